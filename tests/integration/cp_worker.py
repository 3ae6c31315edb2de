"""Worker for tests/integration/test_context_parallel.py:
`torchrun --nproc-per-node 4 tests/integration/cp_worker.py OUT.json`.

One launch of 4 gloo ranks runs every context-parallel case through hfdist's own recipe (meta model -> LoRA ->
hfdist.parallel.parallelize with a cp rung and its --cp-method -> the Trainer's batch sharding,
hfdist.parallel.context.shard_batch), so the suite pays the process start-up once. Attention is hfdist's document
attention (the CPU default: the batch carries the whole rows' boundaries) unless named. On llama-tiny (4 heads, 2 kv):
- fsdp_cp: dp_shard=2 x cp=2, full fine-tune (Ulysses);
- cp=4: dp_shard=1 x cp=4, eager attention with its dense mask: llama-tiny's 2 kv heads are fewer than cp (GQA,
  kv heads repeated);
- LoRA on dp_shard=2 x cp=2;
- cp=2 x tp=2 (Megatron TP with sequence parallel and the vocab-parallel loss, FSDP2 over the cp axis);
- HSDP: dp_replicate=2 x cp=2 (FSDP2 replicated over dp_replicate, sharded over cp), sdpa with its dense mask;
on llama-tiny-6h (6 heads, 2 kv: cp=4, or cp=2 under tp=2, cannot split the heads):
- ring_cp4: cp=4 by ring attention (asked for), with activation checkpointing (the ring's forward runs again in
  backward);
- hybrid_cp4_lora: cp=4, auto: Ulysses over 2 ranks x a ring of 2, LoRA;
- tp_cp_ring: tp=2 x cp=2 (fsdp_tp_cp), auto: ring (3 heads per tp rank);
- pp_cp_ring: pp=2 x cp=2 by ring (the 3d rung's pipeline: the batch cut before stage 0, each stage's micro-batches
  attending by the whole rows' boundaries);
and the long cases, one packed row (chat-sized documents and a few long ones) with each rank's largest tensor
measured while it trains (hfdist.metrics.memory.LiveTensorBytes, and the longest dimension of anything created):
- long_cp4: cp=4 (Ulysses) at LONG_SEQ = 32,768 tokens: nothing S x S;
- long_ring: cp=4 by ring at RING_SEQ = 65,536 tokens: nothing longer than S / cp along any dimension;
- ring_bf16_8k: cp=4 by ring at 8,192 tokens computing in bf16, against one process's bf16 (CPU autocast).
Each trains STEPS AdamW steps on packed rows holding several documents, against the same model trained in one
process (by rank 0, which writes the results; for the long cases it shares it), recording per step
the loss and the global gradient norm before the optimizer step (hfdist.parallel.grad_norm over every mesh, the
pipeline's over its stages; the reference's by torch), and compares per-document logits under cp with each document
run alone. Adam's update is the same for g and c g, so losses alone miss a wrong gradient scale: a planted case,
fsdp_cp's layout with every rank's gradients halved after each backward (the wrong dp x cp average: cp left out of
the factor that undoes FSDP2's), trains PLANTED_STEPS steps for the test to show the norms catch it. A case that
raises is recorded with its traceback instead of aborting the launch.
"""

from __future__ import annotations

import json
import sys
import traceback
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._pytree import tree_flatten

from hfdist.config.dims import ParallelDims
from hfdist.config.ladder import ContextSettings, PipelineSettings, load_rung
from hfdist.data.collation import attention_inputs
from hfdist.metrics.memory import LiveTensorBytes
from hfdist.models.attention import DOCUMENT_ATTENTION
from hfdist.models.build import inject_lora, materialize, meta_model
from hfdist.models.load import load_weights, weight_plan
from hfdist.parallel.context import CP_ATTENTIONS, cp_group_of, cp_spec_of, shard_batch
from hfdist.parallel.grad_norm import grad_norm
from hfdist.parallel.parallelize import parallelize
from hfdist.parallel.tensor import tp_causal_lm_loss
from hfdist.parallel.verify import StrategyNotInEffect, verify_strategy

SEQ, ROWS, STEPS, LR, VOCAB = 512, 4, 3, 3e-3, 512
LONG_SEQ, RING_SEQ, LONG_STEPS = 32768, 65536, 2
BF16_RING_SEQ = 8192
PLANTED_STEPS, PLANTED_GRAD_SCALE = 2, 0.5


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


