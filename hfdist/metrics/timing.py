"""Seconds a short operation takes on a device, read as the best of a few windows of back-to-back calls.

A window holds nothing but the calls: whatever lines the participants up (a device drain, a barrier) runs before
it, never inside, so its latency is not counted in (timed with each call, a barrier read a 64 MiB copy's bandwidth at
half and a 4 KiB all-gather's latency at double on NCCL). On a GPU the window is timed by CUDA events on the stream
(the kernels' time, not the host's launches); on a CPU by the host clock. The best window is the figure: other work
on a machine only ever slows one down.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["REPEATS", "per_call", "host_window", "cuda_window", "device_window"]

REPEATS = 5

Window = Callable[[Callable[[], None]], float]


def per_call(fn: Callable[[], object], line_up: Callable[[], None], window: Window, calls: int = 10,
             repeats: int = REPEATS) -> float:
    """Seconds one call of `fn` takes: the best of `repeats` windows of `calls` back-to-back calls, `line_up` run
    before each window (module docstring) and `fn` once before them all (allocation, kernel choice, a
    communicator's first use)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        line_up()
        best = min(best, window(lambda: [fn() for _ in range(calls)]) / calls)
    return best


def host_window(run: Callable[[], None]) -> float:
    """Seconds `run` takes by the host clock."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def cuda_window(run: Callable[[], None]) -> float:
    """Seconds the kernels `run` launches take on the current CUDA stream, by events recorded around them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def device_window(device: torch.device) -> Window:
    """The window for `device`: CUDA events on a GPU, the host clock elsewhere."""
    return cuda_window if device.type == "cuda" else host_window
