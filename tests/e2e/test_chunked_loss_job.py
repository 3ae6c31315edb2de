"""End-to-end: the job's loss in sequence chunks (--loss-chunk-size 16 of 64 positions) through scripts/finetune.py
gives the single-process run's losses (whose 64 positions fit one default chunk: unchunked), on one process, on a
DeepSpeed rung (the Trainer's loss through DeepSpeed's engine) and on the pipeline rung (the last stage's loss)."""

from __future__ import annotations

import pytest

from helpers import finetune

pytestmark = pytest.mark.multiproc

LOSS_RTOL = 1e-5  # as tests/e2e/test_finetune_ladder.py: the reduction order differs across ranks
CHUNKED = ["--loss-chunk-size", "16"]


@pytest.fixture(scope="module")
def chunked_runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("chunked")
    return {"single": finetune(root / "single", *CHUNKED, via="python"),
            "zero2": finetune(root / "zero2", "--config", "zero2", *CHUNKED),
            "pp": finetune(root / "pp", "--config", "pp", *CHUNKED)}


@pytest.mark.parametrize("name", ["single", "zero2", "pp"])
def test_chunked_job_losses_equal_unchunked_single_process(chunked_runs, references, name):
    got, ref = chunked_runs[name]["losses"], references["single"]["losses"]
    assert len(got) == len(ref) == 4
    assert got == pytest.approx(ref, rel=LOSS_RTOL if name != "single" else 1e-6), f"{name}: {got} vs {ref}"
