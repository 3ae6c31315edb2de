"""Peak FLOP/s of a device, the denominator of MFU: a table of dense datasheet figures per GPU model and dtype,
and, on CPU (no datasheet reachable), a measured matmul peak named as such.
"""

from __future__ import annotations

import re
import time
from typing import NamedTuple

import torch

__all__ = ["PEAK_FLOPS", "CPU_PEAK_SOURCE", "PeakFlops", "peak_flops_for", "measure_cpu_peak_flops",
           "device_peak_flops"]

CPU_PEAK_SOURCE = "measured CPU matmul peak"

_T = 1e12
# Dense peak FLOP/s (no 2:4 sparsity): NVIDIA lists most tensor figures "with sparsity" (marked *), halved here.
# fp32 is the non-tensor (CUDA core) rate, what torch uses at the default float32 matmul precision "highest";
# tf32 applies once `torch.backends.cuda.matmul.allow_tf32` / `set_float32_matmul_precision("high")` is set.
# bf16/fp16 are with fp32 accumulation (training). A missing dtype means the device has no such tensor path.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H100 datasheet (SXM5 / PCIe / NVL columns), sparse figures halved.
    "H100 SXM": {"bf16": 989 * _T, "fp16": 989 * _T, "tf32": 494.5 * _T, "fp32": 67 * _T},
    "H100 PCIe": {"bf16": 756 * _T, "fp16": 756 * _T, "tf32": 378 * _T, "fp32": 51 * _T},
    "H100 NVL": {"bf16": 835 * _T, "fp16": 835 * _T, "tf32": 417.5 * _T, "fp32": 60 * _T},
    # NVIDIA H200 datasheet (SXM / NVL columns): the H100 SXM / NVL compute with more, faster memory.
    "H200": {"bf16": 989 * _T, "fp16": 989 * _T, "tf32": 494.5 * _T, "fp32": 67 * _T},
    "H200 NVL": {"bf16": 835 * _T, "fp16": 835 * _T, "tf32": 417.5 * _T, "fp32": 60 * _T},
    # NVIDIA GH200 Grace Hopper datasheet: its GPU has the H100 SXM compute.
    "GH200": {"bf16": 989 * _T, "fp16": 989 * _T, "tf32": 494.5 * _T, "fp32": 67 * _T},
    # NVIDIA HGX B200 spec (8-GPU board figures per GPU, sparse halved); bf16/fp16 only, as in torchtitan's table.
    "B200": {"bf16": 2250 * _T, "fp16": 2250 * _T},
    # NVIDIA A100 datasheet: SXM4 and PCIe, 40 GB and 80 GB, share the peak figures.
    "A100 SXM": {"bf16": 312 * _T, "fp16": 312 * _T, "tf32": 156 * _T, "fp32": 19.5 * _T},
    "A100 PCIe": {"bf16": 312 * _T, "fp16": 312 * _T, "tf32": 156 * _T, "fp32": 19.5 * _T},
    # NVIDIA L40S datasheet.
    "L40S": {"bf16": 362.05 * _T, "fp16": 362.05 * _T, "tf32": 183 * _T, "fp32": 91.6 * _T},
    # NVIDIA L4 datasheet.
    "L4": {"bf16": 121 * _T, "fp16": 121 * _T, "tf32": 60 * _T, "fp32": 30.3 * _T},
    # NVIDIA A10 datasheet.
    "A10": {"bf16": 125 * _T, "fp16": 125 * _T, "tf32": 62.5 * _T, "fp32": 31.2 * _T},
    # A10G (AWS G5) has no NVIDIA datasheet; figures as AWS/NVIDIA state them to customers and third-party
    # comparisons repeat (Baseten, "NVIDIA A10 vs A10G"): half the A10's tensor rate, more CUDA-core fp32.
    "A10G": {"bf16": 70 * _T, "fp16": 70 * _T, "tf32": 35 * _T, "fp32": 35 * _T},
    # NVIDIA Ada Lovelace architecture whitepaper, RTX 4090 column (GeForce: fp32 accumulation runs at half rate).
    "RTX 4090": {"bf16": 165.2 * _T, "fp16": 165.2 * _T, "tf32": 82.6 * _T, "fp32": 82.6 * _T},
    # NVIDIA Ampere GA102 whitepaper, RTX 3090 column (fp32 accumulation).
    "RTX 3090": {"bf16": 71 * _T, "fp16": 71 * _T, "tf32": 35.6 * _T, "fp32": 35.6 * _T},
    # NVIDIA V100 datasheet (SXM2 / PCIe / V100S): fp16 tensor cores only, no bf16 or tf32.
    "V100 SXM2": {"fp16": 125 * _T, "fp32": 15.7 * _T},
    "V100 PCIe": {"fp16": 112 * _T, "fp32": 14 * _T},
    "V100S PCIe": {"fp16": 130 * _T, "fp32": 16.4 * _T},
    # NVIDIA T4 datasheet.
    "T4": {"fp16": 65 * _T, "fp32": 8.1 * _T},
    # AMD Instinct MI300X datasheet (matrix rates, dense).
    "MI300X": {"bf16": 1307.4 * _T, "fp16": 1307.4 * _T, "tf32": 653.7 * _T, "fp32": 163.4 * _T},
}

