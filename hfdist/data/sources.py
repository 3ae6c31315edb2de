"""A job's sources (hfdist.config.sources: as the command line and the job file give them) checked against the
formats hfdist reads (hfdist.data.formats) and against each other, before any process starts (hfdist.job.preflight)
and again when the data is read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hfdist.config.sources import FORMAT_ALIASES, DataSource
from hfdist.errors import DataError

__all__ = ["check_sources", "with_eval_fraction", "format_columns"]


def _canonical_format(name: str, where: str) -> str:
    from hfdist.data.formats import FORMATS

    canonical = FORMAT_ALIASES.get(name.lower(), name)
    known = [f.name for f in FORMATS]
    if canonical not in known:
        raise DataError(f"{where}: format={name!r} is not a format hfdist reads; it reads {', '.join(known)} (also "
                        f"named {', '.join(FORMAT_ALIASES)}). Pick one, or leave format out to detect it from the "
                        "columns.")
    return canonical


def format_columns(fmt: str) -> tuple[str, ...]:
    """The fields (required and optional) a format reads; `alpaca` also reads instruction/output without input."""
    from hfdist.data.formats import FORMATS

    found = next(f for f in FORMATS if f.name == fmt)
    return found.columns + found.optional


def _check_format(source: DataSource) -> None:
    """A source's format is one hfdist reads, and its column mapping names fields of that format."""
    if source.format is None:
        return
    where = f"--dataset {source.spec()}"
    fmt = _canonical_format(source.format, where)
    allowed = set(format_columns(fmt)) | ({"instruction", "output", "input", "system"} if fmt.startswith(
        "instruction/") else set())
    stray = [field for field, _ in source.columns if field not in allowed]
    if stray:
        raise DataError(f"{where}: columns maps {', '.join(map(str, stray))}, which format {fmt} does not read "
                        f"(it reads {', '.join(format_columns(fmt))}).")


def check_sources(sources: Sequence[DataSource], eval_dataset: str | None = None) -> tuple[DataSource, ...]:
    """The sources of one job, checked together.

    Raises:
        DataError: a format hfdist does not read or a column mapping to no field of it, weights on some sources
            and not others, two sources of one name, or per-source eval shares together with --eval-dataset.
    """
    sources = tuple(sources)
    for source in sources:
        _check_format(source)
    weighted = [s.name for s in sources if s.weight is not None]
    if weighted and len(weighted) != len(sources):
        bare = [s.name for s in sources if s.weight is None]
        raise DataError(f"Sources {', '.join(weighted)} have a weight and {', '.join(bare)} do not. Weights are "
                        "shares of the mixture's label tokens, so give every source a weight (e.g. weight=0.2), or "
                        "none (each source's rows are then taken once, or epochs=N times).")
    names = [s.name for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DataError(f"Two sources are named {', '.join(twice)}. Give each a name of its own (name=... in its "
                        "--dataset spec or its datasets: entry): the summary and the trackers report by name.")
    if eval_dataset and any(s.eval_fraction for s in sources):
        raise DataError("A source sets eval_fraction and the job has --eval-dataset: the held-out data is one or "
                        "the other. Drop eval_fraction from the sources, or --eval-dataset.")
    return sources


def with_eval_fraction(sources: Sequence[DataSource], fraction: float | None) -> tuple[DataSource, ...]:
    """`sources` with --eval-fraction as the eval share of every source that sets none."""
    return tuple(s if s.eval_fraction or not fraction else replace(s, eval_fraction=fraction) for s in sources)
