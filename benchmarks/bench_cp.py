"""Benchmark context parallelism: per-rank activation memory and tokens/s of cp = 1, 2, 4 at one sequence length,
and the longest sequence each fits under a per-rank cap, beside the planner's predictions.

    python benchmarks/bench_cp.py                 # llama-tiny, seq 4096, cap 512 MiB: results/<hardware>/context_parallel.*
    python benchmarks/bench_cp.py --seq 1024 --max-seq 4096 --out /tmp/cp   # a quick check

Each degree runs in processes of its own (benchmarks/cp_bench_worker.py; cp = 1 as one plain process, cp > 1 under
torchrun with gloo), on one packed row of 8 documents, fp32, OMP_NUM_THREADS=--threads per rank. Activation memory
is what autograd saves in a forward (hfdist.metrics.memory.saved_tensor_bytes), per rank; the planner's figure is
hfdist.plan.bytes' activation term for the fsdp_cp rung at that cp (no activation checkpointing, fp32) and the same
--attn-implementation: hfdist's document attention by default (the packed rows' boundaries, nothing S x S), or
sdpa with the rows' 4-D block mask (seq x seq bytes and its float copy, whole on every cp rank), which the planner
counts too (hfdist.models.attention.dense_mask_bytes).
Tokens/s counts each token once across the cp group; the cp ranks share the machine's cores, so on 2 cores cp > 2
cannot speed anything up -- the figure shows the exchange's cost, not a GPU's scaling.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from measure import REPO, recorded, results_dir, torchrun, worker_env

MEASURED_ON = "cpu"  # results/<hardware> names the CPU on any machine: its workers run gloo on CPU tensors

WORKER = REPO / "benchmarks" / "cp_bench_worker.py"
MIB = 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-tiny", help="hfdist model preset (its heads must divide by 4)")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--seq", type=int, default=4096, help="the fixed sequence length of the memory/throughput figures")
    p.add_argument("--min-seq", type=int, default=1024, help="first length of the longest-sequence search")
    p.add_argument("--max-seq", type=int, default=16384, help="last length of the search (doubling from --min-seq)")
    p.add_argument("--cap-mib", type=float, default=512, help="per-rank cap on saved activation bytes")
    p.add_argument("--steps", type=int, default=3, help="timed forward + backward steps after one warm-up")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    p.add_argument("--attn-implementation", default="hfdist_documents", choices=("hfdist_documents", "sdpa"),
                   help="the attention of every degree (default hfdist_documents, the CPU default)")
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/<hardware>)")
    return p.parse_args(argv)


def predicted_activations(preset: str, cp: int, seq: int, attention: str) -> int:
    """The planner's per-rank activation bytes for the fsdp_cp rung at `cp` (fp32, no checkpointing)."""
    from hfdist.config.dims import ParallelDims
    from hfdist.config.ladder import load_rung
    from hfdist.models.presets import load_config
    from hfdist.models.shape import ModelShape
    from hfdist.plan.bytes import Workload, rung_rank_bytes

    shape = ModelShape.from_config(load_config(preset))
    return rung_rank_bytes(shape, load_rung("fsdp_cp"), ParallelDims(cp=cp),
                           Workload(seq=seq, micro_batch=1, dtype="fp32", attention=attention)).activations


def run_degree(args: argparse.Namespace, cp: int, out: Path) -> tuple[list[dict], str]:
    worker_args = [str(out), "--preset", args.preset, "--seq", str(args.seq), "--min-seq", str(args.min_seq),
                   "--max-seq", str(args.max_seq), "--cap-mib", str(args.cap_mib), "--steps", str(args.steps),
                   "--attn-implementation", args.attn_implementation]
    cmd = [sys.executable, str(WORKER), *worker_args] if cp == 1 else torchrun(cp, WORKER, *worker_args)
    env = worker_env(args.threads)
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"cp={cp} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(out.read_text()), recorded(cmd, env)


