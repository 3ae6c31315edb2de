"""Resuming on another strategy and world size (DCP resharding), through scripts/finetune.py.

Each case trains llama-tiny-odd (5 layers: pipeline stages of unequal size; 4 heads over 2 kv heads: GQA) for 5
steps with a checkpoint at step 3 on one layout (the uninterrupted run), copies checkpoint-3 into a fresh folder
and resumes it on another layout: steps 4-5 must give the uninterrupted run's losses (every layout computes the
same math, so resharded states must continue it exactly), and the step record must stay continuous. Bad input for a
resume (another global batch, lost shard files) is refused before any process starts.
"""

from __future__ import annotations

import shutil
import sys

import pytest

from helpers import FINETUNE, TINY_ARGS, finetune, run_cmd

pytestmark = pytest.mark.multiproc

ODD = ["--model", "llama-tiny-odd", "--max-steps", "5", "--save-steps", "3", "--no-wandb"]
RTOL = 1e-5
# name -> (source config args, resumed config args): what wrote the checkpoint, what resumes it.
CASES = {
    "fsdp_hybrid4_to_fsdp_full_shard2": (["--config", "fsdp_hybrid"], ["--config", "fsdp_full_shard"]),
    "fsdp_full_shard2_to_fsdp_tp4": (["--config", "fsdp_full_shard"], ["--config", "fsdp_tp"]),
    "pp2_to_fsdp_full_shard2": (["--config", "pp"], ["--config", "fsdp_full_shard"]),
    "ddp_to_fsdp_full_shard": (["--config", "ddp"], ["--config", "fsdp_full_shard"]),
    "lora_fsdp2_to_fsdp4": (["--config", "fsdp_full_shard", "--lora"],
                            ["--config", "fsdp_full_shard", "--num-processes", "4", "--lora"]),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{source args as a tuple: (summary, folder)}: each uninterrupted run once."""
    root = tmp_path_factory.mktemp("reshard")
    out = {}
    for i, (source, _) in enumerate(CASES.values()):
        if tuple(source) not in out:
            folder = root / f"source{i}"
            out[tuple(source)] = (finetune(folder, *ODD, *source), folder)
    return out


@pytest.mark.parametrize("case", CASES)
def test_resumed_on_another_layout_continues_the_uninterrupted_run(sources, case, tmp_path):
    source, target = CASES[case]
    first, folder = sources[tuple(source)]
    shutil.copytree(folder / "checkpoint-3", tmp_path / "checkpoint-3")
    second = finetune(tmp_path, *ODD, *target, "--resume")
    assert second["resumed_from"] == str(tmp_path / "checkpoint-3")
    assert second["loss_steps"] == first["loss_steps"] == [1, 2, 3, 4, 5]
    assert second["losses"][3:] == pytest.approx(first["losses"][3:], rel=RTOL)
    assert second["losses"][:3] == first["losses"][:3]  # the record before the resume is the checkpoint's
    line = next(ln for ln in second["_stdout"].splitlines() if ln.startswith("hfdist: resuming from"))
    was, now = first["strategy"], second["strategy"]
    assert f"resharding {was['name']} on {was['world_size']} ranks" in line
    assert f"-> {now['name']} on {now['world_size']} ranks" in line and "RNG:" in line
    assert (was["world_size"], was["name"]) != (now["world_size"], now["name"])


def test_per_rank_step_and_data_wait_times_and_the_slowest_rank(sources):
    """Every rank's mean step time and data wait are in the summary; the closing table names the slowest rank."""
    summary, _ = sources[("--config", "fsdp_hybrid")]
    ranks = summary["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(r["step_seconds"] > 0 and 0 <= r["data_wait_seconds"] < r["step_seconds"] for r in ranks)
    assert "% below the fastest (rank " in summary["_stdout"] and "hfdist: per-rank figures" in summary["_stdout"]


def _preflight(out, *extra):
    """A resume that preflight refuses: `python scripts/finetune.py` (no process group is ever formed)."""
    return run_cmd([sys.executable, str(FINETUNE), *TINY_ARGS, *ODD, "--output-dir", str(out), "--resume", *extra],
                   timeout=300)


def test_resume_with_another_global_batch_is_refused_naming_both(sources, tmp_path):
    _, folder = sources[("--config", "ddp")]
    shutil.copytree(folder / "checkpoint-3", tmp_path / "checkpoint-3")
    proc = _preflight(tmp_path, "--config", "fsdp_full_shard", "--global-batch-size", "16")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "global_batch_size: checkpoint 8, this run 16" in proc.stderr and "--global-batch-size 8" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]


def test_checkpoint_missing_a_ranks_shards_is_refused_naming_the_files(sources, tmp_path):
    _, folder = sources[("--config", "fsdp_hybrid")]
    shutil.copytree(folder / "checkpoint-3", tmp_path / "checkpoint-3")
    shards = sorted((tmp_path / "checkpoint-3" / "sharded").glob("*.distcp"))
    assert len(shards) == 4
    for lost in shards[2:]:
        lost.unlink()
    proc = _preflight(tmp_path, "--config", "fsdp_full_shard")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{shards[2].name} (missing), {shards[3].name} (missing)" in proc.stderr
    assert shards[0].name not in proc.stderr


def test_checkpoint_identity_says_what_it_holds(sources):
    import json

    for (summary, folder) in sources.values():
        record = json.loads((folder / "checkpoint-3" / "hfdist_checkpoint.json").read_text())
        assert record["format"] == "dcp" and "keyed by the full model's parameter names" in record["holds"]
        assert record["world_size"] == summary["strategy"]["world_size"] and record["step"] == 3
