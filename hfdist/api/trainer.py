"""strategy_trainer: any transformers.Trainer subclass (a plain Trainer, TRL's SFTTrainer or DPOTrainer, one of
yours) taught the strategy its model was prepared for.

    Trainer = strategy_trainer(SFTTrainer, strategy)
    trainer = Trainer(model=prepare_model(strategy, "llama-tiny", tokenizer=tok), args=..., train_dataset=...)

The class is the trainer's own with hfdist's mixins in front (hfdist.train): data sharded by data-parallel rank,
the strategy and precision verified before the first step, clipping, streamed fp32 saves and layout-free DCP
checkpoints, per-rank metrics (DistributedMetricsCallback) by default. The loss:
- a trainer that keeps the Trainer's own loss (no compute_loss of its own) trains on hfdist's: the causal-LM token
  mean, chunked, vocab-parallel under TP, on each rank's chunk under CP, staged under PP (CausalLMLossMixin), and
  its `evaluate()` gives the held-out set's exact token-mean loss on every rung (hfdist.train.evaluation);
- a trainer with its own compute_loss (TRL's, yours) keeps it, on outputs made whole on every rank of a tp / cp
  group (hfdist.parallel.whole_outputs): full logits, whole sequences, as one process computes them;
- pipeline stages run one loss only, the last stage's token cross-entropy: a trainer whose loss is that (hfdist's;
  TRL's SFT negative log-likelihood) trains on them, any other is refused before the first step, naming why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

from transformers import Trainer

from hfdist.api.model import REFERENCE_ADAPTER, placement_of, prepared_record
from hfdist.api.strategy import Strategy, StrategyRefused, placed_by_hfdist
from hfdist.train.context_trainer import ContextParallelMixin
from hfdist.train.evaluation import EvaluationMixin
from hfdist.train.pipeline_trainer import PipelineMixin
from hfdist.train.trainer import CausalLMLossMixin, StrategyMixin

__all__ = ["strategy_trainer", "StrategyAwareMixin", "WholeOutputsMixin"]

T = TypeVar("T", bound=type)


_SFT_MODULE = "trl.trainer.sft_trainer"  # TRL's SFTTrainer: its default loss is the token mean pipelines stage


def _loss_owner(cls: type) -> type:
    """The class whose compute_loss a trainer class runs (hfdist's mixins left out)."""
    return next(c for c in cls.__mro__ if "compute_loss" in vars(c) and not c.__module__.startswith("hfdist"))


def _sft_nll(trainer) -> bool:
    """Whether `trainer`'s loss is TRL's SFT negative log-likelihood: the causal-LM token mean the pipeline's last
    stage computes (no DFT weighting, label smoothing, loss function of the user's or MoE auxiliary loss)."""
    return (_loss_owner(type(trainer)).__module__ == _SFT_MODULE and trainer.args.loss_type == "nll"
            and trainer.compute_loss_func is None and trainer.label_smoother is None
            and not getattr(trainer, "aux_loss_enabled", False))


def _unstaged_loss(name: str, loss: str, rung_name: str) -> StrategyRefused:
    return StrategyRefused(
        f"{name} trains with a loss of its own ({loss}), and {rung_name}'s pipeline stages compute one loss only: the "
        "last stage's token cross-entropy, summed over micro-batches (the model never returns logits or "
        "log-probabilities to a loss outside the schedule). Train this loss on a rung without pipeline stages "
        "(fsdp_full_shard, fsdp_tp, fsdp_cp, zero3), or use a trainer whose loss is the causal-LM token mean "
        "(Trainer, TRL's SFTTrainer with loss_type='nll').")


@contextlib.contextmanager
def _no_adapters_added(model) -> Iterator[None]:
    """While a trainer is built, adding a LoRA adapter to the prepared model keeps the one prepare_model made under that
    name (TRL's DPOTrainer adds its "ref" adapter; prepare_model(reference_adapter=True) made it sharded) and refuses
    a new one, which would be created whole beside the sharded adapters."""
    add = getattr(model, "add_adapter", None)
    if add is None:
        yield
        return

    def keep(adapter_name: str, *args, **kwargs) -> None:
        if adapter_name in model.peft_config:
            return
        raise StrategyRefused(
            f"The trainer adds a LoRA adapter '{adapter_name}' to the model hfdist already sharded; it would be created "
            "whole, beside sharded adapters. Make it while the model is prepared: prepare_model(..., lora=R, "
            f"reference_adapter=True) makes the '{REFERENCE_ADAPTER}' adapter TRL's DPOTrainer uses as its reference, "
            "or pass a ref_model (prepare_model(..., trainable=False)).")

    model.add_adapter = keep
    try:
        yield
    finally:
        del model.add_adapter


class StrategyAwareMixin:
    """Reads what prepare_model recorded on the model and hands it to StrategyMixin; refuses, before the first step,
    what the strategy cannot train: a model prepare_model did not make, a loss the pipeline cannot stage, a Trainer
    that moved the model hfdist placed.

    Args:
        metrics: add a DistributedMetricsCallback (every rank's memory, throughput and MFU in the logs) unless the
            callbacks hold one already.
        (the rest: the trainer's own, and StrategyMixin's checkpoint_identity)
    """

    def __init__(self, *args, metrics: bool = True, **kwargs) -> None:
        model = kwargs["model"] if "model" in kwargs else args[0]
        record = prepared_record(model)
        if not record.trainable:
            raise StrategyRefused("The model was prepared with trainable=False (a frozen reference copy); prepare "
                                  "the model to train with trainable=True.")
        arguments = kwargs.get("args", args[1] if len(args) > 1 else None)
        if record.strategy.rung.owns_sharding and arguments is not None:
            placed_by_hfdist(arguments)
        if metrics:
            from hfdist.callbacks.distributed_metrics import DistributedMetricsCallback

            callbacks = list(kwargs.get("callbacks") or [])
            if not any(isinstance(c, DistributedMetricsCallback) for c in callbacks):
                kwargs["callbacks"] = [*callbacks, DistributedMetricsCallback()]
        strategy = record.strategy
        with _no_adapters_added(model):
            super().__init__(*args, rung=strategy.rung, lora=record.lora, qlora=record.qlora,
                             mixed_precision=strategy.mixed_precision, skeleton=record.skeleton,
                             compile=record.compile, attention=record.attention, fp8=record.fp8, **kwargs)
        self.prepared = record
        if hasattr(self, "_tp_size"):  # TRL divides its gathered token counts by the ranks that share a batch
            self._tp_size = self.rung.dims.ranks_per_batch
        self._refuse_what_cannot_train()
        self._check_not_moved("when the trainer was built")

    def _refuse_what_cannot_train(self) -> None:
        rung = self.rung
        custom_loss = self.label_smoother is not None or self.compute_loss_func is not None
        if rung.uses_pipeline:
            from hfdist.parallel.pipeline.plan import check_pipeline

            staged = isinstance(self, CausalLMLossMixin) and not custom_loss or _sft_nll(self)
            if not staged:
                raise _unstaged_loss(type(self).__name__, self._loss_name(), rung.name)
            if getattr(self, "padding_free", False):
                raise StrategyRefused(
                    f"{type(self).__name__} collates padding-free (TRL: packing with the bfd strategy, or "
                    "padding_free=True): each batch is one flattened row, which pipeline stages cannot cut into "
                    f"{rung.pipeline.n_microbatches} micro-batches. Set packing=False (or packing_strategy='wrapped' "
                    "with padding_free=False) on pipeline rungs.")
            check_pipeline(rung, self.args.per_device_train_batch_size, self.model.config.num_hidden_layers)
        elif rung.dims.cp > 1 and isinstance(self, CausalLMLossMixin) and custom_loss:
            raise StrategyRefused(
                f"{rung.name} cuts every sequence over cp={rung.dims.cp} ranks and computes hfdist's token loss on "
                "each chunk; a label smoother or compute_loss_func would see one chunk's logits only. Drop them, or "
                "override compute_loss in a Trainer subclass (it then sees whole sequences on every rank).")

    def _loss_name(self) -> str:
        if self.label_smoother is not None:
            return "label smoothing"
        if self.compute_loss_func is not None:
            return "compute_loss_func"
        owner = _loss_owner(type(self))
        if owner.__module__ == _SFT_MODULE:
            return f"TRL's SFT loss_type={self.args.loss_type!r}"
        return f"{owner.__module__}.{owner.__qualname__}.compute_loss"

    def _check_not_moved(self, when: str) -> None:
        """Refuse a model whose parameters are no longer where hfdist placed them (mesh rungs)."""
        if not self.rung.owns_sharding:
            return
        now = placement_of(self.model)
        moved = [(name, self.prepared.placement.get(name), where) for name, where in now.items()
                 if self.prepared.placement.get(name) != where]
        if moved or len(now) != len(self.prepared.placement):
            name, before, after = moved[0] if moved else ("(the parameter set)", "", "")
            raise StrategyRefused(
                f"The model was moved or changed after hfdist placed it ({when}): {name} was {before} and is "
                f"{after}. hfdist shards and places the model itself on {self.rung.name}; a `.to(...)`, `.half()` or "
                "a wrapper of the Trainer's undoes its sharding. Remove the move (set the precision with "
                "resolve_strategy(mixed_precision=...), the device by the launcher), and build the arguments with "
                "strategy.training_arguments(YourConfig, ...) so the Trainer does not place the model.")

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        self._check_not_moved("before the first step")
        prepared = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self.args.process_index == 0:  # StrategyMixin verified the strategy (it raises when it is not in effect)
            rung = self.rung
            print(f"hfdist: {rung.name} in effect ({rung.dims.layout()}, {rung.kind.value}, precision "
                  f"{self.mixed_precision}), verified before step 1", flush=True)
        return prepared


class WholeOutputsMixin:
    """A trainer's own loss under TP / CP: the model's outputs (and a reference model's) made whole on every rank of
    a tp / cp group (hfdist.parallel.whole_outputs), the cp ranks then counted like tensor-parallel ones: they hold
    the same batch and compute the same loss."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from hfdist.parallel.whole_outputs import whole_outputs

        self.whole_output_hooks = whole_outputs(self.model)
        reference = getattr(self, "ref_model", None)
        if reference is not None:
            self.whole_output_hooks += whole_outputs(reference)

    def get_tp_size(self) -> int:
        return super().get_tp_size() * self.rung.dims.cp


def strategy_trainer(trainer_cls: T, strategy: Strategy) -> T:
    """`trainer_cls` (transformers.Trainer or a subclass) with hfdist's mixins for `strategy`; see the module
    docstring. Construct it with the trainer's own arguments and a model from hfdist.api.prepare_model; `metrics=`
    (default True) adds per-rank metrics, `checkpoint_identity=` what checkpoints record of the run.

    Raises:
        StrategyRefused: `trainer_cls` is not a transformers.Trainer, or its loss is one pipeline stages cannot
        compute (DPO's, a compute_loss of yours) on a pipeline rung; the message names the fix.
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise StrategyRefused(f"strategy_trainer takes a transformers.Trainer class (Trainer, TRL's SFTTrainer, "
                              f"DPOTrainer, or a subclass of yours), not {trainer_cls!r}.")
    rung = strategy.rung
    own_loss = trainer_cls.compute_loss is not Trainer.compute_loss
    owner = _loss_owner(trainer_cls)
    if rung.uses_pipeline and own_loss and owner.__module__ != _SFT_MODULE:
        raise _unstaged_loss(trainer_cls.__name__, f"{owner.__module__}.{owner.__qualname__}.compute_loss", rung.name)
    mixins: list[type] = []
    if rung.uses_pipeline:
        # Under cp the batch is cut before stage 0 (ContextParallelMixin's step runs first, then the schedule's).
        mixins += [ContextParallelMixin, PipelineMixin] if rung.dims.cp > 1 else [PipelineMixin]
    elif own_loss and (rung.uses_tp or rung.dims.cp > 1) and rung.owns_sharding:
        mixins.append(WholeOutputsMixin)
    elif rung.dims.cp > 1:
        mixins.append(ContextParallelMixin)
    mixins.append(StrategyAwareMixin)
    if not own_loss:
        mixins += [EvaluationMixin, CausalLMLossMixin]
    mixins.append(StrategyMixin)
    name = f"{trainer_cls.__name__}On{''.join(p.capitalize() for p in rung.name.split('_'))}"
    return type(name, (*mixins, trainer_cls), {"__module__": trainer_cls.__module__, "__doc__": trainer_cls.__doc__})