# torch.cuda.get_device_name() strings -> PEAK_FLOPS keys; first match wins, so variants precede their family
# ("GH200" contains "H200", "A100" would swallow "A10" without the word boundaries).
_NAME_PATTERNS: list[tuple[re.Pattern, str]] = [(re.compile(p, re.IGNORECASE), key) for p, key in [
    (r"\bH100\b.*\bNVL\b", "H100 NVL"),
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe"),
    (r"\bH100\b", "H100 SXM"),  # "NVIDIA H100 80GB HBM3" is the SXM part
    (r"\bGH200\b", "GH200"),
    (r"\bH200\b.*\bNVL\b", "H200 NVL"),
    (r"\bH200\b", "H200"),
    (r"\bB200\b", "B200"),
    (r"\bA100\b.*\bPCIe\b", "A100 PCIe"),
    (r"\bA100\b", "A100 SXM"),
    (r"\bL40S\b", "L40S"),
    (r"\bL4\b", "L4"),
    (r"\bA10G\b", "A10G"),
    (r"\bA10\b", "A10"),
    (r"\bRTX 4090\b", "RTX 4090"),
    (r"\bRTX 3090\b", "RTX 3090"),
    (r"\bV100S\b", "V100S PCIe"),
    (r"\bV100\b.*\bPCIe\b", "V100 PCIe"),
    (r"\bV100\b", "V100 SXM2"),
    (r"\bT4\b", "T4"),
    (r"\bMI300X\b", "MI300X"),
]]

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", "bf16": "bf16",
                "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16", "fp32": "fp32",
                "float32": "fp32", "float": "fp32", "tf32": "tf32"}


class PeakFlops(NamedTuple):
    """A device's peak FLOP/s and where the number comes from (a datasheet row or CPU_PEAK_SOURCE)."""

    flops: float
    source: str


def _dtype_name(dtype: torch.dtype | str) -> str:
    name = _DTYPE_NAMES.get(dtype.lower() if isinstance(dtype, str) else dtype)
    if name is None:
        raise ValueError(f"No peak FLOP/s for dtype {dtype!r}; use one of bf16, fp16, fp32, tf32.")
    return name


def _device_key(device_name: str) -> str | None:
    return next((key for pattern, key in _NAME_PATTERNS if pattern.search(device_name)), None)


def peak_flops_for(device_name: str, dtype: torch.dtype | str) -> float | None:
    """Dense datasheet peak FLOP/s for a `torch.cuda.get_device_name()` string and a dtype, or None if unknown.

    dtype: torch.bfloat16 / float16 / float32 or "bf16", "fp16", "fp32", "tf32" (fp32 is the non-tensor rate;
    pass "tf32" when TF32 matmuls are allowed).
    """
    key = _device_key(device_name)
    if key is None:
        return None
    return PEAK_FLOPS[key].get(_dtype_name(dtype))


_CPU_PEAKS: dict[tuple[torch.dtype, int, int], float] = {}


def measure_cpu_peak_flops(dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 8,
                           budget_s: float = 0.3) -> float:
    """Measured CPU matmul peak: the best FLOP/s of up to `repeats` square `size`³ matmuls, cached per process.

    CPUs have no datasheet row that torch reaches, so MFU on CPU is relative to this measurement (call it the
    "measured CPU matmul peak" wherever it is shown). The best run, not the mean, because other processes on a
    shared machine only ever slow a run down; the cache key includes the thread count, which sets the peak. The
    runs stop once they have taken `budget_s` seconds (after two at least): every rank of every run measures, and a
    bf16 matmul on a CPU without bf16 units takes ~0.1 s (1 s a rank for 8 runs, measured on 2 cores).
    """
    key = (dtype, size, torch.get_num_threads())
    if key not in _CPU_PEAKS:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=gen).to(dtype)
        b = torch.randn(size, size, generator=gen).to(dtype)
        torch.mm(a, b)  # warm-up: first call pays for allocation and kernel selection
        times: list[float] = []
        while len(times) < max(repeats, 1) and (len(times) < 2 or sum(times) < budget_s):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        _CPU_PEAKS[key] = 2.0 * size**3 / min(times)
    return _CPU_PEAKS[key]


def device_peak_flops(device: torch.device | str, dtype: torch.dtype | str) -> PeakFlops | None:
    """The peak to divide by for MFU on `device`: the datasheet row of a GPU, or the measured CPU matmul peak.

    Returns None for a GPU without a table row (report TFLOP/s only, no MFU, rather than guess a peak).
    """
    device = torch.device(device)
    dt = _dtype_name(dtype)
    if device.type == "cpu":
        cpu_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dt, torch.float32)  # no TF32 on CPU
        return PeakFlops(measure_cpu_peak_flops(cpu_dtype), f"{CPU_PEAK_SOURCE} ({dt})")
    name = torch.cuda.get_device_name(device)
    key, peak = _device_key(name), peak_flops_for(name, dt)
    return None if peak is None else PeakFlops(peak, f"{key} datasheet, dense {dt}")


