"""PipelineModel: a rank's pipeline stages as one nn.Module the HF Trainer can own.

The Trainer builds its optimizer from `model.parameters()`, zeroes gradients and counts tokens with forward hooks.
Under pipeline parallelism a rank holds only its stages, and one training
"forward" is a whole schedule step (forward and backward of every micro-batch, interleaved across ranks), so this
wrapper:
- registers the local stages as submodules (their parameters are the rank's parameters, nothing else);
- runs `PipelineRunner.step` in `forward`: call it once per batch, with gradients enabled, and never call
  `.backward()` on what it returns (the schedule has already run the backward);
- offers what a trainer needs besides the step, so no trainer reaches into the runner: `evaluate` (a batch's loss on
  every rank), `clip_grad_norm_` (over every stage), `save_modules` and `original_name` (the full model's names of
  the local tensors, for saving and checkpoints), `has_last_stage`, `loss_chunk_size` and `receive_buffer_bytes`
  (what the stages receive into, for the memory meter).
Saving streams the stages' tensors into a HF checkpoint (hfdist.checkpoint.hf_export), by the names `save_modules`
maps back to the full model's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
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
        from transformers import GenerationConfig

        super().__init__()
        self.runner = runner
        self.stages = nn.ModuleList(runner.stages)
        self.config = config
        # What trainers built for HF models (TRL's) read and set besides the config: the generation settings (pad
        # and EOS tokens) and the tags of the model card.
        self.generation_config = GenerationConfig.from_model_config(config)
        self.model_tags: list[str] = []
        self.loss_scale = loss_scale

    def add_model_tags(self, tags: list[str] | str) -> None:
        """Tags for the model card (as a HF PreTrainedModel keeps them)."""
        self.model_tags += [tags] if isinstance(tags, str) else [t for t in tags if t not in self.model_tags]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, num_items_in_batch: int | torch.Tensor | None = None,
                shift_labels: torch.Tensor | None = None, row_position_ids: torch.Tensor | None = None,
                **_: object) -> torch.Tensor:
        """One schedule step on this batch: forward AND backward of every micro-batch; gradients accumulate.

        Args:
            num_items_in_batch: real label tokens of the global batch (all data-parallel ranks and accumulation
                steps); default: this batch's.
            shift_labels, row_position_ids: a cp rank's part of the batch (hfdist.parallel.context.shard_batch):
                the labels shifted on the whole rows before the cut, and the whole rows' position ids.

        Returns:
            On the rank of the last stage, this batch's loss share times `loss_scale` (a global-batch mean once
            averaged over data-parallel ranks, like the HF Trainer's losses); 0 on the other ranks.
        """
        num_tokens = None if num_items_in_batch is None else float(num_items_in_batch) / self.loss_scale
        loss = self.runner.step(input_ids, labels if shift_labels is None else shift_labels, attention_mask,
                                position_ids, num_tokens=num_tokens, shifted=shift_labels is not None,
                                row_position_ids=row_position_ids)
        if loss is None:
            return torch.zeros((), device=self.runner.device)
        return loss

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank runs the last stage (the one that computes the loss)."""
        return self.runner.has_last_stage

    def receive_buffer_bytes(self) -> int:
        """Bytes of the buffers this rank's stages receive activations and gradients into (allocated at the first
        step, kept for the run)."""
        return self.runner.receive_buffer_bytes()

    @property
    def loss_chunk_size(self) -> int | None:
        """Sequence positions per lm_head + cross-entropy chunk of the last stage (None: unchunked)."""
        return self.runner.loss_chunk_size

    @loss_chunk_size.setter
    def loss_chunk_size(self, value: int | None) -> None:
        self.runner.loss_chunk_size = value

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor], num_items_in_batch: float | None = None) -> float:
        """The mean token loss of `batch` (input_ids, labels, optional attention_mask / position_ids) with the
        current weights (its token-loss sum over `num_items_in_batch` when given), on every rank: the last stage's
        loss is broadcast over the pipeline group. Collective over the pipeline group; gradients and weights are
        left as they were."""
        runner = self.runner
        shifted = batch.get("shift_labels")
        box = [runner.evaluate(batch["input_ids"], batch["labels"] if shifted is None else shifted,
                               batch.get("attention_mask"), batch.get("position_ids"), num_tokens=num_items_in_batch,
                               shifted=shifted is not None, row_position_ids=batch.get("row_position_ids"))]
        dist.broadcast_object_list(box, group=runner.pp_group, group_src=runner.last_stage_rank)
        return float(box[0])

    @torch.no_grad()
    def last_logits(self, batch: dict[str, torch.Tensor], positions: torch.Tensor) -> torch.Tensor | None:
        """The whole logits of row b of `batch` at positions[b], (B, V), on the rank holding the last stage (None on
        the others): the forward-only schedule (PipelineRunner.last_logits). Collective over the pipeline group."""
        return self.runner.last_logits(batch["input_ids"], positions, batch.get("attention_mask"),
                                       batch.get("position_ids"))

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients of every stage (on all pipeline ranks) by their global L2 norm; returns that norm,
        the same on every rank. `float("inf")` only measures it. Collective over the pipeline group."""
        return self.runner.clip_grad_norm_(max_norm)

    def save_modules(self) -> list[tuple[nn.Module, object]]:
        """(stage, rename) pairs of this rank's stages, rename mapping a stage's parameter name to the full
        model's: what hfdist.models.load.local_tensors takes to save the full model's tensors from the stages."""
        return [(stage, stage.original_name) for stage in self.runner.stages]

    def original_name(self, fqn: str) -> str:
        """The full model's name of one of this module's parameters ("stages.<i>.<name in the stage>")."""
        _, index, local = fqn.split(".", 2)
        return self.runner.stages[int(index)].original_name(local)
