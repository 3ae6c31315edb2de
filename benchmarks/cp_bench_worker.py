"""Worker for benchmarks/bench_cp.py: `torchrun --nproc-per-node CP benchmarks/cp_bench_worker.py OUT.json ...`
(or plain `python` for cp = 1).

Builds the model (seed 0, fp32, max_position_embeddings raised to the longest length: RoPE needs no table), makes
every rank one cp rank by --cp-method (hfdist.parallel.context.apply_cp; no FSDP: sharding the states does not change
activations), and on one packed row of documents measures per rank, at each --seq:
- the bytes autograd saves in a forward (hfdist.metrics.memory.saved_tensor_bytes);
- the training memory of one forward + backward: the peak of the tensors the step creates
  (hfdist.metrics.memory.LiveTensorBytes: activations, temporaries, the exchanged tensors or the ring's key/value
  blocks in flight, the gradients backward creates);
- the tokens/s of forward + backward (each token counted once across the cp group; median of --steps after a
  warm-up);
and, with --max-seq, the saved bytes at --min-seq x 2^k up to --max-seq, stopping above --cap-mib: the longest
length under the cap. Rank 0 writes every rank's figures to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hfdist.data.collation import attention_inputs
from hfdist.metrics.memory import LiveTensorBytes, saved_tensor_bytes
from hfdist.parallel.context import apply_cp, shard_batch

MIB = 2**20


def packed_row(seq: int, vocab: int, attention: str, documents: int = 8) -> dict[str, torch.Tensor]:
    """One row of `seq` tokens holding `documents` documents of random lengths, labels = inputs."""
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, vocab, (1, seq), generator=g)
    cuts = sorted(torch.randperm(seq - 1, generator=g)[: documents - 1].add(1).tolist())
    positions = torch.cat([torch.arange(b - a) for a, b in zip([0, *cuts], [*cuts, seq])])[None]
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions,
            **attention_inputs(positions, attention)}


def build(preset: str, max_seq: int, attention: str):
    from transformers import AutoModelForCausalLM

    from hfdist.models.document_attention import register_document_attention
    from hfdist.models.presets import load_config

    register_document_attention()
    config = load_config(preset)
    config.max_position_embeddings = max_seq
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention)


def local_inputs(row: dict[str, torch.Tensor], plan) -> dict[str, torch.Tensor]:
    return shard_batch(row, dist.get_rank(), plan) if plan is not None else {**row, "use_cache": False}


def saved_bytes(model, row, plan) -> int:
    """Bytes autograd saves in one forward of this rank's part of `row`."""
    with saved_tensor_bytes(model) as saved:
        loss = model(**local_inputs(row, plan)).loss
    del loss
    return saved["bytes"]


def step_peak(model, row, plan) -> int:
    """Peak bytes of the tensors one forward + backward of this rank's part of `row` creates."""
    inputs = local_inputs(row, plan)
    with LiveTensorBytes() as created:
        model(**inputs).loss.backward()
    model.zero_grad(set_to_none=True)
    return created.peak


def tokens_per_second(model, row, plan, steps: int) -> float:
    """The row's tokens (once, across the cp group) over the median forward + backward time."""
    inputs = local_inputs(row, plan)
    count = row["labels"][:, 1:].ne(-100).sum()
    times = []
    for step in range(steps + 1):
        if plan is not None:
            dist.barrier()
        start = time.perf_counter()
        model(**inputs, num_items_in_batch=count).loss.backward()
        if plan is not None:
            dist.barrier()
        if step:  # the first is a warm-up
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return row["input_ids"].numel() / statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--preset", default="llama-tiny")
    p.add_argument("--seq", type=int, nargs="+", default=[16384])
    p.add_argument("--min-seq", type=int, default=1024)
    p.add_argument("--max-seq", type=int, default=0)
    p.add_argument("--cap-mib", type=float, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--attn-implementation", default="hfdist_documents")
    p.add_argument("--cp-method", default="ulysses")
    args = p.parse_args()
    cp = int(os.environ.get("WORLD_SIZE", "1"))
    model = build(args.preset, max(*args.seq, args.max_seq), args.attn_implementation)
    plan = None
    if cp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from hfdist.parallel.context_check import check_cp

        dist.init_process_group("gloo")
        plan = apply_cp(model, init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))["cp"],
                        plan=check_cp(model.config, cp, max(args.seq), method=args.cp_method))
    vocab = model.config.vocab_size
    record = {"rank": dist.get_rank() if cp > 1 else 0, "cp": cp, "method": plan.method if plan else "none",
              "ulysses": plan.ulysses if plan else 1, "by_seq": {}, "by_length": {}}
    for seq in args.seq:
        row = packed_row(seq, vocab, args.attn_implementation)
        record["by_seq"][seq] = {"saved_bytes": saved_bytes(model, row, plan), "step_peak": step_peak(model, row, plan),
                                 "tokens_per_second": tokens_per_second(model, row, plan, args.steps)}
    seq = args.min_seq
    while args.max_seq and seq <= args.max_seq:
        got = saved_bytes(model, packed_row(seq, vocab, args.attn_implementation), plan)
        record["by_length"][seq] = got
        over = torch.tensor(float(got > args.cap_mib * MIB))
        if cp > 1:
            dist.all_reduce(over, op=dist.ReduceOp.MAX)  # every rank must stop at the same length
        if over.item():
            break
        seq *= 2
    records = [record]
    if cp > 1:
        records = [None] * cp
        dist.all_gather_object(records, record)
    if record["rank"] == 0:
        args.out.write_text(json.dumps(records, indent=1))
    if cp > 1:
        # Every rank past its last exchange before any tears the group down: the ring's gloo point-to-point pairs
        # abort the process (std::terminate) when a peer leaves first (hfdist.job.run does the same).
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
