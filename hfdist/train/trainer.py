"""HfdistTrainer: the HF Trainer, taught that hfdist may already have parallelised the model, and checked.

DDP and DeepSpeed ZeRO go through the Trainer and accelerate unchanged. For FSDP2 and TP hfdist shards the model
itself; the Trainer then must neither wrap it in DDP nor move it, and must gather the shards to save. Before the first
step the strategy in effect is verified (hfdist.parallel.verify), and its precision (hfdist.train.precision). Every
rung saves through hfdist.checkpoint.hf_export: fp32, one tensor at a time.

`StrategyMixin` holds all of that for any Trainer subclass; `CausalLMLossMixin` is hfdist's loss (the chunked
causal-LM loss, vocab-parallel under TP); `HfdistTrainer` is the two on the Trainer. The strategies that change the
training step live in their own mixins: hfdist.train.pipeline_trainer (pipeline stages) and
hfdist.train.context_trainer (context parallelism). hfdist.api.strategy_trainer puts the mixins a strategy needs in
front of any Trainer subclass; the Trainer must not place a model hfdist placed itself (the arguments say so:
hfdist.api.strategy.placed_by_hfdist).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer

from hfdist.checkpoint.trainer_hooks import CheckpointingMixin
from hfdist.config.ladder import Rung
from hfdist.metrics.memory import cuda_peaks_kept_through_resets
from hfdist.models.chunked_loss import DEFAULT_LOSS_CHUNK_SIZE, causal_lm_loss
from hfdist.models.router_stats import router_recorder
from hfdist.parallel.parallelize import verify_compiled
from hfdist.parallel.verify import verify_strategy
from hfdist.train.evaluation import EvaluationMixin
from hfdist.train.nonfinite import NonFiniteGuard
from hfdist.train.precision import PrecisionProbe, check_precision
from hfdist.train.preemption import PreemptionMixin, agreement_group

__all__ = ["StrategyMixin", "CausalLMLossMixin", "HfdistTrainer", "PRIVATE_OVERRIDES", "PRIVATE_CALLS"]

# The private Trainer methods overridden by hfdist's trainer classes and mixins (name -> parameter names after self),
# and those they call: tests/unit/test_trainer_contract.py checks them against the installed transformers.
PRIVATE_OVERRIDES: dict[str, tuple[str, ...]] = {
    "_prepare_for_training": ("max_steps", "train_dataloader", "resume_from_checkpoint"),
    "_sync_replicated_trainable_parameters": ("model",),  # pipeline only
    "_clip_grad_norm": ("model",),
    "_get_grad_norm": ("model", "grad_norm"),
    "_defer_fsdp_gradient_reduction": (),
    "_save": ("output_dir", "state_dict"),
    "_save_checkpoint": ("model", "trial"),
    "_finalize_training": ("trial", "num_train_samples", "start_time"),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
}
PRIVATE_CALLS = ("_prepare_inputs", "_get_output_dir", "_save_rng_state", "_save_optimizer_and_scheduler",
                 "_load_best_model")


class StrategyMixin(PreemptionMixin, CheckpointingMixin):
    """Mixed in before a transformers.Trainer (subclass): trains a model hfdist prepared for `rung`, verified before
    the first step; atomic, layout-free checkpoints (hfdist.checkpoint.trainer_hooks); a checkpoint and a stop on a
    preemption signal (hfdist.train.preemption: `preempt_signals=`, `preempted`); a stop on every rank, with nothing
    written, at a non-finite loss, gradient norm or update (hfdist.train.nonfinite: TrainingDiverged); streamed fp32
    saves.

    Args:
        rung: the strategy asked for.
        lora: whether the model carries LoRA adapters (verified too).
        qlora: whether their base is QLoRA's 4-bit one (verified: 4-bit, sharded where the rung shards).
        checkpoint_identity: what a checkpoint records about the run, to refuse resuming another setup's.
        mixed_precision: "bf16" or "no", as the run trains (checked before the first step).
        skeleton: the full model's structure on the meta device (a PeftModel under LoRA): what saving writes.
        compile: whether the decoder layers were compiled (--compile; verified before the first step).
        attention: the attention implementation the run resolved (verified before the first step).
        fp8: the float8 recipe the decoder projections compute with (--fp8; verified before the first step), or
            None.
    """

    def __init__(self, *args, rung: Rung, lora: bool = False, qlora: bool = False,
                 checkpoint_identity: dict | None = None,
                 mixed_precision: str = "no", skeleton: nn.Module | None = None, compile: bool = False,
                 attention: str | None = None, fp8: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.attention = attention
        self.rung = rung
        self.lora = lora
        self.qlora = qlora
        self.checkpoint_identity = checkpoint_identity or {}
        self.mixed_precision = mixed_precision
        self.precision = PrecisionProbe()
        self.nonfinite = NonFiniteGuard()
        # Run on the model after each step's backward, before the gradients' norm (tests plant faults here:
        # hfdist.train.injected_faults).
        self.gradient_hooks: list[Callable[[nn.Module], None]] = []
        self.skeleton = skeleton
        self.compile = compile
        self.fp8 = fp8
        if fp8 is not None:  # the scales of FSDP2's float8 all-gather, once per step (a no-op without it)
            from hfdist.train.float8_scales import Float8ScalesCallback

            self.add_callback(Float8ScalesCallback())
        if rung.owns_sharding:
            # The Trainer's own switch for "the model already owns its placement and gradient reduction": with it,
            # accelerate prepares autocast only (no DDP wrap, no .to()) and saving joins all ranks.
            self.is_distributed_loading_by_transformers = True

    # -- ranks that share a batch --------------------------------------------------------------------------------

    def get_tp_size(self) -> int:
        """Ranks that share one batch as tensor-parallel ranks: the Trainer divides its gathered token count and its
        loss scaling (and the data-parallel world in the total batch size) by this."""
        return self.rung.dims.tp

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

    def loss_context(self) -> contextlib.AbstractContextManager:
        """`loss_parallel()` under TP (cross-entropy on vocab-sharded logits, forward and backward, where the loss
        is not fused: the fused loss does its vocab-parallel softmax itself), else nothing."""
        if self.rung.uses_tp:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def training_step(self, model, inputs, num_items_in_batch=None):
        with self.loss_context():  # backward too must run inside loss_parallel()
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.nonfinite.note_loss(loss)
        return loss

    def _clip_grad_norm(self, model):
        """The gradient norm over every mesh (hfdist.parallel.grad_norm), clipped to max_grad_norm, on the rungs whose
        sharding hfdist applies; the Trainer's own (accelerate's, DeepSpeed's) elsewhere."""
        for hook in self.gradient_hooks:
            hook(self.model)
        if not self.rung.owns_sharding:
            return super()._clip_grad_norm(model)
        from hfdist.parallel.grad_norm import clip_grad_norm

        return clip_grad_norm(model.parameters(), self.args.max_grad_norm, device=self.args.device)

    def _get_grad_norm(self, model, grad_norm=None):
        # The Trainer norms the gradients for its log even without clipping (max_grad_norm 0): the same way.
        if grad_norm is None:
            for hook in self.gradient_hooks:
                hook(self.model)
        if grad_norm is None and self.rung.owns_sharding:
            from hfdist.parallel.grad_norm import grad_norm as global_norm

            grad_norm = global_norm(model.parameters(), device=self.args.device)
        grad_norm = super()._get_grad_norm(model, grad_norm)
        # Before the optimizer step (on DeepSpeed, after its own, inside the backward): a non-finite loss or norm on
        # any rank stops every rank here (hfdist.train.nonfinite).
        self.nonfinite.check_step(self.state.global_step + 1, grad_norm)
        return grad_norm

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
        verify_strategy(self.rung, model, self.model, self.lora, self.attention, self.qlora)
        # The step boundary's agreements (preemption's, the non-finite guard's) share one small CPU group.
        self.nonfinite.group = self.preemption.group = agreement_group()
        if self.compile:
            verify_compiled(self.rung, self.model)
        check_precision(self.rung, self.mixed_precision, self.accelerator, model, self.model, self.fp8)
        self.precision.attach(self.model)
        return model, train_dataloader

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """Gradient accumulation under FSDP2: the reduce-scatter runs at every micro-batch, so each layer's gradient
        is sharded as soon as its backward ends; only HSDP's all-reduce across replicas (of those shards) waits for
        the last micro-batch.

        Why not defer the reduce-scatter too, as transformers does: FSDP2 would keep every layer's unsharded gradient,
        in fp32, from one micro-batch to the next: the whole model's gradients on every rank (llama-small on 4 CPU
        ranks, 4 micro-batches of 1: a training peak of 55.0 MiB per rank against 46.1 reduced each time; Llama-3.1-70B
        under fsdp_tp at tp 2: 132 GB more per GPU). Reduce-scattering each micro-batch costs communication instead
        (hfdist.plan.cost counts it)."""
        hsdp = self.rung.dims.dp_replicate > 1
        if hsdp:
            self.model.set_requires_all_reduce(False)
        try:
            yield
        finally:
            if hsdp:
                self.model.set_requires_all_reduce(True)

    # -- saving ----------------------------------------------------------------------------------------------------

    def save_modules(self) -> list[tuple[nn.Module, object]]:
        """(module, rename) pairs whose parameters make up this rank's part of the full model (rename: None when
        the names already are the full model's), as hfdist.models.load.local_tensors takes them."""
        return [(self.model, None)]

    def _trained_parameters(self) -> list[torch.Tensor]:
        """The values of the parameters training changes that this rank holds: its shards (a DTensor's local piece,
        ZeRO-3's partition). Frozen ones cannot turn non-finite, and a QLoRA base's packed codes are no floats."""
        return [getattr(p, "ds_tensor", p) for p in self.model.parameters() if p.requires_grad]

    def _save_checkpoint(self, model, trial) -> None:
        self.nonfinite.check_weights(self.state.global_step, self._trained_parameters())  # nothing non-finite is written
        return super()._save_checkpoint(model, trial)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        self._save(output_dir)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The model (or LoRA adapter) in fp32 as a HF checkpoint, one tensor at a time (collective), + tokenizer:
        on every rung, DeepSpeed AutoTP's (zero2_tp) included (its split layers' fp32 master slices)."""
        from hfdist.checkpoint.hf_export import save_hf_checkpoint
        from hfdist.models.load import local_tensors
        from hfdist.train.watchdog import solo_phase

        output_dir = output_dir or self.args.output_dir
        self.nonfinite.check_weights(self.state.global_step, self._trained_parameters())
        with solo_phase("saving the model", "SAVE"):  # rank 0 writes every tensor while the others wait on it
            save_hf_checkpoint(output_dir, self.skeleton, local_tensors(self.save_modules()), adapter_only=self.lora)
            if self.args.should_save and self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            if dist.is_initialized():
                dist.barrier()


class CausalLMLossMixin:
    """hfdist's loss for a StrategyMixin trainer: the causal-LM token mean, chunked and fused (never the whole batch's
    logits, lm_head's gradients computed in the forward; hfdist.models.chunked_loss) and vocab-parallel under TP; a label smoother or a `compute_loss_func` of the
    user's goes to the Trainer's own loss instead.

    Args:
        loss_chunk_size: sequence positions per lm_head + cross-entropy chunk (fused, or recomputing where lm_head is
            not a plain Linear), on every rung; None: the whole sequence at once.
    """

    def __init__(self, *args, loss_chunk_size: int | None = DEFAULT_LOSS_CHUNK_SIZE, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loss_chunk_size = loss_chunk_size

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
        # An MoE model's router aux loss over the global batch (hfdist.models.router_stats), in training forwards.
        recorder = router_recorder(self.model) if self.model.training else None
        with recorder.recording() if recorder is not None else contextlib.nullcontext():
            loss = self.causal_lm_loss(model, inputs, num_items_in_batch)
        self.precision.note_loss(loss)
        scale = 1
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # As the Trainer does: the gradient averaging over data-parallel ranks must not divide a global sum.
            scale = self.accelerator.num_processes // self.get_tp_size()
        aux = recorder.aux_term(self.args.gradient_accumulation_steps, scale) if recorder is not None else None
        loss = (loss if aux is None else loss + aux) * scale
        return (loss, None) if return_outputs else loss

    @torch.no_grad()
    def batch_loss(self, batch: dict[str, torch.Tensor]) -> float:
        """The mean token loss of `batch` through the trained (still distributed) model, on every rank.

        Collective: every rank calls it with the same batch.
        """
        batch = {k: v.to(self.args.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        model = self.model_wrapped
        model.eval()
        with self.loss_context(), self.compute_loss_context_manager():  # the training precision
            return self.score(model, batch)

    def score(self, model: nn.Module, batch: dict[str, torch.Tensor], num_items_in_batch: float | None = None) -> float:
        """`batch_loss`'s (and evaluation's) forward, inside their contexts: the model's mean token loss on this
        rank's batch, or its token-loss sum over `num_items_in_batch` when given (1: the sum itself)."""
        return float(self.causal_lm_loss(model, batch, num_items_in_batch).detach().float().cpu())


class HfdistTrainer(EvaluationMixin, CausalLMLossMixin, StrategyMixin, Trainer):
    """The Trainer of `hfdist finetune`: StrategyMixin's strategy handling with hfdist's loss (CausalLMLossMixin) and
    its evaluation on any rung (hfdist.train.evaluation); its arguments are the mixins'."""
