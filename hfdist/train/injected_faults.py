"""Faults a test injects into a real run, through the environment, to show that hfdist notices them.

    HFDIST_INJECT_GRAD_SCALE=RANK:FACTOR[:RUNG]   rank RANK multiplies its gradients by FACTOR before every
                                                  optimizer step (only in runs of the rung RUNG, when given): a
                                                  layout that is not the same math as the others (hfdist tune must
                                                  flag its losses and never choose it; under Adam a
                                                  negative FACTOR shows in the first update, a positive one not:
                                                  its first step, m / sqrt(v), is the same for g and c g)

Nothing here runs unless the variable is set; the job adds the callback only then (hfdist.job.run).
"""

from __future__ import annotations

import os

from transformers import TrainerCallback

__all__ = ["GRAD_SCALE_ENV", "InjectedFaults", "injected_faults"]

GRAD_SCALE_ENV = "HFDIST_INJECT_GRAD_SCALE"


class InjectedFaults(TrainerCallback):
    """Scales this rank's gradients by `factor` before each optimizer step."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        import torch

        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.factor)


def injected_faults(rank: int, rung: str) -> list[TrainerCallback]:
    """The callbacks the environment asks this rank of a run of `rung` to run (none unless a HFDIST_INJECT_*
    variable is set).

    Raises:
        ValueError: a variable that is not RANK:FACTOR[:RUNG].
    """
    spec = os.environ.get(GRAD_SCALE_ENV)
    if not spec:
        return []
    try:
        target, factor, *only = spec.split(":")
        target_rank, scale = int(target), float(factor)
        if len(only) > 1:
            raise ValueError(spec)
    except ValueError as exc:
        raise ValueError(f"{GRAD_SCALE_ENV}={spec!r} is not RANK:FACTOR[:RUNG] (e.g. 1:2.0:fsdp_tp).") from exc
    return [InjectedFaults(scale)] if rank == target_rank and (not only or only[0] == rung) else []
