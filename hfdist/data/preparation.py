"""Preparation: sources and a tokenizer -> packed blocks the model trains on, streamed through disk in bounded
memory; what became of the data, in one line per side.

    sources --(reading: a batch of rows at a time)--> rows --(formats, chat, encode: in --num-proc workers)-->
         documents on disk in shards (hfdist.data.documents; resumable)
         --(mixture: held-out rows per source, the training mixture by weight or epochs, from the seed)-->
         training / evaluation documents
         --(packing: best-fit-decreasing over the lengths, a window of blocks at a time)--> FOLDER/train.arrow,
           FOLDER/eval.arrow: blocks of seq_len (input_ids, labels, position_ids), memory-mapped by every rank

`build` writes a folder from sources (hfdist.job.data and `hfdist prepare` use it, through hfdist.data.prepared);
hfdist.data.cached's `prepare` is the library's call on a datasets.Dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hfdist.config.sources import DataSource
from hfdist.data.chat import DEFAULT_CHAT_TEMPLATE, DEFAULT_TEMPLATE_NOTE, ensure_chat_template
from hfdist.data.documents import SHARD_ROWS, Documents, SourcePlan, tokenize_sources
from hfdist.data.encode import LONG_DOCUMENT_POLICIES, Note
from hfdist.data.mixture import SourceDraw, draw, held_out_rows
from hfdist.data.packed_file import PackedStats, write_packed
from hfdist.data.reading import BATCH_ROWS, SourceReader, resolve_format
from hfdist.errors import DataError

__all__ = ["DataReport", "Built", "build", "finish", "check_policy", "held_out_rows", "check_enough_blocks",
           "tokenizer_fingerprint", "template_fingerprint", "PACKING_VERSION", "DOCUMENTS_FOLDER"]

PACKING_VERSION = "bfd-3"  # part of every packed folder's settings: bump when the packed layout changes
DOCUMENTS_FOLDER = "documents"  # the tokenised documents inside a folder being prepared (removed once it is)
_PARALLEL_FROM_ROWS = 20_000  # smaller datasets tokenize faster in one process than worker start-up takes
_DOCUMENT = (Note.WHOLE, Note.PIECE, Note.TRUNCATED)


@dataclass(frozen=True)
class DataReport:
    """What preparation made of the data of one side (training or held-out), with each source's part.

    `sources`: per source, {name, format, rows, label_tokens} (rows counting repeats under epochs > 1)."""

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
    sources: tuple[dict[str, Any], ...] = ()

    @property
    def padding_fraction(self) -> float:
        """Share of the blocks' tokens that are padding."""
        return self.padding_tokens / max(self.blocks * self.seq_len, 1)

    def line(self, what: str = "data") -> str:
        """One line for the run's log (`what`: "data", "eval data", ...), and a line per source of a mixture."""
        text = (f"hfdist: {what}: {self.rows} {self.format} rows -> {self.documents} documents ({self.split_rows} "
                f"rows split, {self.truncated} answers truncated, {self.empty_rows} empty rows skipped, "
                f"{self.dropped_rows} dropped) -> {self.blocks} blocks of {self.seq_len} tokens, "
                f"{100 * self.padding_fraction:.1f}% padding, {self.label_tokens} label tokens "
                f"({self.seconds:.1f} s)")
        if len(self.sources) > 1:
            text += "".join(f"\nhfdist: {what}: {s['name']} ({s['format']}): {s['rows']} rows, {s['label_tokens']} "
                            f"label tokens, {100 * s['label_tokens'] / max(self.label_tokens, 1):.1f}% of them"
                            for s in self.sources)
        return text + (f"\nhfdist: {DEFAULT_TEMPLATE_NOTE}" if self.default_template else "")


@dataclass
class Built:
    """A prepared folder's blocks and reports: `train` and `eval` (None without held-out data) are datasets.Dataset
    objects, memory-mapped from the folder's Arrow files when first used (`hfdist prepare` writes them and never
    reads them). `fingerprints`: each source's content hash, by name."""

    blocks: dict[str, Any]  # side -> its Dataset, or the path of its Arrow file
    train_report: DataReport
    eval_report: DataReport | None
    fingerprints: dict[str, str] = field(default_factory=dict)

    def _side(self, side: str) -> Any:
        found = self.blocks.get(side)
        if isinstance(found, Path):
            import datasets

            found = self.blocks[side] = datasets.Dataset.from_file(str(found))
        return found

    @property
    def train(self) -> Any:
        return self._side("train")

    @property
    def eval(self) -> Any:
        return self._side("eval")


def _default_num_proc(rows: int) -> int:
    if rows < _PARALLEL_FROM_ROWS:
        return 1
    return max(1, min(len(os.sched_getaffinity(0)), 16))


