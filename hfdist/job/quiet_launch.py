"""`accelerate launch` run inside hfdist's hand-over process, without the launch stack's own tracebacks.

Why in this process: a launcher of its own would be one more Python started on every launch that imports torch and
accelerate again (about a second of CPU, before any rank starts); the hand-over has imported them already. The
ranks are this process's children, torch elastic's agent runs in its main thread, and the agent's signal handlers
are this process's while the launch runs (hfdist.job.launch, preemption).

Why quiet: accelerate's launchers end a failed run with a traceback of their own (subprocess.CalledProcessError from
the single-process and DeepSpeed launchers, torch elastic's ChildFailedError report from the multi-process one) after
the ranks' output, so hfdist's one-paragraph error would be buried above it. `launch_here` turns those exceptions
into the ranks' exit code and which ranks failed, for the hand-over to report. The agent handles the signals torch
elastic lists in PET_SIGNALS_TO_HANDLE, which the hand-over sets without the preemption signals: those it relays to
the ranks itself (hfdist.job.signal_relay). The launcher's own notes (torch
elastic's thread and signal messages, accelerate's hints) go to OUTPUT_DIR/logs/launcher.log (hfdist.console).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["launch_here"]


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ is `env` inside (accelerate builds the ranks' environment from it), as it was after."""
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """torch elastic's agent installs its own handlers for the signals it forwards: the caller's come back after."""
    saved = {sig: signal.getsignal(sig) for sig in signal.valid_signals()
             if sig not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(sig) is not None}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, handler)


def launch_here(argv: list[str], env: Mapping[str, str]) -> tuple[int, dict[int, int]]:
    """Run `accelerate launch <argv>` in this process, the ranks started with environment `env`.

    Returns:
        The exit code (0 when every rank succeeded, else the first failed rank's; 128 + the signal when the agent
        got a signal and forwarded it to the ranks) and {rank: exit code} of the ranks that failed.
    """
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from hfdist import console

    args = launch_command_parser().parse_args(argv)
    log_folder = env.get(console.LOG_DIR_ENV)
    routing = (console.routed(Path(log_folder) / "launcher.log", verbose=bool(env.get(console.VERBOSE_ENV)))
               if log_folder else contextlib.nullcontext())
    with _environment(env), _signal_handlers_kept(), routing:
        try:
            launch_command(args)
        except subprocess.CalledProcessError as exc:
            return exc.returncode or 1, {0: exc.returncode}
        except ChildFailedError as exc:
            _, first = exc.get_first_failure()
            failures = {int(rank): int(failure.exitcode) for rank, failure in exc.failures.items()}
            return (first.exitcode if first.exitcode > 0 else 1), failures
        except SignalException as exc:  # the agent got one of its signals (Ctrl-C; preemption's are relayed by
            # hfdist.job.signal_relay, never the agent's) and stopped the ranks
            return 128 + int(exc.sigval), {}  # as a shell reports a process the signal ended
    return 0, {}
