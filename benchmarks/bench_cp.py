"""Benchmark context parallelism: per-rank activation and training memory and tokens/s of each cp method (Ulysses,
ring, hybrid) at each cp degree and sequence length, beside one process and the planner's predictions; optionally the
longest sequence each fits under a per-rank cap.

    python benchmarks/bench_cp.py       # llama-tiny, cp 1 / 2 / 4, each method, 16K and 32K: results/<hardware>/
    python benchmarks/bench_cp.py --seq 2048 --cp 1 2 --steps 1 --out /tmp/cp   # a quick check
    python benchmarks/bench_cp.py --seq 65536 --cp 1 4 --methods ring --steps 1   # the longest rows

Each (cp, method) runs in processes of its own (benchmarks/cp_bench_worker.py; cp = 1 as one plain process, cp > 1
under torchrun with gloo), on one packed row of 8 documents, fp32, OMP_NUM_THREADS=--threads per rank; a method
that cannot split the preset at a degree (hfdist.parallel.context_check.plan_cp: Ulysses past the heads, hybrid
without a Ulysses degree between 1 and cp) is left out. Per rank: saved = bytes autograd saves in a forward
(hfdist.metrics.memory.saved_tensor_bytes); training = the peak of the tensors one forward + backward creates
(hfdist.metrics.memory.LiveTensorBytes: activations, temporaries, exchanged tensors or the ring's key/value blocks in
flight, gradients); predicted = hfdist.plan.bytes' activation term for the fsdp_cp rung at that cp and method (no
activation checkpointing, fp32, the same --attn-implementation). Tokens/s counts each token once across the cp
group; the cp ranks share the machine's cores, so on 2 cores cp > 2 cannot speed anything up -- the figure shows
the exchanges' and the blocks' cost, not a GPU's scaling.
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
METHODS = ("ulysses", "ring", "hybrid")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-tiny", help="hfdist model preset (4 heads: every method at cp 4)")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                   help="the cp methods to run at every cp > 1 where they can split the preset")
    p.add_argument("--seq", type=int, nargs="+", default=[16384, 32768],
                   help="the sequence lengths of the memory/throughput figures")
    p.add_argument("--min-seq", type=int, default=1024, help="first length of the longest-sequence search")
    p.add_argument("--max-seq", type=int, default=0,
                   help="last length of the search (doubling from --min-seq); 0: no search")
    p.add_argument("--cap-mib", type=float, default=512, help="per-rank cap on saved activation bytes")
    p.add_argument("--steps", type=int, default=3, help="timed forward + backward steps after one warm-up")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    p.add_argument("--attn-implementation", default="hfdist_documents", choices=("hfdist_documents", "sdpa"),
                   help="the attention of every run (default hfdist_documents, the CPU default; sdpa: Ulysses only)")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/<hardware>)")
    return p.parse_args(argv)


def _config(preset: str):
    from hfdist.models.presets import load_config

    return load_config(preset)


def runs(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(cp, method) pairs to run: one process at cp 1, every asked method that can split the preset elsewhere."""
    from hfdist.errors import HfdistError
    from hfdist.parallel.context_check import check_cp

    out = []
    for cp in args.cp:
        if cp == 1:
            out.append((1, "none"))
            continue
        for method in args.methods:
            try:
                check_cp(_config(args.preset), cp, max(args.seq), method=method)
            except HfdistError:
                continue
            out.append((cp, method))
    return out


def predicted_activations(preset: str, cp: int, method: str, seq: int, attention: str) -> int:
    """The planner's per-rank activation bytes for the fsdp_cp rung at `cp` by `method` (fp32, no checkpointing)."""
    from hfdist.config.dims import ParallelDims
    from hfdist.config.ladder import load_rung
    from hfdist.models.shape import ModelShape
    from hfdist.plan.bytes import Workload, rung_rank_bytes

    shape = ModelShape.from_config(_config(preset))
    workload = Workload(seq=seq, micro_batch=1, dtype="fp32", attention=attention,
                        cp_method=method if cp > 1 else "auto")
    return rung_rank_bytes(shape, load_rung("fsdp_cp"), ParallelDims(cp=cp), workload).activations


def run_one(args: argparse.Namespace, cp: int, method: str, out: Path) -> tuple[list[dict], str]:
    worker_args = [str(out), "--preset", args.preset, "--seq", *map(str, args.seq), "--min-seq", str(args.min_seq),
                   "--max-seq", str(args.max_seq), "--cap-mib", str(args.cap_mib), "--steps", str(args.steps),
                   "--attn-implementation", args.attn_implementation, "--cp-method", method]
    cmd = [sys.executable, str(WORKER), *worker_args] if cp == 1 else torchrun(cp, WORKER, *worker_args)
    env = worker_env(args.threads)
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"cp={cp} {method} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(out.read_text()), recorded(cmd, env)


