"""Worker for tests/integration/test_moe_parallel.py:
`torchrun --nproc-per-node 4 tests/integration/moe_worker.py OUT.json`.

One launch of 4 gloo ranks trains every mixture-of-experts case through hfdist's recipe (hfdist.parallel.parallelize,
the rung's own layout) against one process holding the whole global batch: Qwen3-MoE (one dense layer among its MoE
layers) and Mixtral (8 experts, top-2) on fsdp_ep at ep 2 and 4 and on fsdp_tp with tp 2 x ep 2 (Qwen3-MoE's with the
aux loss's coefficient at 1, so its gradient shows), Qwen3-MoE with LoRA on fsdp_ep, with activation checkpointing
at ep 4, on fsdp_full_shard (the model's
own MoE blocks under FSDP2) and on ddp (under DistributedDataParallel); Llama 4's text model (shared expert, top-1,
interleaved dense layers) on fsdp_ep and, with LoRA on its attention, dense and shared-expert projections, on fsdp_tp
x ep. Per step (AdamW, 2 steps: the second's losses show the first's gradients): the cross-entropy and the router's
aux loss over the global batch as the ranks' shares add up (all-reduced, as the Trainer's logged loss averages them),
the tokens routed to each expert, and the global gradient norm before the optimizer step (every mesh's gradients,
the experts' `efsdp` x `ep` included: hfdist.parallel.grad_norm; the reference's by torch); after building, the
experts each rank holds (its E / ep, equal to the reference's rows). Losses alone cannot tell a gradient's scale (Adam's
update is the same for g and c g), so one case plants a fault the norms must show: Qwen3-MoE on fsdp_ep at ep 2 with
rank 0's expert gradients doubled after every backward. Rank 0 trains the single-process reference (no communication)
and writes the results; every rank builds the reference's fresh weights to compare its experts with; a case that
raises is recorded with its traceback.
"""

from __future__ import annotations

import json
import sys
import traceback
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hfdist.config.ladder import load_rung
from hfdist.models.build import lora_config, materialize, meta_model
from hfdist.models.chunked_loss import causal_lm_loss
from hfdist.models.load import load_weights, weight_plan
from hfdist.models.moe import moe_layers
from hfdist.models.router_stats import RouterRecorder
from hfdist.parallel.grad_norm import grad_norm
from hfdist.parallel.parallelize import parallelize

VOCAB, SEQ, ROWS, STEPS, LR = 1024, 32, 8, 2, 1e-3
WORLD = 4


def make_batch() -> dict[str, torch.Tensor]:
    """The global batch: ROWS sequences, the first tokens of two rows masked out of the loss."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :5] = labels[3, :9] = -100
    return {"input_ids": ids, "labels": labels}


def build(spec: str, lora: bool, rung=None, ac: bool = False):
    """The model of `spec` (LoRA r=4 on every attention and dense projection), seeded as hfdist seeds it: whole in
    this process (wrapped in DDP for the ddp rung, as the Trainer wraps it), or through the rung's recipe."""
    meta = meta_model(spec, VOCAB)
    if lora:
        from peft import get_peft_model

        from hfdist.models.moe import moe_lora_config

        meta = get_peft_model(meta, moe_lora_config(meta, lora_config(4, 8)))
    plan = weight_plan(meta, None, seed=0)
    if rung is None or not rung.owns_sharding:
        materialize(meta, torch.device("cpu"))
        load_weights({**dict(meta.named_parameters()), **dict(meta.named_buffers())}, plan)
        return meta if rung is None else torch.nn.parallel.DistributedDataParallel(meta)
    return parallelize(meta, rung, device=torch.device("cpu"), mixed_precision="no", activation_checkpointing=ac,
                       weights=plan)


