"""The attention kernels ring attention calls per block segment, behind one small contract: forward returns the
output AND its log-sum-exp (so partial results over key blocks merge exactly), backward takes the merged output and
log-sum-exp (so each block's gradient is its share of the whole softmax's).

    forward(q, k, v, causal, scale) -> out (1, H, n, D) in q's dtype, lse (1, H, n) fp32
    backward(dout, q, k, v, out, lse, causal, scale) -> dq, dk, dv (shapes of q, k, v)

q is (1, H, n, D), k / v (1, KV, m, D) with KV dividing H (grouped-query attention); causal means query i sees key
j <= i (the segment is one document piece against itself, n == m).

- CPU: torch's flash-attention kernel for CPU (`aten._scaled_dot_product_flash_attention_for_cpu` and its backward:
  blocked online softmax, grouped-query attention inside the kernel; what torch's sdpa, and so hfdist's document
  attention, computes on CPU).
- any other device (CUDA): the same computation as tiled matmuls (`TiledKernel`: query tiles of TILE rows against the
  segment's keys, fp32 scores), which is exact on every device; it is also checked against the CPU kernel on CPU. A
  fused varlen kernel (flash-attn's `_flash_attn_varlen_forward` / `_backward`) fits the same contract.

`attend_self` / `attend_self_backward`: a run of one-token documents, each attending only itself (output = its
value, lse = its one score), in closed form rather than a kernel call per token.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["BlockKernel", "CpuFlashKernel", "TiledKernel", "kernel_for", "attend_self", "attend_self_backward"]


class BlockKernel(Protocol):
    """Attention of one query piece against one key piece with its log-sum-exp, and the gradients from merged ones."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class CpuFlashKernel:
    """torch's CPU flash-attention kernel (grouped-query attention handled inside it)."""

    def forward(self, q, k, v, causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(1, KV, m, D) -> (1, H, m, D): each kv head repeated for its group of query heads."""
    groups = heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(1, H, m, D) gradients of expanded kv heads -> (1, KV, m, D): summed over each group (the repeat's backward)."""
    b, h, m, d = t.shape
    return t if h == kv_heads else t.view(b, kv_heads, h // kv_heads, m, d).sum(2)


class TiledKernel:
    """The contract as tiled matmuls on any device: query tiles of `tile` rows against all the segment's keys, scores
    in fp32, causal by the tile's row offsets. Holds tile x m scores per head at a time."""

    def __init__(self, tile: int = 512) -> None:
        self.tile = tile

    def _scores(self, q_tile: torch.Tensor, k: torch.Tensor, start: int, causal: bool, scale: float) -> torch.Tensor:
        scores = (q_tile.float() @ k.float().transpose(-1, -2)) * scale
        if causal:
            rows = torch.arange(start, start + q_tile.shape[-2], device=q_tile.device)[:, None]
            scores = scores.masked_fill(torch.arange(k.shape[-2], device=k.device)[None, :] > rows, float("-inf"))
        return scores

    def forward(self, q, k, v, causal, scale):
        heads = q.shape[1]
        k, v = _expand(k, heads), _expand(v, heads)
        outs, lses = [], []
        for start in range(0, q.shape[-2], self.tile):
            scores = self._scores(q[..., start:start + self.tile, :], k, start, causal, scale)
            lse = scores.logsumexp(-1)
            outs.append((torch.exp(scores - lse[..., None]) @ v.float()).to(q.dtype))
            lses.append(lse)
        return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        heads, kv_heads = q.shape[1], k.shape[1]
        ke, ve = _expand(k, heads).float(), _expand(v, heads).float()
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = torch.zeros_like(ke), torch.zeros_like(ve)
        for start in range(0, q.shape[-2], self.tile):
            rows = slice(start, start + self.tile)
            q_tile, do = q[..., rows, :].float(), dout[..., rows, :].float()
            p = torch.exp(self._scores(q_tile, ke, start, causal, scale) - lse[..., rows, None])
            dv += p.transpose(-1, -2) @ do
            delta = (do * out[..., rows, :].float()).sum(-1, keepdim=True)
            ds = p * (do @ ve.transpose(-1, -2) - delta) * scale
            dq[..., rows, :] = ds @ ke
            dk += ds.transpose(-1, -2) @ q_tile
        return dq.to(q.dtype), _fold(dk, kv_heads).to(k.dtype), _fold(dv, kv_heads).to(v.dtype)


def kernel_for(device: torch.device) -> BlockKernel:
    """The block kernel of a device: torch's CPU flash kernel on CPU, the tiled one elsewhere."""
    return CpuFlashKernel() if device.type == "cpu" else TiledKernel()


def attend_self(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens that each attend only themselves (n one-token documents): out = v (per query head), lse = q . k x
    scale. q (1, H, n, D), k / v (1, KV, n, D)."""
    heads = q.shape[1]
    ke = _expand(k, heads)
    return _expand(v, heads).to(q.dtype), (q.float() * ke.float()).sum(-1) * scale


def attend_self_backward(dout, q, k, v, out, lse, scale):
    """attend_self's gradients from the merged `out` / `lse` (the token may also attend earlier chunks of its
    document): p = exp(score - lse) is its weight on itself, so dv = p dout, and the score's gradient
    ds = p (dout . v - dout . out) reaches q and k through the dot product."""
    heads, kv_heads = q.shape[1], k.shape[1]
    ke, ve = _expand(k, heads).float(), _expand(v, heads).float()
    do = dout.float()
    p = torch.exp((q.float() * ke).sum(-1) * scale - lse)[..., None]
    ds = p * ((do * ve).sum(-1, keepdim=True) - (do * out.float()).sum(-1, keepdim=True)) * scale
    return ((ds * ke).to(q.dtype), _fold(ds * q.float(), kv_heads).to(k.dtype),
            _fold(p * do, kv_heads).to(v.dtype))
