"""QLoRA's frozen 4-bit base: the decoder projections as bitsandbytes NF4 layers, built on the meta device like every
other model hfdist trains, and filled shard by shard.

The format is bitsandbytes' (what `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=torch.bfloat16)` gives a transformers model): each weight's
4-bit codes (NF4, blocks of 64) packed two per byte in a bf16 tensor of shape (out x in / 4, 1), and a quantisation
state with one absmax per block, itself quantised to 8 bits in blocks of 256 around its mean (double
quantisation). Packed in bf16 the weight is one more bf16 tensor to FSDP2 (sharded on dim 0, all-gathered with the
layer's other parameters, never cast by a bf16 policy) and to DeepSpeed ZeRO-3 (partitioned like any parameter); the
quantisation state stays on the module, whole on every rank (1/64 byte per parameter). docs/qlora.md has the
evidence behind choosing it over torchao's NF4Tensor.

Two steps, the seam a caller builds on:
    quantize_meta(model)          every LoRA target Linear of the decoder layers -> a 4-bit layer on the meta device
                                  (no memory); LoRA is injected after it, as peft does on a 4-bit model
    load_quantized(model, plan)   after sharding and materialising: each rank reads only the rows its shard of a
                                  weight holds (checkpoint slices or the seeded init), quantises them, and every rank
                                  of the shard group gathers the blocks' absmax to build the one quantisation state

Quantisation is blockwise and rows hold whole blocks (in_features % 64 == 0, checked before launch), so a shard's
codes are exactly the full tensor's codes for its rows: every layout trains the same 4-bit base as one process,
and the same base `from_pretrained` with that BitsAndBytesConfig builds from a bf16 checkpoint.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch
from torch import nn

from hfdist.errors import HfdistError
from hfdist.models.load import WeightPlan, checkpoint_files, read_rows
from hfdist.models.registry import LORA_TARGETS
from hfdist.models.shape import NF4_BLOCK_SIZE, NF4_NESTED_BLOCK_SIZE

__all__ = ["QUANT_TYPE", "BLOCK_SIZE", "NESTED_BLOCK_SIZE", "STORAGE_DTYPE", "QuantizeError", "is_4bit",
           "four_bit_modules", "quantize_meta", "load_quantized", "quantize_rows", "double_quantize",
           "quant_state_tensors", "dequantized_weight", "check_quantizable"]

QUANT_TYPE = "nf4"
BLOCK_SIZE = NF4_BLOCK_SIZE  # values per absmax (bitsandbytes' default, QLoRA's)
NESTED_BLOCK_SIZE = NF4_NESTED_BLOCK_SIZE  # absmax values per second-level scale (double quantisation)
STORAGE_DTYPE = torch.bfloat16  # the packed codes' container: the dtype every other parameter is gathered in
_CODES_PER_ELEMENT = 4  # two 4-bit codes per byte, two bytes per bf16 element
_CHUNK_VALUES = 1 << 18  # values quantised at once (quantize_rows)


class QuantizeError(HfdistError, ValueError):
    """A model whose projections cannot be held as hfdist's 4-bit layers."""


def is_4bit(module: nn.Module) -> bool:
    """Whether `module` is a bitsandbytes 4-bit Linear (the frozen base of a QLoRA projection)."""
    if "bitsandbytes" not in sys.modules:  # no such layer can exist, and importing it costs a second and a warning
        return False
    from bitsandbytes.nn import Linear4bit

    return isinstance(module, Linear4bit)


