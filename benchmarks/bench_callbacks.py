"""What hfdist's callbacks cost a training step, measured two ways.

    python benchmarks/bench_callbacks.py            # writes results/<hardware>/callback_overhead.{json,md}

1. A/B: single-process fine-tunes of the embedded default with DistributedMetricsCallback and the W&B sink (offline)
   fed by the Trainer's logs, and with `--no-metrics` (the loss record and the same progress bar only), alternated
   so drift in machine load hits both alike; the Trainer's own train_runtime (the training loop only) per step.
   On a shared machine the spread between repeats is larger than the cost.
2. Inside: the runs with callbacks time everything that runs on the callbacks' behalf inside the training loop (their
   events and the hooks they put on the model and optimizer) and divide by train_runtime. Both clocks slow down
   together under load, so this fraction holds on a busy machine too.
The load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from measure import REPO, recorded, results_dir

MEASURED_ON = None  # results/<hardware> names the GPUs where there are any: the fine-tuning job's device

FINETUNE = REPO / "scripts" / "finetune.py"
# What runs in the training loop on the callbacks' behalf: their events and the hooks they register.
TIMED = {
    "hfdist.callbacks.distributed_metrics.DistributedMetricsCallback":
        ("on_train_begin", "on_step_begin", "on_step_end", "on_log", "on_train_end"),
    "hfdist.callbacks.throughput.ThroughputMeter": ("_count",),
    "hfdist.callbacks.memory.MemoryMeter": ("_end_of_backward", "_before_step", "_after_step"),
    "hfdist.callbacks.tracker_logs.TrackerLogsCallback": ("on_log",),
    "hfdist.callbacks.progress.MetricsProgressCallback": ("on_log",),
}
CALLBACK_TIME_FILE = "callback_seconds.json"


def _train_timed(finetune_args: list[str], out: Path) -> None:
    """Run the fine-tune in this process with every TIMED method adding its wall time to one clock."""
    from hfdist.config.finetune import parse_args
    from hfdist.job.run import finetune
    from hfdist.metrics.bubble import timed

    clock = [0.0]
    patched = []
    for target, names in TIMED.items():
        module, name = target.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        for method in names:
            patched.append((cls, method, getattr(cls, method)))
            setattr(cls, method, timed(getattr(cls, method), clock))
    try:
        finetune(parse_args(finetune_args), [str(FINETUNE)], finetune_args)
    finally:
        for cls, method, original in patched:
            setattr(cls, method, original)
    (out / CALLBACK_TIME_FILE).write_text(json.dumps({"callback_seconds": clock[0]}))


def command(with_callbacks: bool, steps: int, out: Path) -> tuple[list[str], dict[str, str]]:
    """The command and environment of one run. Both see one GPU from the start: on a multi-GPU host the single
    rung would otherwise restart itself with one visible (hfdist.job.launch), and the timed run's clock, patched into
    this process's classes, would not be in the restarted one."""
    import torch

    from hfdist.job.launch import single_gpu_env

    finetune_args = ["--max-steps", str(steps), "--output-dir", str(out)]
    if with_callbacks:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--inside", *finetune_args]
    else:
        cmd = [sys.executable, str(FINETUNE), *finetune_args, "--no-metrics"]
    env = dict(os.environ)
    return cmd, single_gpu_env(env) if torch.cuda.is_available() else env


def _run(with_callbacks: bool, steps: int, workdir: Path, i: int) -> dict[str, float]:
    out = workdir / f"{'with' if with_callbacks else 'without'}-{i}"
    cmd, env = command(with_callbacks, steps, out)
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    summary = json.loads((out / "hfdist_summary.json").read_text())
    result = {"seconds_per_step": summary["train_runtime"] / len(summary["losses"])}
    if with_callbacks:
        callback = json.loads((out / CALLBACK_TIME_FILE).read_text())["callback_seconds"]
        result["callback_fraction"] = callback / summary["train_runtime"]
    return result


def _loads(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def _write(out: Path, result: dict, steps: int, repeats: int) -> None:
    base, cost = result["median_without"], result["median_with"]
    without, with_cb, inside = (result[k] for k in ("seconds_per_step_without", "seconds_per_step_with",
                                                    "callback_fraction"))
    load = result["load_average"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "callback_overhead.json").write_text(json.dumps(result, indent=2))
    (out / "callback_overhead.md").write_text(
        f"# Cost of hfdist's callbacks ({out.name})\n\n`{result['command']}`: single-process fine-tune of the "
        f"embedded default, {steps} steps, {repeats} alternating repeats, Trainer train_runtime / steps.\n\n"
        f"| | median s/step | runs |\n|---|---|---|\n"
        f"| without callbacks (`--no-metrics`) | {base:.4f} | {', '.join(f'{x:.4f}' for x in without)} |\n"
        f"| with DistributedMetricsCallback + W&B sink (offline) | {cost:.4f} | "
        f"{', '.join(f'{x:.4f}' for x in with_cb)} |\n\n"
        f"A/B overhead: {100 * result['overhead_fraction']:+.2f}% of step time (spread between repeats of one "
        f"setting: {100 * (max(without) - min(without)) / base:.1f}%).\n\n"
        f"Time inside the callbacks and their hooks, measured in the runs with them: "
        f"**{100 * result['median_callback_fraction']:.2f}%** of train_runtime (median; runs: "
        f"{', '.join(f'{100 * x:.2f}%' for x in inside)}).\n\n"
        f"Load average (1/5/15 min) on {result['cpu_count']} cores: {_loads(load['before'])} before, "
        f"{_loads(load['after'])} after.\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--inside", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # one timed run (internal)
    args = p.parse_args()
    if args.inside is not None:
        _train_timed(args.inside, Path(args.inside[args.inside.index("--output-dir") + 1]))
        return 0
    out = results_dir(args.out, MEASURED_ON)
    load_before = os.getloadavg()
    runs: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for with_callbacks in (False, True):
                runs[with_callbacks].append(_run(with_callbacks, args.steps, Path(tmp), i))
            print(f"repeat {i + 1}/{args.repeats}: without {runs[False][-1]['seconds_per_step']:.4f} s/step, "
                  f"with {runs[True][-1]['seconds_per_step']:.4f}, inside the callbacks "
                  f"{100 * runs[True][-1]['callback_fraction']:.2f}%")
    without = [r["seconds_per_step"] for r in runs[False]]
    with_cb = [r["seconds_per_step"] for r in runs[True]]
    inside = [r["callback_fraction"] for r in runs[True]]
    command = [sys.executable, str(Path(__file__).resolve()), "--steps", str(args.steps), "--repeats",
               str(args.repeats)]
    result = {"command": recorded(command), "model": "llama-small (embedded default)", "steps": args.steps,
              "cpu_count": os.cpu_count(), "load_average": {"before": list(load_before),
                                                             "after": list(os.getloadavg())},
              "seconds_per_step_without": without, "seconds_per_step_with": with_cb, "callback_fraction": inside,
              "median_without": statistics.median(without), "median_with": statistics.median(with_cb),
              "median_callback_fraction": statistics.median(inside)}
    result["overhead_fraction"] = result["median_with"] / result["median_without"] - 1
    _write(out, result, args.steps, args.repeats)
    print(f"A/B {100 * result['overhead_fraction']:+.2f}%, inside the callbacks "
          f"{100 * result['median_callback_fraction']:.2f}% -> {out / 'callback_overhead.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
