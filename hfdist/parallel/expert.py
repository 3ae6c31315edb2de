"""Expert parallelism for the registered MoE architectures (hfdist.models.moe): each of `ep` ranks holds E / ep whole
experts of every MoE layer, tokens travel to their experts and back by all-to-all (hfdist.parallel.expert_dispatch),
and FSDP2 shards each rank's experts further over the data-parallel ranks left.

The layout borrows ep from the ranks FSDP2 shards the dense parameters over (torchtitan's dp_shard_in_ep /
dp_shard_mod_ep): the world stays dp_replicate x dp_shard x cp x pp x tp, dp_shard is unflattened into
dp_shard_mod_ep x ep (ep innermost, so an expert-parallel group is neighbouring ranks), and

    attention, norms, embeddings, lm_head, routers   FSDP2 over dp_shard (and TP-split under tp, as for any model)
    routed experts                                   Shard(0) over ep, then FSDP2 over dp_shard_mod_ep x tp

Under tensor parallelism (sequence parallel) an MoE block computes on the rank's own S / tp tokens: no all-gather
before it and no reduce-scatter after; its experts are not split inside (a tp rank is one more data-parallel rank
for them: FSDP2 shards them over tp too and sums their gradients across it), its router runs on local tokens with
a replicated weight whose gradient is summed over tp, and Llama 4's shared expert is split like a dense MLP.
FSDP2 would average the experts' gradients over their own (smaller) mesh; they are scaled to divide by the dense
parameters' mesh instead, so both are the same sum over the data-parallel ranks (hfdist.train's loss scaling relies
on it).

Where neither ep nor tp splits the experts (single, ddp, fsdp_full_shard) the model's own MoE blocks run
unchanged. The recipe (hfdist.parallel.parallelize): apply_tp -> apply_ep -> ... -> apply_fsdp, whose expert units
come first (`shard_experts`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hfdist.models.moe import MoeLayer, causal_lm_of, moe_layers
from hfdist.models.moe_facts import MoeFacts
from hfdist.models.registry import ModelFacts
from hfdist.parallel.dtensors import local_tensor
from hfdist.parallel.expert_check import ExpertParallelError, check_ep_degree
from hfdist.parallel.expert_dispatch import routed_experts

__all__ = ["MoeLayer", "moe_layers", "is_expert_param", "expert_meshes", "apply_ep", "shard_experts",
           "moe_tp_plan", "check_experts", "STACKED"]

STACKED = ("gate_up_proj", "down_proj")  # the experts module's stacked parameters


def is_expert_param(name: str) -> bool:
    """Whether a parameter name (any prefix) is a routed expert's stacked weight."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] in STACKED and parts[-2] == "experts"


