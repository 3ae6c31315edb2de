"""The one parallelize recipe for the rungs hfdist applies itself (FSDP2, TP, PP and their 3D composition).

Steps, in this order, on every rank (DDP and DeepSpeed rungs skip all of it: the Trainer applies them). The model
arrives on the meta device (hfdist.models.build.meta_model, LoRA already injected), so nothing is allocated
before the last two steps, and then only this rank's shards:

    mesh = dims.build_mesh(device)          the DeviceMesh: dp_replicate x dp_shard x cp x pp x tp
    convert_to_float8(model, recipe)        float8 linears in the decoder layers (--fp8; hfdist.parallel.float8)
    apply_tp(model, mesh["tp"])             Megatron TP + sequence parallel + vocab-parallel loss (tp > 1)
    apply_ep(model, mesh ep axis)           an MoE model's experts split whole over ep ranks, tokens dispatched by
                                            all-to-all (ep > 1, or tp > 1: each tp rank routes its own tokens)
    apply_cp(model, mesh["cp"])             attention over sequences sharded across cp ranks (cp > 1: Ulysses,
                                            ring or hybrid, as rung.context planned)
    apply_ac(model)                         activation checkpointing per decoder layer (asked for or in the YAML)
    apply_compile(model)                    torch.compile per decoder layer, in place (--compile)
    split into pipeline stages              this rank's stages only; the rest of the model is dropped (pp > 1)
    apply_fsdp(module, dp_mesh)             FSDP2 per decoder layer + root, per stage under PP (kept gathered
                                            through the step there: reshard_after_forward); over dp_shard x cp;
                                            an MoE model's experts first, over dp_shard / ep x tp
    materialize(module, device)             only the local shards, allocated on the rank's device
    load_weights(local tensors, plan)       each rank reads just its slices of the checkpoint (or seeded init)

The float8 conversion comes first, on the meta model: TP's local linears, the pipeline split and FSDP2 (whose
float8 all-gather needs the converted weights' tensor subclass) all see the float8 linears. TP goes before FSDP2
because FSDP2 shards the TP-split DTensors further over dp (2-D parameters); activation checkpointing is set on
the decoder layers before the split, where they are still reachable from the model; FSDP comes after the split
because it must see the final module tree (stages) to pick its units.

Compilation (torchtitan's order: after TP and activation checkpointing, before FSDP): each decoder layer is compiled
as it will run, with its TP plan's input/output redistributions and its checkpointed forward (HF checkpoints inside
`forward`) in the traced region, and it stays the module FSDP2 makes one unit of, so the compiled region is exactly
one FSDP unit; FSDP2's all-gather / reshard hooks on it run eagerly around the graph (torch marks them
dynamo-disabled). The compile is in place (`module.compile()`, as accelerate's `compile_regions_fsdp2`):
`torch.compile(module)` would return a wrapper whose call bypasses the hooks `fully_shard` adds afterwards, and
would rename every parameter (`_orig_mod.`), which checkpoints and the weight loader key on. DDP
and single-process runs compile the same way in hfdist.job.run, before the Trainer wraps the model in DDP.
The rung table (hfdist.config.rungs) says which rungs take --compile; the others are refused before launch
(check_compile), as is a mixture-of-experts model on any rung.

Precision: FSDP2's MixedPrecisionPolicy is the one mechanism (compute in bf16, parameters, gradient reduction
and optimizer in fp32): a pipeline with one data-parallel rank gets FSDP2 on its 1-rank dp mesh under bf16, so
its stages compute, and hand each other activations, in bf16 like every other mesh rung (no autocast).

Without `weights` the model stays on the meta device, sharded: the recipe can run for simulated ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from hfdist.config.features import refuse_unless
from hfdist.config.ladder import Rung
from hfdist.models.moe import moe_layers

__all__ = ["parallelize", "reshard_after_forward", "apply_ac", "apply_compile", "check_compile", "compile_record",
           "verify_compiled", "uses_fsdp", "fsdp_shard_ranks"]


def apply_ac(model: nn.Module) -> None:
    """Recompute every decoder layer in backward (HF's per-layer checkpointing, non-reentrant)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def check_compile(rung: Rung, config=None) -> None:
    """Refuse --compile on the rungs it is not built or tested for, before any process starts (the rung table's
    `compile`: hfdist.config.features.refuse_unless), and for `config`'s model if it is a mixture of experts.

    Raises:
        ConfigError: naming the rung, why, and the rungs that take --compile.
        ExpertParallelError: an MoE model (hfdist.parallel.expert_check.check_moe_compile).
    """
    refuse_unless(rung, "compile")
    if config is not None:
        from hfdist.parallel.expert_check import check_moe_compile

        check_moe_compile(config, rung)


def _decoder_layers(model: nn.Module, layer_cls_name: str | None = None) -> list[nn.Module]:
    from hfdist.parallel.fsdp import find_layers, fsdp_unit_class

    return find_layers(model, fsdp_unit_class(model, layer_cls_name))


def apply_compile(model: nn.Module, layer_cls_name: str | None = None) -> int:
    """torch.compile every decoder layer in place (regional compilation; see the module docstring for the order).

    The model's KV cache is turned off (`use_cache`): training never reads it, and its per-layer state would make
    the compiler specialise, and recompile, the layer for every layer index. With it off the layers share one
    compiled graph. Returns the number of layers compiled.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.use_cache = False
    layers = _decoder_layers(model, layer_cls_name)
    for layer in layers:
        layer.compile()
    return len(layers)


def _is_compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def compile_record(model: nn.Module, layer_cls_name: str | None = None) -> dict[str, int]:
    """What this rank compiled: its decoder layers, how many of them run compiled, and the graphs dynamo built."""
    from torch._dynamo.utils import counters

    layers = _decoder_layers(model, layer_cls_name)
    return {"decoder_layers": len(layers), "compiled_layers": sum(map(_is_compiled, layers)),
            "graphs": int(counters["stats"]["unique_graphs"])}


def verify_compiled(rung: Rung, model: nn.Module) -> None:
    """Fail unless every decoder layer of `model` (unwrapped) runs compiled (--compile in effect).

    Raises:
        StrategyNotInEffect: naming how many layers are not.
    """
    from hfdist.parallel.verify import StrategyNotInEffect

    record = compile_record(model, rung.fsdp.layer_cls_to_wrap if rung.fsdp else None)
    if not record["decoder_layers"] or record["compiled_layers"] != record["decoder_layers"]:
        raise StrategyNotInEffect(
            f"--compile is not in effect on {rung.name}: {record['compiled_layers']} of {record['decoder_layers']} "
            "decoder layers are compiled modules. hfdist stops rather than train eagerly when compiled training was "
            "asked for.")


def uses_fsdp(rung: Rung, mixed_precision: str) -> bool:
    """Whether the recipe applies FSDP2: every mesh rung, except a pipeline with one data-parallel rank in fp32
    (nothing to shard there, and no compute dtype to cast to)."""
    return rung.uses_fsdp or (rung.owns_sharding and mixed_precision == "bf16")


def fsdp_shard_ranks(rung: Rung, mixed_precision: str) -> int:
    """The ranks FSDP2 shards each parameter over in the recipe (dp_shard x cp); 1 where it applies no FSDP2."""
    return rung.dims.dp_shard * rung.dims.cp if rung.owns_sharding and uses_fsdp(rung, mixed_precision) else 1


def reshard_after_forward(rung: Rung) -> bool:
    """Whether FSDP2 frees a decoder layer's gathered parameters after its forward: the YAML's setting, except on
    pipeline stages, which keep them. A schedule runs every micro-batch's forward and backward through a stage within
    one step, and torch's stages already keep the parameters gathered from backward to the next forward (and reduce
    the gradients once, after the last micro-batch); resharding after each forward would all-gather every layer
    again for every micro-batch's backward, exposed in the bubble rather than overlapped (torchtitan's rule under
    pipelining too). The planner counts pipeline stages' layers as gathered through the step accordingly."""
    assert rung.fsdp is not None
    return rung.fsdp.reshard_after_forward and not rung.uses_pipeline


