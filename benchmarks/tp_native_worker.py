"""Worker for benchmarks/bench_tp_native.py: one training run of one variant, one JSON file per rank.

    python benchmarks/tp_native_worker.py --variant reference --model-dir M --batches B.pt --out DIR --lr LR ...
    torchrun --standalone --nproc-per-node 2 benchmarks/tp_native_worker.py --variant hfdist_sp --model-dir M ...

Variants (every one loads the same save_pretrained folder and trains on the same batches with the same AdamW):
- reference: one process, no parallelism, HF's own loss;
- hfdist_sp / hfdist_nosp: `hfdist.parallel.tensor.apply_tp` with / without sequence parallel, loss parallel on,
  loss from `tp_causal_lm_loss` under `loss_parallel()`;
- hfdist_sp_torch_norms: hfdist_sp with torch's public SequenceParallel style in place of hfdist's LocalNorm (the
  norms computed through DTensor; hfdist.torch_private says why hfdist keeps its own);
- native: transformers' `from_pretrained(..., distributed_config=DistributedConfig(tp_size=world))`, HF's own loss.

Each variant runs in processes of its own because a process's peak RSS cannot be reset: a second model trained in
the same process would report the first one's peak. A rank that raises writes the exception to its JSON first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
import traceback
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import hfdist.parallel.tensor as tensor_parallel
from hfdist.config.dims import ParallelDims
from hfdist.metrics.memory import held_tensor, peak_memory_bytes, rank_state_bytes, saved_tensor_bytes
from hfdist.parallel.tensor import apply_tp, tp_causal_lm_loss

VARIANTS = ("reference", "hfdist_sp", "hfdist_nosp", "hfdist_sp_torch_norms", "native")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--model-dir", type=Path, required=True, help="folder written by save_pretrained")
    p.add_argument("--batches", type=Path, required=True, help="torch.save'd list of global batches, one per step")
    p.add_argument("--out", type=Path, required=True, help="folder for <variant>-rank<r>.json")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--weight-decay", type=float, required=True)
    p.add_argument("--profile", type=Path, default=None,
                   help="write torch.profiler's table of the timed steps' top ops (self CPU time) to "
                        "<this>-<variant>-rank<r>.txt; the profiler's hooks slow the steps, so the rates are not kept")
    return p.parse_args()


def build(variant: str, model_dir: Path) -> torch.nn.Module:
    """The model of `variant`, loaded from `model_dir` and split across the world where the variant says so."""
    if variant == "native":
        config = DistributedConfig(tp_size=dist.get_world_size())
        return AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=config)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if variant == "reference":
        return model
    mesh = ParallelDims(tp=dist.get_world_size()).build_mesh("cpu")
    if variant == "hfdist_sp_torch_norms":
        tensor_parallel.tp_plan = _with_torch_norms(tensor_parallel.tp_plan)
    return apply_tp(model, mesh["tp"], sequence_parallel=variant != "hfdist_nosp", loss_parallel=True)


def _with_torch_norms(tp_plan):
    """`tp_plan` with torch's SequenceParallel style on the residual stream's norms: local outputs inside a layer
    (what the layer's local compute takes), a DTensor out of the final norm (what lm_head's style takes)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    def plan(*args, **kwargs):
        styles = tp_plan(*args, **kwargs)
        for key in styles:
            if key.endswith("layernorm"):
                styles[key] = SequenceParallel(use_local_output=True)
        styles["model.norm"] = SequenceParallel(use_local_output=False)
        return styles

    return plan


def step_loss(variant: str, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Forward and backward of one global batch; returns the loss and the shape of the logits this rank computes
    (hfdist's loss computes them chunk by chunk from its vocabulary shard of lm_head and never holds them whole)."""
    if variant.startswith("hfdist"):
        # Forward and backward both under loss_parallel(): the vocab-sharded logits are never gathered.
        with loss_parallel():
            loss = tp_causal_lm_loss(model, batch)
            loss.backward()
        return loss.detach(), [*batch["input_ids"].shape, held_tensor(model.lm_head.weight).shape[0]]
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), list(out.logits.shape)


def grad_norm_probe(params: list[torch.nn.Parameter]) -> dict[str, Any]:
    """`clip_grad_norm_` as a training script would call it (max_norm=inf: grads unchanged); the norm or the error.

    Mixed DTensor / plain-tensor gradients are a known way for TP to break clipping, so the outcome is a result.
    """
    try:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=float("inf"))
    except Exception as exc:  # the exact failure is what the benchmark reports
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}
    return {"norm": float(norm.full_tensor() if isinstance(norm, DTensor) else norm)}


