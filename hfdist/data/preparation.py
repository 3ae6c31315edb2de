"""`prepare`: a dataset and a tokenizer -> packed rows the model trains on; what became of the data, in one line.

    rows --(formats: detect, read, validate)--> samples --(chat: template, assistant spans)--> segments
         --(encode: tokenize, label, split long; parallel and cached by datasets)--> documents
         --(packing: best-fit-decreasing)--> blocks of seq_len: input_ids, labels, position_ids

Tokenization is a `datasets.map` (cached in the dataset's cache folder, keyed by the data, tokenizer, template,
seq_len and policy; a second run with the same inputs reads the cache). Packing runs in numpy over the documents'
Arrow buffers and is cached beside them the same way, so every rank of a run (rank 0 first) and every later run
memory-maps one file.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hfdist.data.chat import DEFAULT_TEMPLATE_NOTE, ensure_chat_template
from hfdist.data.encode import LONG_DOCUMENT_POLICIES, Note, encode_rows
from hfdist.data.errors import DataError
from hfdist.data.formats import detect_format
from hfdist.data.packing import best_fit_decreasing, pack_arrays, padding_per_row
from hfdist.models.registry import IGNORE_INDEX

__all__ = ["DataReport", "prepare", "prepare_with_report", "check_enough_blocks"]

_PACKING_VERSION = "bfd-1"  # part of the packed cache file's name: bump when the packed layout changes
_PARALLEL_FROM_ROWS = 20_000  # smaller datasets tokenize faster in one process than worker start-up takes


@dataclass(frozen=True)
class DataReport:
    """What `prepare` made of a dataset."""

    format: str
    rows: int
    documents: int
    split_rows: int
    truncated: int
    empty_rows: int
    dropped_rows: int
    blocks: int
    seq_len: int
    padding_tokens: int
    label_tokens: int
    default_template: bool
    seconds: float

    @property
    def padding_fraction(self) -> float:
        """Share of the blocks' tokens that are padding."""
        return self.padding_tokens / max(self.blocks * self.seq_len, 1)

    def line(self) -> str:
        """One line for the run's log."""
        text = (f"hfdist: data: {self.rows} {self.format} rows -> {self.documents} documents ({self.split_rows} rows "
                f"split, {self.truncated} answers truncated, {self.empty_rows} empty rows skipped, "
                f"{self.dropped_rows} dropped) -> {self.blocks} blocks of {self.seq_len} tokens, "
                f"{100 * self.padding_fraction:.1f}% padding, {self.label_tokens} label tokens "
                f"({self.seconds:.1f} s)")
        return text + (f"\nhfdist: {DEFAULT_TEMPLATE_NOTE}" if self.default_template else "")


def _default_num_proc(rows: int) -> int | None:
    if rows < _PARALLEL_FROM_ROWS:
        return None
    return max(1, min(len(os.sched_getaffinity(0)), 16))


def _documents(dataset, tokenizer, seq_len: int, long_documents: str, num_proc: int | None):
    fmt = detect_format(list(dataset.column_names))
    return fmt.name, dataset.map(
        encode_rows, batched=True, batch_size=256, with_indices=True, remove_columns=dataset.column_names,
        num_proc=num_proc if num_proc is not None else _default_num_proc(len(dataset)),
        fn_kwargs={"format_name": fmt.name, "tokenizer": tokenizer, "seq_len": seq_len,
                   "long_documents": long_documents},
        desc=f"hfdist: tokenize {fmt.name} rows for {seq_len}-token blocks")


def _flat(column) -> tuple[np.ndarray, np.ndarray]:
    """A list<int> Arrow column as (values, offsets) numpy arrays, without a Python list in between."""
    import pyarrow as pa

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.values.to_numpy(zero_copy_only=False)
    return values[offsets[0]:offsets[-1]], offsets - offsets[0]


def _matrix(packed, key: str, seq_len: int) -> np.ndarray:
    """A packed column as an (n_blocks, seq_len) numpy array read from Arrow (memory-mapped when cached)."""
    return packed.data.column(key).combine_chunks().flatten().to_numpy().reshape(-1, seq_len)


