"""ContextParallelMixin: the Trainer's batches cut along the sequence for context parallelism, with hfdist's loss.

Every rank of a cp group gets the same batch (hfdist.train.trainer shards data over the data-parallel ranks only)
and trains on its tokens of every row (hfdist.parallel.context.shard_batch: labels shifted on the whole row first, so
the token before each cut still predicts the one after it; which tokens, the cp plan's layout: contiguous under
Ulysses, head-tail chunks under a ring). The loss is this rank's tokens' sum over the whole batch's label count,
which the Trainer counted on the whole rows before the cut (`get_cp_size` makes it count each token once); FSDP2
averages the gradients over dp_shard x cp, and the Trainer's loss scaling undoes the average.

Under pipeline stages (cp on `3d`) the batch is cut the same way before stage 0 (it is mixed in before the
PipelineMixin), and the stages get the whole rows' position ids besides, from which each rebuilds its micro-batch's
document boundaries for the attention (hfdist.parallel.pipeline.stage).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hfdist.parallel.context import cp_spec_of, shard_batch

__all__ = ["ContextParallelMixin"]


class ContextParallelMixin:
    """Mixed in before a CausalLMLossMixin trainer (HfdistTrainer), or before the PipelineMixin, when the rung has
    cp > 1."""

    def get_cp_size(self) -> int:
        """Ranks that hold one batch's sequences in parts: the Trainer divides its gathered token count by this
        too, so the loss is normalised by each real label token counted once."""
        return self.rung.dims.cp

    def training_step(self, model, inputs, num_items_in_batch=None):
        # The Trainer counted the batch's label tokens already, on the whole rows.
        return super().training_step(model, self._cp_shard(inputs), num_items_in_batch)

    def score(self, model: nn.Module, batch: dict[str, torch.Tensor], num_items_in_batch: float | None = None) -> float:
        """The mean token loss: each cp rank sums its tokens' losses, divided by the whole batch's label count (or
        `num_items_in_batch`), and the cp group adds the parts."""
        count = batch["labels"][:, 1:].ne(-100).sum() if num_items_in_batch is None else num_items_in_batch
        shard = self._cp_shard(batch)
        if self.rung.uses_pipeline:  # the last stage's partial sum, on every pipeline rank
            loss = torch.tensor(model.evaluate(shard, float(count)), device=batch["input_ids"].device)
        else:
            loss = self.causal_lm_loss(model, shard, num_items_in_batch=count)
        dist.all_reduce(loss, group=cp_spec_of(self.model).group)
        return float(loss.detach().float().cpu())

    def _cp_shard(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tokens of every sequence (hfdist.parallel.context.shard_batch)."""
        spec = cp_spec_of(self.model)
        return shard_batch(inputs, dist.get_rank(spec.group), spec.plan, row_positions=self.rung.uses_pipeline)
