"""Build the DeepSpeed ops this host's rungs JIT-compile on first use, now (scripts/setup.sh runs it).

    python scripts/prebuild_deepspeed_ops.py

DeepSpeed compiles its C++/CUDA ops the first time a run needs them, into ~/.cache/torch_extensions: minutes (6.5
measured on 2 cores) that would stall that run's every rank. Which ops, by host:
- any host: cpu_adam, the optimizer of zero3_offload_cpu / zero3_offload_nvme (DeepSpeedCPUAdam, their JSONs' AdamW
  with the optimizer offloaded). It is plain C++ with OpenMP on GPU hosts too (DeepSpeed's CUDA accelerator hands
  out the CPU builder for host-side optimizers), so it builds without the CUDA toolkit.
- a GPU host: async_io (zero3_offload_nvme) where the CUDA toolkit is installed (DeepSpeed's CUDA op builder needs
  CUDA_HOME; hfdist refuses NVMe offload before launch where it is missing). The other rungs train with the
  Trainer's torch AdamW and build nothing.
- a CPU host: also fused_adam, async_io and the shared-memory communication op, DeepSpeed's CPU variants.
Each line this prints starts with "setup:"; an op that fails to build is reported and the rest still build.
"""

from __future__ import annotations

GPU_ALWAYS = ("CPUAdamBuilder",)
GPU_WITH_CUDA_TOOLKIT = ("AsyncIOBuilder",)
CPU_HOST = ("CPUAdamBuilder", "FusedAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder")


def builders_for_host(on_gpu: bool, cuda_toolkit: bool) -> tuple[str, ...]:
    """The DeepSpeed op builder classes to build on this host (module docstring)."""
    if not on_gpu:
        return CPU_HOST
    return GPU_ALWAYS + (GPU_WITH_CUDA_TOOLKIT if cuda_toolkit else ())


def prebuild() -> list[str]:
    """Build each op for this host through DeepSpeed's accelerator (the builders a run would load); returns the
    "setup:" lines, one per op."""
    import torch
    import torch.utils.cpp_extension as cpp
    from deepspeed.accelerator import get_accelerator

    on_gpu = torch.cuda.is_available()
    lines = []
    for name in builders_for_host(on_gpu, cpp.CUDA_HOME is not None):
        builder = get_accelerator().create_op_builder(name)
        if builder is None:
            lines.append(f"setup: DeepSpeed has no {name} on this accelerator")
            continue
        try:
            builder.load(verbose=False)
            lines.append(f"setup: DeepSpeed op {builder.NAME} built")
        except Exception as exc:  # noqa: BLE001 (a missing libaio only affects zero3_offload_nvme; the run reports it)
            lines.append(f"setup: DeepSpeed op {builder.NAME} not built ({type(exc).__name__}: {exc})")
    if on_gpu and cpp.CUDA_HOME is None:
        lines.append("setup: no CUDA toolkit (CUDA_HOME): DeepSpeed's CUDA ops (async_io for zero3_offload_nvme) are "
                     "not pre-built")
    return lines


if __name__ == "__main__":
    print("\n".join(prebuild()), flush=True)
