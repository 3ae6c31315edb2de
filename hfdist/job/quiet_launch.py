"""`accelerate launch` for hfdist's hand-over, without the launch stack's own tracebacks.

    python -m hfdist.job.quiet_launch <accelerate launch arguments>

accelerate's launchers end a failed run with a traceback of their own (subprocess.CalledProcessError from the
single-process and DeepSpeed launchers, torch elastic's ChildFailedError report from the multi-process one) after
the ranks' output, so hfdist's one-paragraph error would be buried above it. This runs the same
`accelerate.commands.launch.launch_command` in-process and turns those exceptions into the ranks' exit code, with
which ranks failed written for the hand-over (hfdist.job.launch) to report. The launcher's own notes (torch elastic's
thread and signal messages, accelerate's hints) go to OUTPUT_DIR/logs/launcher.log (hfdist.console).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hfdist.errors import ERROR_DIR_ENV, FAILURES_FILE

__all__ = ["main"]


def _record_failures(failures: dict[int, int]) -> None:
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder and Path(folder).is_dir():
        (Path(folder) / FAILURES_FILE).write_text(json.dumps({"failures": failures}))


def main(argv: list[str] | None = None) -> int:
    """Run `accelerate launch` with `argv`; returns the exit code of the failed rank (0 when every rank succeeded)."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from hfdist import console

    args = launch_command_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if os.environ.get(console.LOG_DIR_ENV):
        console.start(Path(os.environ[console.LOG_DIR_ENV]) / "launcher.log",
                      verbose=bool(os.environ.get(console.VERBOSE_ENV)))
    try:
        launch_command(args)
    except subprocess.CalledProcessError as exc:
        _record_failures({0: exc.returncode})
        return exc.returncode or 1
    except ChildFailedError as exc:
        codes = {int(rank): int(failure.exitcode) for rank, failure in exc.failures.items()}
        _record_failures(codes)
        _, first = exc.get_first_failure()
        return first.exitcode if first.exitcode > 0 else 1
    except SignalException as exc:  # the agent got a signal and forwarded it to the ranks
        _wait_for_ranks()
        return 128 + int(exc.sigval)  # as a shell reports a process the signal ended (the hand-over reads the ranks')
    return 0


def _wait_for_ranks() -> None:
    """After the agent forwarded a signal: wait until every rank (a child of this process) has exited, ignoring more
    of the signals the agent forwards. A second signal (Slurm signals every process of a job; hfdist's hand-over
    forwards its own) would otherwise end the agent's wait early and this process with it, while the ranks are still
    writing their checkpoint; the ranks stop on their own (hfdist.train.preemption)."""
    import signal

    for name in os.environ.get("PET_SIGNALS_TO_HANDLE", "SIGTERM").split(","):
        signal.signal(signal.Signals[name.strip()], signal.SIG_IGN)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return


if __name__ == "__main__":
    from hfdist.console import leave

    leave(main())