def build(lora: bool, implementation: str, rung=None, preset: str = "llama-tiny", recompute: bool = False,
          mixed_precision: str = "no"):
    """The model as hfdist builds it: meta structure (+ LoRA), then either the whole model in this process or
    `rung`'s parallelised shards (each decoder layer recomputed in backward under `recompute`; computing in
    `mixed_precision`), filled from the same seeded plan (identical starting weights)."""
    torch.manual_seed(0)
    model = meta_model(preset, vocab_size=VOCAB, attn_implementation=implementation)
    if lora:
        model = inject_lora(model, 4, 8)
    plan = weight_plan(model, None, 0)
    if rung is not None:
        model = parallelize(model, rung, device=torch.device("cpu"), mixed_precision=mixed_precision,
                            activation_checkpointing=recompute, weights=plan)
    else:
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


def global_grad_norm(model, dims: ParallelDims) -> float:
    """The norm of every gradient of the model before the step: one process's by torch (no communication), a
    layout's by hfdist.parallel.grad_norm over every mesh (a pipeline's over its stages too, its tied weight once)."""
    if dims.world_size == 1:
        return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
    return float(model.clip_grad_norm_(float("inf")) if dims.pp > 1 else grad_norm(model.parameters()))


def train(model, batch, rows: slice, cp_rank: int, dims: ParallelDims | None = None, steps: int = STEPS,
          grad_scale: float = 1.0, autocast: torch.dtype | None = None) -> dict[str, list[float]]:
    """`steps` AdamW steps: per step the loss, the sum of the ranks' partial sums over the global label count, and
    the global gradient norm before the optimizer step, after every gradient is scaled by `grad_scale` (a planted
    fault when not 1); the forward and backward under CPU autocast to `autocast` when given (the single rung's
    bf16). Under pipeline stages the model's forward runs the schedule (forward and backward) and returns, on the
    last stage, its partial sum scaled by dp x cp (the FSDP2 average it undoes)."""
    dims = dims or ParallelDims()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    n = count(batch)
    local = local_rows(batch, rows)
    spec = cp_spec_of(model)
    inputs = shard_batch(local, cp_rank, spec.plan, row_positions=dims.pp > 1) if dims.cp > 1 else local
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        if dims.pp > 1:
            total = model(**inputs, num_items_in_batch=n).detach() / (dims.dp * dims.cp)
        else:
            with loss_parallel() if dims.tp > 1 else nullcontext(), \
                    torch.autocast("cpu", dtype=autocast) if autocast is not None else nullcontext():
                loss = loss_of(model, inputs, n, dims.tp)
                (loss * dims.dp * dims.cp).backward()  # FSDP2 averages gradients over dp_shard x cp: undo it
            total = loss.detach().clone()
        if dims.world_size > 1:
            dist.all_reduce(total)  # tp ranks hold the same partial sum (under pp: only the last stage's ranks)
        if grad_scale != 1.0:
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(grad_scale)
        norms.append(global_grad_norm(model, dims))
        opt.step()
        losses.append(float(total) / dims.tp)
    return {"losses": losses, "grad_norms": norms}


def document_logit_error(model, reference, batch, rows: slice, cp_rank: int) -> float:
    """Largest |logit difference| over every document of this rank's rows: the cp model on the packed rows
    (each rank's tokens gathered from the cp group and put back in place) against `reference` on each document
    alone."""
    from hfdist.parallel.context import token_index

    spec = cp_spec_of(model)
    local = local_rows(batch, rows)
    inputs = {k: v for k, v in shard_batch(local, cp_rank, spec.plan).items() if "labels" not in k}
    with torch.no_grad():
        part = model(**inputs).logits
        part = (part.full_tensor() if isinstance(part, DTensor) else part).contiguous()  # vocab-split under TP
        parts = [torch.empty_like(part) for _ in range(spec.plan.cp)]
        dist.all_gather(parts, part, group=spec.group)
        seq = local["input_ids"].shape[1]
        order = torch.cat([token_index(seq, spec.plan, r) for r in range(spec.plan.cp)])
        logits = torch.empty_like(torch.cat(parts, dim=1)).index_copy_(1, order, torch.cat(parts, dim=1))
        worst = 0.0
        for row in range(logits.shape[0]):
            starts = (local["position_ids"][row] == 0).nonzero().flatten().tolist() + [logits.shape[1]]
            for a, b in zip(starts[:-1], starts[1:]):
                alone = reference(input_ids=local["input_ids"][row:row + 1, a:b], use_cache=False).logits[0]
                worst = max(worst, float((logits[row, a:b] - alone).abs().max()))
    return worst