def _generic(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def layout(model: torch.nn.Module) -> dict[str, dict[str, str]]:
    """How this rank holds each parameter (layer numbers folded to `*`), parameters that view a larger storage than
    their local elements, and gradients larger than their parameter's local shard."""
    def describe(t: torch.Tensor) -> str:
        return f"DTensor{tuple(t.placements)}" if isinstance(t, DTensor) else "plain tensor (full copy)"

    params, views, grads = {}, {}, {}
    for name, p in model.named_parameters():
        local, name = held_tensor(p), _generic(name)
        params[name] = describe(p)
        own, storage = local.numel() * local.element_size(), local.untyped_storage().nbytes()
        if storage > own:
            views[name] = f"{own} bytes in a {storage}-byte storage"
        if p.grad is not None and held_tensor(p.grad).numel() != local.numel():
            grads[name] = f"{describe(p.grad)}, {held_tensor(p.grad).numel()} elements vs {local.numel()}"
    return {"params": params, "params_viewing_larger_storage": views, "grads_larger_than_shard": grads}


def param_shard_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters' local elements, whatever storage they are views of (see the views note in the md)."""
    return sum(held_tensor(p).numel() * held_tensor(p).element_size() for p in model.parameters())


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train the variant one step per batch; the first step is the untimed warm-up."""
    record: dict[str, Any] = {"rss_after_imports_bytes": peak_memory_bytes(torch.device("cpu"))}
    batches = torch.load(args.batches, weights_only=True)
    model = build(args.variant, args.model_dir)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    losses, seconds, cpu_seconds, tokens = [], [], [], []
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None
    for step, batch in enumerate(batches):
        if profiler is not None and step == 1:
            profiler.start()
        warmup, last = step == 0, step == len(batches) - 1
        optimizer.zero_grad(set_to_none=True)
        start, cpu_start = time.perf_counter(), time.process_time()
        with ExitStack() as probes:
            if warmup:  # measured on the untimed step only: the hooks cost time
                saved = probes.enter_context(saved_tensor_bytes(model))
                comm = probes.enter_context(CommDebugMode())
            loss, logits_shape = step_loss(args.variant, model, batch)
        if last:  # gradients and (from the second step on) optimizer state are both live here
            pause, cpu_pause = time.perf_counter(), time.process_time()
            record["state_bytes"] = rank_state_bytes(model, optimizer)
            record["grad_norm_last_step"] = grad_norm_probe(params)
            record["layout"] = layout(model)
            start += time.perf_counter() - pause  # not part of the training step being timed
            cpu_start += time.process_time() - cpu_pause
        optimizer.step()
        losses.append(float(loss))
        if warmup:
            record["saved_activation_bytes"] = saved["bytes"]
            record["collectives_per_step"] = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
            record["logits_local_shape"] = logits_shape
        else:
            seconds.append(time.perf_counter() - start)
            # CPU time of the whole process (every thread): unlike wall time, not inflated by waiting for a core.
            cpu_seconds.append(time.process_time() - cpu_start)
            # Every TP rank runs its model on the whole global batch: all of its tokens pass through each rank.
            tokens.append(batch["input_ids"].numel())  # positions computed (packed rows' padding included)
    if profiler is not None:
        profiler.stop()
        rank = dist.get_rank() if dist.is_initialized() else 0
        table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        Path(f"{args.profile}-{args.variant}-rank{rank}.txt").write_text(table)
    record.update({
        "losses": losses, "step_seconds": seconds, "step_tokens": tokens, "tokens_per_s": sum(tokens) / sum(seconds),
        # The median step resists the other jobs sharing this machine's cores better than the total does.
        "tokens_per_s_median_step": statistics.median(n / t for n, t in zip(tokens, seconds)),
        "step_cpu_seconds": cpu_seconds,
        "tokens_per_cpu_s_median_step": statistics.median(n / t for n, t in zip(tokens, cpu_seconds)),
        "peak_rss_bytes": peak_memory_bytes(torch.device("cpu")), "param_shard_bytes": param_shard_bytes(model),
    })
    return record


def main() -> None:
    args = parse_args()
    distributed = args.variant != "reference"
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    result: dict[str, Any] = {"variant": args.variant, "rank": rank,
                              "world": dist.get_world_size() if distributed else 1,
                              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                              "torch_threads": torch.get_num_threads()}
    path = args.out / f"{args.variant}-rank{rank}.json"
    try:
        result.update(train(args))
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
        path.write_text(json.dumps(result, indent=1))
        raise
    path.write_text(json.dumps(result, indent=1))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
