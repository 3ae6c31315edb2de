"""Worker of benchmarks/bench_chunked_loss.py: one process (or one torchrun rank of a tp group) measuring training
steps of a large-vocabulary model with the loss chunked or not, fused or recomputing.

    python benchmarks/chunked_loss_worker.py OUT.json --chunk 512 [--fused] [--tp 2 under torchrun] ...

Per rank: the peak resident memory the first forward + backward adds (Linux VmHWM restarted just before it,
hfdist.metrics.memory.start_peak_window), the peak bytes of tensors that step's ops create (LiveTensorBytes, on a
second step), and the time of the following steps. --chunk 0 without --fused is the plain unchunked loss; --fused
computes lm_head's gradients in the forward (hfdist.models.fused_loss). Rank 0 writes OUT.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.distributed as dist

from hfdist.metrics.memory import LiveTensorBytes, peak_memory_bytes, start_peak_window
from hfdist.models.build import build_model
from hfdist.models.chunked_loss import causal_lm_loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--preset", default="llama-small")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--chunk", type=int, default=512, help="0: unchunked")
    p.add_argument("--fused", action="store_true", help="the fused loss (default: recompute each chunk's logits)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (run under torchrun with as many)")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    args = p.parse_args()
    cpu = torch.device("cpu")
    model = build_model(args.preset, vocab_size=args.vocab, seed=0)
    context = contextlib.nullcontext
    if args.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel

        from hfdist.parallel.tensor import apply_tp

        dist.init_process_group("gloo")
        apply_tp(model, init_device_mesh("cpu", (args.tp,), mesh_dim_names=("tp",)))
        context = loss_parallel
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)}

    def step() -> None:
        with context():
            loss = causal_lm_loss(model, batch, chunk_size=args.chunk or None, fused=args.fused)
            loss.backward()
        model.zero_grad(set_to_none=False)  # gradients stay allocated, as in training between steps

    start = start_peak_window(cpu)
    step()
    rss_added = peak_memory_bytes(cpu) - start
    live = LiveTensorBytes()
    with live:
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    rank = {"peak_rss_added_bytes": rss_added, "live_tensor_peak_bytes": live.peak,
            "step_s_median": statistics.median(times), "step_s": times}
    ranks = [rank]
    if args.tp > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, rank)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": ranks}, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