def summarise(args: argparse.Namespace, cp: int, method: str, records: list[dict], command: str) -> dict:
    """One run's figures: per --seq the worst rank's saved and training bytes and the slowest rank's tokens/s."""
    by_seq = {}
    for seq in args.seq:
        figures = [r["by_seq"][str(seq)] for r in records]
        by_seq[seq] = {"saved_bytes": max(f["saved_bytes"] for f in figures),
                       "step_peak": max(f["step_peak"] for f in figures),
                       "tokens_per_second": min(f["tokens_per_second"] for f in figures),
                       "predicted_activation_bytes": predicted_activations(args.preset, cp, method, seq,
                                                                           args.attn_implementation)}
    row = {"cp": cp, "method": method, "ulysses": records[0]["ulysses"], "command": command, "by_seq": by_seq}
    if args.max_seq:
        lengths = sorted({int(s) for r in records for s in r["by_length"]})
        worst = {s: max(r["by_length"][str(s)] for r in records if str(s) in r["by_length"]) for s in lengths}
        fits = [s for s in lengths if worst[s] <= args.cap_mib * MIB]
        row["longest_under_cap"] = max(fits) if fits else None
    return row


def markdown(args: argparse.Namespace, rows: list[dict], load: str) -> str:
    attention = ("sdpa with the 4-D block mask" if args.attn_implementation == "sdpa" else
                 "hfdist's document attention (the documents' boundaries, no mask)")
    lines = [f"# Context parallelism on {args.preset}: memory and throughput per method and cp degree", "",
             f"One packed row of 8 documents, fp32, {attention}, OMP_NUM_THREADS={args.threads} per rank, load "
             f"before the run: {load}. Per rank (the worst): saved = bytes autograd saves in a forward "
             "(hfdist.metrics.memory.saved_tensor_bytes); training = the peak of the tensors one forward + backward "
             "creates (hfdist.metrics.memory.LiveTensorBytes), and its ratio to one process's on the same row; "
             "predicted = hfdist.plan's activation term for fsdp_cp at that cp and method. Tokens/s counts each "
             "token once across the cp group (median of the timed steps, the slowest rank), and its ratio to "
             "Ulysses' at the same cp and length. cp ranks share the machine's cores: the ratios, not the absolute "
             "rates, are what carries over.", ""]
    one = {seq: next((r["by_seq"][seq] for r in rows if r["cp"] == 1), None) for seq in args.seq}
    for seq in args.seq:
        lines += [f"## {seq:,} tokens", "",
                  "| cp | method | saved (MiB) | predicted (MiB) | training (MiB) | training / one process | "
                  "tokens/s | tokens/s / Ulysses |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            f = r["by_seq"][seq]
            ulysses = next((u["by_seq"][seq] for u in rows if u["cp"] == r["cp"] and u["method"] == "ulysses"), None)
            method = r["method"] + (f" ({r['ulysses']} x {r['cp'] // r['ulysses']})" if r["method"] == "hybrid" else "")
            memory = f"{f['step_peak'] / one[seq]['step_peak']:.2f}" if one[seq] else "-"
            speed = f"{f['tokens_per_second'] / ulysses['tokens_per_second']:.2f}" if ulysses else "-"
            lines.append(f"| {r['cp']} | {method} | {f['saved_bytes'] / MIB:,.1f} | "
                         f"{f['predicted_activation_bytes'] / MIB:,.1f} | {f['step_peak'] / MIB:,.1f} | {memory} | "
                         f"{f['tokens_per_second']:,.0f} | {speed} |")
        lines.append("")
    if args.max_seq:
        lines += [f"Longest sequence under {args.cap_mib:g} MiB saved per rank ({args.min_seq} doubling to "
                  f"{args.max_seq}): " + ", ".join(f"cp {r['cp']} {r['method']}: {r['longest_under_cap'] or '-'}"
                                                   for r in rows), ""]
    lines += ["Commands:", ""] + [f"    {r['command']}" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load = open("/proc/loadavg").read().split()[:3] if Path("/proc/loadavg").exists() else ["?"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cp, method in runs(args):
            records, command = run_one(args, cp, method, Path(tmp) / f"cp{cp}-{method}.json")
            rows.append(summarise(args, cp, method, records, command))
            figures = ", ".join(f"{seq}: {f['step_peak'] / MIB:.1f} MiB, {f['tokens_per_second']:.0f} tok/s"
                                for seq, f in rows[-1]["by_seq"].items())
            print(f"cp={cp} {method}: {figures}", flush=True)
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
