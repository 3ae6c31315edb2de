"""Per-rank memory readers: bytes of params, grads and optimizer state this rank really holds, peak and current
memory, and the bytes autograd saves for backward. The one place hfdist (and its benchmarks and tests) reads memory.

Bytes are measured from the tensors, never from a formula: local shards of DTensors (FSDP2/TP), DeepSpeed ZeRO-3
partitions (`ds_tensor`), DeepSpeed's fp32 master partitions. Tensors sharing storage (DeepSpeed's flat buffers,
views) are counted once, storage size included, so alignment padding shows up as it does in the allocator.

Process memory on CPU: the peak is Linux's VmHWM, never getrusage's ru_maxrss (which survives exec, so a rank
started by a bigger launcher reports the launcher's peak); the current size is /proc/self/statm's resident pages.
`freed_memory_returned_to_os` makes those figures count tensors rather than glibc's heap.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import weakref
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["held_tensor", "innermost_optimizer", "rank_state_bytes", "held_outside_bytes",
           "peak_memory_bytes", "current_memory_bytes",
           "reset_peak_memory", "cuda_peaks_kept_through_resets", "start_peak_window", "cuda_memory_stats", "saved_tensor_bytes", "LiveTensorBytes",
           "freed_memory_returned_to_os", "MMAP_THRESHOLD_BYTES"]

MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
_GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # the ceiling of glibc's own sliding threshold on 64-bit (malloc.c)


def held_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage this rank holds for `t` (its local shard or ZeRO-3 partition)."""
    ds_tensor = getattr(t, "ds_tensor", None)
    if ds_tensor is not None:  # ZeRO-3: `t.data` is an empty placeholder between all-gathers
        return ds_tensor
    local = getattr(t, "_local_tensor", None)  # DTensor
    return local if local is not None else t


def _storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    total = 0
    for t in tensors:
        if t is None:
            continue
        held = held_tensor(t)
        if held.numel() == 0:
            continue
        if is_traceable_wrapper_subclass(held):  # no storage of its own (torchao's float8 weights): its inner ones
            total += _storage_bytes((getattr(held, name) for name in held.__tensor_flatten__()[0]), seen)
            continue
        storage = held.untyped_storage()
        key = storage.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def innermost_optimizer(optimizer) -> torch.optim.Optimizer | None:
    """The torch optimizer that owns the state, below accelerate's and DeepSpeed's wrappers."""
    seen = set()
    opt = optimizer
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        inner = getattr(opt, "optimizer", None)
        if inner is None or inner is opt:
            break
        opt = inner
    return opt if isinstance(opt, torch.optim.Optimizer) else None


def rank_state_bytes(model: torch.nn.Module, optimizer=None) -> dict[str, int]:
    """Bytes of model states held by this rank.

    Returns:
        param_bytes: the model's parameters (local shards), and the quantisation state of QLoRA's 4-bit layers
            (kept whole on every rank beside their packed shards).
        grad_bytes: gradients currently held: the model params' `.grad` and, under DeepSpeed, the gradient
            partitions attached to its fp32 master partitions. Call it where gradients are live (just before
            the optimizer step) to see their peak.
        optimizer_bytes: the optimizer's state tensors (Adam's two moments and step counters).
        master_bytes: parameter copies the optimizer updates that are not the model's own parameters
            (DeepSpeed's fp32 master partitions); 0 when the optimizer steps the model's params directly.
    """
    from hfdist.models.quantize import quant_state_tensors

    params = list(model.parameters())
    seen_params: set[int] = set()
    param_bytes = _storage_bytes(params, seen_params) + _storage_bytes(quant_state_tensors(model), set(seen_params))
    seen_grads: set[int] = set()
    grad_bytes = _storage_bytes((p.grad for p in params), seen_grads)
    optimizer_bytes = master_bytes = 0
    inner = innermost_optimizer(optimizer)
    if inner is not None:
        # DeepSpeed steps its torch optimizer one parameter group (ZeRO-1/2) or sub-group (ZeRO-3) at a time and
        # swaps the groups' params in and out around each of those steps, so inside one (where the memory meter's
        # hooks read this) the groups hold a single partition: the params the optimizer keeps state for are the rest.
        opt_params = [p for group in inner.param_groups for p in group["params"]] + \
            [p for p in inner.state if torch.is_tensor(p)]
        master_bytes = _storage_bytes(opt_params, set(seen_params))
        grad_bytes += _storage_bytes((p.grad for p in opt_params), seen_grads)
        state_tensors = (v for state in inner.state.values() for v in state.values() if torch.is_tensor(v))
        optimizer_bytes = _storage_bytes(state_tensors, set())
    return {"param_bytes": param_bytes, "grad_bytes": grad_bytes, "optimizer_bytes": optimizer_bytes,
            "master_bytes": master_bytes}