def expert_meshes(mesh: DeviceMesh, ep: int, tp: int) -> tuple[DeviceMesh | None, DeviceMesh]:
    """(the expert-parallel mesh, or None for ep = 1; the mesh FSDP2 shards the experts over): dp_shard of `mesh`
    (hfdist.config.dims.ParallelDims.build_mesh) unflattened into dp_shard_mod_ep x ep, the experts' FSDP2 mesh
    dp_shard_mod_ep x tp flattened."""
    shard = mesh["dp_shard"].size()
    sparse = mesh._unflatten("dp_shard", (shard // ep, ep), ("dp_shard_mod_ep", "ep"))
    axes = ("dp_shard_mod_ep", "tp") if tp > 1 else ("dp_shard_mod_ep",)
    fsdp = sparse[axes]._flatten("efsdp") if len(axes) > 1 else sparse["dp_shard_mod_ep"]
    return (sparse["ep"] if ep > 1 else None), fsdp


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _weights(experts: nn.Module, name: str) -> torch.Tensor:
    """A stacked weight as this rank computes with it (its experts), its gradient scaled so that FSDP2's average
    over the experts' mesh is the dense parameters' (`shard_experts`)."""
    local = local_tensor(getattr(experts, name))
    scale = getattr(experts, "hfdist_grad_scale", 1.0)
    return _ScaleGrad.apply(local, scale) if scale != 1.0 else local


def _experts_forward(experts: nn.Module, facts: MoeFacts, num_experts: int, group,
                     hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return routed_experts(hidden, expert_ids, weights, _weights(experts, "gate_up_proj"), _weights(experts, "down_proj"),
                          experts.act_fn, num_experts=num_experts, transposed=facts.transposed,
                          weights_input=facts.weights_input, group=group)


def _route(block: nn.Module, facts: MoeFacts, k: int, x: torch.Tensor):
    """(router logits, each token's k weights, its k experts) through the block's own router module (its hooks run:
    hfdist.models.router_stats records from them)."""
    router = block.get_submodule(facts.router)
    if facts.weights_input:  # Llama 4: the sigmoid of the top-k logits, zero elsewhere; its top-k again for the ids
        scores, logits = router(x)
        expert_ids = torch.topk(logits, k, dim=1).indices
        return logits, scores.gather(1, expert_ids), expert_ids
    return router(x)


def _block_forward(block: nn.Module, facts: MoeFacts, k: int, hidden_states: torch.Tensor):
    """The MoE block as transformers computes it, with its experts called as hfdist's (dispatching) module."""
    if getattr(block, "jitter_noise", 0) and block.training:
        raise ExpertParallelError("router_jitter_noise > 0 draws noise per rank; hfdist's expert parallelism "
                                  "does not reproduce it. Set router_jitter_noise to 0 in the config.")
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    logits, weights, expert_ids = _route(block, facts, k, x)
    out = block.get_submodule(facts.experts)(x, expert_ids, weights)
    if facts.shared_expert is not None:
        out = block.get_submodule(facts.shared_expert)(hidden_states).reshape(-1, shape[-1]) + out
    if facts.weights_input:  # Llama 4's decoder layer takes (flat output, router logits)
        return out, logits
    return out.reshape(shape)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh | None) -> list[MoeLayer]:
    """Every MoE block of `model` computes through hfdist's dispatching experts: with `ep_mesh` each rank keeps E / ep
    whole experts (the stacked weights become DTensors Shard(0) on it); without, every expert stays here (tensor
    parallelism alone: each tp rank routes its own tokens). Apply after apply_tp, before FSDP2.

    Returns:
        The model's MoE layers.

    Raises:
        ExpertParallelError: experts not divisible by ep, or a model without MoE layers.
    """
    layers = moe_layers(model)
    if not layers:
        raise ExpertParallelError(f"apply_ep needs a mixture-of-experts model; {type(causal_lm_of(model)).__name__} "
                                  "has no MoE layers.")
    config = causal_lm_of(model).config
    facts = layers[0].facts
    num_experts, k = facts.num_experts(config), facts.top_k(config)
    ep = ep_mesh.size() if ep_mesh is not None else 1
    check_ep_degree(config, facts, ep)
    group = ep_mesh.get_group() if ep_mesh is not None else None
    for layer in layers:
        experts = layer.experts
        if ep_mesh is not None:
            for name in STACKED:
                p = experts.get_parameter(name)
                experts.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), ep_mesh, [Shard(0)]),
                                                              p.requires_grad))
        experts.forward = _bind(_experts_forward, experts, facts, num_experts, group)
        layer.block.forward = _bind(_block_forward, layer.block, facts, k)
        layer.block.hfdist_ep = ep
    return layers


def _bind(fn, *args):
    """fn with its leading arguments fixed (a module's replacement forward)."""
    def forward(*rest: Any, **kwargs: Any):
        return fn(*args, *rest, **kwargs)
    return forward