def whole_logit_error(model, reference, batch, rows: slice) -> float:
    """Largest |logit difference| between the cp model made to return whole outputs on every rank (a Trainer's own
    loss: hfdist.parallel.whole_outputs cuts the rows by the plan's layout and gathers them back) and the reference
    on the same rows (a user's trainer hands the model its rows and position ids)."""
    from hfdist.parallel.whole_outputs import whole_outputs

    inputs = {k: v for k, v in local_rows(batch, rows).items() if k != "labels"}
    handles = whole_outputs(model)
    try:
        with torch.no_grad():  # the cp model rebuilds the attention inputs from the position ids itself
            got = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).logits
            want = reference(**inputs, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    return float((got - want).abs().max())


def cp_rung(name: str, dims: ParallelDims, method: str):
    """A cp rung of these degrees: fsdp_cp's FSDP2 settings (3d's pipeline, 2 micro-batches, under pp)."""
    base = load_rung("3d" if dims.pp > 1 else "fsdp_cp")
    pipeline = PipelineSettings("1F1B", 2) if dims.pp > 1 else None
    return replace(base, name=name, dims=dims, num_processes=dims.world_size, pipeline=pipeline,
                   context=ContextSettings(method))


def dp_rows(dims: ParallelDims) -> slice:
    """This rank's rows of the global batch: its data-parallel rank's share."""
    per_dp = ROWS // dims.dp
    dp_rank = dist.get_rank() // dims.ranks_per_batch
    return slice(dp_rank * per_dp, (dp_rank + 1) * per_dp)


def case(name: str, dims: ParallelDims, lora: bool, implementation: str, preset: str, method: str,
         recompute: bool = False) -> dict:
    rung = cp_rung(name, dims, method)
    batch = packed_batch(implementation)
    rows = dp_rows(dims)
    model = build(lora, implementation, rung, preset, recompute)
    reference = build(lora, implementation, preset=preset)
    verify_strategy(rung, model, model, lora, implementation)  # the run-time check passes on the real layout...
    spec = cp_spec_of(model)
    refused = None
    if name == "fsdp_cp":  # ...and refuses the same model attending without the cp exchange
        model.config._attn_implementation = "sdpa"
        try:
            verify_strategy(rung, model, model, lora)
        except StrategyNotInEffect as exc:
            refused = str(exc)
        model.config._attn_implementation = CP_ATTENTIONS[spec.plan.method]
    cp_rank = dist.get_rank(spec.group)
    out = {"refused_without_cp": refused, "attn": model.config._attn_implementation,
           "method": spec.plan.method, "ulysses": spec.plan.ulysses, "cp_rank": cp_rank,
           "mask_in_batch": "attention_mask" in local_rows(batch, rows)}
    if dims.pp == 1:
        out["doc_logit_err"] = document_logit_error(model, reference, batch, rows, cp_rank)
        out["whole_logit_err"] = whole_logit_error(model, reference, batch, rows)
        # A forward without backward leaves FSDP2's root (embedding, norm, lm_head) unsharded: the optimizer must
        # be made on the sharded parameters.
        model.reshard()
    out["run"] = train(model, batch, rows, cp_rank, dims)
    # One process's run, no communication: rank 0's is the one written (the other ranks would train the same for
    # nothing, on the cores rank 0 trains on).
    out["reference"] = train(reference, batch, slice(0, ROWS), 0) if dist.get_rank() == 0 else None
    out["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return out


def planted_case(name: str, dims: ParallelDims, grad_scale: float) -> dict:
    """`dims` (Ulysses on llama-tiny) with every rank's gradients x `grad_scale` after each backward, PLANTED_STEPS
    steps, against the reference's."""
    batch = packed_batch(DOCUMENT_ATTENTION)
    model = build(False, DOCUMENT_ATTENTION, cp_rung(name, dims, "auto"))
    run = train(model, batch, dp_rows(dims), dist.get_rank(cp_group_of(model)), dims, PLANTED_STEPS, grad_scale)
    reference = (train(build(False, DOCUMENT_ATTENTION), batch, slice(0, ROWS), 0, steps=PLANTED_STEPS)
                 if dist.get_rank() == 0 else None)  # rank 0's is the one written, as case()'s
    return {"run": run, "reference": reference, "grad_scale": grad_scale}


class LongestDim(LiveTensorBytes):
    """LiveTensorBytes that also records the longest dimension of any floating-point tensor of two or more dimensions
    an op creates (views excluded): activations, keys, values and their gradients (not the int64 batch, whose label
    shift is a whole row, nor FSDP2's flat 1-D parameter buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.longest, self.longest_op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if (type(t) is torch.Tensor and t.is_floating_point() and t.dim() > 1 and
                    id(t.untyped_storage()) not in inputs and max(t.shape) > self.longest):
                self.longest, self.longest_op = max(t.shape), f"{func} {tuple(t.shape)}"
        return out


def long_case(name: str, seq: int, method: str) -> dict:
    """cp=4 on one row of `seq` tokens: the losses against one process training the same row (rank 0's, shared),
    and the largest tensor (bytes, and longest dimension) each rank creates while it trains (every rank's)."""
    dims = ParallelDims(cp=4)
    rung = cp_rung(name, dims, method)
    batch = packed_batch(DOCUMENT_ATTENTION, rows=1, seq=seq)
    model = build(False, DOCUMENT_ATTENTION, rung)
    verify_strategy(rung, model, model, False, DOCUMENT_ATTENTION)
    with LongestDim() as created:
        run = train(model, batch, slice(0, 1), dist.get_rank(cp_group_of(model)), dims, LONG_STEPS)
    box = [train(build(False, DOCUMENT_ATTENTION), batch, slice(0, 1), 0, steps=LONG_STEPS)
           if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    largest = [None] * dist.get_world_size()
    dist.all_gather_object(largest, (created.largest, created.largest_op, created.longest, created.longest_op))
    config = model.config
    return {"run": run, "reference": box[0], "largest": largest, "seq": seq,
            "width": max(config.intermediate_size, config.hidden_size, VOCAB),
            "batch_keys": sorted(local_rows(batch, slice(0, 1))), "method": cp_spec_of(model).plan.method,
            "documents": int((batch["position_ids"] == 0).sum()), "attn": config._attn_implementation}


def ring_bf16_case(name: str, seq: int) -> dict:
    """cp=4 by ring on one row of `seq` tokens computing in bf16 (FSDP2's bf16 compute: the block kernels get bf16
    queries, keys and values, as the GPU's flash kernel does), against one process training the same row under CPU
    autocast to bf16 (the single rung's bf16; rank 0's, shared); and the dtypes the block kernel was handed."""
    from hfdist.parallel import ring_kernels

    dims = ParallelDims(cp=4)
    rung = cp_rung(name, dims, "ring")
    batch = packed_batch(DOCUMENT_ATTENTION, rows=1, seq=seq)
    model = build(False, DOCUMENT_ATTENTION, rung, preset="llama-tiny-6h", mixed_precision="bf16")
    seen: set[str] = set()
    kernel_forward = ring_kernels.CpuFlashKernel.forward

    def recording(self, q, k, v, causal, scale):
        seen.add(str(q.dtype))
        return kernel_forward(self, q, k, v, causal, scale)

    ring_kernels.CpuFlashKernel.forward = recording
    try:
        run = train(model, batch, slice(0, 1), dist.get_rank(cp_group_of(model)), dims, LONG_STEPS)
    finally:
        ring_kernels.CpuFlashKernel.forward = kernel_forward
    box = [train(build(False, DOCUMENT_ATTENTION, preset="llama-tiny-6h"), batch, slice(0, 1), 0, steps=LONG_STEPS,
                 autocast=torch.bfloat16) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return {"run": run, "reference": box[0], "method": cp_spec_of(model).plan.method, "kernel_dtypes": sorted(seen),
            "seq": seq}


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    results = {}
    doc, six = DOCUMENT_ATTENTION, "llama-tiny-6h"
    cases = {"fsdp_cp": (ParallelDims(dp_shard=2, cp=2), False, doc, "llama-tiny", "auto"),
             "cp4_gqa_eager": (ParallelDims(cp=4), False, "eager", "llama-tiny", "auto"),
             "lora_fsdp_cp": (ParallelDims(dp_shard=2, cp=2), True, doc, "llama-tiny", "auto"),
             "tp_cp": (ParallelDims(cp=2, tp=2), False, doc, "llama-tiny", "auto"),
             "hsdp_cp": (ParallelDims(dp_replicate=2, cp=2), False, "sdpa", "llama-tiny", "auto"),
             "ring_cp4": (ParallelDims(cp=4), False, doc, six, "ring", True),  # recomputed: the ring runs again
             "hybrid_cp4_lora": (ParallelDims(cp=4), True, doc, six, "auto"),
             "tp_cp_ring": (ParallelDims(cp=2, tp=2), False, doc, six, "auto"),
             "pp_cp_ring": (ParallelDims(cp=2, pp=2), False, doc, six, "ring")}
    runs = {name: partial(case, name, *args) for name, args in cases.items()}
    runs["planted_fsdp_cp_grads_x0.5"] = partial(planted_case, "fsdp_cp", ParallelDims(dp_shard=2, cp=2),
                                                 PLANTED_GRAD_SCALE)
    runs["long_cp4"] = partial(long_case, "long_cp4", LONG_SEQ, "ulysses")
    runs["long_ring"] = partial(long_case, "long_ring", RING_SEQ, "ring")
    runs["ring_bf16_8k"] = partial(ring_bf16_case, "ring_bf16_8k", BF16_RING_SEQ)
    only = sys.argv[2:]  # a subset of the cases, by name (for a quick look; the suite runs them all)
    for name, run in runs.items():
        if only and name not in only:
            continue
        try:
            results[name] = run()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
