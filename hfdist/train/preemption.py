"""Preemption: a signal on any rank becomes a checkpoint at the next step boundary and a clean stop on every rank.

SIGTERM (Kubernetes, torchrun, Slurm at the time limit), SIGUSR1 (Slurm's `--signal` notice) and --preempt-signal,
received by any rank while it trains, set a flag in that rank (a Python signal handler, so only in the main thread:
under Ray Train, which trains in a thread of its worker, Ray's own restarts cover a lost worker instead). At the end of
every optimizer step all ranks agree on the flags with one small collective (a max over [signal, -rank], on a gloo
group: a CPU tensor, no device synchronisation); when one is set, every rank saves a checkpoint of that step (at once,
not in the background: nothing trains after it; a background write still in flight lands first) and the Trainer
stops. The trainer's `preempted` then says where and why; hfdist's job records it in hfdist_summary.json and the
trackers and exits with PREEMPTED_EXIT_CODE (hfdist.config.preemption), and `--resume` continues from that
checkpoint as from any other.

Rank 0 prints the grace a preemption needs (the last checkpoint's measured write + a step) against what the
environment advertises: at the start (a resumed run: its checkpoint's recorded write time) and after this run's first
checkpoint, with a warning when it does not fit.

Tests only: HFDIST_TEST_PREEMPT_AT=RANK:STEP[:SIGNAL[:FLAGS]] makes rank RANK send SIGNAL (default SIGTERM) as step
STEP begins to itself, or with the flag `launcher` to its launcher: the process that handed over to accelerate and
runs torch elastic's agent (what Kubernetes signals, a container's first process), twice, as under Slurm, which
signals every process of a job (the second arrives while the agent forwards the first); with `fresh`, only in a run
that did not
resume (a worker killed once, then restarted from a checkpoint). FLAGS is a comma-separated list. So a test preempts
or kills a run at a known step without timing a signal from outside.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers.trainer_callback import TrainerCallback

from hfdist.config.preemption import DEFAULT_SIGNALS, Grace, advertised_grace, grace_lines

__all__ = ["Preempted", "PreemptionWatch", "PreemptionCallback", "PreemptionMixin", "TEST_PREEMPT_ENV",
           "agreement_group"]

TEST_PREEMPT_ENV = "HFDIST_TEST_PREEMPT_AT"


@dataclass(frozen=True)
class Preempted:
    """Where a run stopped for a preemption: the step whose checkpoint was written, the signal, and the lowest rank
    that received it (every rank learns both from the step's agreement)."""

    step: int
    signal: str
    rank: int
    checkpoint: str | None = None
    save_seconds: float | None = None

    def record(self) -> dict[str, Any]:
        """As hfdist_summary.json's `preempted`."""
        return asdict(self)


def agreement_group() -> dist.ProcessGroup | None:
    """The group of the step boundary's small agreements (preemption's, the non-finite guard's): the world group
    where it has a CPU backend (gloo), else a gloo group of its own (a CUDA tensor under NCCL would synchronise the
    device every step); None without a process group. Collective where a group is made: every rank calls it at the
    same point."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from hfdist.checkpoint.background import world_timeout

    return dist.group.WORLD if "gloo" in str(dist.get_backend()) else dist.new_group(
        backend="gloo", timeout=world_timeout(), group_desc="hfdist_agreement")


class PreemptionWatch:
    """This rank's preemption signals (handlers installed while it trains) and the step boundary's agreement.

    Args:
        signals: signal names (hfdist.config.preemption.preempt_signals); empty: never preempted.
    """

    def __init__(self, signals: Sequence[str] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: tuple[str, float] | None = None  # the first signal this rank got, and when (time.time())
        self.armed = False
        self._previous: dict[signal.Signals, Any] = {}
        self.group: dist.ProcessGroup | None = None  # the agreement's (agreement_group); made by arm() if not set

    def _on_signal(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = (signal.Signals(signum).name, time.time())

    def arm(self) -> None:
        """Catch the signals (main thread only: Python runs handlers there) and make the agreement's group. Collective
        where a group is made: every rank arms at the same point (the start of training)."""
        if self.group is None and self.signals:
            self.group = agreement_group()
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.signals:
            sig = signal.Signals[name]
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self.armed = bool(self.signals)

    def disarm(self, preempted: bool = False) -> None:
        """Give the signals back to their previous handlers (the end of training); a preempted run ignores them
        instead until it exits: a repeated notice (Slurm signals every process of a job) is the same preemption, and
        must not end the rank while it writes its summary and leaves."""
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if preempted else handler)
        self._previous.clear()
        self.armed = False

    def agree(self) -> tuple[str, int] | None:
        """(signal, lowest rank that received it) when any rank received a preemption signal, else None; the same on
        every rank. Collective: one all_reduce (max) of two integers."""
        own = signal.Signals[self.received[0]].value if self.received else 0
        rank = dist.get_rank() if self.group is not None else 0
        if self.group is None:
            flags = [own, -rank if own else -1]
        else:
            world = dist.get_world_size()
            tensor = torch.tensor([own, -rank if own else -world], dtype=torch.int64)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
            flags = tensor.tolist()
        return (signal.Signals(flags[0]).name, -flags[1]) if flags[0] else None

    def rank_record(self) -> dict[str, Any]:
        """This rank's part of the summary: the signal it received and when (epoch seconds), if any."""
        return {"preempt_signal": self.received[0], "preempt_signal_time": self.received[1]} if self.received else {}


def _test_delivery(watch: PreemptionWatch, rank: int, step: int, resumed: bool) -> None:
    """HFDIST_TEST_PREEMPT_AT=RANK:STEP[:SIGNAL[:FLAGS]]: this rank sends the signal, as that step begins, to itself
    or to the hand-over's process (module docstring), and then waits until the launchers have forwarded it back to
    this rank, so that the run stops at this step whatever the launchers' delay."""
    spec = os.environ.get(TEST_PREEMPT_ENV)
    if not spec:
        return
    target_rank, target_step, *rest = spec.split(":")
    flags = rest[1].split(",") if len(rest) > 1 else []
    if int(target_rank) != rank or int(target_step) != step or ("fresh" in flags and resumed):
        return
    sig = signal.Signals[rest[0] if rest else "SIGTERM"]
    if "launcher" not in flags:
        os.kill(os.getpid(), sig)
        return
    os.kill(os.getppid(), sig)
    os.kill(os.getppid(), sig)
    deadline = time.time() + 120
    while watch.received is None and time.time() < deadline:
        time.sleep(0.01)


class PreemptionCallback(TrainerCallback):
    """The Trainer's side of preemption (module docstring): arms the watch, agrees at every step's end and asks the
    Trainer for a checkpoint and a stop, prints the grace."""

    def __init__(self, trainer: PreemptionMixin) -> None:
        self.trainer = trainer
        self._step_started = 0.0
        self._step_seconds: float | None = None
        self._grace_printed = False

    def _print_grace(self, save_seconds: float | None, what: str) -> None:
        watch = self.trainer.preemption
        grace = self.trainer.preempt_grace
        signals = watch.signals if watch.armed else ()
        if signals:
            print("\n".join(grace_lines(save_seconds, self._step_seconds, grace, signals, what)), flush=True)

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.preemption.arm()
        if args.process_index == 0:
            self._print_grace(*self.trainer.resumed_save_seconds())
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_started = time.perf_counter()
        _test_delivery(self.trainer.preemption, args.process_index, state.global_step + 1,
                       self.trainer.resumed_from is not None)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self._step_seconds = time.perf_counter() - self._step_started
        agreed = self.trainer.preemption.agree() if self.trainer.preemption.signals else None
        if agreed is not None:
            self.trainer.preempted = Preempted(step=state.global_step, signal=agreed[0], rank=agreed[1])
            control.should_save = True
            control.should_training_stop = True
        last = self.trainer.last_save
        if last is not None and not self._grace_printed and args.process_index == 0 and agreed is None:
            self._grace_printed = True
            self._print_grace(last[1], f"checkpoint-{last[0]}")
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.preemption.disarm(preempted=self.trainer.preempted is not None)
        return control


class PreemptionMixin:
    """Mixed into hfdist's trainers before CheckpointingMixin (needs its `save_async`, `last_save` and `_save_checkpoint`).

    Args:
        preempt_signals: the signal names that preempt the run (default SIGTERM, SIGUSR1; empty: none).
        preempt_grace: the grace the environment advertises (hfdist.config.preemption.advertised_grace: the job
            reads its launcher's); default: what the environment variables say.
    """

    def __init__(self, *args, preempt_signals: Sequence[str] = DEFAULT_SIGNALS, preempt_grace: Grace | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.preempt_grace = preempt_grace if preempt_grace is not None else advertised_grace()
        self.preemption = PreemptionWatch(preempt_signals)
        self.preempted: Preempted | None = None
        self.resumed_from: str | None = None  # the checkpoint this training resumed from
        self.add_callback(PreemptionCallback(self))

    def resumed_save_seconds(self) -> tuple[float | None, str]:
        """The write time recorded by the checkpoint this run resumed from (None: not resumed, or none recorded: a
        checkpoint of an older hfdist), and the checkpoint's name."""
        if self.resumed_from is None:
            return None, ""
        from hfdist.checkpoint.format import CheckpointError, read_marker

        checkpoint = Path(self.resumed_from)
        try:
            return read_marker(checkpoint).get("save_seconds"), checkpoint.name
        except CheckpointError:
            return None, checkpoint.name

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        self.resumed_from = resume_from_checkpoint
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def _save_checkpoint(self, model, trial) -> None:
        if self.preempted is None:
            return super()._save_checkpoint(model, trial)
        # Nothing trains after this checkpoint: written now, not copied for a thread (a write in flight lands first).
        save_async, self.save_async = self.save_async, False
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.save_async = save_async
        step, seconds = self.last_save if self.last_save is not None else (self.state.global_step, None)
        checkpoint = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
        self.preempted = Preempted(self.preempted.step, self.preempted.signal, self.preempted.rank, str(checkpoint),
                                   seconds if step == self.state.global_step else None)
