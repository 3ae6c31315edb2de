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

from helpers import REPO, run_cmd

GB = 10**9


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
    assert "more than the 80.0 GB available" in message and "The fastest predicted layout that fits is" in message
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


def _prebuild_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("prebuild_deepspeed_ops", REPO / "scripts" / "prebuild_deepspeed_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("toolkit", [None, "/usr/local/cuda"])
def test_setup_prebuilds_cpu_adam_on_a_gpu_host_too(gpu_host, monkeypatch, toolkit):
    """gpu-readiness C16: zero3_offload_cpu's optimizer (DeepSpeedCPUAdam) JIT-builds cpu_adam on first use, minutes
    into the first run; setup.sh builds it on GPU hosts too (with or without the CUDA toolkit: on DeepSpeed's CUDA
    accelerator it is the plain C++ builder), and NVMe's async_io where the toolkit is. The builders come from
    DeepSpeed's own CUDA accelerator; only their compilation is replaced by a record."""
    import deepspeed.accelerator
    import torch.utils.cpp_extension as cpp
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    cuda = CUDA_Accelerator()
    built = []
    create = cuda.create_op_builder

    def recording(name):
        builder = create(name)
        builder.load = lambda verbose=True: built.append(builder.NAME)
        return builder

    monkeypatch.setattr(cuda, "create_op_builder", recording)
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: cuda)
    monkeypatch.setattr(cpp, "CUDA_HOME", toolkit)
    lines = _prebuild_module().prebuild()
    assert built == (["cpu_adam"] if toolkit is None else ["cpu_adam", "async_io"])
    assert "setup: DeepSpeed op cpu_adam built" in lines
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "python scripts/prebuild_deepspeed_ops.py" in setup  # what setup.sh runs, on every host


class _FakeGpu:
    """A device whose work runs after the host queues it: each queued action adds its milliseconds to the queue;
    events record the queue's position; synchronize waits (sleeps) until the queue has run."""

    def __init__(self) -> None:
        self.queued_ms, self.done_ms, self.log = 0.0, 0.0, []

    def queue(self, ms: float) -> None:
        self.queued_ms += ms

    def synchronize(self, device=None) -> None:
        import time

        time.sleep((self.queued_ms - self.done_ms) / 1000)
        self.done_ms = self.queued_ms
        self.log.append("synchronize")

    def event_class(self):
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.at = None

            def record(self, stream=None) -> None:
                self.at = gpu.queued_ms

            def elapsed_time(self, end) -> float:
                assert gpu.done_ms >= end.at, "an event read before the device reached it"
                return end.at - self.at

        return Event


def test_bubble_meter_times_gpu_work_on_the_device(monkeypatch):
    """gpu-readiness B11: on a GPU a stage's forward returns once its kernels are queued; the compute time must be
    the device's (CUDA events around each action) and a step's wall time must end when the device has finished."""
    import torch.distributed as dist

    from hfdist.metrics.bubble import time_steps

    gpu = _FakeGpu()
    monkeypatch.setattr(torch.cuda, "Event", gpu.event_class())
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)
    monkeypatch.setattr(dist, "barrier", lambda group=None: None)

    class Stage:
        def forward_one_chunk(self, *args):
            gpu.queue(2.0)

        def backward_one_chunk(self, *args):
            gpu.queue(4.0)

        def backward_weight_one_chunk(self, *args):
            gpu.queue(0.5)

    class Runner:
        device, pp_group = torch.device("cuda", 0), None

        def __init__(self) -> None:
            self.pipeline_stages = [Stage()]

        def loss_fn(self, *args):
            gpu.queue(1.0)

        def step(self, *args):
            gpu.log.append("step")
            stage = self.pipeline_stages[0]
            for _ in range(4):  # micro-batches
                stage.forward_one_chunk()
                self.loss_fn()
                stage.backward_one_chunk()
                stage.backward_weight_one_chunk()
            gpu.queue(10.0)  # the step's own work outside the compute actions (communication): not compute

    busy, wall = time_steps(Runner(), None, None, steps=3)
    assert busy == pytest.approx(3 * 4 * 7.5 / 1000)  # the device's time inside the actions, not the host's ~0
    assert wall >= 3 * (4 * 7.5 + 10) / 1000  # every step timed until the device finished it
    assert gpu.log == ["synchronize", "step", "synchronize"] * 3 + ["synchronize"]
