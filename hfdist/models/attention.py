"""Which attention implementation a run uses (`--attn-implementation`), whether it keeps packed documents apart, and
what it holds in memory. Torch-free: the command line, preflight and the planner read it before any process.

The choices, by what keeps a packed row's documents apart (hfdist.data.collation builds their inputs):

    flash_attention_2 / flash_attention_3 (flash-attn / FA3 packages, GPU), a kernels-hub flash kernel id:
        document boundaries (cu_seq_lens) only; varlen kernels, O(tokens) memory, no S x S anything.
    hfdist_documents (DOCUMENT_ATTENTION; hfdist.models.document_attention): the same boundaries, each document
        attended by torch's sdpa on its own; exact, O(tokens), on CPU and GPU alike.
    flex_attention (torch, GPU for training): position ids only; transformers builds a block-sparse BlockMask
        from them on the device (O((S/128)^2) block indices).
    sdpa / eager (explicit choices only): a dense (B, 1, S, S) mask built by the collator, and attention over
        all S x S pairs; sdpa saves the mask as an additive bias per layer, eager the S x S attention weights.

`auto` (the default) picks, on a GPU, the first importable of flash_attention_3, flash_attention_2, flex_attention
(hfdist_documents under context parallelism, whose all-to-all hands attention no BlockMask); on CPU
hfdist_documents. A choice that cannot keep documents apart or cannot run here is refused before any process.
"""

from __future__ import annotations

import importlib.util

from hfdist.errors import HfdistError

__all__ = ["AUTO", "DOCUMENT_ATTENTION", "DENSE_MASK", "CHOICES", "AttentionChoiceError", "is_hub_kernel",
           "takes_boundaries", "uses_dense_mask", "resolve_attention", "dense_mask_bytes"]

AUTO = "auto"
DOCUMENT_ATTENTION = "hfdist_documents"
DENSE_MASK = ("sdpa", "eager")
_FLASH_PACKAGES = {"flash_attention_3": "flash_attn_interface", "flash_attention_2": "flash_attn"}
CHOICES = (AUTO, *DENSE_MASK, *_FLASH_PACKAGES, "flex_attention", DOCUMENT_ATTENTION)


class AttentionChoiceError(HfdistError, ValueError):
    """An attention implementation that cannot keep packed documents apart, or cannot run on this machine."""


def is_hub_kernel(name: str) -> bool:
    """Whether `name` is a kernels-hub id ("org/repo", optionally ":function"), which transformers loads itself."""
    return "/" in name


def takes_boundaries(name: str) -> bool:
    """Whether the implementation keeps documents apart by the batch's cu_seq_lens (no mask): flash varlen kernels
    (packages or hub) and hfdist's document attention."""
    return name == DOCUMENT_ATTENTION or "flash" in name


def uses_dense_mask(name: str) -> bool:
    """Whether the implementation needs the collator's dense (B, 1, S, S) block-diagonal mask."""
    return name in DENSE_MASK


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _refuse(name: str, why: str) -> AttentionChoiceError:
    return AttentionChoiceError(
        f"--attn-implementation {name} {why} Use --attn-implementation auto (the default: flash varlen or flex on a "
        f"GPU, hfdist's exact per-document attention '{DOCUMENT_ATTENTION}' on CPU), or sdpa / eager to attend "
        "through a dense S x S document mask.")


def resolve_attention(requested: str, *, on_gpu: bool, training: bool = True, cp: int = 1) -> str:
    """The attention implementation a run uses for `requested` (a CHOICES entry or a kernels-hub id).

    Args:
        on_gpu: whether the run computes on CUDA.
        training: whether backward runs (flex attention has no CPU backward in torch 2.13).
        cp: the context-parallel degree (flex gets no BlockMask through hfdist's Ulysses exchange).

    Raises:
        AttentionChoiceError: an unknown name, a backend that is not installed or cannot run here, or one that
            cannot keep packed documents apart; one paragraph naming the fix.
    """
    if requested == AUTO:
        if not on_gpu:
            return DOCUMENT_ATTENTION
        for name, package in _FLASH_PACKAGES.items():
            if _importable(package):
                return name
        return "flex_attention" if cp == 1 else DOCUMENT_ATTENTION
    if requested in _FLASH_PACKAGES:
        if not _importable(_FLASH_PACKAGES[requested]):
            raise _refuse(requested, f"needs the '{_FLASH_PACKAGES[requested]}' package, which is not installed "
                                     f"here{'' if on_gpu else ' (and a GPU: this machine has none)'}.")
        if not on_gpu:
            raise _refuse(requested, "runs on CUDA GPUs only, and this machine has none.")
        return requested
    if requested == "flex_attention":
        if training and not on_gpu:
            raise _refuse(requested, "cannot train on CPU: torch's flex attention has no CPU backward "
                                     "(\"FlexAttention does not support backward on CPU\").")
        if cp > 1:
            raise _refuse(requested, f"cannot keep documents apart under context parallelism (cp={cp}): the "
                                     "Ulysses exchange attends the gathered sequence without the BlockMask "
                                     "transformers builds per chunk.")
        return requested
    if is_hub_kernel(requested):
        if "flash" not in requested.lower():
            raise _refuse(requested, "is a kernels-hub kernel hfdist cannot give document boundaries to: only "
                                     "flash-attention varlen kernels (e.g. kernels-community/flash-attn) keep "
                                     "packed documents apart without a mask.")
        if not on_gpu or not _importable("kernels"):
            raise _refuse(requested, "needs a CUDA GPU and the 'kernels' package (pip install kernels).")
        return requested
    if requested in (*DENSE_MASK, DOCUMENT_ATTENTION):
        return requested
    raise AttentionChoiceError(f"--attn-implementation {requested} is not one hfdist knows: choose one of "
                               f"{', '.join(CHOICES)}, or a kernels-hub flash kernel id (org/repo).")


def dense_mask_bytes(name: str, *, seq: int, micro_batch: int, heads: int, elem: int) -> tuple[int, int]:
    """(mask bytes, bytes saved per layer) a dense-mask implementation holds on one rank for `micro_batch` rows of
    `seq` tokens, beyond the activations every implementation saves (hfdist.models.shape), with `heads` attention
    heads on the rank and activations of `elem` bytes; (0, 0) for every implementation without an S x S tensor.

    sdpa: the collator's bool mask (1 byte per entry), and the additive bias of the activation dtype sdpa makes of it
    and saves for backward in each layer (under context parallelism one copy serves every layer,
    hfdist.parallel.context). eager: its float32 mask, and per layer and head the S x S softmax output it saves
    (fp32, plus its cast to the activation dtype when that is narrower).
    """
    entries = micro_batch * seq * seq
    if name == "sdpa":
        return entries, entries * elem
    if name == "eager":
        return entries * 4, entries * heads * (4 + (elem if elem < 4 else 0))
    return 0, 0
