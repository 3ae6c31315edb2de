"""Write a trained model as a Hugging Face checkpoint (or LoRA adapter) one tensor at a time, from any layout.

The same routine serves every rung: a rank's tensors may be plain (DDP: the full model), DTensor shards (FSDP2,
TP, 3D), a pipeline stage's only, or DeepSpeed ZeRO partitions (split by AutoTP as well on zero2_tp). For each
tensor of the checkpoint, in the order `save_pretrained` writes them, rank 0 allocates the full fp32 tensor,
receives each distinct slice of it from the lowest rank holding that slice (point to point; where the slice lies in
the full tensor is what torch.distributed.checkpoint computes for DTensor shards, and AutoTP's layout record for its
split layers), appends it to the safetensors shard it is writing and frees it. ZeRO parameters are assembled by
DeepSpeed's `safe_get_full_fp32_param` (its fp32 master, never the bf16 copy), one at a time; under AutoTP that
gives each tp rank its slice, sent on like a DTensor shard. So rank 0 holds one full tensor beyond its own state
and the other ranks nothing (ZeRO: one, transiently), the written weights are fp32 on every rung (the master
weights, exactly what was trained), and the output is what `save_pretrained` writes:
model.safetensors (or model-0000i-of-0000N.safetensors + model.safetensors.index.json above `max_shard_bytes`),
config.json and generation_config.json; or adapter_model.safetensors and adapter_config.json for a LoRA adapter,
which `PeftModel.from_pretrained` loads.

Why not torch.distributed.checkpoint's HuggingFaceStorageWriter with consolidation: it serialises each rank's
part of every output file in memory (safetensors' `save` returns the whole file as bytes), writes a sharded copy
that rank 0 re-reads to consolidate (twice the disk traffic, a shared filesystem even for one output file), and
it cannot read ZeRO partitions, which need a per-tensor gather anyway. Nor DTensor.full_tensor(): it all-gathers,
so every rank of the mesh would hold the full tensor, not only the writer.
"""

from __future__ import annotations

import copy
import json
import struct
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ExportEntry", "SafetensorsStreamWriter", "checkpoint_entries", "export_plan", "save_hf_checkpoint",
           "stream_hf_checkpoint", "SAVED_DTYPE", "DEFAULT_MAX_SHARD_BYTES"]

SAVED_DTYPE = torch.float32  # every rung saves its fp32 (master) weights
DEFAULT_MAX_SHARD_BYTES = 50 * 10**9  # transformers' save_pretrained default ("50GB")
_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_INDEX = "model.safetensors.index.json"
_RELEASE_WAIT_S = 5.0  # bounds the wait for a collective's worker thread to drop a buffer (see _freed)


