"""MemoryMeter: per-rank bytes of params, grads and optimizer state, and peak memory, per logging window.

Windows cover training only: the meter starts at the first step's setup (the model load and the optimizer's
creation are before it: their peak is kept apart as `setup_peak_memory_bytes`) and its last window closes when
training ends, before anything a script does afterwards (an evaluation, saving the model).

`training_peak_bytes` is what training's tensors need at their peak, the figure the memory planner predicts: on a
GPU the allocator's peak; on a CPU, which has no allocator statistics, the tensors of the second optimizer step
counted as they are made (hfdist.metrics.memory.LiveTensorBytes, from the end of the first step's update to the
second's: its forward, backward and every gradient, and FSDP2's unsharded parameters while they hold memory) on top
of what the rank held when it began (parameters, the optimizer's state, DDP's gradient buckets, a pipeline's receive
buffers). The second step is the first with the
optimizer's state in place, and the one in which DDP rebuilds its buckets; counting its ops makes it about a tenth
slower. Compiled layers are not
counted (the compiler would trace the counter): there, and when training ends before a second step, the figure is
the rank's state when training began plus what its resident set grew by. `training_resident_bytes` is always the
latter: on a CPU it also holds what glibc's heap keeps of freed tensors (measured up to twice a step's activations
on llama-small under TP), which no plan of the tensors counts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hfdist.metrics.memory import (
    LiveTensorBytes,
    cuda_memory_stats,
    innermost_optimizer,
    peak_memory_bytes,
    rank_state_bytes,
    reset_peak_memory,
    start_peak_window,
)
from hfdist.torch_private import fsdp_unsharded_storages

__all__ = ["MemoryMeter", "PEAK_KEYS", "COUNT_KEYS"]

# Peaks of a window (max over windows for the run); CUDA only except peak_memory_bytes (process peak RSS on CPU).
PEAK_KEYS = ("peak_memory_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "peak_active_bytes")
# The CUDA allocator's counters: cumulative over the process (reset_peak_memory_stats leaves them), so a window
# reports what was added since the previous one and the run what was added since training began.
COUNT_KEYS = ("alloc_retries", "ooms")


class MemoryMeter:
    """Measures what this rank holds, at the moments each quantity peaks.

    Gradients peak at one of two moments, measured both: at the end of backward (a post-accumulate hook on the
    first trainable parameter, the last to get its gradient; DDP and ZeRO-1 hold full gradients there) and just
    before the optimizer updates (a step pre-hook on the innermost torch optimizer, which DeepSpeed calls from
    inside its own step; FSDP2 and ZeRO-2/3 hold their gradient shards there). Params and optimizer state are
    measured just after the step.
    """

    def __init__(self) -> None:
        self._model: torch.nn.Module | None = None
        self._device = torch.device("cpu")
        self._hooks: list = []
        self._state_bytes: dict[str, int] = {}
        self._window_grad_bytes = 0
        self._run: dict[str, int] = {}
        self._counts_at_start: dict[str, int] = {}
        self._counts_seen: dict[str, int] = {}
        self._held_at_start = self._resident_at_start = 0
        self._held_outside: Callable[[], int] = lambda: 0
        self._steps = 0
        self._counter: LiveTensorBytes | None = None  # the second step's tensors, on CPU
        self._counted_peak: int | None = None
        self._counted_held = 0

    def start(self, model: torch.nn.Module, optimizer, device: torch.device,
              held_outside: Callable[[], int] = lambda: 0) -> None:
        """Hook the model and optimizer and open the first window (the peak so far becomes the setup peak).

        Args:
            held_outside: the bytes of training state not in the model's or optimizer's tensors (DDP's gradient
                buckets, a pipeline's receive buffers: hfdist.metrics.memory.held_outside_bytes), counted in
                `training_peak_bytes`; read now and again when the count starts, after the first step (which
                allocates the pipeline's).
        """
        self._model, self._device = model, device
        inner = innermost_optimizer(optimizer)
        if inner is not None:
            self._hooks = [inner.register_step_pre_hook(self._before_step),
                           inner.register_step_post_hook(self._after_step)]
        first_trainable = next((p for p in model.parameters() if p.requires_grad), None)
        if first_trainable is not None:
            self._hooks.append(first_trainable.register_post_accumulate_grad_hook(self._end_of_backward))
        self._run = {"setup_peak_memory_bytes": peak_memory_bytes(device)}
        counts = cuda_memory_stats(device)
        self._counts_at_start = self._counts_seen = {k: counts[k] for k in COUNT_KEYS if k in counts}
        self._held_outside = held_outside
        self._held_at_start = sum(rank_state_bytes(model, optimizer).values()) + held_outside()
        self._resident_at_start = start_peak_window(device)
        self._steps = 0
        # the count closes at the optimizer's step pre-hook: none without a torch optimizer to hook
        self._count_tensors = device.type == "cpu" and inner is not None and not any(
            getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())

    def _end_of_backward(self, param) -> None:
        self._window_grad_bytes = max(self._window_grad_bytes, rank_state_bytes(self._model)["grad_bytes"])

    def _before_step(self, optimizer, args, kwargs) -> None:
        grads = rank_state_bytes(self._model, optimizer)["grad_bytes"]
        self._window_grad_bytes = max(self._window_grad_bytes, grads)
        if self._counter is not None:  # the second step's forward and backward are done: its gradients are live
            self._counted_peak = self._counted_held + self._counter.peak
            self._stop_counting()

    def _after_step(self, optimizer, args, kwargs) -> None:
        self._state_bytes = rank_state_bytes(self._model, optimizer)

    def step_end(self) -> None:
        """The Trainer's optimizer step has ended: after the first, start counting the second's tensors. (Steps are
        the Trainer's: DeepSpeed calls the torch optimizer's step once per parameter group, so its hooks fire
        several times a step.)"""
        self._steps += 1
        if self._steps == 1 and self._count_tensors:
            held = self._state_bytes
            # what the second step starts with; its gradients are freed and made again inside the count
            self._counted_held = held["param_bytes"] + held["optimizer_bytes"] + held["master_bytes"] + \
                self._held_outside()
            self._counter = LiveTensorBytes(resized=fsdp_unsharded_storages(self._model))
            self._counter.__enter__()

    def _stop_counting(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None

    def take_window(self) -> dict[str, int]:
        """This window's figures: the state bytes after its last step, its peak gradient bytes, its memory peaks
        (then reset) and the allocator's retries and OOMs in it."""
        out = {k: v for k, v in self._state_bytes.items() if k != "grad_bytes"}
        out["grad_bytes"] = self._window_grad_bytes
        out["peak_memory_bytes"] = peak_memory_bytes(self._device)
        stats = cuda_memory_stats(self._device)
        out.update({k: v for k, v in stats.items() if k in PEAK_KEYS})
        for key in COUNT_KEYS:
            if key in stats:
                out[key] = stats[key] - self._counts_seen.get(key, 0)
        self._counts_seen = {k: stats[k] for k in COUNT_KEYS if k in stats}
        for key in (*PEAK_KEYS, "grad_bytes"):
            if key in out:
                self._run[key] = max(self._run.get(key, 0), out[key])
        self._window_grad_bytes = 0
        reset_peak_memory(self._device)
        return out

    def finish(self) -> dict[str, int]:
        """Close the last window and unhook; returns this rank's figures for the whole of training: the state
        bytes, the peaks over all windows, the setup peak, and the retries and OOMs since training began."""
        self._stop_counting()
        last = self.take_window()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        out = {**last, **self._run}
        if self._device.type == "cuda":
            out["training_peak_bytes"] = out["training_resident_bytes"] = out["peak_memory_bytes"]
        else:
            out["training_resident_bytes"] = self._held_at_start + max(
                out["peak_memory_bytes"] - self._resident_at_start, 0)
            out["training_peak_bytes"] = (self._counted_peak if self._counted_peak is not None
                                          else out["training_resident_bytes"])
        for key in COUNT_KEYS:
            if key in self._counts_seen:
                out[key] = self._counts_seen[key] - self._counts_at_start.get(key, 0)
        return out
