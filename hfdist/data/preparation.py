"""`prepare`: a dataset and a tokenizer -> packed rows the model trains on; what became of the data, in one line.

    rows --(formats: detect, read, validate)--> samples --(chat: template, assistant spans)--> segments
         --(encode: tokenize, label, split long; parallel and cached by datasets)--> documents
         --(held out: whole rows, drawn by the seed)--> training / evaluation documents
         --(packing: best-fit-decreasing, a window of blocks at a time)--> blocks of seq_len: input_ids, labels,
           position_ids

Tokenization is a `datasets.map` (cached in the dataset's cache folder, keyed by the data, tokenizer, template,
seq_len and policy; a second run with the same inputs reads the cache). Packing runs in numpy over the documents'
Arrow buffers (hfdist.data.packed_file) and is cached beside them the same way, so every rank of a run (rank 0
first) and every later run memory-maps one file.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hfdist.data.chat import DEFAULT_TEMPLATE_NOTE, ensure_chat_template
from hfdist.data.encode import LONG_DOCUMENT_POLICIES, Note, encode_rows
from hfdist.data.errors import DataError
from hfdist.data.formats import detect_format
from hfdist.data.packed_file import PackedStats, write_packed

__all__ = ["DataReport", "Split", "prepare", "prepare_with_report", "prepare_split", "held_out_rows",
           "check_enough_blocks", "PACKING_VERSION"]

PACKING_VERSION = "bfd-2"  # part of every packed file's key: bump when the packed layout changes
_PARALLEL_FROM_ROWS = 20_000  # smaller datasets tokenize faster in one process than worker start-up takes
_DOCUMENT = (Note.WHOLE, Note.PIECE, Note.TRUNCATED)


@dataclass(frozen=True)
class DataReport:
    """What `prepare` made of a dataset (or of one side of a held-out split)."""

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

    def line(self, what: str = "data") -> str:
        """One line for the run's log (`what`: "data", "eval data", ...)."""
        text = (f"hfdist: {what}: {self.rows} {self.format} rows -> {self.documents} documents ({self.split_rows} "
                f"rows split, {self.truncated} answers truncated, {self.empty_rows} empty rows skipped, "
                f"{self.dropped_rows} dropped) -> {self.blocks} blocks of {self.seq_len} tokens, "
                f"{100 * self.padding_fraction:.1f}% padding, {self.label_tokens} label tokens "
                f"({self.seconds:.1f} s)")
        return text + (f"\nhfdist: {DEFAULT_TEMPLATE_NOTE}" if self.default_template else "")


@dataclass(frozen=True)
class Split:
    """Training and held-out evaluation blocks from one dataset (`prepare_split`)."""

    train: object  # datasets.Dataset
    train_report: DataReport
    eval: object
    eval_report: DataReport


def _default_num_proc(rows: int) -> int | None:
    if rows < _PARALLEL_FROM_ROWS:
        return None
    return max(1, min(len(os.sched_getaffinity(0)), 16))


@dataclass
class _Documents:
    """A dataset tokenized into documents (a datasets.Dataset with input_ids, labels, row, note)."""

    format: str
    docs: object
    rows: int
    pad_id: int
    default_template: bool
    started: float

    def packed(self, keep: np.ndarray, seq_len: int, side: tuple, desc: str):
        """The documents `keep` selects (a mask over documents), packed and cached: (Dataset, PackedStats)."""
        import datasets
        from datasets.fingerprint import Hasher
        from datasets.table import InMemoryTable

        documents = np.flatnonzero(keep & np.isin(self.notes, _DOCUMENT))
        if not self.docs.cache_files:  # documents held in memory (a dataset built in Python): packed in memory too
            with tempfile.TemporaryDirectory(prefix="hfdist-packed-") as folder:
                stats = write_packed(self.docs.data, documents, seq_len, self.pad_id, Path(folder) / "p.arrow", desc)
                return datasets.Dataset(InMemoryTable.from_file(str(Path(folder) / "p.arrow"))), stats
        # The documents' fingerprint is what datasets itself keys their cache by (data, function, tokenizer).
        key = Hasher.hash((self.docs._fingerprint, seq_len, self.pad_id, PACKING_VERSION, side))
        folder = Path(self.docs.cache_files[0]["filename"]).parent
        path, stats_path = folder / f"hfdist-packed-{key}.arrow", folder / f"hfdist-packed-{key}.json"
        if path.is_file() and stats_path.is_file():
            return datasets.Dataset.from_file(str(path)), PackedStats(**json.loads(stats_path.read_text()))
        stats = write_packed(self.docs.data, documents, seq_len, self.pad_id, path, desc)
        stats_path.write_text(json.dumps(asdict(stats)))
        return datasets.Dataset.from_file(str(path)), stats

    @property
    def notes(self) -> np.ndarray:
        return self.docs.data.column("note").to_numpy()

    @property
    def source_rows(self) -> np.ndarray:
        return self.docs.data.column("row").to_numpy()

    def report(self, keep: np.ndarray, rows: int, stats: PackedStats, seq_len: int) -> DataReport:
        """What became of the rows whose documents `keep` selects."""
        notes, source = self.notes[keep], self.source_rows[keep]
        return DataReport(
            format=self.format, rows=rows, documents=int(np.isin(notes, _DOCUMENT).sum()),
            split_rows=len(np.unique(source[notes == Note.PIECE])), truncated=int((notes == Note.TRUNCATED).sum()),
            empty_rows=int((notes == Note.EMPTY).sum()), dropped_rows=int((notes == Note.DROPPED).sum()),
            blocks=stats.blocks, seq_len=seq_len, padding_tokens=stats.padding_tokens,
            label_tokens=stats.label_tokens, default_template=self.default_template,
            seconds=time.perf_counter() - self.started)


