"""Hang diagnostics: when a collective times out, every surviving rank says who never joined, in which collective
and step, and where each rank was; then the job ends.

The pieces, all from torch 2.13 itself:
- `--collective-timeout` is set on every process group this process holds, once the world forms and again once the
  mesh's groups exist (`_set_pg_timeout`): TrainingArguments' ddp_timeout reaches `init_process_group` on GPU only
  (transformers 5.23 drops it with use_cpu), and `new_group` defaults to torch's 30 minutes, not the world's
  timeout. gloo then raises in every rank that waits longer in one collective (checked: "Timed out waiting
  20000ms for recv operation"); NCCL's watchdog aborts.
- torch's flight recorder, on for every backend by `TORCH_FR_BUFFER_SIZE` (gloo included; NCCL's older
  `TORCH_NCCL_TRACE_BUFFER_SIZE` is deprecated in torch 2.13): each rank's last collectives, with the per-group sequence number of
  the last one it enqueued. On GPU `TORCH_NCCL_DUMP_ON_TIMEOUT` has NCCL write it on a timeout, to
  OUTPUT_DIR/logs/flight_recorder/rank_<r>; on CPU the report below reads it in-process.
- a heartbeat thread per rank that publishes, at every step and at least every HEARTBEAT_SECONDS, into the job's
  c10d store its step, its flight-recorder group status and its main thread's Python stack. A stopped, dead or GIL-holding rank stops
  publishing, so its last heartbeat is where it was; the store (kept by the launcher's agent) outlives it.

NCCL raises nothing in Python: the main thread waits inside CUDA, and torch's own watchdog aborts the process once
a collective has waited the timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING=3). So under NCCL the heartbeat thread
watches NCCL's flight recorder (`_dump_nccl_trace_json`; gloo's is `_dump_fr_trace_json`) and reports once this rank's
oldest unfinished collective has waited STALL_FRACTION of the timeout, before torch's watchdog would.

Phases in which rank 0 works alone while the others wait in a collective (data preparation behind
main_process_first, the streamed save of the model, W&B's start and the summary) run under `alone` / `solo_phase`: every group's timeout is widened to
SOLO_PHASE_TIMEOUT_SECONDS (or the --collective-timeout, if longer) for the phase and restored after it.

On the timeout each surviving rank reports in three steps (`CollectiveWatch.report_and_exit`):
- diagnose (hfdist.train.hang_report.diagnose, a pure function): the timed-out collective's sequence number against
  every rank's last enqueued one in that group: the ranks behind it never joined; with the silent ones and those
  that never published;
- act: silent ranks on this rank's own host are killed (a stopped process ignores the launcher's SIGTERM until torch
  elastic's 30 s grace ends), and a save they were part of, which can never finish, is removed;
- render (hang_report.render): the report, to the screen and, written atomically, to
  OUTPUT_DIR/logs/hang-rank-<r>.txt.
The rank then leaves at once (exit code EXIT_CODE) without touching the process group, whose teardown would wait on
the missing rank, and the launcher stops the others.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from transformers.trainer_callback import TrainerCallback

from hfdist.train import hang_report
from hfdist.train.hang_report import HEARTBEAT_SECONDS, HangDiagnosis

__all__ = ["CollectiveWatch", "StepWatchCallback", "flight_recorder_env", "solo_phase", "HEARTBEAT_SECONDS",
           "EXIT_CODE", "MIN_TIMEOUT_SECONDS", "DEFAULT_TIMEOUT_SECONDS", "SOLO_PHASE_TIMEOUT_SECONDS", "STALL_FRACTION",
           "TEST_HOLD_ENV"]

DEFAULT_TIMEOUT_SECONDS = 300.0  # long enough for a first step's lazy init and a large checkpoint's collectives
MIN_TIMEOUT_SECONDS = 1.0
# Rank 0 alone: 280 GB of fp32 70B weights at 30 MB/s, or tokenizing a large dataset (its cache makes reruns fast).
SOLO_PHASE_TIMEOUT_SECONDS = 3 * 3600.0
STALL_FRACTION = 0.8  # under NCCL the heartbeat reports at this share of the timeout, before torch's watchdog aborts
# Tests only: HFDIST_TEST_HOLD_<KEY>=seconds holds rank 0 that long alone at the start of the solo phase KEY (DATA:
# data preparation, SAVE: the streamed save, WANDB / SUMMARY: W&B's start, the summary), to show the others wait.
TEST_HOLD_ENV = "HFDIST_TEST_HOLD_"
EXIT_CODE = 3
_STACK_FRAMES = 12
_FR_ENTRIES = "2000"
_PREFIX = "hfdist/heartbeat/"


def flight_recorder_env(output_dir: str | Path) -> dict[str, str]:
    """The environment that turns torch's flight recorder on (gloo and NCCL) and has NCCL dump it on a timeout into
    OUTPUT_DIR/logs/flight_recorder/rank_<r>. Set before the process group forms; a user's own values win."""
    dump = str(Path(output_dir) / "logs" / "flight_recorder" / "rank_")
    return {"TORCH_FR_BUFFER_SIZE": _FR_ENTRIES, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": dump, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump}


def _flight_record(collectives: bool, nccl: bool = False, only_active: bool = False) -> dict[str, Any]:
    """This process's flight-recorder record: NCCL's under NCCL, else gloo's (torch keeps one per backend);
    {"error": why} when it is off or unreadable. only_active: just the collectives not finished."""
    try:
        import torch._C._distributed_c10d as c10d

        dump = c10d._dump_nccl_trace_json if nccl else c10d._dump_fr_trace_json
        raw = dump(collectives, only_active)  # (includeCollectives, onlyActive), both recorders alike
        return json.loads(raw.decode(errors="replace") if isinstance(raw, bytes) else raw)
    except Exception as exc:  # noqa: BLE001 (diagnostics must never fail the run)
        return {"error": f"{type(exc).__name__}: {exc}"}


def _main_stack() -> list[str]:
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return []
    return [line.rstrip() for line in traceback.format_stack(frame)[-_STACK_FRAMES:]]


class CollectiveWatch:
    """A rank's heartbeat and, on a collective timeout, its report. Use `watching()` around the collective work.

    Args:
        output_dir: the run's output folder (the report is also written under its logs/).
        timeout: the --collective-timeout in effect (seconds), quoted in the report.
    """

    def __init__(self, output_dir: str | Path, timeout: float) -> None:
        self.output_dir = Path(output_dir)
        self.timeout = timeout
        self.phase = "setting up"
        self.step: int | None = None
        self._store = None
        self._rank, self._world = 0, 1
        self._nccl = False  # set by start(): NCCL's flight recorder, and stalls reported by the heartbeat
        self._timeout_now = timeout  # the timeout the groups have now (widened in a solo phase)
        self._stop, self._wake = threading.Event(), threading.Event()
        self._reporting = threading.Lock()  # one report per process: the heartbeat's or the main thread's
        self._record: dict[str, Any] = {}

    def where(self, phase: str, step: int | None = None) -> None:
        """What this rank is doing now (published at once by the heartbeat thread, at most every 0.2 s)."""
        self.phase, self.step = phase, step
        self._wake.set()

    def _beat(self) -> dict[str, Any]:
        status = _flight_record(collectives=False, nccl=self._nccl).get("pg_status", {})
        return {"rank": self._rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                "phase": self.phase, "step": self.step,
                "last_enqueued": {pg: s.get("last_enqueued_collective") for pg, s in status.items()},
                "stack": _main_stack()}

    def _publish(self) -> None:
        with contextlib.suppress(Exception):  # a store hiccup must not kill the rank; the next beat retries
            self._store.set(f"{_PREFIX}{self._rank}", json.dumps(self._beat()))

    def _loop(self) -> None:
        while not self._stop.is_set():
            # A short timeout is checked often enough to report before it runs out (NCCL).
            self._wake.wait(min(HEARTBEAT_SECONDS, 0.1 * self._timeout_now))
            self._wake.clear()
            if self._stop.is_set():
                return
            self._publish()
            if self._nccl:
                self._report_stall()
            self._stop.wait(0.2)  # a fast run's steps must not turn the heartbeat into a busy loop

    def _report_stall(self) -> None:
        """Under NCCL: report and leave once this rank's oldest unfinished collective has waited STALL_FRACTION of
        the timeout (torch's watchdog times it from the same moment, its enqueueing, and aborts at the whole)."""
        entries = _flight_record(collectives=True, nccl=True, only_active=True).get("entries", [])
        waiting = [e for e in entries if not e.get("retired") and e.get("state") != "completed"]
        if not waiting:
            return
        oldest = min(int(e.get("time_created_ns") or 0) for e in waiting)
        if time.time() - oldest / 1e9 >= STALL_FRACTION * self._timeout_now:
            self._stop.set()
            self.report_and_exit(None)

    def _set_timeout(self, seconds: float) -> None:
        """Put `seconds` on every process group this rank is in (and the heartbeat's stall threshold)."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        self._timeout_now = seconds
        if not (dist.is_available() and dist.is_initialized()):
            return
        for group in list(c10d._world.pg_map):
            if not c10d._rank_not_in_group(group):
                c10d._set_pg_timeout(timedelta(seconds=seconds), group)

    def cover_groups(self) -> None:
        """Put the timeout on every process group that exists now (call again after creating more)."""
        self._set_timeout(self._timeout_now)

    @contextlib.contextmanager
    def alone(self, phase: str, key: str) -> Iterator[None]:
        """Run a phase in which rank 0 works alone while the other ranks wait for it: every group's timeout is
        SOLO_PHASE_TIMEOUT_SECONDS (or the --collective-timeout, if longer) for the phase, which every rank leaves
        together (a barrier at its end, so that no rank waits for rank 0 after its timeout is restored). Must be
        entered by every rank. `key` names the phase's test hold (TEST_HOLD_ENV + key, seconds; rank 0 only)."""
        import torch.distributed as dist

        before = (self.phase, self.step)
        self.where(phase)
        self._set_timeout(max(self.timeout, SOLO_PHASE_TIMEOUT_SECONDS))
        try:
            hold = float(os.environ.get(TEST_HOLD_ENV + key) or 0)
            if hold > 0 and self._rank == 0:
                print(f"hfdist: test hold: rank 0 alone in {phase} for {hold:g} s ({TEST_HOLD_ENV}{key})",
                      file=sys.stderr, flush=True)
                time.sleep(hold)
            yield
            if dist.is_available() and dist.is_initialized():
                dist.barrier()
        finally:
            self._set_timeout(self.timeout)
            self.where(*before)

    def start(self) -> None:
        """Put the timeout on the process groups and start publishing heartbeats (once the world has formed; a
        no-op without a process group)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        self.cover_groups()
        self._store = dist.distributed_c10d._get_default_store()
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self._nccl = "nccl" in str(dist.get_backend())  # "nccl", or "cuda:nccl,cpu:gloo" beside CPU offload
        self._publish()
        _STARTED[:] = [self]
        threading.Thread(target=self._loop, name="hfdist-heartbeat", daemon=True).start()

    def stop(self) -> None:
        """Stop the heartbeat thread."""
        self._stop.set()
        self._wake.set()
        if self in _STARTED:
            _STARTED.clear()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Run the block; a collective timeout inside it prints the report and ends this process (EXIT_CODE)."""
        try:
            yield
        except BaseException as exc:
            if not _is_timeout(exc):
                raise
            self._stop.set()
            self.report_and_exit(exc)

    def _beats(self, exc: BaseException | None) -> dict[int, dict[str, Any]]:
        """Every rank's last heartbeat that the store holds; this rank's now, its stack where the timeout struck
        (its main thread's now, when the heartbeat found the stall)."""
        beats = {}
        with contextlib.suppress(Exception):
            self._store.set_timeout(timedelta(seconds=5))  # the report must not wait a full timeout on the store
        for rank in range(self._world):
            key = f"{_PREFIX}{rank}"
            with contextlib.suppress(Exception):
                if self._store.check([key]):
                    beats[rank] = json.loads(self._store.get(key))
        beats[self._rank] = self._beat()
        if exc is not None:
            beats[self._rank]["stack"] = [ln.rstrip() for ln in traceback.format_tb(exc.__traceback__)[-_STACK_FRAMES:]]
        return beats

    def diagnose(self, exc: BaseException | None = None) -> HangDiagnosis:
        """Gather this rank's flight-recorder record and every rank's last heartbeat, and diagnose the hang
        (hfdist.train.hang_report.diagnose).

        Args:
            exc: the timeout the main thread raised (gloo); None when the heartbeat found the collective stalled
                (NCCL, before torch's watchdog aborts the process).
        """
        self._record = _flight_record(collectives=True, nccl=self._nccl)
        limit = f"--collective-timeout {self.timeout:g} s" if self._timeout_now == self.timeout else \
            f"the timeout {self._timeout_now:g} s of this phase (rank 0 works alone in it)"
        raised = exc is not None
        return hang_report.diagnose(self._record, self._beats(exc), rank=self._rank, world=self._world, now=time.time(),
                        where=f"step {self.step}" if self.step is not None else self.phase, limit=limit,
                        stall_fraction=None if raised else STALL_FRACTION,
                        unrecorded=_collective_from_stack(exc) if raised else "a collective",
                        timeout_message=str(exc).splitlines()[0].split("] ")[-1][:120] if raised else None)

    def act(self, diagnosis: HangDiagnosis) -> tuple[list[int], list[str]]:
        """End what the hang leaves behind: SIGKILL the silent ranks on this host (the job is ending; they cannot
        take part in it) and remove the unfinished save they were part of. Returns (killed ranks, removed saves)."""
        from hfdist.checkpoint.format import remove_unfinished

        killed = []
        for rank, pid in diagnosis.silent_on(socket.gethostname()):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                killed.append(rank)
        return killed, remove_unfinished(self.output_dir)

    def report_and_exit(self, exc: BaseException | None) -> None:
        """Diagnose, act, print the report and write it to logs/hang-rank-<r>.txt (atomically), and leave now. A
        second caller (the other thread) waits for the first one's exit."""
        self._reporting.acquire()
        diagnosis = self.diagnose(exc)
        text = hang_report.render(diagnosis, *self.act(diagnosis), exit_code=EXIT_CODE)
        print(text, file=sys.stderr, flush=True)
        logs = self.output_dir / "logs"
        _write_atomically(logs / f"hang-rank-{self._rank}.txt", text + "\n")
        # The flight recorder's record as JSON (under NCCL its own dump on a timeout, TORCH_NCCL_DUMP_ON_TIMEOUT,
        # never comes: the process leaves before torch's watchdog fires).
        _write_atomically(logs / "flight_recorder" / f"rank_{self._rank}.json", json.dumps(self._record, indent=1))
        from hfdist import console

        with contextlib.suppress(Exception):
            console.finish()
        sys.stdout.flush()
        os._exit(EXIT_CODE)


_STARTED: list[CollectiveWatch] = []  # this process's started watch (one per rank)


def solo_phase(phase: str, key: str) -> contextlib.AbstractContextManager:
    """`CollectiveWatch.alone(phase, key)` on this process's started watch; nothing without one (hfdist's trainer
    used outside the job)."""
    return _STARTED[0].alone(phase, key) if _STARTED else contextlib.nullcontext()


def _write_atomically(path: Path, text: str) -> None:
    """Write `path` whole or not at all (a partial file under another name, renamed); errors are ignored."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(text)
        os.replace(partial, path)


def _collective_from_stack(exc: BaseException) -> str:
    """The collective named by the stack the timeout raised through: the innermost torch.distributed call (c10d's
    function, e.g. all_gather_into_tensor, or the wait in FSDP's code), with the first caller outside torch."""
    frames = traceback.extract_tb(exc.__traceback__)
    c10d = [f for f in frames if f.filename.endswith("distributed_c10d.py")]
    inner = c10d[-1] if c10d else next((f for f in reversed(frames) if "torch/distributed" in f.filename),
                                       frames[-1] if frames else None)
    if inner is None:
        return "a collective"
    caller = next((f for f in reversed(frames) if "site-packages/torch/" not in f.filename), None)
    where = f", called from {Path(caller.filename).name}:{caller.lineno} {caller.name}" if caller else ""
    return f"torch.distributed {inner.name} ({Path(inner.filename).name}:{inner.lineno}{where})"


def _is_timeout(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a collective's timeout."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RuntimeError) and "timed out" in str(exc).lower():
            return True
        failures = getattr(exc, "failures", None)  # DCP's CheckpointException: rank -> (error, traceback)
        if isinstance(failures, dict) and any(_is_timeout(f[0] if isinstance(f, tuple) else f)
                                              for f in failures.values()):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class StepWatchCallback(TrainerCallback):
    """Tells the CollectiveWatch which step the rank is in (published with its heartbeat)."""

    def __init__(self, watch: CollectiveWatch) -> None:
        self.watch = watch

    def on_step_begin(self, args, state, control, **kwargs):
        self.watch.where("training", state.global_step + 1)

    def on_train_end(self, args, state, control, **kwargs):
        self.watch.where("after training")