def parallelize(model: nn.Module, rung: Rung, *, device: torch.device, mixed_precision: str,
                activation_checkpointing: bool, compile: bool = False, fp8: str | None = None,
                weights=None) -> nn.Module:
    """Apply `rung`'s parallelism to `model` (on the meta device, LoRA already injected) on this rank; see the
    module docstring.

    Args:
        device: the rank's device (its type is the mesh's).
        compile: torch.compile each decoder layer (check_compile must have accepted the rung).
        fp8: a float8 recipe of hfdist.parallel.float8 (its decoder projections compute in float8), or None.
        weights: a hfdist.models.load.WeightPlan made from the full model: the local shards are materialised on
            `device` and filled from it. None: the model stays on the meta device.

    Returns:
        The model, sharded in place; under pipeline parallelism a PipelineModel holding this rank's stages.
    """
    from hfdist.parallel.fsdp import apply_fsdp

    assert rung.owns_sharding and rung.fsdp is not None
    dims = rung.dims
    mesh = dims.build_mesh(device.type)
    if fp8 is not None:
        from hfdist.parallel.float8 import convert_to_float8
        from hfdist.parallel.float8_check import gathers_in_float8

        convert_to_float8(model, fp8, tp=dims.tp,
                          all_gather=gathers_in_float8(fp8, fsdp_shard_ranks(rung, mixed_precision)))
    if rung.uses_tp:
        from hfdist.parallel.tensor import apply_tp

        apply_tp(model, mesh["tp"])
    expert_mesh = None
    if dims.ep > 1 or (rung.uses_tp and moe_layers(model)):  # experts split over ep, or routing tp-local tokens
        from hfdist.parallel.expert import apply_ep, expert_meshes

        ep_mesh, expert_mesh = expert_meshes(mesh, dims.ep, dims.tp)
        apply_ep(model, ep_mesh)
    if dims.cp > 1:
        from hfdist.parallel.context import apply_cp
        from hfdist.parallel.fit import check_context_parallel

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        apply_cp(model, mesh["cp"], tp=dims.tp, plan=check_context_parallel(base.config, rung))
    if activation_checkpointing or rung.fsdp.activation_checkpointing:
        apply_ac(model)
    if compile:
        apply_compile(model, rung.fsdp.layer_cls_to_wrap)

    dp_mesh = dims.fsdp_mesh(mesh)

    def shard(module: nn.Module) -> nn.Module:
        return apply_fsdp(module, dp_mesh, layer_cls_name=rung.fsdp.layer_cls_to_wrap,
                          reshard_after_forward=reshard_after_forward(rung),
                          param_dtype=torch.bfloat16 if mixed_precision == "bf16" else None,
                          offload_params=rung.fsdp.offload_params and device.type == "cuda", expert_mesh=expert_mesh)

    if not rung.uses_pipeline:
        model = shard(model)
        if weights is not None:
            _materialize_and_load([(model, None)], device, weights)
        return model
    return _split_pipeline(model, rung, mesh, shard if uses_fsdp(rung, mixed_precision) else None, device, weights)


