"""Checkpoint and resume through scripts/finetune.py: a run stopped after step 2 and resumed equals the
uninterrupted run; checkpoints are atomic and self-describing; damaged or foreign ones are refused clearly.

Each rung trains llama-tiny for 4 steps with a checkpoint every 2 (the uninterrupted run: the session's shared run of
that rung, helpers.SHARED_RUNS, whose losses and saved model tests/e2e/test_finetune_ladder.py and
test_finetune_pipeline.py check). Its checkpoint-2 is copied into a fresh output folder and `--resume` continues from
it: the resumed run's step-3/4 losses must equal the uninterrupted run's (same optimizer moments, LR schedule
position, RNG and data position), and the final models must score the same. The shared runs write their DCP
checkpoints in the background (--save-async, asked for: a CPU run saves synchronously by default; their markers and
their summaries' checkpoint costs say so), so these are resumes from asynchronous checkpoints.

fsdp_full_shard resumes instead from a run of its own whose rank 1 was killed while writing checkpoint-4 in the
background (held there, and only there, by a sitecustomize hook; rank 0 had written its shard): what the kill
left (checkpoint-2 complete, checkpoint-4 a staging folder without marker) is what that resume starts from.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from helpers import FINETUNE, REPO, SHARED_SAVE_STEPS, TINY_ARGS, finetune, pid_of_rank, run_cmd, run_tree, side_by_side

pytestmark = pytest.mark.multiproc

RUNGS = ["ddp", "fsdp_full_shard", "zero3", "fsdp_tp", "pp", "lora_fsdp_full_shard"]
RTOL = 1e-6  # same ranks, same reduction order: resumed steps are bit-identical in practice


KILLED_RUNG = "fsdp_full_shard"  # resumed from a run killed mid-write instead of a copy of the shared checkpoint
HOLD_ENV = "HFDIST_TEST_HOLD_WRITE_OF"
# Imported by every process of the killed run (PYTHONPATH): a rank other than 0 stops inside its background write of
# the staging folder named by HOLD_ENV, after DCP's plan and before its shard file, until it is killed.
HOLD_HOOK = f"""
import os, time
from torch.distributed.checkpoint.filesystem import _FileSystemWriter

_write_data = _FileSystemWriter.write_data


def _held_write_data(self, plan, planner):
    if os.environ.get("RANK", "0") != "0" and os.environ["{HOLD_ENV}"] in str(self.path):
        time.sleep(600)
    return _write_data(self, plan, planner)


if os.environ.get("{HOLD_ENV}"):
    _FileSystemWriter.write_data = _held_write_data
