"""Tokenised documents -> a packed Arrow file, written a window of blocks at a time.

Only the documents' lengths (a few bytes per document) and one window of blocks are ever in memory: the placement
(hfdist.data.packing.assign_blocks) needs the lengths alone, and each window's documents are read from their shards
on disk (hfdist.data.documents.Documents.gather, one shard mapped at a time), packed and appended to the file, so a
dataset larger than memory packs in bounded memory. The file is what `datasets.Dataset.from_file` memory-maps:
every rank and every later run reads it without a copy; the same documents give the same bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hfdist.data.packing import assign_blocks, pack_arrays, padding_per_row
from hfdist.models.registry import IGNORE_INDEX

__all__ = ["PackedStats", "WINDOW_TOKENS", "write_packed", "KEYS"]

KEYS = ("input_ids", "labels", "position_ids")
WINDOW_TOKENS = 1 << 18  # tokens per window: packing a window holds about 80 bytes a token (20 MiB) at its peak


@dataclass(frozen=True)
class PackedStats:
    """What a packed file holds: blocks, padding tokens, tokens that carry a label."""

    blocks: int
    padding_tokens: int
    label_tokens: int


def _schema(seq_len: int):
    import pyarrow as pa

    return pa.schema([(key, pa.list_(pa.int32(), seq_len)) for key in KEYS])


def write_packed(documents, selected: np.ndarray, seq_len: int, pad_id: int, path: Path, desc: str) -> PackedStats:
    """Pack the `selected` documents (indices into `documents`, a hfdist.data.documents.Documents; each at least
    one token long) into blocks of `seq_len` tokens by best-fit-decreasing, and write them to `path` atomically.

    Args:
        desc: the progress bar's label (datasets' progress bars: `datasets.disable_progress_bars()` hides it).
    """
    import pyarrow as pa
    from datasets.arrow_writer import ArrowWriter
    from datasets.utils import tqdm as progress

    from hfdist.data.documents import LABEL_BIT

    block_of, order = assign_blocks(documents.lengths[selected], seq_len)
    in_order, blocks_in_order = selected[order], block_of[order]
    del order
    n_blocks = int(block_of.max()) + 1 if len(block_of) else 0
    del block_of
    window = max(1, WINDOW_TOKENS // seq_len)
    padding = labelled = 0
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with ArrowWriter(schema=_schema(seq_len), path=str(tmp)) as writer:
        for first in progress(range(0, n_blocks, window), desc=desc, unit="window", leave=False):
            start, end = np.searchsorted(blocks_in_order, [first, first + window])
            words, offsets = documents.gather(in_order[start:end])
            ids = (words & ~LABEL_BIT).astype(np.int32)
            labels = np.where(words & LABEL_BIT, ids, IGNORE_INDEX).astype(np.int32)
            cuts = np.flatnonzero(np.diff(blocks_in_order[start:end])) + 1
            local = [part.tolist() for part in np.split(np.arange(end - start), cuts)]
            packed = pack_arrays(ids, labels, offsets, local, seq_len, pad_id)
            padding += int(padding_per_row(packed["position_ids"]).sum())
            labelled += int((packed["labels"] != IGNORE_INDEX).sum())
            writer.write_table(pa.table({k: pa.FixedSizeListArray.from_arrays(pa.array(packed[k].reshape(-1)), seq_len)
                                         for k in KEYS}, schema=_schema(seq_len)))
        writer.finalize()
    os.replace(tmp, path)  # atomic: ranks and runs that read the file never see half of it
    return PackedStats(blocks=n_blocks, padding_tokens=padding, label_tokens=labelled)
