"""One clock for timing any Trainer-based training script, and what the benchmarks that use it share.

`python step_clock.py SCRIPT ARGS...` runs SCRIPT as __main__ with ARGS, every transformers.Trainer it creates
carrying one more callback that notes the time at the start of training and at the end of each optimizer step. Each
rank writes them to $STEP_CLOCK_DIR/rank-<RANK>.json when training ends.

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

from measure import REPO, worker_env

__all__ = ["CLOCK", "add_run_arguments", "clocked_run", "tokens_per_s", "load_line"]

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


def clocked_run(cmd: list[str], out: Path, env: dict[str, str] | None = None) -> dict:
    """Run `cmd` (which starts step_clock.py around a script) from the repository root with the clock writing into
    `out`/clock, one thread per process, in `env` (default: the benchmark worker's); returns rank 0's record (exits
    with the run's output when it fails)."""
    clock = out / "clock"
    clock.mkdir(parents=True)
    env = {**(env or worker_env(1)), CLOCK_DIR_ENV: str(clock), "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
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


def _install_clock() -> None:
    """Give every Trainer created from now on the step clock."""
    from transformers import Trainer, TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.train_begin = 0.0
            self.step_ends: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.train_begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_ends.append(time.perf_counter())

        def on_train_end(self, args, state, control, **kwargs):
            out = Path(os.environ[CLOCK_DIR_ENV]) / f"rank-{os.environ.get('RANK', '0')}.json"
            out.write_text(json.dumps({"train_begin": self.train_begin, "step_ends": self.step_ends}))

    init = Trainer.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.add_callback(StepClock())

    Trainer.__init__ = __init__


if __name__ == "__main__":
    _install_clock()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
