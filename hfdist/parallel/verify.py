"""Check at run time that the strategy asked for is the one in effect; fail loudly when it is not.

Silent fallbacks are the most common distributed-training bug users report (accelerate running DDP when the config
said FSDP, ZeRO not engaged, LoRA saving empty adapters), so every run checks its model before the first step.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from hfdist.config.ladder import Rung, StrategyKind
from hfdist.errors import HfdistError

__all__ = ["StrategyNotInEffect", "verify_strategy"]


class StrategyNotInEffect(HfdistError, RuntimeError):
    """The model or world is not in the state the requested strategy implies."""


def _fail(rung: Rung, what: str) -> None:
    raise StrategyNotInEffect(
        f"Strategy '{rung.name}' is not in effect: {what}. hfdist stops rather than train with another strategy "
        f"than asked. Launch with scripts/finetune.py --config {rung.name} (it starts the right world), and check "
        "that no other launcher config overrides it."
    )


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _check_fsdp(rung: Rung, model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hfdist.parallel.expert import is_expert_param
    from hfdist.parallel.fsdp import fsdp_unit_class, is_instance_of_named

    assert rung.fsdp is not None
    unit = fsdp_unit_class(model, rung.fsdp.layer_cls_to_wrap)
    layers = [m for m in model.modules() if is_instance_of_named(m, unit)]
    unwrapped = [i for i, m in enumerate(layers) if not isinstance(m, FSDPModule)]
    if not layers or unwrapped or not isinstance(model, FSDPModule):
        _fail(rung, f"{len(unwrapped)} of {len(layers)} {unit} modules (or the root) are not FSDP2 modules")
    d = rung.dims
    local = int(os.environ.get("LOCAL_WORLD_SIZE", d.dp_shard))
    if d.dp_replicate > 1 and local % d.dp_shard:
        # Ranks are numbered node by node, so shard groups of consecutive ranks stay inside a node when dp_shard
        # divides the processes per node; otherwise every all-gather would cross the slow inter-node link.
        _fail(rung, f"hybrid sharding groups of dp_shard={d.dp_shard} ranks do not fit the {local} processes of a "
                    "node, so shards would span nodes; set parallelism_config_dp_shard_size to the processes per node")
    want = (Replicate(), Shard(0)) if d.dp_replicate > 1 else (Shard(0),)
    shard = d.dp_shard * d.cp  # cp ranks hold the same parameters: FSDP2 shards over dp_shard x cp
    want_shape = (d.dp_replicate, shard) if d.dp_replicate > 1 else (shard,)
    if d.tp > 1:
        want_shape = (*want_shape, d.tp)
    for name, p in model.named_parameters():
        if is_expert_param(name) and (d.ep > 1 or d.tp > 1):
            continue  # placed over ep and FSDP2's expert mesh: _check_experts
        if not isinstance(p, DTensor):
            _fail(rung, f"parameter {name} is a plain tensor, not a sharded DTensor")
        # FSDP2 shards dim 0 of a TP-split weight as a _StridedShard (torch-private, no Shard subclass).
        dp_ok = all(isinstance(w, Replicate) and isinstance(got, Replicate) or
                    isinstance(w, Shard) and type(got).__name__ in ("Shard", "_StridedShard") and got.dim == w.dim
                    for w, got in zip(want, p.placements))
        if not dp_ok or tuple(p.device_mesh.shape) != want_shape:
            _fail(rung, f"parameter {name} has placements {p.placements} on a mesh of shape "
                        f"{tuple(p.device_mesh.shape)}; expected {want} (+ tp) on {want_shape}")
        # Megatron TP: the column-parallel q_proj is split on its output dim across the tp axis.
        if d.tp > 1 and name.endswith("q_proj.weight") and "lora" not in name and p.placements[-1] != Shard(0):
            _fail(rung, f"{name} is not column-split over tp (placements {p.placements})")


def _check_experts(rung: Rung, model: nn.Module) -> None:
    """ep (or tp on an MoE model): every MoE block dispatches through hfdist's experts, each rank holding its E / ep
    experts (hfdist.parallel.expert.check_experts), and each experts module is an FSDP2 unit of its own."""
    from torch.distributed.fsdp import FSDPModule

    from hfdist.models.moe import moe_layers
    from hfdist.parallel.expert import check_experts
    from hfdist.parallel.expert_check import ExpertParallelError

    try:
        check_experts(model, rung.dims.ep)
    except ExpertParallelError as exc:
        _fail(rung, str(exc))
    unsharded = [layer.path for layer in moe_layers(model) if not isinstance(layer.experts, FSDPModule)]
    if unsharded:
        _fail(rung, f"the experts of {unsharded[0]} (and {len(unsharded) - 1} more) are not an FSDP2 unit")


def _check_context_parallel(rung: Rung, model: nn.Module) -> None:
    """cp: every attention layer attends through the cp attention of one plan, over groups of the asked sizes (the
    whole cp group; its Ulysses groups and ring), and the method is the one the run asked for (--cp-method)."""
    from hfdist.parallel.context import CP_ATTENTIONS

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = [m for name, m in base.named_modules() if name.endswith("self_attn")]
    specs = [getattr(m, "hfdist_cp", None) for m in layers]
    if base.config._attn_implementation not in CP_ATTENTIONS.values() or not layers or None in specs:
        _fail(rung, f"context parallelism (cp={rung.dims.cp}) is not in effect: the model attends with "
                    f"'{base.config._attn_implementation}' and {specs.count(None)} of {len(layers)} attention "
                    "layers have no cp group")
    plans = {spec.plan for spec in specs}
    plan = plans.pop()
    if plans or base.config._attn_implementation != CP_ATTENTIONS[plan.method]:
        _fail(rung, f"the attention layers run different context-parallel plans ({sorted(p.method for p in plans)} "
                    f"and {plan.method} under '{base.config._attn_implementation}')")
    asked = rung.context
    if asked.method not in ("auto", plan.method) or asked.ulysses not in (None, plan.ulysses):
        _fail(rung, f"context parallelism runs {plan.method} (Ulysses over {plan.ulysses}), but {asked.method}"
                    f"{f' (Ulysses over {asked.ulysses})' if asked.ulysses else ''} was planned (--cp-method)")
    sizes = {tuple(dist.get_world_size(g) if g is not None else None for g in (s.group, s.ulysses_group, s.ring_group))
             for s in specs}
    want = (rung.dims.cp, plan.ulysses if plan.ulysses > 1 else None, plan.ring if plan.ring > 1 else None)
    if sizes != {want}:
        _fail(rung, f"the attention layers exchange over groups of (cp, ulysses, ring) = {sorted(sizes)} ranks, not "
                    f"{want} ({plan.method}, cp={rung.dims.cp})")


def _check_pipeline(rung: Rung, model: nn.Module) -> None:
    """PP: this rank trains only its stages, on a pipeline of the asked size and schedule; each stage is FSDP2 over
    dp (when dp > 1) and TP-split (when tp > 1), checked like a whole FSDP model."""
    from torch.distributed.tensor import DTensor, Shard

    from hfdist.parallel.pipeline.model import PipelineModel

    if not isinstance(model, PipelineModel):
        _fail(rung, f"the Trainer's model is a {type(model).__name__}, not hfdist's PipelineModel")
    runner, want = model.runner, rung.pipeline
    if runner.pp != rung.dims.pp or (runner.schedule_name, runner.n_microbatches) != (want.schedule, want.n_microbatches):
        _fail(rung, f"the pipeline runs pp={runner.pp}, {runner.schedule_name} with {runner.n_microbatches} "
                    f"micro-batches; the config asks for pp={rung.dims.pp}, {want.schedule} with {want.n_microbatches}")
    local = sum(len(stage.layer_range) for stage in runner.stages)
    total = sum(len(r) for r in runner.layer_ranges)
    if local >= total:
        _fail(rung, f"this rank holds {local} of the model's {total} decoder layers: the model was not split")
    from torch.distributed.fsdp import FSDPModule

    for stage in runner.stages:
        if rung.dims.dp > 1 or isinstance(stage, FSDPModule):  # dp = 1 too under bf16: FSDP2 is the precision
            _check_fsdp(rung, stage)
        elif rung.dims.tp > 1:
            for name, p in stage.named_parameters():
                if not isinstance(p, DTensor) or tuple(p.device_mesh.shape) != (rung.dims.tp,):
                    _fail(rung, f"stage parameter {name} is not a DTensor on the tp mesh")
                if name.endswith("q_proj.weight") and "lora" not in name and p.placements[-1] != Shard(0):
                    _fail(rung, f"{name} is not column-split over tp (placements {p.placements})")


def _check_deepspeed(rung: Rung, wrapped: nn.Module) -> None:
    if type(wrapped).__name__ != "DeepSpeedEngine":
        _fail(rung, f"the Trainer's model is a {type(wrapped).__name__}, not a DeepSpeedEngine")
    stage = wrapped.zero_optimization_stage()
    if stage != rung.zero_stage:
        _fail(rung, f"DeepSpeed runs ZeRO stage {stage}, the config asks for {rung.zero_stage}")
    if rung.dims.tp > 1:
        split = [m for m in wrapped.module.modules() if type(m).__name__ in ("LinearLayer", "LinearAllreduce")]
        if not split:
            _fail(rung, f"DeepSpeed AutoTP (autotp_size={rung.dims.tp}) replaced no Linear layer")
    got = {}
    for key, section in (("offload_param", wrapped.zero_offload_param()),
                         ("offload_optimizer", wrapped.zero_offload_optimizer())):
        device = getattr(section, "device", "none") if section is not None else "none"
        got[key] = str(getattr(device, "value", device))
    if got != {"offload_param": rung.offload_param, "offload_optimizer": rung.offload_optimizer}:
        _fail(rung, f"DeepSpeed offload is {got}, the config asks for params={rung.offload_param}, "
                    f"optimizer={rung.offload_optimizer}")


def _check_lora(rung: Rung, model: nn.Module) -> None:
    from peft import PeftModel

    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    # Pipeline stages hold the PeftModel's LoRA layers, not the PeftModel itself.
    if not (isinstance(model, PeftModel) or rung.dims.pp > 1) or not trainable:
        _fail(rung, f"--lora was asked but the model is a {type(model).__name__} with {len(trainable)} trainables")
    stray = [n for n in trainable if "lora_" not in n]
    if stray:
        _fail(rung, f"--lora was asked but non-LoRA parameters train too, e.g. {stray[:3]}")


def _check_attention(rung: Rung, model: nn.Module, attention: str) -> None:
    """The attention implementation every layer reads is the one the run resolved (under cp: the base the cp
    attention computes with, or whose boundaries the ring reads)."""
    from hfdist.parallel.context import CP_ATTENTIONS

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    in_effect = {base.config._attn_implementation}
    if in_effect <= set(CP_ATTENTIONS.values()):
        in_effect = {m.hfdist_cp.base for m in base.modules() if getattr(m, "hfdist_cp", None) is not None}
    if in_effect != {attention}:
        _fail(rung, f"the model attends with {', '.join(sorted(map(str, in_effect)))}, not the "
                    f"--attn-implementation resolved for this run ({attention}), so packed documents would not be "
                    "kept apart as the batch describes them")


def _packed_numel(weight: torch.Tensor) -> tuple[int, int]:
    """(numel of the whole packed weight, numel this rank holds): a ZeRO-3 partition, a DTensor's local shard, or
    the plain tensor."""
    if hasattr(weight, "ds_tensor"):
        return weight.ds_numel, weight.ds_tensor.numel()
    local = getattr(weight, "_local_tensor", weight)
    return weight.numel(), local.numel()


def _check_qlora(rung: Rung, model: nn.Module) -> None:
    """QLoRA: every LoRA-adapted projection's base is a 4-bit NF4 layer with its double-quantised state, holding
    one quarter of its values' count in packed bf16, split over the ranks where the rung shards weights."""
    from hfdist.models.quantize import BLOCK_SIZE, QUANT_TYPE, STORAGE_DTYPE, is_4bit

    adapted = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    bases = [m.base_layer for m in adapted]
    plain = [type(b).__name__ for b in bases if not is_4bit(b)]
    if not bases or plain:
        _fail(rung, f"--qlora was asked but {len(plain)} of {len(bases)} adapted projections have a "
                    f"full-precision base ({', '.join(sorted(set(plain))) or 'no adapted projection at all'})")
    sharded = rung.owns_sharding and rung.dims.dp_shard * rung.dims.cp > 1 or rung.uses_deepspeed and \
        rung.zero_stage >= 3 and rung.num_processes > 1
    for base in bases:
        state, weight = getattr(base, "quant_state", None), base.weight
        whole, held = _packed_numel(weight)
        if (state is None or state.quant_type != QUANT_TYPE or not state.nested or state.blocksize != BLOCK_SIZE
                or weight.dtype != STORAGE_DTYPE or 4 * whole != base.out_features * base.in_features):
            _fail(rung, f"a 4-bit base of {base.out_features} x {base.in_features} holds {whole} {weight.dtype} "
                        f"values with quantisation state {getattr(state, 'quant_type', None)} "
                        f"(double-quantised: {getattr(state, 'nested', None)}); expected {QUANT_TYPE}, "
                        "double-quantised, packed 4 values per bf16")
        if sharded and held >= whole:
            _fail(rung, f"a 4-bit base weight ({whole} packed values) is held whole on this rank, not sharded")


