"""ThroughputCallback: per-rank step time and real (non-padding) tokens per second, in any HF Trainer."""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback

__all__ = ["ThroughputCallback"]


class ThroughputCallback(TrainerCallback):
    """Counts the tokens this rank's model really sees (a forward pre-hook) and times each optimizer step.

    Token counts stay on the device between steps so the hook never forces a GPU sync; the first step (warm-up,
    lazy init, DeepSpeed/FSDP first all-gathers) is left out of the rate when there is more than one step.
    """

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self.step_tokens: list[int] = []
        self.step_samples: list[int] = []
        self._pending_tokens: torch.Tensor | int = 0
        self._pending_samples = 0
        self._t0 = 0.0
        self._hook = None
        self._device = torch.device("cpu")
        self._window_start = 0

    def _count_tokens(self, module, args, kwargs) -> None:
        if not module.training:
            return
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self._pending_samples += ids.shape[0]
        if mask is not None and mask.dim() == 2:  # a padding mask; a packed batch's 4-D block mask counts all
            self._pending_tokens = self._pending_tokens + mask.sum()
        elif ids is not None:
            self._pending_tokens = self._pending_tokens + ids.numel()

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._device = args.device
        self._hook = model.register_forward_pre_hook(self._count_tokens, with_kwargs=True)

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        self.step_times.append(time.perf_counter() - self._t0)
        self.step_tokens.append(int(self._pending_tokens))
        self.step_samples.append(self._pending_samples)
        self._pending_tokens = self._pending_samples = 0

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def take_window(self) -> dict[str, float]:
        """Steps, seconds and tokens since the previous call (one logging window)."""
        start, self._window_start = self._window_start, len(self.step_times)
        seconds = sum(self.step_times[start:])
        tokens, samples = sum(self.step_tokens[start:]), sum(self.step_samples[start:])
        return {"steps": len(self.step_times) - start, "step_seconds": seconds / max(len(self.step_times) - start, 1),
                "tokens": tokens, "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
                "samples_per_second": samples / seconds if seconds > 0 else 0.0}

    def record(self) -> dict[str, float]:
        """Tokens/s of this rank (warm-up step excluded when possible), mean step time, total tokens."""
        skip = 1 if len(self.step_times) > 1 else 0
        seconds = sum(self.step_times[skip:])
        tokens = sum(self.step_tokens[skip:])
        return {
            "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "samples_per_second": sum(self.step_samples[skip:]) / seconds if seconds > 0 else 0.0,
            "mean_step_seconds": seconds / max(len(self.step_times) - skip, 1),
            "tokens": sum(self.step_tokens),
            "steps": len(self.step_times),
        }
