"""A prepared-data folder: packed training (and evaluation) blocks, and what they were made for.

    DIR/train.arrow, DIR/eval.arrow   packed blocks (hfdist.data.packed_file), memory-mapped by every rank
    DIR/hfdist_prepared.json          the settings the blocks depend on (DataSettings), the reports, and every
                                      source's fingerprint (a hash of its content) and identity (path, size, time)
    DIR/documents/                    while it is being prepared: the tokenised documents (hfdist.data.documents),
                                      from which an interrupted preparation resumes; removed once the blocks are written

`hfdist prepare` writes one on any machine; a job pointed at it (--prepared-data) loads it in seconds and refuses it
when it was made for another tokenizer, chat template, sequence length, long-document policy, held-out split or
sources, naming each difference, or when a source it can read has changed since. The manifest is written last, so a
folder whose writing was interrupted is not a prepared folder (`hfdist prepare` resumes it).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from hfdist.config.sources import DataSource
from hfdist.data.preparation import (
    DOCUMENTS_FOLDER,
    PACKING_VERSION,
    Built,
    DataReport,
    template_fingerprint,
    tokenizer_fingerprint,
)
from hfdist.errors import DataError

__all__ = ["MANIFEST", "DataSettings", "Prepared", "data_settings", "tokenizer_fingerprint", "template_fingerprint",
           "write_prepared", "write_manifest", "read_prepared", "read_folder", "is_prepared", "holds_other_files"]

MANIFEST = "hfdist_prepared.json"
_FORMAT = 2
_FLAGS = {"sources": "--dataset", "eval_dataset": "--eval-dataset", "eval_fraction": "--eval-fraction",
          "seed": "--seed", "seq_len": "--seq-len", "long_documents": "--long-documents",
          "tokenizer": "the tokenizer (--model)",
          "chat_template": "the tokenizer's chat template", "packing": "hfdist's packing (another hfdist version)"}
Prepared = Built  # what a job's data phase hands on: the blocks of each side and their reports


@dataclass(frozen=True)
class DataSettings:
    """Everything packed blocks depend on. `sources` are the --dataset specs (hfdist.data.sources); `tokenizer` and
    `chat_template` are content hashes (the same tokenizer read from the hub or from a local copy is the same
    tokenizer); `tokenizer_name` only says which it was."""

    sources: tuple[str, ...]
    eval_dataset: str | None
    eval_fraction: float | None
    seed: int | None  # draws the held-out rows and the mixture: part of the settings only where they are drawn
    seq_len: int
    long_documents: str
    tokenizer: str
    chat_template: str
    tokenizer_name: str = ""
    packing: str = PACKING_VERSION

    def differences(self, other: "DataSettings") -> list[str]:
        """What differs from `other` (a prepared folder's settings), one phrase per setting."""
        # The seed matters only where both draw rows; other sources or another fraction are named already.
        skip = {"tokenizer_name"} | ({"seed"} if None in (self.seed, other.seed) else set())
        return [f"{_FLAGS[f.name]}: prepared with {_shown(other, f.name)}, this job has {_shown(self, f.name)}"
                for f in fields(self) if f.name not in skip and getattr(self, f.name) != getattr(other, f.name)]


def _shown(settings: DataSettings, name: str) -> str:
    if name == "tokenizer":  # a hash alone says nothing to a person: which tokenizer it was, and its hash
        return f"{settings.tokenizer_name or '?'}'s (content hash {settings.tokenizer})"
    if name == "sources":
        return " ".join(settings.sources)
    return repr(getattr(settings, name))


def data_settings(tokenizer, *, sources: tuple[DataSource, ...], eval_dataset: str | None,
                  eval_fraction: float | None, seed: int, seq_len: int, long_documents: str) -> DataSettings:
    """The settings blocks prepared now would have (the tokenizer with the chat template it trains with:
    hfdist.data.chat.ensure_chat_template applied)."""
    from hfdist.data.chat import ensure_chat_template

    ensure_chat_template(tokenizer)
    draws = eval_fraction or any(s.eval_fraction or s.weight or (s.epochs and s.epochs % 1) for s in sources)
    return DataSettings(sources=tuple(s.spec() for s in sources), eval_dataset=eval_dataset,
                        eval_fraction=eval_fraction, seed=seed if draws else None, seq_len=seq_len,
                        long_documents=long_documents, tokenizer=tokenizer_fingerprint(tokenizer),
                        chat_template=template_fingerprint(tokenizer),
                        tokenizer_name=str(getattr(tokenizer, "name_or_path", "")))


def is_prepared(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a complete prepared-data folder."""
    return (Path(folder) / MANIFEST).is_file()


def holds_other_files(folder: str | os.PathLike) -> bool:
    """Whether `folder` exists and holds anything besides an unfinished preparation (a file, or a folder of other
    files): not a folder `hfdist prepare` may write into."""
    out = Path(folder)
    if not out.exists():
        return False
    if not out.is_dir():
        return True
    ours = {DOCUMENTS_FOLDER, "train.arrow", "eval.arrow", ".lock"}
    return any(p.name not in ours and not p.name.endswith(".tmp") for p in out.iterdir())


def write_manifest(folder: str | os.PathLike, settings: DataSettings | None, built: Built,
                   identities: dict[str, str] | None = None) -> None:
    """The manifest of a folder whose blocks `build` wrote, written last and atomically."""
    out = Path(folder)
    manifest = {"format": _FORMAT, "settings": asdict(settings) if settings is not None else None,
                "train": asdict(built.train_report),
                "eval": asdict(built.eval_report) if built.eval_report is not None else None,
                "fingerprints": built.fingerprints, "identities": identities or {}}
    tmp = out / f"{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / MANIFEST)


def write_prepared(folder: str | os.PathLike, settings: DataSettings, built: Built,
                   identities: dict[str, str]) -> None:
    """Finish a folder `build` wrote: its manifest, then the tokenised documents removed."""
    from hfdist.data.preparation import finish

    write_manifest(folder, settings, built, identities)
    finish(folder)


def _report(record: dict[str, Any] | None) -> DataReport | None:
    if record is None:
        return None
    return DataReport(**{**record, "sources": tuple(record.get("sources", ()))})


def read_folder(folder: str | os.PathLike) -> Built:
    """The blocks (memory-mapped when first used) and reports of a complete prepared folder, unchecked."""
    out = Path(folder)
    manifest = json.loads((out / MANIFEST).read_text())
    sides = ["train"] + (["eval"] if manifest["eval"] is not None else [])
    return Built({side: out / f"{side}.arrow" for side in sides}, _report(manifest["train"]),
                 _report(manifest["eval"]), manifest.get("fingerprints", {}))


def _changed_sources(manifest: dict[str, Any], sources: tuple[DataSource, ...]) -> list[str]:
    """The sources readable here whose content is not what was prepared: the identity (path, size, time) first, the
    content hash only when that differs (a copy on another machine has new times)."""
    from hfdist.data.reading import SourceReader, identity

    changed = []
    for index, source in enumerate(sources):
        recorded = manifest["fingerprints"].get(source.name)
        if source.path is None or not Path(source.path).exists() or recorded is None:
            continue
        if manifest["identities"].get(source.name) == identity(source):
            continue
        now = SourceReader(source, index).fingerprint()
        if now != recorded:
            changed.append(f"{source.name} ({source.path}: content hash {recorded} when prepared, {now} now)")
    return changed


def read_prepared(folder: str | os.PathLike, settings: DataSettings,
                  sources: tuple[DataSource, ...] = ()) -> Built:
    """The blocks of a prepared folder, checked to be made with `settings` from `sources` as they are now.

    Raises:
        DataError: not a prepared folder, one of another hfdist format, one made with other settings (each
            difference named, with the fix), or from a source whose content has changed since.
    """
    out = Path(folder)
    if out.exists() and not out.is_dir():
        raise DataError(f"--prepared-data {out} is a file, not a folder. Point it at the folder `hfdist prepare` "
                        "wrote, or at one that does not exist yet (the job then writes it).")
    if not is_prepared(out):
        raise DataError(f"--prepared-data {out} holds no prepared data ({MANIFEST} is missing: not written by "
                        "`hfdist prepare`). Run `hfdist prepare` with this job's settings to write it (an "
                        "interrupted one resumes), or point --prepared-data at a folder that does not exist yet (the "
                        "job then prepares the data and writes it there).")
    manifest = json.loads((out / MANIFEST).read_text())
    saved = DataSettings(**{**manifest["settings"], "sources": tuple(manifest["settings"]["sources"])}) \
        if manifest.get("format") == _FORMAT and manifest.get("settings") else None
    diff = settings.differences(saved) if saved is not None else ["another hfdist's folder format"]
    if diff:
        raise DataError(f"--prepared-data {out} was made for another job ({'; '.join(diff)}), so its blocks are not "
                        "this job's data. Run `hfdist prepare` again with this job's settings (the same job file or "
                        "flags), or point --prepared-data at a new folder (the job then prepares the data itself and "
                        "writes it there).")
    changed = _changed_sources(manifest, sources)
    if changed:
        raise DataError(f"--prepared-data {out} was prepared from other contents of {'; '.join(changed)}. Run "
                        "`hfdist prepare` again into a new folder (or remove this one), so the job trains on the data "
                        "as it is now.")
    return read_folder(out)
