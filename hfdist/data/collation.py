"""Packed rows -> the model's keyword arguments, with attention that keeps every document to itself.

A packed row's documents are marked by its position ids (0 where each starts). What the batch carries besides them
depends on the attention implementation the run uses (`--attn-implementation`, hfdist.models.attention):
- document boundaries, no mask (hfdist_documents, the default on CPU; flash_attention_2/3 and kernels-hub flash
  kernels, the default on a GPU where flash-attn is installed): the rows as one flattened varlen batch,
  `cu_seq_lens_q/k` (every document's start, and the end; int32) and `max_length_q/k`. O(documents) bytes; the
  attention attends each document on its own (transformers hands them to flash_attn_varlen_func; hfdist's document
  attention, hfdist.models.document_attention, runs torch's sdpa per document).
- flex_attention: nothing besides the position ids, from which transformers builds a block-sparse BlockMask on the
  device; it does so only without a KV cache, so the batch says `use_cache=False`.
- sdpa (explicit choice): a 4-D boolean mask (B, 1, S, S), True where a token may attend (same document, not
  later). B x S x S bytes, 128 MiB for 8 rows of 4096 tokens, and sdpa saves an additive copy of it (of the
  activation dtype) for backward in every layer; a mask also rules out sdpa's flash kernel.
- eager (explicit choice): the same mask as additive floats (0 / dtype minimum, 4 bytes per entry), which eager
  attention adds to the full S x S scores.
Position ids always go along: RoPE restarts with every document, and the boundaries travel with the batch (under
pipeline parallelism each stage rebuilds the varlen arguments of its micro-batch from them; under context
parallelism the batch's boundaries describe the whole rows, which every rank attends after its all-to-all).

Position ids alone are not enough under sdpa/eager: transformers 5.23 derives a packed mask from them only when no
attention mask and no KV cache are given, and a model builds a cache whenever `use_cache` is on (its config
default), so a plain forward mixes the documents (measured; tests/unit/test_data_exactness.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hfdist.errors import DataError
from hfdist.models.attention import DENSE_MASK, takes_boundaries, uses_dense_mask
from hfdist.models.document_attention import varlen_kwargs

__all__ = ["document_ids", "block_causal_mask", "varlen_kwargs", "attention_inputs", "sliding_window_for",
           "collate", "collator_for"]


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) -> (B, S): the index of each token's document within its row (a new one wherever position is 0)."""
    return (position_ids == 0).cumsum(-1)


def block_causal_mask(position_ids: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """(B, S) position ids -> (B, 1, S, S) bool: query i may attend key j iff j <= i, both in one document, and
    (with a sliding window) i - j < window, the window rule of transformers' sliding-window mask."""
    doc = document_ids(position_ids)
    idx = torch.arange(position_ids.shape[-1], device=position_ids.device)
    allowed = (doc[:, :, None] == doc[:, None, :]) & (idx[:, None] >= idx[None, :])
    if sliding_window is not None:
        allowed &= (idx[:, None] - idx[None, :]) < sliding_window
    return allowed[:, None]


def attention_inputs(position_ids: torch.Tensor, attn_implementation: str = "sdpa",
                     sliding_window: int | None = None) -> dict[str, Any]:
    """What the model needs besides position ids to keep each row's documents apart (see the module docstring).

    Raises:
        DataError: an attention implementation hfdist cannot give document boundaries to.
    """
    if takes_boundaries(attn_implementation):
        return varlen_kwargs(position_ids)
    if attn_implementation == "flex_attention":
        return {"use_cache": False}
    if not uses_dense_mask(attn_implementation):
        raise DataError(f"The model uses the '{attn_implementation}' attention implementation; hfdist keeps packed "
                        f"documents apart under hfdist_documents, flash-attention, flex_attention and "
                        f"{', '.join(DENSE_MASK)}. Pick one with --attn-implementation (default auto).")
    allowed = block_causal_mask(position_ids, sliding_window)
    if attn_implementation == "sdpa":
        return {"attention_mask": allowed}
    return {"attention_mask": torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)}


def sliding_window_for(config, seq_len: int) -> int | None:
    """The window the dense packed mask must apply: None when no layer slides, the window covers --seq-len, or the
    implementation takes no dense mask (document boundaries and flex apply each layer's window themselves).

    Raises:
        DataError: some layers slide (with a window shorter than seq_len) and others do not; one 4-D mask serves
            every layer, so it cannot be both.
    """
    from hfdist.models.registry import facts_for, is_supported

    window = getattr(config, "sliding_window", None)
    if not uses_dense_mask(getattr(config, "_attn_implementation", None) or "sdpa") or not window or window >= seq_len:
        return None
    if is_supported(config):
        kinds = set(facts_for(config).mask_kinds(config))
    else:
        kinds = set(getattr(config, "layer_types", None) or ["sliding_attention"])
    if kinds == {"sliding_attention"}:
        return int(window)
    if "sliding_attention" not in kinds:
        return None
    raise DataError(f"The model mixes sliding-window ({window} tokens) and full-attention layers, and --seq-len "
                    f"{seq_len} exceeds the window: one packed attention mask cannot serve both kinds. Use "
                    f"--seq-len <= {window}, or --attn-implementation auto (which applies each layer's window itself).")


def collate(rows: Sequence[Mapping[str, Any]], attn_implementation: str = "sdpa",
            sliding_window: int | None = None) -> dict[str, Any]:
    """Packed rows (from `prepare`) -> keyword arguments for the model: input_ids, labels, position_ids (B, S)
    int64, plus the attention inputs of `attn_implementation` (`attention_inputs`).

    Raises:
        DataError: a row whose position ids do not start a document at its first token (not a packed row).
    """
    batch = {key: torch.from_numpy(np.asarray([row[key] for row in rows], dtype=np.int64))
             for key in ("input_ids", "labels", "position_ids")}
    if (batch["position_ids"][:, 0] != 0).any():
        raise DataError("collate takes packed rows from hfdist.data.prepare: every row's position ids start at 0.")
    return {**batch, **attention_inputs(batch["position_ids"], attn_implementation, sliding_window)}


def collator_for(config, seq_len: int, attention: str | None = None) -> Callable[[Sequence[Mapping[str, Any]]],
                                                                          dict[str, Any]]:
    """`collate` set for a model config: its attention implementation (or `attention`, where the model computes with
    another than its config says: hfdist.api.prepare_model's record) and sliding window (picklable, for DataLoader
    workers)."""
    implementation = attention or getattr(config, "_attn_implementation", None) or "sdpa"
    window = sliding_window_for(config, seq_len)
    attention_inputs(torch.zeros(1, 2, dtype=torch.long), implementation, window)  # refuse an unknown one now
    return functools.partial(collate, attn_implementation=implementation, sliding_window=window)