def verify_strategy(rung: Rung, wrapped: nn.Module, model: nn.Module, lora: bool, attention: str | None = None,
                    qlora: bool = False) -> None:
    """Raise StrategyNotInEffect unless `rung` is really applied.

    Args:
        wrapped: what the Trainer trains (DDP / DeepSpeedEngine / the FSDP2 model itself).
        model: the underlying model (Trainer.model).
        lora: whether LoRA adapters were asked for.
        attention: the attention implementation the run resolved (hfdist.models.attention); None: not checked.
        qlora: whether their base must be QLoRA's 4-bit one.
    """
    world = _world_size()
    if world != rung.num_processes:
        _fail(rung, f"the world has {world} processes, the config needs {rung.num_processes}")
    if rung.kind is StrategyKind.DDP and not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        _fail(rung, f"the Trainer's model is a {type(wrapped).__name__}, not DistributedDataParallel")
    if rung.dims.pp > 1:
        _check_pipeline(rung, model)
    elif rung.owns_sharding:
        _check_fsdp(rung, model)
        from hfdist.models.moe import moe_layers

        if rung.dims.ep > 1 or (rung.uses_tp and moe_layers(model)):
            _check_experts(rung, model)
    if rung.dims.cp > 1:
        _check_context_parallel(rung, model)
    if rung.uses_deepspeed:
        _check_deepspeed(rung, wrapped)
    if lora:
        _check_lora(rung, model)
    if attention is not None:
        _check_attention(rung, model, attention)
    if qlora:
        _check_qlora(rung, model)
