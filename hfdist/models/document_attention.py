"""Document attention: packed documents kept apart in O(tokens) memory, with no S x S tensor, on any device.

The batch carries its document boundaries as flash-attention's varlen arguments (`cu_seq_lens_q/k`: every
document's start in the rows flattened into one sequence, and the total; `varlen_kwargs` builds them from the
position ids, for hfdist.data.collation), and this attention function, registered with transformers'
AttentionInterface under DOCUMENT_ATTENTION, attends each document on its own:

    q (B, H, S, D), k / v (B, KV, S, D)  ->  each row split at its documents' boundaries (views, no copy)
    -> per document: torch's scaled_dot_product_attention with is_causal (grouped-query attention inside the
    kernel) -> concatenated back: (B, S, H, D), what every transformers attention returns.

Why this formulation: per-document sdpa with is_causal is linear in the tokens, faster than the documents padded
into one batch and than one sdpa call with the (S, S) block-diagonal mask, and sdpa's own grouped-query path beats
repeating the kv heads (the figures: docs/attention.md, "How it works"). Splitting (not slicing) the rows keeps the
backward O(tokens): split's backward concatenates the gradients, where each slice's backward would write a zero
tensor of the whole sequence.

Exactness: every document sees exactly the keys it would see alone (causal, and within the model's sliding
window when the window is shorter than the document: a band mask of that document only, O(doc_len^2)), with the
scaling, softcapping and dropout the model passes; runs of one-token segments (packing's padding) attend only to
themselves, so their output is their value, computed without a kernel call per token.

The mask function registered under the same name keeps transformers from building any mask in training (no KV
cache, no padding: it returns None), and gives the dense mask transformers would build for sdpa only where a cache
or a padding mask is in play (generation), in which case the attention runs as sdpa with it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hfdist.errors import HfdistError
from hfdist.models.attention import DOCUMENT_ATTENTION
from hfdist.models.kv_heads import repeat_kv_heads

__all__ = ["DOCUMENT_ATTENTION", "DocumentAttentionError", "varlen_kwargs", "document_lengths",
           "document_attention", "document_mask", "register_document_attention"]


class DocumentAttentionError(HfdistError, ValueError):
    """Document attention called without boundaries it can trust."""


def varlen_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """flash-attention varlen arguments for rows flattened into one sequence: every document's start (and the
    total length) as int32 `cu_seq_lens_*`, the longest document as `max_length_*`."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    cu = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    longest = int(cu.diff().max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def document_lengths(cu_seq_lens: torch.Tensor) -> list[int]:
    """Segment lengths from cumulative boundaries (0, end_1, ..., total): what the flattened rows split into."""
    cu = cu_seq_lens.tolist()
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def _boundaries(query: torch.Tensor, kwargs: dict[str, Any]) -> list[int]:
    """The flattened rows' segment lengths: from cu_seq_lens_q when the batch carries them (the collator's), else
    from position ids of the attended length (0 starts a document, as the packed rows mark them), else one document
    per row. Raises when the position ids describe another length (a context-parallel chunk): guessing would attend
    across documents."""
    batch, seq = query.shape[0], query.shape[2]
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        lengths = document_lengths(cu)
        cu_k = kwargs.get("cu_seq_lens_k")
        same = cu_k is None or cu_k is cu or document_lengths(cu_k) == lengths
        if sum(lengths) != batch * seq or not same:
            raise DocumentAttentionError(
                f"Document attention got cu_seq_lens covering {sum(lengths)} tokens (q and k "
                f"{'equal' if same else 'different'}) for {batch} rows of {seq}: the boundaries belong to another "
                "batch. Build them from this batch's position ids (hfdist.models.document_attention.varlen_kwargs).")
        return lengths
    positions = kwargs.get("position_ids")
    if positions is None:
        return [seq] * batch
    if positions.shape[-1] != seq:
        raise DocumentAttentionError(
            f"Document attention got position ids for {positions.shape[-1]} tokens but attends {seq}, and no "
            "cu_seq_lens_q: under context parallelism the boundaries must come with the batch (hfdist's collator "
            "adds them).")
    return document_lengths(varlen_kwargs(positions.expand(batch, -1))["cu_seq_lens_q"])


def _rows(lengths: list[int], batch: int, seq: int) -> list[list[int]]:
    """The flattened rows' segment lengths, row by row (a document never crosses a row: packed rows start one)."""
    rows, current, filled = [], [], 0
    for n in lengths:
        current.append(n)
        filled += n
        if filled == seq:
            rows.append(current)
            current, filled = [], 0
        elif filled > seq:
            raise DocumentAttentionError(
                f"A document of the batch crosses the end of a row of {seq} tokens: packed rows must start a "
                "document at their first token (position id 0), as hfdist.data.prepare packs them.")
    return rows


