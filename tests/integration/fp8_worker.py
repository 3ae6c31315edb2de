"""Worker for tests/integration/test_fp8_parallel.py: `torchrun --nproc-per-node 2 tests/integration/fp8_worker.py
OUT.json`.

One launch, two gloo ranks, llama-tiny built by hfdist's recipe (hfdist.parallel.parallelize with --fp8), one
forward + backward of the same batch on every rank, compared with one process's float8 model on that batch:

- "linear/<recipe>/<split>[/emulated][/local_scales]": one torchao Float8Linear (with a bias) split over tp = 2 by
  hfdist's LocalLinear style (column split: output gathered; row split: reduced to a replicated output) against the
  same linear in one process: output, input gradient and weight gradient. "emulated" runs torchao's fp32-output
  emulation of the float8 matmul: its partial sums are exact in fp32, so the split linear must equal the whole one;
  the hardware kernel (torch._scaled_mm) writes rowwise outputs in bf16, so a row split's partial sums differ from
  the whole sum by bf16 rounding. "local_scales" (tensorwise) switches the tp reduction of the scales off: the
  computation the rule exists to avoid.
- "tp/<recipe>": llama-tiny at tp = 2 (one data-parallel rank, so no float8 all-gather): the loss of one forward
  against one process's float8 model. (Gradients of a whole float8 model are not compared: float8 rounding turns
  any last-bit difference of a partial sum into whole quantisation steps downstream, ~5% of a gradient.)
- "fsdp/<precision>/<recipe or none>": FSDP2 over dp_shard = 2, the bytes every all-gather of the step (forward and
  backward) returned on rank 0, measured with a CommDebugMode that adds up the gathered tensors, by dtype; the
  float8 record; with tensorwise, the loss and gradients against one process.

Rank 0 writes OUT.json; cases that raise record their error instead of aborting the launch.
"""

from __future__ import annotations

import json
import sys
import traceback
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

MODEL = "llama-tiny"


class GatheredBytes(CommDebugMode):
    """CommDebugMode that also adds up the bytes every all-gather returns on this rank, by dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.gathered: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c10d = torch.ops.c10d
        if getattr(func, "_overloadpacket", None) in (c10d._allgather_base_, c10d.allgather_into_tensor_coalesced_):
            outputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            for t in outputs:
                key = str(t.dtype).removeprefix("torch.")
                self.gathered[key] = self.gathered.get(key, 0) + t.numel() * t.element_size()
        return super().__torch_dispatch__(func, types, args, kwargs)


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def reference(recipe: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One process's float8 model: the loss of the batch and every gradient."""
    from hfdist.models.build import build_model
    from hfdist.parallel.float8 import convert_to_float8
    from hfdist.parallel.tensor import tp_causal_lm_loss

    model = build_model(MODEL)
    convert_to_float8(model, recipe)
    loss = tp_causal_lm_loss(model, batch())
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def distributed(rung_name: str, tp: int, mixed: str, recipe: str | None, count: bool):
    """hfdist's recipe for the rung on 2 ranks: (loss, gradients as full tensors, gathered bytes, float8 record)."""
    from torch.distributed.tensor.parallel import loss_parallel

    from hfdist.config.ladder import load_rung
    from hfdist.models.build import meta_model
    from hfdist.models.load import weight_plan
    from hfdist.parallel.float8 import float8_record, precompute_scales
    from hfdist.parallel.parallelize import parallelize
    from hfdist.parallel.tensor import tp_causal_lm_loss

    rung = load_rung(rung_name).with_num_processes(2, tp=tp)
    skeleton = meta_model(MODEL)
    model = parallelize(skeleton, rung, device=torch.device("cpu"), mixed_precision=mixed,
                        activation_checkpointing=False, fp8=recipe, weights=weight_plan(skeleton, None, 0))
    if recipe is not None:
        precompute_scales(model)  # as Float8ScalesCallback does before the first step
    mode = GatheredBytes() if count else nullcontext()
    with mode, loss_parallel() if tp > 1 else nullcontext():
        loss = tp_causal_lm_loss(model, batch())
        loss.backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
    return loss.item(), grads, getattr(mode, "gathered", None), float8_record(model)