def summarise(args: argparse.Namespace, cp: int, records: list[dict], command: str) -> dict:
    cap = args.cap_mib * MIB
    lengths = sorted({int(s) for r in records for s in r["by_length"]})
    worst = {s: max(r["by_length"][str(s)] for r in records if str(s) in r["by_length"]) for s in lengths}
    fits = [s for s in lengths if worst[s] <= cap]
    grid = [args.min_seq * 2**k for k in range(64) if args.min_seq * 2**k <= args.max_seq]
    predicted_fits = [s for s in grid if predicted_activations(args.preset, cp, s, args.attn_implementation) <= cap]
    return {"cp": cp, "seq": args.seq, "command": command,
            "saved_bytes_per_rank": [r["saved_bytes"] for r in records],
            "predicted_activation_bytes": predicted_activations(args.preset, cp, args.seq, args.attn_implementation),
            # sdpa: the mask's additive fp32 copy (1, 1, seq, seq), on every rank
            "block_mask_bytes": 4 * args.seq * args.seq if args.attn_implementation == "sdpa" else 0,
            "tokens_per_second": min(r["tokens_per_second"] for r in records),
            "saved_bytes_by_length": worst,
            "longest_under_cap": max(fits) if fits else None,
            "predicted_longest_under_cap": max(predicted_fits) if predicted_fits else None}


def markdown(args: argparse.Namespace, rows: list[dict], load: str) -> str:
    attention = ("sdpa with the 4-D block mask" if args.attn_implementation == "sdpa" else
                 "hfdist's document attention (the documents' boundaries, no mask)")
    mask = ("cp = 1 is hfdist's plain path, where sdpa converts the boolean block mask to a float copy in every "
            "layer and saves each (layers x 4 x seq^2 bytes); under cp > 1 the Ulysses attention converts it once "
            "per forward (4 x seq^2 bytes, whole on every rank): that mask is the part cp does not divide."
            if args.attn_implementation == "sdpa" else
            "Nothing S x S exists: every rank attends each document of the gathered sequence for its heads.")
    lines = [f"# Context parallelism on {args.preset}: activation memory and throughput per cp degree", "",
             f"One packed row of 8 documents, fp32, {attention}, OMP_NUM_THREADS={args.threads} "
             f"per rank, load before the run: {load}. Saved = bytes autograd saves in a forward on the worst rank "
             "(hfdist.metrics.memory.saved_tensor_bytes); predicted = hfdist.plan's activation term for fsdp_cp "
             f"(--attn-implementation {args.attn_implementation}). Tokens/s counts each token once across the cp "
             f"group (median of the timed steps, the slowest rank). {mask}", "",
             f"| cp | saved per rank at seq {args.seq} (MiB) | predicted (MiB) | fp32 block mask (MiB) | tokens/s | "
             f"longest seq under {args.cap_mib:g} MiB | predicted longest |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['cp']} | {max(r['saved_bytes_per_rank']) / MIB:,.1f} | "
                     f"{r['predicted_activation_bytes'] / MIB:,.1f} | {r['block_mask_bytes'] / MIB:,.1f} | "
                     f"{r['tokens_per_second']:,.0f} | {r['longest_under_cap'] or '-'} | "
                     f"{r['predicted_longest_under_cap'] or '-'} |")
    lines += ["", f"Lengths searched: {args.min_seq} doubling to {args.max_seq} (the longest is the last length "
              "under the cap on this grid).", "", "Commands:", ""]
    lines += [f"    {r['command']}" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load = open("/proc/loadavg").read().split()[:3] if Path("/proc/loadavg").exists() else ["?"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cp:
            records, command = run_degree(args, cp, Path(tmp) / f"cp{cp}.json")
            rows.append(summarise(args, cp, records, command))
            print(f"cp={cp}: saved {max(rows[-1]['saved_bytes_per_rank']) / MIB:.1f} MiB/rank, "
                  f"{rows[-1]['tokens_per_second']:.0f} tok/s, longest {rows[-1]['longest_under_cap']}", flush=True)
    out = results_dir(args.out, MEASURED_ON)
    out.mkdir(parents=True, exist_ok=True)
    driver = recorded([sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:])])
    (out / "context_parallel.json").write_text(json.dumps({"command": driver, "load": load, "runs": rows}, indent=1))
    (out / "context_parallel.md").write_text(markdown(args, rows, " ".join(load)).replace(
        "Commands:", f"Commands (driver: `{driver}`):"))
    print(f"wrote {out / 'context_parallel.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
