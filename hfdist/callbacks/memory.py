"""MemoryCallback: per-rank bytes of params, grads and optimizer state, and peak memory, in any HF Trainer."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from hfdist.metrics.memory import (
    cuda_memory_stats,
    innermost_optimizer,
    peak_memory_bytes,
    rank_state_bytes,
    reset_peak_memory,
)

__all__ = ["MemoryCallback"]


class MemoryCallback(TrainerCallback):
    """Measures what this rank holds, at the moments each quantity peaks.

    Gradients peak at one of two moments, measured both: at the end of backward (a post-accumulate hook on the
    first trainable parameter, the last to get its gradient; DDP and ZeRO-1 hold full gradients there) and just
    before the optimizer updates (a step pre-hook on the innermost torch optimizer, which DeepSpeed calls from
    inside its own step; FSDP2 and ZeRO-2/3 hold their gradient shards there). Params and optimizer state are
    measured just after the step.
    """

    def __init__(self) -> None:
        self.state_bytes: dict[str, int] = {}
        self.peak_grad_bytes = 0
        self._model: torch.nn.Module | None = None
        self._hooks: list = []
        self._device = torch.device("cpu")
        self._run_peaks: dict[str, int] = {}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._model = model
        self._device = args.device
        inner = innermost_optimizer(optimizer)
        if inner is not None:
            self._hooks = [inner.register_step_pre_hook(self._before_step),
                           inner.register_step_post_hook(self._after_step)]
        first_trainable = next((p for p in model.parameters() if p.requires_grad), None)
        if first_trainable is not None:
            self._hooks.append(first_trainable.register_post_accumulate_grad_hook(self._end_of_backward))
        reset_peak_memory(self._device)

    def _end_of_backward(self, param) -> None:
        self.peak_grad_bytes = max(self.peak_grad_bytes, rank_state_bytes(self._model)["grad_bytes"])

    def _before_step(self, optimizer, args, kwargs) -> None:
        grads = rank_state_bytes(self._model, optimizer)["grad_bytes"]
        self.peak_grad_bytes = max(self.peak_grad_bytes, grads)

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.state_bytes = rank_state_bytes(self._model, optimizer)

    def on_train_end(self, args, state, control, **kwargs):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def take_window(self) -> dict[str, int]:
        """This window's figures (CUDA peaks since the previous call, then reset); the run's peaks keep the max."""
        out = {k: v for k, v in self.state_bytes.items() if k != "grad_bytes"}
        out["grad_bytes"] = self.peak_grad_bytes
        out["peak_memory_bytes"] = peak_memory_bytes(self._device)
        out.update(cuda_memory_stats(self._device))
        for key in ("peak_memory_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "peak_active_bytes"):
            if key in out:
                self._run_peaks[key] = max(self._run_peaks.get(key, 0), out[key])
        reset_peak_memory(self._device)
        return out

    def record(self) -> dict[str, int]:
        """This rank's figures for the whole run: params, peak grads, optimizer state, master copies, peak memory
        (+ CUDA stats), the peaks being the max over all windows."""
        out = self.take_window()
        out.update(self._run_peaks)
        return out