def check_policy(seq_len: int, long_documents: str) -> None:
    if long_documents not in LONG_DOCUMENT_POLICIES:
        raise DataError(f"long_documents must be one of {LONG_DOCUMENT_POLICIES}, got '{long_documents}'.")
    if seq_len < 2:
        raise DataError(f"--seq-len {seq_len} leaves no room for a document: use at least 2 (typically 512+).")


def _plan(readers: Sequence[SourceReader], tokenizer, seq_len: int, long_documents: str, shard_rows: int
          ) -> tuple[list[SourcePlan], dict[str, Any], dict[str, str]]:
    """Each source's format and fields, and what the tokenised documents depend on (their folder's plan)."""
    plans, described, fingerprints = [], [], {}
    for reader in readers:
        fmt, fields = resolve_format(reader.source, reader.columns())
        plans.append(SourcePlan(reader.source.name, fmt, fields, f"--dataset {reader.source.name}: "
                                if len(readers) > 1 else "", str(reader.path)))
        fingerprints[reader.source.name] = reader.fingerprint()
        described.append({"name": reader.source.name, "format": fmt, "fields": fields,
                          "fingerprint": fingerprints[reader.source.name]})
    plan = {"version": PACKING_VERSION, "sources": described, "tokenizer": tokenizer_fingerprint(tokenizer),
            "chat_template": template_fingerprint(tokenizer), "seq_len": seq_len, "long_documents": long_documents,
            "shard_rows": shard_rows, "batch_rows": BATCH_ROWS}
    return plans, plan, fingerprints


def _tokenized(readers: Sequence[SourceReader], tokenizer, folder: Path, seq_len: int, long_documents: str,
               num_proc: int | None, shard_rows: int) -> tuple[Documents, list[SourcePlan], dict[str, str]]:
    from datasets.utils import tqdm as progress

    plans, plan, fingerprints = _plan(readers, tokenizer, seq_len, long_documents, shard_rows)
    rows = sum(r.rows_hint() for r in readers)
    workers = num_proc if num_proc is not None else _default_num_proc(rows)
    with progress(total=rows, unit=" rows", desc=f"hfdist: tokenize rows for {seq_len}-token blocks",
                  leave=False) as bar:
        documents = tokenize_sources(readers, plans, folder, plan, tokenizer=tokenizer, seq_len=seq_len,
                                     long_documents=long_documents, num_proc=workers, shard_rows=shard_rows,
                                     progress=bar.update)
    for s, plan_s in enumerate(plans):
        notes = documents.notes[documents.source_first[s]:documents.source_first[s + 1]]
        if not np.isin(notes, _DOCUMENT).any():
            raise DataError(
                f"Nothing to train on: of {f'--dataset {plan_s.name}' if plan_s.where else 'the dataset'}'s "
                f"{documents.source_rows[s]} {plan_s.format} rows, {int((notes == Note.EMPTY).sum())} have empty "
                f"fields and {int((notes == Note.DROPPED).sum())} have no answer token within --seq-len {seq_len} (a "
                "prompt that fills the block). Fill the empty fields, raise --seq-len, or pass another dataset.")
    return documents, plans, fingerprints


def _report(documents: Documents, chosen: np.ndarray, rows: list[int], stats: PackedStats, plans, seq_len: int,
            defaulted: bool, started: float) -> DataReport:
    """What became of the rows whose documents `chosen` selects (a side)."""
    notes = documents.notes[chosen]
    trained = chosen[np.isin(notes, _DOCUMENT)]
    pieces = chosen[notes == Note.PIECE]
    split_rows = len(np.unique(np.stack([documents.source_of(pieces), documents.rows[pieces]]), axis=1).T) \
        if len(pieces) else 0
    bounds = documents.source_first
    labels = [int(documents.labels[trained[(trained >= bounds[s]) & (trained < bounds[s + 1])]].sum(dtype=np.int64))
              for s in range(len(plans))]
    per_source = tuple({"name": p.name, "format": p.format, "rows": rows[s], "label_tokens": labels[s]}
                       for s, p in enumerate(plans) if rows[s])
    formats = list(dict.fromkeys(s["format"] for s in per_source)) or [plans[0].format]
    return DataReport(
        format="+".join(formats), rows=sum(rows), documents=len(trained), split_rows=split_rows,
        truncated=int((notes == Note.TRUNCATED).sum()), empty_rows=int((notes == Note.EMPTY).sum()),
        dropped_rows=int((notes == Note.DROPPED).sum()), blocks=stats.blocks, seq_len=seq_len,
        padding_tokens=stats.padding_tokens, label_tokens=stats.label_tokens, default_template=defaulted,
        seconds=time.perf_counter() - started, sources=per_source)


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what the tokenizer maps text to: its vocabulary, merges, normalisation and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    content = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    special = json.dumps({k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())})
    return hashlib.sha256((content + special).encode()).hexdigest()[:16]


