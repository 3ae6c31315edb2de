"""The GPU suite (`bash benchmarks/gpu/run.sh`) on CPU: its dry run (llama-tiny, a few steps) runs every kind of
cell (hfdist's runs with and without --fp8, the plain Trainer and TRL baselines, a longer sequence) in two parts,
the second resuming where the first stopped, and writes the report; the GPU suites' cells fit a lent machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import REPO, run_cmd

sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))

from cells import ATTENTION_BACKENDS, DRY_RUN, GPU, suite_cells  # noqa: E402
from suite import PART_BUDGET_S, parts  # noqa: E402

RUN_SH = ["bash", str(REPO / "benchmarks" / "gpu" / "run.sh")]
THIS_PYTHON = {"PYTHON": sys.executable}  # run.sh's interpreter: the one running the tests


@pytest.mark.parametrize("gpus", [1, 8])
def test_the_gpu_suites_fit_a_lent_machine(gpus):
    """Parts of under 9 minutes (their estimates), 30 minutes in all, with what the suite is for."""
    cells = suite_cells(GPU, gpus, dry_run=False, attention=True, long_needs_checkpointing=False, big_fits=True)
    names = [c.name for c in cells]
    assert len(names) == len(set(names))
    assert all(sum(c.estimate_s for c in part) <= PART_BUDGET_S for part in parts(cells) if len(part) > 1)
    assert sum(c.estimate_s for c in cells) <= 30 * 60
    for wanted in ("full-2048", "full-2048-fp8", "full-2048-compile", "full-2048-fp8-compile", "plain-trainer-2048",
                   "trl-sft-2048"):
        assert wanted in names
    if gpus == 1:
        assert {"lora-2048", "full-8192", "full-8192-compile", "full-2048-fp8-rowwise", "8b-lora-2048"} <= set(names)
        assert {f"full-8192-attn-{a}" for a in ATTENTION_BACKENDS if a != "auto"} <= set(names)
    else:
        assert {"ladder-data-parallel", "ladder-model-parallel", "ladder-fp8", "8b-full-2048-fsdp"} <= set(names)


def _state(out: Path) -> dict:
    return json.loads((out / "gpu_suite_state.json").read_text())


def test_dry_run_runs_in_parts_that_resume(tmp_path):
    out, runs = tmp_path / "results", tmp_path / "runs"
    args = ["--dry-run", "--out", str(out), "--runs", str(runs)]
    listed = run_cmd([*RUN_SH, *args, "--budget-s", "60", "--list"], timeout=120, env=THIS_PYTHON)
    assert listed.returncode == 0 and listed.stdout.startswith("part 1 ("), listed.stderr[-2000:]
    cells = suite_cells(DRY_RUN, 0, dry_run=True, attention=False, long_needs_checkpointing=False, big_fits=False)
    assert len(parts(cells, 60)) == 2

    first = run_cmd([*RUN_SH, *args, "--budget-s", "60"], timeout=600, env=THIS_PYTHON)
    assert first.returncode == 0, first.stderr[-3000:]
    started = _state(out)
    assert 1 <= len(started) < len(cells) and "run it again for the next part" in first.stdout
    assert "not run yet" in (out / "gpu_suite.md").read_text()

    rest = run_cmd([*RUN_SH, *args, "--all"], timeout=900, env=THIS_PYTHON)
    assert rest.returncode == 0, rest.stderr[-3000:]
    done = _state(out)
    assert set(done) == {c.name for c in cells} and all(done[k] == started[k] for k in started)  # resumed
    for cell in cells:
        record = done[cell.name]
        assert record["exit"] == 0, record
        assert record["tokens_per_s_per_device"] > 0 and record["peak_memory_bytes"] > 0
        assert len(record["losses"]) == DRY_RUN.steps
        assert (record["planned"] is not None) == (cell.kind == "hfdist")
    report = (out / "gpu_suite.md").read_text()
    assert "not run yet" not in report and "| full-64-fp8 |" in report and "| trl-sft-64 |" in report
    commands = (out / "gpu_suite_commands.sh").read_text().splitlines()[1:]
    assert len(commands) == len(cells) and all(c.startswith("python ") for c in commands)
    assert not list(runs.rglob("*.safetensors")) or all("assets-" in str(p) for p in runs.rglob("*.safetensors"))
