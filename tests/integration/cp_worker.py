"""Worker for tests/integration/test_context_parallel.py:
`torchrun --nproc-per-node 4 tests/integration/cp_worker.py OUT.json`.

One launch of 4 gloo ranks runs every context-parallel case through hfdist's own recipe (meta model -> LoRA ->
hfdist.parallel.parallelize with a cp rung -> the Trainer's batch sharding, hfdist.parallel.context.shard_batch),
so the suite pays the process start-up once. Attention is hfdist's document attention (the CPU default: each rank
attends every document of the gathered sequence on its own, from the whole rows' boundaries) unless named:
- fsdp_cp: dp_shard=2 x cp=2, full fine-tune;
- cp=4: dp_shard=1 x cp=4, eager attention with its dense mask: llama-tiny's 2 kv heads are fewer than cp (GQA,
  kv heads repeated);
- LoRA on dp_shard=2 x cp=2;
- cp=2 x tp=2 (Megatron TP with sequence parallel and the vocab-parallel loss, FSDP2 over the cp axis);
- HSDP: dp_replicate=2 x cp=2 (FSDP2 replicated over dp_replicate, sharded over cp), sdpa with its dense mask;
- long_cp4: cp=4 on one packed row of LONG_SEQ = 32,768 tokens (chat-sized documents and a few long ones), each
  rank's largest tensor measured while it trains (hfdist.metrics.memory.LiveTensorBytes): nothing S x S.
Each trains STEPS AdamW steps on packed rows holding several documents, against the same model trained in one
process (every rank computes the reference itself; for long_cp4 rank 0 does and shares it), and compares
per-document logits under cp with each document run alone. A case that raises is recorded with its traceback
instead of aborting the launch.
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
from hfdist.metrics.memory import LiveTensorBytes
from hfdist.models.attention import DOCUMENT_ATTENTION
from hfdist.models.build import inject_lora, materialize, meta_model
from hfdist.models.load import load_weights, weight_plan
from hfdist.parallel.context import CP_ATTENTION, cp_group_of, shard_batch
from hfdist.parallel.parallelize import parallelize
from hfdist.parallel.tensor import tp_causal_lm_loss
from hfdist.parallel.verify import StrategyNotInEffect, verify_strategy

SEQ, ROWS, STEPS, LR, VOCAB = 512, 4, 3, 3e-3, 512
LONG_SEQ, LONG_STEPS = 32768, 2


def _row_positions(g: torch.Generator, seq: int, cuts: list[int]) -> torch.Tensor:
    positions = torch.empty(seq, dtype=torch.long)
    for start, end in zip([0, *cuts], [*cuts, seq]):
        positions[start:end] = torch.arange(end - start)
    return positions


def packed_batch(implementation: str, rows: int = ROWS, seq: int = SEQ) -> dict[str, torch.Tensor]:
    """`rows` packed rows of `seq` tokens, the first token of every document and a few more masked out of the
    labels; attention inputs as hfdist's collator builds them. SEQ rows hold 3-6 documents of random lengths;
    longer rows chat-sized documents (50-700 tokens) and one of 4,000 per 16K."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
    positions = torch.empty(rows, seq, dtype=torch.long)
    for row in range(rows):
        if seq == SEQ:
            cuts = sorted(torch.randperm(SEQ - 1, generator=g)[: 2 + row].add(1).tolist())
        else:
            lengths = [4000 if i % 40 == 0 else int(torch.randint(50, 700, (1,), generator=g)) for i in range(seq)]
            ends = torch.tensor(lengths).cumsum(0)
            cuts = ends[ends < seq].tolist()
        positions[row] = _row_positions(g, seq, cuts)
    labels = ids.clone()
    labels[positions == 0] = -100
    labels[torch.rand(rows, seq, generator=g) < 0.1] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "implementation": implementation}


def local_rows(batch: dict, rows: slice) -> dict[str, torch.Tensor]:
    """A data-parallel rank's rows, with the attention inputs hfdist's collator would build for them (document
    boundaries describe exactly the rows they come with)."""
    local = {k: batch[k][rows] for k in ("input_ids", "labels", "position_ids")}
    return {**local, **attention_inputs(local["position_ids"], batch["implementation"])}


