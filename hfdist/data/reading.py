"""A source's rows, a batch at a time, in bounded memory; its format and columns; what identifies its content.

    JSON Lines (.jsonl, .json)   the file's lines, read in order; they are parsed where they are tokenised (workers)
    Parquet                      record batches of the columns the format reads (pyarrow)
    CSV                          pyarrow's streaming reader, every column read as text
    anything else                through datasets (a hub id, a saved folder, a JSON array, a datasets.Dataset): its
                                 Arrow cache files read in sequence when the dataset is one as loaded, else batch
                                 by batch through datasets

Every batch holds BATCH_ROWS rows (a source's last fewer), numbered from the source's first row, so what a batch
holds depends on the data alone: never on the number of workers, nor on where an interrupted preparation stopped.
Blank lines of a JSON Lines file are not rows (as datasets reads them).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from hfdist.config.sources import DataSource
from hfdist.data.sources import format_columns
from hfdist.errors import DataError

__all__ = ["BATCH_ROWS", "RowBatch", "SourceReader", "batch_columns"]

BATCH_ROWS = 256  # rows per tokenisation task
_HASH_CHUNK = 1 << 23
_SUFFIXES = {".json": "jsonl", ".jsonl": "jsonl", ".csv": "csv", ".parquet": "parquet"}


@dataclass(frozen=True)
class RowBatch:
    """BATCH_ROWS rows of source `source` from row `first_row`: JSON text lines ("lines", with each row's line
    number in the file) or a pyarrow Table / RecordBatch ("arrow")."""

    source: int
    first_row: int
    kind: str
    data: Any
    line_numbers: tuple[int, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.data) if self.kind == "lines" else self.data.num_rows


def _json_row(line: bytes, number: int, file: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"--dataset {file}: line {number} is not a JSON object ({exc.msg}, column {exc.colno}). Each "
                        "line of a JSON Lines file must be one JSON object (one row): fix or drop that line.") from None
    if not isinstance(row, dict):
        raise DataError(f"--dataset {file}: line {number} is not a JSON object (a JSON {type(row).__name__}). Each "
                        "line of a JSON Lines file must be one JSON object (one row): fix or drop that line.")
    return row


def batch_columns(batch: RowBatch, fields: dict[str, str], file: str = "") -> dict[str, list]:
    """A batch's values of the format's `fields` (field -> the dataset's column), as Python lists; a column a row
    lacks reads as None. `file` names a JSON Lines file in its errors."""
    if batch.kind == "lines":
        rows = [_json_row(line, number, file) for line, number in zip(batch.data, batch.line_numbers)]
        return {field: [row.get(column) for row in rows] for field, column in fields.items()}
    names = batch.data.schema.names
    return {field: batch.data.column(column).to_pylist() if column in names else [None] * batch.rows
            for field, column in fields.items()}


def _hash_files(files: list[Path], root: Path | None = None) -> str:
    digest = hashlib.sha256()
    for file in files:
        if root is not None:
            digest.update(str(file.relative_to(root)).encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()[:32]


class SourceReader:
    """One source of a job: its columns, its rows in batches, its fingerprint.

    Args:
        source: the source's settings.
        index: its place among the job's sources (carried by every batch).
        dataset: a datasets.Dataset given in Python (the library's `prepare`), read instead of `source.path`.
    """

    def __init__(self, source: DataSource, index: int, dataset: Any = None) -> None:
        from hfdist.data.default import DATA_FILE

        self.source, self.index = source, index
        self._dataset = dataset
        path = Path(source.path) if source.path is not None else DATA_FILE
        self.kind = "dataset" if dataset is not None else _SUFFIXES.get(path.suffix.lower()) if path.is_file() else None
        if dataset is None and self.kind is None and path.is_file():
            raise DataError(f"--dataset {source.path}: unsupported file type '{path.suffix}'. Use one of "
                            f"{', '.join(sorted(_SUFFIXES))}, a saved dataset folder, or a hub id.")
        if self.kind == "jsonl" and _starts_with(path, b"["):  # one JSON array: parsed whole, by datasets
            self.kind = None
        self.path = path

    # -- what the source is --------------------------------------------------------------------------------------

    def _loaded(self):
        """The source through datasets (hub ids, folders, JSON arrays), loaded once."""
        if self._dataset is None:
            from hfdist.data.load import load_raw_dataset

            self._dataset = load_raw_dataset(str(self.path), split=self.source.split)
        return self._dataset

    def fingerprint(self) -> str:
        """A hash of the source's content: its file(s), or datasets' fingerprint of a hub or in-Python dataset."""
        if self.kind in ("jsonl", "csv", "parquet"):
            return _hash_files([self.path])
        if self.kind != "dataset" and self.path.is_dir():
            return _hash_files(sorted(p for p in self.path.rglob("*") if p.is_file()), self.path)
        return str(self._loaded()._fingerprint)

    def columns(self) -> list[str]:
        """The dataset's column names (a JSON Lines file's: the keys of its first batch of rows)."""
        if self.kind == "jsonl":
            first = next(self.batches(), None)
            keys: dict[str, None] = {}
            for line, number in zip(first.data, first.line_numbers) if first else ():
                keys.update(dict.fromkeys(_json_row(line, number, str(self.path))))
            return list(keys)
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(self.path).schema_arrow.names
        if self.kind == "csv":
            return self._csv_header()
        return list(self._loaded().column_names)

    def rows_hint(self) -> int:
        """About how many rows the source has (newlines of a text file), for the progress bar and the default
        number of workers."""
        if self.kind in ("jsonl", "csv"):
            with open(self.path, "rb") as f:
                lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(_HASH_CHUNK), b""))
            return max(lines - (self.kind == "csv"), 0)
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(self.path).metadata.num_rows
        return len(self._loaded())

    # -- the rows --------------------------------------------------------------------------------------------------

    def batches(self, start_row: int = 0, columns: list[str] | None = None) -> Iterator[RowBatch]:
        """The rows from `start_row` (a multiple of BATCH_ROWS) in batches of BATCH_ROWS; `columns` (the dataset's
        names) limits what columnar sources read."""
        if self.kind == "jsonl":
            yield from self._line_batches(start_row)
            return
        tables = {"parquet": self._parquet_tables, "csv": self._csv_tables}.get(self.kind, self._dataset_tables)
        yield from self._rebatched(tables(columns), start_row)

    def _line_batches(self, start_row: int) -> Iterator[RowBatch]:
        row = 0
        with open(self.path, "rb") as f:
            numbered = ((n, line) for n, line in enumerate(f, 1) if line.strip())
            for _ in islice(numbered, start_row):  # resuming: the rows before are already done
                row += 1
            while chunk := list(islice(numbered, BATCH_ROWS)):
                yield RowBatch(self.index, row, "lines", [line.rstrip() for _, line in chunk],
                               tuple(n for n, _ in chunk))
                row += len(chunk)

    def _rebatched(self, tables: Iterator[Any], start_row: int) -> Iterator[RowBatch]:
        """Tables of any sizes -> batches of BATCH_ROWS rows from `start_row`."""
        import pyarrow as pa

        row, pending = 0, []
        for table in tables:
            if row + table.num_rows <= start_row:
                row += table.num_rows
                continue
            if row < start_row:
                table, row = table.slice(start_row - row), start_row
            pending.append(table)
            while sum(t.num_rows for t in pending) >= BATCH_ROWS:
                joined = pa.concat_tables([_table(t) for t in pending])
                yield RowBatch(self.index, row, "arrow", joined.slice(0, BATCH_ROWS).combine_chunks())
                row += BATCH_ROWS
                pending = [joined.slice(BATCH_ROWS)]
        rest = [_table(t) for t in pending if t.num_rows]
        if rest:
            yield RowBatch(self.index, row, "arrow", pa.concat_tables(rest).combine_chunks())

    def _parquet_tables(self, columns: list[str] | None) -> Iterator[Any]:
        import pyarrow.parquet as pq

        file = pq.ParquetFile(self.path)
        wanted = [c for c in columns if c in file.schema_arrow.names] if columns is not None else None
        yield from file.iter_batches(batch_size=4 * BATCH_ROWS, columns=wanted)

    def _csv_header(self) -> list[str]:
        import csv

        with open(self.path, newline="", encoding="utf-8") as f:
            return next(csv.reader(f), [])

    def _csv_tables(self, columns: list[str] | None) -> Iterator[Any]:
        import pyarrow as pa
        import pyarrow.csv as pcsv

        header = self._csv_header()
        wanted = [c for c in header if columns is None or c in columns]
        # Every column as text: a column of numbers in one block and words in the next must not change type.
        convert = pcsv.ConvertOptions(column_types={c: pa.string() for c in header}, include_columns=wanted)
        with pcsv.open_csv(self.path, read_options=pcsv.ReadOptions(block_size=1 << 20),
                           convert_options=convert) as reader:
            yield from reader

    def _dataset_tables(self, columns: list[str] | None) -> Iterator[Any]:
        """A datasets.Dataset's rows: its Arrow files read in sequence (no memory map: the pages read are not kept)
        when it is one as datasets loaded it, else through datasets."""
        import pyarrow as pa

        dataset = self._loaded()
        files = _pristine_files(dataset)
        wanted = [c for c in dataset.column_names if columns is None or c in columns]
        if files is None:
            yield from dataset.select_columns(wanted).with_format("arrow").iter(batch_size=4 * BATCH_ROWS)
            return
        for file in files:
            with pa.OSFile(file) as raw:
                reader = pa.ipc.open_stream(raw)
                for batch in reader:
                    yield batch.select(wanted)


def _table(t: Any):
    import pyarrow as pa

    return pa.Table.from_batches([t]) if isinstance(t, pa.RecordBatch) else t


def _starts_with(path: Path, marker: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(4096).lstrip()[:1] == marker


def _pristine_files(dataset: Any) -> list[str] | None:
    """The Arrow files holding `dataset` in order, when it is exactly their rows (no selection, no transform);
    None otherwise."""
    from datasets.table import ConcatenationTable, MemoryMappedTable

    if dataset._indices is not None:
        return None
    table = dataset.data
    blocks = [row for row in table.blocks] if isinstance(table, ConcatenationTable) else [[table]]
    if not all(len(row) == 1 and isinstance(row[0], MemoryMappedTable) and not row[0].replays for row in blocks):
        return None
    return [row[0].path for row in blocks]


def resolve_format(source: DataSource, columns: list[str]) -> tuple[str, dict[str, str]]:
    """(the source's format, the fields it reads -> the dataset's columns): `source.format` or detected from the
    columns as `source.columns` renames them.

    Raises:
        DataError: no format matches, or the named one lacks a column it needs (naming the source).
    """
    from hfdist.data.formats import FORMATS, detect_format

    renamed = {column: field for field, column in source.columns}
    visible = [renamed.get(c, c) for c in columns]
    missing_mapped = [column for _, column in source.columns if column not in columns]
    if missing_mapped:
        raise DataError(f"--dataset {source.name}: columns maps to {', '.join(missing_mapped)}, which the dataset "
                        f"does not have (its columns: {', '.join(columns)}). Fix the column names.")
    if source.format is None:
        try:
            fmt = detect_format(visible)
        except DataError as exc:
            raise DataError(f"--dataset {source.name}: {exc}") from None
    else:
        name = source.format
        if name == "instruction/input/output" and "input" not in visible:
            name = "instruction/output"  # Alpaca without its optional input column
        fmt = next(f for f in FORMATS if f.name == name)
        absent = [c for c in fmt.columns if c not in visible]
        if absent:
            raise DataError(f"--dataset {source.name}: format {fmt.name} reads the columns {', '.join(fmt.columns)}, "
                            f"and {', '.join(absent)} {'is' if len(absent) == 1 else 'are'} not among the dataset's "
                            f"({', '.join(columns)}). Map them with column.FIELD=NAME (columns: in a job file).")
    mapping = dict(source.columns)
    fields = {f: mapping.get(f, f) for f in format_columns(fmt.name) if f in visible}
    return fmt.name, fields


def identity(source: DataSource) -> str:
    """What names a source's content cheaply (for caches): a local file's path, size and modification time; a
    folder's files'; a hub id as given."""
    path = Path(source.path) if source.path is not None else None
    if path is None:
        from hfdist.data.default import DATA_FILE

        path = DATA_FILE
    if not path.exists():
        return f"{source.path}@{source.split}"
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return "|".join(f"{os.path.abspath(f)}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
