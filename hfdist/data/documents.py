"""Rows -> tokenised documents on disk, in shards, in bounded memory; resumable; read back a window at a time.

    rows (hfdist.data.reading: batches of BATCH_ROWS) --(workers: encode_rows)--> documents
         --> FOLDER/SSS-KKKKKK.tokens  every token of shard K of source S: uint32, the id | 1 << 31 where it is a label
             FOLDER/SSS-KKKKKK.docs.npy   per document: length, source row, note (encode.Note), label tokens
             FOLDER/SSS.json              the source is complete: its rows and format
             FOLDER/plan.json             what the documents depend on (sources' fingerprints, tokenizer, template,
                                          seq_len, policy, shard size): another plan starts the folder afresh

A shard is SHARD_ROWS consecutive rows of one source, written when its last batch is tokenised (tokens first, then
its .docs.npy, each atomically): a preparation killed at any point resumes at the first shard without .docs.npy and
writes the same bytes it would have. At most IN_FLIGHT_PER_WORKER batches per worker are read ahead of what is
written, so memory does not grow with the dataset; what is kept is a few bytes of metadata per document.
`Documents.gather` reads the tokens of any documents back, mapping one shard at a time.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hfdist.data.encode import encode_rows
from hfdist.data.reading import BATCH_ROWS, RowBatch, SourceReader, batch_columns
from hfdist.errors import DataError

__all__ = ["SHARD_ROWS", "IN_FLIGHT_PER_WORKER", "DOC_DTYPE", "SourcePlan", "Documents", "tokenize_sources",
           "LABEL_BIT"]

SHARD_ROWS = 1 << 14  # rows per shard: the unit of resumption
IN_FLIGHT_PER_WORKER = 2  # batches read ahead of the writer, per worker
LABEL_BIT = np.uint32(1 << 31)
DOC_DTYPE = np.dtype([("length", "<i4"), ("row", "<i4"), ("note", "i1"), ("labels", "<i4")])
_PLAN = "plan.json"


@dataclass(frozen=True)
class SourcePlan:
    """How one source's rows are read: its name, format and fields (field -> column), and how messages name it
    (`where`: "" for a job's only source, else "--dataset NAME: "; `file`: its path, for a JSON line's errors)."""

    name: str
    format: str
    fields: dict[str, str]
    where: str = ""
    file: str = ""


# -- tokenisation (in the workers, or in this process with one) -------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer, plans: Sequence[SourcePlan], seq_len: int, long_documents: str) -> None:
    _WORKER.update(tokenizer=tokenizer, plans=plans, seq_len=seq_len, long_documents=long_documents)


def _init_pool_worker(*init_args) -> None:
    # One core a worker: the tokenizer's own threads would make num_proc workers contend for the same cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _init_worker(*init_args)


def encode_batch(batch: RowBatch) -> tuple[np.ndarray, np.ndarray]:
    """One batch of rows -> (the documents' tokens as uint32 words, their DOC_DTYPE records), in the worker."""
    plan = _WORKER["plans"][batch.source]
    columns = batch_columns(batch, plan.fields, plan.file)
    rows = list(range(batch.first_row, batch.first_row + batch.rows))
    try:
        docs = encode_rows(columns, rows, format_name=plan.format, tokenizer=_WORKER["tokenizer"],
                           seq_len=_WORKER["seq_len"], long_documents=_WORKER["long_documents"])
    except DataError as exc:
        raise DataError(f"{plan.where}{exc}") from None
    lengths = np.fromiter(map(len, docs["input_ids"]), dtype=np.int64, count=len(docs["input_ids"]))
    total = int(lengths.sum())
    ids = np.fromiter((t for doc in docs["input_ids"] for t in doc), dtype=np.uint32, count=total)
    labelled = np.fromiter((t != -100 for doc in docs["labels"] for t in doc), dtype=bool, count=total)
    meta = np.empty(len(lengths), dtype=DOC_DTYPE)
    meta["length"], meta["row"], meta["note"] = lengths, docs["row"], docs["note"]
    counted = np.r_[0, np.cumsum(labelled, dtype=np.int64)]
    ends = np.cumsum(lengths)
    meta["labels"] = counted[ends] - counted[ends - lengths]
    return ids | (labelled.astype(np.uint32) << 31), meta


def _encoded(batches: Iterator[RowBatch], num_proc: int, init_args: tuple) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`encode_batch` of every batch, in order; with num_proc > 1 in forked workers, at most IN_FLIGHT_PER_WORKER
    batches per worker ahead of the consumer."""
    if num_proc <= 1:
        _init_worker(*init_args)
        yield from map(encode_batch, batches)
        return
    with multiprocessing.get_context("fork").Pool(num_proc, initializer=_init_pool_worker, initargs=init_args) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(encode_batch, (batch,)))
            if len(pending) >= IN_FLIGHT_PER_WORKER * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _atomic_save(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


class _ShardWriter:
    """One source's shards as the batches arrive: tokens appended to a temporary file, records kept until the
    shard's last row, then both made final (tokens first)."""

    def __init__(self, folder: Path, source: int, first_shard: int, shard_rows: int) -> None:
        self.folder, self.source, self.shard, self.shard_rows = folder, source, first_shard, shard_rows
        self.rows = first_shard * shard_rows
        self._records: list[np.ndarray] = []
        self._tokens = None

    def _name(self, suffix: str) -> Path:
        return self.folder / f"{self.source:03d}-{self.shard:06d}{suffix}"

    def add(self, words: np.ndarray, records: np.ndarray, rows: int) -> None:
        if self._tokens is None:
            self._tokens = open(self._name(".tokens.tmp"), "wb")
        words.tofile(self._tokens)
        self._records.append(records)
        self.rows += rows
        if self.rows % self.shard_rows == 0:
            self._close()

    def _close(self) -> None:
        if self._tokens is None:
            return
        self._tokens.close()
        os.replace(self._name(".tokens.tmp"), self._name(".tokens"))
        records = np.concatenate(self._records)
        _atomic_save(self._name(".docs.npy"), lambda tmp: np.save(open(tmp, "wb"), records))
        self._records, self._tokens = [], None
        self.shard += 1

    def finish(self, fmt: str) -> None:
        self._close()
        (self.folder / f"{self.source:03d}.json").write_text(json.dumps({"rows": self.rows, "format": fmt,
                                                                         "shards": self.shard}))


def _completed_shards(folder: Path, source: int) -> int:
    """How many shards of `source` from the first are complete (a later one is redone)."""
    shard = 0
    while (folder / f"{source:03d}-{shard:06d}.docs.npy").is_file():
        shard += 1
    return shard


def _start_folder(folder: Path, plan: dict) -> None:
    """Keep `folder`'s documents if they were made by `plan`, else start it afresh; drop half-written files."""
    written = folder / _PLAN
    if folder.is_dir() and (not written.is_file() or json.loads(written.read_text()) != plan):
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.tmp"):
        stale.unlink()
    if not written.is_file():
        _atomic_save(written, lambda tmp: tmp.write_text(json.dumps(plan, indent=1)))


def tokenize_sources(readers: Sequence[SourceReader], plans: Sequence[SourcePlan], folder: Path, plan: dict, *,
                     tokenizer, seq_len: int, long_documents: str, num_proc: int, shard_rows: int = SHARD_ROWS,
                     progress: Callable[[int], None] = lambda rows: None) -> "Documents":
    """Every row of every source tokenised into `folder` (module docstring), resuming what a run with the same
    `plan` left; `progress(rows)` after each batch. `shard_rows` (a multiple of BATCH_ROWS) is part of the plan.

    Raises:
        DataError: a malformed row or file (named), or a row too long under long_documents="error".
    """
    _start_folder(folder, plan)
    todo = [(r, _completed_shards(folder, r.index)) for r in readers
            if not (folder / f"{r.index:03d}.json").is_file()]
    if shard_rows % BATCH_ROWS:
        raise ValueError(f"shard_rows must be a multiple of {BATCH_ROWS}, got {shard_rows}")
    for reader, done in todo:
        progress(done * shard_rows)

    sent: deque = deque()  # (source, rows) of each batch handed to the workers, in order

    def batches() -> Iterator[RowBatch]:
        for reader, done in todo:
            for batch in reader.batches(done * shard_rows, list(plans[reader.index].fields.values())):
                sent.append((batch.source, batch.rows))
                yield batch

    writers = {r.index: _ShardWriter(folder, r.index, done, shard_rows) for r, done in todo}
    for words, records in _encoded(batches(), num_proc, (tokenizer, plans, seq_len, long_documents)):
        source, rows = sent.popleft()
        writers[source].add(words, records, rows)
        progress(rows)
    for index, writer in writers.items():
        writer.finish(plans[index].format)
    return Documents.read(folder, len(readers))


class Documents:
    """The tokenised documents of every source (metadata in memory: 13 bytes per document), their tokens on disk.

    Attributes:
        lengths, rows, notes, labels: per document (int32, int32 source row, int8 Note, int32 label tokens), every
            source's in order.
        source_first: the first document of each source (and the end): source s is [source_first[s],
            source_first[s + 1]).
        source_rows: each source's row count; formats: each source's format.
    """

    def __init__(self, folder: Path, records: list[np.ndarray], shard_paths: list[Path], shard_first: np.ndarray,
                 source_first: np.ndarray, source_rows: list[int], formats: list[str]) -> None:
        self.folder = folder
        self.lengths = np.concatenate([r["length"] for r in records]) if records else np.zeros(0, np.int32)
        self.rows = np.concatenate([r["row"] for r in records]) if records else np.zeros(0, np.int32)
        self.notes = np.concatenate([r["note"] for r in records]) if records else np.zeros(0, np.int8)
        self.labels = np.concatenate([r["labels"] for r in records]) if records else np.zeros(0, np.int32)
        self.shard_paths, self.shard_first = shard_paths, shard_first
        self.source_first, self.source_rows, self.formats = source_first, source_rows, formats
        self._starts: np.ndarray | None = None

    @classmethod
    def read(cls, folder: Path, sources: int) -> "Documents":
        """The documents a complete folder holds (every source's SSS.json written)."""
        records, paths, shard_first, source_first, rows, formats = [], [], [0], [0], [], []
        for s in range(sources):
            info = json.loads((folder / f"{s:03d}.json").read_text())
            rows.append(info["rows"])
            formats.append(info["format"])
            for k in range(info["shards"]):
                record = np.load(folder / f"{s:03d}-{k:06d}.docs.npy")
                records.append(record)
                paths.append(folder / f"{s:03d}-{k:06d}.tokens")
                shard_first.append(shard_first[-1] + len(record))
            source_first.append(shard_first[-1])
        return cls(folder, records, paths, np.asarray(shard_first, np.int64), np.asarray(source_first, np.int64),
                   rows, formats)

    def __len__(self) -> int:
        return len(self.lengths)

    def source_of(self, docs: np.ndarray) -> np.ndarray:
        """The source of each of `docs`."""
        return np.searchsorted(self.source_first, docs, side="right") - 1

    def gather(self, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens of `docs`, one after another: (uint32 words, offsets: doc i is words[offsets[i]:offsets[i+1]]).
        Each shard is memory-mapped once, for the documents it holds, and unmapped before the next."""
        if self._starts is None:  # where each document starts in its shard's file
            ends = np.cumsum(self.lengths, dtype=np.int64)
            shard_base = np.r_[0, ends][self.shard_first[:-1]]
            self._starts = ends - self.lengths - np.repeat(shard_base, np.diff(self.shard_first))
        lengths = self.lengths[docs].astype(np.int64)
        offsets = np.r_[0, np.cumsum(lengths)]
        out = np.empty(int(offsets[-1]), dtype=np.uint32)
        shard = np.searchsorted(self.shard_first, docs, side="right") - 1
        by_shard = np.argsort(shard, kind="stable")
        cuts = np.flatnonzero(np.diff(shard[by_shard])) + 1
        for part in np.split(by_shard, cuts) if len(docs) else []:
            mapped = np.memmap(self.shard_paths[int(shard[part[0]])], dtype=np.uint32, mode="r")
            n = lengths[part]
            within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            out[np.repeat(offsets[part], n) + within] = mapped[np.repeat(self._starts[docs[part]], n) + within]
            del mapped  # unmapped: the pages read do not stay in this process
        return out, offsets
