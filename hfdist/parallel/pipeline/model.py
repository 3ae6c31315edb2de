"""PipelineModel: a rank's pipeline stages as one nn.Module the HF Trainer can own.

The Trainer builds its optimizer from `model.parameters()`, zeroes gradients and counts tokens with forward hooks.
Under pipeline parallelism a rank holds only its stages, and one training
"forward" is a whole schedule step (forward and backward of every micro-batch, interleaved across ranks), so this
wrapper:
- registers the local stages as submodules (their parameters are the rank's parameters, nothing else);
- runs `PipelineRunner.step` in `forward`: call it once per batch, with gradients enabled, and never call
  `.backward()` on what it returns (the schedule has already run the backward).
Saving streams the stages' tensors into a HF checkpoint (hfdist.checkpoint.hf_export), by the names `runner.stages` map
back to the full model's.
"""

from __future__ import annotations

import torch
from torch import nn

from hfdist.parallel.pipeline.runner import PipelineRunner

__all__ = ["PipelineModel"]


class PipelineModel(nn.Module):
    """The local pipeline stages of one rank, trained one schedule step per `forward` call.

    Args:
        runner: the PipelineRunner built from the full model (which the caller then drops).
        config: the full model's HF config (the Trainer reads it).
        loss_scale: multiplies the per-token normaliser's reciprocal: with FSDP2 averaging gradients over `dp`
            data-parallel replicas, pass dp so the averaged gradients are those of the global token mean.
    """

    # The HF Trainer passes num_items_in_batch (the global token count) only to models that accept loss kwargs.
    accepts_loss_kwargs = True
    # Tells the Trainer the loss shifts labels, so it counts num_items_in_batch over labels[..., 1:] as HF does.
    loss_type = "ForCausalLM"
    main_input_name = "input_ids"

    def __init__(self, runner: PipelineRunner, config, loss_scale: int = 1):
        super().__init__()
        self.runner = runner
        self.stages = nn.ModuleList(runner.stages)
        self.config = config
        self.loss_scale = loss_scale

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, num_items_in_batch: int | torch.Tensor | None = None,
                **_: object) -> torch.Tensor:
        """One schedule step on this batch: forward AND backward of every micro-batch; gradients accumulate.

        Args:
            num_items_in_batch: real label tokens of the global batch (all data-parallel ranks and accumulation
                steps); default: this batch's.

        Returns:
            On the rank of the last stage, this batch's loss share times `loss_scale` (a global-batch mean once
            averaged over data-parallel ranks, like the HF Trainer's losses); 0 on the other ranks.
        """
        num_tokens = None if num_items_in_batch is None else float(num_items_in_batch) / self.loss_scale
        loss = self.runner.step(input_ids, labels, attention_mask, position_ids, num_tokens=num_tokens)
        if loss is None:
            return torch.zeros((), device=self.runner.device)
        return loss
