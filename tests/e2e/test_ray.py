"""`hfdist finetune --launcher ray` on a local Ray cluster the launch starts (Ray Train's TorchTrainer, 2 CPU workers):
the rung's mesh is built on the process group Ray made, a worker killed mid-run is restarted by Ray from the latest
checkpoint, and the run ends with the losses of the same rung launched by accelerate / torchrun (the session's
shared fsdp_full_shard run). The kill comes from the worker itself at a given step, once (HFDIST_TEST_PREEMPT_AT
with `fresh`: not again in the restarted group), so nothing is timed."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile

import pytest

from helpers import SHARED_SAVE_STEPS, TINY_ARGS, run_cmd

pytestmark = pytest.mark.multiproc

RTOL = 1e-6  # the same rung, ranks and reduction order as the shared run: bit-identical in practice (measured 0)


@pytest.fixture
def ray_tmp():
    """A short temporary folder of Ray's own (its sockets' paths must stay under 108 characters), removed after."""
    folder = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_killed_worker_is_restarted_by_ray_and_the_run_ends_with_the_torchrun_losses(tmp_path, ray_tmp, shared_runs):
    reference = shared_runs["fsdp_full_shard"]
    out = tmp_path / "ray"
    cmd = [sys.executable, "-m", "hfdist.cli", "finetune", "--launcher", "ray", "--config", "fsdp_full_shard",
           *TINY_ARGS, *SHARED_SAVE_STEPS, "--no-save-async", "--max-failures", "1", "--no-wandb",
           "--output-dir", str(out)]
    # Rank 1 kills itself (SIGKILL: no handler runs, as when a node is lost) as step 3 begins, in the first group only.
    proc = run_cmd(cmd, env={"RAY_TMPDIR": ray_tmp, "HFDIST_TEST_PREEMPT_AT": "1:3:SIGKILL:fresh"}, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    summary = json.loads((out / "hfdist_summary.json").read_text())
    assert "hfdist: Ray Train starts 2 workers for fsdp_full_shard (dp_shard=2, on CPU)" in proc.stdout
    assert summary["strategy"]["world_size"] == 2 and summary["strategy"]["dp_shard"] == 2
    # No --resume was given: only a group Ray restarted resumes, from the checkpoint the killed group wrote.
    assert summary["resumed_from"] == str(out / "checkpoint-2")
    assert summary["loss_steps"] == reference["loss_steps"] == [1, 2, 3, 4]
    assert summary["losses"] == pytest.approx(reference["losses"], rel=RTOL)
    assert summary["check_batch_loss"] == pytest.approx(reference["check_batch_loss"], rel=RTOL)
    assert (out / "model.safetensors").is_file() and (out / "logs" / "ray.log").is_file()
