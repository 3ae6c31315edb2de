"""One rank of the 4-bit implementation comparison (benchmarks/bench_qlora.py): torchao's NF4Tensor and
bitsandbytes' Params4bit (bf16 storage), each as the frozen base of a small LoRA stack, under FSDP2, DDP and DeepSpeed
ZeRO-3 on gloo; every rank writes whether training ran, its loss and adapter gradient against the unsharded model's,
and the bytes of the 4-bit base it holds.

    torchrun --nproc-per-node 2 benchmarks/qlora_impl_worker.py IMPL STRATEGY OUT.json
    IMPL: torchao | bnb      STRATEGY: fsdp2 | fsdp2_bf16 | ddp | zero3
"""

from __future__ import annotations

import json
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

IN, OUT, RANK = 256, 512, 8


def four_bit(weight: torch.Tensor, impl: str) -> nn.Module:
    """A frozen Linear whose weight is `weight` (bf16) in 4-bit NF4 by `impl`."""
    if impl == "torchao":
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        layer.weight = nn.Parameter(to_nf4(weight), requires_grad=False)
        return layer
    from bitsandbytes.nn import Linear4bit, Params4bit

    layer = Linear4bit(weight.shape[1], weight.shape[0], bias=False, quant_type="nf4", quant_storage=torch.bfloat16)
    layer.weight = Params4bit(weight, requires_grad=False, quant_type="nf4", quant_storage=torch.bfloat16,
                              compress_statistics=True, module=layer)
    layer.weight._quantize("cpu")
    return layer


class Block(nn.Module):
    """A 4-bit projection with a LoRA adapter, then a second 4-bit projection back (backward crosses both)."""

    def __init__(self, up: torch.Tensor, down: torch.Tensor, impl: str):
        super().__init__()
        self.up, self.down = four_bit(up, impl), four_bit(down, impl)
        self.lora_a, self.lora_b = nn.Linear(IN, RANK, bias=False), nn.Linear(RANK, OUT, bias=False)
        generator = torch.Generator().manual_seed(1)
        for p in (self.lora_a.weight, self.lora_b.weight):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)

    def forward(self, x):
        return self.down(self.up(x) + self.lora_b(self.lora_a(x)))


def build(impl: str) -> nn.Module:
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(OUT, IN, generator=generator) * 0.02).to(torch.bfloat16),
               (torch.randn(IN, OUT, generator=generator) * 0.02).to(torch.bfloat16)]
    return nn.Sequential(Block(*weights, impl), Block(*weights, impl))


def base_bytes(model: nn.Module) -> int:
    """Bytes of the 4-bit weights this rank holds: local shard or ZeRO partition, NF4Tensor's inner tensors, and
    bitsandbytes' quantisation state (kept on the module, whole)."""
    total, seen = 0, set()

    def add(t):
        nonlocal total
        if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()

    for m in model.modules():
        for name in ("up", "down"):
            layer = getattr(m, name, None)
            if layer is None:
                continue
            w = getattr(layer.weight, "ds_tensor", None)
            w = w if w is not None else getattr(layer.weight, "_local_tensor", layer.weight)
            inner = [getattr(w, a) for a in ("quantized_data", "quantized_scalers", "quantization_factor")
                     if hasattr(w, a)]
            for t in inner or [w]:
                add(t)
            state = getattr(layer, "quant_state", None)
            for s in (state, getattr(state, "state2", None)):
                if s is not None:
                    for t in (s.absmax, s.code, getattr(s, "offset", None)):
                        add(t)
    return total


def run(impl: str, strategy: str) -> dict:
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(2))
    reference = build(impl)
    ref_loss = reference(x).float().square().mean()
    ref_loss.backward()
    ref_grad = reference[0].lora_a.weight.grad
    model = build(impl)
    if strategy.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if strategy == "fsdp2_bf16" else MixedPrecisionPolicy()
        for block in model:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        wrapped = fully_shard(model, mesh=mesh, mp_policy=policy)
    elif strategy == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
        wrapped, *_ = deepspeed.initialize(model=model, config=config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    held = base_bytes(model)
    loss = wrapped(x).float().square().mean()
    if strategy == "zero3":
        wrapped.backward(loss)
        from deepspeed.utils import safe_get_full_grad

        grad = safe_get_full_grad(model[0].lora_a.weight)
    else:
        loss.backward()
        grad = model[0].lora_a.weight.grad
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    for _ in range(2):  # a few more steps: the gathers and frees repeat without error
        more = wrapped(x).float().square().mean()
        wrapped.backward(more) if strategy == "zero3" else more.backward()
    return {"ran": True, "loss": loss.item(), "reference_loss": ref_loss.item(),
            "loss_rel_diff": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "grad_max_abs_diff": (grad.float() - ref_grad).abs().max().item(), "base_bytes": held,
            "unsharded_base_bytes": base_bytes(reference)}


def main() -> int:
    impl, strategy, out = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    try:
        result = run(impl, strategy)
    except Exception as exc:  # the comparison records a failure as a result
        result = {"ran": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                  "where": traceback.format_exc().splitlines()[-3][:300]}
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"impl": impl, "strategy": strategy, "ranks": results}, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