def _pack(docs, seq_len: int, pad_id: int):
    """The packed Dataset, cached next to the documents' cache file when they have one."""
    import datasets
    import pyarrow as pa
    from datasets.arrow_writer import ArrowWriter
    from datasets.fingerprint import Hasher

    cache = None
    if docs.cache_files:
        # The documents' fingerprint is what datasets itself keys their cache by (data, function, tokenizer).
        key = Hasher.hash((docs._fingerprint, seq_len, pad_id, _PACKING_VERSION))
        cache = Path(docs.cache_files[0]["filename"]).parent / f"hfdist-packed-{key}.arrow"
        if cache.is_file():
            return datasets.Dataset.from_file(str(cache))
    ids, offsets = _flat(docs.data.column("input_ids"))
    labels, _ = _flat(docs.data.column("labels"))
    lengths = np.diff(offsets)
    real = np.flatnonzero(lengths > 0)
    blocks = [[int(real[d]) for d in block] for block in best_fit_decreasing(lengths[real], seq_len)]
    packed = pack_arrays(ids, labels, offsets, blocks, seq_len, pad_id)
    table = pa.table({k: pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), seq_len)
                      for k, v in packed.items()})
    if cache is None:
        return datasets.Dataset(table)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    with ArrowWriter(path=str(tmp)) as writer:
        writer.write_table(table)
        writer.finalize()
    os.replace(tmp, cache)  # atomic: ranks and runs that read the cache never see half a file
    return datasets.Dataset.from_file(str(cache))


def prepare_with_report(dataset, tokenizer, seq_len: int, *, long_documents: str = "split",
                        num_proc: int | None = None):
    """`prepare`, and a DataReport of what it did. See `prepare`."""
    import datasets

    started = time.perf_counter()
    if isinstance(dataset, datasets.DatasetDict):
        dataset = dataset["train"]
    if long_documents not in LONG_DOCUMENT_POLICIES:
        raise DataError(f"long_documents must be one of {LONG_DOCUMENT_POLICIES}, got '{long_documents}'.")
    if seq_len < 2:
        raise DataError(f"--seq-len {seq_len} leaves no room for a document: use at least 2 (typically 512+).")
    defaulted = ensure_chat_template(tokenizer)
    # Padding is masked from loss and attention, so its id only has to be a valid one.
    pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    format_name, docs = _documents(dataset, tokenizer, seq_len, long_documents, num_proc)
    notes = docs.data.column("note").to_numpy()
    rows = docs.data.column("row").to_numpy()
    documents = int(np.isin(notes, (Note.WHOLE, Note.PIECE, Note.TRUNCATED)).sum())
    if documents == 0:
        raise DataError(
            f"Nothing to train on: of the dataset's {len(dataset)} {format_name} rows, {int((notes == Note.EMPTY).sum())} "
            f"have empty fields and {int((notes == Note.DROPPED).sum())} have no answer token within --seq-len "
            f"{seq_len} (a prompt that fills the block). Fill the empty fields, raise --seq-len, or pass another "
            "dataset.")
    packed = _pack(docs, seq_len, pad_id)
    report = DataReport(
        format=format_name, rows=len(dataset), documents=documents,
        split_rows=len(np.unique(rows[notes == Note.PIECE])), truncated=int((notes == Note.TRUNCATED).sum()),
        empty_rows=int((notes == Note.EMPTY).sum()), dropped_rows=int((notes == Note.DROPPED).sum()),
        blocks=len(packed), seq_len=seq_len,
        padding_tokens=int(padding_per_row(_matrix(packed, "position_ids", seq_len)).sum()),
        label_tokens=int((_matrix(packed, "labels", seq_len) != IGNORE_INDEX).sum()),
        default_template=defaulted, seconds=time.perf_counter() - started)
    return packed, report


def prepare(dataset, tokenizer, seq_len: int, *, long_documents: str = "split", num_proc: int | None = None):
    """Tokenize, label and pack a dataset into rows of `seq_len` tokens that keep documents apart.

    Args:
        dataset: a `datasets.Dataset` (or a DatasetDict: its "train" split) in one of the formats of
            hfdist.data.formats, detected from its columns.
        tokenizer: a HF tokenizer; one without a chat template gets hfdist's default (hfdist.data.chat).
        seq_len: tokens per packed row.
        long_documents: "split" (default) or "error" for documents longer than seq_len (hfdist.data.encode).
        num_proc: tokenization processes (default: one for small datasets, the available cores up to 16 else).

    Returns:
        A `datasets.Dataset` of packed rows: input_ids, labels, position_ids (seq_len int32 each); feed batches
        of them through `hfdist.data.collate`.

    Raises:
        DataError: unknown columns, a malformed row (named), a row too long under "error", or nothing to train on.
    """
    return prepare_with_report(dataset, tokenizer, seq_len, long_documents=long_documents, num_proc=num_proc)[0]


def check_enough_blocks(blocks: int, global_batch: int, seq_len: int) -> None:
    """Refuse a dataset that cannot fill one optimizer step.

    Raises:
        DataError: fewer packed rows than the global batch, with both numbers.
    """
    if blocks < global_batch:
        raise DataError(f"The dataset packs into {blocks} blocks of {seq_len} tokens, fewer than the "
                        f"--global-batch-size of {global_batch} that one optimizer step takes. Use more data, a "
                        f"--global-batch-size <= {blocks}, or a shorter --seq-len.")
