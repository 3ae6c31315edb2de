"""hfdist's console: hfdist's own lines, progress bars and errors on the screen; library chatter in a log file.

A run's processes print a lot that is not for the person watching it: accelerate's and torch elastic's launcher
notes, DeepSpeed's accelerator detection (once per rank, even in an FSDP run), transformers' token-alignment
notice, deprecation warnings, W&B's banners. `start()` routes each process's stdout and stderr:

    text starting with "hfdist" (hfdist's lines and error paragraphs)   -> screen and log
      (also after the prefix Ray puts on the lines it forwards from a worker: "(RayTrainWorker pid=N) hfdist: ...")
    progress-bar redraws (text starting with "\\r", how tqdm draws)       -> screen
    uncaught exceptions (tracebacks of real failures)                   -> screen and log
    everything else (library logging, warnings, prints)                 -> log only; --verbose: screen too

The decision is made per write at the start of a line and holds until the line ends, so a multi-line paragraph
stays together. Library progress bars (datasets' map, transformers' shard writing) are switched off unless verbose:
their redraws would otherwise reach the screen. Code that draws for the person (a progress bar, a closing table)
can also write to `screen()` directly; `say()` prints one line to screen and log.

The log file (OUTPUT_DIR/logs/<name>.log) is opened once the run's output folder exists: until then its lines wait
in memory, so a run stopped by bad input before it wrote anything leaves no folder behind (its hfdist paragraph
says what is wrong). An uncaught exception writes the log out in any case, and so does `finish()`.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import os
import re
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn, TextIO

__all__ = ["SCREEN_PREFIX", "LOG_DIR_ENV", "VERBOSE_ENV", "log_dir", "log_path", "start", "finish", "leave", "stop",
           "routed", "screen", "say", "launch_env"]

SCREEN_PREFIX = "hfdist"
# How hfdist's hand-over tells the processes it starts where their logs go and whether to be verbose.
LOG_DIR_ENV = "HFDIST_LOG_DIR"
VERBOSE_ENV = "HFDIST_VERBOSE"
# The prefix Ray's driver puts on each line it forwards from a worker process (colour codes, the actor and its pid).
_FORWARDED = re.compile(r"(\x1b\[[\d;]*m)?\(\w+ pid=\d+(, ip=[\w.:]+)?\)(\x1b\[[\d;]*m)? ")
# Library progress bars off (their redraws would bypass the log), set before the libraries read them.
_QUIET_ENV = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def log_dir(output_dir: str | Path) -> Path:
    """The folder of a run's library logs: OUTPUT_DIR/logs."""
    return Path(output_dir) / "logs"


def log_path(output_dir: str | Path, name: str) -> Path:
    """Where a process's library log goes: OUTPUT_DIR/logs/<name>.log (name: rank-R, launcher)."""
    return log_dir(output_dir) / f"{name}.log"


def launch_env(output_dir: str | Path, verbose: bool) -> dict[str, str]:
    """Environment for the processes a hand-over starts: where the launcher logs, verbosity, and libraries' own
    progress bars off unless verbose."""
    return {LOG_DIR_ENV: str(log_dir(output_dir)), **({VERBOSE_ENV: "1"} if verbose else dict(_QUIET_ENV))}


class _DeferredLog(io.TextIOBase):
    """The log file, opened (appending) once `anchor` (the run's output folder) exists; lines wait in memory until
    then."""

    def __init__(self, path: Path) -> None:
        self.path, self.anchor = path, path.parent.parent
        self._file: TextIO | None = None
        self._pending: list[str] = []

    def materialise(self) -> None:
        """Open the file now (creating its folders) and write what waited."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (the process's log)
            self._file.write("".join(self._pending))
            self._pending.clear()

    def write(self, text: str) -> int:
        if self._file is None and self.anchor.is_dir():
            self.materialise()
        if self._file is None:
            self._pending.append(text)
        else:
            self._file.write(text)
        return len(text)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _for_screen(line: str) -> bool:
    """Whether a line is hfdist's (maybe forwarded by Ray from a worker)."""
    forwarded = _FORWARDED.match(line)
    return line.startswith(SCREEN_PREFIX, forwarded.end() if forwarded else 0)


class _Router(io.TextIOBase):
    """A text stream that sends each line to the screen, the log, or both (module docstring)."""

    def __init__(self, screen_stream: TextIO, log: TextIO, verbose: bool) -> None:
        self._screen, self._log, self._verbose = screen_stream, log, verbose
        self._line_start, self._to_screen, self._bar = True, True, False
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        if not text:
            return 0
        with self._lock:
            bar_part = text.startswith("\r") or (self._bar and text.startswith("\n"))
            if text.startswith("\r"):  # a bar redraw: the bar's line stays open on the screen
                self._to_screen, self._bar = True, True
            elif self._bar and text.startswith("\n"):  # the newline that closes the bar
                self._to_screen, self._bar = True, False
            elif self._line_start or self._bar:  # a new line, or another thread's text while a bar is drawn
                self._to_screen, self._bar = self._verbose or _for_screen(text), False
            if self._to_screen:
                self._screen.write(text)
            if not bar_part:  # bar redraws would fill the log with copies of one line
                self._log.write(text)
            self._line_start = text.endswith("\n")
        return len(text)

    def flush(self) -> None:
        self._screen.flush()
        self._log.flush()

    def fileno(self) -> int:  # C-level writers (faulthandler) reach the terminal
        return self._screen.fileno()

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:
        return getattr(self._screen, "encoding", "utf-8")


