"""Grouped-query attention's key / value heads matched to the query heads: the one repeat every attention path of
hfdist uses (document attention, Ulysses' head exchange, the ring's block kernels), and its backward.

Head h of the queries reads key / value head h // (heads / kv_heads), transformers' `repeat_kv` order.
"""

from __future__ import annotations

import torch

__all__ = ["repeat_kv_heads", "sum_kv_groups"]


def repeat_kv_heads(t: torch.Tensor, times: int) -> torch.Tensor:
    """(B, KV, n, D) -> (B, KV x times, n, D): each key / value head repeated for its group of `times` query
    heads (t itself when times is 1)."""
    return t if times == 1 else t.repeat_interleave(times, dim=1)


def sum_kv_groups(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, n, D) gradients of repeated heads -> (B, kv_heads, n, D): each group summed (repeat_kv_heads'
    backward)."""
    b, h, n, d = t.shape
    return t if h == kv_heads else t.view(b, kv_heads, h // kv_heads, n, d).sum(2)
