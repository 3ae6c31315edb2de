"""`hfdist tune` against an exhaustive sweep of the same candidates, on this machine.

    python benchmarks/bench_tune.py        # writes results/<hardware>/tune.{json,md}

1. `hfdist tune` on the job below (its candidates: the rungs of --configs, their degrees, micro-batches and
   recompute), into a fresh folder: its wall time and the layout it chose.
2. The sweep: `hfdist tune --exhaustive` on the same job and candidates into another fresh folder (every
   candidate probed, the same probe length), which both measures every candidate and reports the best.
3. The figures: the chosen layout's tokens/s over the sweep's best (the chosen layout's own tokens/s as the sweep
   measured it, so both sides are one measurement of each layout), tune's wall time over the sweep's, and every
   probe's planned against measured training peak memory per rank (the plan's error).

Both runs measure the machine themselves (hardware-N.json) and probe in separate worlds, one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import REPO, recorded, results_dir, worker_env

MEASURED_ON = None  # where the job trains: the GPUs of a GPU host, else results/cpu-<cores>core


def _tune(args, out: Path, exhaustive: bool) -> tuple[dict, float, str]:
    cmd = [sys.executable, "-m", "hfdist.cli", "tune", "--model", args.model, "--num-processes", str(args.processes),
           "--configs", args.configs, "--consider", args.consider, "--global-batch-size", str(args.global_batch),
           "--seq-len", str(args.seq_len), "--budget", str(args.budget), "--probe-steps", str(args.probe_steps),
           "--report-to", "none", "--out", str(out), *(["--exhaustive"] if exhaustive else [])]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=worker_env(1), capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads((out / "tune.json").read_text()), seconds, recorded(cmd)


def _markdown(data: dict) -> str:
    t, s = data["tune"], data["sweep"]
    lines = ["# hfdist tune against an exhaustive sweep", "",
             f"Measured by `python benchmarks/bench_tune.py {data['args']}` (load average before: "
             f"{data['load_before']:.1f}, after: {data['load_after']:.1f}).", "",
             f"- tune: `{t['command']}`: {t['probes']} probe(s) of {t['candidates']} candidate(s) in "
             f"{t['seconds']:.0f} s; chose {t['chosen']}.",
             f"- sweep: `{s['command']}`: {s['probes']} probe(s) in {s['seconds']:.0f} s; best {s['best']} "
             f"({s['best_tokens_per_second']:,.0f} tokens/s).",
             f"- chosen layout's tokens/s (as the sweep measured it) over the sweep's best: **{data['speed_ratio']:.3f}**"
             f"; tune's wall time over the sweep's: **{data['time_ratio']:.3f}**.",
             f"- the plan's training peak memory against every probe's measured peak (sweep): largest miss "
             f"**{data['largest_memory_error']:+.1%}**.", "",
             "| layout | measured tok/s (sweep) | planned GB | measured GB | plan error | losses |",
             "|---|---|---|---|---|---|"]
    for p in sorted(s["rows"], key=lambda r: -(r["tokens_per_second"] or 0)):
        error = ((p["planned_bytes"] - p["peak_memory_bytes"]) / p["peak_memory_bytes"]
                 if p["peak_memory_bytes"] else None)
        lines.append(f"| {p['describe']} | {p['tokens_per_second'] or 0:,.0f} | {p['planned_bytes'] / 1e9:.3f} | "
                     f"{(p['peak_memory_bytes'] or 0) / 1e9:.3f} | {f'{error:+.1%}' if error is not None else '-'} | "
                     f"{p['agreement'] or p['status']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-small", help="the job's model (default llama-small)")
    p.add_argument("--processes", type=int, default=4, help="processes of every probe (default 4)")
    p.add_argument("--configs", default="ddp,fsdp_full_shard,fsdp_tp,pp", help="the rungs tune considers")
    p.add_argument("--consider", default="micro-batch,recompute", help="what else tune may change")
    p.add_argument("--global-batch", type=int, default=16, help="the job's global batch (default 16)")
    p.add_argument("--seq-len", type=int, default=256, help="the job's sequence length (default 256)")
    p.add_argument("--probe-steps", type=int, default=5, help="optimizer steps per probe (default 5)")
    p.add_argument("--budget", type=float, default=60.0, help="minutes for each of the two runs (default 60)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/<hardware>)")
    args = p.parse_args()
    shown = " ".join(sys.argv[1:])
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        tuned, tune_seconds, tune_cmd = _tune(args, Path(tmp) / "tune", exhaustive=False)
        swept, sweep_seconds, sweep_cmd = _tune(args, Path(tmp) / "sweep", exhaustive=True)
    if tuned["winner"] is None:  # nothing checked: tune says why in its report
        raise SystemExit(f"hfdist tune chose no layout ({tuned.get('unsettled')}); nothing to compare with the sweep")
    ok = [r for r in swept["probes"] if r["status"] == "ok" and r["agreement"] == "agrees"]
    best = max(ok, key=lambda r: r["tokens_per_second"])
    chosen = next(r for r in swept["probes"] if r["key"] == tuned["winner"])
    errors = [(r["planned_bytes"] - r["peak_memory_bytes"]) / r["peak_memory_bytes"] for r in swept["probes"]
              if r["peak_memory_bytes"]]
    data = {"args": shown, "load_before": load_before, "load_after": os.getloadavg()[0],
            "tune": {"command": tune_cmd, "seconds": tune_seconds, "probes": len(tuned["probes"]),
                     "candidates": len(tuned["candidates"]), "chosen": chosen["describe"]},
            "sweep": {"command": sweep_cmd, "seconds": sweep_seconds, "probes": len(swept["probes"]),
                      "best": best["describe"], "best_tokens_per_second": best["tokens_per_second"],
                      "rows": swept["probes"]},
            "speed_ratio": chosen["tokens_per_second"] / best["tokens_per_second"],
            "time_ratio": tune_seconds / sweep_seconds,
            "largest_memory_error": max(errors, key=abs)}
    out = results_dir(args.out, MEASURED_ON)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps(data, indent=2))
    (out / "tune.md").write_text(_markdown(data))
    print(_markdown(data))


if __name__ == "__main__":
    main()
