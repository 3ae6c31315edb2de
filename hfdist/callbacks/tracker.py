"""TrackerSink: what every experiment tracker of a run shares (W&B, MLflow, TensorBoard, Trackio): written by the
logging rank only, opened at its first use, and never able to stop training.

A tracker is a view of the run, not its record (the local JSON summary is): every call into a tracker's library is
guarded, the first failure (no package, bad credentials, unreachable server, full disk) prints one warning naming the
tracker and turns that tracker off, and training goes on with the others.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Mapping

__all__ = ["TrackerSink", "numeric"]


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numbers among a log's values (trackers that store scalar series refuse strings and lists)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


class TrackerSink:
    """One tracker's run of one job. On ranks that don't log (`active=False`) every method is a no-op.

    Subclasses open their run in `_open` and write through `_call`, which turns the tracker off at the first failure.

    Args:
        label: the tracker's name in messages ("W&B", "MLflow", ...).
        active: whether this rank logs (rank 0).
    """

    label = "tracker"

    def __init__(self, *, active: bool) -> None:
        self.active = active
        self.error: str | None = None  # why the tracker was turned off, for the local summary
        self._run: Any = None
        self._closed = not active

    def _warn_and_disable(self, what: str, exc: BaseException) -> None:
        if self.error is None:
            first_line = (str(exc).strip().splitlines() or [""])[0]
            self.error = f"{self.label} {what} failed: {type(exc).__name__}: {first_line}"
            print(f"hfdist: warning: {self.error}. Training goes on without {self.label}; the local JSON summary is "
                  "the record.", file=sys.stderr, flush=True)
        self._closed = True

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # any tracker failure: warn once, keep training
            self._warn_and_disable(what, exc)
            return None

    def _open(self) -> Any:
        """Start the tracker's run; returns its handle (raises on failure)."""
        raise NotImplementedError

    def _ensure_run(self) -> Any:
        if self._closed:
            return None
        if self._run is None:
            self._run = self._call("init", self._open)
        return None if self._closed else self._run

    def start(self) -> bool:
        """Open the run now (e.g. before training, so the tracker's start-up stays out of step times); True if it is
        open."""
        return self._ensure_run() is not None

    @property
    def location(self) -> str | None:
        """Where the run is (a folder, or a URI and run id), once started; None otherwise."""
        return None

    def record(self) -> dict[str, Any]:
        """What the local summary says of this tracker: where its run is and why it was turned off, if it was."""
        return {"location": self.location, "error": self.error}
