"""Mixture-of-experts: the experts' grouped GEMM against a loop over the experts, and hfdist's job on the MoE rungs
(tokens/s and MFU from active FLOPs).

    python benchmarks/bench_moe.py                       # results/<hardware>/moe.{json,md}
    python benchmarks/bench_moe.py --rows 256 --experts 4 --rungs single --max-steps 3 --out /tmp/moe   # a quick check

Experts: one MoE layer's local experts (hfdist.parallel.expert_dispatch.run_experts) on --rows routed rows spread
evenly over --experts experts (hidden --hidden, expert width --width), forward + backward, the median of --repeats
after a warm-up, as one grouped GEMM per projection (torch's grouped_mm, hfdist's GPU path) and as a loop over the
experts (its CPU path), on the GPU when there is one (bf16) else the CPU (fp32). The grouped GEMM is what expert
parallelism runs on a GPU; only a GPU can say what it gains (torch's CPU grouped GEMM is a reference kernel).

Job: `scripts/finetune.py` on each --rungs entry (e.g. `fsdp_ep:2`: the rung with --ep 2, on the YAML's process
count on CPU, one process per GPU on a GPU machine) for --model, reading each rank's tokens/s and MFU (the job's
metrics callback: model FLOPs of the active parameters, hfdist.metrics.flops) from hfdist_summary.json. On a
one-GPU machine only the one-process rungs run: NCCL puts one rank per GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import REPO, recorded, results_dir, worker_env

MEASURED_ON = None  # results/<hardware> names the GPUs where there are any: where the experts and the job run
FINETUNE = REPO / "scripts" / "finetune.py"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16384, help="routed rows (tokens x top-k) of the experts' benchmark")
    p.add_argument("--experts", type=int, default=16, help="local experts the rows are spread over")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=768, help="one expert's intermediate width")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--model", default="qwen3-moe-tiny", help="the job's model preset")
    p.add_argument("--rungs", nargs="*", default=["single", "fsdp_full_shard", "fsdp_ep:2"],
                   help="rungs of the job (RUNG or RUNG:EP); none: the experts' benchmark only")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/<hardware>)")
    return p.parse_args(argv)


def time_experts(args: argparse.Namespace) -> dict:
    """Median seconds of forward + backward of the local experts, grouped and looped, and their ratio."""
    import torch
    from torch import nn

    from hfdist.parallel.expert_dispatch import run_experts

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(args.rows, args.hidden, generator=g).to(device, dtype)
    gate_up = (torch.randn(args.experts, 2 * args.width, args.hidden, generator=g) * 0.02).to(device, dtype)
    down = (torch.randn(args.experts, args.hidden, args.width, generator=g) * 0.02).to(device, dtype)
    base, extra = divmod(args.rows, args.experts)
    sizes = [base + (e < extra) for e in range(args.experts)]
    out = {"device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    for name, grouped in (("grouped", True), ("loop", False)):
        w = [gate_up.clone().requires_grad_(), down.clone().requires_grad_()]
        times = []
        for i in range(args.repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            run_experts(rows, sizes, *w, nn.SiLU(), False, grouped=grouped).float().square().mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first call warms up
                times.append(time.perf_counter() - start)
        out[f"{name}_seconds"] = statistics.median(times)
    flops = 6 * args.rows * 3 * args.hidden * args.width  # forward + both gradients of the three projections
    out["grouped_tflops"] = flops / out["grouped_seconds"] / 1e12
    out["loop_over_grouped"] = out["loop_seconds"] / out["grouped_seconds"]
    return out


def run_job(args: argparse.Namespace, rung: str, work: Path) -> dict:
    """One job: each rank's tokens/s and MFU from its summary, and the command."""
    name, _, ep = rung.partition(":")
    out = work / rung.replace(":", "_ep")
    cmd = [sys.executable, str(FINETUNE), "--model", args.model, "--seq-len", str(args.seq_len),
           "--global-batch-size", str(args.global_batch), "--max-steps", str(args.max_steps), "--save-steps", "0",
           "--report-to", "none", "--output-dir", str(out), *(["--config", name] if name != "single" else []),
           *(["--ep", ep] if ep else [])]
    env = worker_env(1)
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        return {"rung": rung, "command": recorded(cmd, env), "error": proc.stderr[-2000:]}
    summary = json.loads((out / "hfdist_summary.json").read_text())
    ranks = summary["ranks"]
    return {"rung": rung, "command": recorded(cmd, env), "layout": summary["strategy"],
            "tokens_per_second": sum(r.get("tokens_per_second", 0) for r in ranks) / summary["strategy"]["tp"],
            "mfu": [r.get("mfu") for r in ranks], "losses": summary["losses"]}


def markdown(args: argparse.Namespace, experts: dict, jobs: list[dict], load: str, driver: str) -> str:
    lines = [f"# Mixture-of-experts: grouped GEMM and the MoE rungs ({experts['device']})", "",
             f"Load before the run: {load}. Driver: `{driver}`.", "",
             f"Experts: {args.rows} routed rows over {args.experts} experts, hidden {args.hidden}, width "
             f"{args.width}, {experts['dtype']}, forward + backward, median of {args.repeats}.", "",
             "| path | seconds | TFLOP/s |", "|---|---:|---:|",
             f"| grouped GEMM | {experts['grouped_seconds']:.4f} | {experts['grouped_tflops']:.2f} |",
             f"| loop over experts | {experts['loop_seconds']:.4f} | "
             f"{experts['grouped_tflops'] / experts['loop_over_grouped']:.2f} |", ""]
    if jobs:
        lines += [f"Job: {args.model}, seq {args.seq_len} x global batch {args.global_batch}, {args.max_steps} steps; "
                  "tokens/s summed over the ranks (once per tp group), MFU per rank from active FLOPs.", "",
                  "| rung | tokens/s | MFU per rank | command |", "|---|---:|---|---|"]
        for job in jobs:
            if "error" in job:
                lines.append(f"| {job['rung']} | failed | - | `{job['command']}` |")
                continue
            mfu = ", ".join(f"{m:.1%}" for m in job["mfu"] if m is not None) or "-"
            lines.append(f"| {job['rung']} | {job['tokens_per_second']:,.0f} | {mfu} | `{job['command']}` |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load = " ".join(open("/proc/loadavg").read().split()[:3]) if Path("/proc/loadavg").exists() else "?"
    experts = time_experts(args)
    print(f"experts on {experts['device']}: grouped {experts['grouped_seconds']:.4f} s, loop "
          f"{experts['loop_seconds']:.4f} s ({experts['loop_over_grouped']:.2f} x)", flush=True)
    jobs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rung in args.rungs:
            jobs.append(run_job(args, rung, Path(tmp)))
            print(f"{rung}: {jobs[-1].get('tokens_per_second', 'failed')} tokens/s", flush=True)
    out = results_dir(args.out, MEASURED_ON)
    out.mkdir(parents=True, exist_ok=True)
    driver = recorded([sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:])])
    (out / "moe.json").write_text(json.dumps({"command": driver, "load": load, "experts": experts, "jobs": jobs},
                                             indent=1))
    (out / "moe.md").write_text(markdown(args, experts, jobs, load, driver))
    print(f"wrote {out / 'moe.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