def shard_experts(model: nn.Module, mesh: DeviceMesh, divide_factor: int, **fsdp_kwargs: Any) -> int:
    """FSDP2 on each MoE layer's experts module, as its own unit over `mesh` (expert_meshes' second), before the
    decoder layers are: their gradients end up divided by `divide_factor`, the dense units' mesh size, not by
    `mesh`'s (module docstring). FSDP2's own set_gradient_divide_factor reduces with a pre-multiplied sum, which
    gloo lacks; so the experts' local gradient is scaled by mesh size / divide_factor in backward instead (exact
    for powers of two) and FSDP2 averages as usual. Returns the number of units."""
    from torch.distributed.fsdp import fully_shard

    layers = moe_layers(model)
    for layer in layers:
        # FSDP2 splits dim 0 (the experts) unless a rank's experts do not divide over the mesh (Llama 4 Scout: 16
        # experts, ep 8, 8 ranks left: 2 experts over 8 ranks), where whole rows would leave most ranks empty and a
        # few holding whole experts; there it splits dim 1 (2I or H wide), as torchtitan does.
        local = local_tensor(layer.experts.gate_up_proj).shape[0]
        dim = 0 if local % mesh.size() == 0 else 1
        fully_shard(layer.experts, mesh=mesh, shard_placement_fn=lambda param, d=dim: Shard(d), **fsdp_kwargs)
        layer.experts.hfdist_grad_scale = mesh.size() / divide_factor
    return len(layers)


def moe_tp_plan(config, facts: ModelFacts, styles: dict[str, Any]) -> dict[str, Any]:
    """The tensor-parallel plan's entries for the MLP side of an MoE model's decoder layers (hfdist.parallel.tensor
    adds them to the attention's), per layer: a dense layer's MLP as in a dense model (gathered, column- then
    row-split); an MoE block on local tokens, its router replicated (gradient summed over tp), Llama 4's shared
    expert split like a dense MLP.

    Args:
        styles: "gather" (the block's input style), "router" (a replicated module on local tokens), and
            "linear(name, colwise)" -> {path suffix: style} for one projection (LoRA-aware), from the plan's maker.
    """
    moe = facts.moe
    assert moe is not None
    sparse = set(moe.moe_layer_indices(config))
    plan: dict[str, Any] = {}

    def mlp(path: str) -> None:
        plan[path] = styles["gather"]
        for name, colwise in (("gate_proj", True), ("up_proj", True), ("down_proj", False)):
            plan.update(styles["linear"](f"{path}.{name}", colwise))

    for i in range(int(config.num_hidden_layers)):
        block = f"{facts.layers}.{i}.{moe.block}"
        if i not in sparse:
            mlp(block)
            continue
        plan[f"{block}.{moe.router}"] = styles["router"]
        if moe.shared_expert is not None:
            mlp(f"{block}.{moe.shared_expert}")
    return plan


def check_experts(model: nn.Module, ep: int) -> None:
    """Raise unless every MoE block computes through hfdist's experts and, with ep > 1, each rank's experts are the
    E / ep of its ep rank (the stacked weights Shard(0) over an "ep" mesh axis of size ep).

    Raises:
        ExpertParallelError: naming the layer and what is off.
    """
    layers = moe_layers(model)
    if not layers:
        raise ExpertParallelError("expert parallelism was asked for, but the model has no MoE layers")
    for layer in layers:
        if getattr(layer.block, "hfdist_ep", None) != ep:
            raise ExpertParallelError(f"{layer.path} does not compute through hfdist's expert-parallel experts "
                                      f"(ep={ep})")
        if ep == 1:
            continue
        for name in STACKED:
            p = getattr(layer.experts, name)
            names = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
            if "ep" not in names:
                raise ExpertParallelError(f"{layer.path}.experts.{name} is not split over an ep mesh axis")
            axis = names.index("ep")
            if p.device_mesh.size(axis) != ep or p.placements[axis] != Shard(0):
                raise ExpertParallelError(f"{layer.path}.experts.{name} is placed {p.placements} on "
                                          f"{p.device_mesh}, not Shard(0) over ep={ep}")