"""


def _killed_mid_write(out: Path, hooks: Path) -> dict:
    """Train KILLED_RUNG like the shared run, SIGKILL rank 1 while rank 0 has written its shard of checkpoint-4 and
    rank 1 is held in its write of it; what the kill left behind (before anything resumes from it)."""
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(HOLD_HOOK)
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           HOLD_ENV: ".partial-checkpoint-4",
           "PYTHONPATH": os.pathsep.join([str(hooks), str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("HFDIST_HANDED_OVER", None)
    cmd = [sys.executable, str(FINETUNE), *TINY_ARGS, "--config", KILLED_RUNG, *SHARED_SAVE_STEPS, "--no-wandb",
           "--output-dir", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rank0_shard = out / ".partial-checkpoint-4" / "sharded" / "__0_0.distcp"
    killed = False
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and not killed:
        if rank0_shard.exists() and (pid := pid_of_rank(1, str(out))) is not None:
            os.kill(pid, signal.SIGKILL)
            killed = True
        time.sleep(0.05)
    if proc.poll() is None and not killed:
        proc.kill()
    log = proc.communicate(timeout=300)[0]
    from hfdist.checkpoint.format import latest_checkpoint

    return {"killed": killed, "returncode": proc.returncode, "log": log, "latest": latest_checkpoint(out),
            "entries": sorted(p.name for p in out.iterdir() if "checkpoint" in p.name),
            "partial": sorted(str(p.relative_to(out / ".partial-checkpoint-4"))
                              for p in (out / ".partial-checkpoint-4").rglob("*") if p.is_file())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_runs):
    """{rung: (uninterrupted summary, resumed summary)} plus their folders; "_killed": what the run killed mid-write
    left behind."""
    root = tmp_path_factory.mktemp("resume")
    shared_runs.launch(RUNGS)
    jobs, killed = {}, {}
    for name in RUNGS:
        full, resumed = shared_runs[name]["_dir"], root / name / "resumed"
        args = ["--config", name.removeprefix("lora_"), *SHARED_SAVE_STEPS] + (["--lora"] if "lora" in name else [])
        if name != KILLED_RUNG:
            resumed.mkdir(parents=True)
            shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
        jobs[name] = (resumed, (*args, "--resume"), {})

    def killed_then_resumed() -> dict:
        """The run killed mid-write (it needs no shared run), then its resume: one chain beside the other resumes."""
        killed.update(_killed_mid_write(jobs[KILLED_RUNG][0], root / "hooks"))
        out, args, _ = jobs[KILLED_RUNG]
        return finetune(out, *args)

    # The chain first: the longest, it starts at once.
    calls = {KILLED_RUNG: killed_then_resumed}
    calls.update({name: partial(finetune, out, *args) for name, (out, args, _) in jobs.items() if name != KILLED_RUNG})
    seconds = side_by_side(calls)
    out = {name: (shared_runs[name], seconds[name], shared_runs[name]["_dir"], jobs[name][0]) for name in RUNGS}
    return {**out, "_killed": killed}


def test_rank_killed_mid_write_leaves_the_previous_checkpoint_the_latest(runs):
    """The kill landed inside the background write of checkpoint-4: the job failed, checkpoint-4 was never renamed
    (a staging folder with rank 0's shard and no marker or DCP metadata), checkpoint-2 is complete and the latest;
    test_resumed_run_equals_uninterrupted_run[fsdp_full_shard] resumed from exactly this and matched the shared run."""
    killed = runs["_killed"]
    assert killed["killed"], f"rank 1 was never killed mid-write:\n{killed['log'][-4000:]}"
    assert killed["returncode"] != 0, killed["log"][-4000:]
    assert killed["entries"] == [".partial-checkpoint-4", "checkpoint-2"]
    assert "sharded/__0_0.distcp" in killed["partial"] and "hfdist_checkpoint.json" not in killed["partial"]
    assert "sharded/.metadata" not in killed["partial"]
    assert killed["latest"].name == "checkpoint-2"


@pytest.mark.parametrize("name", RUNGS)
def test_resumed_run_equals_uninterrupted_run(runs, name):
    first, second, _, resumed = runs[name]
    assert second["resumed_from"] == str(resumed / "checkpoint-2")
    assert second["loss_steps"] == first["loss_steps"] == [1, 2, 3, 4]  # each step once, none skipped
    assert second["losses"] == pytest.approx(first["losses"], rel=RTOL)
    assert second["check_batch_loss"] == pytest.approx(first["check_batch_loss"], rel=RTOL)


@pytest.mark.parametrize("name", RUNGS)
def test_checkpoints_are_complete_and_describe_their_run(runs, name):
    first, _, full, _ = runs[name]
    assert sorted(p.name for p in full.iterdir() if "checkpoint" in p.name) == ["checkpoint-2", "checkpoint-4"]
    marker = json.loads((full / "checkpoint-4" / "hfdist_checkpoint.json").read_text())
    assert marker["step"] == 4 and marker["strategy"] == name.removeprefix("lora_")
    assert marker["lora"] == name.startswith("lora_")
    assert marker["world_size"] == first["strategy"]["world_size"]
    assert marker["async_save"] is (name != "zero3")  # written in the background (DeepSpeed: its own, synchronous)
    # What each checkpoint cost, in the summary: the step loop's wait and the write's own seconds.
    costs = first["checkpoints"]
    assert [c["step"] for c in costs] == [2, 4] and all(c["background"] is (name != "zero3") for c in costs)
    assert all(c["held_s"] > 0 and c["write_s"] > 0 for c in costs)
    ckpt = full / "checkpoint-2"
    world = first["strategy"]["world_size"]
    assert sorted(p.name for p in ckpt.glob("rng_state_*.pth")) == [f"rng_state_{r}.pth" for r in range(world)]
    if name != "zero3":  # every rung but DeepSpeed: a DCP folder, a file per rank
        assert len(list((ckpt / "sharded").glob("*.distcp"))) == world
        assert marker["format"] == "dcp"
    if name == "zero3":  # DeepSpeed's own per-rank partitions
        assert len(list(ckpt.glob("global_step2/*optim_states.pt"))) == world


def _resume_cmd(out, *extra):
    return [sys.executable, str(FINETUNE), *TINY_ARGS, "--output-dir", str(out), "--save-steps", "2", "--resume",
            "--no-wandb", *extra]


def test_deepspeed_checkpoint_on_another_layout_is_refused_naming_the_converter(runs, tmp_path):
    """ZeRO partitions reshard only through DeepSpeed's universal checkpoint, which the Trainer does not load."""
    _, _, full, _ = runs["zero3"]
    shutil.copytree(full / "checkpoint-2", tmp_path / "checkpoint-2")
    proc = run_cmd(_resume_cmd(tmp_path, "--config", "fsdp_full_shard"), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "was written by zero3 on 2 ranks (deepspeed format); this run is fsdp_full_shard" in proc.stderr
    assert "deepspeed.checkpoint.ds_to_universal" in proc.stderr and "hfdist checkpoint export" in proc.stderr
    assert "--config zero3 --num-processes 2" in proc.stderr


def test_damaged_shard_is_refused_and_left_alone(runs, tmp_path):
    _, _, full, _ = runs["fsdp_full_shard"]
    shutil.copytree(full / "checkpoint-2", tmp_path / "checkpoint-2")
    shard = sorted((tmp_path / "checkpoint-2" / "sharded").glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = shard.read_bytes()
    proc = run_cmd(_resume_cmd(tmp_path, "--config", "fsdp_full_shard"), timeout=600)
    # Shorter than the data its metadata places in it: refused before any process starts, the file named.
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"lacks shards its metadata lists: {shard.name} ({shard.stat().st_size} bytes, needs" in proc.stderr
    assert "delete the checkpoint to resume from the previous one" in proc.stderr
    assert shard.read_bytes() == before and not (tmp_path / "checkpoint-4").exists()


def _limit_file_size():
    # A write past this size fails with EFBIG (SIGXFSZ ignored, so the process is not killed): a full disk as the
    # writer sees it, for this process and the ranks it starts.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))


def test_failed_save_keeps_the_previous_checkpoint(runs, tmp_path):
    """Resumed at step 2, the step-4 save cannot be written: the run stops with the cause and checkpoint-2 stays
    complete and resumable."""
    _, _, full, _ = runs["fsdp_full_shard"]
    shutil.copytree(full / "checkpoint-2", tmp_path / "checkpoint-2")
    files = {p: p.read_bytes() for p in (tmp_path / "checkpoint-2").rglob("*") if p.is_file()}
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = run_tree(_resume_cmd(tmp_path, "--config", "fsdp_full_shard"), 600, cwd=FINETUNE.parent.parent, env=env,
                    preexec_fn=_limit_file_size)
    assert proc.returncode != 0
    assert "Could not write checkpoint checkpoint-4" in proc.stderr and "intact" in proc.stderr
    assert not (tmp_path / "checkpoint-4").exists()
    assert {p: p.read_bytes() for p in (tmp_path / "checkpoint-2").rglob("*") if p.is_file()} == files


def test_incomplete_checkpoints_are_never_the_latest(tmp_path):
    from hfdist.checkpoint.format import MARKER, latest_checkpoint, staging_dir

    assert latest_checkpoint(tmp_path) is None
    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-2" / MARKER).write_text("{}")
    (tmp_path / "checkpoint-4" / MARKER).write_text("{}")
    staging_dir(tmp_path / "checkpoint-8").mkdir()  # a save that crashed before its rename
    # checkpoint-6 has no marker (a foreign or interrupted folder), checkpoint-8 was never renamed.
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-4"


def test_resuming_a_finished_run_changes_nothing(runs, tmp_path):
    """The final checkpoint is at --max-steps: refused (the Trainer would train one step past max_steps)."""
    _, _, full, _ = runs["ddp"]
    shutil.copytree(full / "checkpoint-4", tmp_path / "checkpoint-4")
    proc = run_cmd(_resume_cmd(tmp_path, "--config", "ddp"), timeout=300)
    assert proc.returncode == 2 and "nothing is left to train" in proc.stderr and "--max-steps" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]
