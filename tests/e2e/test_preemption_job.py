"""Preemption end to end: SIGTERM on one rank (or on the launcher, which forwards it to every rank) mid-run makes the
job write a checkpoint of the step in progress, exit with the documented code (75) and leave nothing half-written;
`--resume` then finishes with the uninterrupted run's losses.

fsdp_full_shard on 4 processes is preempted twice in one output folder: once while its background write of
checkpoint-2 is in flight (rank 1 signals itself from inside that write and holds it until the ranks have agreed to
stop, so the save of step 3 must first wait for it), once between checkpoints (rank 2 at step 5); the third launch
finishes it, against an uninterrupted 4-process run. zero3 (DeepSpeed's own checkpoints) is preempted by a SIGTERM to
its launcher, which forwards it to every rank; pp by one rank; each resumes against the session's shared run of its
rung (helpers.SHARED_RUNS, the same arguments). The signals come from the ranks themselves at a given step
(HFDIST_TEST_PREEMPT_AT, hfdist.train.preemption), so no test times a kill.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from pathlib import Path

import pytest

from helpers import FINETUNE, REPO, SHARED_SAVE_STEPS, TINY_ARGS, eval_args, run_cmd, side_by_side, tensorboard_series

pytestmark = pytest.mark.multiproc

EXIT_PREEMPTED = 75  # docs/clusters.md; hfdist.config.preemption.PREEMPTED_EXIT_CODE
RTOL = 1e-6  # same layout and ranks as the uninterrupted run: resumed steps are bit-identical in practice (measured 0)
# Background writes asked for explicitly (the in-flight case needs one, whatever the default on CPU).
FOUR = ("--config", "fsdp_full_shard", "--num-processes", "4", "--max-steps", "6", "--save-steps", "2", "--save-async")
PREEMPT_ENV = "HFDIST_TEST_PREEMPT_AT"
WRITE_ENV = "HFDIST_TEST_SIGNAL_IN_WRITE_OF"
# Imported by every process of a run that sets WRITE_ENV (PYTHONPATH): rank 1, inside its background write of the
# staging folder WRITE_ENV names, sends itself SIGTERM and holds the write until its ranks have agreed to stop.
WRITE_HOOK = f"""
import os

if os.environ.get("{WRITE_ENV}"):
    import signal
    import threading

    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    _write_data = _FileSystemWriter.write_data
    _agreed = threading.Event()

    def _signalling_write_data(self, plan, planner):
        if os.environ.get("RANK") == "1" and os.environ["{WRITE_ENV}"] in str(self.path):
            from hfdist.train.preemption import PreemptionWatch

            agree = PreemptionWatch.agree

            def noting(watch):
                agreed = agree(watch)
                if agreed is not None:
                    _agreed.set()
                return agreed

            PreemptionWatch.agree = noting
            os.kill(os.getpid(), signal.SIGTERM)
            assert _agreed.wait(600), "the ranks never agreed to stop"
        return _write_data(self, plan, planner)

    _FileSystemWriter.write_data = _signalling_write_data
"""


def _launch(out: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    """`python scripts/finetune.py` (hfdist hands over to accelerate) into `out`: its exit code, output, summary and
    what the output folder holds afterwards (entries, and each checkpoint's marker)."""
    cmd = [sys.executable, str(FINETUNE), *TINY_ARGS, *args, "--output-dir", str(out)]
    proc = run_cmd(cmd, env=env, timeout=900)
    summary_file = out / "hfdist_summary.json"
    return {"code": proc.returncode, "log": proc.stdout + proc.stderr,
            "summary": json.loads(summary_file.read_text()) if summary_file.is_file() else None,
            "entries": sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) if out.is_dir() else [],
            "markers": {p.name: json.loads((p / "hfdist_checkpoint.json").read_text())
                        for p in out.glob("checkpoint-*") if (p / "hfdist_checkpoint.json").is_file()}}


def _chain(*launches) -> list[dict]:
    """Launch one after the other (each continues the previous one's output folder)."""
    return [launch() for launch in launches]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_runs):
    root = tmp_path_factory.mktemp("preemption")
    hooks = root / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(WRITE_HOOK)
    shared_runs.launch(["zero3", "pp"])
    evals = eval_args(shared_runs.root)  # the shared runs' arguments, so their losses are these runs' reference
    fsdp, shared = root / "fsdp", (*SHARED_SAVE_STEPS, *evals, "--no-wandb")
    in_write = {WRITE_ENV: ".partial-checkpoint-2",
                "PYTHONPATH": os.pathsep.join([str(hooks), str(REPO), os.environ.get("PYTHONPATH", "")])}
    chains = {
        "uninterrupted": partial(_launch, root / "uninterrupted", *FOUR, "--no-wandb"),
        # In flight: checkpoint-2's background write (rank 1); between checkpoints: rank 2 at step 5; then to the end.
        "fsdp": partial(_chain,
                        partial(_launch, fsdp, *FOUR, "--report-to", "tensorboard", env=in_write),
                        partial(_launch, fsdp, *FOUR, "--no-wandb", "--resume",
                                env={PREEMPT_ENV: "2:5", "HFDIST_PREEMPT_GRACE": "0.001"}),
                        partial(_launch, fsdp, *FOUR, "--no-wandb", "--resume")),
        "zero3": partial(_chain,
                         partial(_launch, root / "zero3", "--config", "zero3", *shared,
                                 env={PREEMPT_ENV: "0:3:SIGTERM:launcher"}),
                         partial(_launch, root / "zero3", "--config", "zero3", *shared, "--resume")),
        "pp": partial(_chain,
                      partial(_launch, root / "pp", "--config", "pp", *shared, env={PREEMPT_ENV: "1:3"}),
                      partial(_launch, root / "pp", "--config", "pp", *shared, "--resume")),
    }
    return {**side_by_side(chains), "zero3_reference": shared_runs["zero3"], "pp_reference": shared_runs["pp"]}