@dataclass(frozen=True)
class ExportEntry:
    """One tensor of the written checkpoint: its key in the file, the model's name for it, its shape in the file, the
    dtype it is written in; `part`: where it lies in the model's tensor, whose shape is then `full_shape` (an MoE
    layer's stacked experts are written one expert and projection at a time, as save_pretrained writes them)."""

    key: str
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = SAVED_DTYPE
    part: tuple | None = None
    full_shape: tuple[int, ...] | None = None

    @property
    def model_shape(self) -> tuple[int, ...]:
        """The shape of the model's tensor this entry is (part of)."""
        return self.full_shape or self.shape

    @property
    def nbytes(self) -> int:
        """Bytes it takes in the file."""
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class SafetensorsStreamWriter:
    """Writes tensors into safetensors files whose headers are known in advance, appending each tensor as it
    arrives: only the tensor being written is in memory. Files split at `max_shard_bytes` like save_pretrained.

    Args:
        folder: the output folder (exists).
        entries: every tensor, in the order they will be passed to `write`.
        single_name: the file name when everything fits one shard ("model.safetensors", "adapter_model.safetensors").
    """

    def __init__(self, folder: Path, entries: list[ExportEntry], single_name: str,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        shards: list[list[ExportEntry]] = [[]]
        size = 0
        for entry in entries:
            if shards[-1] and size + entry.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(entry)
            size += entry.nbytes
        stem = single_name.removesuffix(".safetensors")
        names = [single_name] if len(shards) == 1 else \
            [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        self.folder = folder
        self._queue = [(folder / name, shard) for name, shard in zip(names, shards)]
        self._file = None
        self._pending: list[ExportEntry] = []
        if len(shards) > 1:
            weight_map = {e.key: name for name, shard in zip(names, shards) for e in shard}
            index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
            (folder / _INDEX).write_text(json.dumps(index, indent=2))

    def _open_next(self) -> None:
        path, shard = self._queue.pop(0)
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for e in shard:
            header[e.key] = {"dtype": _DTYPE_NAMES[e.dtype], "shape": list(e.shape),
                             "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format aligns the data section to 8 bytes
        self._file = open(path, "wb")  # noqa: SIM115 (closed when its last tensor is written)
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._pending = list(shard)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Append the next tensor (it must be the next entry, with its shape)."""
        if not self._pending:
            self._open_next()
        entry = self._pending.pop(0)
        if entry.key != key or tuple(tensor.shape) != entry.shape:
            raise ValueError(f"expected {entry.key} {entry.shape}, got {key} {tuple(tensor.shape)}")
        data = tensor.detach().to(device="cpu", dtype=entry.dtype).contiguous()
        self._file.write(data.view(torch.uint8).numpy().data)
        if not self._pending:
            self._file.close()
            self._file = None

    def close(self) -> None:
        """Check every announced tensor was written."""
        if self._pending or self._queue:
            raise ValueError("the checkpoint is incomplete: not every tensor was written")


def checkpoint_entries(skeleton: nn.Module, adapter_only: bool, dtype: torch.dtype = SAVED_DTYPE) -> list[ExportEntry]:
    """The tensors of the checkpoint `skeleton` (the full model's structure, e.g. on the meta device) saves, in
    save_pretrained's order: its state dict without tied copies, or its LoRA adapter's entries (peft's names),
    written in `dtype`; under the names and split as transformers' reverse conversion writes them
    (hfdist.models.conversion.saved_layout: an MoE layer's experts one by one)."""
    state = skeleton.state_dict()
    names = {id(t): n for n, t in reversed(list(state.items()))}
    if adapter_only:
        from peft.utils import get_peft_model_state_dict

        return [ExportEntry(key, names[id(t)], tuple(t.shape), dtype)
                for key, t in get_peft_model_state_dict(skeleton, state_dict=state).items()]
    from hfdist.models.conversion import saved_layout

    tied = set(getattr(skeleton, "all_tied_weights_keys", None) or {})
    names = [n for n in state if n not in tied]
    entries = []
    for name, pieces in saved_layout(skeleton, names).items():
        full = tuple(state[name].shape)
        for key, part in pieces:
            shape = full if part is None else tuple(torch.empty(full, device="meta")[part].shape)
            entries.append(ExportEntry(key, name, shape, dtype, part, None if part is None else full))
    return entries


def _is_zero(tensor: torch.Tensor) -> bool:
    """A DeepSpeed ZeRO parameter (partitioned, or linked to fp32 master partitions)."""
    return hasattr(tensor, "ds_id") or hasattr(tensor, "_hp_mapping")


def _autotp_split(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(dim, offset) of the slice a DeepSpeed AutoTP parameter holds in the full tensor, from the layout record
    AutoTP puts on it (its universal-checkpoint metadata: the split dim and every tp rank's size) and the layer's
    tp rank; None for any other tensor, or one AutoTP keeps whole (a row-parallel layer's bias).

    Raises:
        ValueError: a layout that is not one contiguous slice per rank (fused sub-parameters), naming it.
    """
    meta = getattr(tensor, "ds_autotp_universal_checkpoint_meta", None)
    if not meta or meta.get("replicated") or meta.get("partition_dim") is None:
        return None
    if meta.get("sub_param_shard_widths"):
        raise ValueError(f"DeepSpeed AutoTP split a fused parameter of shape {meta.get('logical_shape')} by "
                         "sub-parameter; hfdist's save assembles one contiguous slice per tp rank only.")
    layer = tensor.gather_params.__self__  # AutoTP binds its layer's gather to each parameter it splits
    dim, sizes = int(meta["partition_dim"]), list(meta["partition_sizes"])
    return dim, sum(sizes[:layer.tp_index])


def _zero_full(tensor: torch.Tensor) -> torch.Tensor:
    """A ZeRO parameter's full fp32 values from DeepSpeed's master partitions (collective over all ranks)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(tensor)
    if full is not None:
        return full
    with deepspeed.zero.GatheredParameters([tensor]):  # outside the optimizer (frozen): its own values
        return tensor.detach().float().clone()


def _local_piece(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """(offsets in the full tensor, sizes, values) of the slice this rank holds: a DTensor's local shard where
    torch.distributed.checkpoint places it (FSDP2, TP and strided FSDP x TP alike), a DeepSpeed AutoTP slice where
    its layer put it, else the whole tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        (chunk,) = tensor.__create_chunk_list__()
        return tuple(chunk.offsets), tuple(chunk.sizes), tensor.to_local()
    offsets = [0] * tensor.dim()
    split = _autotp_split(tensor)
    if split is not None:
        offsets[split[0]] = split[1]
    return tuple(offsets), tuple(tensor.shape), tensor


@dataclass(frozen=True)
class _ZeroWhole:
    """A ZeRO parameter that DeepSpeed's collective fp32 gather gives whole (every rank takes part)."""

    def full(self, entry: ExportEntry, local: Mapping[str, torch.Tensor], rank: int) -> torch.Tensor | None:
        return _zero_full(local.get(entry.name))


@dataclass(frozen=True)
class _Slices:
    """Slices held by the ranks, each distinct one sent to rank 0 from the lowest rank holding it: DTensor shards
    (FSDP2, TP, both), whole plain tensors (DDP, a pipeline stage's), DeepSpeed AutoTP slices. `zero`: the slices
    are ZeRO parameters under AutoTP, whose values are DeepSpeed's fp32 master (a collective gather on every rank
    first, which gives each tp rank its slice)."""

    pieces: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]  # (offsets, sizes, sending rank)
    zero: bool = False

    def full(self, entry: ExportEntry, local: Mapping[str, torch.Tensor], rank: int) -> torch.Tensor | None:
        values = _zero_full(local[entry.name]) if self.zero else None
        return _assemble(entry, self.pieces, local, rank, values)


def export_plan(entries: list[ExportEntry], local: Mapping[str, torch.Tensor]) -> dict[str, _ZeroWhole | _Slices]:
    """Where each tensor of the checkpoint comes from: key -> its piece provider, the same on every rank (computed
    from one all_gather_object of what each rank holds). A slice held by several ranks (replicas, TP-replicated
    norms, DDP copies) is sent once, by the lowest of them."""
    mine = {}
    for e in entries:
        if e.name in local:
            tensor = local[e.name]
            split = _autotp_split(tensor)
            mine[e.key] = None if _is_zero(tensor) and split is None else \
                (*_local_piece(tensor)[:2], _is_zero(tensor))
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    whole: set[str] = set()
    pieces: dict[str, list] = {}
    zero: set[str] = set()
    for rank, held in enumerate(everyone):
        for key, piece in held.items():
            if piece is None:
                whole.add(key)
                continue
            offsets, sizes, is_zero = piece
            if is_zero:
                zero.add(key)
            known = pieces.setdefault(key, [])
            if all(n > 0 for n in sizes) and (offsets, sizes) not in [(o, z) for o, z, _ in known]:
                known.append((offsets, sizes, rank))
    plan: dict[str, _ZeroWhole | _Slices] = {key: _ZeroWhole() for key in whole}
    plan.update({key: _Slices(tuple(p), key in zero) for key, p in pieces.items() if key not in whole})
    return plan


class _OneTensorAtATime:
    """Makes the full tensors one after another so that the last one is freed before the next exists.

    On CPU, gloo's collectives return once the work is marked done, and gloo's worker thread drops its own
    reference to the buffers only after that (ProcessGroupGloo's run loop): on busy cores the caller could allocate
    the next tensor while the last still lives (tests/e2e/test_scale_memory.py caught two full tensors at once). So
    each tensor made is watched (`_freed`) and the next waits for it, boundedly (a tensor someone else keeps costs
    memory, never a hang)."""

    def __init__(self) -> None:
        self._last: threading.Event | None = None

    def make(self, build: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """`build()`, once the tensor the previous call made is gone."""
        if self._last is not None:
            self._last.wait(_RELEASE_WAIT_S)
        full = build()
        self._last = _freed(full) if full is not None else None
        return full


@torch.no_grad()
def save_hf_checkpoint(folder: str | Path, skeleton: nn.Module, local: Mapping[str, torch.Tensor], *,
                       adapter_only: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write the model (or its LoRA adapter) into `folder` as a HF checkpoint, streaming one tensor at a time.

    Collective: every rank calls it. Rank 0 assembles each full tensor from the slices the ranks hold (sent to it
    point to point; the other ranks hold nothing beyond their own state) and appends it to the file it writes.
    ZeRO parameters come from DeepSpeed's collective fp32 gather instead, one at a time (`export_plan`).

    Args:
        skeleton: the full model's structure (a meta-device copy is enough; a PeftModel for an adapter): its
            config, names, shapes and tied weights decide what is written.
        local: this rank's tensors by their name in the full model (plain, DTensor shards or ZeRO parameters).
        adapter_only: write the LoRA adapter (the skeleton is a PeftModel).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    plan = export_plan(checkpoint_entries(skeleton, adapter_only), local)
    tensors = _OneTensorAtATime()
    stream_hf_checkpoint(folder, skeleton,
                         lambda entry: tensors.make(lambda: plan[entry.key].full(entry, local, rank)),
                         adapter_only=adapter_only, writes=rank == 0, max_shard_bytes=max_shard_bytes)


@torch.no_grad()
def stream_hf_checkpoint(folder: str | Path, skeleton: nn.Module, full_tensor, *, adapter_only: bool = False,
                         writes: bool = True, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                         dtype: torch.dtype = SAVED_DTYPE) -> None:
    """Write a HF checkpoint (or LoRA adapter) of `skeleton` into `folder`, asking `full_tensor(entry)` for each
    tensor in save_pretrained's order and appending it before asking for the next: one full tensor in memory.

    Args:
        full_tensor: ExportEntry -> the full tensor by the entry's model name (`entry.name`); may return None on a
            process that does not write (it is still called there: a collective gather may need every rank). It is
            called once for consecutive entries of one tensor (the parts of a stacked one).
        writes: whether this process writes the files (rank 0 of a save).
        dtype: the dtype the tensors are written in (and config.json records): fp32, the master weights, but for a
            merged export (hfdist.checkpoint.convert), bf16 like the models HF ships.
    """
    folder = Path(folder)
    entries = checkpoint_entries(skeleton, adapter_only, dtype)
    writer = None
    if writes:
        folder.mkdir(parents=True, exist_ok=True)
        writer = SafetensorsStreamWriter(folder, entries,
                                         "adapter_model.safetensors" if adapter_only else "model.safetensors",
                                         max_shard_bytes)
    full, name = None, None
    for entry in entries:
        if entry.name != name:
            full = None  # gone before the next is made
            full, name = full_tensor(entry), entry.name
        if writer is not None:
            writer.write(entry.key, full if entry.part is None else full[entry.part])
    del full
    if writer is not None:
        writer.close()
        _write_configs(folder, skeleton, adapter_only, dtype)


def _assemble(entry: ExportEntry, pieces: tuple, local: Mapping[str, torch.Tensor], rank: int,
              values: torch.Tensor | None = None) -> torch.Tensor | None:
    """On rank 0 the full fp32 tensor of `entry`, filled from its own slice and the others' (received straight
    into place when the slice is contiguous); on the other ranks None, after sending their slice if asked.
    `values`: this rank's slice when it is not the local tensor itself (DeepSpeed's fp32 master of it)."""
    full = torch.empty(entry.model_shape, dtype=SAVED_DTYPE, device=_comm_device()) if rank == 0 else None
    staging = None  # one buffer for the slices that cannot be received in place (TP's rowwise under FSDP)
    for offsets, sizes, sender in pieces:
        if rank == sender:
            values = (values if values is not None else _local_piece(local[entry.name])[2]).detach().to(SAVED_DTYPE)
            if rank == 0:
                full[_slices(offsets, sizes)].copy_(values)
            else:
                dist.send(values.contiguous(), dst=0)
        elif rank == 0:
            view = full[_slices(offsets, sizes)]
            target = view
            if not view.is_contiguous():
                if staging is None or staging.shape != view.shape:  # a new shape only where the split is uneven
                    staging = torch.empty(sizes, dtype=SAVED_DTYPE, device=full.device)
                target = staging
            dist.recv(target, src=sender)
            if target is not view:
                view.copy_(target)
    if staging is not None:  # gone before the next tensor is made (see _freed)
        freed = _freed(staging)
        del staging, target
        freed.wait(_RELEASE_WAIT_S)
    return full


def _freed(tensor: torch.Tensor) -> threading.Event:
    """An event set once `tensor`'s memory is freed (its storage's last reference dropped, from any thread; see
    _OneTensorAtATime). GPU tensors are not waited for (set at once): NCCL hands its buffers back to CUDA's caching
    allocator on its own schedule."""
    event = threading.Event()
    if tensor.device.type == "cpu":
        weakref.finalize(tensor.untyped_storage(), event.set)
    else:
        event.set()
    return event


def _slices(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes))


def _comm_device() -> torch.device:
    """Where point-to-point buffers live: the GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _write_configs(folder: Path, skeleton: nn.Module, adapter_only: bool, dtype: torch.dtype) -> None:
    """config.json + generation_config.json (the saved dtype recorded), or adapter_config.json."""
    if adapter_only:
        peft_config = copy.deepcopy(skeleton.peft_config["default"])
        peft_config.inference_mode = True
        peft_config.save_pretrained(str(folder))
        return
    config = copy.deepcopy(skeleton.config)
    config.dtype = dtype
    config.save_pretrained(str(folder))
    generation = getattr(skeleton, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(folder))