def held_outside_bytes(model: torch.nn.Module) -> int:
    """Bytes of training state `model` (the Trainer's wrapped model) holds outside its parameters, gradients and
    optimizer state: DDP's gradient buckets, a pipeline's receive buffers (allocated at its first step)."""
    from hfdist.parallel.pipeline.model import PipelineModel

    return ddp_bucket_bytes(model) + (model.receive_buffer_bytes() if isinstance(model, PipelineModel) else 0)


def ddp_bucket_bytes(model: torch.nn.Module) -> int:
    """Bytes of DistributedDataParallel's gradient buckets around `model` (0 for any other module): with torch's
    default gradient_as_bucket_view=False the reducer holds a flat copy of every trainable gradient, allocated when
    DDP wraps the model."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or model.gradient_as_bucket_view:
        return 0
    return sum(p.numel() * p.element_size() for p in model.module.parameters() if p.requires_grad)


def _vm_hwm_bytes() -> int | None:
    """This process image's peak RSS (Linux VmHWM), or None where /proc has no such line."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA max allocated on GPU, the process's peak RSS on CPU.

    On Linux the peak RSS is VmHWM: getrusage's ru_maxrss survives exec, so a rank started by a bigger launcher
    (pytest, a notebook) would report the launcher's peak.
    """
    if device.type == "cuda":
        return max(int(torch.cuda.max_memory_allocated(device)), _CLEARED_CUDA_PEAK[0])
    hwm = _vm_hwm_bytes()
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes


def current_memory_bytes(device: torch.device) -> int:
    """Memory this rank uses now: CUDA allocated on GPU, the process's resident set on CPU (Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak window (CUDA only: a process's peak RSS cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        _CLEARED_CUDA_PEAK[0] = 0


# The highest CUDA peak that a reset by someone else cleared inside `cuda_peaks_kept_through_resets` since hfdist's
# own last reset (one value: a rank uses one GPU).
_CLEARED_CUDA_PEAK = [0]


@contextmanager
def cuda_peaks_kept_through_resets() -> Iterator[None]:
    """Inside the block, a reset of CUDA's peak statistics by other code first keeps the peak it clears, and
    `peak_memory_bytes` counts it until hfdist starts its next peak window.

    DeepSpeed resets them while it builds ZeRO-1/2 (`empty_cache` before flattening each parameter group, on every
    rank) and its bf16 optimizer (`see_memory_usage(force=True)`, on rank 0 only): read afterwards, the setup peak
    would be understated, and by different amounts on different ranks. DeepSpeed's CUDA accelerator resets through
    torch.cuda's function, looked up at each call, which the block swaps for one that keeps the peak first.
    """
    import torch.cuda.memory as cuda_memory

    modules = (torch.cuda, cuda_memory)
    originals = [module.reset_peak_memory_stats for module in modules]

    def keeping(device=None) -> None:
        _CLEARED_CUDA_PEAK[0] = max(_CLEARED_CUDA_PEAK[0], int(torch.cuda.max_memory_allocated(device)))
        originals[0](device)

    for module in modules:
        module.reset_peak_memory_stats = keeping
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            module.reset_peak_memory_stats = original


