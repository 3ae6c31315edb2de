"""Weights into a model whose parameters were allocated empty after sharding: each rank fills only what it keeps.

Where every value comes from is decided once, on the full model while it is still on the meta device (a
`WeightPlan`): a checkpoint's safetensors for the weights it holds, the seeded init (hfdist.models.init) for a
preset's weights and for LoRA adapters. Loading then goes through `torch.distributed.checkpoint` for FSDP2, TP,
pipeline and plain tensors alike: DCP's planner cuts each rank's slices out of the full tensors (DTensor shards,
strided FSDP x TP shards, a pipeline stage's tensors only), and its safetensors reader reads just those slices and
converts them to the model's dtype (a bf16 checkpoint into fp32 weights) on the copy. Each rank reads its own
slices (no rank-0 scatter): a rank touches 1/N of the checkpoint, the reads run in parallel, and no process
holds more than one tensor it does not keep.

A checkpoint that holds a tensor under another name or split otherwise than the model (an MoE layer's experts one
by one, stacked in the model; renamed modules) is read through transformers' own conversion mapping
(hfdist.models.conversion): a rank's slice of a stacked tensor is read as the slices of the per-expert tensors it
covers (`StackedReader`), so a rank holding E / ep experts reads those experts only.

ZeRO-3 partitions are flat ranges of each parameter, not tensor slices, so `load_gathered` fills them the
DeepSpeed way: one parameter at a time gathered, rank 0 reads or generates its full values, DeepSpeed
re-partitions them on leaving `GatheredParameters`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.futures import Future

from hfdist.models.conversion import StackedSource, hf_key
from hfdist.models.init import InitRule, SeededInitReader, init_rule, initial_values

__all__ = ["TensorSource", "WeightPlan", "weight_plan", "hf_key", "local_tensors", "load_weights", "load_gathered",
           "SafetensorsSliceReader", "StackedReader", "checkpoint_files", "read_rows"]

_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorSource:
    """Where one tensor's values come from: checkpoint key `key` (rule None), or the seeded init of `key`.

    `packed`: the model holds it as a 4-bit packed weight (QLoRA's base), whose rows hfdist.models.quantize reads
    and quantises; `load_weights` leaves it alone. `stacked`: the checkpoint tensors it is stacked from (`key` is
    then the model's name), with each group's extent along the concatenated dim (`widths`).
    """

    key: str
    shape: tuple[int, ...]
    rule: InitRule | None = None
    packed: bool = False
    stacked: StackedSource | None = None
    widths: tuple[int, ...] = ()


@dataclass(frozen=True)
class WeightPlan:
    """Every parameter's (and checkpointed buffer's) source, by its name in the full model.

    Attributes:
        checkpoint: the safetensors folder (None: a preset, everything seeded).
        seed: the seed of the seeded tensors.
        tensors: name in the full model (as `named_parameters` / a pipeline runner gives it) -> source.
    """

    checkpoint: Path | None
    seed: int
    tensors: dict[str, TensorSource]

    @property
    def seeded(self) -> dict[str, tuple[tuple[int, ...], InitRule]]:
        """Key -> (shape, rule) of the seeded tensors."""
        return {s.key: (s.shape, s.rule) for s in self.tensors.values() if s.rule is not None}

    @property
    def stacked(self) -> dict[str, TensorSource]:
        """Model name -> source of the tensors stacked from several checkpoint tensors."""
        return {s.key: s for s in self.tensors.values() if s.stacked is not None}


def _checkpoint_keys(folder: Path) -> dict[str, Path]:
    """Tensor key -> safetensors file of a HF checkpoint folder (its index when sharded, else the file headers)."""
    from safetensors import safe_open

    index = folder / _INDEX
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    keys: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            keys.update(dict.fromkeys(f.keys(), file))
    return keys


def _source_shape(module: nn.Module, local: str, p: torch.Tensor) -> tuple[tuple[int, ...], bool]:
    """(the shape a parameter has in the checkpoint, whether the model packs it): a Linear weight held in another
    shape than (out_features, in_features) is a 4-bit packed one (hfdist.models.quantize)."""
    if isinstance(module, nn.Linear) and local == "weight":
        full = (module.out_features, module.in_features)
        return full, tuple(p.shape) != full
    return tuple(p.shape), False


def _checkpoint_layout(model: nn.Module, checkpoint: Path | None):
    """(checkpoint key -> (file, shape), the checkpoint's layout for the model: hfdist.models.conversion)."""
    from hfdist.models.checkpoint_check import checkpoint_headers
    from hfdist.models.conversion import CheckpointLayout, checkpoint_layout

    if checkpoint is None:
        return {}, CheckpointLayout({}, {})
    headers = checkpoint_headers(checkpoint)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return headers, checkpoint_layout(base, headers)


def weight_plan(model: nn.Module, checkpoint: Path | None, seed: int) -> WeightPlan:
    """Decide where each tensor of `model` (full, typically on the meta device, LoRA already injected) gets its
    values. Tied parameters share their first name's source (a tied lm_head loads the embedding).

    Raises:
        ValueError: a tensor neither the checkpoint holds nor the seeded init knows (named, with the fix).
    """
    config = getattr(model, "config", None)
    std = float(getattr(config, "initializer_range", None) or 0.02)
    available, layout = _checkpoint_layout(model, checkpoint)
    # A tied parameter appears under several names; its first (the embedding before lm_head) decides key and rule.
    first_seen: dict[int, tuple[str, InitRule | None]] = {}
    tensors: dict[str, TensorSource] = {}
    missing, unknown = [], []
    for path, module in model.named_modules(remove_duplicate=False):
        for local, p in module.named_parameters(recurse=False, remove_duplicate=False):
            name = f"{path}.{local}" if path else local
            first, rule = first_seen.setdefault(id(p), (name, init_rule(path, module, local, std)))
            key = hf_key(first)
            shape, packed = _source_shape(module, local, p)
            if key in layout.stacked and "lora_" not in key:
                source = layout.stacked[key]
                widths = source.shape({k: available[k][1] for group in source.groups for k in group})[1]
                tensors[name] = TensorSource(key, shape, stacked=source, widths=tuple(widths))
                continue
            key = layout.direct.get(key, key)
            if key in available and "lora_" not in key:
                tensors[name] = TensorSource(key, shape, packed=packed)
            elif checkpoint is not None and "lora_" not in key:
                missing.append(key)
            elif rule is None:
                unknown.append(name)
            else:
                tensors[name] = TensorSource(key, shape, rule, packed)
        for local, b in module.named_buffers(recurse=False):
            name = f"{path}.{local}" if path else local
            if local not in module._non_persistent_buffers_set and hf_key(name) in available:
                tensors[name] = TensorSource(hf_key(name), tuple(b.shape))
    if missing:
        raise ValueError(f"The checkpoint in {checkpoint} lacks {len(missing)} of the model's weights, e.g. "
                         f"{missing[:3]}: it is not a complete checkpoint of this architecture. Point --model at the "
                         "folder save_pretrained wrote (all its *.safetensors files and the index).")
    if unknown:
        raise ValueError(f"No initialisation is known for {unknown[:3]} (neither a Linear, Embedding, norm nor LoRA "
                         "weight): build this model from a checkpoint instead of a preset.")
    return WeightPlan(checkpoint, seed, tensors)


class SafetensorsSliceReader(HuggingFaceStorageReader):
    """torch's HF safetensors reader, opening the file anew for every tensor it reads.

    The stock reader keeps each file memory-mapped while it reads all of that file's tensors, so the pages a rank
    touched (its slices of every tensor, in the checkpoint's dtype) stay resident until the file is done: for a
    one-file checkpoint that is 1/N of the whole checkpoint on top of the rank's shards (the two readers measured
    against each other: benchmarks/bench_load_memory.py, docs/results.md).
    """

    def read_data(self, plan, planner) -> Future:
        from safetensors import safe_open

        for item in plan.items:
            path = self.storage_data[item.storage_index].relative_path
            with safe_open(filename=path, framework="pt") as f:
                index = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
                values = f.get_slice(item.storage_index.fqn)[index]
                target = planner.resolve_tensor(item).detach()
                target.copy_(values)  # converts the checkpoint's dtype to the model's
                planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done


class StackedReader(SeededInitReader):
    """A `torch.distributed.checkpoint` storage of the model's stacked tensors (an MoE layer's experts), each slice a
    rank asks for read as the slices of the checkpoint tensors it is stacked from, one file opening per piece: a
    rank reads only its experts, only its rows of them.

    Args:
        sources: model name -> its stacked TensorSource.
        files: checkpoint key -> safetensors file.
    """

    def __init__(self, sources: dict[str, TensorSource], files: dict[str, Path]) -> None:
        super().__init__({key: (s.shape, None) for key, s in sources.items()}, seed=0)
        self.sources, self.files = sources, files

    def read_data(self, plan, planner) -> Future:
        for item in plan.items:
            target = planner.resolve_tensor(item).detach()
            read_box(self.sources[item.storage_index.fqn], self.files, tuple(item.storage_offsets),
                     tuple(item.lengths), target)
            planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done


def read_box(source: TensorSource, files: dict[str, Path], offsets: tuple[int, ...], lengths: tuple[int, ...],
             out: torch.Tensor) -> torch.Tensor:
    """The box (`offsets`, `lengths`) of a stacked tensor, read into `out` piece by piece (converted to its dtype)."""
    from safetensors import safe_open

    for key, index, into in source.stacked.pieces(list(source.widths), offsets, lengths):
        with safe_open(str(files[key]), framework="pt") as f:
            out[into].copy_(f.get_slice(key)[index])
    return out


def local_tensors(modules: list[tuple[nn.Module, object]]) -> dict[str, torch.Tensor]:
    """A rank's parameters by their name in the full model, sharded as they are kept.

    Args:
        modules: (module, rename) pairs: rename maps a module's parameter name to the full model's (a pipeline
            stage's `original_name`), or is None for the whole model.

    FSDP2 keeps a unit unsharded after a forward without backward (the root, or every unit under a pipeline
    schedule's evaluation); its parameters are resharded first, so each is the DTensor shard the rank owns.
    """
    from torch.distributed.fsdp import FSDPModule

    out: dict[str, torch.Tensor] = {}
    for module, rename in modules:
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()
        for name, p in module.named_parameters():
            out[rename(name) if rename else name] = p
    return out


def load_weights(tensors: Mapping[str, torch.Tensor], plan: WeightPlan) -> None:
    """Fill this rank's `tensors` (full-model name -> plain tensor or DTensor, allocated on the rank's device) from
    `plan`'s sources. Not a collective: each rank plans and reads its own slices (a DTensor's local shard says
    where it lies), so it runs the same with or without a process group, on any subset of ranks.
    """
    import torch.distributed.checkpoint as dcp

    from_checkpoint: dict[str, torch.Tensor] = {}
    seeded: dict[str, torch.Tensor] = {}
    stacked: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        source = plan.tensors.get(name)
        if source is None or source.packed:
            continue  # buffers without a checkpoint entry keep the values they were built with; 4-bit weights
            # are quantised from their rows by hfdist.models.quantize
        target = seeded if source.rule is not None else stacked if source.stacked is not None else from_checkpoint
        # Tied parameters are one object on a rank (TP and FSDP keep the tie): the same key twice is that object.
        assert target.get(source.key, tensor) is tensor, f"{name}: two distinct tensors load {source.key}"
        target[source.key] = tensor
    with warnings.catch_warnings():  # DCP warns that no_dist means "one process": here it means "no coordination"
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        if from_checkpoint:
            dcp.load(from_checkpoint, storage_reader=SafetensorsSliceReader(str(plan.checkpoint)), no_dist=True)
        if seeded:
            dcp.load(seeded, storage_reader=SeededInitReader(plan.seeded, plan.seed), no_dist=True)
        if stacked:
            dcp.load(stacked, storage_reader=StackedReader(plan.stacked, checkpoint_files(plan)), no_dist=True)


def checkpoint_files(plan: WeightPlan) -> dict[str, Path]:
    """Tensor key -> safetensors file of `plan`'s checkpoint ({} for a preset)."""
    return _checkpoint_keys(plan.checkpoint) if plan.checkpoint is not None else {}


def _full_tensor(source: TensorSource, plan: WeightPlan, files: dict[str, Path]) -> torch.Tensor:
    """One tensor's full values: read from the checkpoint (the file opened for this tensor only) or generated."""
    if source.rule is not None:
        return initial_values(source.key, source.shape, source.rule, plan.seed)
    if source.stacked is not None:
        return read_box(source, files, (0,) * len(source.shape), source.shape, torch.empty(source.shape))
    from safetensors import safe_open

    with safe_open(str(files[source.key]), framework="pt") as f:
        return f.get_tensor(source.key)


def read_rows(source: TensorSource, plan: WeightPlan, files: dict[str, Path], rows: slice = slice(None)
              ) -> torch.Tensor:
    """Rows `rows` of one tensor, in the dtype it is stored in: a slice read from the checkpoint (the file opened for
    this tensor only, only those rows read), or of the seeded init (generated whole, one tensor at a time)."""
    if source.rule is not None:
        return initial_values(source.key, source.shape, source.rule, plan.seed)[rows]
    from safetensors import safe_open

    with safe_open(str(files[source.key]), framework="pt") as f:
        return f.get_slice(source.key)[rows]


@torch.no_grad()
def load_gathered(model: nn.Module, plan: WeightPlan) -> None:
    """Fill a model built under `deepspeed.zero.Init` (parameters partitioned over the ranks), one parameter at a
    time: gathered, rank 0 reads or generates its full values, DeepSpeed re-partitions them on leaving the context.
    Parameters DeepSpeed has not partitioned (LoRA adapters injected after the build) are filled on every rank.
    Collective over all ranks.
    """
    import deepspeed
    import torch.distributed as dist

    rank0 = dist.get_rank() == 0
    files = checkpoint_files(plan)
    for name, p in model.named_parameters():
        source = plan.tensors[name]
        if hasattr(p, "ds_id"):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if rank0:
                    p.data.copy_(_full_tensor(source, plan, files))
        else:
            p.copy_(_full_tensor(source, plan, files))
