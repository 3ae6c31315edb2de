"""The GPU suite (`bash benchmarks/gpu/run.sh`) on CPU: its dry run (llama-tiny, a few steps) runs every kind of
cell (hfdist's runs with and without --fp8, the plain Trainer and TRL baselines, a longer sequence) in parts, the
later ones resuming where the first stopped, and writes the report; the GPU suites' cells fit a lent machine, the
headline figures in its first 8 minutes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import REPO, run_cmd

sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))

from cells import ATTENTION_BACKENDS, DRY_RUN, FIRST_PART_S, GPU, suite_cells  # noqa: E402
from suite import PART_BUDGET_S, parts  # noqa: E402

RUN_SH = ["bash", str(REPO / "benchmarks" / "gpu" / "run.sh")]
THIS_PYTHON = {"PYTHON": sys.executable}  # run.sh's interpreter: the one running the tests


@pytest.mark.parametrize("gpus", [1, 8])
def test_the_gpu_suites_fit_a_lent_machine(gpus):
    """Parts of under 9 minutes (their estimates), 30 minutes in all, with what the suite is for; part 1 at most 8
    minutes, and it holds the headline figures: bf16 tokens/s and MFU against the plan, a plain Trainer, the packed
    long rows by the default attention and by sdpa, --compile, --fp8 and LoRA."""
    cells = suite_cells(GPU, gpus, dry_run=False, attention=True, long_needs_checkpointing=False, big_fits=True)
    names = [c.name for c in cells]
    assert len(names) == len(set(names))
    planned = parts(cells)
    assert all(sum(c.estimate_s for c in part) <= PART_BUDGET_S for part in planned if len(part) > 1)
    assert sum(c.estimate_s for c in planned[0]) <= FIRST_PART_S
    assert [c.name for c in planned[0]] == ["full-2048", "plain-trainer-2048", "full-8192", "full-8192-attn-sdpa",
                                            "full-2048-compile", "full-2048-fp8", "lora-2048"]
    assert sum(c.estimate_s for c in cells) <= 30 * 60
    for wanted in ("full-2048", "full-2048-fp8", "full-2048-compile", "plain-trainer-2048", "trl-sft-2048",
                   "kernels", "full-2048-eval-prompts"):
        assert wanted in names
    if gpus == 1:
        assert {"lora-2048", "full-8192", "full-8192-compile", "full-2048-fp8-rowwise", "full-2048-fp8-compile",
                "8b-lora-2048"} <= set(names)
        assert [c.name for c in planned[1]][:2] == ["kernels", "full-2048-eval-prompts"]  # this round's work next
        assert {f"full-8192-attn-{a}" for a in ATTENTION_BACKENDS if a != "auto"} <= set(names)
    else:
        assert {"ladder-data-parallel", "ladder-model-parallel", "ladder-fp8", "8b-full-2048-fsdp"} <= set(names)


def test_list_shows_what_one_gpu_would_run_on_a_machine_without_one():
    """`--list --gpus 1` on this CPU machine: the parts one GPU would run, part 1 first with its estimate."""
    listed = run_cmd([*RUN_SH, "--list", "--gpus", "1"], timeout=120, env=THIS_PYTHON)
    assert listed.returncode == 0, listed.stderr[-2000:]
    first = listed.stdout.splitlines()[0]
    seconds = int(first.split("(~", 1)[1].split(" s", 1)[0])
    assert first.startswith("part 1 (~") and seconds <= FIRST_PART_S and "full-2048," in first, first


def _state(out: Path) -> dict:
    return json.loads((out / "gpu_suite_state.json").read_text())


def test_dry_run_runs_in_parts_that_resume(tmp_path):
    out, runs = tmp_path / "results", tmp_path / "runs"
    args = ["--dry-run", "--out", str(out), "--runs", str(runs)]
    listed = run_cmd([*RUN_SH, *args, "--budget-s", "60", "--list"], timeout=120, env=THIS_PYTHON)
    assert listed.returncode == 0 and listed.stdout.startswith("part 1 ("), listed.stderr[-2000:]
    cells = suite_cells(DRY_RUN, 0, dry_run=True, attention=False, long_needs_checkpointing=False, big_fits=False)
    assert len(parts(cells, 60, None)) >= 2  # the first run leaves cells for the next

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
        if cell.kind == "kernels":  # benchmarks/gpu/kernels.py's CPU stand-in: timed, every figure there
            attention, moe = record["kernels"]["attention"], record["kernels"]["moe"]
            assert all(attention[m]["blocks_s"] > 0 and attention[m]["flash_s"] > 0 for m in ("ring", "hybrid"))
            assert moe["grouped_s"] > 0 and moe["loop_s"] > 0 and record["planned"] is None
            continue
        assert record["tokens_per_s_per_device"] > 0 and record["peak_memory_bytes"] > 0
        assert len(record["losses"]) == DRY_RUN.steps
        assert (record["planned"] is not None) == (cell.kind == "hfdist")
    report = (out / "gpu_suite.md").read_text()
    assert "not run yet" not in report and "| full-64-fp8 |" in report and "| trl-sft-64 |" in report
    assert "| kernels | ring blocks " in report
    commands = (out / "gpu_suite_commands.sh").read_text().splitlines()[1:]
    assert len(commands) == len(cells) and all(c.startswith("python ") for c in commands)
    assert not list(runs.rglob("*.safetensors")) or all("assets-" in str(p) for p in runs.rglob("*.safetensors"))
