"""What each context-parallel method costs one rank: activations beyond a plain layer's, buffers in flight, and
bytes sent per step. Torch-free: hfdist.plan.bytes adds the first two to a cp rung's activations, and the planner
prices the third (hfdist.plan.cost: the all-to-alls on the Ulysses group, the ring's point-to-point messages).

Per decoder layer on one rank, with t = the rank's tokens (seq x micro-batch / cp), per tp rank H query heads, KV kv
heads (each at least 1), head dim D, e bytes per activation element, and a plan of Ulysses degree u and ring r
(hfdist.parallel.context_check.CpPlan; cp = u x r):

    Ulysses (u = cp): the attention saves the gathered q, k, v and output: the plain layer's bytes
        (hfdist.models.shape counts q, output, k, v and the log-sum-exp per token), plus the kv heads repeated to
        KV' = KV x kv_repeats(KV, u) when u does not divide KV: 2 t D (KV' - KV) e more.
        In flight: each all-to-all's contiguous send copy and receive buffer of q, k, v (then of the output):
        2 t D (H + 2 KV') e.
        Sent per layer: 4 all-to-alls forward (q, k, v, output) and the same 4 of their gradients backward, each
        sending (u - 1) / u of its tensor: 2 (u - 1) / u t D (2 H + 2 KV') e.
    ring (r = cp): saves the plain layer's bytes (the rank's own q, k, v, output and log-sum-exp).
        In flight (backward, the peak): two key/value blocks (the one attended, the one arriving) 4 t KV D e, the
        fp32 gradient accumulators of three blocks (this step's, the one arriving, the one sent) 6 t KV D 4, and
        the fp32 query gradient t H D 4. Never more than two blocks: O(t), not O(seq). The block kernels
        (hfdist.parallel.ring_kernels) hold no score tiles: torch's flash kernels, on CPU and, in bf16, on CUDA
        (whose call repeats a block's KV heads to H for the call's length: transient, not counted); an fp32 run on
        a GPU takes the tiled kernel, 512 x (its block's tokens) fp32 scores per head, not counted either.
        Sent per layer: keys and values r - 1 times forward and backward, their fp32 gradients r times:
        2 (r - 1) t KV D e x 2 + 2 r t KV D 4.
    hybrid (u x r): Ulysses over u (as above with KV'), then the ring over r on the group's gathered share: blocks of
        u t tokens with H / u query heads and KV' / u kv heads, so the ring's terms with t -> u t, H -> H / u and
        KV -> KV' / u; the two in-flight sets counted together.

Activation checkpointing recomputes every layer's forward once more: its forward exchanges are sent twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfdist.models.shape import ModelShape
from hfdist.parallel.context_check import CpPlan, kv_repeats

__all__ = ["CpLayerCosts", "cp_layer_costs", "cp_step_send_bytes"]


@dataclass(frozen=True)
class CpLayerCosts:
    """One decoder layer's context-parallel costs on one rank (bytes)."""

    saved: int  # activations saved for backward beyond the plain layer's (hfdist.models.shape)
    in_flight: int  # buffers that exist while the layer's attention runs: exchanged copies, key/value blocks
    ulysses: int  # ranks of the all-to-all group (1: none)
    exchanged: int  # the tensors the all-to-alls exchange in one forward (q, k, v, output), again in backward
    ring_forward: int  # bytes sent point-to-point around the ring in one forward
    ring_backward: int  # ... and in one backward

    @property
    def sent_forward(self) -> int:
        """Bytes this rank sends in the layer's forward: (u - 1) / u of the exchanged tensors, and the ring's."""
        return (self.ulysses - 1) * self.exchanged // self.ulysses + self.ring_forward

    @property
    def sent_backward(self) -> int:
        """Bytes this rank sends in the layer's backward."""
        return (self.ulysses - 1) * self.exchanged // self.ulysses + self.ring_backward


def _heads(shape: ModelShape, tp: int) -> tuple[int, int]:
    return max(shape.heads // tp, 1), max(shape.kv_heads // tp, 1)


def _ring(tokens: int, heads: int, kv: int, dim: int, elem: int, ring: int) -> tuple[int, int, int]:
    """(in flight, sent forward, sent backward) of a ring over `ring` members, blocks of `tokens` x `kv` heads."""
    block = tokens * kv * dim
    in_flight = 4 * block * elem + 6 * block * 4 + tokens * heads * dim * 4
    return in_flight, 2 * (ring - 1) * block * elem, 2 * (ring - 1) * block * elem + 2 * ring * block * 4


def cp_layer_costs(shape: ModelShape, tokens: int, elem: int, tp: int, plan: CpPlan) -> CpLayerCosts:
    """The module docstring's terms for one layer: `tokens` this rank holds, `elem` bytes per element."""
    heads, kv = _heads(shape, tp)
    dim, u, r = shape.head_dim, plan.ulysses, plan.ring
    saved = in_flight = exchanged = ring_forward = ring_backward = 0
    kv_wide = kv
    if u > 1:
        kv_wide = kv * kv_repeats(kv, u)
        saved = 2 * tokens * dim * (kv_wide - kv) * elem
        in_flight = 2 * tokens * dim * (heads + 2 * kv_wide) * elem
        exchanged = tokens * dim * (2 * heads + 2 * kv_wide) * elem
    if r > 1:
        ring_flight, ring_forward, ring_backward = _ring(u * tokens, heads // u, kv_wide // u, dim, elem, r)
        in_flight += ring_flight
    return CpLayerCosts(saved, in_flight, u, exchanged, ring_forward, ring_backward)


def cp_step_send_bytes(shape: ModelShape, layers: int, tokens: int, elem: int, tp: int, plan: CpPlan,
                       activation_checkpointing: bool = False) -> int:
    """Bytes one rank sends for context parallelism in one forward + backward of `layers` decoder layers over
    `tokens` of its own (per micro-batch; a pipeline stage multiplies by its micro-batches)."""
    costs = cp_layer_costs(shape, tokens, elem, tp, plan)
    forwards = 2 if activation_checkpointing else 1
    return layers * (forwards * costs.sent_forward + costs.sent_backward)
