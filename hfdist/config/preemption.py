"""Preemption without torch: the exit code a preempted run leaves with, the signals that preempt it, and the grace its
environment gives between the signal and the kill (hfdist.train.preemption does the checkpoint; the launchers, the
planner-free preflight and the benchmarks read these).

The exit code is 75, sysexits.h's EX_TEMPFAIL ("a temporary failure; the user is invited to retry"): what a preempted
run is, once its checkpoint is written. It differs from success (0), a crash (1, or a rank's own code), bad input (2),
a hang (3, hfdist.train.watchdog) and from a process killed by the signal before it could save (128 + the signal's
number: 143 for SIGTERM, 138 for SIGUSR1), so a scheduler or a script can requeue on 75 alone (a Kubernetes Job's
podFailurePolicy `onExitCodes`, docs/clusters.md).

The grace a run needs is its last checkpoint's measured write time plus the step in progress when the signal comes.
What the environment advertises, where it says (the smallest applies):
- HFDIST_PREEMPT_GRACE (seconds): set by you, the Slurm template (its `--signal` lead) or a manifest (a pod's
  terminationGracePeriodSeconds, which Kubernetes does not show inside the pod);
- torchrun's shutdown timeout: how long it waits after forwarding a signal before it kills its workers
  (`--shutdown-timeout`, read from the launcher's command line, or TORCH_ELASTIC_SHUTDOWN_TIMEOUT; torch's default 30 s).
  hfdist's own hand-over sets it high, so the environment's grace is the one that counts;
- Kubernetes (KUBERNETES_SERVICE_HOST set) without HFDIST_PREEMPT_GRACE: its default terminationGracePeriodSeconds,
  30 s.
Slurm does not export its grace (KillWait, a partition's GraceTime: `scontrol show config`), nor Ray its node drain
deadline to a process; no figure is assumed there.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["PREEMPTED_EXIT_CODE", "DEFAULT_SIGNALS", "GRACE_ENV", "Grace", "signal_name", "preempt_signals",
           "advertised_grace", "grace_lines", "preempted_line", "elastic_env", "PREEMPTED_NOTE",
           "leave_preempted_note", "preempted_note"]

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (module docstring)
# Rank 0's closing line, left in the hand-over's folder (hfdist.errors.ERROR_DIR_ENV): the launcher, which may have got
# the signal itself and stopped the ranks, then exits PREEMPTED_EXIT_CODE too (hfdist.job.launch).
PREEMPTED_NOTE = "preempted.txt"
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")  # Kubernetes, torchrun and Slurm's end of job; Slurm's `--signal` notice
GRACE_ENV = "HFDIST_PREEMPT_GRACE"
TORCHRUN_SHUTDOWN_DEFAULT = 30.0  # torch.distributed.launcher.api.LaunchConfig's default shutdown_timeout
KUBERNETES_GRACE_DEFAULT = 30.0  # a pod's default terminationGracePeriodSeconds
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")
# The signals torch elastic handles by default (torch.distributed.run --signals-to-handle).
_ELASTIC_DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def signal_name(text: str) -> str:
    """argparse type of --preempt-signal: a signal by name (SIGUSR2, USR2) or number, as its canonical name.

    Raises:
        argparse.ArgumentTypeError: no such signal on this system, or one a process cannot catch (SIGKILL, SIGSTOP).
    """
    raw = text.strip().upper()
    try:
        sig = signal.Signals(int(raw)) if raw.isdigit() else signal.Signals[raw if raw.startswith("SIG") else f"SIG{raw}"]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a signal on this system: {text!r} (a name such as SIGUSR2 or USR2, or a number)") \
            from None
    if sig.name in _UNCATCHABLE:
        raise argparse.ArgumentTypeError(f"{sig.name} cannot be caught, so it cannot ask for a checkpoint; pick another "
                         "(SIGUSR2, SIGINT, ...)")
    return sig.name


def preempt_signals(extra: str | None = None) -> tuple[str, ...]:
    """The signals that preempt a run: SIGTERM and SIGUSR1, and `extra` (--preempt-signal) when given."""
    return tuple(dict.fromkeys((*DEFAULT_SIGNALS, *((signal_name(extra),) if extra else ()))))


def elastic_env(relayed: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """The environment of the torch elastic agent hfdist's hand-over runs: it handles its default signals (Ctrl-C's
    SIGINT, ...) but not the preemption signals, which the hand-over relays to the ranks itself
    (hfdist.job.signal_relay), and it waits for the ranks as long as they checkpoint when it stops them: the
    environment's own grace (Kubernetes', Slurm's) is the deadline that counts. A user's own values win."""
    handled = ",".join(s for s in _ELASTIC_DEFAULT_SIGNALS if s not in relayed)
    out = {"PET_SIGNALS_TO_HANDLE": handled, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(24 * 3600)}
    return {k: v for k, v in out.items() if k not in env}


@dataclass(frozen=True)
class Grace:
    """Seconds between a preemption signal and the kill, and who says so."""

    seconds: float
    source: str


def _launcher_shutdown_timeout(env: Mapping[str, str], launcher_argv: Sequence[str]) -> float:
    """torchrun's shutdown timeout: its --shutdown-timeout flag, else its environment variables, else torch's 30 s."""
    for i, arg in enumerate(launcher_argv):
        for flag in ("--shutdown-timeout", "--shutdown_timeout"):
            if arg == flag and i + 1 < len(launcher_argv):
                return float(launcher_argv[i + 1])
            if arg.startswith(flag + "="):
                return float(arg.split("=", 1)[1])
    for key in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        if env.get(key):
            return float(env[key])
    return TORCHRUN_SHUTDOWN_DEFAULT


def advertised_grace(env: Mapping[str, str] | None = None, launcher_argv: Sequence[str] = (),
                     handed_over: bool = False) -> Grace | None:
    """The grace this process's environment advertises (module docstring), the smallest of those it states; None
    when none states one.

    Args:
        launcher_argv: the command line of the process that started this one (torchrun's flags).
        handed_over: started by hfdist's own hand-over, whose torch elastic agent waits as long as the ranks need.
    """
    env = os.environ if env is None else env
    found = []
    if env.get(GRACE_ENV):
        found.append(Grace(float(env[GRACE_ENV]), GRACE_ENV))
    elif env.get("KUBERNETES_SERVICE_HOST"):
        found.append(Grace(KUBERNETES_GRACE_DEFAULT, f"Kubernetes' default terminationGracePeriodSeconds; set "
                                                     f"{GRACE_ENV} to your pod's"))
    if env.get("TORCHELASTIC_RUN_ID") and not handed_over:
        found.append(Grace(_launcher_shutdown_timeout(env, launcher_argv), "torchrun's --shutdown-timeout"))
    return min(found, key=lambda g: g.seconds, default=None)


def grace_lines(save_seconds: float | None, step_seconds: float | None, grace: Grace | None, signals: Sequence[str],
                what: str) -> list[str]:
    """What rank 0 prints of the grace a preemption needs: `save_seconds` (the last checkpoint's write, `what` says
    which) plus a step (`step_seconds`, the last step's time), against `grace`; a warning line when it does not fit.
    Before any checkpoint was measured (save_seconds None) only what the environment gives."""
    sent = "/".join(signals)
    gives = f"the environment gives {grace.seconds:g} s ({grace.source})" if grace else \
        f"no grace advertised ({GRACE_ENV} sets it)"
    if save_seconds is None:
        return [f"hfdist: preemption: {sent} checkpoints at the next step and exits {PREEMPTED_EXIT_CODE}; {gives}; "
                "the time a checkpoint takes is printed after the first one."]
    needed = save_seconds + (step_seconds or 0.0)
    step = f"up to {step_seconds:.1f} s" if step_seconds is not None else "the time of a step"
    lines = [f"hfdist: preemption needs {'' if step_seconds is not None else 'at least '}{needed:.1f} s after {sent}: "
             f"{what} took {save_seconds:.1f} s to write, plus {step} to end the step in progress; {gives}."]
    if grace is not None and needed > grace.seconds:
        lines.append(f"hfdist: warning: a preempted run would be killed {needed - grace.seconds:.1f} s before its "
                     f"checkpoint lands, losing the steps since the previous one: raise the grace "
                     f"({grace.source}) above {needed:.0f} s, or make checkpoints smaller (--lora).")
    return lines


def preempted_line(rung: str, step: int, signal: str, ranks: Sequence[int], save_seconds: float | None,
                   checkpoint: str) -> str:
    """The line a preempted run ends with."""
    who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks)) if ranks else "a rank"
    took = f" in {save_seconds:.1f} s" if save_seconds is not None else ""
    return (f"hfdist: {rung} preempted at step {step} ({signal} on {who}): {checkpoint} written{took}; exit code "
            f"{PREEMPTED_EXIT_CODE}. Run the same command with --resume to continue from it.")


def leave_preempted_note(line: str) -> None:
    """Rank 0 of a preempted run under hfdist's hand-over: leave its closing line for the launcher."""
    from hfdist.errors import ERROR_DIR_ENV

    folder = os.environ.get(ERROR_DIR_ENV)
    if folder and os.path.isdir(folder):
        with open(os.path.join(folder, PREEMPTED_NOTE), "w", encoding="utf-8") as note:
            note.write(line)


def preempted_note(folder: str | os.PathLike) -> str | None:
    """The closing line a preempted run's rank 0 left in the hand-over's `folder`, or None."""
    path = os.path.join(folder, PREEMPTED_NOTE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as note:
        return note.read()
