"""Faults a test injects into a real run, through the environment, to show that hfdist notices them.

    HFDIST_INJECT_GRAD_SCALE=RANK:FACTOR[:RUNG[:NAME]]
        rank RANK (`*`: every rank) multiplies its gradients by FACTOR after every backward, before their norm and
        the optimizer step; only in runs of the rung RUNG when given (empty: any), only the parameters whose names
        contain NAME when given (e.g. `experts`). A layout that is not the same math as the others: one rank's
        expert gradients x 2, or every rank's x 0.5 as a wrong average over data-parallel ranks would make them.
        Under Adam a positive factor leaves the losses nearly as they were (its update, m / sqrt(v), is the same for
        g and c g); the gradient norm shows it (hfdist.report.same_math, tests/e2e/test_cells.py).

    HFDIST_INJECT_FIXED_COMPLETIONS=1
        GRPO's rollouts return fixed completions instead of sampling the model: each a function of its prompt, the
        step and its place among the prompt's --num-generations copies (fixed_completion), whatever the layout. One
        GRPO step on a fixed set of completions is then the same math on every rung (the loss and the gradient of
        the model's log-probabilities of those completions), which sampling, drawn from each rank's own random
        stream, is not (tests/e2e/test_cells.py's grpo cells).

Nothing here runs unless the variable is set; the job hands the hooks to its trainer only then (hfdist.job.run,
hfdist.train.trainer.StrategyMixin.gradient_hooks).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["GRAD_SCALE_ENV", "FIXED_COMPLETIONS_ENV", "GradientScale", "injected_faults", "fixed_completion"]

GRAD_SCALE_ENV = "HFDIST_INJECT_GRAD_SCALE"
FIXED_COMPLETIONS_ENV = "HFDIST_INJECT_FIXED_COMPLETIONS"


def fixed_completion(prompt_ids: list[int], step: int, copy: int, vocab: range, max_length: int) -> list[int]:
    """The completion a fixed rollout returns for `prompt_ids` at `step`, the prompt's copy number `copy`: 1 to
    `max_length` token ids from `vocab`, drawn by a generator seeded from those three alone."""
    seed = hash((tuple(prompt_ids), step, copy)) & 0x7FFFFFFF  # tuples of ints hash the same in every process
    generator = torch.Generator().manual_seed(seed)
    length = int(torch.randint(1, max_length + 1, (1,), generator=generator))
    return (torch.randint(vocab.start, vocab.stop, (length,), generator=generator)).tolist()


class GradientScale:
    """Multiplies this rank's gradients (of the parameters whose names contain `name`, all when empty) by
    `factor`."""

    def __init__(self, factor: float, name: str = "") -> None:
        self.factor = factor
        self.name = name

    def __call__(self, model: nn.Module) -> None:
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if p.grad is not None and self.name in param_name:
                    p.grad.mul_(self.factor)


def injected_faults(rank: int, rung: str) -> list[Callable[[nn.Module], None]]:
    """The gradient hooks the environment asks this rank of a run of `rung` to run (none unless a HFDIST_INJECT_*
    variable is set).

    Raises:
        ValueError: a variable that is not RANK:FACTOR[:RUNG[:NAME]].
    """
    spec = os.environ.get(GRAD_SCALE_ENV)
    if not spec:
        return []
    try:
        target, factor, *rest = spec.split(":")
        scale = float(factor)
        if len(rest) > 2 or (target != "*" and not target.isdigit()):
            raise ValueError(spec)
    except ValueError as exc:
        raise ValueError(f"{GRAD_SCALE_ENV}={spec!r} is not RANK:FACTOR[:RUNG[:NAME]] (e.g. 1:2.0:fsdp_tp, or "
                         "*:0.5:fsdp_cp, or 0:2.0:fsdp_ep:experts).") from exc
    only, name = (rest + ["", ""])[:2]
    if (target != "*" and int(target) != rank) or (only and only != rung):
        return []
    return [GradientScale(scale, name)]