def _assert_preempted(run: dict, step: int, checkpoints: list[str]) -> None:
    """Exit 75 with checkpoint-`step` written, complete, beside the others in `checkpoints`; nothing half-written (no
    staging folder, no model, a whole summary recording the preemption)."""
    assert run["code"] == EXIT_PREEMPTED, run["log"][-6000:]
    assert run["entries"] == checkpoints, run["entries"]  # no .partial-checkpoint-N: every save landed
    assert set(run["markers"]) == set(checkpoints)
    preempted = run["summary"]["preempted"]
    assert preempted["step"] == step and preempted["signal"] == "SIGTERM"
    assert preempted["checkpoint"].endswith(f"checkpoint-{step}") and preempted["save_seconds"] > 0
    assert run["summary"]["check_batch_loss"] is None and run["summary"]["loss_steps"][-1] == step
    assert f"preempted at step {step} (SIGTERM on " in run["log"] and "exit code 75" in run["log"]


def test_signal_during_a_background_write_checkpoints_the_next_step(runs):
    """Rank 1 got SIGTERM inside its background write of checkpoint-2: the ranks agreed at the end of step 3, that
    write landed first (complete, written in the background), then checkpoint-3 was written at once."""
    first = runs["fsdp"][0]
    _assert_preempted(first, 3, ["checkpoint-2", "checkpoint-3"])
    assert first["markers"]["checkpoint-2"]["async_save"] is True
    assert first["markers"]["checkpoint-3"]["async_save"] is False
    assert first["summary"]["preempted"]["rank"] == 1 and first["summary"]["strategy"]["world_size"] == 4
    assert [r["rank"] for r in first["summary"]["ranks"] if "preempt_signal" in r] == [1]
    # The trackers record it too: TensorBoard's scalars of the run.
    assert tensorboard_series(first["summary"]["config"]["output_dir"] + "/tensorboard")["preempted_at_step"][-1][1] == 3


def test_signal_between_checkpoints_checkpoints_that_step(runs):
    """Rank 2 got SIGTERM as step 5 began (checkpoint-4 written, checkpoint-6 not yet): checkpoint-5, exit 75; the
    grace printed at the start (from checkpoint-3's recorded write time) warns that 0.001 s cannot hold it."""
    second = runs["fsdp"][1]
    _assert_preempted(second, 5, ["checkpoint-4", "checkpoint-5"])
    assert second["summary"]["preempted"]["rank"] == 2
    assert second["summary"]["resumed_from"].endswith("checkpoint-3")
    assert "checkpoint-3 took" in second["log"] and "HFDIST_PREEMPT_GRACE" in second["log"]
    assert "hfdist: warning: a preempted run would be killed" in second["log"]


def test_preempted_fsdp_run_resumes_to_the_uninterrupted_losses(runs):
    last, reference = runs["fsdp"][2], runs["uninterrupted"]
    assert last["code"] == 0 and reference["code"] == 0, last["log"][-6000:] + reference["log"][-3000:]
    # The grace a preemption needs, printed once the first checkpoint landed (step 3 of the uninterrupted run).
    assert "hfdist: preemption needs" in reference["log"] and "checkpoint-2 took" in reference["log"]
    assert last["summary"]["preempted"] is None and last["summary"]["resumed_from"].endswith("checkpoint-5")
    assert last["summary"]["loss_steps"] == reference["summary"]["loss_steps"] == [1, 2, 3, 4, 5, 6]
    assert last["summary"]["losses"] == pytest.approx(reference["summary"]["losses"], rel=RTOL)
    assert last["summary"]["check_batch_loss"] == pytest.approx(reference["summary"]["check_batch_loss"], rel=RTOL)


def test_zero3_preempted_through_its_launcher(runs):
    """SIGTERM to the launcher: the process that handed over, which runs accelerate's agent (as Kubernetes signals a
    container's first process), twice (as under Slurm, which signals every process of a job); the agent forwards it
    to every rank; DeepSpeed writes its own checkpoint-3; the launcher exits 75."""
    first, resumed = runs["zero3"]
    _assert_preempted(first, 3, ["checkpoint-2", "checkpoint-3"])
    assert first["markers"]["checkpoint-3"]["format"] == "deepspeed"
    assert sorted(r["rank"] for r in first["summary"]["ranks"] if r.get("preempt_signal") == "SIGTERM") == [0, 1]
    assert resumed["code"] == 0, resumed["log"][-6000:]
    assert resumed["summary"]["loss_steps"] == [1, 2, 3, 4]
    assert resumed["summary"]["losses"] == pytest.approx(runs["zero3_reference"]["losses"], rel=RTOL)


def test_pp_preempted_on_one_rank(runs):
    first, resumed = runs["pp"]
    _assert_preempted(first, 3, ["checkpoint-2", "checkpoint-3"])
    assert [r["rank"] for r in first["summary"]["ranks"] if "preempt_signal" in r] == [1]
    assert resumed["code"] == 0, resumed["log"][-6000:]
    assert resumed["summary"]["loss_steps"] == [1, 2, 3, 4]
    assert resumed["summary"]["losses"] == pytest.approx(runs["pp_reference"]["losses"], rel=RTOL)
