"""Context parallelism (cp): every rank of a cp group holds 1/cp of each sequence's tokens, and attention over the
whole sequence stays exact, with packed documents kept apart.

The method is Ulysses (DeepSpeed-Ulysses' all-to-all over heads), registered with transformers' AttentionInterface
so the HF model itself runs unchanged around it:

    rank c holds tokens [c*S/cp, (c+1)*S/cp) of every row: embedding, RoPE (from its own position ids), MLPs, norms,
    lm_head and loss all run on those tokens only.
    in each attention layer:  q, k, v (B, heads, S/cp, D)  --all-to-all-->  (B, heads/cp, S, D)
                              the run's attention over the full sequence, each packed document on its own: by
                              the whole rows' document boundaries (cu_seq_lens, O(documents), built by the
                              collator before the rows were cut) under hfdist_documents / flash varlen, or by the
                              dense (B, 1, S, S) mask under the explicit sdpa / eager choice
                              (B, S, heads/cp, D)  --all-to-all-->  (B, S/cp, heads, D)

Why Ulysses rather than ring attention: each rank computes ordinary attention over the whole sequence for a
slice of the heads, so it is the same arithmetic as one process (exact to rounding), the documents' boundaries apply
unchanged (a ring would have to cut every document into per-step blocks and merge partial softmaxes), every
rank does equal work without zig-zag reordering (each one attends the full sequence), and it costs two all-to-alls
of q/k/v/out per layer whose volume shrinks with cp. Its limit is the head count: heads must divide by cp (x tp).
Grouped-query attention with fewer kv heads than cp is handled by repeating each kv head just enough times
(lcm(kv_heads, cp) heads in all) before the exchange; the backward of that repeat sums the gradients back.

The label shift happens on the whole row before it is cut (`shard_batch`), so the token at the end of one rank's
chunk still predicts the first token of the next rank's chunk; the loss is a sum over local tokens divided by the
global count of label tokens (the Trainer's num_items_in_batch), and FSDP2 shards and averages gradients over
dp_shard x cp (hfdist.parallel.parallelize).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hfdist.parallel.context_check import ContextParallelError, check_cp, kv_repeats

__all__ = ["ContextParallelError", "CP_ATTENTION", "check_cp", "kv_repeats", "shard_batch", "apply_cp",
           "cp_group_of"]

CP_ATTENTION = "hfdist_ulysses"
_SHARDED_KEYS = ("input_ids", "position_ids")


def shard_batch(batch: dict[str, Any], rank: int, cp: int) -> dict[str, Any]:
    """This cp rank's part of a collated batch: labels shifted on the whole row first (as HF's causal-LM loss
    would), then input_ids, position_ids and the shifted labels cut into cp contiguous chunks along the sequence.
    The attention inputs (the documents' varlen boundaries; the 4-D mask only under the explicit sdpa / eager
    choice) stay whole: attention runs over the full sequence after the all-to-all. The model gets the chunk as `labels` and `shift_labels` (HF's loss then
    uses it as given, not shifting again) and no KV cache."""
    seq = batch["input_ids"].shape[1]
    if seq % cp:
        raise ContextParallelError(f"A batch of {seq} tokens per row cannot be cut into cp={cp} equal chunks; "
                                   f"use a --seq-len that is a multiple of {cp}.")
    chunk = seq // cp
    out = dict(batch)
    for key in _SHARDED_KEYS:
        if key in batch:
            out[key] = batch[key].narrow(1, rank * chunk, chunk).contiguous()
    if "labels" in batch:
        shifted = nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        out["labels"] = out["shift_labels"] = shifted.narrow(1, rank * chunk, chunk).contiguous()
    out["use_cache"] = False
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (equal splits); its backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    # Both buffers contiguous: all_to_all_single reads and writes memory in order (empty_like would keep a
    # permuted input's strides, and the received chunks would land transposed).
    x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x, group=group)
    return out


def _heads_to_ranks(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(B, H, S/cp, D) on each rank -> (B, H/cp, S, D): rank c keeps head group c for the whole sequence."""
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)  # (cp: head group, B, H/cp, S/cp, D)
    got = _AllToAll.apply(send, group)  # (cp: sequence chunk, B, H/cp, S/cp, D)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _sequence_to_ranks(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(B, S, H/cp, D) attention output -> (B, S/cp, H, D): rank c gets its own sequence chunk, every head."""
    b, s, h, d = x.shape
    send = x.reshape(b, cp, s // cp, h, d).transpose(0, 1)  # (cp: sequence chunk, B, S/cp, H/cp, D)
    got = _AllToAll.apply(send, group)  # (cp: head group, B, S/cp, H/cp, D)
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // cp, cp * h, d)


class _AdditiveMask:
    """sdpa turns a boolean mask into an additive one of the query's dtype in every call and saves that copy for
    backward: (layers) x seq x seq x 4 bytes per rank for the packed rows' block mask, the part of the activations
    cp cannot divide (measured: results/cpu-2core/context_parallel.md). Converting it once per forward and handing
    every layer the same tensor keeps one copy (sdpa saves the tensor it is given). Both the boolean mask and its
    additive copy are held weakly: the copy lives exactly as long as autograd keeps it."""

    def __init__(self) -> None:
        self._source: weakref.ref | None = None
        self._additive: weakref.ref | None = None

    def __call__(self, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        if mask is None or mask.dtype != torch.bool:
            return mask
        additive = self._additive() if self._additive is not None else None
        if additive is None or self._source() is not mask or additive.dtype != dtype:
            additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            additive.masked_fill_(~mask, torch.finfo(dtype).min)
            self._source, self._additive = weakref.ref(mask), weakref.ref(additive)
        return additive


_ADDITIVE_MASK = _AdditiveMask()


class _GroupedView:
    """The attention module as the base attention function sees it after the exchange: the same module, with the
    query heads per kv head this rank really holds (it differs from the model's when kv heads were repeated)."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function (AttentionInterface) for a sequence sharded over the cp group: see the
    module docstring. The group, degree and base implementation are the module's `hfdist_cp` (set by apply_cp)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    group, cp, base = module.hfdist_cp
    repeats = kv_repeats(key.shape[1], cp)
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    query, key, value = (_heads_to_ranks(t, group, cp) for t in (query, key, value))
    view = _GroupedView(module, query.shape[1] // key.shape[1])
    # "eager" is no registered function: each modeling file has its own eager_attention_forward.
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(base, eager)
    if base == "sdpa":
        attention_mask = _ADDITIVE_MASK(attention_mask, query.dtype)
    out, _ = attend(view, query, key, value, attention_mask, **kwargs)
    return _sequence_to_ranks(out, group, cp), None


def cp_group_of(model: nn.Module):
    """The cp process group a model's attention exchanges over (None when apply_cp was not applied)."""
    for module in model.modules():
        spec = getattr(module, "hfdist_cp", None)
        if spec is not None:
            return spec[0]
    return None


def apply_cp(model: nn.Module, cp_mesh, tp: int = 1) -> None:
    """Make every attention layer of `model` attend over a sequence sharded across `cp_mesh` (Ulysses).

    The model's attention implementation (hfdist_documents, flash varlen, sdpa or eager) still computes the
    attention, on the full sequence and a slice of the heads; its name moves to `config._attn_implementation` =
    CP_ATTENTION.

    Args:
        tp: the tensor-parallel degree applied before (each rank's attention then holds heads / tp).

    Raises:
        ContextParallelError: heads not divisible by the cp degree, no attention layer found, or flex attention
            (its BlockMask is built per chunk by the model, never for the gathered sequence).
    """
    from transformers import AttentionInterface

    cp = cp_mesh.size()
    base_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base_model.config
    check_cp(config, cp, tp=tp)
    base = config._attn_implementation or "sdpa"
    if base == CP_ATTENTION:
        raise ContextParallelError("apply_cp was applied twice to one model.")
    if base == "flex_attention":
        raise ContextParallelError("Context parallelism cannot keep packed documents apart under flex_attention: "
                                   "the gathered sequence gets no BlockMask. Use --attn-implementation auto.")
    AttentionInterface.register(CP_ATTENTION, ulysses_attention)
    layers = [m for name, m in base_model.named_modules() if name.endswith("self_attn")]
    if not layers:
        raise ContextParallelError(f"{type(base_model).__name__} has no `self_attn` modules for context parallelism.")
    spec = (cp_mesh.get_group(), cp, base)
    for layer in layers:
        layer.hfdist_cp = spec
    config._attn_implementation = CP_ATTENTION

