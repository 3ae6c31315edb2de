"""Tokenized documents -> a packed Arrow file, written a window of blocks at a time.

Only the documents' lengths (a few bytes per document) and one window of blocks are ever in memory: the tokens are
read from the documents' Arrow table (memory-mapped from datasets' cache) for the documents of each window, packed
(hfdist.data.packing) and appended to the file, so a dataset larger than memory packs in bounded memory. The file
is what `datasets.Dataset.from_file` memory-maps: every rank and every later run reads it without a copy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hfdist.data.packing import assign_blocks, pack_arrays, padding_per_row
from hfdist.models.registry import IGNORE_INDEX

__all__ = ["PackedStats", "document_lengths", "write_packed", "KEYS"]

KEYS = ("input_ids", "labels", "position_ids")
_WINDOW_TOKENS = 1 << 24  # tokens per window: 3 int32 columns of 64 MiB each


@dataclass(frozen=True)
class PackedStats:
    """What a packed file holds: blocks, padding tokens, tokens that carry a label."""

    blocks: int
    padding_tokens: int
    label_tokens: int


def document_lengths(column) -> np.ndarray:
    """Tokens of every document of a list<int> Arrow column (from its offsets; no token is read)."""
    import pyarrow.compute as pc

    parts = [pc.list_value_length(chunk).fill_null(0).to_numpy(zero_copy_only=False) for chunk in column.chunks]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _flat(column) -> tuple[np.ndarray, np.ndarray]:
    """A list<int> Arrow column as (values, offsets) numpy arrays, without a Python list in between."""
    import pyarrow as pa

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.values.to_numpy(zero_copy_only=False)
    return values[offsets[0]:offsets[-1]], offsets - offsets[0]


def _schema(seq_len: int):
    import pyarrow as pa

    return pa.schema([(key, pa.list_(pa.int32(), seq_len)) for key in KEYS])


def write_packed(table, documents: np.ndarray, seq_len: int, pad_id: int, path: Path, desc: str) -> PackedStats:
    """Pack `documents` (row indices of `table`, an Arrow table with input_ids and labels, each at least one token
    long) into blocks of `seq_len` tokens by best-fit-decreasing, and write them to `path` atomically.

    Args:
        desc: the progress bar's label (datasets' progress bars: `datasets.disable_progress_bars()` hides it).
    """
    import pyarrow as pa
    from datasets.arrow_writer import ArrowWriter
    from datasets.utils import tqdm as progress

    ids_column, labels_column = table.column("input_ids"), table.column("labels")
    block_of, order = assign_blocks(document_lengths(ids_column)[documents], seq_len)
    in_order, blocks_in_order = documents[order], block_of[order]
    n_blocks = int(block_of.max()) + 1 if len(block_of) else 0
    window = max(1, _WINDOW_TOKENS // seq_len)
    padding = labelled = 0
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with ArrowWriter(schema=_schema(seq_len), path=str(tmp)) as writer:
        for first in progress(range(0, n_blocks, window), desc=desc, unit="window", leave=False):
            start, end = np.searchsorted(blocks_in_order, [first, first + window])
            take = pa.array(in_order[start:end])
            ids, offsets = _flat(ids_column.take(take))
            labels, _ = _flat(labels_column.take(take))
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
