"""What a GRPO step holds beyond an SFT step's, per rank (hfdist.plan.bytes adds it): the rollout's KV cache and
the completion logits of the loss.

A GRPO step first generates: each data-parallel rank samples its share of the step's completions in one
`generate` call (TRL's GRPOTrainer, steps_per_generation = the accumulation steps), every completion's prompt and
tokens in the KV cache of every layer, keys and values split over tp. The training state is held meanwhile; the
activations are not (no backward runs), so the step's peak is the larger of the two phases' working bytes. Then
the policy's loss runs TRL's own code, not hfdist's chunked loss: each micro-batch's completion logits whole, in
the compute dtype and again in fp32 for the log-softmax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hfdist.config.dims import ParallelDims
    from hfdist.models.shape import ModelShape
    from hfdist.plan.bytes import Workload

__all__ = ["rollout_kv_bytes", "completion_logits_bytes"]


def rollout_kv_bytes(shape: ModelShape, dims: ParallelDims, w: Workload, elem: int, completions: int,
                     layers: int) -> int:
    """The KV cache of a rank's rollout: `completions` sequences of w.seq tokens (prompt and completion), keys and
    values of `layers` layers, kv heads split over tp, in `elem`-byte elements."""
    kv_heads = max(shape.kv_heads // dims.tp, 1)
    return completions * w.seq * layers * 2 * kv_heads * shape.head_dim * elem


def completion_logits_bytes(shape: ModelShape, dims: ParallelDims, w: Workload, elem: int) -> int:
    """One micro-batch's completion logits in the loss: w.completion_len positions per sequence over the whole
    vocabulary (the whole-outputs hook gathers them on every tp rank), in the compute dtype and in fp32."""
    return w.micro_batch * w.completion_len * shape.vocab * (elem + 4)
