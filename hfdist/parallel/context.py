"""Context parallelism (cp): every rank of a cp group holds 1/cp of each sequence's tokens, and attention over the
whole sequence stays exact, with packed documents kept apart.

Three methods (hfdist.parallel.context_check.plan_cp chooses, `--cp-method`), one attention function registered
with transformers' AttentionInterface under the method's name (CP_ATTENTIONS), so the HF model runs unchanged
around it. Embedding, RoPE (from each token's own position id), MLPs, norms, lm_head and loss run on the rank's
tokens only; in each attention layer:

    ulysses:  q, k, v (B, heads, S/cp, D)  --all-to-all-->  (B, heads/cp, S, D)
              the run's attention over the full sequence, each packed document on its own: by the whole rows'
              document boundaries (cu_seq_lens, O(documents), built by the collator before the rows were cut)
              under hfdist_documents / flash varlen, or by the dense (B, 1, S, S) mask under the explicit sdpa /
              eager choice
              (B, S, heads/cp, D)  --all-to-all-->  (B, S/cp, heads, D)
    ring:     q, k, v stay on the rank (its head-tail share of every row, hfdist.parallel.ring_layout); keys and
              values travel around the cp ring, each block pair attends within documents by global positions,
              merged by log-sum-exp (hfdist.parallel.ring_attention). Any head count.
    hybrid:   Ulysses inside each group of `ulysses` consecutive cp ranks (heads), ring across the cp / ulysses
              groups (on the group's gathered share).

Ulysses is the same arithmetic as one process (every rank attends whole documents of the whole sequence for a slice
of the heads) and needs cp (x tp) to divide the heads; grouped-query attention with fewer kv heads than its degree
repeats each kv head just enough times (lcm(kv_heads, degree) heads in all), the repeat's backward summing the
gradients back. The ring splits documents into per-step pieces and merges partial softmaxes, exactly; it needs the
batch's document boundaries (the attention implementations that take them: hfdist_documents, flash varlen).

The label shift happens on the whole row before it is cut (`shard_batch`), so the token before a cut still predicts
the one after it; the loss is a sum over local tokens divided by the global count of label tokens (the Trainer's
num_items_in_batch), and FSDP2 shards and averages gradients over dp_shard x cp (hfdist.parallel.parallelize).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hfdist.models.kv_heads import repeat_kv_heads
from hfdist.parallel.context_check import ContextParallelError, CpPlan, check_cp, check_cp_attention, kv_repeats
from hfdist.parallel.ring_layout import rank_ranges

__all__ = ["ContextParallelError", "CP_ATTENTIONS", "CpPlan", "CpSpec", "check_cp", "kv_repeats", "token_index",
           "shard_batch", "apply_cp", "cp_spec_of", "cp_group_of"]

# The attention implementation name the model's config carries under each method (what `verify` checks).
CP_ATTENTIONS = {"ulysses": "hfdist_ulysses", "ring": "hfdist_ring", "hybrid": "hfdist_hybrid"}
_SHARDED_KEYS = ("input_ids", "position_ids")


def token_index(seq: int, plan: CpPlan, rank: int, device=None) -> torch.Tensor:
    """The positions of a row of `seq` tokens cp rank `rank` holds, in its local order
    (hfdist.parallel.ring_layout.rank_ranges: contiguous under Ulysses, head-tail chunks under a ring).

    Raises:
        ContextParallelError: a length the plan cannot cut evenly.
    """
    if seq % plan.seq_multiple:
        raise ContextParallelError(f"A batch of {seq} tokens per row cannot be cut for {plan.method} context "
                                   f"parallelism (cp={plan.cp}); use a --seq-len that is a multiple of "
                                   f"{plan.seq_multiple}.")
    return torch.cat([torch.arange(a, b, device=device) for a, b in rank_ranges(seq, plan.cp, plan.ulysses, rank)])


def shard_batch(batch: dict[str, Any], rank: int, plan: CpPlan, row_positions: bool = False) -> dict[str, Any]:
    """This cp rank's part of a collated batch: labels shifted on the whole row first (as HF's causal-LM loss
    would), then input_ids, position_ids and the shifted labels cut to the rank's tokens (`token_index`). The
    attention inputs (the documents' varlen boundaries; the 4-D mask only under the explicit sdpa / eager choice)
    stay whole: they describe the whole rows, which the attention reads. The model gets the cut as `labels` and
    `shift_labels` (HF's loss then uses it as given, not shifting again) and no KV cache.

    Args:
        row_positions: also pass the whole rows' position ids as `row_position_ids` (pipeline stages rebuild each
            micro-batch's document boundaries from them).
    """
    index = token_index(batch["input_ids"].shape[1], plan, rank, batch["input_ids"].device)
    out = dict(batch)
    for key in _SHARDED_KEYS:
        if key in batch:
            out[key] = batch[key].index_select(1, index)
    if "labels" in batch:
        shifted = nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        out["labels"] = out["shift_labels"] = shifted.index_select(1, index)
    if row_positions:
        out["row_position_ids"] = batch["position_ids"]
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


@dataclass
class CpSpec:
    """What every attention layer of a cp model carries (`hfdist_cp`): the groups, the plan, the base attention.

    Attributes:
        group: the whole cp group.
        plan: the method and its degrees.
        base: the run's attention implementation: Ulysses computes with it, the ring reads the boundaries the batch
            carries for it.
        ulysses_group: the all-to-all group of this rank (None without Ulysses).
        ring_group: the ring of this rank (None without a ring); `member` its index there.
    """

    group: Any
    plan: CpPlan
    base: str
    ulysses_group: Any = None
    ring_group: Any = None
    member: int = 0
    _segments: tuple = field(default=(None, None, None), repr=False)

    def ring_blocks(self, cu_seq_lens: torch.Tensor, rows: int, seq: int, scale: float, device: torch.device):
        """hfdist.parallel.ring_attention.RingBlocks for a batch's boundaries; the segments are computed once per
        boundaries tensor (every layer of a forward gets the same one) and kept while it lives."""
        from hfdist.parallel.ring_attention import RingBlocks
        from hfdist.parallel.ring_kernels import kernel_for
        from hfdist.parallel.ring_layout import ring_segments

        source, key, segments = self._segments
        if source is None or source() is not cu_seq_lens or key != (rows, seq):
            segments = ring_segments(cu_seq_lens.tolist(), rows, seq, self.plan.ring, self.member)
            self._segments = (weakref.ref(cu_seq_lens), (rows, seq), segments)
        return RingBlocks(self.ring_group, self.member, segments, kernel_for(device), scale)


def _ring(module: nn.Module, spec: CpSpec, query, key, value, kwargs: dict[str, Any]) -> torch.Tensor:
    """The ring step of ring / hybrid attention on this rank's (gathered) share: (B, S', H', D) out."""
    from hfdist.parallel.ring_attention import ring_attention

    if kwargs.get("dropout") or kwargs.get("softcap") or kwargs.get("sliding_window"):
        raise ContextParallelError("Ring attention runs without attention dropout, softcapping or sliding windows "
                                   "(none of which it implements); use --cp-method ulysses for this model.")
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise ContextParallelError(
            "Ring context parallelism attends each packed document from the whole rows' boundaries, and this batch "
            "carries none (cu_seq_lens_q): collate it with hfdist.data.collation for an attention implementation "
            "that takes boundaries (hfdist_documents, flash varlen).")
    scale = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    blocks = spec.ring_blocks(cu, query.shape[0], query.shape[2] * spec.plan.ring, float(scale), query.device)
    return ring_attention(query, key, value, blocks)


def cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function (AttentionInterface) for a sequence sharded over the cp group: see the
    module docstring. The method, groups and base implementation are the module's `hfdist_cp` (set by apply_cp)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    spec: CpSpec = module.hfdist_cp
    u = spec.plan.ulysses
    if u > 1:
        repeats = kv_repeats(key.shape[1], u)
        key, value = repeat_kv_heads(key, repeats), repeat_kv_heads(value, repeats)
        query, key, value = (_heads_to_ranks(t, spec.ulysses_group, u) for t in (query, key, value))
    if spec.plan.ring > 1:
        out = _ring(module, spec, query, key, value, kwargs)
    else:
        view = _GroupedView(module, query.shape[1] // key.shape[1])
        # "eager" is no registered function: each modeling file has its own eager_attention_forward.
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(spec.base, eager)
        if spec.base == "sdpa":
            attention_mask = _ADDITIVE_MASK(attention_mask, query.dtype)
        out, _ = attend(view, query, key, value, attention_mask, **kwargs)
    return (_sequence_to_ranks(out, spec.ulysses_group, u) if u > 1 else out), None


def cp_spec_of(model: nn.Module) -> CpSpec | None:
    """The CpSpec a model's attention layers carry (None when apply_cp was not applied)."""
    return next((m.hfdist_cp for m in model.modules() if getattr(m, "hfdist_cp", None) is not None), None)


def cp_group_of(model: nn.Module):
    """The cp process group a model's attention exchanges over (None when apply_cp was not applied)."""
    spec = cp_spec_of(model)
    return spec.group if spec is not None else None


def _groups(cp_mesh, plan: CpPlan) -> tuple[Any, Any, int]:
    """(Ulysses group, ring group, ring member) of this rank: the cp mesh unflattened into (ring, ulysses), Ulysses
    innermost (consecutive ranks, where the all-to-alls stay inside a node)."""
    if plan.ring == 1:
        return cp_mesh.get_group(), None, 0
    if plan.ulysses == 1:
        return None, cp_mesh.get_group(), cp_mesh.get_local_rank()
    mesh = cp_mesh._unflatten(0, (plan.ring, plan.ulysses), ("cp_ring", "cp_ulysses"))
    return mesh["cp_ulysses"].get_group(), mesh["cp_ring"].get_group(), mesh["cp_ring"].get_local_rank()


def apply_cp(model: nn.Module, cp_mesh, tp: int = 1, plan: CpPlan | None = None) -> CpPlan:
    """Make every attention layer of `model` attend over a sequence sharded across `cp_mesh` by `plan`'s method.

    The model's attention implementation (hfdist_documents, flash varlen, sdpa or eager) stays the base: Ulysses
    computes with it on the gathered sequence, the ring reads the boundaries the batch carries for it. The
    config's `_attn_implementation` becomes the method's name (CP_ATTENTIONS).

    Args:
        tp: the tensor-parallel degree applied before (each rank's attention then holds heads / tp).
        plan: from hfdist.parallel.context_check.plan_cp (the run's --cp-method); None: auto for this model.

    Returns:
        The plan applied.

    Raises:
        ContextParallelError: a plan that does not fit the model or the attention, no attention layer found, or flex
            attention (its BlockMask is built per chunk by the model, never for the gathered sequence).
    """
    from transformers import AttentionInterface

    cp = cp_mesh.size()
    base_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base_model.config
    if plan is None:
        plan = check_cp(config, cp, tp=tp)
    elif plan.cp != cp or (int(config.num_attention_heads) // tp) % plan.ulysses:
        raise ContextParallelError(f"The {plan.method} plan (cp={plan.cp}, Ulysses over {plan.ulysses}) does not fit a "
                                   f"cp mesh of {cp} ranks and {config.num_attention_heads} heads / tp={tp}; plan it "
                                   "for this model (hfdist.parallel.context_check.check_cp).")
    base = config._attn_implementation or "sdpa"
    if base in CP_ATTENTIONS.values():
        raise ContextParallelError("apply_cp was applied twice to one model.")
    if base == "flex_attention":
        raise ContextParallelError("Context parallelism cannot keep packed documents apart under flex_attention: "
                                   "the gathered sequence gets no BlockMask. Use --attn-implementation auto.")
    check_cp_attention(plan, base)
    name = CP_ATTENTIONS[plan.method]
    AttentionInterface.register(name, cp_attention)
    layers = [m for name_, m in base_model.named_modules() if name_.endswith("self_attn")]
    if not layers:
        raise ContextParallelError(f"{type(base_model).__name__} has no `self_attn` modules for context parallelism.")
    ulysses, ring, member = _groups(cp_mesh, plan)
    spec = CpSpec(cp_mesh.get_group(), plan, base, ulysses, ring, member)
    for layer in layers:  # one spec for all: the ring's segments are computed once per batch, not per layer
        layer.hfdist_cp = spec
    config._attn_implementation = name
    return plan
