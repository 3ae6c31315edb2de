"""The error every data step raises for input hfdist cannot train on (one paragraph: the problem and the fix)."""

from __future__ import annotations

from hfdist.errors import HfdistError

__all__ = ["DataError"]


class DataError(HfdistError, ValueError):
    """A dataset, a row of it, or a tokenizer that hfdist cannot use as given."""