_state: dict[str, object] = {}


def screen() -> TextIO:
    """The terminal's stream (stderr), for progress bars and tables; the plain sys.stderr before `start()`."""
    return _state.get("screen_err", sys.stderr)  # type: ignore[return-value]


def say(text: str) -> None:
    """One line for the person running hfdist: on the screen and in the log."""
    print(text if text.startswith(SCREEN_PREFIX) else f"{SCREEN_PREFIX}: {text}", flush=True)


def _show_exception(exc_type, exc, tb) -> None:
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    screen().write(text)
    screen().flush()
    log = _state.get("log")
    if isinstance(log, _DeferredLog):  # a crash keeps its log, output folder or not
        log.write(text)
        log.materialise()
        log.flush()


def finish() -> None:
    """Write the log out if the run's output folder exists (a process about to leave without its interpreter's
    exit handlers, as a finished rank does, calls this)."""
    log = _state.get("log")
    if isinstance(log, _DeferredLog):
        if log.anchor.is_dir():
            log.materialise()
        log.flush()


def leave(code: int) -> NoReturn:
    """End this process with exit status `code`, its work done, without the interpreter's teardown: the log and the
    streams are flushed first. For the processes a job starts (the hand-over, the launcher, each rank), whose work is
    over when this is called: every file they write is closed by then, trackers finished, checkpoints waited for.

    Why: the teardown garbage-collects the modules torch, transformers and DeepSpeed loaded, 0.4-1.4 s of CPU per
    process after the run has ended, paid in series down the chain hand-over -> launcher -> ranks on every launch;
    and in a rank gloo's threads can abort it ("terminate called without an active exception", SIGABRT), turning a
    finished run into a failed one."""
    finish()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a reader that went away (`hfdist configs | head`), a closed stream
            pass
    os._exit(code)


def _repoint_handlers(old: tuple[TextIO, ...], new_out: TextIO, new_err: TextIO) -> None:
    """Logging handlers made before start() (transformers' default handler, torch's) hold the old streams."""
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for lg in loggers:
        for handler in lg.handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in old:
                handler.setStream(new_out if handler.stream is old[0] else new_err)


def start(log_file: str | Path, verbose: bool = False) -> None:
    """Route this process's stdout/stderr as the module docstring says, library output into `log_file`
    (OUTPUT_DIR/logs/<name>.log, appended). Idempotent: a second call keeps the first routing."""
    if _state:
        return
    path = Path(log_file)
    log = _DeferredLog(path)
    atexit.register(finish)
    if not verbose:
        os.environ.update(_QUIET_ENV)
    old = (sys.stdout, sys.stderr)
    _state.update(screen_out=sys.stdout, screen_err=sys.stderr, log=log, path=path, verbose=verbose)
    sys.stdout = _Router(old[0], log, verbose)  # type: ignore[assignment]
    sys.stderr = _Router(old[1], log, verbose)  # type: ignore[assignment]
    # Python's warnings print to sys.stderr at the time they are shown, so they reach the log through the router.
    _repoint_handlers(old, sys.stdout, sys.stderr)  # type: ignore[arg-type]
    sys.excepthook = _show_exception
    threading.excepthook = lambda args: _show_exception(args.exc_type, args.exc_value, args.exc_traceback)
    if not verbose and "transformers.utils.logging" in sys.modules:  # imported before start(): switch its bars off
        sys.modules["transformers.utils.logging"].disable_progress_bar()


def stop() -> None:
    """Give this process its original streams back (tests; the routing otherwise lasts the process)."""
    if not _state:
        return
    routed = (sys.stdout, sys.stderr)
    sys.stdout, sys.stderr = _state["screen_out"], _state["screen_err"]  # type: ignore[assignment]
    _repoint_handlers(routed, sys.stdout, sys.stderr)
    sys.excepthook, threading.excepthook = sys.__excepthook__, threading.__excepthook__
    atexit.unregister(finish)
    _state["log"].close()  # type: ignore[union-attr]
    _state.clear()


@contextlib.contextmanager
def routed(log_file: str | Path, verbose: bool = False) -> Iterator[None]:
    """`start()` for the length of a with block, for a process that routes only part of its life (the hand-over,
    while accelerate's launcher runs in it); a process already routed keeps its routing."""
    if _state:
        yield
        return
    start(log_file, verbose)
    try:
        yield
    finally:
        finish()
        stop()
