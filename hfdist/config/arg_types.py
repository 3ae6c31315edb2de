"""argparse types of hfdist's command lines: each refuses a bad value with the reason (argparse turns it into one
line naming the flag, exit 2), so a job file's value, checked by the same type, is refused the same way."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

__all__ = ["dataset_spec", "positive_float", "non_negative_float", "fraction", "probability", "non_negative_int",
           "positive_int",
           "names", "trackers", "timeout_seconds", "TRACKERS"]

# Where a run's series go (hfdist.callbacks.trackers); "none" alone turns every tracker off.
TRACKERS = ("wandb", "mlflow", "tensorboard", "trackio")


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    value = float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0."""
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number strictly between 0 and 1."""
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must lie strictly between 0 and 1, got {text}")
    return value


def probability(text: str) -> float:
    """argparse type: a number in [0, 1)."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {text}")
    return value


def names(text: str) -> tuple[str, ...]:
    """argparse type: a comma-separated list of names (module names, trackers), without repeats."""
    found = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not found:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got '{text}'")
    return found


def trackers(text: str) -> tuple[str, ...]:
    """argparse type of --report-to: known tracker names, or "none" (no tracker)."""
    given = names(text)
    unknown = [n for n in given if n not in (*TRACKERS, "none")]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown tracker {', '.join(unknown)}: choose from "
                                         f"{', '.join(TRACKERS)} or none")
    if "none" in given and len(given) > 1:
        raise argparse.ArgumentTypeError("none means no tracker at all: pass it alone")
    return () if given == ("none",) else given


def timeout_seconds(text: str) -> float:
    """argparse type of --collective-timeout: at least one second."""
    value = float(text)
    if not value >= 1.0:  # NaN too
        raise argparse.ArgumentTypeError(
            f"{text} s is below 1 s: every collective would time out (a step's collectives take longer). Pass "
            "at least 1; the default is 300 (long enough for a first step's set-up and a large checkpoint)")
    return value


def dataset_spec(value: Any) -> str:
    """argparse type of --dataset: one source, as `PATH[,key=value...]` (or, in a job file, a mapping of its
    settings), checked and written the one way hfdist.data.sources.DataSource.spec writes it."""
    from hfdist.config.sources import parse_source, source_from_mapping
    from hfdist.errors import DataError

    try:
        source = source_from_mapping(value) if isinstance(value, Mapping) else parse_source(str(value))
    except DataError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return source.spec()
