"""Worker for tests/integration/test_context_parallel.py:
`torchrun --nproc-per-node 4 tests/integration/cp_worker.py OUT.json`.

One launch of 4 gloo ranks runs every context-parallel case through hfdist's own recipe (meta model -> LoRA ->
hfdist.parallel.parallelize with a cp rung -> the Trainer's batch sharding, hfdist.parallel.context.shard_batch),
so the suite pays the process start-up once:
- fsdp_cp: dp_shard=2 x cp=2 (sdpa), full fine-tune;
- cp=4: dp_shard=1 x cp=4, eager attention: llama-tiny's 2 kv heads are fewer than cp (GQA, kv heads repeated);
- LoRA on dp_shard=2 x cp=2;
- cp=2 x tp=2 (Megatron TP with sequence parallel and the vocab-parallel loss, FSDP2 over the cp axis);
- HSDP: dp_replicate=2 x cp=2 (FSDP2 replicated over dp_replicate, sharded over cp).
Each trains STEPS AdamW steps on packed rows of SEQ tokens holding several documents, against the same model
trained in one process (every rank computes the reference itself), and compares per-document logits under cp with
each document run alone. A case that raises is recorded with its traceback instead of aborting the launch.
"""

from __future__ import annotations

import json
import sys
import traceback
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hfdist.config.dims import ParallelDims
from hfdist.config.ladder import load_rung
from hfdist.data.collation import attention_inputs
from hfdist.models.build import inject_lora, materialize, meta_model
from hfdist.models.load import load_weights, weight_plan
from hfdist.parallel.context import CP_ATTENTION, cp_group_of, shard_batch
from hfdist.parallel.parallelize import parallelize
from hfdist.parallel.tensor import tp_causal_lm_loss
from hfdist.parallel.verify import StrategyNotInEffect, verify_strategy

SEQ, ROWS, STEPS, LR, VOCAB = 512, 4, 3, 3e-3, 512


def packed_batch(implementation: str) -> dict[str, torch.Tensor]:
    """ROWS packed rows of SEQ tokens, 3-6 documents each (random lengths), the first token of every document and
    a few more masked out of the labels; attention inputs as hfdist's collator builds them."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    positions = torch.empty(ROWS, SEQ, dtype=torch.long)
    for row in range(ROWS):
        cuts = sorted(torch.randperm(SEQ - 1, generator=g)[: 2 + row].add(1).tolist())
        start = 0
        for end in [*cuts, SEQ]:
            positions[row, start:end] = torch.arange(end - start)
            start = end
    labels = ids.clone()
    labels[positions == 0] = -100
    labels[torch.rand(ROWS, SEQ, generator=g) < 0.1] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": positions,
            **attention_inputs(positions, implementation)}


def build(lora: bool, implementation: str, rung=None):
    """The model as hfdist builds it: meta structure (+ LoRA), then either the whole model in this process or
    `rung`'s parallelised shards, filled from the same seeded plan (identical starting weights)."""
    torch.manual_seed(0)
    model = meta_model("llama-tiny", vocab_size=VOCAB)
    model.config._attn_implementation = implementation
    if lora:
        model = inject_lora(model, 4, 8)
    plan = weight_plan(model, None, 0)
    if rung is not None:
        return parallelize(model, rung, device=torch.device("cpu"), mixed_precision="no",
                           activation_checkpointing=False, weights=plan)
    materialize(model, torch.device("cpu"))
    load_weights({**dict(model.named_parameters()), **dict(model.named_buffers())}, plan)
    if lora:  # peft starts lora_B at zero: give every adapter a gradient from the first step
        _perturb_lora_b(model)
    return model


def _perturb_lora_b(model) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    g = torch.Generator().manual_seed(3)
    for name, p in sorted(model.named_parameters()):
        if "lora_B" in name:
            full = torch.randn(p.shape, generator=g) * 0.05
            with torch.no_grad():
                if isinstance(p, DTensor):
                    p.copy_(distribute_tensor(full, p.device_mesh, p.placements))
                else:
                    p.copy_(full)


def count(batch) -> torch.Tensor:
    return batch["labels"][:, 1:].ne(-100).sum()


def loss_of(model, inputs, n, tp: int) -> torch.Tensor:
    """The Trainer's loss: HF's own, or under TP the vocab-parallel one (call inside loss_parallel())."""
    return tp_causal_lm_loss(model, inputs, n) if tp > 1 else model(**inputs, num_items_in_batch=n).loss


