"""FSDP2 (`fully_shard`) for HF causal LMs: FULL_SHARD on a 1-D mesh, HYBRID_SHARD (HSDP) on a 2-D one.

hfdist applies FSDP itself rather than through accelerate: accelerate only engages FSDP on GPU-like backends and
silently runs DDP on CPU, and the same code path on CPU and GPU is what makes the CPU tests mean something.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from hfdist.errors import HfdistError

__all__ = ["FsdpError", "apply_fsdp", "fsdp_unit_class", "find_layers", "is_instance_of_named", "fsdp_units",
           "gathered_whole",
           "fsdp_policy", "fsdp_compute_dtype"]


class FsdpError(HfdistError, ValueError):
    """FSDP settings that cannot apply to this model."""


def is_instance_of_named(module: nn.Module, class_name: str) -> bool:
    """Whether `module`'s class or a base is named `class_name` (fully_shard subclasses it as FSDP<name>)."""
    return any(c.__name__ == class_name for c in type(module).__mro__)


def fsdp_unit_class(model: nn.Module, configured: str | None = None) -> str:
    """The class name FSDP wraps one unit per instance of: the config's `fsdp_transformer_layer_cls_to_wrap` when
    set, else the decoder layer of a registered architecture, else the model's own `_no_split_modules` (what HF
    declares must stay whole: its decoder layer).

    Raises:
        FsdpError: none of these names a class.
    """
    if configured:
        return configured
    from hfdist.models.registry import facts_for, is_supported

    if is_supported(model):
        return facts_for(model).decoder_layer
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if names:
            return names[0]
    raise FsdpError(f"{type(model).__name__} declares no decoder-layer class (_no_split_modules) and its architecture "
                    "is not in hfdist's registry: set fsdp_transformer_layer_cls_to_wrap in the config to the class "
                    "of its repeated layer.")


def find_layers(model: nn.Module, layer_cls_name: str) -> list[nn.Module]:
    """Every submodule whose class is named `layer_cls_name` (the unit FSDP wraps).

    Raises:
        FsdpError: no such module, naming the classes that do repeat in the model (the usual fix).
    """
    layers = [m for m in model.modules() if is_instance_of_named(m, layer_cls_name)]
    if not layers:
        counts: dict[str, int] = {}
        for m in model.modules():
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
        repeated = sorted((n for n, c in counts.items() if c > 1 and n.endswith("Layer")), key=counts.get)
        raise FsdpError(
            f"fsdp_transformer_layer_cls_to_wrap is '{layer_cls_name}', but the model has no module of that class, "
            f"so FSDP would wrap the whole model as one unit (no memory saved). Repeated layer classes in this "
            f"model: {repeated or 'none'}. Set fsdp_transformer_layer_cls_to_wrap in the config to one of them."
        )
    return layers


def apply_fsdp(
    model: nn.Module,
    mesh,
    layer_cls_name: str | None = None,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    offload_params: bool = False,
    expert_mesh=None,
) -> nn.Module:
    """Shard `model` in place with FSDP2: each transformer layer is one unit, the root holds the rest.

    Args:
        mesh: DeviceMesh of the data-parallel axes: 1-D (dp_shard) for FULL_SHARD, 2-D (dp_replicate, dp_shard)
            for HYBRID_SHARD, where fully_shard replicates over the first axis and shards over the second.
        layer_cls_name: class name of the unit to wrap; default `fsdp_unit_class(model)` (the decoder layer).
        param_dtype: compute dtype of the all-gathered params (bf16 under --mixed-precision bf16, on CPU too; the
            sharded params stay fp32); gradients are then reduced in fp32. None: compute in the params' dtype.
        offload_params: keep sharded params and optimizer state in CPU RAM (GPU only).
        expert_mesh: an MoE model's experts are units of their own over this mesh, sharded first
            (hfdist.parallel.expert.shard_experts: expert parallelism, or tensor parallelism on an MoE model).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    layers = find_layers(model, fsdp_unit_class(model, layer_cls_name))
    kwargs = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None),
        offload_policy=CPUOffloadPolicy() if offload_params else OffloadPolicy(),
    )
    if expert_mesh is not None:
        from hfdist.parallel.expert import shard_experts

        shard_experts(model, expert_mesh, mesh.size(), reshard_after_forward=reshard_after_forward,
                      mp_policy=kwargs["mp_policy"], offload_policy=kwargs["offload_policy"])
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root's params (embeddings, final norm, lm_head) are used last in backward: no point resharding them.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 units in `model` (the modules `fully_shard` was applied to), outermost first."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp_policy(unit: nn.Module):
    """The MixedPrecisionPolicy an FSDP2 unit runs with."""
    # FSDP2 keeps the policy in its module state; torch 2.13 has no public getter for it.
    return unit._get_fsdp_state()._mp_policy


def fsdp_compute_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype FSDP2's policy computes `model`'s units in (None: no FSDP2 unit, or no cast)."""
    units = fsdp_units(model)
    return fsdp_policy(units[0]).param_dtype if units else None


@contextlib.contextmanager
def gathered_whole(model: nn.Module, reshard_after_forward: bool) -> Iterator[None]:
    """`model`'s FSDP2 units all-gathered once and kept whole inside the block (generation: every token's forward
    would otherwise gather every layer again), resharded on leaving it, each unit's resharding after forward put back
    as apply_fsdp set it (`reshard_after_forward` for the inner units, never for the root). The whole model is held
    on every rank meanwhile, in the units' compute dtype. No FSDP2 unit: nothing happens."""
    units = fsdp_units(model)
    if not units:
        yield
        return
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(reshard_after_forward and unit is not units[0], recurse=False)
