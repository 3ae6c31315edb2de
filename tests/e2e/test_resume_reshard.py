"""Resuming on another strategy and world size (DCP resharding), through scripts/finetune.py.

Each case copies the checkpoint-2 of a 4-step run on one layout (the uninterrupted run) into a fresh folder and
resumes it on another layout: steps 3-4 must give the uninterrupted run's losses (every layout computes the same
math, so resharded states must continue it exactly), and the step record must stay continuous. The uninterrupted
runs are the session's shared llama-tiny runs (helpers.SHARED_RUNS: checkpoints at steps 2 and 4), except the
pipeline's, which trains llama-tiny-odd (5 layers: pipeline stages of unequal size; 4 heads over 2 kv heads: GQA,
as llama-tiny). Bad input for a resume (another global batch, lost shard files) is refused before any process starts.
"""

from __future__ import annotations

import shutil
import sys
from functools import partial
from pathlib import Path

import pytest

from helpers import FINETUNE, SHARED_SAVE_STEPS, TINY_ARGS, finetune, run_cmd, side_by_side

pytestmark = pytest.mark.multiproc

ODD = ["--model", "llama-tiny-odd"]
PP_ODD = "pp_odd"  # the one source trained here
RTOL = 1e-5
# name -> (source: a SHARED_RUNS name or PP_ODD, resumed run's args): what wrote the checkpoint, what resumes it.
CASES = {
    "fsdp_hybrid4_to_fsdp_full_shard2": ("fsdp_hybrid", ["--config", "fsdp_full_shard"]),
    "fsdp_full_shard2_to_fsdp_tp4": ("fsdp_full_shard", ["--config", "fsdp_tp"]),
    "pp2_to_fsdp_full_shard2": (PP_ODD, [*ODD, "--config", "fsdp_full_shard"]),
    "ddp_to_fsdp_full_shard": ("ddp", ["--config", "fsdp_full_shard"]),
    "lora_fsdp2_to_fsdp4": ("lora_fsdp_full_shard", ["--config", "fsdp_full_shard", "--num-processes", "4", "--lora"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_runs) -> tuple[dict, dict]:
    """Every uninterrupted run once and every case's resume: the shared sources (launched by the first module that
    asks for them), then the resumes side by side, PP_ODD's a chain beside the others (its own run, then its resume)."""
    folder, root = tmp_path_factory.mktemp("reshard") / PP_ODD, tmp_path_factory.mktemp("resharded")
    shared = [source for source, _ in CASES.values() if source != PP_ODD]
    shared_runs.launch(shared)
    sources = {source: (shared_runs[source], shared_runs[source]["_dir"]) for source in shared}

    def resume(case: str) -> dict:
        source, target = CASES[case]
        shutil.copytree(sources[source][1] / "checkpoint-2", root / case / "checkpoint-2")
        return finetune(root / case, *target, *SHARED_SAVE_STEPS, "--no-wandb", "--resume")

    def pp_odd_then_resumed(case: str) -> dict:
        sources[PP_ODD] = (finetune(folder, *ODD, "--config", "pp", *SHARED_SAVE_STEPS, "--no-wandb"), folder)
        return resume(case)

    # The chain first: the longest, it starts at once.
    calls = {case: partial(pp_odd_then_resumed, case) for case, (source, _) in CASES.items() if source == PP_ODD}
    calls.update({case: partial(resume, case) for case, (source, _) in CASES.items() if source != PP_ODD})
    resumed = {case: (summary, root / case) for case, summary in side_by_side(calls).items()}
    return sources, resumed


@pytest.fixture(scope="module")
def sources(runs) -> dict[str, tuple[dict, Path]]:
    """{source name: (summary, folder)}: each uninterrupted run once."""
    return runs[0]


@pytest.fixture(scope="module")
def resumed(runs) -> dict[str, tuple[dict, Path]]:
    """{case: (resumed summary, its folder)}: each case's source checkpoint-2 resumed on the case's layout."""
    return runs[1]


@pytest.mark.parametrize("case", CASES)
def test_resumed_on_another_layout_continues_the_uninterrupted_run(sources, resumed, case):
    source, _ = CASES[case]
    first, _ = sources[source]
    second, folder = resumed[case]
    assert second["resumed_from"] == str(folder / "checkpoint-2")
    assert second["loss_steps"] == first["loss_steps"] == [1, 2, 3, 4]
    assert second["losses"][2:] == pytest.approx(first["losses"][2:], rel=RTOL)
    assert second["losses"][:2] == first["losses"][:2]  # the record before the resume is the checkpoint's
    line = next(ln for ln in second["_stdout"].splitlines() if ln.startswith("hfdist: resuming from"))
    was, now = first["strategy"], second["strategy"]
    assert f"resharding {was['name']} on {was['world_size']} ranks" in line
    assert f"-> {now['name']} on {now['world_size']} ranks" in line and "RNG:" in line
    assert (was["world_size"], was["name"]) != (now["world_size"], now["name"])


def test_per_rank_step_and_data_wait_times_and_the_slowest_rank(sources):
    """Every rank's mean step time and data wait are in the summary; the closing table names the slowest rank."""
    summary, _ = sources["fsdp_hybrid"]
    ranks = summary["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(r["step_seconds"] > 0 and 0 <= r["data_wait_seconds"] < r["step_seconds"] for r in ranks)
    assert "% below the fastest (rank " in summary["_stdout"] and "hfdist: per-rank figures" in summary["_stdout"]


def _preflight(out, *extra):
    """A resume that preflight refuses: `python scripts/finetune.py` (no process group is ever formed)."""
    return run_cmd([sys.executable, str(FINETUNE), *TINY_ARGS, *SHARED_SAVE_STEPS, "--no-wandb", "--output-dir",
                    str(out), "--resume", *extra], timeout=300)


def test_resume_with_another_global_batch_is_refused_naming_both(sources, tmp_path):
    _, folder = sources["ddp"]
    shutil.copytree(folder / "checkpoint-2", tmp_path / "checkpoint-2")
    proc = _preflight(tmp_path, "--config", "fsdp_full_shard", "--global-batch-size", "16")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "global_batch_size: checkpoint 8, this run 16" in proc.stderr and "--global-batch-size 8" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def test_checkpoint_missing_a_ranks_shards_is_refused_naming_the_files(sources, tmp_path):
    _, folder = sources["fsdp_hybrid"]
    shutil.copytree(folder / "checkpoint-2", tmp_path / "checkpoint-2")
    shards = sorted((tmp_path / "checkpoint-2" / "sharded").glob("*.distcp"))
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
        record = json.loads((folder / "checkpoint-2" / "hfdist_checkpoint.json").read_text())
        assert record["format"] == "dcp" and "keyed by the full model's parameter names" in record["holds"]
        assert record["world_size"] == summary["strategy"]["world_size"] and record["step"] == 2
