"""One clock for timing any Trainer-based training script, and what the benchmarks that use it share.

`python step_clock.py SCRIPT ARGS...` runs SCRIPT as __main__ with ARGS, every transformers.Trainer it creates
carrying one more callback that notes the time at the start of training, at the start and the end of each optimizer
step (from one step's end to the next one's start the Trainer logs and saves its checkpoints) and at the end of
training (after the Trainer's last checkpoint has been written); it also counts the non-padding input tokens of every
step (where the Trainer's training step receives its batch; padding is the tokenizer's pad id, none without a
tokenizer) and keeps the logged losses and the process's peak resident memory. Each rank writes them to
$STEP_CLOCK_DIR/rank-<RANK>.json when training ends.

The same clock, on the same callback events, times hfdist's job and the plain Trainer script
(benchmarks/bench_overhead.py) and eager and compiled runs (benchmarks/bench_compile.py), so nothing is measured by
its own instruments.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

from measure import REPO, recorded, worker_env

__all__ = ["CLOCK", "RunFailed", "add_run_arguments", "clocked_run", "tokens_per_s", "load_line"]

CLOCK = Path(__file__).resolve()
CLOCK_DIR_ENV = "STEP_CLOCK_DIR"


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The options every clocked benchmark takes: run length, warm-up, repeats, tokens per step, output folder."""
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of tokens/s")
    p.add_argument("--repeats", type=int, default=3, help="alternating repeats (figures are medians)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/<hardware>)")


class RunFailed(RuntimeError):
    """A timed run exited non-zero; the message holds the command and the tails of its output. A benchmark either
    stops on it (uncaught) or records it and goes on."""


def clocked_run(cmd: list[str], out: Path, env: dict[str, str] | None = None) -> dict:
    """Run `cmd` (which starts step_clock.py around a script) from the repository root with the clock writing into
    `out`/clock, one thread per process, in `env` (default: the benchmark worker's); returns rank 0's record.

    Raises:
        RunFailed: the run exited non-zero."""
    clock = out / "clock"
    clock.mkdir(parents=True)
    env = {**(env or worker_env(1)), CLOCK_DIR_ENV: str(clock), "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        # A long tail: the first error of a chained traceback (the one that explains the rest) comes early.
        raise RunFailed(f"{recorded(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-20000:]}")
    return json.loads((clock / "rank-0.json").read_text())


def tokens_per_s(record: dict, args: argparse.Namespace) -> float:
    """Tokens per second over the steps after the warm-up (global batch x seq-len tokens per step)."""
    ends = record["step_ends"]
    assert len(ends) == args.steps, (len(ends), args.steps)
    tokens = (args.steps - args.warmup) * args.global_batch * args.seq_len
    return tokens / (ends[-1] - ends[args.warmup - 1])


def load_line(load: dict, cpu_count: int | None) -> str:
    """The load average before and after a benchmark, as its results file states it."""
    return (f"Load average (1/5/15 min) on {cpu_count} cores: {' / '.join(f'{v:.2f}' for v in load['before'])} "
            f"before, {' / '.join(f'{v:.2f}' for v in load['after'])} after.")


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM): one reader for every script the clock times."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _install_clock() -> None:
    """Give every Trainer created from now on the step clock, and count the tokens of every batch it trains on."""
    from transformers import Trainer, TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.train_begin = 0.0
            self.step_begins: list[float] = []
            self.step_ends: list[float] = []
            self.step_tokens: list[int] = []  # this rank's non-padding input tokens per optimizer step
            self.tokens = 0
            self.losses: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.train_begin = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            self.step_begins.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.step_ends.append(time.perf_counter())
            self.step_tokens.append(self.tokens)
            self.tokens = 0

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

        def on_train_end(self, args, state, control, **kwargs):
            out = Path(os.environ[CLOCK_DIR_ENV]) / f"rank-{os.environ.get('RANK', '0')}.json"
            out.write_text(json.dumps({"train_begin": self.train_begin, "step_begins": self.step_begins,
                                       "step_ends": self.step_ends,
                                       "train_end": time.perf_counter(), "step_tokens": self.step_tokens,
                                       "losses": self.losses, "peak_rss_bytes": _peak_rss_bytes()}))

    init, training_step = Trainer.__init__, Trainer.training_step

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._step_clock = StepClock()
        self.add_callback(self._step_clock)

    def counted_training_step(self, model, inputs, *args, **kwargs):
        ids = inputs["input_ids"]
        pad = getattr(self.processing_class, "pad_token_id", None)
        self._step_clock.tokens += int(ids.numel() if pad is None else (ids != pad).sum())
        return training_step(self, model, inputs, *args, **kwargs)

    Trainer.__init__, Trainer.training_step = __init__, counted_training_step


if __name__ == "__main__":
    _install_clock()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
