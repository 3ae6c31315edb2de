"""hfdist's error base and the entry-point wrapper that turns its errors into one clear paragraph and exit 2."""

from __future__ import annotations

import os
import sys
from typing import Callable

__all__ = ["HfdistError", "run_with_clear_errors"]


class HfdistError(Exception):
    """Base of every error hfdist raises for bad input or a strategy not in effect; the message names the fix."""


def run_with_clear_errors(job: Callable[[], int]) -> int:
    """Run `job`; an HfdistError prints as one paragraph on stderr (no traceback) and gives exit code 2."""
    try:
        return job()
    except HfdistError as exc:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        where = f" (rank {os.environ.get('RANK', '0')})" if world > 1 else ""
        print(f"hfdist: error{where}: {exc}", file=sys.stderr, flush=True)
        return 2