def scale_expert_grads(model: torch.nn.Module, factor: float) -> None:
    """The planted fault: this rank's gradients of the experts (parameters named `experts`) x `factor`, the shards of
    the other ranks left as they are."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name and p.grad is not None:
                p.grad.mul_(factor)  # a DTensor's local shard: no communication, the other ranks' shards untouched


def train(model, batch: dict, recorder: RouterRecorder, *, scale: int, tp: bool, expert_grad_scale: float = 1.0
          ) -> list[dict]:
    """STEPS AdamW steps on `batch` (this rank's rows; all of the global batch when `scale` is 1: the reference): per
    step the summed CE / aux / total over the ranks' shares, the global tokens per expert (summed over the MoE layers)
    and the global gradient norm before the step, after this rank's expert gradients are scaled by
    `expert_grad_scale` (a planted fault when not 1)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    reference = scale == 1
    # the global target count, as the Trainer's num_items_in_batch
    count = int(((batch if reference else make_batch())["labels"][:, 1:] != -100).sum())
    steps = []
    for _ in range(STEPS):
        with loss_parallel() if tp else nullcontext():
            with recorder.recording():
                ce = causal_lm_loss(model, batch, num_items_in_batch=count)
            aux = recorder.aux_term(1, value_scale=scale)
            loss = ce + aux if aux is not None else ce
            (loss * scale).backward()
        counts = recorder._global.clone()
        recorder._local.zero_()
        recorder._global.zero_()
        if expert_grad_scale != 1.0:
            scale_expert_grads(model, expert_grad_scale)
        # the reference's by torch, without communication (every rank computes it); the layout's over every mesh
        norm = (torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
                if reference else grad_norm(model.parameters()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append({"ce": float(ce.detach()), "aux": float(aux.detach()) if aux is not None else 0.0,
                      "counts": counts.tolist(), "grad_norm": float(norm)})
    return steps


def shares_summed(steps: list[dict], tp: int) -> list[dict]:
    """The ranks' CE shares summed over the data-parallel ranks (tp ranks hold the same), and the aux values
    (already the global aux / scale on every rank: summed over all ranks, divided by tp); the counts and the gradient
    norm are already global."""
    out = []
    for step in steps:
        t = torch.tensor([step["ce"], step["aux"]], dtype=torch.float64)
        dist.all_reduce(t)
        out.append({**step, "ce": float(t[0]) / tp, "aux": float(t[1]) / tp})
    return out


def held_experts(model, reference) -> dict:
    """Each rank's experts after the recipe: how many whole experts it holds per MoE layer (its ep rank's slice,
    gathered over FSDP2's expert mesh), and the largest difference from the reference's rows there."""
    held, diff = set(), 0.0
    for layer, ref in zip(moe_layers(model), moe_layers(reference)):
        experts = layer.experts
        experts.unshard()
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name)
            local = p.to_local() if isinstance(p, DTensor) else p
            first = p.device_mesh.get_local_rank("ep") * local.shape[0] if isinstance(p, DTensor) else 0
            want = getattr(ref.experts, name)[first:first + local.shape[0]]
            held.add(local.shape[0])
            diff = max(diff, float((local.detach() - want.detach()).abs().max()))
        experts.reshard()
    return {"held": sorted(held), "max_abs_diff": diff}


def recorder_of(model, coef: float | None, distributed: bool = True) -> RouterRecorder:
    """The model's RouterRecorder, its aux coefficient replaced by `coef` when given (1.0: the aux loss's gradient
    large enough to show in three steps)."""
    recorder = RouterRecorder(model, distributed=distributed)
    if coef is not None:
        recorder.coef = coef
    return recorder


def case(spec: str, rung_name: str, ep: int, tp: int, lora: bool, references: dict, coef: float | None = None,
         ac: bool = False, rank0_expert_grad_scale: float = 1.0) -> dict:
    """One case against its single-process reference (trained once per model and shared by the cases)."""
    rank = dist.get_rank()
    rung = load_rung(rung_name).with_num_processes(WORLD, ep=ep if ep > 1 else None, tp=tp if tp > 1 else None)
    key = (spec, lora, coef)
    if key not in references:
        ref = build(spec, lora)
        # rank 0's figures are the ones written: the other ranks would train the same on the cores rank 0 trains on
        steps = train(ref, make_batch(), recorder_of(ref, coef, distributed=False), scale=1, tp=False) \
            if rank == 0 else None
        references[key] = (build(spec, lora), steps)  # fresh weights to compare the held experts with
    ref_model, ref_steps = references[key]
    model = build(spec, lora, rung, ac)
    experts = held_experts(model, ref_model) if ep > 1 or tp > 1 else {}
    dp = WORLD // tp
    mine = {k: v.chunk(dp)[rank // tp] for k, v in make_batch().items()}
    recorder = recorder_of(model.module if hasattr(model, "module") else model, coef)
    steps = shares_summed(train(model, mine, recorder, scale=dp, tp=tp > 1,
                                expert_grad_scale=rank0_expert_grad_scale if rank == 0 else 1.0), tp)
    return {"steps": steps, "reference": ref_steps, "experts": experts, "layout": rung.dims.describe(),
            "num_experts": moe_layers(ref_model)[0].facts.num_experts(ref_model.config), "ep": ep}


# name -> (preset, rung, ep, tp, LoRA[, the aux loss's coefficient: 1.0 makes its gradient show in two steps,
# activation checkpointing: every layer's forward, its all-to-alls included, run again in backward, a planted fault:
# rank 0's expert gradients times this after each backward]).
CASES = {
    "qwen3_moe/ddp": ("qwen3-moe-tiny", "ddp", 1, 1, False),
    "qwen3_moe/fsdp": ("qwen3-moe-tiny", "fsdp_full_shard", 1, 1, False),
    "qwen3_moe/ep2": ("qwen3-moe-tiny", "fsdp_ep", 2, 1, False),
    "qwen3_moe/ep4": ("qwen3-moe-tiny", "fsdp_ep", 4, 1, False),
    "qwen3_moe/tp2_ep2_aux1": ("qwen3-moe-tiny", "fsdp_tp", 2, 2, False, 1.0),
    "qwen3_moe/ep2_lora": ("qwen3-moe-tiny", "fsdp_ep", 2, 1, True),
    "qwen3_moe/ep4_ac": ("qwen3-moe-tiny", "fsdp_ep", 4, 1, False, None, True),
    "mixtral/ep2": ("mixtral-tiny", "fsdp_ep", 2, 1, False),
    "mixtral/ep4": ("mixtral-tiny", "fsdp_ep", 4, 1, False),
    "mixtral/tp2_ep2": ("mixtral-tiny", "fsdp_tp", 2, 2, False),
    "llama4/ep2": ("llama4-tiny", "fsdp_ep", 2, 1, False),
    "llama4/tp2_ep2_lora": ("llama4-tiny", "fsdp_tp", 2, 2, True),
    "planted/qwen3_moe/ep2_rank0_experts_x2": ("qwen3-moe-tiny", "fsdp_ep", 2, 1, False, None, False, 2.0),
}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CASES)
    results, references = {}, {}
    for name in only:
        try:
            spec, rung, ep, tp, lora, *coef = CASES[name]
            results[name] = case(spec, rung, ep, tp, lora, references, *coef)
        except Exception:  # noqa: BLE001 - recorded for the test to report
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
