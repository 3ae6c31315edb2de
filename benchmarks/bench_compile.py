"""Eager against `--compile` (torch.compile per decoder layer; inductor on CPU): tokens/s of hfdist's job.

    python benchmarks/bench_compile.py       # writes results/<hardware>/compile.{json,md}

The embedded default (llama-small, seq --seq-len x global batch --global-batch tokens per step, fp32) on one rung
(--config, default single: one process, one thread), eager and compiled runs alternating within every repeat, each
figure the median over repeats. Both are timed by one clock (benchmarks/step_clock.py: the end of every optimizer
step); the first --warmup steps, where compilation happens, are left out of tokens/s and reported apart as the
time to the end of the first step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import REPO, recorded, results_dir, worker_env

FINETUNE = REPO / "scripts" / "finetune.py"
CLOCK = REPO / "benchmarks" / "step_clock.py"
VARIANTS = ("eager", "compile")


def _run(variant: str, args, work: Path) -> dict[str, float]:
    """One run: tokens/s after the warm-up and the seconds from the start of training to the first step's end."""
    out = work / variant
    clock = out / "clock"
    clock.mkdir(parents=True)
    cmd = [sys.executable, str(CLOCK), str(FINETUNE), "--config", args.config, "--seq-len", str(args.seq_len),
           "--global-batch-size", str(args.global_batch), "--max-steps", str(args.steps), "--save-steps", "0",
           "--no-wandb", "--output-dir", str(out / "run"), *(["--compile"] if variant == "compile" else [])]
    env = {**worker_env(1), "STEP_CLOCK_DIR": str(clock), "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{variant} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    record = json.loads((clock / "rank-0.json").read_text())
    ends = record["step_ends"]
    assert len(ends) == args.steps, (variant, len(ends))
    tokens = (args.steps - args.warmup) * args.global_batch * args.seq_len
    return {"tokens_per_s": tokens / (ends[-1] - ends[args.warmup - 1]),
            "first_step_seconds": ends[0] - record["train_begin"]}


def _write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile.json").write_text(json.dumps(result, indent=2))
    med, load = result["median"], result["load_average"]
    rows = "".join(f"| {v} | {med[v]['tokens_per_s']:,.0f} | {med[v]['first_step_seconds']:.1f} | "
                   f"{', '.join(format(r['tokens_per_s'], ',.0f') for r in result['runs'][v])} |\n"
                   for v in VARIANTS)
    (out / "compile.md").write_text(
        f"# Eager against --compile ({out.name})\n\n`{result['command']}` ({result['wall_seconds'] / 60:.0f} min)\n\n"
        f"{result['model']} on `{result['config']}`, seq {result['seq_len']} x global batch "
        f"{result['global_batch']} tokens per step, fp32, one thread per process, {result['steps']} steps of which "
        f"the first {result['warmup']} are left out of tokens/s, {result['repeats']} alternating repeats "
        f"(medians).\n\n| | tokens/s (median) | start of training to first step end, s (median) | runs, tokens/s |\n"
        f"|---|---|---|---|\n{rows}\n"
        f"compile / eager: **{result['compile_vs_eager']:.3f}** in tokens/s.\n\n"
        f"Load average (1/5/15 min) on {result['cpu_count']} cores: "
        f"{' / '.join(f'{v:.2f}' for v in load['before'])} before, "
        f"{' / '.join(f'{v:.2f}' for v in load['after'])} after.\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="single")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    start, load_before = time.perf_counter(), os.getloadavg()
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for variant in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
                runs[variant].append(_run(variant, args, Path(tmp) / f"repeat-{i}"))
            print(f"repeat {i + 1}/{args.repeats}: " +
                  ", ".join(f"{v} {runs[v][-1]['tokens_per_s']:,.0f} tokens/s" for v in VARIANTS), flush=True)
    median = {v: {k: statistics.median(r[k] for r in runs[v]) for k in ("tokens_per_s", "first_step_seconds")}
              for v in VARIANTS}
    command = [sys.executable, str(Path(__file__).resolve()), "--config", args.config, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--seq-len", str(args.seq_len),
               "--global-batch", str(args.global_batch)]
    result = {"command": recorded(command), "model": "llama-small (embedded default)", "config": args.config,
              "seq_len": args.seq_len, "global_batch": args.global_batch, "steps": args.steps,
              "warmup": args.warmup, "repeats": args.repeats, "cpu_count": os.cpu_count(),
              "torch": __import__("torch").__version__,
              "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
              "wall_seconds": time.perf_counter() - start, "runs": runs, "median": median,
              "compile_vs_eager": median["compile"]["tokens_per_s"] / median["eager"]["tokens_per_s"]}
    _write(results_dir(args.out), result)
    print(f"compile / eager: {result['compile_vs_eager']:.3f} -> {results_dir(args.out) / 'compile.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
