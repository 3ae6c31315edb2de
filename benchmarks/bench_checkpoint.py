"""What checkpoints cost training: a 153 M-parameter Llama (llama-medium, seeded init) trained with a checkpoint every
5 and every 2 steps, written in the background (--save-async) or synchronously (--no-save-async: a CPU run's default),
against the same run without checkpoints, on single, fsdp_full_shard and fsdp_tp (2 processes: tp 2).

    python benchmarks/bench_checkpoint.py       # writes results/<hardware>/checkpoint_async.{json,md}

Held equal within a rung: model, data (the embedded conversations), global batch x --seq-len, steps, seed, fp32,
one thread per process (on a machine shared with other work, more threads than free cores make OpenMP's
barriers spin), no W&B. Every run is timed by one clock
(benchmarks/step_clock.py: on rank 0, from the start of training to its end, which waits for the last checkpoint's
write; and the end of every optimizer step). Variants alternate within every repeat (the order rotating); each
ratio is a run's training time over the time of the run without checkpoints in the same repeat, and the figures are
medians over repeats. A run that fails is recorded with its error (the results list it) and the benchmark goes on;
its repeat's ratio for that variant is left out. A checkpoint holds the model and the AdamW state (12 bytes per parameter, 1.8 GB for the
whole model); --save-total-limit 2 deletes older ones as the job does by default.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from step_clock import CLOCK, RunFailed, clocked_run, load_line

from measure import REPO, recorded, results_dir, worker_env

MEASURED_ON = None  # results/<hardware> names the GPUs where there are any: the fine-tuning job's device

FINETUNE = REPO / "scripts" / "finetune.py"
CONFIGS = REPO / "hfdist" / "configs" / "accelerate_configs"
MODEL = "llama-medium"
RUNGS = {"single": 1, "fsdp_full_shard": 2, "fsdp_tp": 2}  # rung -> processes
VARIANTS = {"none": ("--save-steps", "0"), "async/5": ("--save-steps", "5", "--save-async"),
            "sync/5": ("--save-steps", "5", "--no-save-async"), "async/2": ("--save-steps", "2", "--save-async"),
            "sync/2": ("--save-steps", "2", "--no-save-async")}


def _save_steps(variant: str, steps: int) -> list[int]:
    every = int(variant.split("/")[1]) if "/" in variant else 0
    return list(range(every, steps + 1, every)) if every else []


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(rung: str, variant: str, args, out: Path) -> list[str]:
    """The step clock around `hfdist finetune`'s script: one process, or `accelerate launch` of the rung's world."""
    nproc = RUNGS[rung]
    job = [str(FINETUNE), "--model", args.model, "--max-steps", str(args.steps), "--global-batch-size",
           str(args.global_batch), "--seq-len", str(args.seq_len), "--learning-rate", "1e-4", "--warmup-steps", "2",
           "--save-total-limit", "2", "--no-wandb", "--output-dir", str(out), *VARIANTS[variant]]
    if nproc == 1:
        return [sys.executable, str(CLOCK), *job]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / f"{rung}.yaml"),
              "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision", "no",
              "--main_process_port", str(_free_port())]
    return [*launch, str(CLOCK), *job, "--config", rung, "--num-processes", str(nproc)]


def _measure(rung: str, variant: str, args, out: Path) -> dict:
    """One run: its training time (start to end, the last write included), the step loop alone (start to the last
    step's end), and rank 0's peak memory as hfdist's summary reports it."""
    record = clocked_run(_command(rung, variant, args, out / "run"), out, env=worker_env(1))
    summary = json.loads((out / "run" / "hfdist_summary.json").read_text())
    assert summary["loss_steps"] == list(range(1, args.steps + 1)), summary["loss_steps"]
    saved = sorted(p.name for p in (out / "run").iterdir() if p.name.startswith("checkpoint-"))
    begins, ends = record["step_begins"], record["step_ends"]
    return {"seconds": record["train_end"] - record["train_begin"],
            "step_loop_seconds": ends[-1] - record["train_begin"],
            # From each step's end to the next one's start (and to the end of training): where the training thread
            # saves, logs, and waits for a checkpoint's write.
            "between_steps_seconds": sum(b - e for e, b in zip(ends, [*begins[1:], record["train_end"]])),
            "in_steps_seconds": sum(e - b for b, e in zip(begins, ends)),
            "peak_memory_bytes": summary["ranks"][0]["peak_memory_bytes"], "checkpoints_left": saved}


def _ok(runs: list[dict]) -> list[dict]:
    """The runs that finished (a failed one holds only its error)."""
    return [r for r in runs if "failed" not in r]


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in _ok(runs)) if _ok(runs) else float("nan")


