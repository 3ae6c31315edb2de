"""Measure the pipeline bubble: the fraction of a step each rank spends waiting rather than computing.

Every compute action of the schedule (forward, full / input / weight backward, loss) is timed on each rank; the
rest of the step's wall time is bubble (plus communication, which a CPU run cannot separate from waiting).
For a balanced 1F1B step the theory is (p - 1) / (m + p - 1) (`ideal_bubble_fraction`).

On a GPU the host returns from a compute action once its kernels are queued, so the host clock would time their
launch: there each action is timed by CUDA events recorded around it on the current stream (the time the GPU spent
between them, which starts once the stream's earlier work, the wait for the received activations included, is
done), and every timed step starts and ends with the device synchronised.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hfdist.parallel.pipeline.plan import ideal_bubble_fraction

if TYPE_CHECKING:
    from hfdist.parallel.pipeline.runner import PipelineRunner

__all__ = ["BubbleMeasurement", "ComputeClock", "measure_bubble", "time_steps", "timed", "synchronize"]

# PipelineStage methods that do a schedule's compute; the schedule waits for communication outside them.
_STAGE_COMPUTE = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


@dataclass(frozen=True)
class BubbleMeasurement:
    """One schedule's measured bubble next to the theory.

    Attributes:
        step_s: mean wall time of a step (slowest rank).
        busy_s: mean compute time per step on each pp rank.
        bubble: 1 - busy / step time, averaged over the pp ranks.
        ideal: (p - 1) / (v m + p - 1) for this pp, micro-batch count and stages per rank v: the GPipe / 1F1B /
            Interleaved1F1B bubble of balanced stages; zero-bubble schedules aim below it.
    """

    schedule: str
    pp: int
    n_microbatches: int
    stages_per_rank: int
    step_s: float
    busy_s: list[float]
    bubble: float
    ideal: float

    def to_dict(self) -> dict:
        """Plain dict for JSON summaries and benchmark tables."""
        return asdict(self)


def timed(fn: Callable, clock: list[float]) -> Callable:
    """`fn`, adding its host wall time to clock[0] on every call (`.__wrapped__` is `fn`): for host-side work
    (callbacks, hooks); GPU work is timed by `ComputeClock`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[0] += time.perf_counter() - start
    return wrapper


class ComputeClock:
    """The time spent in the calls `wrap` returns, on `device`: the host clock on CPU, CUDA events on the current
    stream around each call on a GPU (read in `seconds()`, which waits for the device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._seconds = [0.0]  # host time on CPU; events already read on a GPU
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def wrap(self, fn: Callable) -> Callable:
        """`fn`, timed on every call (`.__wrapped__` is `fn`)."""
        if self.device.type != "cuda":
            return timed(fn, self._seconds)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return fn(*args, **kwargs)
            finally:
                end.record()
                self._events.append((start, end))
        return wrapper

    def seconds(self) -> float:
        """The time inside the wrapped calls so far."""
        if self._events:
            synchronize(self.device)
            self._seconds[0] += sum(start.elapsed_time(end) for start, end in self._events) / 1000  # ms
            self._events.clear()
        return self._seconds[0]


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a no-op on CPU, where every call has finished when it returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(runner: PipelineRunner, input_ids: torch.Tensor, labels: torch.Tensor,
               attention_mask: torch.Tensor | None = None, steps: int = 3) -> tuple[float, float]:
    """(compute seconds, wall seconds) of `steps` pipeline steps on this rank, each step started with the pp group
    and the device in step and timed until the device has finished it. Collective over the pp group."""
    clock = ComputeClock(runner.device)
    # The compute methods of torch's PipelineStage objects (public API) and the runner's loss function.
    patched = [(stage, name) for stage in runner.pipeline_stages for name in _STAGE_COMPUTE]
    patched.append((runner, "loss_fn"))
    for obj, name in patched:
        setattr(obj, name, clock.wrap(getattr(obj, name)))
    wall = 0.0
    try:
        for _ in range(steps):
            dist.barrier(group=runner.pp_group)  # start every rank's timed step together
            synchronize(runner.device)
            start = time.perf_counter()
            runner.step(input_ids, labels, attention_mask)
            synchronize(runner.device)
            wall += time.perf_counter() - start
    finally:
        for obj, name in patched:
            setattr(obj, name, getattr(obj, name).__wrapped__)
    return clock.seconds(), wall


def measure_bubble(runner: PipelineRunner, input_ids: torch.Tensor, labels: torch.Tensor,
                   attention_mask: torch.Tensor | None = None, *, steps: int = 3,
                   warmup: int = 1) -> BubbleMeasurement:
    """Time `steps` pipeline steps (after `warmup` untimed ones) and return the measured bubble on every rank.

    Collective over the pp group. Gradients accumulate into the parameters: zero them afterwards.
    """
    for _ in range(max(warmup, 1)):  # the first step also builds the schedule that is instrumented by time_steps
        runner.step(input_ids, labels, attention_mask)
    busy, wall = time_steps(runner, input_ids, labels, attention_mask, steps)
    stats = torch.tensor([busy, wall], dtype=torch.float64, device=runner.device)
    everyone = [torch.zeros_like(stats) for _ in range(runner.pp)]
    dist.all_gather(everyone, stats, group=runner.pp_group)
    busy = [float(s[0]) / steps for s in everyone]
    step_s = max(float(s[1]) for s in everyone) / steps
    return BubbleMeasurement(
        schedule=runner.schedule_name, pp=runner.pp, n_microbatches=runner.n_microbatches,
        stages_per_rank=runner.stages_per_rank, step_s=step_s, busy_s=busy,
        bubble=sum(1 - b / step_s for b in busy) / len(busy),
        ideal=ideal_bubble_fraction(runner.pp, runner.n_microbatches, runner.stages_per_rank),
    )
