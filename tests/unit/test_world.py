"""Process counts and devices on a multi-GPU host, with torch's device API and the launcher's environment mocked:
one process per GPU by default, overrides, refusals before any process starts, the single rung on one GPU, and the
hand-over command."""

from __future__ import annotations

import sys

import pytest
import torch

from hfdist.config.dims import ParallelDims
from hfdist.config.finetune import FinetuneConfig
from hfdist.config.ladder import LadderError, load_rung
from hfdist.job import launch, quiet_launch
from hfdist.job.world import Node, WorldError, resolve_rung

EIGHT_GPUS = Node(gpus=8)


@pytest.fixture
def no_launcher(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", launch.HANDED_OVER_ENV):
        monkeypatch.delenv(key, raising=False)


def _gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_node_reads_the_gpus_and_the_launched_world(monkeypatch, no_launcher):
    _gpus(monkeypatch, 8)
    assert Node.detect() == Node(gpus=8) and not Node.detect().launched
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert Node.detect() == Node(gpus=8, world=16, local_world=8)
    _gpus(monkeypatch, 0)
    assert Node.detect().gpus == 0


@pytest.mark.parametrize("name, dims", [
    ("ddp", ParallelDims(dp_replicate=8)),
    ("zero3", ParallelDims(dp_shard=8)),
    ("fsdp_full_shard", ParallelDims(dp_shard=8)),
    ("fsdp_hybrid", ParallelDims(dp_shard=8)),  # shards over the node's GPUs; one node: one replica
    ("fsdp_tp", ParallelDims(dp_shard=4, tp=2)),
    ("pp", ParallelDims(dp_shard=4, pp=2)),
    ("3d", ParallelDims(dp_shard=2, pp=2, tp=2)),
    ("zero2_tp", ParallelDims(dp_shard=4, tp=2)),
])
def test_default_is_one_process_per_gpu(name, dims):
    rung = resolve_rung(FinetuneConfig(config=name), EIGHT_GPUS)
    assert rung.num_processes == 8 and rung.dims == dims


def test_on_cpu_the_yaml_counts_stand():
    for name in ("ddp", "fsdp_hybrid", "fsdp_tp", "3d"):
        assert resolve_rung(FinetuneConfig(config=name), Node()) == load_rung(name)


def test_degree_overrides_beat_the_yaml():
    tp8 = resolve_rung(FinetuneConfig(config="fsdp_tp", tp=8), EIGHT_GPUS)
    assert tp8.dims == ParallelDims(tp=8) and tp8.num_processes == 8  # no YAML edit needed
    assert resolve_rung(FinetuneConfig(config="3d", tp=4, pp=2), EIGHT_GPUS).dims == ParallelDims(pp=2, tp=4)
    assert resolve_rung(FinetuneConfig(config="fsdp_hybrid", dp_replicate=2), EIGHT_GPUS).dims == \
        ParallelDims(dp_replicate=2, dp_shard=4)
    pp = resolve_rung(FinetuneConfig(config="fsdp_full_shard", pp=2), EIGHT_GPUS)
    assert pp.dims == ParallelDims(dp_shard=4, pp=2) and pp.pipeline.schedule == "1F1B" and pp.uses_pipeline
    assert resolve_rung(FinetuneConfig(config="zero2_tp", tp=4), EIGHT_GPUS).dims == ParallelDims(dp_shard=2, tp=4)
    # CPU: the overrides apply to the YAML's process count
    assert resolve_rung(FinetuneConfig(config="fsdp_full_shard", tp=2), Node()).dims == ParallelDims(tp=2)


@pytest.mark.parametrize("cfg, message", [
    (FinetuneConfig(config="fsdp_tp", tp=3), "tensor x pipeline degrees tp x pp = 3 x 1 = 3 must divide the processes"),
    (FinetuneConfig(config="fsdp_hybrid", dp_replicate=3), "--dp-replicate 3 does not divide"),
    (FinetuneConfig(config="ddp", tp=2), "replicates the whole model on every rank"),
    (FinetuneConfig(config="zero3", pp=2), "no pipeline stages"),
    (FinetuneConfig(config="zero3", tp=2), "AutoTP does not compose with ZeRO-3"),
    (FinetuneConfig(config="single", num_processes=2), "single rung runs one process"),
])
def test_degrees_that_do_not_fit_are_refused(cfg, message):
    with pytest.raises(LadderError) as err:
        resolve_rung(cfg, EIGHT_GPUS)
    assert message in str(err.value)


def test_more_processes_than_gpus_is_refused_with_the_fix():
    with pytest.raises(WorldError) as err:
        resolve_rung(FinetuneConfig(config="fsdp_full_shard", num_processes=16), EIGHT_GPUS)
    text = str(err.value)
    assert "16 processes" in text and "8 GPUs" in text and "--num-processes 8" in text and "docs/multi-node.md" in text
    with pytest.raises(WorldError, match="runs 8 processes of the launched world but has 4 GPUs"):
        resolve_rung(FinetuneConfig(config="fsdp_full_shard"), Node(gpus=4, world=8, local_world=8))


def test_several_nodes_shard_hybrid_inside_each():
    two_nodes = Node(gpus=8, world=16, local_world=8)
    assert resolve_rung(FinetuneConfig(config="fsdp_hybrid"), two_nodes).dims == \
        ParallelDims(dp_replicate=2, dp_shard=8)
    assert resolve_rung(FinetuneConfig(config="fsdp_full_shard"), two_nodes).dims == ParallelDims(dp_shard=16)


class _Finished:
    """A launch that has ended with exit code 0 (subprocess.Popen's wait and send_signal)."""

    def wait(self) -> int:
        return 0

    def send_signal(self, signum: int) -> None:
        raise AssertionError("nothing forwards a signal here")


def _captured_launch(monkeypatch) -> list:
    """The launches a hand-over makes, as (command, environment): a child process's command, or the `accelerate
    launch` arguments it runs in its own process."""
    calls = []
    monkeypatch.setattr(launch.subprocess, "Popen", lambda cmd, env: calls.append((cmd, env)) or _Finished())
    monkeypatch.setattr(quiet_launch, "launch_here", lambda argv, env: calls.append((argv, env)) or (0, {}))
    return calls


def test_single_on_a_multi_gpu_host_restarts_on_one_gpu(monkeypatch, no_launcher, tmp_path):
    """transformers would otherwise wrap the single run in nn.DataParallel over every GPU (gpu-readiness #2)."""
    calls = _captured_launch(monkeypatch)
    cfg = FinetuneConfig(output_dir=str(tmp_path / "o"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
    rung = resolve_rung(cfg, Node(gpus=3))
    assert launch.ensure_world(rung, cfg, ["scripts/finetune.py"], ["--max-steps", "2"], Node(gpus=3)) == 0
    (cmd, env), = calls
    assert cmd == [sys.executable, "scripts/finetune.py", "--max-steps", "2"]
    assert env["CUDA_VISIBLE_DEVICES"] == "2" and env[launch.HANDED_OVER_ENV] == "1"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert launch.single_gpu_env({})["CUDA_VISIBLE_DEVICES"] == "0"
    assert launch.ensure_world(rung, cfg, ["x.py"], [], Node(gpus=1)) is None  # one GPU: trains in this process
    assert launch.ensure_world(rung, cfg, ["x.py"], [], Node()) is None


def test_every_other_rung_trains_in_a_launched_world(monkeypatch, no_launcher, tmp_path):
    calls = _captured_launch(monkeypatch)
    cfg = FinetuneConfig(config="fsdp_full_shard", num_processes=1, output_dir=str(tmp_path / "o"))
    rung = resolve_rung(cfg, Node())
    assert launch.ensure_world(rung, cfg, launch_entry := ["-m", "hfdist.cli", "finetune"], ["--a"], Node()) == 0
    (cmd, env), = calls
    assert cmd[:2] == ["--config_file", str(rung.yaml_path)] and cmd[-4:] == [*launch_entry, "--a"]
    assert cmd[cmd.index("--num_processes") + 1] == "1" and cmd[cmd.index("--num_machines") + 1] == "1"
    assert env["HFDIST_LOG_DIR"] == str(tmp_path / "o" / "logs")
    gpu_rung = resolve_rung(FinetuneConfig(config="fsdp_tp", tp=8), EIGHT_GPUS)
    launch.ensure_world(gpu_rung, cfg, ["x.py"], [], EIGHT_GPUS)
    gpu_cmd = calls[-1][0]
    assert gpu_cmd[gpu_cmd.index("--num_processes") + 1] == "8" and "--mixed_precision" not in gpu_cmd


def test_a_launched_world_of_the_wrong_size_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "_check_launcher_env", lambda rung: None)
    cfg = FinetuneConfig(config="fsdp_hybrid", output_dir=str(tmp_path))
    with pytest.raises(launch.LaunchError, match="needs 4 processes .* but this world has 2"):
        launch.ensure_world(load_rung("fsdp_hybrid"), cfg, ["x.py"], [], Node(world=2, local_world=2))
    assert launch.ensure_world(load_rung("ddp"), cfg, ["x.py"], [], Node(world=2, local_world=2)) is None