def _ratios(runs: dict[str, dict[str, list[dict]]], key: str) -> dict:
    """Per rung and variant: the median over repeats of a run's `key` over the same repeat's run without saves
    (repeats where either failed are left out; NaN when none is left)."""
    out = {}
    for rung, by in runs.items():
        out[rung] = {}
        for variant, got in by.items():
            pairs = [r[key] / b[key] for r, b in zip(got, by["none"]) if "failed" not in r and "failed" not in b]
            out[rung][variant] = statistics.median(pairs) if pairs else float("nan")
    return out


def _table(result: dict) -> str:
    rows = []
    for rung in result["ratios"]:
        runs = result["runs"][rung]
        base_between = _median(runs["none"], "between_steps_seconds")
        for variant in VARIANTS:
            saves = result["saves"][variant]
            held = (_median(runs[variant], "between_steps_seconds") - base_between) / saves if saves else 0.0
            runs_s = ", ".join("failed" if "failed" in r else f"{r['seconds']:.1f}" for r in runs[variant])
            rows.append(f"| {rung} | {variant} | {_median(runs[variant], 'seconds'):.1f} | "
                        f"{result['ratios'][rung][variant]:.3f} | {result['step_loop_ratios'][rung][variant]:.3f} | "
                        f"{result['in_steps_ratios'][rung][variant]:.3f} | {held:.1f} | "
                        f"{_median(runs[variant], 'peak_memory_bytes') / 2**20:,.0f} | {runs_s} |")
        rows.append(f"| | | (no saves: {_median(runs['none'], 'seconds'):.1f} s) | | | | | | |")
    return ("| rung | checkpoints (mode/every) | training s (median) | x no saves | step loop x no saves | in steps x no "
            "saves | s held per save | rank-0 peak MiB | runs (s) |\n|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(rows))


def _failures(result: dict) -> str:
    failed = [(rung, variant, i + 1, r["failed"]) for rung, by in result["runs"].items()
              for variant, got in by.items() for i, r in enumerate(got) if "failed" in r]
    if not failed:
        return ""
    lines = ["", "Runs that failed (left out of the medians and ratios), each with the errors its output raised, in "
             "order (the first one of a chained traceback is the cause; the whole output is in the json):", ""]
    for rung, variant, repeat, error in failed:
        raised = list(dict.fromkeys(re.findall(r"^\S*(?:Error|Exception)\b.*$", error, flags=re.MULTILINE)))
        lines.append(f"- {rung} {variant}, repeat {repeat}: " + ("; ".join(f"`{e[:300]}`" for e in raised[:6])
                                                                  or error.strip().splitlines()[-1]))
    return "\n".join(lines) + "\n"


def _write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint_async.json").write_text(json.dumps(result, indent=2))
    (out / "checkpoint_async.md").write_text(
        f"# Checkpoints written in the background vs synchronously ({out.name})\n\n`{result['command']}` "
        f"({result['wall_seconds'] / 60:.0f} min)\n\n"
        f"{result['model']} ({result['parameters'] / 1e6:.0f} M parameters; a checkpoint holds "
        f"{result['checkpoint_bytes'] / 2**30:.2f} GiB of model + AdamW state), seq {result['seq_len']} x global "
        f"batch {result['global_batch']}, fp32, {result['steps']} steps, {result['repeats']} alternating repeats; "
        f"training time = rank 0's clock from the start of training to its end, which waits for the last "
        f"checkpoint's write; \"step loop\": to the last step's end; \"in steps\": the steps alone (a background "
        f"write slowing them shows here); \"held per save\": the time from a step's end to the next one's start "
        f"(where the Trainer saves) beyond the run without checkpoints', per checkpoint (for async: the staging "
        f"copy, and any wait for the previous write or, at the end, for the last one). Ratios are each run over "
        f"the run without checkpoints of the same repeat, medians over repeats. async/N: --save-steps N "
        f"--save-async (written in the background); sync/N: --save-steps N --no-save-async. Checkpoints at steps "
        f"{'; '.join(f'{v}: {_steps(steps)}' for v, steps in result['save_steps'].items())}.\n\n"
        f"{_table(result)}\n\n"
        f"Peak memory: hfdist's per-rank peak (resident memory on CPU); the background writer's staged copy of "
        f"the rank's model + optimizer state is part of it.\n\n"
        f"{load_line(result['load_average'], result['cpu_count'])} {result['load_note']}\n{_failures(result)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=11, help="optimizer steps per run")
    p.add_argument("--repeats", type=int, default=2, help="alternating repeats (figures are medians)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument("--rungs", nargs="+", default=list(RUNGS), choices=list(RUNGS))
    p.add_argument("--model", default=MODEL, help=f"preset to train (default {MODEL}; llama-tiny: a quick check)")
    p.add_argument("--load-note", default="", help="what else ran on the machine, as the results file says it")
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/<hardware>)")
    args = p.parse_args()
    from hfdist.models.build import meta_model

    parameters = sum(t.numel() for t in meta_model(args.model).parameters())
    start, load_before = time.perf_counter(), os.getloadavg()
    runs: dict[str, dict[str, list[dict]]] = {r: {v: [] for v in VARIANTS} for r in args.rungs}
    command = [sys.executable, str(Path(__file__).resolve()), "--steps", str(args.steps), "--repeats",
               str(args.repeats), "--seq-len", str(args.seq_len), "--global-batch", str(args.global_batch),
               "--rungs", *args.rungs, "--model", args.model]

    def result() -> dict:
        return {"command": recorded(command), "model": args.model, "parameters": parameters,
                "checkpoint_bytes": 12 * parameters, "seq_len": args.seq_len, "global_batch": args.global_batch,
                "steps": args.steps, "repeats": args.repeats, "cpu_count": os.cpu_count(),
                "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
                "load_note": args.load_note, "wall_seconds": time.perf_counter() - start, "runs": runs,
                "ratios": _ratios(runs, "seconds"), "step_loop_ratios": _ratios(runs, "step_loop_seconds"),
                "in_steps_ratios": _ratios(runs, "in_steps_seconds"),
                "saves": {v: len(_save_steps(v, args.steps)) for v in VARIANTS},
                "save_steps": {v: _save_steps(v, args.steps) for v in VARIANTS if v != "none"}}

    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for rung in args.rungs:
                order = list(VARIANTS)[i % len(VARIANTS):] + list(VARIANTS)[:i % len(VARIANTS)]
                for variant in order:
                    out = Path(tmp) / f"{i}-{rung}-{variant[:1]}{variant[-1]}"
                    try:
                        got = _measure(rung, variant, args, out)
                    except RunFailed as exc:  # recorded, and the other runs go on
                        got = {"failed": str(exc)}
                        print(f"{rung} {variant} failed (recorded):\n{str(exc)[-2000:]}", flush=True)
                    # A run leaves ~2 checkpoints and the model (4+ GB for llama-medium): kept, 30 runs filled a
                    # 67 GB disk, and the next run's writes failed.
                    shutil.rmtree(out, ignore_errors=True)
                    runs[rung][variant].append(got)
                print(f"repeat {i + 1}/{args.repeats} {rung}: " + ", ".join(
                    f"{v} " + ("failed" if "failed" in runs[rung][v][-1] else f"{runs[rung][v][-1]['seconds']:.1f} s")
                    for v in VARIANTS) + f" (load {os.getloadavg()[0]:.1f})", flush=True)
                # After every rung of every repeat, so a benchmark stopped part-way keeps what it measured.
                _write(results_dir(args.out, MEASURED_ON), result())

    final = result()
    _write(results_dir(args.out, MEASURED_ON), final)
    for rung, by in final["ratios"].items():
        print(f"{rung}: " + ", ".join(f"{v} {x:.3f}" for v, x in by.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
