"""prepare_model: one rank's model for a strategy, built and loaded without ever holding more of it than the rank
keeps, and the record of what was done that the strategy's trainers read.

Steps, in this order (every rung goes through them; the rung decides what each does):
    checks      the model's config against the rung before anything is built (hfdist.parallel.fit): an
                architecture hfdist splits, tp dividing heads and sizes, cp dividing heads, enough layers for the stages
    structure   the model on the meta device (free at any size), with the tokenizer's vocabulary; the skeleton the
                saves write is a second one in fp32
    adapters    QLoRA's 4-bit base made on the meta model (its decoder projections), then LoRA injected (every rung
                shards or partitions the adapters with the layers)
    place       mesh rungs: hfdist.parallel.parallelize (TP -> CP -> activation checkpointing -> compile -> stages ->
                FSDP2 -> only the local shards materialised and loaded, float8 linears under fp8, each rank quantising
                the 4-bit rows it keeps under QLoRA); ZeRO-3 with zero.Init: built partitioned
                under DeepSpeed, loaded one gathered parameter at a time; DDP, ZeRO-1/2, one process: the whole model
                materialised and loaded, then activation checkpointing and compile (before the Trainer wraps it)
    record      `model.hfdist_prepared`: the strategy, LoRA, the skeleton, where every parameter was placed
Weights are a checkpoint's (a local folder or a hub id: safetensors, each rank reading its own slices) or a preset's
seeded init, the same values in every layout (hfdist.models.load, hfdist.models.init).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hfdist.api.strategy import Strategy, StrategyRefused
from hfdist.config.ladder import Rung

__all__ = ["PreparedModel", "REFERENCE_ADAPTER", "prepare_model", "prepared_record", "load_tokenizer"]

# The adapter TRL's DPOTrainer scores the reference with when the policy is a LoRA model without a ref_model: a copy of
# the trained adapter taken before training (for a fresh adapter, the base model's function).
REFERENCE_ADAPTER = "ref"


@dataclass(frozen=True)
class PreparedModel:
    """What prepare_model made of a model, read by the trainers of hfdist.api.strategy_trainer.

    Attributes:
        strategy: the strategy it was prepared for.
        lora: whether it carries LoRA adapters (only they train).
        trainable: False for a frozen copy (DPO's reference model).
        compile: whether its decoder layers were compiled.
        skeleton: the full model's structure on the meta device (a PeftModel under LoRA): what saving writes.
        attention: the attention implementation the decoder layers compute with (under context parallelism, the one
            inside Ulysses' exchange): what a collator builds attention inputs for.
        fp8: the float8 recipe of the decoder projections (torchao), or None.
        qlora: whether the adapted projections' base is QLoRA's 4-bit one.
        placement: each parameter's (type, device, dtype, placements) as hfdist left it, to catch a Trainer that moves
            the model.
    """

    strategy: Strategy
    lora: bool
    trainable: bool
    compile: bool
    skeleton: nn.Module = field(repr=False)
    attention: str
    placement: dict[str, tuple[str, ...]] = field(repr=False)
    fp8: str | None = None
    qlora: bool = False


def placement_of(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each parameter's (type, device, dtype, placements): what a Trainer must not change."""
    return {name: (type(p).__name__, str(p.device), str(p.dtype), str(getattr(p, "placements", "")))
            for name, p in model.named_parameters()}


def prepared_record(model: nn.Module) -> PreparedModel:
    """The record prepare_model left on `model`.

    Raises:
        StrategyRefused: a model prepare_model did not make.
    """
    record = getattr(model, "hfdist_prepared", None)
    if not isinstance(record, PreparedModel):
        raise StrategyRefused(f"The Trainer got a {type(model).__name__} that hfdist.api.prepare_model did not make: "
                              "hfdist applies the strategy while building the model (sharded on the meta device, "
                              "then each rank loads its part). Pass the model spec to "
                              "prepare_model(strategy, 'name-or-path') and train what it returns.")
    return record


def load_tokenizer(spec: str | None):
    """The tokenizer of a model spec: hfdist's embedded one for a preset (llama-tiny, ...), the model's own
    otherwise; a pad token set (EOS) when it has none, and hfdist's default chat template when it has none (saved
    with the model, so it carries the template it was trained with)."""
    from hfdist.data.chat import ensure_chat_template
    from hfdist.data.load import load_tokenizer as load
    from hfdist.models.presets import is_preset

    tokenizer = load(spec, is_preset=spec is None or is_preset(spec))
    ensure_chat_template(tokenizer)
    return tokenizer


def _device() -> torch.device:
    """This rank's device, the process group built first when a launcher started a world (accelerate's state:
    the same group the Trainer's arguments use)."""
    from accelerate import PartialState

    return PartialState().device


@contextlib.contextmanager
def _no_zero3_build() -> Iterator[None]:
    """Meta structures are built as plain modules even while a ZeRO-3 config is alive (transformers would build
    every model under deepspeed.zero.Init then)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    config = ref() if ref is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if config is not None:
            hf_deepspeed.set_hf_deepspeed_config(config)


def _lora_config(lora: Any):
    """A peft LoraConfig from `lora`: a rank (hfdist.models.build.lora_config: every decoder projection, alpha 2r,
    no dropout) or a LoraConfig as given."""
    if lora is None or lora is False:
        return None
    from peft import LoraConfig

    from hfdist.models.build import lora_config

    return lora if isinstance(lora, LoraConfig) else lora_config(int(lora), 2 * int(lora))


def _adapters(model: nn.Module, lora, reference_adapter: bool) -> nn.Module:
    """LoRA injected (`lora`: a LoraConfig, or None for none), and with `reference_adapter` a frozen second adapter
    of the same shape named REFERENCE_ADAPTER."""
    if lora is None:
        return model
    from peft import get_peft_model

    from hfdist.models.moe import moe_lora_config

    lora = moe_lora_config(model, lora)  # an MoE model's routed experts stay frozen (docs/moe.md)
    model = get_peft_model(model, lora)
    if reference_adapter:
        model.add_adapter(REFERENCE_ADAPTER, lora)
        for name, p in model.named_parameters():
            if f".{REFERENCE_ADAPTER}." in name:
                p.requires_grad_(False)
    return model


def _structure(spec: str | None, vocab_size: int | None, pad_id: int | None, dtype: torch.dtype, lora,
               attention: str | None, trainable: bool, reference_adapter: bool = False,
               quantized: bool = False) -> nn.Module:
    """The model on the meta device: its projections 4-bit when `quantized` (QLoRA's base), LoRA injected, frozen
    entirely when not trainable."""
    from hfdist.models.build import meta_model

    with _no_zero3_build():
        model = meta_model(spec, vocab_size=vocab_size, dtype=dtype, attn_implementation=attention)
    if pad_id is not None:
        model.config.pad_token_id = pad_id
    if quantized:
        from hfdist.models.quantize import quantize_meta

        quantize_meta(model)
    model = _adapters(model, lora, reference_adapter)
    if not trainable:
        model.requires_grad_(False)
    return model


def _place(strategy: Strategy, spec: str | None, model: nn.Module, plan, device: torch.device, *, lora,
           activation_checkpointing: bool, compile: bool, zero3_init: bool, fp8: str | None,
           qlora: bool) -> nn.Module:
    """This rank's model for its rung, weights loaded (see the module docstring's `place`)."""
    from hfdist.models.build import materialize, zero3_model
    from hfdist.models.load import load_gathered, load_weights
    from hfdist.models.quantize import load_quantized
    from hfdist.parallel.parallelize import apply_ac, apply_compile, parallelize

    rung = strategy.rung
    if rung.owns_sharding:
        return parallelize(model, rung, device=device, mixed_precision=strategy.mixed_precision,
                           activation_checkpointing=activation_checkpointing, compile=compile, fp8=fp8, weights=plan)
    # (QLoRA's 4-bit base is built whole, one packed tensor at a time, and partitioned by DeepSpeed's engine:
    # zero.Init cannot create bitsandbytes' packed parameters.)
    if rung.zero_stage == 3 and zero3_init and not qlora:
        built = zero3_model(spec, model.config.vocab_size, model.dtype,
                            attn_implementation=model.config._attn_implementation)
        built.config.pad_token_id = model.config.pad_token_id
        built = _adapters(built, lora, REFERENCE_ADAPTER in getattr(model, "peft_config", {}))
        if not any(p.requires_grad for p in model.parameters()):
            built.requires_grad_(False)
        load_gathered(built, plan)
        model = built
    else:
        if fp8 is not None:  # on the meta model, as the recipe converts (DeepSpeed rungs refuse --fp8)
            from hfdist.parallel.float8 import convert_to_float8

            convert_to_float8(model, fp8)
        materialize(model, device)
        load_weights({**dict(model.named_parameters()), **dict(model.named_buffers())}, plan)
        load_quantized(model, plan, device=device)
    if activation_checkpointing:
        apply_ac(model)
    if compile:  # before the Trainer wraps it in DDP (the recipe's order: compile, then the data-parallel wrap)
        apply_compile(model)
    return model


def _checks(strategy: Strategy, config, compile: bool, fp8: str | None, qlora: bool, lora: bool) -> None:
    """The config against the rung before anything is built; each failure one paragraph naming the fix."""
    from hfdist.config.features import refuse_unless
    from hfdist.parallel.fit import check_model_fits

    rung = strategy.rung
    if compile:
        from hfdist.parallel.parallelize import check_compile

        check_compile(rung, config)
    check_model_fits(config, rung)
    if lora or qlora:
        refuse_unless(rung, "lora")
    if qlora:
        from hfdist.models.quantize import check_quantizable

        refuse_unless(rung, "qlora")
        from hfdist.parallel.expert_check import check_moe

        check_moe(config, rung, qlora=True)
        check_quantizable(config, shard=rung.dims.dp_shard * rung.dims.cp if rung.owns_sharding else 1)
    if fp8 is not None:
        from hfdist.parallel.float8_check import check_fp8

        check_fp8(fp8, rung, config, seq_len=None, lora=lora, compile=compile, mixed_precision=strategy.mixed_precision,
                  on_gpu=torch.cuda.is_available())


def _training_dtype(rung: Rung, mixed: str) -> torch.dtype:
    """The dtype the model's own weights are held in: fp32 (the master weights) on every rung but DeepSpeed
    under bf16, which trains a bf16 model against fp32 partitions of its own."""
    return torch.bfloat16 if rung.uses_deepspeed and mixed == "bf16" else torch.float32


def prepare_model(strategy: Strategy, model: str | None, *, tokenizer=None, lora: Any = None, seed: int = 0,
                  trainable: bool = True, activation_checkpointing: bool = False, compile: bool = False,
                  attn_implementation: str | None = None, reference_adapter: bool = False, fp8: str | None = None,
                  qlora: bool = False, meta: nn.Module | None = None, zero3_init: bool | None = None) -> nn.Module:
    """This rank's model for `strategy`, weights loaded, ready for a trainer of hfdist.api.strategy_trainer.

    Args:
        strategy: from hfdist.api.resolve_strategy.
        model: a preset name (llama-tiny, llama-3.1-8b, ...), a local checkpoint folder or a hub id (safetensors).
        tokenizer: the tokenizer the data is encoded with: its vocabulary size and pad token go into the model.
        lora: a LoRA rank (hfdist's targets: every decoder projection) or a peft LoraConfig; None: full fine-tune.
        seed: the seeded init of a preset's weights and of LoRA adapters (the same values in every layout).
        trainable: False for a frozen copy (DPO's reference model: sharded the same way, no gradients).
        activation_checkpointing: recompute every decoder layer in backward.
        compile: torch.compile every decoder layer (the rungs that take it: single, ddp, fsdp_full_shard,
            fsdp_hybrid, fsdp_tp).
        attn_implementation: the attention implementation (default: the model config's).
        reference_adapter: with `lora`, a frozen second adapter named "ref" beside the trained one, sharded with it:
            TRL's DPOTrainer (no ref_model) copies the trained adapter into it and scores the reference with it.
        fp8: the decoder projections in float8 through torchao ("tensorwise" or "rowwise"; docs/fp8.md), or None.
        qlora: with `lora`, the adapted base in 4-bit NF4 (bitsandbytes; docs/qlora.md), each rank quantising the
            rows it keeps.
        meta: the model already built on the meta device (LoRA injected) by the caller, instead of from `model`.
        zero3_init: ZeRO-3 rungs: build partitioned under deepspeed.zero.Init (default: the YAML's zero3_init_flag,
            as accelerate passes it).

    Returns:
        The model (a PipelineModel holding this rank's stages under pipeline parallelism), with its record in
        `.hfdist_prepared`.

    Raises:
        StrategyRefused (or another HfdistError): a model the strategy cannot apply to, naming the fix.
    """
    from hfdist.models.build import checkpoint_folder
    from hfdist.models.load import weight_plan
    from hfdist.models.presets import load_config

    lora_config = _lora_config(lora)
    if qlora and lora_config is None:
        raise StrategyRefused("qlora=True trains LoRA adapters on the 4-bit base: pass lora= (a rank or a "
                              "LoraConfig) as well.")
    config = meta.config if meta is not None else load_config(model)
    _checks(strategy, config, compile, fp8, qlora, lora_config is not None)
    device = _device()
    vocab = len(tokenizer) if tokenizer is not None else None
    pad = tokenizer.pad_token_id if tokenizer is not None else None
    if meta is None:
        dtype = _training_dtype(strategy.rung, strategy.mixed_precision)
        meta = _structure(model, vocab, pad, dtype, lora_config, attn_implementation, trainable,
                          reference_adapter and lora_config is not None, quantized=qlora)
    skeleton = _structure(model, meta.config.vocab_size, meta.config.pad_token_id, torch.float32, lora_config,
                          None, trainable)
    attention = meta.config._attn_implementation or "sdpa"
    torch.manual_seed(seed)
    plan = weight_plan(meta, checkpoint_folder(model), seed)
    if zero3_init is None:
        zero3_init = os.environ.get("ACCELERATE_DEEPSPEED_ZERO3_INIT", "true").lower() == "true"
    placed = _place(strategy, model, meta, plan, device, lora=lora_config,
                    activation_checkpointing=activation_checkpointing, compile=compile, zero3_init=zero3_init,
                    fp8=fp8, qlora=qlora)
    placed.hfdist_prepared = PreparedModel(strategy, lora_config is not None, trainable, compile, skeleton,
                                           attention, placement_of(placed), fp8, qlora)
    return placed