def four_bit_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every 4-bit Linear in `model`."""
    return ((name, m) for name, m in model.named_modules() if is_4bit(m))


def check_quantizable(config, shard: int = 1) -> None:
    """Every decoder projection of `config` must split into whole 4-bit blocks per row and into `shard` equal row
    ranges (the ranks a sharding rung spreads each weight over): the rows a rank quantises are then exactly its
    shard of the packed weight.

    Raises:
        QuantizeError: naming the projection, its shape and the fix.
    """
    from hfdist.models.registry import facts_for

    for name, (in_features, out_features, _) in facts_for(config, "--qlora").linear_shapes(config).items():
        if in_features % BLOCK_SIZE:
            raise QuantizeError(f"--qlora quantises {name} ({out_features} x {in_features}) in blocks of {BLOCK_SIZE} "
                                f"values along each row, and {in_features} is not a multiple of {BLOCK_SIZE}. Use "
                                "--lora for this model (its base stays in full precision).")
        if out_features % shard:
            raise QuantizeError(f"--qlora shards {name} ({out_features} rows) over {shard} ranks, each quantising "
                                f"its own rows, and {out_features} is not divisible by {shard}. Use a number of "
                                f"processes whose sharding degree divides {out_features}, or --lora.")


def _linear4bit_on_meta(linear: nn.Linear) -> nn.Module:
    """A bitsandbytes Linear4bit for `linear`'s shape, its packed weight (and bias) on the meta device."""
    from bitsandbytes.nn import Linear4bit, Params4bit

    out_features, in_features = linear.out_features, linear.in_features
    q = Linear4bit(in_features, out_features, bias=linear.bias is not None, compute_dtype=None,
                   compress_statistics=True, quant_type=QUANT_TYPE, quant_storage=STORAGE_DTYPE, device="meta")
    packed = torch.empty(out_features * in_features // _CODES_PER_ELEMENT, 1, dtype=STORAGE_DTYPE, device="meta")
    q.weight = Params4bit(packed, requires_grad=False, compress_statistics=True, quant_type=QUANT_TYPE,
                          quant_storage=STORAGE_DTYPE, bnb_quantized=True, module=q)
    if linear.bias is not None:
        q.bias = linear.bias
    q.quant_state = _meta_quant_state(out_features, in_features)
    # On a CPU with AVX512-BF16, bitsandbytes repacks a weight in place for its bf16 inference kernel the first time
    # the layer runs in eval mode without grad (hfdist scores its check batch so): the repacked weight would replace
    # FSDP2's gathered parameter and compute in bf16 whatever the run's precision. Off: one path, train and eval.
    q.support_avx512bf16_for_cpu = False
    return q


def _meta_quant_state(out_features: int, in_features: int):
    """A quantisation state shaped as `load_quantized` makes it, on the meta device: what a simulated rank holds and
    what the strategy check reads before the real one replaces it."""
    import bitsandbytes.functional as bnbf

    blocks = -(-out_features * in_features // BLOCK_SIZE)
    meta = torch.device("meta")
    nested = bnbf.QuantState(absmax=torch.empty(-(-blocks // NESTED_BLOCK_SIZE), device=meta),
                             code=torch.empty(256, device=meta), blocksize=NESTED_BLOCK_SIZE, dtype=torch.float32)
    return bnbf.QuantState(absmax=torch.empty(blocks, dtype=torch.uint8, device=meta),
                           shape=torch.Size((out_features, in_features)), code=torch.empty(16, device=meta),
                           blocksize=BLOCK_SIZE, quant_type=QUANT_TYPE, dtype=STORAGE_DTYPE,
                           offset=torch.empty((), device=meta), state2=nested)


def quantize_meta(model: nn.Module) -> nn.Module:
    """Replace every LoRA target projection (hfdist.models.registry.LORA_TARGETS) of `model`'s decoder layers with a
    4-bit layer on the meta device, in place; returns `model`. Call it before LoRA is injected (peft then wraps the
    4-bit layers with its own LoRA layers for them, as on any 4-bit model)."""
    targets = set(LORA_TARGETS)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if child_name in targets and type(child) is nn.Linear:
                setattr(parent, child_name, _linear4bit_on_meta(child))
    # transformers' own mark of a bitsandbytes 4-bit model: peft reads it to wrap the 4-bit layers with its 4-bit
    # LoRA layers (the ones `PeftModel.from_pretrained` builds on a 4-bit base), not its generic Linear.
    model.is_loaded_in_4bit = True
    return model


def quantize_rows(values: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes as a (numel / 4, 1) bf16 tensor, fp32 absmax per block) of a (rows, in_features) tensor,
    quantised as bf16 values (the dtype checkpoints ship in), into `out` when given.

    A few rows at a time: bitsandbytes' CPU quantiser makes fp32 temporaries of ~20 bytes per value, which for a
    whole 70B projection would be gigabytes; in chunks of _CHUNK_VALUES they stay a few megabytes, freed (and, in
    the loader's allocator window, returned to the OS) before the next chunk.
    """
    import bitsandbytes  # noqa: F401 (registers torch.ops.bitsandbytes)

    rows, cols = values.shape
    per_row = cols // _CODES_PER_ELEMENT
    out = torch.empty(rows * per_row, 1, dtype=STORAGE_DTYPE, device=values.device) if out is None else out
    absmax = torch.empty(rows * cols // BLOCK_SIZE, dtype=torch.float32, device=values.device)
    step = max(1, _CHUNK_VALUES // cols)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        chunk = values[start:stop].to(STORAGE_DTYPE).contiguous()
        packed, block_absmax = torch.ops.bitsandbytes.quantize_4bit.default(chunk, BLOCK_SIZE, QUANT_TYPE,
                                                                            STORAGE_DTYPE)
        out[start * per_row:stop * per_row].copy_(packed)
        absmax[start * cols // BLOCK_SIZE:stop * cols // BLOCK_SIZE].copy_(block_absmax)
        del chunk, packed, block_absmax
    return out, absmax


def double_quantize(absmax: torch.Tensor, shape: tuple[int, int]):
    """The quantisation state of a whole weight of `shape` from all its blocks' absmax (in row order): the absmax
    quantised to 8 bits in blocks of 256 around their mean, as bitsandbytes' `quantize_4bit(...,
    compress_statistics=True)` does on the full tensor."""
    import bitsandbytes.functional as bnbf

    offset = absmax.mean()
    nested, nested_state = bnbf.quantize_blockwise(absmax - offset, blocksize=NESTED_BLOCK_SIZE)
    return bnbf.QuantState(absmax=nested, shape=torch.Size(shape), dtype=STORAGE_DTYPE, blocksize=BLOCK_SIZE,
                           code=bnbf.get_4bit_type(QUANT_TYPE, device=absmax.device), quant_type=QUANT_TYPE,
                           offset=offset, state2=nested_state)


def _rows_held(weight: torch.Tensor, out_features: int, in_features: int) -> tuple[slice, object]:
    """(rows of the full weight this rank's piece of the packed `weight` holds, the process group sharding it or
    None): a DTensor's local chunk (FSDP2 Shard(0), replicated over any other mesh axis), else everything."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor):
        return slice(0, out_features), None
    (chunk,) = weight.__create_chunk_list__()
    per_row = in_features // _CODES_PER_ELEMENT
    start, length = chunk.offsets[0], chunk.sizes[0]
    if start % per_row or length % per_row:
        raise QuantizeError(f"a 4-bit weight of {out_features} x {in_features} is sharded into pieces that do not "
                            "hold whole rows; check_quantizable should have refused this layout before launch")
    sharded = [i for i, p in enumerate(weight.placements) if isinstance(p, Shard)]
    group = weight.device_mesh.get_group(sharded[0]) if sharded else None
    return slice(start // per_row, (start + length) // per_row), group


def _gather_rows_absmax(absmax: torch.Tensor, group) -> torch.Tensor:
    """Every shard's absmax, in shard (= row) order: the whole weight's."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return absmax
    parts = [torch.empty_like(absmax) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, absmax.contiguous(), group=group)
    return torch.cat(parts)


@torch.no_grad()
def load_quantized(model: nn.Module, plan: WeightPlan, rename=None, device: torch.device | None = None) -> None:
    """Fill the 4-bit layers of `model` (materialised: plain packed weights, or FSDP2's DTensor shards) from `plan`,
    each rank quantising only the rows it keeps. Collective over each weight's shard group (one all-gather of its
    absmax per weight, in the same order on every rank); no communication where nothing is sharded.

    Args:
        rename: maps a name in `model` to the full model's (a pipeline stage's), or None.
        device: where the layers compute: the rows are quantised there and the quantisation states live there
            (default: each weight's own device; FSDP2's CPU offload keeps the shards in host memory, not the states).
    """
    from bitsandbytes.nn import Params4bit
    from torch.distributed.tensor import DTensor

    files = checkpoint_files(plan)
    for name, module in four_bit_modules(model):
        full_name = f"{name}.weight"
        source = plan.tensors[rename(full_name) if rename else full_name]
        out_features, in_features = module.out_features, module.in_features
        weight = module.weight
        rows, group = _rows_held(weight, out_features, in_features)
        local = weight.to_local() if isinstance(weight, DTensor) else None
        values = read_rows(source, plan, files, rows).to(device or weight.device)
        packed, absmax = quantize_rows(values, out=local)
        del values
        state = double_quantize(_gather_rows_absmax(absmax, group), (out_features, in_features))
        if local is None:
            module.weight = Params4bit(packed, requires_grad=False, quant_state=state,
                                       compress_statistics=True, quant_type=QUANT_TYPE, quant_storage=STORAGE_DTYPE,
                                       bnb_quantized=True, module=module)
        module.quant_state = state


def quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors of every 4-bit layer's quantisation state (absmax, second-level scales, code books, offset): what a
    rank holds of the base beyond its packed weights."""
    out = []
    for _, module in four_bit_modules(model):
        state = getattr(module, "quant_state", None)
        nested = getattr(state, "state2", None)
        for s in (state, nested):
            if s is not None:
                out += [t for t in (s.absmax, s.code, getattr(s, "offset", None)) if torch.is_tensor(t)]
    return out


def dequantized_weight(packed: torch.Tensor, state) -> torch.Tensor:
    """The bf16 weight a 4-bit layer computes with: its full packed codes dequantised with its quantisation state."""
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(packed, state)
