"""`prepare(dataset)` for a script of your own: a datasets.Dataset tokenised, labelled and packed (hfdist.data.
preparation.build), the blocks cached beside the dataset's own cache files under a key of everything they depend on
(a prepared folder: hfdist.data.prepared), so the next call with the same dataset and settings reads them back."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from hfdist.config.sources import DataSource
from hfdist.data.chat import ensure_chat_template
from hfdist.data.preparation import (
    PACKING_VERSION,
    Built,
    DataReport,
    build,
    check_policy,
    finish,
    template_fingerprint,
    tokenizer_fingerprint,
)
from hfdist.data.prepared import is_prepared, read_folder, write_manifest

__all__ = ["Split", "prepare", "prepare_with_report", "prepare_split"]


@dataclass(frozen=True)
class Split:
    """Training and held-out evaluation blocks from one dataset (`prepare_split`)."""

    train: object  # datasets.Dataset
    train_report: DataReport
    eval: object
    eval_report: DataReport


def _library_build(dataset, tokenizer, seq_len: int, *, eval_fraction: float | None, seed: int,
                   long_documents: str, num_proc: int | None) -> Built:
    """`build` on one datasets.Dataset: cached beside its cache files under a key of everything the blocks depend
    on; a Dataset held in memory is built in a temporary folder and its blocks kept in memory."""
    import datasets
    from datasets.fingerprint import Hasher
    from datasets.table import InMemoryTable
    from filelock import FileLock

    if isinstance(dataset, datasets.DatasetDict):
        dataset = dataset["train"]
    check_policy(seq_len, long_documents)
    source = DataSource(path=None, name="dataset", eval_fraction=eval_fraction)
    options = dict(seed=seed, long_documents=long_documents, num_proc=num_proc, datasets_given=[dataset])
    if not dataset.cache_files:
        with tempfile.TemporaryDirectory(prefix="hfdist-prepared-") as tmp:
            built = build([source], tokenizer, seq_len, tmp, **options)
            keep = {side: datasets.Dataset(InMemoryTable.from_file(str(Path(tmp) / f"{side}.arrow")))
                    for side in ("train", "eval") if getattr(built, side) is not None}
            return Built(keep, built.train_report, built.eval_report, built.fingerprints)
    ensure_chat_template(tokenizer)
    key = Hasher.hash((dataset._fingerprint, tokenizer_fingerprint(tokenizer), template_fingerprint(tokenizer),
                       seq_len, long_documents, eval_fraction, seed if eval_fraction else None, PACKING_VERSION))
    folder = Path(dataset.cache_files[0]["filename"]).parent / f"hfdist-prepared-{key}"
    with FileLock(str(folder) + ".lock"):
        if not is_prepared(folder):
            built = build([source], tokenizer, seq_len, folder, **options)
            write_manifest(folder, None, built)
            finish(folder)
    return read_folder(folder)


def prepare_with_report(dataset, tokenizer, seq_len: int, *, long_documents: str = "split",
                        num_proc: int | None = None):
    """`prepare`, and a DataReport of what it did. See `prepare`."""
    built = _library_build(dataset, tokenizer, seq_len, eval_fraction=None, seed=0, long_documents=long_documents,
                           num_proc=num_proc)
    return built.train, built.train_report


def prepare_split(dataset, tokenizer, seq_len: int, *, eval_fraction: float, seed: int,
                  long_documents: str = "split", num_proc: int | None = None) -> Split:
    """`prepare`, with `eval_fraction` of the rows held out for evaluation before packing: whole rows (so a
    conversation split into several documents stays on one side), drawn by `seed` (`held_out_rows`); each side
    packed on its own.

    Raises:
        DataError: as `prepare`, or a held-out side without a document (too small a fraction of too few rows).
    """
    built = _library_build(dataset, tokenizer, seq_len, eval_fraction=eval_fraction, seed=seed,
                           long_documents=long_documents, num_proc=num_proc)
    return Split(train=built.train, train_report=built.train_report, eval=built.eval, eval_report=built.eval_report)


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
