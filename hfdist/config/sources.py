"""The datasets a job trains on: one source, or a mixture of several, each with its format, split, column mapping,
weight (or epochs) and eval share, as the command line and the job file spell them. Torch-free; hfdist.data.sources
checks them against the formats hfdist reads and against each other.

    --dataset rows.jsonl                                        one source (the whole spec is the path)
    --dataset a.jsonl,weight=0.5 --dataset b.parquet,weight=0.3,format=sharegpt --dataset c.csv,weight=0.2
    --dataset c.csv,epochs=2,column.output=answer,eval_fraction=0.02,name=qa

    datasets:                                                   the job file's list (entries take the same keys)
      - {path: a.jsonl, weight: 0.5}
      - {path: b.parquet, weight: 0.3, format: sharegpt, columns: {conversations: turns}}

A spec is a path or hub id, then `,key=value` settings: weight, epochs, format, split, eval_fraction, name, and
column.FIELD=NAME (the dataset's column NAME read as the format's FIELD). The mixture's rules (hfdist.data.mixture):
- weight: the source's share of the training label tokens (weights are normalised); the mixture is as large as the
  sources allow without repeating a row (the source that runs out first sets its size);
- epochs: the source's rows taken that many times (2: every row twice; 0.5: a random half); the default is 1;
- weights are given to every source or to none (a share of an unknown whole is not a rule);
- eval_fraction: that share of the source's rows held out for evaluation (default: --eval-fraction).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from hfdist.errors import DataError

__all__ = ["DataSource", "FORMAT_ALIASES", "parse_source", "source_from_mapping", "default_name"]

# What a source's `format` may name: hfdist.data.formats' names, and the names datasets are known by.
FORMAT_ALIASES = {"sharegpt": "conversations", "alpaca": "instruction/input/output",
                  "prompt-completion": "prompt/completion", "chat": "messages"}
_KEYS = ("path", "name", "weight", "epochs", "format", "split", "columns", "eval_fraction")
_SETTING = re.compile(r"^(name|weight|epochs|format|split|eval_fraction|column\.[^=]+)=(.*)$")


@dataclass(frozen=True)
class DataSource:
    """One dataset of a job. `path` None is the embedded default; `columns` maps the format's fields to the
    dataset's column names ((field, column) pairs, sorted)."""

    path: str | None
    name: str
    weight: float | None = None
    epochs: float | None = None
    format: str | None = None
    split: str = "train"
    columns: tuple[tuple[str, str], ...] = ()
    eval_fraction: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The source as a job file's entry (only what differs from the defaults, besides path and name)."""
        out: dict[str, Any] = {"path": self.path, "name": self.name}
        for key in ("weight", "epochs", "format", "eval_fraction"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.split != "train":
            out["split"] = self.split
        if self.columns:
            out["columns"] = dict(self.columns)
        return out

    def spec(self) -> str:
        """The source as a --dataset value (what `parse_source` reads back)."""
        parts = [self.path or "default"]
        parts += [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.as_dict().items()
                  if k not in ("path", "name", "columns")]
        parts += [f"column.{field}={column}" for field, column in self.columns]
        if self.name != default_name(self.path):
            parts.append(f"name={self.name}")
        return ",".join(parts)


def default_name(path: str | None) -> str:
    """A source's name when none is given: the file's stem, a hub id's last part, 'default' for the embedded data."""
    if path is None:
        return "default"
    pure = PurePath(path.rstrip("/"))
    return pure.stem if pure.suffix else pure.name


def _number(text: Any, key: str, where: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise DataError(f"{where}: {key}={text!r} is not a number. Give {key} as a number, e.g. {key}=0.5.") from None
    low_ok = value > 0 if key != "eval_fraction" else 0 < value < 1
    if not low_ok or value != value or value == float("inf"):
        rule = "strictly between 0 and 1" if key == "eval_fraction" else "positive"
        raise DataError(f"{where}: {key}={text!r} must be {rule}.")
    return value


def source_from_mapping(entry: Mapping[str, Any], where: str = "--dataset") -> DataSource:
    """A source from a job file's `datasets:` entry (or a parsed spec): keys as the module docstring lists.

    Raises:
        DataError: an unknown key, a bad value, or weight and epochs together.
    """
    unknown = [k for k in entry if k not in _KEYS]
    if unknown:
        raise DataError(f"{where}: unknown setting {', '.join(map(str, unknown))}; a source takes "
                        f"{', '.join(_KEYS)}. Rename or remove it.")
    path = entry.get("path")
    path = None if path in (None, "", "default") else str(path)
    weight = _number(entry["weight"], "weight", where) if entry.get("weight") is not None else None
    epochs = _number(entry["epochs"], "epochs", where) if entry.get("epochs") is not None else None
    if weight is not None and epochs is not None:
        raise DataError(f"{where}: weight and epochs together. A weight is the source's share of the mixture, epochs "
                        "how often its rows are taken: give one of them.")
    fmt = str(entry["format"]) if entry.get("format") else None
    fmt = FORMAT_ALIASES.get(fmt.lower(), fmt) if fmt is not None else None  # checked by hfdist.data.sources
    columns = entry.get("columns") or {}
    if not isinstance(columns, Mapping):
        raise DataError(f"{where}: columns must map the format's fields to the dataset's column names "
                        f"(e.g. {{output: answer}}), got {columns!r}.")
    fraction = _number(entry["eval_fraction"], "eval_fraction", where) if entry.get("eval_fraction") else None
    name = str(entry.get("name") or default_name(path))
    return DataSource(path=path, name=name, weight=weight, epochs=epochs, format=fmt,
                      split=str(entry.get("split") or "train"),
                      columns=tuple(sorted((str(k), str(v)) for k, v in columns.items())), eval_fraction=fraction)


def parse_source(spec: str) -> DataSource:
    """A --dataset value: a path or hub id, then `,key=value` settings (the module docstring). A path containing
    commas stays whole: only trailing parts that read as settings are settings.

    Raises:
        DataError: a bad setting (named), as `source_from_mapping`.
    """
    parts = spec.split(",")
    settings: dict[str, Any] = {}
    while len(parts) > 1 and _SETTING.match(parts[-1].strip()):
        key, value = _SETTING.match(parts.pop().strip()).groups()
        if key.startswith("column."):
            settings.setdefault("columns", {})[key[len("column."):]] = value
        elif key in settings:
            raise DataError(f"--dataset {spec}: {key} is given twice. Give each setting once.")
        else:
            settings[key] = value
    return source_from_mapping({"path": ",".join(parts).strip(), **settings}, f"--dataset {spec}")