def build(lora: bool, implementation: str, rung=None):
    """The model as hfdist builds it: meta structure (+ LoRA), then either the whole model in this process or
    `rung`'s parallelised shards, filled from the same seeded plan (identical starting weights)."""
    torch.manual_seed(0)
    model = meta_model("llama-tiny", vocab_size=VOCAB, attn_implementation=implementation)
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


def train(model, batch, rows: slice, cp_rank: int, dims: ParallelDims | None = None, steps: int = STEPS) -> list[float]:
    """`steps` AdamW steps; the loss of each is the sum of the ranks' partial sums over the global label count."""
    dims = dims or ParallelDims()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    n = count(batch)
    local = local_rows(batch, rows)
    inputs = shard_batch(local, cp_rank, dims.cp) if dims.cp > 1 else local
    losses = []
    for _ in range(steps):
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
    local = local_rows(batch, rows)
    inputs = {k: v for k, v in shard_batch(local, cp_rank, cp).items() if "labels" not in k}
    with torch.no_grad():
        chunk = model(**inputs).logits
        chunk = (chunk.full_tensor() if isinstance(chunk, DTensor) else chunk).contiguous()  # vocab-split under TP
        parts = [torch.empty_like(chunk) for _ in range(cp)]
        dist.all_gather(parts, chunk, group=cp_group_of(model))
        logits = torch.cat(parts, dim=1)
        worst = 0.0
        for row in range(logits.shape[0]):
            starts = (local["position_ids"][row] == 0).nonzero().flatten().tolist() + [logits.shape[1]]
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
    verify_strategy(rung, model, model, lora, implementation)  # the run-time check passes on the real layout...
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
           "mask_in_batch": "attention_mask" in local_rows(batch, rows),
           "doc_logit_err": document_logit_error(model, reference, batch, rows, cp_rank, dims.cp)}
    # A forward without backward leaves FSDP2's root (embedding, norm, lm_head) unsharded: the optimizer must be
    # made on the sharded parameters.
    model.reshard()
    out["losses"] = train(model, batch, rows, cp_rank, dims)
    out["ref_losses"] = train(reference, batch, slice(0, ROWS), 0)
    out["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return out


def long_case() -> dict:
    """cp=4 on one row of LONG_SEQ tokens: the losses against one process training the same row (rank 0's, shared),
    and the largest tensor each rank creates while it trains (every rank's reported)."""
    dims = ParallelDims(cp=4)
    rung = replace(load_rung("fsdp_cp"), name="long_cp4", dims=dims, num_processes=dims.world_size)
    batch = packed_batch(DOCUMENT_ATTENTION, rows=1, seq=LONG_SEQ)
    model = build(False, DOCUMENT_ATTENTION, rung)
    verify_strategy(rung, model, model, False, DOCUMENT_ATTENTION)
    with LiveTensorBytes() as created:
        losses = train(model, batch, slice(0, 1), dist.get_rank(cp_group_of(model)), dims, LONG_STEPS)
    box = [train(build(False, DOCUMENT_ATTENTION), batch, slice(0, 1), 0, steps=LONG_STEPS)
           if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    largest = [None] * dist.get_world_size()
    dist.all_gather_object(largest, (created.largest, created.largest_op))
    return {"losses": losses, "ref_losses": box[0], "largest": largest, "seq": LONG_SEQ,
            "batch_keys": sorted(local_rows(batch, slice(0, 1))),
            "documents": int((batch["position_ids"] == 0).sum()),
            "attn": model.config._attn_implementation}


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    results = {}
    cases = {"fsdp_cp": (ParallelDims(dp_shard=2, cp=2), False, DOCUMENT_ATTENTION),
             "cp4_gqa_eager": (ParallelDims(cp=4), False, "eager"),
             "lora_fsdp_cp": (ParallelDims(dp_shard=2, cp=2), True, DOCUMENT_ATTENTION),
             "tp_cp": (ParallelDims(cp=2, tp=2), False, DOCUMENT_ATTENTION),
             "hsdp_cp": (ParallelDims(dp_replicate=2, cp=2), False, "sdpa")}
    for name, (dims, lora, implementation) in cases.items():
        try:
            results[name] = case(name, dims, lora, implementation)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    try:
        results["long_cp4"] = long_case()
    except Exception:
        results["long_cp4"] = {"error": traceback.format_exc()}
    dist.barrier()
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
