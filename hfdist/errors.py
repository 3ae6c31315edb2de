"""hfdist's error base and the entry-point wrapper that turns its errors into one clear paragraph and exit 2.

Under hfdist's own hand-over (hfdist.job.launch) the ranks do not print their paragraph: every rank usually stops
on the same bad input, and the launch stack would print its tracebacks after them. Each rank leaves its paragraph
in the folder named by HFDIST_ERROR_DIR instead, and the hand-over prints each distinct paragraph once, last.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

__all__ = ["HfdistError", "DataError", "run_with_clear_errors", "report_error", "ERROR_DIR_ENV", "collected_errors",
           "DIVERGED_EXIT_CODE"]

ERROR_DIR_ENV = "HFDIST_ERROR_DIR"
# A run stopped by a non-finite loss, gradient norm or update (hfdist.train.nonfinite). docs/clusters.md's table: a
# crash is 1, bad input 2, a hang 3, a preemption 75.
DIVERGED_EXIT_CODE = 4


class HfdistError(Exception):
    """Base of every error hfdist raises for bad input or a strategy not in effect; the message names the fix."""


class DataError(HfdistError, ValueError):
    """A dataset, a row of it, a dataset spec, or a tokenizer that hfdist cannot use as given."""


def _leave_for_hand_over(rank: str, message: str) -> bool:
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder or not Path(folder).is_dir():
        return False
    # written aside and renamed: torch elastic stops the other ranks when one exits, and a rank stopped mid-write
    # must leave no half paragraph for the hand-over to print
    staged = Path(folder) / f".rank-{rank}.partial"
    try:
        staged.write_text(message)
        staged.replace(Path(folder) / f"rank-{rank}.txt")
    except OSError:
        return False
    return True


def report_error(message: str) -> None:
    """This rank's one-paragraph error: left for hfdist's hand-over, which prints it last (module docstring), or
    printed on stderr."""
    rank = os.environ.get("RANK", "0")
    if not _leave_for_hand_over(rank, message):
        where = f" (rank {rank})" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"hfdist: error{where}: {message}", file=sys.stderr, flush=True)


def run_with_clear_errors(job: Callable[[], int]) -> int:
    """Run `job`; an HfdistError prints as one paragraph on stderr (no traceback) and gives exit code 2."""
    try:
        return job()
    except HfdistError as exc:
        report_error(str(exc))
        return 2


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    contiguous = ranks == list(range(ranks[0], ranks[-1] + 1))
    return f"ranks {ranks[0]}-{ranks[-1]}" if contiguous else "ranks " + ", ".join(map(str, ranks))


def collected_errors(folder: Path) -> list[str]:
    """What the ranks of a failed hand-over left in `folder`: each distinct hfdist paragraph once, prefixed with the
    ranks that raised it."""
    by_text: dict[str, list[int]] = {}
    for path in sorted(folder.glob("rank-*.txt")):
        by_text.setdefault(path.read_text(), []).append(int(path.stem.split("-", 1)[1]))
    return [f"hfdist: error ({_ranks(sorted(ranks))}): {text}" for text, ranks in by_text.items()]