def template_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's chat template."""
    return hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()[:16]


def build(sources: Sequence[DataSource], tokenizer, seq_len: int, folder: str | os.PathLike, *,
          eval_source: DataSource | None = None, seed: int = 0, long_documents: str = "split",
          num_proc: int | None = None, datasets_given: Sequence[Any] | None = None,
          shard_rows: int = SHARD_ROWS) -> Built:
    """Prepare `sources` (and the held-out `eval_source`) into `folder`: train.arrow (and eval.arrow), resuming
    the tokenised documents an interrupted call with the same inputs left there (module docstring). The folder's
    manifest is hfdist.data.prepared's to write.

    Args:
        sources: the training sources; their eval_fraction holds rows out for evaluation.
        eval_source: a held-out dataset (--eval-dataset), every row of it evaluated.
        datasets_given: datasets.Dataset objects to read instead of the sources' paths (the library's calls).
        num_proc: tokenisation processes (default: one below 20,000 rows, else the available cores up to 16).
        shard_rows: rows per shard of tokenised documents, the unit an interrupted preparation resumes from (a
            multiple of hfdist.data.reading.BATCH_ROWS).

    Raises:
        DataError: unknown columns or format, a malformed row (named), a row too long under "error", a source with
            nothing to train on, or a side without a document.
    """
    started = time.perf_counter()
    check_policy(seq_len, long_documents)
    ensure_chat_template(tokenizer)
    defaulted = tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE
    # Padding is masked from loss and attention, so its id only has to be a valid one.
    pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    every = list(sources) + ([eval_source] if eval_source is not None else [])
    given = list(datasets_given or []) + [None] * (len(every) - len(datasets_given or []))
    readers = [SourceReader(s, i, given[i]) for i, s in enumerate(every)]
    out = Path(folder)
    for stale in out.glob("*.tmp"):  # what an interrupted preparation was writing when it stopped
        stale.unlink()
    documents, plans, fingerprints = _tokenized(readers, tokenizer, out / DOCUMENTS_FOLDER, seq_len,
                                                long_documents, num_proc, shard_rows)
    specs = [SourceDraw(s.weight, s.epochs, s.eval_fraction) for s in sources]
    specs += [SourceDraw(eval_only=True)] if eval_source is not None else []
    bounds = documents.source_first
    drawn = draw([documents.rows[bounds[s]:bounds[s + 1]] for s in range(len(every))],
                 [documents.labels[bounds[s]:bounds[s + 1]] for s in range(len(every))],
                 documents.source_rows, specs, seed)
    sides = {}
    for side, chosen, rows in (("train", drawn.train, drawn.train_rows), ("eval", drawn.eval, drawn.eval_rows)):
        if side == "eval" and not any(s.eval_fraction for s in sources) and eval_source is None:
            continue
        packable = chosen[np.isin(documents.notes[chosen], _DOCUMENT)]
        stats = write_packed(documents, packable, seq_len, pad_id, out / f"{side}.arrow",
                             f"hfdist: pack the {side} side's {seq_len}-token blocks")
        if stats.blocks == 0:
            fractions = {s.eval_fraction for s in sources}
            held = (f"--eval-fraction {fractions.pop():g} of the dataset's" if len(fractions) == 1 else
                    "The sources' eval_fraction shares of their")
            raise DataError(f"{held} {sum(documents.source_rows[:len(sources)])} rows leaves no document on the "
                            f"{side} side. Pick a fraction that leaves rows on both sides, or pass --eval-dataset.")
        sides[side] = (out / f"{side}.arrow", _report(documents, chosen, rows, stats, plans, seq_len, defaulted,
                                                      started))
    return Built({side: path for side, (path, _) in sides.items()}, sides["train"][1],
                 sides["eval"][1] if "eval" in sides else None, fingerprints)


def finish(folder: str | os.PathLike) -> None:
    """Drop the tokenised documents of a folder whose blocks are written (its manifest too)."""
    shutil.rmtree(Path(folder) / DOCUMENTS_FOLDER, ignore_errors=True)


def check_enough_blocks(blocks: int, global_batch: int, seq_len: int) -> None:
    """Refuse a dataset that cannot fill one optimizer step.

    Raises:
        DataError: fewer packed rows than the global batch, with both numbers.
    """
    if blocks < global_batch:
        raise DataError(f"The dataset packs into {blocks} blocks of {seq_len} tokens, fewer than the "
                        f"--global-batch-size of {global_batch} that one optimizer step takes. Use more data, a "
                        f"--global-batch-size <= {blocks}, or a shorter --seq-len.")
