"""The memory planner's arithmetic for mixture-of-experts models (hfdist.models.moe.MoeShape), torch-free, read by
hfdist.plan.bytes and the planner: which ep a cluster gets, what a rank gathers of an MoE layer, the experts' bytes
a rank holds, and the all-to-all traffic of a step.

How hfdist lays the experts out (hfdist.parallel.expert): each MoE layer's E experts are split whole over ep ranks
(borrowed from dp_shard) and each rank's E / ep experts are sharded by FSDP2 over dp_shard / ep x tp; attention and
the other dense weights are FSDP2 over dp_shard (and TP-split). So:

- held (model states): the experts divide by ep x dp_shard / ep x tp = dp_shard x tp ranks, exactly as the dense
  projections divide by dp_shard x tp: ep does not change what a rank holds between steps;
- gathered (FSDP2's all-gather of a unit while it computes): a rank gathers its E / ep experts whole (tp does not
  split them inside: each tp rank routes its own tokens), instead of all E under plain FSDP2: ep's memory win;
- all-to-all: per MoE layer and micro-batch a rank sends each of its tokens' k rows (hidden wide) to the experts'
  ranks and receives them back (dispatch + combine), and backward sends their gradients the same two ways: 4 x
  tokens x k x hidden x element bytes, of which the share (ep - 1) / ep leaves the rank.
"""

from __future__ import annotations

from typing import Any

from hfdist.config.dims import ParallelDims
from hfdist.models.moe import MoeShape

__all__ = ["choose_ep", "gathered_layer_params", "expert_bytes_per_rank", "all_to_all_bytes_per_step", "ep_rungs",
           "moe_note", "gathered_expert_delta", "moe_step_terms"]


def choose_ep(experts: int, dp_shard: int, gpus_per_node: int) -> int:
    """The ep an expert-parallel rung gets on a cluster: the largest degree that splits the experts whole, divides
    dp_shard and keeps an ep group inside one node (all-to-all over NVLink, not the inter-node fabric): the fewest
    experts, so the least gathered, per rank."""
    return max(d for d in range(1, min(dp_shard, gpus_per_node) + 1) if experts % d == 0 and dp_shard % d == 0)


def gathered_layer_params(linear_params: float, moe: MoeShape | None, hidden: int, layers: int, tp: int,
                          ep: int) -> float:
    """Parameters of one decoder layer (mean over layers) as FSDP2 gathers them on a rank: the projections split
    by tp (`linear_params`, every expert counted: hfdist.models.shape.ModelShape.layer_linear_params) plus its two
    norms, except that an MoE layer's routed experts are gathered E / ep at a time, whole (module docstring)."""
    whole = linear_params / tp + 2 * hidden
    if moe is None:
        return whole
    experts = moe.expert_params(hidden) * moe.layers / layers  # per layer, averaged
    return whole - experts / tp + experts / ep


def gathered_expert_delta(moe: MoeShape | None, hidden: int, layers: int, stage_layers: int, tp: int,
                          ep: int) -> float:
    """What a rank gathers of its pipeline stage's routed experts beyond the tp share the dense accounting gives
    them: E / ep experts whole instead of E / tp (module docstring); 0 for a dense model."""
    if moe is None:
        return 0.0
    experts = moe.expert_params(hidden) * moe.layers / layers * stage_layers
    return experts / ep - experts / tp


def expert_bytes_per_rank(moe: MoeShape | None, hidden: int, dims: ParallelDims, weight_bytes: float) -> float:
    """Bytes of routed-expert weights one rank holds between steps (`weight_bytes` per parameter): every MoE layer's
    experts over dp_shard x tp ranks (E / ep whole experts per ep rank, FSDP2 over the rest)."""
    if moe is None:
        return 0.0
    return moe.layers * moe.expert_params(hidden) * weight_bytes / (dims.dp_shard * dims.tp)