def _materialize_and_load(modules: list[tuple[nn.Module, object]], device: torch.device, weights) -> None:
    """Allocate the local shards of `modules` on `device` and fill them, each rank its own."""
    from hfdist.models.build import materialize
    from hfdist.models.load import load_weights, local_tensors
    from hfdist.models.quantize import load_quantized

    for module, _ in modules:
        materialize(module, device)
    load_weights(local_tensors(modules), weights)
    for module, rename in modules:  # QLoRA's 4-bit projections: each rank quantises the rows of its shards
        load_quantized(module, weights, rename, device)


def _split_pipeline(model: nn.Module, rung: Rung, mesh, shard, device: torch.device, weights) -> nn.Module:
    """Cut the (TP-split) model into this rank's pipeline stages, each FSDP-sharded over dp when `shard` is set."""
    from hfdist.parallel.pipeline.model import PipelineModel
    from hfdist.parallel.pipeline.runner import PipelineRunner

    assert rung.pipeline is not None
    config = model.config
    runner = PipelineRunner(model, mesh["pp"], schedule=rung.pipeline.schedule,
                            n_microbatches=rung.pipeline.n_microbatches, parallelize=shard,
                            activation_mesh=mesh["tp"] if rung.uses_tp else None)
    if weights is not None:
        _materialize_and_load([(stage, stage.original_name) for stage in runner.stages], device, weights)
    # FSDP2 averages gradients over the dp replicas and the cp ranks; the loss normaliser is scaled by dp x cp to
    # undo that.
    return PipelineModel(runner, config, loss_scale=rung.dims.dp * rung.dims.cp if shard is not None else 1)