def train(model, batch, rows: slice, cp_rank: int, dims: ParallelDims | None = None) -> list[float]:
    """STEPS AdamW steps; the loss of each is the sum of the ranks' partial sums over the global label count."""
    dims = dims or ParallelDims()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    n = count(batch)
    local = {k: v[rows] for k, v in batch.items()}
    inputs = shard_batch(local, cp_rank, dims.cp) if dims.cp > 1 else local
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        with loss_parallel() if dims.tp > 1 else nullcontext():
            loss = loss_of(model, inputs, n, dims.tp)
            (loss * dims.dp * dims.cp).backward()  # FSDP2 averages gradients over dp_shard x cp: undo it
        total = loss.detach().clone()
        if dims.world_size > 1:
            dist.all_reduce(total)  # tp ranks hold the same partial sum
        opt.step()
        losses.append(float(total) / dims.tp)
    return losses


def document_logit_error(model, reference, batch, rows: slice, cp_rank: int, cp: int) -> float:
    """Largest |logit difference| over every document of this rank's rows: the cp model on the packed rows
    (chunks gathered from the cp group) against `reference` on each document alone."""
    local = {k: v[rows] for k, v in batch.items()}
    inputs = {k: v for k, v in shard_batch(local, cp_rank, cp).items() if "labels" not in k}
    with torch.no_grad():
        chunk = model(**inputs).logits
        chunk = (chunk.full_tensor() if isinstance(chunk, DTensor) else chunk).contiguous()  # vocab-split under TP
        parts = [torch.empty_like(chunk) for _ in range(cp)]
        dist.all_gather(parts, chunk, group=cp_group_of(model))
        logits = torch.cat(parts, dim=1)
        worst = 0.0
        for row in range(logits.shape[0]):
            starts = (local["position_ids"][row] == 0).nonzero().flatten().tolist() + [SEQ]
            for a, b in zip(starts[:-1], starts[1:]):
                alone = reference(input_ids=local["input_ids"][row:row + 1, a:b], use_cache=False).logits[0]
                worst = max(worst, float((logits[row, a:b] - alone).abs().max()))
    return worst


def case(name: str, dims: ParallelDims, lora: bool, implementation: str) -> dict:
    rank = dist.get_rank()
    rung = replace(load_rung("fsdp_cp"), name=name, dims=dims, num_processes=dims.world_size)
    batch = packed_batch(implementation)
    dp_rank = rank // dims.ranks_per_batch
    per_dp = ROWS // dims.dp
    rows = slice(dp_rank * per_dp, (dp_rank + 1) * per_dp)
    model = build(lora, implementation, rung)
    if lora:
        _perturb_lora_b(model)
    reference = build(lora, implementation)
    verify_strategy(rung, model, model, lora)  # the run-time check passes on the real layout...
    refused = None
    if name == "fsdp_cp":  # ...and refuses the same model attending without the cp exchange
        model.config._attn_implementation = "sdpa"
        try:
            verify_strategy(rung, model, model, lora)
        except StrategyNotInEffect as exc:
            refused = str(exc)
        model.config._attn_implementation = CP_ATTENTION
    cp_rank = dist.get_rank(cp_group_of(model))
    out = {"refused_without_cp": refused, "attn": model.config._attn_implementation, "cp_rank": cp_rank,
           "doc_logit_err": document_logit_error(model, reference, batch, rows, cp_rank, dims.cp)}
    # A forward without backward leaves FSDP2's root (embedding, norm, lm_head) unsharded: the optimizer must be
    # made on the sharded parameters.
    model.reshard()
    out["losses"] = train(model, batch, rows, cp_rank, dims)
    out["ref_losses"] = train(reference, batch, slice(0, ROWS), 0)
    out["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return out


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    results = {}
    cases = {"fsdp_cp": (ParallelDims(dp_shard=2, cp=2), False, "sdpa"),
             "cp4_gqa_eager": (ParallelDims(cp=4), False, "eager"),
             "lora_fsdp_cp": (ParallelDims(dp_shard=2, cp=2), True, "sdpa"),
             "tp_cp": (ParallelDims(cp=2, tp=2), False, "sdpa"),
             "hsdp_cp": (ParallelDims(dp_replicate=2, cp=2), False, "sdpa")}
    for name, (dims, lora, implementation) in cases.items():
        try:
            results[name] = case(name, dims, lora, implementation)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