def _runs(lengths: list[int]) -> list[tuple[int, bool]]:
    """Segments as (tokens, is_run_of_single_tokens): consecutive one-token segments merged into one run."""
    runs: list[tuple[int, bool]] = []
    for n in lengths:
        if n == 1 and runs and runs[-1][1]:
            runs[-1] = (runs[-1][0] + 1, True)
        else:
            runs.append((n, n == 1))
    return runs


def _band(n: int, window: int, device: torch.device) -> torch.Tensor:
    """(n, n) bool: query i sees key j iff 0 <= i - j < window (transformers' sliding-window rule)."""
    idx = torch.arange(n, device=device)
    diff = idx[:, None] - idx[None, :]
    return (diff >= 0) & (diff < window)


def _softcapped(q, k, v, scale: float, softcap: float, allowed: torch.Tensor | None, causal: bool,
                dropout: float, training: bool) -> torch.Tensor:
    """One document's attention with tanh softcapping (which sdpa has no argument for), as eager attention
    computes it: (1, heads, n, D) each; k / v already repeated to the query heads."""
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    n = q.shape[-2]
    if allowed is None and causal:
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    weights = F.dropout(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), p=dropout, training=training)
    return weights @ v


def _attend_document(q, k, v, *, scale: float | None, window: int | None, causal: bool, softcap: float | None,
                     dropout: float, training: bool) -> torch.Tensor:
    """(1, heads, n, D) query against (1, kv_heads, n, D) keys / values of one document -> (1, heads, n, D)."""
    n = q.shape[-2]
    allowed = _band(n, window, q.device) if causal and window is not None and window < n else None
    if softcap is not None:
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv_heads(k, groups), repeat_kv_heads(v, groups)
        return _softcapped(q, k, v, scale if scale is not None else q.shape[-1] ** -0.5, softcap, allowed, causal,
                           dropout, training)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout,
                                          is_causal=causal and allowed is None, scale=scale, enable_gqa=True)


# Outside torch.compile's graphs (a compiled decoder layer breaks around it): the documents' lengths are data, and a
# graph specialised on them would recompile for every batch.
@torch.compiler.disable
def document_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function (AttentionInterface): each document of the flattened rows attended on its
    own (see the module docstring).

    Args:
        query: (B, H, S, D); key, value: (B, KV, S, D), H a multiple of KV.
        attention_mask: None in training (the registered mask function builds none); a mask transformers built for
            a cache or padding, which sends the call to sdpa with it.
        kwargs: cu_seq_lens_q / cu_seq_lens_k (int32 boundaries of the flattened rows), or position_ids.

    Returns:
        (attention output (B, S, H, D), None): no attention weights, as with sdpa.

    Raises:
        DocumentAttentionError: boundaries that do not describe this batch.
    """
    if attention_mask is not None or query.shape[2] != key.shape[2]:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, softcap=softcap, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    batch, heads, seq, _ = query.shape
    groups = heads // key.shape[1]
    window = int(sliding_window) if sliding_window else None
    rows = []
    # Row by row, split along the sequence: views of q / k / v in whatever layout the model made them. Kept 4-D:
    # torch 2.13 sends 3-D grouped-query inputs to its math path, which materialises every head's n x n scores.
    # The rows are split too, not sliced: each slice's backward would write a zero tensor of the whole batch (B of
    # them per layer), split's concatenates the rows' gradients once.
    by_row = [t.split(1) for t in (query, key, value)]
    for r, lengths in enumerate(_rows(_boundaries(query, kwargs), batch, seq)):
        runs = _runs(lengths)
        outputs = []
        row = [t[r].split([n for n, _ in runs], dim=-2) for t in by_row]
        for (n, singles), q, k, v in zip(runs, *row):
            if singles:  # each token attends only to itself: softmax of one score is 1
                out = repeat_kv_heads(v, groups)
            else:
                out = _attend_document(q, k, v, scale=scaling, window=window, causal=causal, softcap=softcap,
                                       dropout=dropout, training=module.training)
            outputs.append(out.transpose(1, 2))
        rows.append(torch.cat(outputs, dim=1))
    # (B, S, H, D), contiguous: the model's reshape to (B, S, H * D) is a view.
    return torch.cat(rows), None


def document_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """transformers mask function (AttentionMaskInterface) for DOCUMENT_ATTENTION: None when every query attends
    keys of its own positions and nothing is padded (training, a first forward without cache), so no S x S mask
    exists; otherwise the mask sdpa would get (a KV cache or a padding mask: generation)."""
    trivial = (isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0 and q_length == kv_length
               and (attention_mask is None or bool(attention_mask[:, -kv_length:].all())))
    if trivial:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


def register_document_attention() -> None:
    """Make DOCUMENT_ATTENTION a valid `attn_implementation` of transformers models (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(DOCUMENT_ATTENTION, document_attention)
    AttentionMaskInterface.register(DOCUMENT_ATTENTION, document_mask)
