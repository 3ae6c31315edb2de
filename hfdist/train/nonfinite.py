"""The non-finite guard: a run whose loss or gradient norm stops being finite on any rank stops on every rank at that
step, before its optimizer step, and nothing non-finite is ever written.

Why hfdist stops it: left alone, the Trainer applies the NaN update, logs the step's loss as the mean of the earlier
ones (`logging_nan_inf_filter`: 0.0 when every step is logged), goes on saving checkpoints of NaN weights (rotating
the finite ones out) and saves a final model of NaNs, and exits 0: a diverged run (too high a learning rate, a bad
batch, an fp16 overflow) reported as a success with its last good state deleted.

Two checks, each one collective agreement (a max over [code, -rank] on a gloo group, as preemption's):
- every optimizer step, after the gradient norm and before the optimizer step: this rank's losses of the step (every
  micro-batch's) and the global gradient norm before clipping (the same number on every rank). DeepSpeed steps its
  optimizer inside the backward, so on its rungs the update of the non-finite step is already applied: the weights
  are never saved afterwards.
- before every save (checkpoint or final model): every trained parameter this rank holds (its shards) is finite: a
  finite step can still make an infinite update (a huge gradient times the learning rate).
A check that fails raises `TrainingDiverged` on every rank at once; the job writes the summary (the step's loss or
gradient norm as nan / inf), leaves the checkpoints it has (all finite, the last one not rotated out by any later
save), prints the paragraph and exits DIVERGED_EXIT_CODE.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from hfdist.errors import DIVERGED_EXIT_CODE, HfdistError

__all__ = ["DIVERGED_EXIT_CODE", "Diverged", "TrainingDiverged", "NonFiniteGuard"]
# What the agreement sends: 0 finite, else the first non-finite value's kind (what rank 0 prints).
_KINDS = {1: "nan", 2: "inf", 3: "-inf"}


def _kind(value: float) -> int:
    return 0 if math.isfinite(value) else 1 if math.isnan(value) else 2 if value > 0 else 3


@dataclass(frozen=True)
class Diverged:
    """Where and how a run stopped being finite.

    Attributes:
        step: the optimizer step (1-based) whose loss, gradient norm or update was not finite.
        what: "loss", "grad_norm" or "weights" (the update before a save).
        value: "nan", "inf" or "-inf".
        rank: the lowest rank that saw it (every rank, for the global gradient norm).
        loss: the step's loss, the mean over the ranks as the Trainer logs it (None for the weights, whose step
            logged its finite loss already).
        grad_norm: the step's gradient norm (None for the weights).
    """

    step: int
    what: str
    value: str
    rank: int
    loss: float | None = None
    grad_norm: float | None = None

    def record(self) -> dict[str, Any]:
        """As hfdist_summary.json's `diverged`."""
        return asdict(self)

    def paragraph(self) -> str:
        """The one paragraph the job ends with."""
        found = {"loss": f"the loss was {self.value} on rank {self.rank}",
                 "grad_norm": f"the gradient norm before clipping was {self.value}",
                 "weights": f"the update made rank {self.rank}'s weights {self.value} (its loss and gradient "
                            "norm were finite)"}[self.what]
        return (f"training diverged at step {self.step}: {found}, so every rank stopped before writing anything of "
                f"it (no model; the checkpoints in the output folder are all from earlier, finite steps). It is "
                "usually too high a learning rate (--learning-rate; a longer --warmup-steps), a gradient spike that "
                "--max-grad-norm does not bound, fp16 overflow, or a batch of bad data (empty labels, corrupt "
                "tokens); --resume continues from the last checkpoint once the cause is changed.")


class TrainingDiverged(HfdistError):
    """Raised on every rank at once when the guard finds a non-finite value (module docstring)."""

    def __init__(self, diverged: Diverged) -> None:
        super().__init__(diverged.paragraph())
        self.diverged = diverged


class NonFiniteGuard:
    """This rank's side of the two checks (module docstring); `group`: where the agreement runs (None: alone)."""

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None
        self._losses: list[torch.Tensor] = []

    def note_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss as the training step returns it to the Trainer (which sums a step's and logs their
        mean over the ranks): kept on its device, read at the step's check."""
        self._losses.append(loss.detach().float().reshape(-1)[:1])

    def _agree(self, code: int) -> tuple[int, int]:
        """(the highest code of any rank, the lowest rank with a code); collective."""
        if self.group is None:
            return code, 0
        rank, world = dist.get_rank(), dist.get_world_size()
        flags = torch.tensor([code, -rank if code else -world], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return int(flags[0]), -int(flags[1])

    def _mean_over_ranks(self, value: float) -> float:
        if self.group is None:
            return value
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total, group=self.group)
        return float(total) / dist.get_world_size()

    def check_step(self, step: int, grad_norm: float | torch.Tensor | None) -> None:
        """The step's loss on this rank and its gradient norm (global: the same on every rank); collective.

        Raises:
            TrainingDiverged: on every rank, when either is not finite on any rank.
        """
        loss = float(torch.cat([t.cpu() for t in self._losses]).double().sum()) if self._losses else 0.0
        self._losses.clear()
        norm = None if grad_norm is None else float(grad_norm)
        # One code per rank: the loss's kind (1-3), else the gradient norm's (4-6), else 0.
        mine = _kind(loss) or (_kind(norm) + 3 if norm is not None and _kind(norm) else 0)
        code, rank = self._agree(mine)
        if not code:
            return
        loss = self._mean_over_ranks(loss)  # the step's loss as the Trainer would have logged it
        what, value = ("loss", _KINDS[code]) if code <= 3 else ("grad_norm", _KINDS[code - 3])
        raise TrainingDiverged(Diverged(step, what, value, rank, loss=loss, grad_norm=norm))

    def check_weights(self, step: int, params: list[torch.Tensor]) -> None:
        """Every one of `params` (the trained parameters this rank holds) is finite; collective. Run before every
        save.

        Raises:
            TrainingDiverged: on every rank, when any rank holds a non-finite value.
        """
        from hfdist.parallel.dtensors import local_tensor

        code = 0
        with torch.no_grad():
            for p in params:
                local = local_tensor(p)
                if not local.is_floating_point() or local.numel() == 0:
                    continue
                # Two reductions and no temporary the size of the tensor (a save's memory is measured): a nan
                # propagates to both, an inf to one of them.
                extremes = (float(local.amax()), float(local.amin()))
                code = next((_kind(x) for x in extremes if not math.isfinite(x)), 0)
                if code:
                    break
        code, rank = self._agree(code)
        if code:
            raise TrainingDiverged(Diverged(step, "weights", _KINDS[code], rank))
