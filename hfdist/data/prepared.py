"""A prepared-data folder: packed training (and evaluation) blocks, and what they were made for.

    DIR/train.arrow, DIR/eval.arrow   packed blocks (hfdist.data.packed_file), memory-mapped by every rank
    DIR/hfdist_prepared.json          the settings the blocks depend on (DataSettings) and the reports

`hfdist prepare` writes one on any machine; a job pointed at it (--prepared-data) loads it in seconds and refuses it
when it was made for another tokenizer, chat template, sequence length, long-document policy, held-out split or
dataset, naming each difference. The manifest is written last, so a folder whose writing was interrupted is not a
prepared folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from hfdist.data.errors import DataError
from hfdist.data.preparation import PACKING_VERSION, DataReport

__all__ = ["MANIFEST", "DataSettings", "Prepared", "data_settings", "tokenizer_fingerprint", "write_prepared",
           "read_prepared", "is_prepared"]

MANIFEST = "hfdist_prepared.json"
_FORMAT = 1
_FLAGS = {"dataset": "--dataset", "eval_dataset": "--eval-dataset", "eval_fraction": "--eval-fraction",
          "seed": "--seed", "seq_len": "--seq-len", "long_documents": "--long-documents",
          "tokenizer": "the tokenizer (--model)",
          "chat_template": "the tokenizer's chat template", "packing": "hfdist's packing (another hfdist version)"}


@dataclass(frozen=True)
class DataSettings:
    """Everything packed blocks depend on. `tokenizer` and `chat_template` are content hashes (the same tokenizer
    read from the hub or from a local copy is the same tokenizer); `tokenizer_name` only says which it was."""

    dataset: str | None
    eval_dataset: str | None
    eval_fraction: float | None
    seed: int | None  # draws the held-out rows: part of the settings only with eval_fraction
    seq_len: int
    long_documents: str
    tokenizer: str
    chat_template: str
    tokenizer_name: str = ""
    packing: str = PACKING_VERSION

    def differences(self, other: "DataSettings") -> list[str]:
        """What differs from `other` (a prepared folder's settings), one phrase per setting."""
        # The seed matters only where both hold rows out; another fraction is named already.
        skip = {"tokenizer_name"} | ({"seed"} if None in (self.eval_fraction, other.eval_fraction) else set())
        return [f"{_FLAGS[f.name]}: prepared with {_shown(other, f.name)}, this job has {_shown(self, f.name)}"
                for f in fields(self) if f.name not in skip and getattr(self, f.name) != getattr(other, f.name)]


def _shown(settings: DataSettings, name: str) -> str:
    if name == "tokenizer":  # a hash alone says nothing to a person: which tokenizer it was, and its hash
        return f"{settings.tokenizer_name or '?'}'s (content hash {settings.tokenizer})"
    return repr(getattr(settings, name))


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what the tokenizer maps text to: its vocabulary, merges, normalisation and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    content = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    special = json.dumps({k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())})
    return hashlib.sha256((content + special).encode()).hexdigest()[:16]


def data_settings(tokenizer, *, dataset: str | None, eval_dataset: str | None, eval_fraction: float | None,
                  seed: int, seq_len: int, long_documents: str) -> DataSettings:
    """The settings blocks prepared now would have (the tokenizer with the chat template it trains with:
    hfdist.data.chat.ensure_chat_template applied)."""
    from hfdist.data.chat import ensure_chat_template

    ensure_chat_template(tokenizer)
    template = hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()[:16]
    return DataSettings(dataset=dataset, eval_dataset=eval_dataset, eval_fraction=eval_fraction,
                        seed=seed if eval_fraction else None, seq_len=seq_len, long_documents=long_documents,
                        tokenizer=tokenizer_fingerprint(tokenizer), chat_template=template,
                        tokenizer_name=str(getattr(tokenizer, "name_or_path", "")))


@dataclass(frozen=True)
class Prepared:
    """A prepared folder's blocks (datasets.Dataset, memory-mapped) and reports; `eval` is None without held-out
    data."""

    train: Any
    train_report: DataReport
    eval: Any
    eval_report: DataReport | None


def is_prepared(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a complete prepared-data folder."""
    return (Path(folder) / MANIFEST).is_file()


def _save_arrow(dataset, path: Path) -> None:
    """A packed Dataset as one Arrow file at `path` (a copy of its cache file, or its table written out)."""
    files = [f["filename"] for f in dataset.cache_files]
    if len(files) == 1:
        shutil.copyfile(files[0], path)
        return
    from datasets.arrow_writer import ArrowWriter

    with ArrowWriter(path=str(path)) as writer:
        writer.write_table(dataset.data.table)
        writer.finalize()


def write_prepared(folder: str | os.PathLike, settings: DataSettings, prepared: Prepared) -> None:
    """Write `prepared` into `folder` (created), its manifest last."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    _save_arrow(prepared.train, out / "train.arrow")
    if prepared.eval is not None:
        _save_arrow(prepared.eval, out / "eval.arrow")
    manifest = {"format": _FORMAT, "settings": asdict(settings), "train": asdict(prepared.train_report),
                "eval": asdict(prepared.eval_report) if prepared.eval_report is not None else None}
    tmp = out / f"{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / MANIFEST)


def read_prepared(folder: str | os.PathLike, settings: DataSettings) -> Prepared:
    """The blocks of a prepared folder, checked to be made with `settings`.

    Raises:
        DataError: not a prepared folder, one of another hfdist format, or one made with other settings (each
            difference named, with the fix).
    """
    import datasets

    out = Path(folder)
    if out.exists() and not out.is_dir():
        raise DataError(f"--prepared-data {out} is a file, not a folder. Point it at the folder `hfdist prepare` "
                        "wrote, or at one that does not exist yet (the job then writes it).")
    if not is_prepared(out):
        raise DataError(f"--prepared-data {out} holds no prepared data ({MANIFEST} is missing: not written by "
                        "`hfdist prepare`, or its writing was interrupted). Run `hfdist prepare` with this job's "
                        "settings to write it, or point --prepared-data at a folder that does not exist yet (the "
                        "job then prepares the data and writes it there).")
    manifest = json.loads((out / MANIFEST).read_text())
    saved = DataSettings(**manifest["settings"]) if manifest.get("format") == _FORMAT else None
    diff = settings.differences(saved) if saved is not None else ["another hfdist's folder format"]
    if diff:
        raise DataError(f"--prepared-data {out} was made for another job ({'; '.join(diff)}), so its blocks are not "
                        "this job's data. Run `hfdist prepare` again with this job's settings (the same job file or "
                        "flags), or point --prepared-data at a new folder (the job then prepares the data itself and "
                        "writes it there).")
    has_eval = manifest["eval"] is not None
    return Prepared(train=datasets.Dataset.from_file(str(out / "train.arrow")),
                    train_report=DataReport(**manifest["train"]),
                    eval=datasets.Dataset.from_file(str(out / "eval.arrow")) if has_eval else None,
                    eval_report=DataReport(**manifest["eval"]) if has_eval else None)