def all_to_all_bytes_per_step(moe: MoeShape | None, hidden: int, dims: ParallelDims, tokens_per_rank: int,
                              elem: int) -> int:
    """Bytes one rank sends by all-to-all in a training step (forward and backward) over every MoE layer, for
    `tokens_per_rank` tokens in the step (its micro-batches' tokens over tp: each tp rank routes its own shard);
    0 without expert parallelism."""
    if moe is None or dims.ep == 1:
        return 0
    rows = tokens_per_rank / dims.tp * moe.top_k
    return int(4 * rows * hidden * elem * moe.layers * (dims.ep - 1) / dims.ep)


def ep_rungs(rung, config: Any, gpus_per_node: int) -> list:
    """`rung` (laid out on a cluster) once per ep it can take for `config` (the planner's layouts): on a rung that
    takes --ep (hfdist.config.rungs: `takes_ep`) an MoE model's experts at every degree that splits them whole,
    divides dp_shard and keeps an ep group inside a node (fsdp_ep's without ep 1, fsdp_full_shard's layout); a dense
    model on an expert-parallel rung: none; any other rung as it is."""
    from dataclasses import replace

    from hfdist.parallel.expert_check import moe_facts

    facts = moe_facts(config)
    if facts is None:
        return [rung] if rung.dims.ep == 1 else []
    if rung.info is None or not rung.info.takes_ep or rung.dims.cp > 1 or rung.dims.pp > 1:
        return [rung]
    experts, shard = facts.num_experts(config), rung.dims.dp_shard
    degrees = [d for d in range(1, min(shard, gpus_per_node) + 1)
               if experts % d == 0 and shard % d == 0 and (d > 1 or rung.dims.ep == 1)]
    return [replace(rung, dims=replace(rung.dims, ep=d)) for d in degrees]


def moe_note(moe: MoeShape | None, hidden: int, dims: ParallelDims, tokens: int, elem: int,
             bytes_per_param: int) -> str:
    """A plan's line on an MoE model's routed experts at a layout: their model-state bytes per rank and, with ep,
    the all-to-all per micro-batch of `tokens` tokens ("" for a dense model)."""
    if moe is None:
        return ""
    states = expert_bytes_per_rank(moe, hidden, dims, bytes_per_param) / 1e9
    where = f"E/ep = {moe.experts // dims.ep} whole experts per ep rank" if dims.ep > 1 else "all experts"
    line = f"routed experts: {states:.1f} GB of model states per rank ({where}, over dp_shard x tp = " \
        f"{dims.dp_shard * dims.tp} ranks)"
    if dims.ep > 1:
        line += f", all-to-all {all_to_all_bytes_per_step(moe, hidden, dims, tokens, elem) / 1e9:.2f} GB per micro-batch"
    return line


def moe_step_terms(moe: MoeShape | None, hidden: int, layers: int, stage_layers: int, dims: ParallelDims,
                   tokens: int, elem: int, forwards: int, backwards: int) -> tuple[float, float, float, float]:
    """What an MoE model changes in a rank's collectives of one step (hfdist.plan.cost), for its pipeline stage's
    `stage_layers` decoder layers, `tokens` per forward on the rank, `forwards` / `backwards` passes in the step:
    (extra parameters FSDP2 gathers and reduce-scatters: gathered_expert_delta; the MoE layers whose MLP has no tp
    all-gather / reduce-scatter pair: they route tp-local tokens; the all-to-all buffer bytes of the step: each
    token's k rows there and back, in every forward and backward; the all-to-all calls). Zeros for a dense model."""
    if moe is None:
        return 0.0, 0.0, 0.0, 0.0
    moe_layers = moe.layers / layers * stage_layers
    delta = gathered_expert_delta(moe, hidden, layers, stage_layers, dims.tp, dims.ep)
    tp_saved = moe_layers if dims.tp > 1 else 0.0
    if dims.ep == 1:
        return delta, tp_saved, 0.0, 0.0
    rows = tokens / dims.tp * moe.top_k
    passes = forwards + backwards
    return delta, tp_saved, 2 * rows * hidden * elem * moe_layers * passes, 2 * moe_layers * passes
