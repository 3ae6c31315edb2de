"""End-to-end: `--compile` (torch.compile per decoder layer, inductor on CPU) trains what eager trains, on the rungs
that take it, with every layer checked compiled; a rung that does not take it is refused before launch.

One compiled run per rung the rung table tests with compile (ddp, fsdp_full_shard, fsdp_tp) on llama-tiny,
compared with the single-process eager run every strategy is compared with (each rung's eager losses equal it at rel
1e-5: tests/e2e/test_finetune_ladder.py). Compiling on 2 CPU cores costs about a minute per run; the steps
themselves are tiny.
"""

from __future__ import annotations

import sys

import pytest

from helpers import FINETUNE, finetune_all, run_cmd, table_rungs

pytestmark = pytest.mark.multiproc

COMPILE_RTOL = 1e-4
RUNGS = table_rungs(option="compile")  # the rung table's tested_with: ddp, fsdp_full_shard, fsdp_tp


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("compile")
    return finetune_all({name: (root / name, ("--config", name, "--compile", "--no-wandb"), {})
                         for name in RUNGS})


@pytest.mark.parametrize("name", RUNGS)
def test_compiled_losses_match_eager(references, compiled, name):
    eager, got = references["single"], compiled[name]
    assert len(got["losses"]) == len(eager["losses"]) == 4
    assert got["losses"] == pytest.approx(eager["losses"], rel=COMPILE_RTOL)
    assert got["check_batch_loss"] == pytest.approx(eager["check_batch_loss"], rel=COMPILE_RTOL)
    assert got["losses"][-1] < got["losses"][0]


@pytest.mark.parametrize("name", RUNGS)
def test_every_rank_ran_compiled_layers(compiled, name):
    summary = compiled[name]
    assert summary["strategy"]["compile"] is True
    records = [r["compile"] for r in summary["ranks"]]
    assert len(records) == summary["strategy"]["world_size"]
    for record in records:
        assert record["decoder_layers"] == record["compiled_layers"] == 4, records
        assert record["graphs"] >= 1, records  # dynamo really built graphs in this process


def test_compile_on_a_pipeline_rung_is_refused_before_launch(tmp_path):
    out = tmp_path / "o"
    proc = run_cmd([sys.executable, str(FINETUNE), "--config", "pp", "--compile", "--output-dir", str(out)],
                   timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--compile does not run on pp" in proc.stderr and "Drop --compile" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
