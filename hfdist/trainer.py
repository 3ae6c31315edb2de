"""HfdistTrainer: the HF Trainer, taught that hfdist may already have parallelised the model, and checked.

DDP and DeepSpeed ZeRO go through the Trainer and accelerate unchanged. For FSDP2 (and later TP/PP) hfdist shards
the model itself; the Trainer then must neither wrap it in DDP nor move it, and must gather the shards to save.
Before the first step the strategy in effect is verified (hfdist.verify).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from transformers import Trainer

from hfdist.ladder import Rung
from hfdist.verify import verify_strategy

__all__ = ["HfdistTrainer", "gather_full_state_dict"]


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of a DTensor-sharded model, on CPU; collective, call on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class HfdistTrainer(Trainer):
    """Trainer for a model hfdist may have sharded; verifies the rung before training.

    Args:
        rung: the strategy asked for.
        lora: whether the model carries LoRA adapters (verified too).
    """

    def __init__(self, *args, rung: Rung, lora: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rung = rung
        self.lora = lora
        if rung.kind == "fsdp":
            # The Trainer's own switch for "the model already owns its placement and gradient reduction": with it,
            # accelerate prepares autocast only (no DDP wrap, no .to()) and saving joins all ranks.
            self.is_distributed_loading_by_transformers = True

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        verify_strategy(self.rung, model, self.model, self.lora)
        return model, train_dataloader

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """Gradient accumulation under FSDP2: skip the cross-replica all-reduce (HSDP) or all reduction until the
        last micro-batch of the step."""
        if self.rung.dims.dp_replicate > 1:
            self.model.set_requires_all_reduce(False)
        else:
            self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self.rung.kind != "fsdp":
            return super()._save(output_dir, state_dict)
        output_dir = output_dir or self.args.output_dir
        full = gather_full_state_dict(self.model)  # every rank takes part in the all-gathers
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            self.model.save_pretrained(output_dir, state_dict=full, safe_serialization=True)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
        if dist.is_initialized():
            dist.barrier()
