"""GPU code paths, on CPU: torch.cuda's device API mocked where the code asks it, so each branch a GPU host takes
runs here too. And the suite itself is GPU-safe: tests/conftest.py hides the GPUs before torch is imported, so a
GPU host runs every test exactly as a CPU one (the processes the tests start included).

Covered elsewhere with the same mocks: process counts and the single rung (test_world.py), memory windows and
allocator retries (test_callbacks.py), datasheet peaks by device name (test_flops.py), the precision a rung gets on a
GPU (test_precision.py).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from hfdist.config.finetune import ConfigError, FinetuneConfig
from hfdist.config.ladder import known_rung_names, load_rung

from helpers import run_cmd

GB = 10**9


@pytest.fixture
def gpu_host(monkeypatch):
    """An 8 x H100 80GB node as torch.cuda describes it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=80 * GB, name="NVIDIA H100 80GB HBM3"))


def test_the_suite_sees_no_gpu_and_neither_do_its_processes():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert not torch.cuda.is_available() and torch.cuda.device_count() == 0
    child = run_cmd([sys.executable, "-c", "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"])
    assert child.returncode == 0 and child.stdout.strip() == "''"


def test_plan_check_plans_against_the_gpus_memory(gpu_host):
    """Before any process starts, a rung the planner predicts cannot fit the GPU is refused with the rung that does
    (the GPU's memory read from torch.cuda; on CPU the check is skipped)."""
    from hfdist.job.preflight import plan_check

    ddp = load_rung("ddp").with_num_processes(8)
    with pytest.raises(ConfigError) as exc:
        plan_check(FinetuneConfig(config="ddp", model="llama-3.1-8b", seq_len=2048), ddp, micro=1)
    message = str(exc.value)
    assert "more than the 80.0 GB available" in message and "The simplest rung that fits is" in message
    fsdp = load_rung("fsdp_full_shard").with_num_processes(8)
    plan_check(FinetuneConfig(config="fsdp_full_shard", model="llama-3.1-8b", seq_len=2048), fsdp, micro=1)


def test_plan_check_is_skipped_on_cpu():
    from hfdist.job.preflight import plan_check

    plan_check(FinetuneConfig(config="ddp", model="llama-3.1-70b"), load_rung("ddp").with_num_processes(8), micro=1)


def test_every_shipped_rung_passes_the_gpu_settings_check(gpu_host):
    from hfdist.job.preflight import _check_gpu_settings

    for name in known_rung_names():
        _check_gpu_settings(load_rung(name))


def test_results_folder_is_named_after_the_gpus(gpu_host):
    from hfdist.report.matrix import hardware_name

    assert hardware_name() == "h100-80gb-hbm3-x8"


def test_mfu_peak_on_a_gpu_is_the_datasheet_row(gpu_host):
    from hfdist.metrics.peaks import device_peak_flops

    peak = device_peak_flops("cuda:0", torch.bfloat16)
    assert peak.flops == 989e12 and "datasheet" in peak.source


def test_load_window_on_cuda_reads_the_allocator(monkeypatch):
    """The load record's baseline and peak (hfdist.job.run) on a GPU: CUDA's allocator, its peak restarted."""
    from hfdist.metrics.memory import peak_memory_bytes, start_peak_window

    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(device))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * GB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 7 * GB)
    cuda = torch.device("cuda", 0)
    assert start_peak_window(cuda) == 3 * GB and calls == [cuda]
    assert peak_memory_bytes(cuda) == 7 * GB


def test_checkpoints_record_the_gpu_and_a_cpu_checkpoint_is_not_resumed_there(gpu_host, tmp_path):
    from hfdist.checkpoint.format import CheckpointError
    from hfdist.checkpoint.resume import _check_precision_and_device, checkpoint_identity

    rung = load_rung("fsdp_full_shard").with_num_processes(8)
    identity = checkpoint_identity(FinetuneConfig(config="fsdp_full_shard"), rung)
    assert identity["device"] == "cuda" and identity["mixed_precision"] == "bf16"  # auto on a GPU: the YAML's
    with pytest.raises(CheckpointError, match="it trained on cpu, this run is on cuda"):
        _check_precision_and_device(tmp_path, {"device": "cpu", "mixed_precision": "no"}, identity)


def test_streamed_save_exchanges_through_the_gpu_under_nccl(gpu_host, monkeypatch):
    """NCCL moves only CUDA tensors: the save's point-to-point buffers go to this rank's GPU there."""
    import torch.distributed as dist

    from hfdist.checkpoint import hf_export

    assert hf_export._comm_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert hf_export._comm_device() == torch.device("cuda", 3)


def test_nvme_offload_without_the_cuda_toolkit_is_refused_before_launch(gpu_host, monkeypatch):
    """On a GPU host DeepSpeed JIT-builds its async I/O op (NVMe offload) against CUDA_HOME; a pip-only torch has
    none, and the build would fail inside every rank minutes in. The CUDA op builder is the one DeepSpeed's CUDA
    accelerator hands out; here only torch.cuda and CUDA_HOME are simulated."""
    import deepspeed.accelerator
    import torch.utils.cpp_extension as cpp
    from deepspeed.ops.op_builder.async_io import AsyncIOBuilder

    from hfdist.job.preflight import check_nvme_offload

    cuda_accelerator = SimpleNamespace(create_op_builder=lambda name: AsyncIOBuilder())
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: cuda_accelerator)
    monkeypatch.setattr(cpp, "CUDA_HOME", None)
    with pytest.raises(ConfigError, match=r"zero3_offload_nvme offloads to NVMe.*the CUDA toolkit.*CUDA_HOME.*"
                                          r"DS_BUILD_AIO=1.*zero3_offload_cpu"):
        check_nvme_offload(load_rung("zero3_offload_nvme"))
    check_nvme_offload(load_rung("zero3_offload_cpu"))  # no NVMe: nothing to build
    monkeypatch.setattr(cpp, "CUDA_HOME", "/usr/local/cuda")
    check_nvme_offload(load_rung("zero3_offload_nvme"))  # toolkit present (libaio and ninja are, on this machine)
