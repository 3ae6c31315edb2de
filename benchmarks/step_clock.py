"""Run a training script with a clock on its Trainer: `python step_clock.py SCRIPT ARGS...` runs SCRIPT as
__main__ with ARGS, every transformers.Trainer it creates carrying one more callback that notes the time at the end
of each optimizer step (and the start of training). Each rank writes them to $STEP_CLOCK_DIR/rank-<RANK>.json when training ends.

The same clock, on the same callback event, times hfdist's job and the plain Trainer script in
benchmarks/bench_overhead.py, so neither is measured by its own instruments.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

from transformers import Trainer, TrainerCallback

CLOCK_DIR_ENV = "STEP_CLOCK_DIR"


class StepClock(TrainerCallback):
    """perf_counter() at the start of training and at every optimizer step's end, written by each rank at the end
    of training."""

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


def _with_clock(init):
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.add_callback(StepClock())
    return __init__


if __name__ == "__main__":
    Trainer.__init__ = _with_clock(Trainer.__init__)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
