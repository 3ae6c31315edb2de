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

from hfdist.config.dims import ParallelDims
from hfdist.models.moe import MoeShape

__all__ = ["choose_ep", "gathered_layer_params", "expert_bytes_per_rank", "all_to_all_bytes_per_step"]


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
