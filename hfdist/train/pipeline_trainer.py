"""PipelineMixin: the Trainer's step, clipping, saving and checkpoint names when the model is cut into pipeline
stages.

Under pipeline parallelism the Trainer's model is a PipelineModel (hfdist.parallel.pipeline.model) whose forward runs
a whole schedule step (forward and backward of every micro-batch), so the training step calls it once and never
calls backward; gradient clipping and the grad norm span every stage (each rank holds only its own); the Trainer's
broadcast of replicated parameters from rank 0 must not run (pipeline ranks hold different stages); saving and
checkpoints name each stage's tensors by the full model's names. The loss is the one the last stage computes: the
causal-LM token mean, which is why only trainers whose loss that is can run on pipeline stages.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["PipelineMixin"]


class PipelineMixin:
    """Mixed in before a StrategyMixin trainer whose model is a PipelineModel (the rung has pp > 1)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if hasattr(self, "loss_chunk_size"):  # the last stage computes the loss, chunked as the trainer's would be
            self.model.loss_chunk_size = self.loss_chunk_size

    def get_tp_size(self) -> int:
        """The pipeline's ranks share a batch like tensor-parallel ranks: the Trainer divides its token count and
        loss scaling by tp x pp."""
        return super().get_tp_size() * self.rung.dims.pp

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """One schedule step: forward and backward of every micro-batch (the model's forward runs both)."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.loss_context():
            loss = model(**inputs, num_items_in_batch=num_items_in_batch)
        if model.has_last_stage:
            self.precision.note_loss(loss)
        # The Trainer logs the mean of this over all ranks. Only the last stage's ranks (1 in pp) hold a loss, and
        # it is already scaled by dp like any Trainer loss, so scaling it by pp makes that mean the batch loss.
        loss = loss.detach() * self.rung.dims.pp
        self.nonfinite.note_loss(loss)
        return loss

    def score(self, model: nn.Module, batch: dict[str, torch.Tensor], num_items_in_batch: float | None = None) -> float:
        """The batch's mean token loss (its sum over `num_items_in_batch` when given) through the schedule's
        forward-only evaluation, on every rank."""
        return model.evaluate(batch, num_items_in_batch)

    def last_token_logits(self, batch: dict[str, torch.Tensor], positions: torch.Tensor) -> torch.Tensor | None:
        """Generation's forward: the schedule's forward-only pass, the whole logits at `positions` on the last
        stage's rank (None elsewhere)."""
        return self.model.last_logits(self._prepare_inputs(batch), positions)

    def _sync_replicated_trainable_parameters(self, model) -> None:
        # The Trainer would broadcast every plain-tensor parameter from rank 0 to all ranks, but pipeline ranks hold
        # different stages; replicas of one stage are FSDP2 modules that reduce their own gradients.
        return

    def _clip_grad_norm(self, model):
        return self.model.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.model.clip_grad_norm_(float("inf"))
        return super()._get_grad_norm(model, grad_norm)

    def save_modules(self) -> list[tuple[nn.Module, object]]:
        return self.model.save_modules()

    def _canonical_name(self):
        return self.model.original_name