def _tokenized(dataset, tokenizer, seq_len: int, long_documents: str, num_proc: int | None) -> _Documents:
    """Every row of `dataset` as documents (tokenized, labelled, long ones split), refused when none is left."""
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
    fmt = detect_format(list(dataset.column_names))
    docs = dataset.map(
        encode_rows, batched=True, batch_size=256, with_indices=True, remove_columns=dataset.column_names,
        num_proc=num_proc if num_proc is not None else _default_num_proc(len(dataset)),
        fn_kwargs={"format_name": fmt.name, "tokenizer": tokenizer, "seq_len": seq_len,
                   "long_documents": long_documents},
        desc=f"hfdist: tokenize {fmt.name} rows for {seq_len}-token blocks")
    out = _Documents(fmt.name, docs, len(dataset), pad_id, defaulted, started)
    notes = out.notes
    if not np.isin(notes, _DOCUMENT).any():
        raise DataError(
            f"Nothing to train on: of the dataset's {len(dataset)} {fmt.name} rows, {int((notes == Note.EMPTY).sum())} "
            f"have empty fields and {int((notes == Note.DROPPED).sum())} have no answer token within --seq-len "
            f"{seq_len} (a prompt that fills the block). Fill the empty fields, raise --seq-len, or pass another "
            "dataset.")
    return out


def prepare_with_report(dataset, tokenizer, seq_len: int, *, long_documents: str = "split",
                        num_proc: int | None = None):
    """`prepare`, and a DataReport of what it did. See `prepare`."""
    documents = _tokenized(dataset, tokenizer, seq_len, long_documents, num_proc)
    every = np.ones(len(documents.notes), dtype=bool)
    packed, stats = documents.packed(every, seq_len, ("all",), f"hfdist: pack {seq_len}-token blocks")
    return packed, documents.report(every, documents.rows, stats, seq_len)


def held_out_rows(rows: int, fraction: float, seed: int) -> np.ndarray:
    """Which of `rows` rows are held out for evaluation: round(fraction x rows) of them (at least one), drawn by
    `seed` (the same rows on every rank and in every run with the same seed)."""
    chosen = np.random.default_rng(seed).permutation(rows)[:max(1, round(fraction * rows))]
    held = np.zeros(rows, dtype=bool)
    held[chosen] = True
    return held


def prepare_split(dataset, tokenizer, seq_len: int, *, eval_fraction: float, seed: int,
                  long_documents: str = "split", num_proc: int | None = None) -> Split:
    """`prepare`, with `eval_fraction` of the rows held out for evaluation before packing: whole rows (so a
    conversation split into several documents stays on one side), drawn by `seed` (`held_out_rows`); each side
    packed on its own.

    Raises:
        DataError: as `prepare`, or a held-out side without a document (too small a fraction of too few rows).
    """
    documents = _tokenized(dataset, tokenizer, seq_len, long_documents, num_proc)
    held_rows = held_out_rows(documents.rows, eval_fraction, seed)
    held = held_rows[documents.source_rows]
    out = {}
    for side, keep, rows in (("train", ~held, int((~held_rows).sum())), ("eval", held, int(held_rows.sum()))):
        packed, stats = documents.packed(keep, seq_len, (side, eval_fraction, seed),
                                         f"hfdist: pack the {side} side's {seq_len}-token blocks")
        if stats.blocks == 0:
            raise DataError(f"--eval-fraction {eval_fraction:g} of the dataset's {documents.rows} rows leaves no "
                            f"document on the {side} side. Pick a fraction that leaves rows on both sides, or "
                            "pass --eval-dataset.")
        out[side] = (packed, documents.report(keep, rows, stats, seq_len))
    return Split(train=out["train"][0], train_report=out["train"][1], eval=out["eval"][0],
                 eval_report=out["eval"][1])


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
