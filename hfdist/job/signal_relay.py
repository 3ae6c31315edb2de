"""The hand-over's side of preemption: the first preemption signal it receives is relayed once to every process it
started (the ranks, or the one process of the single rung's restart), and every later one is ignored until it exits.

Why hfdist relays, and not torch elastic's agent: the agent turns a signal into an exception (SignalException) raised
wherever its main thread happens to be, forwards the signal and waits for the ranks; a second signal (Slurm signals
every process of a job; a pod may be signalled again) raised the exception again inside that wait, unwinding the
launch while the ranks were still writing their checkpoint, so the exit code depended on when the signals landed (a
preempted zero3 run exited 143 instead of 75 in one loaded suite run). Relayed here, the signal never reaches the
agent (hfdist.config.preemption.elastic_env leaves the relayed signals out of its list): it keeps watching the ranks,
which checkpoint and exit as for a signal on one rank, and nothing this process does later depends on how many
signals came or when.

Why once: one preemption is one event. Every rank learns it at the step's agreement (hfdist.train.preemption), and a
rank that has stopped training keeps ignoring the signals, so a repeat has nothing to add; a repeat relayed to a
process outside training would end it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from hfdist.processes import children, signal_each

__all__ = ["SignalRelay"]


class SignalRelay:
    """While entered (in the main thread): the first of `signals` this process receives goes to every process
    `targets()` names (default: this process's children), later ones are ignored.

    On leaving, the previous handlers come back only if nothing was relayed; after a relay the signals stay ignored
    until the process exits, so a signal during its last steps (reading the ranks' outcome, printing) cannot turn a
    preempted run's exit code into a kill's.

    Attributes:
        received: the name of the relayed signal, or None.
    """

    def __init__(self, signals: Sequence[str], targets: Callable[[], list[int]] = children) -> None:
        self.signals = tuple(signal.Signals[name] for name in signals)
        self.targets = targets
        self.received: str | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            return
        self.received = signal.Signals(signum).name
        for sig in self.signals:  # every later preemption signal is the same event
            signal.signal(sig, signal.SIG_IGN)
        signal_each(self.targets(), signal.Signals(signum))

    def __enter__(self) -> SignalRelay:
        if threading.current_thread() is not threading.main_thread():  # Python runs handlers there only
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.received is None:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
