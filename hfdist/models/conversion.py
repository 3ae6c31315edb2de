"""Checkpoint keys <-> the model's parameters, through transformers' own weight conversion.

transformers 5 models may hold a tensor under another name or shape than their checkpoints do: an MoE layer's
experts are stacked in one (E, 2I, H) `experts.gate_up_proj` while the checkpoint holds `experts.<e>.gate_proj.weight`
and `experts.<e>.up_proj.weight` per expert (Qwen3-MoE; Mixtral's `block_sparse_moe.experts.<e>.w1/w3` too), and
renamed modules. `from_pretrained` applies the model's conversion mapping (transformers.conversion_mapping:
WeightRenaming and WeightConverter entries), `save_pretrained` its reverse. hfdist reads the same mapping, so every
checkpoint transformers loads, hfdist loads, and writes what save_pretrained writes, without ever assembling a
stacked tensor whole on a rank that keeps only part of it:

- keys are renamed by transformers' own `rename_source_key` (renamings, then at most one converter);
- a converter's operations are read as a layout: MergeModulelist(dim) stacks its source keys' tensors (in the
  natural order of their keys, as transformers sorts them) along `dim`, Concatenate(dim) then joins the source
  patterns' stacks in pattern order. So a slice of the model's tensor is a set of slices of checkpoint tensors
  (`StackedSource.pieces`), which hfdist.models.load reads one by one. Saving runs the reverse: each checkpoint key
  is a slice of the model's tensor;
- any other operation (Interleave, Transpose, ...) in a registered architecture's mapping is refused by name: no
  registered architecture uses one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from hfdist.models.presets import ModelSpecError

__all__ = ["StackedSource", "CheckpointLayout", "checkpoint_layout", "saved_layout", "hf_key"]

_PEFT_PREFIX = "base_model.model."


def hf_key(name: str) -> str:
    """The name a parameter has in a HF checkpoint: a peft LoRA model's names without its wrapper prefix and
    `.base_layer` (the adapters' own names keep their `lora_A.<adapter>` part)."""
    return name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


@dataclass(frozen=True)
class StackedSource:
    """A model tensor made of checkpoint tensors: `groups[g][i]` is the checkpoint key of the i-th slice along
    `stack_dim` of group g, and the groups are joined along `concat_dim` (None: one group)."""

    groups: tuple[tuple[str, ...], ...]
    stack_dim: int = 0
    concat_dim: int | None = None

    def shape(self, shapes: dict[str, tuple[int, ...]]) -> tuple[tuple[int, ...] | None, list[int]]:
        """(the stacked tensor's shape, each group's extent along concat_dim) from its pieces' checkpoint shapes;
        None for the shape when they do not stack (pieces of different shapes in a group, or groups that differ
        elsewhere than along concat_dim)."""
        stacked = []
        for keys in self.groups:
            piece = {shapes[k] for k in keys}
            if len(piece) != 1:
                return None, []
            dims = list(piece.pop())
            dims.insert(self.stack_dim, len(keys))
            stacked.append(dims)
        cat = self.concat_dim
        widths = [d[cat] for d in stacked] if cat is not None else [1]
        rest = {tuple(x for j, x in enumerate(d) if j != cat) for d in stacked}
        if len(rest) != 1 or (cat is None and len(stacked) != 1):
            return None, []
        full = list(stacked[0])
        if cat is not None:
            full[cat] = sum(widths)
        return tuple(full), widths

    def pieces(self, group_sizes: list[int], offsets: tuple[int, ...], lengths: tuple[int, ...]):
        """(checkpoint key, its index tuple, the target index tuple) for every checkpoint slice inside the box
        (`offsets`, `lengths`) of the model tensor; `group_sizes`: each group's extent along concat_dim."""
        starts = [sum(group_sizes[:g]) for g in range(len(group_sizes))]
        rank = len(offsets)
        for g, keys in enumerate(self.groups):
            lo, hi = starts[g], starts[g] + group_sizes[g]
            cat = self.concat_dim
            if cat is not None:
                a, b = max(lo, offsets[cat]), min(hi, offsets[cat] + lengths[cat])
                if a >= b:
                    continue
            for i in range(offsets[self.stack_dim], offsets[self.stack_dim] + lengths[self.stack_dim]):
                source, target = [], []
                for d in range(rank):
                    if d == self.stack_dim:
                        target.append(i - offsets[d])
                        continue
                    lo_d, n = offsets[d], lengths[d]
                    if d == cat:
                        source.append(slice(a - lo, b - lo))
                        target.append(slice(a - lo_d, b - lo_d))
                    else:
                        source.append(slice(lo_d, lo_d + n))
                        target.append(slice(0, n))
                yield keys[i], tuple(source), tuple(target)


@dataclass(frozen=True)
class CheckpointLayout:
    """Where each of a model's tensors is in a checkpoint: `direct` (model name -> checkpoint key, possibly renamed)
    or `stacked` (model name -> StackedSource)."""

    direct: dict[str, str]
    stacked: dict[str, StackedSource]


def _natural(key: str) -> list:
    from transformers.core_model_loading import dot_natural_key

    return dot_natural_key(key)


def _ops(converter) -> tuple[int, int | None]:
    """(stack dim, concat dim or None) of a converter whose operations hfdist reads as a layout.

    Raises:
        ModelSpecError: an operation hfdist does not read in slices.
    """
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    if ops and isinstance(ops[0], MergeModulelist):
        if len(ops) == 1:
            return ops[0].dim, None
        if len(ops) == 2 and isinstance(ops[1], Concatenate):
            return ops[0].dim, ops[1].dim
    raise ModelSpecError(
        f"transformers converts the checkpoint keys {converter.source_patterns} with {ops}, which hfdist does not "
        "read in slices (it reads stacked experts: MergeModulelist, then Concatenate). Convert the checkpoint once "
        "with transformers (from_pretrained, then save_pretrained) or use a registered architecture.")


def _conversions(model):
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = get_model_conversion_mapping(model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def checkpoint_layout(model, keys, model_key=lambda name: name) -> CheckpointLayout:
    """The layout of a checkpoint holding `keys` for `model` (a transformers model, e.g. on the meta device), keyed
    by model tensor names as `model_key` maps them (hfdist.models.load.hf_key for a peft model's names).

    Raises:
        ModelSpecError: a conversion hfdist cannot read in slices.
    """
    from transformers.core_model_loading import rename_source_key

    renamings, converters = _conversions(model)
    prefix = getattr(model, "base_model_prefix", None)
    meta = dict.fromkeys(model_key(n) for n, _ in model.state_dict().items())
    direct: dict[str, str] = {}
    collected: dict[str, dict[str, list[str]]] = {}
    owner: dict[str, Any] = {}
    for key in sorted(keys, key=_natural):
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if pattern is None:
            direct.setdefault(target, key)
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        owner[target] = converter
        collected.setdefault(target, {}).setdefault(pattern, []).append(key)
    stacked = {}
    for target, by_pattern in collected.items():
        converter = owner[target]
        stack, cat = _ops(converter)
        groups = tuple(tuple(by_pattern[p]) for p in converter.source_patterns if p in by_pattern)
        stacked[target] = StackedSource(groups, stack, cat)
    return CheckpointLayout(direct, stacked)


def saved_layout(model, names) -> dict[str, list[tuple[str, tuple | None]]]:
    """What save_pretrained writes for each model tensor in `names`: [(checkpoint key, the index tuple of its slice
    of the tensor, or None for the whole tensor)]: one whole entry under the (reverse-renamed) name, or a stacked
    tensor's per-expert slices, as transformers' reverse conversion writes them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming, apply_renamings

    transforms = [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)]
    renamings = [t.reverse_transform() for t in transforms[::-1] if isinstance(t, WeightRenaming)]
    converters = [(t, _pattern(t.target_patterns[0])) for t in transforms if isinstance(t, WeightConverter)]
    out = {}
    for name in names:
        hit = next(((c, pat) for c, pat in converters if re.search(pat, name)), None)
        if hit is None:
            out[name] = [(apply_renamings(name, renamings), None)]
            continue
        converter, pat = hit
        stack, cat = _ops(converter)
        shape = tuple(model.get_parameter(name).shape)
        originals = converter._original_source_patterns
        width = shape[cat] // len(originals) if cat is not None else None
        pieces = []
        for g, source in enumerate(originals):
            for i in range(shape[stack]):
                index = [slice(None)] * len(shape)
                index[stack] = i
                if cat is not None:
                    index[cat] = slice(g * width, (g + 1) * width)
                key = re.sub(pat, source.replace("*", str(i)), name, count=1)
                pieces.append((apply_renamings(key, renamings), tuple(index)))
        out[name] = pieces
    return out


def _pattern(pattern: str) -> str:
    """A conversion pattern as transformers matches it: `*` any key segment, ending on a name boundary."""
    out = re.escape(pattern).replace(r"\*", r"[^.]+")
    return out + r"(?!\w)" if re.search(r"[A-Za-z0-9]$", pattern) else out
