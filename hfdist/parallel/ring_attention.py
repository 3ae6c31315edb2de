"""Ring attention over packed documents: exact causal attention of a row whose tokens are spread over a ring of
ranks, each packed document kept apart, no rank ever holding more than two members' keys and values.

Each ring member holds the queries, keys and values of its head-tail pair of chunks (hfdist.parallel.ring_layout).
`RingAttention` (one autograd.Function, the ring-flash-attention scheme):

    forward:  r steps; at step i the member holds the keys / values of member (m - i) mod r, sends them on to
              m + 1 while it computes (the next block arrives from m - 1 meanwhile), and attends every segment
              where its queries meet that block's keys within a document, causally by global positions
              (ring_layout.ring_segments, from the whole rows' boundaries the collator built). Each segment's
              output and log-sum-exp (hfdist.parallel.ring_kernels) merge exactly into the member's running ones
              (lse = logaddexp(lse, lse_i); out = out e^(lse_old - lse) + out_i e^(lse_i - lse)), in fp32.
    backward: the same r steps with the keys / values travelling again, plus their gradient accumulators one step
              behind: the member adds its segments' gradients (computed by the kernel from the merged output and
              log-sum-exp, so each block gets its share of the whole softmax's gradient) to the accumulator that
              arrived with the block, and sends it on; after r steps each accumulator is home, complete.

In flight per member: two blocks of keys / values (and, in backward, of their fp32 gradients): O(S / cp) each,
never O(S); nothing S x S or (S / cp)^2 (segments are kernel calls on document pieces, causal by the kernel's flag).
The rotation is torch.distributed point-to-point (batch_isend_irecv: gloo and NCCL).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hfdist.parallel.ring_kernels import BlockKernel, attend_self, attend_self_backward
from hfdist.parallel.ring_layout import Segment

__all__ = ["RingBlocks", "RingAttention", "ring_attention"]


@dataclass
class RingBlocks:
    """What one member's ring attention needs besides q / k / v.

    Attributes:
        group: the ring's process group (its ranks in member order).
        member: this rank's index in the ring.
        segments: per source member, the (row, Segment) pairs this member's queries attend of its keys.
        kernel: the block kernel of the device.
        scale: the softmax scale (the model's `scaling`).
    """

    group: object
    member: int
    segments: list[list[tuple[int, Segment]]]
    kernel: BlockKernel
    scale: float

    @property
    def ring(self) -> int:
        """Members of the ring."""
        return len(self.segments)


class _Rotation:
    """One step of the ring: `tensors` sent to the next member while the previous member's arrive."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], blocks: RingBlocks) -> None:
        ring, member = blocks.ring, blocks.member
        self.received = tuple(torch.empty_like(t) for t in tensors)
        ops = [dist.P2POp(dist.isend, t, group=blocks.group, group_peer=(member + 1) % ring) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, group=blocks.group, group_peer=(member - 1) % ring) for t in self.received]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self.works:
            work.wait()
        return self.received


def _merge(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold one segment's (out, lse) into the running ones, in place (views of the member's fp32 accumulators)."""
    merged = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - merged)[..., None]).add_(part_out.float() * torch.exp(part_lse - merged)[..., None])
    lse.copy_(merged)


def _piece(t: torch.Tensor, row: int, a: int, b: int) -> torch.Tensor:
    return t[row:row + 1, :, a:b]


def _pieces(q: torch.Tensor, block: tuple[torch.Tensor, ...], row: int, s: Segment) -> tuple[torch.Tensor, ...]:
    """A segment's queries, and its keys and values of the block at hand (views)."""
    return _piece(q, row, s.q0, s.q1), _piece(block[0], row, s.k0, s.k1), _piece(block[1], row, s.k0, s.k1)


class RingAttention(torch.autograd.Function):
    """out = causal document attention of this member's queries over the whole ring's keys (module docstring).
    q (B, H, Sq, D); k, v (B, KV, Sk, D) of this member; returns (B, H, Sq, D) in q's dtype."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: RingBlocks) -> torch.Tensor:
        k, v = k.contiguous(), v.contiguous()
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        block = (k, v)
        for step in range(blocks.ring):
            rotation = _Rotation(block, blocks) if step < blocks.ring - 1 else None
            for row, s in blocks.segments[(blocks.member - step) % blocks.ring]:
                qp, kp, vp = _pieces(q, block, row, s)
                if s.kind == "self":
                    part = attend_self(qp, kp, vp, blocks.scale)
                else:
                    part = blocks.kernel.forward(qp, kp, vp, s.kind == "causal", blocks.scale)
                _merge(out[row, :, s.q0:s.q1], lse[row, :, s.q0:s.q1], part[0][0], part[1][0])
            if rotation is not None:
                block = rotation.wait()
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.blocks = blocks
        return result

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        blocks: RingBlocks = ctx.blocks
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        block, sent = (k, v), None
        for step in range(blocks.ring):
            rotation = _Rotation(block, blocks) if step < blocks.ring - 1 else None
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            for row, s in blocks.segments[(blocks.member - step) % blocks.ring]:
                qp, kp, vp = _pieces(q, block, row, s)
                args = (_piece(dout, row, s.q0, s.q1), qp, kp, vp, _piece(out, row, s.q0, s.q1),
                        lse[row:row + 1, :, s.q0:s.q1])
                if s.kind == "self":
                    gq, gk, gv = attend_self_backward(*args, blocks.scale)
                else:
                    gq, gk, gv = blocks.kernel.backward(*args, s.kind == "causal", blocks.scale)
                dq[row, :, s.q0:s.q1] += gq[0]
                dk[row, :, s.k0:s.k1] += gk[0]
                dv[row, :, s.k0:s.k1] += gv[0]
            if sent is not None:  # the accumulator of this block, from the members it visited before
                earlier = sent.wait()
                dk += earlier[0]
                dv += earlier[1]
            sent = _Rotation((dk, dv), blocks)
            if rotation is not None:
                block = rotation.wait()
        dk, dv = sent.wait()  # this member's own block, back from its last visit
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: RingBlocks) -> torch.Tensor:
    """RingAttention.apply, returning (B, Sq, H, D) as transformers attention functions do (contiguous)."""
    return RingAttention.apply(query, key, value, blocks).transpose(1, 2).contiguous()
