"""Per-rank peak memory and step time of a large-vocabulary model with hfdist's chunked loss against the unchunked
one (the whole batch's fp32 logits at once, as transformers' own loss holds them).

    python benchmarks/bench_chunked_loss.py       # results/<hardware>/chunked_loss.{md,json}; est. 5-6 min on 2 idle cores

llama-tiny's layers with a 32768-token vocabulary (--vocab), one sequence of 2048 tokens, fp32, forward + backward
through hfdist.models.chunked_loss.causal_lm_loss with --chunk-size positions per chunk (the default, 512) or
unchunked (0): one process, and tensor parallelism over 2 gloo ranks (vocab-sharded logits under loss_parallel(),
sequence parallel). Each variant runs in fresh processes (benchmarks/chunked_loss_worker.py), the variants
alternating, --repeats times; reported are medians over the repeats, per rank:
- the resident memory the first forward + backward adds to the built model (peak RSS, Linux VmHWM, restarted
  just before the step), the figure the issue's "per-rank peak memory" asks about;
- the peak bytes of the tensors that a step's ops create (hfdist.metrics.memory.LiveTensorBytes; under TP it does
  not see DTensor's local ops, so only the peak RSS speaks for tp > 1);
- the step time (median of --steps timed steps; noisy when the machine is shared: `uptime` is recorded).
The logits' bytes are B x S x V x 4 / tp per rank; "covers" says whether the measured drop is at least that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from measure import REPO, recorded, results_dir, torchrun, worker_env

# results/<hardware> names the CPU on any machine: the workers run gloo on CPU tensors (one process, or TP).
MEASURED_ON = "cpu"

WORKER = REPO / "benchmarks" / "chunked_loss_worker.py"
MIB = 2**20
METRICS = ("peak_rss_added_bytes", "live_tensor_peak_bytes", "step_s_median")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-tiny")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=512, help="the chunked variant's positions per chunk")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel degrees (1: one process)")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per variant, alternating")
    p.add_argument("--steps", type=int, default=2, help="timed steps per process")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/<hardware>)")
    return p.parse_args(argv)


def run_variant(args: argparse.Namespace, tp: int, chunk: int) -> list[dict]:
    """One fresh process (tp = 1) or torchrun group: the per-rank measurements."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        worker_args = [str(out), "--preset", args.preset, "--vocab", str(args.vocab), "--seq", str(args.seq),
                       "--batch", str(args.batch), "--chunk", str(chunk), "--tp", str(tp), "--steps", str(args.steps)]
        cmd = torchrun(tp, WORKER, *worker_args) if tp > 1 else [sys.executable, str(WORKER), *worker_args]
        proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode:
            raise SystemExit(f"{recorded(cmd)} failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())["ranks"]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    chunks = {"unchunked": 0, "chunked": args.chunk_size}
    samples: dict[tuple[int, str], list[list[dict]]] = {}
    loads = [uptime()]
    for _ in range(args.repeats):
        for tp in args.tp:
            for name, chunk in chunks.items():  # alternating, so drifting load hits both variants alike
                samples.setdefault((tp, name), []).append(run_variant(args, tp, chunk))
        loads.append(uptime())
    rows = []
    for tp in args.tp:
        logits = args.batch * args.seq * args.vocab * 4 // tp
        per_variant = {}
        for name in chunks:
            repeats = samples[(tp, name)]
            per_variant[name] = [{m: statistics.median(r[rank][m] for r in repeats) for m in METRICS}
                                 | {"repeats": [r[rank] for r in repeats]} for rank in range(tp)]
        for rank in range(tp):
            whole, chunked = per_variant["unchunked"][rank], per_variant["chunked"][rank]
            drop = whole["peak_rss_added_bytes"] - chunked["peak_rss_added_bytes"]
            rows.append({"tp": tp, "rank": rank, "logits_bytes": logits, "unchunked": whole, "chunked": chunked,
                         "peak_drop_bytes": drop, "drop_covers_logits": drop >= logits})
    command = recorded([sys.executable, "benchmarks/bench_chunked_loss.py",
                        *(argv if argv is not None else sys.argv[1:])])
    result = {"command": command, "preset": args.preset, "vocab": args.vocab, "seq": args.seq, "batch": args.batch,
              "chunk_size": args.chunk_size, "repeats": args.repeats, "steps": args.steps, "dtype": "fp32",
              "threads_per_rank": 1, "load": loads, "rows": rows}
    out = results_dir(args.out, MEASURED_ON)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chunked_loss.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "chunked_loss.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    lines = [
        "# Chunked loss: per-rank peak memory and step time",
        "",
        f"`{r['command']}`",
        "",
        f"{r['preset']} layers, vocabulary {r['vocab']}, batch {r['batch']} x seq {r['seq']}, fp32, chunks of "
        f"{r['chunk_size']} positions vs unchunked; medians over {r['repeats']} alternating fresh processes per "
        "variant (peak: resident memory a forward + backward adds; live: bytes of tensors the step's ops create, "
        "which under TP (tp > 1) sees only the ops on plain tensors, not DTensor's local ones, so read peak there; "
        "step: median of the timed steps, noisy on a shared machine; the chunked step recomputes each chunk's "
        "logits in backward).",
        "",
        "| tp | rank | logits MiB | peak unchunked MiB | peak chunked MiB | drop MiB | drop >= logits | "
        "live unchunked MiB | live chunked MiB | step unchunked s | step chunked s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        u, c = row["unchunked"], row["chunked"]
        lines.append(
            f"| {row['tp']} | {row['rank']} | {row['logits_bytes'] / MIB:.0f} | {u['peak_rss_added_bytes'] / MIB:.0f} "
            f"| {c['peak_rss_added_bytes'] / MIB:.0f} | {row['peak_drop_bytes'] / MIB:.0f} | "
            f"{'yes' if row['drop_covers_logits'] else 'no'} | {u['live_tensor_peak_bytes'] / MIB:.0f} | "
            f"{c['live_tensor_peak_bytes'] / MIB:.0f} | {u['step_s_median']:.2f} | {c['step_s_median']:.2f} |")
    lines += ["", "Load (`uptime`) before and after each round of variants:", ""]
    lines += [f"- {load}" for load in r["load"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
