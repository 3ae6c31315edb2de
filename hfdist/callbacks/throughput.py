"""ThroughputMeter: per-rank optimizer-step times, the time each step waited for its data, and the real
(non-padding) tokens the model sees, with the lengths of their sequences for the FLOPs of each batch."""

from __future__ import annotations

import time

import torch

from hfdist.metrics.flops import batch_lengths

__all__ = ["ThroughputMeter"]


def _as_int(value: torch.Tensor | int) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


class ThroughputMeter:
    """Counts what this rank's model really sees (a forward pre-hook) and times each optimizer step.

    Counts stay on the device until a window is read, so the hook never syncs a GPU; each step's bounds are
    synchronised (the Trainer already syncs every micro-batch for its NaN filter, so this costs no overlap).
    The first step (warm-up, lazy init, DeepSpeed/FSDP first all-gathers) is left out of the run's rates when there
    is more than one step.
    """

    def __init__(self) -> None:
        self._device = torch.device("cpu")
        self._hook = None
        self._t0 = 0.0
        self._idle_since: float | None = None  # when the previous step (and its logging / saving) ended
        self._wait = 0.0
        self._pending = [0, 0, 0]  # tokens, sum of squared sequence lengths, samples: since the step began
        # [seconds, tokens, squared lengths, samples, data wait seconds] per step, counts read lazily
        self._steps: list[list] = []
        self._window_start = 0

    def start(self, model: torch.nn.Module, device: torch.device) -> None:
        """Count the batches `model`'s forward receives in training mode from now on."""
        self._device = device
        self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        if not module.training:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        tokens, squares = batch_lengths(ids, kwargs.get("attention_mask"), kwargs.get("position_ids"))
        self._pending[0] = self._pending[0] + tokens
        self._pending[1] = self._pending[1] + squares
        self._pending[2] += ids.shape[0] if ids is not None else 0

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def idle(self) -> None:
        """Mark the end of the rank's own work between steps (the step, its logging, its checkpoint): the time from
        the last mark to the next step's begin is its data wait (the Trainer fetches and collates all of a step's
        micro-batches just before the step begins)."""
        self._idle_since = time.perf_counter()

    def step_begin(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()
        self._wait = self._t0 - self._idle_since if self._idle_since is not None else 0.0

    def step_end(self) -> None:
        self._sync()
        self._steps.append([time.perf_counter() - self._t0, *self._pending, self._wait])
        self._pending = [0, 0, 0]
        self.idle()

    def _totals(self, steps: list[list]) -> dict[str, float]:
        for step in steps:
            step[1:4] = [_as_int(v) for v in step[1:4]]
        seconds = sum(s[0] for s in steps)
        return {"steps": len(steps), "seconds": seconds, "tokens": sum(s[1] for s in steps),
                "squared_lengths": sum(s[2] for s in steps), "samples": sum(s[3] for s in steps),
                "data_wait": sum(s[4] for s in steps)}

    def take_window(self) -> dict[str, float]:
        """Steps, seconds, tokens, their sequences' squared lengths, samples and data-wait seconds since the
        previous call."""
        start, self._window_start = self._window_start, len(self._steps)
        return self._totals(self._steps[start:])

    def finish(self) -> dict[str, dict[str, float]]:
        """Unhook; returns the totals of every step ("all") and of the steps that rates use ("rated": all but the
        first when there are several)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        skip = 1 if len(self._steps) > 1 else 0
        return {"all": self._totals(self._steps), "rated": self._totals(self._steps[skip:])}
