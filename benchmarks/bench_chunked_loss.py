"""Per-rank peak memory and step time of a large-vocabulary model with hfdist's fused loss, its chunked loss that
recomputes each chunk's logits in backward, the plain unchunked loss (the whole batch's fp32 logits at once, as
transformers' own loss holds them), and on one process torch 2.13's fused F.linear_cross_entropy in the fused loss's
place; then the two fused losses alone, at --head-hidden sizes.

    python benchmarks/bench_chunked_loss.py       # results/<hardware>/chunked_loss.{md,json}; est. 15 min on 2 idle cores

llama-tiny's layers with a 32768-token vocabulary (--vocab), so lm_head dominates the step, one sequence of 2048
tokens, fp32, forward + backward through hfdist.models.chunked_loss.causal_lm_loss: unchunked (chunk 0, not fused),
chunked (--chunk-size positions per chunk, the default 512, recomputing) and fused (the same chunks, gradients in
the forward): one process, and tensor parallelism over 2 gloo ranks (vocab-sharded lm_head, sequence parallel; the
fused loss vocab-parallel). Each variant runs in fresh processes (benchmarks/chunked_loss_worker.py), the variants
alternating (each round starting at the next one), --repeats times; reported are medians over the repeats, per rank:
- the resident memory the first forward + backward adds to the built model (peak RSS, Linux VmHWM, restarted
  just before the step), the figure the issue's "per-rank peak memory" asks about;
- the peak bytes of the tensors that a step's ops create (hfdist.metrics.memory.LiveTensorBytes; under TP it does
  not see DTensor's local ops, so only the peak RSS speaks for tp > 1);
- the step time (median of --steps timed steps; noisy when the machine is shared: `uptime` is recorded), and the
  fused / unchunked ratio both of the medians and paired within each round (the median of the rounds' ratios,
  which a load drifting between rounds moves less).
The logits' bytes are B x S x V x 4 / tp per rank; "covers" says whether the fused loss's drop is at least that.
The head-only rows: hfdist's fused loss (f) and torch's op (t) on S x H hidden states and a V x H weight, peak
resident memory a forward + backward adds and the CPU time of a step, medians over --repeats fresh processes; a
hidden size above the chunk's rows (H 1024 > 512) is where a gradient-sized buffer outweighs a chunk's logits.
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
METRICS = ("peak_rss_added_bytes", "live_tensor_peak_bytes", "step_s_median", "step_cpu_s_median")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-tiny")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=512,
                   help="positions per chunk of the chunked and fused variants")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel degrees (1: one process)")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per variant, alternating")
    p.add_argument("--steps", type=int, default=3, help="timed steps per process")
    p.add_argument("--head-hidden", type=int, nargs="*", default=[64, 1024],
                   help="hidden sizes of the head-only comparison of the two fused losses (none: skip it)")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/<hardware>)")
    return p.parse_args(argv)


def run_variant(args: argparse.Namespace, tp: int, chunk: int, *flags: str) -> list[dict]:
    """One fresh process (tp = 1) or torchrun group: the per-rank measurements."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        worker_args = [str(out), "--preset", args.preset, "--vocab", str(args.vocab), "--seq", str(args.seq),
                       "--batch", str(args.batch), "--chunk", str(chunk), "--tp", str(tp), "--steps", str(args.steps),
                       *flags]
        cmd = torchrun(tp, WORKER, *worker_args) if tp > 1 else [sys.executable, str(WORKER), *worker_args]
        proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode:
            raise SystemExit(f"{recorded(cmd)} failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())["ranks"]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    variants = {"unchunked": (0,), "chunked": (args.chunk_size,), "fused": (args.chunk_size, "--fused"),
                "torch": (args.chunk_size, "--fused", "--torch-op")}
    names = list(variants)
    samples: dict[tuple[int, str], list[list[dict]]] = {}
    heads: dict[tuple[int, str], list[dict]] = {}
    loads = [uptime()]
    for round_index in range(args.repeats):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for tp in args.tp:
            for name in order:  # alternating, so drifting load hits every variant alike
                if name == "torch" and tp > 1:
                    continue  # torch's op has no vocab-parallel path
                samples.setdefault((tp, name), []).append(run_variant(args, tp, *variants[name]))
        for hidden in args.head_hidden:
            for name, flags in (("fused", ()), ("torch", ("--torch-op",)))[::1 if round_index % 2 == 0 else -1]:
                heads.setdefault((hidden, name), []).append(
                    run_variant(args, 1, args.chunk_size, "--head-only", "--hidden", str(hidden), *flags)[0])
        loads.append(uptime())
    rows = []
    for tp in args.tp:
        logits = args.batch * args.seq * args.vocab * 4 // tp
        for rank in range(tp):
            row = {"tp": tp, "rank": rank, "logits_bytes": logits}
            for name in names:
                if (tp, name) not in samples:
                    continue
                repeats = [r[rank] for r in samples[(tp, name)]]
                row[name] = {m: statistics.median(r[m] for r in repeats) for m in METRICS} | {"repeats": repeats}
            step = {name: [r["step_s_median"] for r in row[name]["repeats"]] for name in names if name in row}
            row["fused_vs_unchunked_step"] = row["fused"]["step_s_median"] / row["unchunked"]["step_s_median"]
            row["fused_vs_unchunked_step_paired"] = statistics.median(
                f / u for f, u in zip(step["fused"], step["unchunked"]))
            row["chunked_vs_unchunked_step"] = row["chunked"]["step_s_median"] / row["unchunked"]["step_s_median"]
            row["peak_drop_bytes"] = row["unchunked"]["peak_rss_added_bytes"] - row["fused"]["peak_rss_added_bytes"]
            row["drop_covers_logits"] = row["peak_drop_bytes"] >= logits
            row["fused_peak_le_chunked"] = (row["fused"]["peak_rss_added_bytes"]
                                            <= row["chunked"]["peak_rss_added_bytes"])
            if "torch" in row:
                row["torch_vs_fused_cpu"] = row["torch"]["step_cpu_s_median"] / row["fused"]["step_cpu_s_median"]
            rows.append(row)
    head_rows = [{"hidden": hidden, "rows": args.batch * args.seq, "vocab": args.vocab, "chunk_rows": args.chunk_size}
                 | {name: {m: statistics.median(r[m] for r in heads[(hidden, name)]) for m in METRICS}
                    | {"repeats": heads[(hidden, name)]} for name in ("fused", "torch")}
                 for hidden in args.head_hidden]
    command = recorded([sys.executable, "benchmarks/bench_chunked_loss.py",
                        *(argv if argv is not None else sys.argv[1:])])
    result = {"command": command, "preset": args.preset, "vocab": args.vocab, "seq": args.seq, "batch": args.batch,
              "chunk_size": args.chunk_size, "repeats": args.repeats, "steps": args.steps, "dtype": "fp32",
              "threads_per_rank": 1, "load": loads, "rows": rows, "head_rows": head_rows}
    out = results_dir(args.out, MEASURED_ON)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chunked_loss.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "chunked_loss.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    lines = [
        "# Fused and chunked loss: per-rank peak memory and step time",
        "",
        f"`{r['command']}`",
        "",
        f"{r['preset']} layers, vocabulary {r['vocab']} (lm_head dominates the step), batch {r['batch']} x seq "
        f"{r['seq']}, fp32: the plain unchunked loss (u), the chunked loss recomputing each chunk's logits in "
        f"backward (c), the fused loss computing the gradients in the forward (f) and, on one process, torch's "
        f"F.linear_cross_entropy in its place (t), chunks of {r['chunk_size']} "
        f"positions; medians over {r['repeats']} alternating fresh processes per variant (peak: resident memory a "
        "forward + backward adds; live: bytes of tensors the step's ops create, which under TP (tp > 1) sees only "
        "the ops on plain tensors, not DTensor's local ones, and not inside torch's op, so read peak there; step: "
        "median of the timed steps; cpu: the process CPU time of a step; f/u: ratio of the step medians, and "
        "paired: the median of each round's ratio; t/f: CPU time of torch's op against hfdist's).",
        "",
        "| tp | rank | logits MiB | peak u MiB | peak c MiB | peak f MiB | peak t MiB | f <= c | live u MiB | "
        "live c MiB | live f MiB | step u s | step c s | step f s | step t s | c/u | f/u | f/u paired | t/f cpu |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        u, c, f, t = row["unchunked"], row["chunked"], row["fused"], row.get("torch")
        peaks = " | ".join("-" if v is None else f"{v['peak_rss_added_bytes'] / MIB:.0f}" for v in (u, c, f, t))
        lives = " | ".join(f"{v['live_tensor_peak_bytes'] / MIB:.0f}" for v in (u, c, f))
        steps = " | ".join("-" if v is None else f"{v['step_s_median']:.2f}" for v in (u, c, f, t))
        torch_cpu = f"{row['torch_vs_fused_cpu']:.2f}" if t is not None else "-"
        lines.append(
            f"| {row['tp']} | {row['rank']} | {row['logits_bytes'] / MIB:.0f} | {peaks} | "
            f"{'yes' if row['fused_peak_le_chunked'] else 'no'} | {lives} | {steps} | "
            f"{row['chunked_vs_unchunked_step']:.2f} | {row['fused_vs_unchunked_step']:.2f} | "
            f"{row['fused_vs_unchunked_step_paired']:.2f} | {torch_cpu} |")
    if r.get("head_rows"):
        lines += ["", "The fused loss alone: hfdist's (f) against torch's F.linear_cross_entropy (t), fp32, gradients "
                  "kept allocated between steps.", "",
                  "| rows | hidden | vocab | chunk rows | peak f MiB | peak t MiB | t/f peak | cpu f s | cpu t s | t/f cpu |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for h in r["head_rows"]:
            f, t = h["fused"], h["torch"]
            peak_ratio = (f"{t['peak_rss_added_bytes'] / f['peak_rss_added_bytes']:.2f}"
                          if f["peak_rss_added_bytes"] > 0 else "-")
            lines.append(
                f"| {h['rows']} | {h['hidden']} | {h['vocab']} | {h['chunk_rows']} | "
                f"{f['peak_rss_added_bytes'] / MIB:.0f} | {t['peak_rss_added_bytes'] / MIB:.0f} | "
                f"{peak_ratio} | {f['step_cpu_s_median']:.2f} | "
                f"{t['step_cpu_s_median']:.2f} | {t['step_cpu_s_median'] / f['step_cpu_s_median']:.2f} |")
    lines += ["", "Load (`uptime`) before and after each round of variants:", ""]
    lines += [f"- {load}" for load in r["load"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
