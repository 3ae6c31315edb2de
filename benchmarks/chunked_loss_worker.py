"""Worker of benchmarks/bench_chunked_loss.py: one process (or one torchrun rank of a tp group) measuring training
steps of a large-vocabulary model with the loss chunked or not, fused or recomputing, or the fused loss alone.

    python benchmarks/chunked_loss_worker.py OUT.json --chunk 512 [--fused [--torch-op]] [--tp 2 under torchrun] ...
    python benchmarks/chunked_loss_worker.py OUT.json --head-only --hidden 1024 [--torch-op] ...

Per rank: the peak resident memory the first forward + backward adds (Linux VmHWM restarted just before it,
hfdist.metrics.memory.start_peak_window), the peak bytes of tensors that step's ops create (LiveTensorBytes, on a
second step; it does not see inside torch's linear_cross_entropy, one dispatched op), and the wall and process CPU
time of the following steps. --chunk 0 without --fused is the plain unchunked loss; --fused computes lm_head's
gradients in the forward (hfdist.models.fused_loss); --torch-op has torch's F.linear_cross_entropy compute the fused
loss on one device instead (what hfdist.models.fused_loss's docstring weighs). --head-only measures the fused loss
alone on --seq x --hidden states and a --vocab x --hidden weight (gradients kept allocated between steps, as in
training; one step run before measuring). Rank 0 writes OUT.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from hfdist.metrics.memory import LiveTensorBytes, peak_memory_bytes, start_peak_window
from hfdist.models.build import build_model
from hfdist.models.chunked_loss import causal_lm_loss
from hfdist.models.fused_loss import fused_linear_cross_entropy
from hfdist.models.loss import IGNORE_INDEX


def torch_fused(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                chunk_rows: int | None = None) -> torch.Tensor:
    """The summed loss by torch's chunked F.linear_cross_entropy, in fused_linear_cross_entropy's signature."""
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_rows or hidden.shape[0])
    return torch.nn.functional.linear_cross_entropy(hidden, weight, targets, linear_bias=bias, reduction="sum",
                                                    ignore_index=IGNORE_INDEX, options=options)


def model_step(args: argparse.Namespace) -> Callable[[], None]:
    """A forward + backward of the model through causal_lm_loss."""
    model = build_model(args.preset, vocab_size=args.vocab, seed=0)
    context = contextlib.nullcontext
    if args.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel

        from hfdist.parallel.tensor import apply_tp

        dist.init_process_group("gloo")
        apply_tp(model, init_device_mesh("cpu", (args.tp,), mesh_dim_names=("tp",)))
        context = loss_parallel
    if args.torch_op:
        import hfdist.models.chunked_loss as chunked_loss

        chunked_loss.fused_linear_cross_entropy = torch_fused  # the one-device fused path only
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)}

    def step() -> None:
        with context():
            loss = causal_lm_loss(model, batch, chunk_size=args.chunk or None, fused=args.fused)
            loss.backward()
        model.zero_grad(set_to_none=False)  # gradients stay allocated, as in training between steps

    return step


def head_step(args: argparse.Namespace) -> Callable[[], None]:
    """A forward + backward of the fused loss alone (hfdist's, or torch's op with --torch-op)."""
    g = torch.Generator().manual_seed(0)
    rows = args.batch * args.seq
    hidden = torch.randn(rows, args.hidden, generator=g).requires_grad_()
    weight = torch.nn.Parameter(torch.randn(args.vocab, args.hidden, generator=g) * 0.02)
    targets = torch.randint(0, args.vocab, (rows,), generator=g)
    hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)
    fused = torch_fused if args.torch_op else fused_linear_cross_entropy

    def step() -> None:
        (fused(hidden, weight, None, targets, args.chunk * args.batch) / rows).backward()

    step()  # first-call costs (torch's op imports and registers itself on first use) stay out of the peak window
    return step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--preset", default="llama-small")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--chunk", type=int, default=512, help="0: unchunked")
    p.add_argument("--fused", action="store_true", help="the fused loss (default: recompute each chunk's logits)")
    p.add_argument("--torch-op", action="store_true", help="torch's F.linear_cross_entropy as the fused loss")
    p.add_argument("--head-only", action="store_true", help="the fused loss alone, on --hidden states")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size with --head-only")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (run under torchrun with as many)")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    args = p.parse_args()
    cpu = torch.device("cpu")
    step = head_step(args) if args.head_only else model_step(args)
    start = start_peak_window(cpu)
    step()
    rss_added = peak_memory_bytes(cpu) - start
    live = LiveTensorBytes()
    with live:
        step()
    times, cpu_times = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    rank = {"peak_rss_added_bytes": rss_added, "live_tensor_peak_bytes": live.peak,
            "step_s_median": statistics.median(times), "step_s": times,
            "step_cpu_s_median": statistics.median(cpu_times), "step_cpu_s": cpu_times}
    ranks = [rank]
    if args.tp > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, rank)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": ranks}, f)
    if dist.is_initialized():
        dist.barrier()  # rank 0 has written the figures: every rank leaves together
        dist.destroy_process_group()


if __name__ == "__main__":
    from hfdist.console import leave

    main()
    leave(0)  # gloo's threads can abort the interpreter's teardown (hfdist.console.leave)
