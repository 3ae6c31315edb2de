"""Documents -> fixed-length blocks: best-fit-decreasing placement of whole documents, padding at the end.

Every block is `seq_len` tokens (a fixed batch shape: stable step time, one pipeline schedule). A packed row holds
- input_ids: its documents one after another, then padding (the pad token);
- labels: each document's labels, IGNORE_INDEX on the padding;
- position_ids: 0, 1, ... restarting at every document, and 0 on every padding token.
The position ids are the row's document boundaries (a document starts where its position is 0; each padding token
is a one-token segment of its own, since documents are never shorter than two tokens); `hfdist.data.collate` turns
them into block-diagonal causal attention. Best-fit-decreasing puts each document, longest first, into the open
block it fills best, which leaves little padding (benchmarks/bench_packing.py measures it).
"""

from __future__ import annotations

import numpy as np

from hfdist.models.registry import IGNORE_INDEX

__all__ = ["assign_blocks", "best_fit_decreasing", "pack_arrays", "padding_per_row"]

_CHUNK = 1 << 16  # documents placed per batch of Python ints


def assign_blocks(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit-decreasing placement: each document, longest first (ties in index order), goes into the block whose
    free space it fills best (of several, the one that reached that free space last), or a new block.
    Deterministic. Every length must be in [1, capacity].

    Returns:
        (block of each document, the documents in placement order): block b holds, in order, the documents of
        `order` whose block is b. int32 / int64 numpy arrays: about 20 bytes per document at the peak, for datasets
        of any size.
    """
    lengths = np.asarray(lengths)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"document lengths must lie in [1, {capacity}], got [{lengths.min()}, {lengths.max()}]")
    # Open blocks by free space, as stacks: top[c] is the last block left with c tokens free (-1: none), below[b]
    # the block under b in its stack; has_free[c] says whether top[c] holds one.
    has_free = np.zeros(capacity + 1, dtype=bool)
    top = [-1] * (capacity + 1)
    below = np.empty(len(lengths), dtype=np.int32)
    placed = np.argsort(-lengths.astype(np.int32), kind="stable").astype(np.int32)
    block_of = np.empty(len(lengths), dtype=np.int32)
    blocks = 0
    for first in range(0, len(placed), _CHUNK):  # Python ints a chunk at a time, not a list of every document
        chunk = placed[first:first + _CHUNK]
        for doc, need in zip(chunk.tolist(), lengths[chunk].tolist()):
            free = need + int(has_free[need:].argmax())  # the smallest free space that holds the document
            if has_free[free]:
                block = top[free]
                top[free] = int(below[block])
                has_free[free] = top[free] >= 0
            else:
                free, block = capacity, blocks
                blocks += 1
            block_of[doc] = block
            left = free - need
            if left:
                below[block] = top[left]
                top[left] = block
                has_free[left] = True
    # Grouped by block, each block's documents in the order they were placed.
    order = placed[np.argsort(block_of[placed], kind="stable")]
    return block_of, order


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Document indices per block, in placement order (`assign_blocks` as lists)."""
    block_of, order = assign_blocks(lengths, capacity)
    ends = np.cumsum(np.bincount(block_of, minlength=int(block_of.max()) + 1)) if len(order) else np.zeros(0, int)
    return [part.tolist() for part in np.split(order, ends[:-1])] if len(order) else []


def pack_arrays(values_ids: np.ndarray, values_labels: np.ndarray, offsets: np.ndarray, blocks: list[list[int]],
                seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """The packed rows as (n_blocks, seq_len) int32 arrays, gathered from flat token arrays: document d's tokens
    are values[offsets[d]:offsets[d + 1]]."""
    order = np.fromiter((d for block in blocks for d in block), dtype=np.int64)
    block_of = np.repeat(np.arange(len(blocks)), [len(b) for b in blocks])
    lengths = (offsets[order + 1] - offsets[order]).astype(np.int64)
    # Where each document starts in its block: the lengths of the documents before it in the same block.
    ends = np.cumsum(lengths)
    first_in_block = np.r_[0, np.flatnonzero(np.diff(block_of)) + 1]
    start_in_block = ends - lengths - np.repeat(ends[first_in_block] - lengths[first_in_block],
                                                np.diff(np.r_[first_in_block, len(order)]))
    within = np.arange(int(ends[-1]) if len(order) else 0) - np.repeat(ends - lengths, lengths)
    src = np.repeat(offsets[order], lengths) + within
    dst = np.repeat(block_of * seq_len + start_in_block, lengths) + within
    size = len(blocks) * seq_len
    ids = np.full(size, pad_id, dtype=np.int32)
    labels = np.full(size, IGNORE_INDEX, dtype=np.int32)
    positions = np.zeros(size, dtype=np.int32)
    ids[dst], labels[dst], positions[dst] = values_ids[src], values_labels[src], within
    shape = (len(blocks), seq_len)
    return {"input_ids": ids.reshape(shape), "labels": labels.reshape(shape), "position_ids": positions.reshape(shape)}


def padding_per_row(position_ids: np.ndarray) -> np.ndarray:
    """Padding tokens at the end of each packed row: the trailing run of position 0 (a document's last token
    never has position 0, since documents are at least two tokens long)."""
    position_ids = np.asarray(position_ids)
    last_doc_token = position_ids.shape[1] - 1 - np.argmax(position_ids[:, ::-1] != 0, axis=1)
    has_doc = (position_ids != 0).any(axis=1)
    return np.where(has_doc, position_ids.shape[1] - 1 - last_doc_token, position_ids.shape[1])
