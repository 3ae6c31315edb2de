"""ContextParallelMixin: the Trainer's batches cut along the sequence for context parallelism, with hfdist's loss.

Every rank of a cp group gets the same batch (hfdist.train.trainer shards data over the data-parallel ranks only)
and trains on its chunk of every row (hfdist.parallel.context.shard_batch: labels shifted on the whole row first, so
each chunk's last token still predicts the next chunk's first). The loss is this rank's chunk's token sum over the
whole batch's label count, which the Trainer counted on the whole rows before the cut (`get_cp_size` makes it count
each token once); FSDP2 averages the gradients over dp_shard x cp, and the Trainer's loss scaling undoes the average.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hfdist.parallel.context import cp_group_of, shard_batch

__all__ = ["ContextParallelMixin"]


class ContextParallelMixin:
    """Mixed in before a CausalLMLossMixin trainer (HfdistTrainer) when the rung has cp > 1."""

    def get_cp_size(self) -> int:
        """Ranks that hold one batch's sequences in chunks: the Trainer divides its gathered token count by this
        too, so the loss is normalised by each real label token counted once."""
        return self.rung.dims.cp

    def training_step(self, model, inputs, num_items_in_batch=None):
        # The Trainer counted the batch's label tokens already, on the whole rows.
        return super().training_step(model, self._cp_shard(inputs), num_items_in_batch)

    def score(self, model: nn.Module, batch: dict[str, torch.Tensor], num_items_in_batch: float | None = None) -> float:
        """The mean token loss: each cp rank sums its chunk's token losses, divided by the whole batch's label
        count (or `num_items_in_batch`), and the cp group adds the parts."""
        count = batch["labels"][:, 1:].ne(-100).sum() if num_items_in_batch is None else num_items_in_batch
        loss = self.causal_lm_loss(model, self._cp_shard(batch), num_items_in_batch=count)
        dist.all_reduce(loss, group=cp_group_of(self.model))
        return float(loss.detach().float().cpu())

    def _cp_shard(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's chunk of every sequence (hfdist.parallel.context.shard_batch)."""
        group = cp_group_of(self.model)
        return shard_batch(inputs, dist.get_rank(group), self.rung.dims.cp)

