"""The attention kernels ring attention calls per block segment, behind one small contract: forward returns the
output AND its log-sum-exp (so partial results over key blocks merge exactly), backward takes the merged output and
log-sum-exp (so each block's gradient is its share of the whole softmax's).

    forward(q, k, v, causal, scale) -> out (1, H, n, D) in q's dtype, lse (1, H, n) fp32
    backward(dout, q, k, v, out, lse, causal, scale) -> dq, dk, dv (shapes of q, k, v)

q is (1, H, n, D), k / v (1, KV, m, D) with KV dividing H (grouped-query attention); causal means query i sees key
j <= i (the segment is one document piece against itself, n == m).

Both devices run torch's flash-attention kernel family (blocked online softmax, nothing n x m held, a causal
piece's masked half skipped), `kernel_for` picking it:
- CPU: `aten._scaled_dot_product_flash_attention_for_cpu` and its backward (grouped-query attention inside the
  kernel; what torch's sdpa, and so hfdist's document attention, computes on CPU).
- CUDA: `aten._scaled_dot_product_flash_attention` and its backward (FlashAttention-2, bf16 / fp16): the key /
  value heads repeated for the query heads, their gradients summed back. It has no CPU kernel, so the CPU tests run
  this class against a CPU stand-in registered for the same op schema (tests/unit/test_ring.py), and the op's own
  argument checks on the meta device. An fp32 piece on CUDA (a run without bf16), or a head size the flash kernel
  does not take, goes to `TiledKernel`: the same computation as tiled matmuls in fp32 (query tiles of TILE rows
  against the segment's keys), exact on every device and checked against the CPU kernel on CPU.

`attend_self` / `attend_self_backward`: a run of one-token documents, each attending only itself (output = its
value, lse = its one score), in closed form rather than a kernel call per token.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hfdist.models.kv_heads import repeat_kv_heads, sum_kv_groups

__all__ = ["BlockKernel", "CpuFlashKernel", "CudaFlashKernel", "TiledKernel", "kernel_for", "attend_self",
           "attend_self_backward"]


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
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv_heads(k, groups), repeat_kv_heads(v, groups)
        outs, lses = [], []
        for start in range(0, q.shape[-2], self.tile):
            scores = self._scores(q[..., start:start + self.tile, :], k, start, causal, scale)
            lse = scores.logsumexp(-1)
            outs.append((torch.exp(scores - lse[..., None]) @ v.float()).to(q.dtype))
            lses.append(lse)
        return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        kv_heads = k.shape[1]
        groups = q.shape[1] // kv_heads
        ke, ve = repeat_kv_heads(k, groups).float(), repeat_kv_heads(v, groups).float()
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
        return dq.to(q.dtype), sum_kv_groups(dk, kv_heads).to(k.dtype), sum_kv_groups(dv, kv_heads).to(v.dtype)


class CudaFlashKernel:
    """torch's CUDA flash-attention kernel (FlashAttention-2) for half-precision pieces; `TiledKernel` for the rest
    (module docstring)."""

    # FlashAttention-2 takes head sizes up to 256 in multiples of 8, in bf16 or fp16.
    _DTYPES = (torch.bfloat16, torch.float16)

    def __init__(self) -> None:
        self.fallback = TiledKernel()

    def _fused(self, q: torch.Tensor) -> bool:
        return q.dtype in self._DTYPES and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0

    def forward(self, q, k, v, causal, scale):
        if not self._fused(q):
            return self.fallback.forward(q, k, v, causal, scale)
        groups = q.shape[1] // k.shape[1]
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, repeat_kv_heads(k, groups), repeat_kv_heads(v, groups), 0.0, causal, False, scale=scale)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        if not self._fused(q):
            return self.fallback.backward(dout, q, k, v, out, lse, causal, scale)
        kv_heads = k.shape[1]
        groups = q.shape[1] // kv_heads
        # Dense inputs: no cumulative lengths; no dropout: the random state the op's signature carries is unused.
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, repeat_kv_heads(k, groups), repeat_kv_heads(v, groups), out, lse, None, None, q.shape[-2],
            k.shape[-2], 0.0, causal, seed, offset, scale=scale)
        return dq, sum_kv_groups(dk, kv_heads), sum_kv_groups(dv, kv_heads)


def kernel_for(device: torch.device) -> BlockKernel:
    """The block kernel of a device (module docstring): torch's flash kernel for CPU or for CUDA, the tiled one on
    any other device."""
    if device.type == "cpu":
        return CpuFlashKernel()
    return CudaFlashKernel() if device.type == "cuda" else TiledKernel()


def attend_self(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens that each attend only themselves (n one-token documents): out = v (per query head), lse = q . k x
    scale. q (1, H, n, D), k / v (1, KV, n, D)."""
    groups = q.shape[1] // k.shape[1]
    ke = repeat_kv_heads(k, groups)
    return repeat_kv_heads(v, groups).to(q.dtype), (q.float() * ke.float()).sum(-1) * scale


def attend_self_backward(dout, q, k, v, out, lse, scale):
    """attend_self's gradients from the merged `out` / `lse` (the token may also attend earlier chunks of its
    document): p = exp(score - lse) is its weight on itself, so dv = p dout, and the score's gradient
    ds = p (dout . v - dout . out) reaches q and k through the dot product."""
    kv_heads = k.shape[1]
    groups = q.shape[1] // kv_heads
    ke, ve = repeat_kv_heads(k, groups).float(), repeat_kv_heads(v, groups).float()
    do = dout.float()
    p = torch.exp((q.float() * ke).sum(-1) * scale - lse)[..., None]
    ds = p * ((do * ve).sum(-1, keepdim=True) - (do * out.float()).sum(-1, keepdim=True)) * scale
    return ((ds * ke).to(q.dtype), sum_kv_groups(ds * q.float(), kv_heads).to(k.dtype),
            sum_kv_groups(p * do, kv_heads).to(v.dtype))
