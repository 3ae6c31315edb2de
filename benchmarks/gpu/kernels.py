"""Microbenchmarks of the kernels this round's work runs on a GPU (the GPU suite's part 2, benchmarks/gpu/cells.py):

- ring and hybrid context parallelism's block kernel (hfdist.parallel.ring_kernels.kernel_for): one causal
  document of S tokens cut as a ring of r members cuts it (2r chunks; each chunk against itself causally, against
  every earlier chunk in full), each block's forward and backward through the kernel, against one flash call over
  the whole row (torch's sdpa, causal, forward and backward). Ring: every query head; hybrid: the heads / u a rank
  holds after its Ulysses all-to-all, a ring of cp / u. Equal FLOPs either way: the ratio is what cutting the row
  into ring blocks costs.
- the routed experts (hfdist.parallel.expert_dispatch.run_experts) of a Qwen3-MoE-shaped layer with ep 1: torch's
  grouped GEMM against the loop over the experts.

    python benchmarks/gpu/kernels.py --out FIGURES.json            # on a GPU: S = 32K, bf16
    python benchmarks/gpu/kernels.py --out FIGURES.json --dry-run  # the CPU stand-in: small sizes

Each figure is the best of a few windows of back-to-back calls (hfdist.metrics.timing: CUDA events on a GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: hfdist

from hfdist.metrics.timing import device_window, per_call  # noqa: E402
from hfdist.models.kv_heads import repeat_kv_heads  # noqa: E402
from hfdist.parallel.expert_dispatch import run_experts  # noqa: E402
from hfdist.parallel.ring_kernels import kernel_for  # noqa: E402

# (S, heads, kv heads, head dim, cp, Ulysses degree of the hybrid) and the MoE layer (tokens, hidden, expert
# intermediate, experts, top-k): Llama-3.1-8B's attention at 32K over cp 8 and Qwen3-30B-A3B's experts on a GPU.
GPU_SIZES = {"attention": (32768, 32, 8, 128, 8, 2), "moe": (8192, 2048, 768, 128, 8)}
DRY_RUN_SIZES = {"attention": (512, 8, 2, 32, 4, 2), "moe": (256, 64, 32, 8, 2)}


def _line_up(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ring_blocks_seconds(q, k, v, ring: int, scale: float) -> float:
    """Forward and backward of every block pair of a causal row cut into 2 x `ring` chunks, through the device's
    ring kernel (each block's own output and log-sum-exp given to its backward: the same work as merged ones)."""
    kernel = kernel_for(q.device)
    chunk = q.shape[-2] // (2 * ring)
    pieces = [slice(i * chunk, (i + 1) * chunk) for i in range(2 * ring)]

    def run() -> None:
        for i, rows in enumerate(pieces):
            for cols in pieces[:i + 1]:
                causal = rows == cols
                qi, kj, vj = q[..., rows, :], k[..., cols, :], v[..., cols, :]
                out, lse = kernel.forward(qi, kj, vj, causal, scale)
                kernel.backward(out, qi, kj, vj, out, lse, causal, scale)

    return per_call(run, lambda: _line_up(q.device), device_window(q.device), calls=1)


def flash_seconds(q, k, v, scale: float) -> float:
    """Forward and backward of the whole causal row by torch's sdpa (its flash kernel where it takes the inputs;
    the kv heads repeated first, as the ring's CUDA kernel does, so that no backend falls back for grouped heads)."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().requires_grad_() for t in (q, repeat_kv_heads(k, groups), repeat_kv_heads(v, groups)))

    def run() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        out.backward(out)

    return per_call(run, lambda: _line_up(q.device), device_window(q.device), calls=1)


def attention_figures(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...]) -> dict:
    """Seconds and TFLOP/s of the ring's and the hybrid's block kernels against one flash call (module docstring)."""
    seq, heads, kv, dim, cp, ulysses = sizes
    scale = dim ** -0.5
    flops = 4 * seq * seq * dim / 2 * 3.5  # causal: forward 2 matmuls of S^2/2 x D, backward 2.5 x forward
    figures = {}
    for name, ring, rank_heads, rank_kv in (("ring", cp, heads, kv), ("hybrid", cp // ulysses, heads // ulysses,
                                                                      max(kv // ulysses, 1))):
        g = torch.Generator(device="cpu").manual_seed(0)
        q = torch.randn(1, rank_heads, seq, dim, generator=g).to(device, dtype)
        k, v = (torch.randn(1, rank_kv, seq, dim, generator=g).to(device, dtype) for _ in range(2))
        blocks, whole = ring_blocks_seconds(q, k, v, ring, scale), flash_seconds(q, k, v, scale)
        figures[name] = {"seq": seq, "heads": rank_heads, "kv_heads": rank_kv, "head_dim": dim, "ring": ring,
                         "blocks_s": blocks, "flash_s": whole, "blocks_over_flash": blocks / whole,
                         "blocks_tflops": flops * rank_heads / blocks / 1e12,
                         "flash_tflops": flops * rank_heads / whole / 1e12}
    return figures


def moe_figures(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...]) -> dict:
    """Seconds of one MoE layer's routed experts (forward) by grouped GEMM and by the loop, rows routed evenly."""
    tokens, hidden, inter, experts, top_k = sizes
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = torch.randn(tokens * top_k, hidden, generator=g).to(device, dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(device, dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5).to(device, dtype)
    sizes_per_expert = [tokens * top_k // experts] * experts
    sizes_per_expert[-1] += tokens * top_k - sum(sizes_per_expert)
    act = torch.nn.SiLU()
    seconds = {}
    for name, grouped in (("grouped", True), ("loop", False)):
        seconds[name] = per_call(lambda: run_experts(rows, sizes_per_expert, gate_up, down, act, False, grouped),
                                 lambda: _line_up(device), device_window(device), calls=3)
    flops = 2 * tokens * top_k * hidden * inter * 3
    return {"tokens": tokens, "hidden": hidden, "intermediate": inter, "experts": experts, "top_k": top_k,
            "grouped_s": seconds["grouped"], "loop_s": seconds["loop"],
            "loop_over_grouped": seconds["loop"] / seconds["grouped"],
            "grouped_tflops": flops / seconds["grouped"] / 1e12}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the figures' JSON file")
    p.add_argument("--dry-run", action="store_true", help="the CPU stand-in: small sizes, fp32 experts")
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    sizes = GPU_SIZES if on_gpu else DRY_RUN_SIZES
    figures = {"device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
               "attention": attention_figures(device, torch.bfloat16, sizes["attention"]),
               # torch's CPU grouped GEMM takes bf16 too, but as a reference kernel: fp32 on CPU keeps it short
               "moe": moe_figures(device, torch.bfloat16 if on_gpu else torch.float32, sizes["moe"])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2))
    ring, moe = figures["attention"]["ring"], figures["moe"]
    print(f"ring blocks {ring['blocks_over_flash']:.2f} x one flash call at {ring['seq']} tokens; MoE loop "
          f"{moe['loop_over_grouped']:.2f} x grouped GEMM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
