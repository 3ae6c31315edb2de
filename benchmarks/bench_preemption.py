"""How long a preempted run takes to leave: from the SIGTERM one rank receives to the exit (code 75) of the process that
launched the job, per rung, with the checkpoint written on the way (its write time and size).

    python benchmarks/bench_preemption.py       # writes results/<hardware>/preemption.{json,md}

Each run is `python scripts/finetune.py --config RUNG` (hfdist hands over to accelerate) on a seeded preset with no
periodic checkpoints (--save-steps 0: the time is the preemption's own, no earlier write in flight); rank 1 (rank 0 of
`single`) sends itself SIGTERM as step --signal-at begins (HFDIST_TEST_PREEMPT_AT, hfdist.train.preemption) and
records when it received it (its summary's rank record). The time to exit = the launcher's exit as this benchmark sees
it - that receipt (one clock: the same machine); it holds the rest of the step in progress, the agreement, the
checkpoint's write (reported apart: rank 0's `save_seconds`), the summary and every process's exit. Figures are
medians over --repeats; a run that fails is recorded with its error and the others go on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from step_clock import load_line

from measure import REPO, recorded, results_dir, worker_env

MEASURED_ON = None  # results/<hardware> names the GPUs where there are any: the fine-tuning job's device

FINETUNE = REPO / "scripts" / "finetune.py"
RUNGS = ("single", "ddp", "fsdp_full_shard", "fsdp_tp", "pp", "zero3")
EXIT_PREEMPTED = 75  # hfdist.config.preemption.PREEMPTED_EXIT_CODE


def _run(rung: str, args, out: Path) -> dict:
    """One preempted run: seconds from the signal to the launcher's exit, the checkpoint's write and size."""
    rank = 0 if rung == "single" else 1
    cmd = [sys.executable, str(FINETUNE), "--config", rung, "--model", args.model, "--max-steps", str(args.steps),
           "--global-batch-size", str(args.global_batch), "--seq-len", str(args.seq_len), "--save-steps", "0",
           "--warmup-steps", "0", "--no-wandb", "--output-dir", str(out)]
    env = {**worker_env(1), "WANDB_MODE": "disabled", "HFDIST_TEST_PREEMPT_AT": f"{rank}:{args.signal_at}"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    exited = time.time()
    summary_file = out / "hfdist_summary.json"
    if proc.returncode != EXIT_PREEMPTED or not summary_file.is_file():
        return {"failed": f"exit code {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"}
    summary = json.loads(summary_file.read_text())
    received = next(r["preempt_signal_time"] for r in summary["ranks"] if r["rank"] == rank)
    checkpoint = Path(summary["preempted"]["checkpoint"])
    return {"seconds_to_exit": exited - received, "save_seconds": summary["preempted"]["save_seconds"],
            "step": summary["preempted"]["step"], "world_size": summary["strategy"]["world_size"],
            "checkpoint_bytes": sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())}


def _median(runs: list[dict], key: str) -> float:
    ok = [r[key] for r in runs if "failed" not in r]
    return statistics.median(ok) if ok else float("nan")


def _table(result: dict) -> str:
    rows = []
    for rung, runs in result["runs"].items():
        each = ", ".join("failed" if "failed" in r else f"{r['seconds_to_exit']:.1f}" for r in runs)
        ok = [r for r in runs if "failed" not in r]
        world = ok[0]["world_size"] if ok else "?"
        rows.append(f"| {rung} | {world} | {_median(runs, 'seconds_to_exit'):.1f} | {_median(runs, 'save_seconds'):.1f} "
                    f"| {_median(runs, 'checkpoint_bytes') / 2**20:,.0f} | {each} |")
    return ("| rung | ranks | signal -> exit s (median) | checkpoint write s | checkpoint MiB | runs (s) |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(rows))


def _write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "preemption.json").write_text(json.dumps(result, indent=2))
    failed = [f"- {rung}, repeat {i + 1}: {r['failed'].strip().splitlines()[0]}"
              for rung, runs in result["runs"].items() for i, r in enumerate(runs) if "failed" in r]
    (out / "preemption.md").write_text(
        f"# Preemption: from the signal to the exit ({out.name})\n\n`{result['command']}` "
        f"({result['wall_seconds'] / 60:.0f} min)\n\n"
        f"{result['model']}, seq {result['seq_len']} x global batch {result['global_batch']}, fp32, one thread per "
        f"process; SIGTERM to one rank as step {result['signal_at']} of {result['steps']} begins, no periodic "
        f"checkpoints. \"signal -> exit\": from that rank's receipt of the signal to the exit (code 75) of the process "
        f"that launched the job, which is the grace a preemption needs here; it includes the rest of the step, the "
        f"checkpoint's write (also shown alone: rank 0's measure), the summary and the processes' exit. Medians over "
        f"{result['repeats']} repeats.\n\n{_table(result)}\n\n"
        f"{load_line(result['load_average'], result['cpu_count'])} {result['load_note']}\n"
        + ("\nRuns that failed (left out of the medians):\n\n" + "\n".join(failed) + "\n" if failed else ""))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-medium", help="preset to train (llama-tiny: a quick check)")
    p.add_argument("--steps", type=int, default=6, help="--max-steps of each run (it stops at --signal-at)")
    p.add_argument("--signal-at", type=int, default=3, help="the step at whose start the rank is signalled")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--rungs", nargs="+", default=list(RUNGS), choices=RUNGS)
    p.add_argument("--load-note", default="", help="what else ran on the machine, as the results file says it")
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/<hardware>)")
    args = p.parse_args()
    start, load_before = time.perf_counter(), os.getloadavg()
    runs: dict[str, list[dict]] = {rung: [] for rung in args.rungs}
    command = [sys.executable, str(Path(__file__).resolve()), "--model", args.model, "--steps", str(args.steps),
               "--signal-at", str(args.signal_at), "--repeats", str(args.repeats), "--seq-len", str(args.seq_len),
               "--global-batch", str(args.global_batch), "--rungs", *args.rungs]

    def result() -> dict:
        return {"command": recorded(command), "model": args.model, "steps": args.steps, "signal_at": args.signal_at,
                "seq_len": args.seq_len, "global_batch": args.global_batch, "repeats": args.repeats,
                "cpu_count": os.cpu_count(), "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
                "load_note": args.load_note, "wall_seconds": time.perf_counter() - start, "runs": runs}

    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for rung in args.rungs:
                out = Path(tmp) / f"{i}-{rung}"
                runs[rung].append(_run(rung, args, out))
                shutil.rmtree(out, ignore_errors=True)  # a checkpoint of llama-medium is ~1.8 GB
                got = runs[rung][-1]
                print(f"repeat {i + 1}/{args.repeats} {rung}: "
                      + ("failed" if "failed" in got else f"{got['seconds_to_exit']:.1f} s to exit"), flush=True)
                _write(results_dir(args.out, MEASURED_ON), result())
    _write(results_dir(args.out, MEASURED_ON), result())
    return 0


if __name__ == "__main__":
    sys.exit(main())
