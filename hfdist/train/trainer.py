"""HfdistTrainer: the HF Trainer, taught that hfdist may already have parallelised the model, and checked.

DDP and DeepSpeed ZeRO go through the Trainer and accelerate unchanged. For FSDP2, TP and PP hfdist shards the model
itself; the Trainer then must neither wrap it in DDP nor move it, and must gather the shards to save. Under PP the
Trainer's model is a PipelineModel (hfdist.parallel.pipeline.model) whose forward runs a whole schedule step, so
the training step, gradient clipping and saving go through its runner. Before the first step the strategy in effect
is verified (hfdist.parallel.verify), and its precision (hfdist.train.precision). Every rung saves through
hfdist.checkpoint.hf_export: fp32, one tensor at a time.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments

from hfdist.checkpoint.trainer_hooks import CheckpointingMixin
from hfdist.config.ladder import Rung
from hfdist.metrics.memory import cuda_peaks_kept_through_resets
from hfdist.models.chunked_loss import DEFAULT_LOSS_CHUNK_SIZE, causal_lm_loss
from hfdist.parallel.context import cp_group_of, shard_batch
from hfdist.parallel.parallelize import verify_compiled
from hfdist.parallel.verify import verify_strategy
from hfdist.train.precision import PrecisionProbe, check_precision

__all__ = ["HfdistTrainer", "MeshTrainingArguments", "PRIVATE_OVERRIDES", "PRIVATE_CALLS"]

# The private Trainer methods overridden (name -> parameter names after self) and called; see the module docstring.
PRIVATE_OVERRIDES: dict[str, tuple[str, ...]] = {
    "_prepare_for_training": ("max_steps", "train_dataloader", "resume_from_checkpoint"),
    "_sync_replicated_trainable_parameters": ("model",),
    "_clip_grad_norm": ("model",),
    "_get_grad_norm": ("model", "grad_norm"),
    "_defer_fsdp_gradient_reduction": (),
    "_save": ("output_dir", "state_dict"),
    "_save_checkpoint": ("model", "trial"),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
}
PRIVATE_CALLS = ("_prepare_inputs", "_get_output_dir", "_save_rng_state", "_save_optimizer_and_scheduler")


@dataclass
class MeshTrainingArguments(TrainingArguments):
    """TrainingArguments for a model hfdist placed and sharded itself (the mesh rungs): the Trainer must never
    `.to(device)` it (its shards are already where they belong; FSDP2's CPU-offloaded parameters would be pulled
    onto the GPU, or raise). `place_model_on_device` is the switch TrainingArguments exposes for this."""

    @property
    def place_model_on_device(self) -> bool:
        return False


class HfdistTrainer(CheckpointingMixin, Trainer):
    """Trainer for a model hfdist may have sharded; verifies the rung before training; atomic checkpoints.

    Args:
        rung: the strategy asked for.
        lora: whether the model carries LoRA adapters (verified too).
        qlora: whether their base is QLoRA's 4-bit one (verified: 4-bit, sharded where the rung shards).
        checkpoint_identity: what a checkpoint records about the run, to refuse resuming another setup's.
        mixed_precision: "bf16" or "no", as the run trains (checked before the first step).
        skeleton: the full model's structure on the meta device (a PeftModel under LoRA): what saving writes.
        loss_chunk_size: sequence positions per lm_head + cross-entropy chunk (hfdist.models.chunked_loss: fused,
            or recomputing where lm_head is not a plain Linear), on every rung; None: the whole sequence at once.
        compile: whether the decoder layers were compiled (--compile; verified before the first step).
    """

    def __init__(self, *args, rung: Rung, lora: bool = False, qlora: bool = False,
                 checkpoint_identity: dict | None = None,
                 mixed_precision: str = "no", skeleton: torch.nn.Module | None = None,
                 loss_chunk_size: int | None = DEFAULT_LOSS_CHUNK_SIZE, compile: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loss_chunk_size = loss_chunk_size
        if rung.uses_pipeline:
            self.model.runner.loss_chunk_size = loss_chunk_size
        self.rung = rung
        self.lora = lora
        self.qlora = qlora
        self.checkpoint_identity = checkpoint_identity or {}
        self.mixed_precision = mixed_precision
        self.precision = PrecisionProbe()
        self.skeleton = skeleton
        self.compile = compile
        if rung.owns_sharding:
            # The Trainer's own switch for "the model already owns its placement and gradient reduction": with it,
            # accelerate prepares autocast only (no DDP wrap, no .to()) and saving joins all ranks.
            self.is_distributed_loading_by_transformers = True

    # -- tensor parallelism: ranks of one tp group share a batch; the loss runs vocab-parallel -------------------

    def get_tp_size(self) -> int:
        """Ranks that share one batch: tp x pp. The Trainer divides its gathered token count and its loss scaling
        (and the data-parallel world in the total batch size) by this, which is what both axes need."""
        return self.rung.dims.tp * self.rung.dims.pp

    def get_cp_size(self) -> int:
        """Ranks that hold one batch's sequences in chunks (context parallelism): the Trainer divides its gathered
        token count by this too, so the loss is normalised by each real label token counted once."""
        return self.rung.dims.cp

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        replicas = self.rung.dims.ranks_per_batch
        if replicas > 1:
            # accelerate shards batches over every process; the ranks of a tp / pp / cp group must see the same
            # batch, so shard over the data-parallel ranks only (cp, pp, tp innermost: dp rank = rank // replicas).
            shard = loader.batch_sampler
            shard.num_processes = self.rung.dims.dp
            shard.process_index = self.args.process_index // replicas
        return loader

    @torch.no_grad()
    def batch_loss(self, batch: dict[str, torch.Tensor]) -> float:
        """The mean token loss of `batch` through the trained (still distributed) model, on every rank.

        Collective: every rank calls it with the same batch. Under PP the last stage's loss is broadcast to the
        pipeline's other ranks.
        """
        batch = {k: v.to(self.args.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        model = self.model_wrapped
        model.eval()
        with self.loss_context(), self.compute_loss_context_manager():  # the training precision
            if self.rung.uses_pipeline:
                runner = model.runner
                box = [runner.evaluate(batch["input_ids"], batch["labels"], batch.get("attention_mask"),
                                       batch.get("position_ids"))]
                dist.broadcast_object_list(box, group=runner.pp_group, group_src=runner.last_stage_rank)
                return float(box[0])
            if self.rung.dims.cp > 1:
                return self._cp_batch_loss(model, batch)
            loss = self.causal_lm_loss(model, batch)
        return float(loss.detach().float().cpu())

    def _cp_batch_loss(self, model, batch: dict[str, torch.Tensor]) -> float:
        """The mean token loss under context parallelism: each cp rank sums its chunk's token losses, divided by
        the whole batch's label count, and the cp group adds the parts."""
        count = batch["labels"][:, 1:].ne(-100).sum()
        loss = self.causal_lm_loss(model, self._cp_shard(batch), num_items_in_batch=count)
        dist.all_reduce(loss, group=cp_group_of(self.model))
        return float(loss.detach().float().cpu())

    def _cp_shard(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's chunk of every sequence (hfdist.parallel.context.shard_batch)."""
        group = cp_group_of(self.model)
        return shard_batch(inputs, dist.get_rank(group), self.rung.dims.cp)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """`loss_parallel()` under TP (cross-entropy on vocab-sharded logits, forward and backward, where the loss
        is not fused: the fused loss does its vocab-parallel softmax itself), else nothing."""
        if self.rung.uses_tp:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def causal_lm_loss(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """The causal-LM loss, chunked and fused (hfdist.models.chunked_loss: never the whole batch's logits, lm_head's
        gradients computed in the forward); under TP vocab-parallel."""
        return causal_lm_loss(model, inputs, num_items_in_batch, self.loss_chunk_size)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.label_smoother is not None or self.compute_loss_func is not None:
            # A loss of the user's: HF computes it from the model's full logits.
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.precision.note_loss(out[0] if return_outputs else out)
            return out
        loss = self.causal_lm_loss(model, inputs, num_items_in_batch)
        self.precision.note_loss(loss)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # As the Trainer does: the gradient averaging over data-parallel ranks must not divide a global sum.
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        return (loss, None) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.rung.uses_pipeline:
            return self._pipeline_training_step(model, inputs, num_items_in_batch)
        if self.rung.dims.cp > 1:  # the Trainer counted the batch's label tokens already, on the whole rows
            inputs = self._cp_shard(inputs)
        with self.loss_context():  # backward too must run inside loss_parallel()
            return super().training_step(model, inputs, num_items_in_batch)

    # -- pipeline parallelism: one forward call is a schedule step (forward + backward of all micro-batches) -----

    def _pipeline_training_step(self, model, inputs, num_items_in_batch) -> torch.Tensor:
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.loss_context():
            loss = model(**inputs, num_items_in_batch=num_items_in_batch)
        if model.runner.has_last_stage:
            self.precision.note_loss(loss)
        # The Trainer logs the mean of this over all ranks. Only the last stage's ranks (1 in pp) hold a loss, and
        # it is already scaled by dp like any Trainer loss, so scaling it by pp makes that mean the batch loss.
        return loss.detach() * self.rung.dims.pp

    def _sync_replicated_trainable_parameters(self, model) -> None:
        if self.rung.uses_pipeline:
            # The Trainer would broadcast every plain-tensor parameter from rank 0 to all ranks, but pipeline ranks
            # hold different stages; replicas of one stage are FSDP2 modules that reduce their own gradients.
            return
        super()._sync_replicated_trainable_parameters(model)

    def _clip_grad_norm(self, model):
        if self.rung.uses_pipeline:  # the norm over every stage: each rank holds only its stages' gradients
            return self.model.runner.clip_grad_norm_(self.args.max_grad_norm)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if self.rung.uses_pipeline and grad_norm is None:
            grad_norm = self.model.runner.clip_grad_norm_(float("inf"))
        return super()._get_grad_norm(model, grad_norm)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self._saves_dcp():
            # The Trainer always makes a decay and a no-decay group; under LoRA the second is empty, and an empty
            # group breaks torch.distributed.checkpoint's flattened optimizer state (torch 2.13: IndexError on
            # resume). (DeepSpeed rungs may hold a placeholder without groups here: DeepSpeed builds the real one.)
            optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
        return optimizer

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        # DeepSpeed's engine resets CUDA's peak statistics while it builds (ZeRO-1/2, its bf16 optimizer): the
        # setup peak the memory meter reads at the first step must still count what came before.
        with cuda_peaks_kept_through_resets():
            model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader,
                                                                    resume_from_checkpoint)
        verify_strategy(self.rung, model, self.model, self.lora, qlora=self.qlora)
        if self.compile:
            verify_compiled(self.rung, self.model)
        check_precision(self.rung, self.mixed_precision, self.accelerator, model, self.model)
        self.precision.attach(self.model)
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

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        self._save(output_dir)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The model (or LoRA adapter) in fp32 as a HF checkpoint, one tensor at a time (collective), + tokenizer:
        on every rung, DeepSpeed AutoTP's (zero2_tp) included (its split layers' fp32 master slices)."""
        from hfdist.checkpoint.hf_export import save_hf_checkpoint
        from hfdist.models.load import local_tensors
        from hfdist.train.watchdog import solo_phase

        output_dir = output_dir or self.args.output_dir
        if self.rung.uses_pipeline:
            modules = [(stage, stage.original_name) for stage in self.model.runner.stages]
        else:
            modules = [(self.model, None)]
        with solo_phase("saving the model", "SAVE"):  # rank 0 writes every tensor while the others wait on it
            save_hf_checkpoint(output_dir, self.skeleton, local_tensors(modules), adapter_only=self.lora)
            if self.args.should_save and self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            if dist.is_initialized():
                dist.barrier()
