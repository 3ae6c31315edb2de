"""The one parallelize recipe for the rungs hfdist applies itself (FSDP2, TP, PP and their 3D composition).

Steps, in this order, on every rank (DDP and DeepSpeed rungs skip all of it: the Trainer applies them). The model
arrives on the meta device (hfdist.models.build.meta_model, LoRA already injected), so nothing is allocated
before the last two steps, and then only this rank's shards:

    mesh = dims.build_mesh(device)          the DeviceMesh: dp_replicate x dp_shard x cp x pp x tp
    apply_tp(model, mesh["tp"])             Megatron TP + sequence parallel + vocab-parallel loss (tp > 1)
    apply_cp(model, mesh["cp"])             attention over sequences sharded across cp ranks (Ulysses, cp > 1)
    apply_ac(model)                         activation checkpointing per decoder layer (asked for or in the YAML)
    split into pipeline stages              this rank's stages only; the rest of the model is dropped (pp > 1)
    apply_fsdp(module, dp_mesh)             FSDP2 per decoder layer + root, per stage under PP; over dp_shard x cp
    materialize(module, device)             only the local shards, allocated on the rank's device
    load_weights(local tensors, plan)       each rank reads just its slices of the checkpoint (or seeded init)

TP goes first because FSDP2 shards the TP-split DTensors further over dp (2-D parameters); activation
checkpointing is set on the decoder layers before the split, where they are still reachable from the model; FSDP
comes after the split because it must see the final module tree (stages) to pick its units.

Precision: FSDP2's MixedPrecisionPolicy is the one mechanism (compute in bf16, parameters, gradient reduction
and optimizer in fp32): a pipeline with one data-parallel rank gets FSDP2 on its 1-rank dp mesh under bf16, so
its stages compute, and hand each other activations, in bf16 like every other mesh rung (no autocast).

Without `weights` the model stays on the meta device, sharded: the recipe can run for simulated ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from hfdist.job.ladder import Rung

__all__ = ["parallelize", "apply_ac", "uses_fsdp"]


def apply_ac(model: nn.Module) -> None:
    """Recompute every decoder layer in backward (HF's per-layer checkpointing, non-reentrant)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def uses_fsdp(rung: Rung, mixed_precision: str) -> bool:
    """Whether the recipe applies FSDP2: every mesh rung, except a pipeline with one data-parallel rank in fp32
    (nothing to shard there, and no compute dtype to cast to)."""
    return rung.uses_fsdp or (rung.owns_sharding and mixed_precision == "bf16")


def parallelize(model: nn.Module, rung: Rung, *, device: torch.device, mixed_precision: str,
                activation_checkpointing: bool, weights=None) -> nn.Module:
    """Apply `rung`'s parallelism to `model` (on the meta device, LoRA already injected) on this rank; see the
    module docstring.

    Args:
        device: the rank's device (its type is the mesh's).
        weights: a hfdist.models.load.WeightPlan made from the full model: the local shards are materialised on
            `device` and filled from it. None: the model stays on the meta device.

    Returns:
        The model, sharded in place; under pipeline parallelism a PipelineModel holding this rank's stages.
    """
    from hfdist.parallel.fsdp import apply_fsdp

    assert rung.owns_sharding and rung.fsdp is not None
    dims = rung.dims
    mesh = dims.build_mesh(device.type)
    if rung.uses_tp:
        from hfdist.parallel.tensor import apply_tp

        apply_tp(model, mesh["tp"])
    if dims.cp > 1:
        from hfdist.parallel.context import apply_cp

        apply_cp(model, mesh["cp"], tp=dims.tp)
    if activation_checkpointing or rung.fsdp.activation_checkpointing:
        apply_ac(model)

    dp_mesh = dims.fsdp_mesh(mesh)

    def shard(module: nn.Module) -> nn.Module:
        return apply_fsdp(module, dp_mesh, layer_cls_name=rung.fsdp.layer_cls_to_wrap,
                          reshard_after_forward=rung.fsdp.reshard_after_forward,
                          param_dtype=torch.bfloat16 if mixed_precision == "bf16" else None,
                          offload_params=rung.fsdp.offload_params and device.type == "cuda")

    if not rung.uses_pipeline:
        model = shard(model)
        if weights is not None:
            _materialize_and_load([(model, None)], device, weights)
        return model
    return _split_pipeline(model, rung, mesh, shard if uses_fsdp(rung, mixed_precision) else None, device, weights)


def _materialize_and_load(modules: list[tuple[nn.Module, object]], device: torch.device, weights) -> None:
    """Allocate the local shards of `modules` on `device` and fill them, each rank its own."""
    from hfdist.models.build import materialize
    from hfdist.models.load import load_weights
    from hfdist.train.export import local_tensors

    for module, _ in modules:
        materialize(module, device)
    load_weights(local_tensors(modules), weights)


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
    # FSDP2 averages gradients over the dp replicas; the loss normaliser is scaled by dp to undo that.
    return PipelineModel(runner, config, loss_scale=rung.dims.dp if shard is not None else 1)