def _set_mmap_threshold(nbytes: int) -> bool:
    """glibc's mallopt(M_MMAP_THRESHOLD, nbytes), unless the environment set it (MALLOC_MMAP_THRESHOLD_ wins) or
    this is not Linux with glibc. Returns whether it was set."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, nbytes))


@contextmanager
def freed_memory_returned_to_os(threshold: int = MMAP_THRESHOLD_BYTES) -> Iterator[bool]:
    """Inside the block, glibc serves every allocation of `threshold` bytes or more with its own mmap, unmapped when
    freed (mallopt M_MMAP_THRESHOLD); on leaving it, blocks up to glibc's own ceiling (32 MiB) come from its heap
    again. Yields whether the setting took (Linux with glibc, and no MALLOC_MMAP_THRESHOLD_ in the environment,
    which wins throughout).

    Left alone, glibc raises that threshold each time a large block is freed (up to 32 MiB), so later tensors of a
    few MB come from its heap, where freed blocks between live ones stay resident: loading a 153 M-parameter model
    under ZeRO-3 (one gathered buffer per parameter, freed while gloo's worker thread may still hold it) left
    100-230 MB free but resident in the heap, more or less from run to run with the machine's load, so a rank's
    peak RSS said more about the allocator than about the tensors it held (tests/e2e/test_scale_memory.py).
    Only around loading and saving, not the training loop: there every tensor of 1 MiB or more would be mapped,
    page-faulted and unmapped once per step (what that costs a CPU step: docs/finetune.md).
    """
    active = _set_mmap_threshold(threshold)
    try:
        yield active
    finally:
        if active:
            _set_mmap_threshold(_GLIBC_MMAP_THRESHOLD_MAX)


def start_peak_window(device: torch.device) -> int:
    """Restart the peak (CUDA's peak stats; on Linux the process's VmHWM, through /proc/self/clear_refs) and return
    the memory in use now, so that `peak_memory_bytes` later minus this is what a phase (loading, saving) added.

    Where the peak RSS cannot be restarted (not Linux), it stays the process's peak since it started.
    """
    if device.type == "cuda":
        reset_peak_memory(device)
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # "reset the peak resident set size to the current value" (Linux >= 4.0)
        except OSError:
            pass
    return current_memory_bytes(device)


def cuda_memory_stats(device: torch.device) -> dict[str, int]:
    """Peak allocated/reserved/active bytes since the last peak reset, and allocation retries and OOMs since the
    process started (hfdist never resets the accumulated counters) (CUDA only)."""
    if device.type != "cuda":
        return {}
    s = torch.cuda.memory_stats(device)
    return {
        "peak_allocated_bytes": int(s.get("allocated_bytes.all.peak", 0)),
        "peak_reserved_bytes": int(s.get("reserved_bytes.all.peak", 0)),
        "peak_active_bytes": int(s.get("active_bytes.all.peak", 0)),
        "alloc_retries": int(s.get("num_alloc_retries", 0)),
        "ooms": int(s.get("num_ooms", 0)),
    }


@contextmanager
def saved_tensor_bytes(model: torch.nn.Module | None = None) -> Iterator[dict[str, int]]:
    """Bytes of the tensors autograd saves for backward inside the block (parameters of `model` excluded): the
    activation memory that peak RSS cannot isolate. Yields {"bytes": n}, filled as the block runs.

    Storages are counted once (views share them; local shards of DTensors are what a rank holds).
    """
    params = {held_tensor(p).untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()
    seen: set[int] = set()
    total = {"bytes": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = held_tensor(t).untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            total["bytes"] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensors that ops create while the mode is on: the activation-ish peak of a step on CPU.

    CPU has no allocator statistics, so this counts storages directly. A storage counts from the op that creates it
    (an output whose storage is none of the op's inputs', so views and in-place ops add nothing) until it is freed.
    Tensors that exist before the mode is entered are not counted: parameters, gradients that backward accumulates
    in place, buffers allocated earlier. Tensor subclasses that wrap others (DTensor, functional collectives'
    AsyncCollectiveTensor) own no memory: the plain tensors their ops create are what is counted. `largest` is the
    biggest single storage an op created (bytes), and `largest_op` that op: what shows an S x S tensor.

    FSDP2's unsharded parameters are the exception: FSDP2 keeps their storages for the model's life and gives them
    memory by resizing them in place (free to 0 bytes after a layer's use, back to full before the next), which no op
    shows. They are given as `resized` (hfdist.torch_private.fsdp_unsharded_storages) and found at FSDP2's copy-out
    op, and counted at their current size: read again where they are filled (the copy-out of an all-gather's result,
    or a copy into one of them, as FSDP2 does on one rank) and wherever the count could set a new peak (so a storage
    FSDP2 freed since is not counted there); reading them at every op would slow the counted step by a third.
    """

    def __init__(self, resized: Iterable[torch.UntypedStorage] = ()) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest = 0
        self.largest_op = ""
        self._tracked: weakref.WeakSet = weakref.WeakSet()
        # FSDP2's unsharded parameters' storages, by identity (the storage implementation's address).
        self._resized: dict[int, torch.UntypedStorage] = {s._cdata: s for s in resized}
        self._resized_bytes = self._read_resized()  # exact after a fill, at most that since
        self._copy_out = _fsdp_copy_out_op()

    def _read_resized(self) -> int:
        return sum(s.nbytes() for s in self._resized.values())

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def _note(self) -> None:
        """A moment the live bytes may peak: FSDP2's resized storages are read again only if they could matter."""
        if self.live + self._resized_bytes > self.peak:
            self._resized_bytes = self._read_resized()
            self.peak = max(self.peak, self.live + self._resized_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._copy_out is not None and func._overloadpacket is self._copy_out:
            for target in kwargs["out"]:
                storage = target.untyped_storage()
                self._resized[storage._cdata] = storage
            self._resized_bytes = self._read_resized()
            self._note()
            return out
        if func is torch.ops.aten.copy_.default and args[0].untyped_storage()._cdata in self._resized:
            self._resized_bytes = self._read_resized()
            self._note()
            return out
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if type(t) not in (torch.Tensor, torch.nn.Parameter):
                continue  # not a tensor, or a subclass wrapping tensors counted on their own
            storage = t.untyped_storage()
            if id(storage) in inputs or storage in self._tracked:
                continue
            nbytes = storage.nbytes()
            self._tracked.add(storage)
            weakref.finalize(storage, self._free, nbytes)
            self.live += nbytes
            self._note()
            if nbytes > self.largest:
                self.largest, self.largest_op = nbytes, str(func)
        return out


def _fsdp_copy_out_op():
    """FSDP2's op that copies an all-gather's result into the unsharded parameters (torch.ops.fsdp, registered when
    FSDP2 is imported: an FSDP2 model has imported it), or None."""
    import sys

    if "torch.distributed.fsdp" not in sys.modules:
        return None
    return getattr(torch.ops.fsdp, "split_with_sizes_copy", None)