def compare(loss: float, grads: dict, ref_loss: float, ref_grads: dict) -> dict[str, float]:
    """Relative differences from the reference: the loss's, and the largest of any gradient's (against its norm)."""
    worst = max(((g.float() - ref_grads[n]).norm() / ref_grads[n].norm()).item() for n, g in grads.items())
    return {"loss": loss, "ref_loss": ref_loss, "loss_rel": abs(loss / ref_loss - 1), "grad_rel": worst}


def split_linear(recipe: str, split: int, emulated: bool, local_scales: bool) -> dict[str, float]:
    """A float8 linear split over the 2 ranks by LocalLinear, against the whole one (module docstring)."""
    from dataclasses import replace

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    import hfdist.parallel.float8_tp as float8_tp
    from hfdist.parallel.tensor_styles import LocalLinear, PartialGradReducer

    mesh, rank = init_device_mesh("cpu", (2,)), dist.get_rank()
    config = replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulated)

    def linear() -> torch.nn.Module:
        torch.manual_seed(0)
        return convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(64, 48)), config=config)

    torch.manual_seed(1)
    x = torch.randn(2, 16, 64)
    grad = torch.randn(2, 16, 48)
    whole, x_whole = linear(), x.clone().requires_grad_()
    out = whole(x_whole)
    out.backward(grad)
    style = LocalLinear(split=0) if split == 0 else LocalLinear(split=1, reduce_to=Replicate(),
                                                               reducer=PartialGradReducer())
    part = parallelize_module(linear(), mesh, {"0": style})
    x_part = (x if split == 0 else x.chunk(2, -1)[rank]).clone().requires_grad_()
    rule = float8_tp._amax_over_tp
    if local_scales:
        float8_tp._amax_over_tp = lambda *args: False
    try:
        out_part = part(x_part)
        out_part.backward(grad.chunk(2, -1)[rank] if split == 0 else grad)
    finally:
        float8_tp._amax_over_tp = rule
    gathered = [torch.empty_like(out_part) for _ in range(2)]
    if split == 0:  # each rank holds its out-features; its input gradient is a share of the sum
        dist.all_gather(gathered, out_part.detach())
        out_part = torch.cat(gathered, -1)
        x_grad = x_part.grad.clone()
        dist.all_reduce(x_grad)
    else:  # each rank holds its in-features' slice of the input
        dist.all_gather(gathered := [torch.empty_like(x_part) for _ in range(2)], x_part.grad)
        x_grad = torch.cat(gathered, -1)
    weight = part[0].weight.grad.full_tensor()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    return {"out": rel(out_part, out), "x_grad": rel(x_grad, x_whole.grad), "w_grad": rel(weight, whole[0].weight.grad)}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    results: dict[str, dict] = {}

    def case(name: str, fn) -> None:
        try:
            results[name] = fn()
        except Exception as exc:  # recorded for the test to report
            results[name] = {"error": repr(exc), "trace": traceback.format_exc()}

    # Rowwise scales are powers of two, which shift exponents without changing the rounding: scales from part of a
    # row give the same float8 values on random data, so only tensorwise shows what local scales would do.
    linear_cases = [(recipe, emulated, False) for recipe in ("tensorwise", "rowwise") for emulated in (True, False)]
    for recipe, emulated, local in [*linear_cases, ("tensorwise", True, True)]:
        for split, where in ((0, "column"), (1, "row")):
            name = f"linear/{recipe}/{where}" + "/emulated" * emulated + "/local_scales" * local
            case(name, lambda r=recipe, s=split, e=emulated, lo=local: split_linear(r, s, e, lo))
    refs = {recipe: reference(recipe) for recipe in ("tensorwise", "rowwise")}
    for recipe in ("tensorwise", "rowwise"):
        case(f"tp/{recipe}", lambda r=recipe: compare(*distributed("fsdp_tp", 2, "no", r, False)[:2], *refs[r]))

    def fsdp(mixed: str, recipe: str | None) -> dict:
        loss, grads, gathered, record = distributed("fsdp_full_shard", 1, mixed, recipe, True)
        found = {"gathered": gathered, "gathered_bytes": sum(gathered.values()), "record": record}
        if recipe == "tensorwise" and mixed == "no":
            found.update(compare(loss, grads, *refs[recipe]))
        return found

    for mixed in ("no", "bf16"):
        for recipe in (None, "tensorwise", "rowwise"):
            case(f"fsdp/{mixed}/{recipe}", lambda m=mixed, r=recipe: fsdp(m, r))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
