"""The processes a launch starts, found and signalled from the process that started them (Linux /proc).

A hand-over's ranks are its children, and torch elastic starts each in a process session of its own (setsid), so
signalling the hand-over's process group reaches none of them: what must reach every rank (a relayed preemption
signal, hfdist.job.signal_relay; the end of a timed-out tune probe or GPU-suite cell, `run_logged`) is sent to each
process found here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["children", "descendants", "signal_each", "end_process_tree", "run_logged"]


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every process visible in /proc (empty where there is no /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it exited while we looked
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ')'.
        parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return parents


def children(pid: int | None = None) -> list[int]:
    """The live direct children of process `pid` (this process by default)."""
    pid = os.getpid() if pid is None else pid
    return sorted(child for child, parent in _parents().items() if parent == pid)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`: its children, theirs, and so on (a process re-parented to init when its
    parent died is no longer found)."""
    parents = _parents()
    below: dict[int, list[int]] = {}
    for child, parent in parents.items():
        below.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in below.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_each(pids: list[int], sig: signal.Signals) -> None:
    """Send `sig` to each process, skipping those that have exited meanwhile."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def end_process_tree(proc: subprocess.Popen, grace: float) -> None:
    """End `proc` and everything it started: SIGTERM to `proc` (a hand-over relays it to its ranks, which leave or
    checkpoint), then, after `grace` seconds, SIGKILL to whatever of the tree is left, found before the first signal
    (ranks in sessions of their own included) and again after the grace."""
    tree = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (proc.poll() is None or any(_alive(p) for p in tree)):
        time.sleep(0.1)
    signal_each(sorted({*tree, *descendants(proc.pid)}), signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()


def run_logged(cmd: list[str], log: Path, *, timeout: float, grace: float, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> int | None:
    """Run `cmd` with its output (stdout and stderr) written to `log`; its exit code, or None when it was still
    running after `timeout` seconds and was ended with every process it started (`end_process_tree`: SIGKILL
    `grace` seconds after SIGTERM). A tune probe's and a GPU-suite cell's way to run a launch."""
    with log.open("w") as out:  # a file, not a pipe: nothing blocks on a full pipe while the tree is ended
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_process_tree(proc, grace)
            return None


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
