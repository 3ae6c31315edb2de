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
import sys
import tempfile
import time
from pathlib import Path

from step_clock import CLOCK, add_run_arguments, clocked_run, load_line, tokens_per_s

from measure import REPO, recorded, results_dir, worker_env

MEASURED_ON = None  # results/<hardware> names the GPUs where there are any: the fine-tuning job's device

FINETUNE = REPO / "scripts" / "finetune.py"
VARIANTS = ("eager", "compile")


def command(variant: str, args, out: Path) -> tuple[list[str], dict[str, str]]:
    """The command and environment of one run, with the step clock in every rank.

    hfdist's job would start a new process tree wherever it hands over (the rung's `accelerate launch`, or the
    single rung's restart with one GPU visible on a multi-GPU host), and the clock would not be in it. So the
    benchmark starts the rung's world itself, as hfdist would (`accelerate launch` with
    hfdist.job.launch.accelerate_arguments, the clock around scripts/finetune.py), and a single run sees one GPU from
    the start."""
    from hfdist.config.finetune import FinetuneConfig
    from hfdist.config.ladder import StrategyKind
    from hfdist.job.launch import accelerate_arguments, single_gpu_env
    from hfdist.job.world import Node, resolve_rung

    script_args = ["--config", args.config, "--seq-len", str(args.seq_len), "--global-batch-size",
                   str(args.global_batch), "--max-steps", str(args.steps), "--save-steps", "0", "--no-wandb",
                   "--output-dir", str(out / "run"), *(["--compile"] if variant == "compile" else [])]
    env = worker_env(1)
    node = Node.detect({})
    rung = resolve_rung(FinetuneConfig(config=args.config), node)
    if rung.kind is StrategyKind.SINGLE:
        return [sys.executable, str(CLOCK), str(FINETUNE), *script_args], single_gpu_env(env) if node.gpus else env
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    return [*launch, *accelerate_arguments(rung, [str(CLOCK), str(FINETUNE)], script_args, on_gpu=node.gpus > 0)], env


def _run(variant: str, args, work: Path) -> dict[str, float]:
    """One run: tokens/s after the warm-up and the seconds from the start of training to the first step's end."""
    out = work / variant
    cmd, env = command(variant, args, out)
    record = clocked_run(cmd, out, env)
    return {"tokens_per_s": tokens_per_s(record, args),
            "first_step_seconds": record["step_ends"][0] - record["train_begin"]}


def _write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile.json").write_text(json.dumps(result, indent=2))
    med = result["median"]
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
        f"{load_line(result['load_average'], result['cpu_count'])}\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="single")
    add_run_arguments(p)
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
    _write(results_dir(args.out, MEASURED_ON), result)
    print(f"compile / eager: {result['compile_vs_eager']:.3f} -> {results_dir(args.out, MEASURED_ON) / 'compile.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
