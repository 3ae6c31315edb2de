"""`hfdist prepare` on 100k rows, then the job's data phase reading what it wrote.

    python benchmarks/bench_prepare.py        # writes results/<hardware>/prepare.{json,md}

1. `hfdist prepare` (a subprocess, as a user runs it) on ROWS `messages` conversations (1-3 exchanges each) at
   --seq-len 128, holding out 1%, tokenising in 2 processes: wall seconds and the peak RSS of the process tree; the
   same on a quarter of the rows, so the peak shows what grows with the data (it should not: rows stay in datasets'
   memory-mapped Arrow files and packing holds one window of blocks).
2. The job's data phase on that folder, in a fresh process per repeat (what each rank of `hfdist finetune` does
   once its tokenizer is loaded: hfdist.job.data.job_data, the prepared folder checked against the job's settings
   and memory-mapped): seconds with datasets' import included (a rank's first data step) and without.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from measure import REPO, recorded, results_dir, worker_env

MEASURED_ON = "cpu"  # tokenising and reading files: results/cpu-<cores>core on any machine


def _write_rows(path: Path, rows: int) -> None:
    from hfdist.data.default import generate_conversations

    conversations = generate_conversations(3 * rows, seed=12)[:rows]
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))


def _prepare(data: Path, folder: Path, args) -> dict[str, Any]:
    """One `hfdist prepare` run: seconds and the process tree's peak RSS (its workers' included)."""
    cmd = [sys.executable, "-m", "hfdist.cli", "prepare", "--dataset", str(data), "--seq-len", str(args.seq_len),
           "--eval-fraction", "0.01", "--global-batch-size", "16", "--num-proc", str(args.num_proc),
           "--prepared-data", str(folder)]
    env = {**worker_env(1), "HF_DATASETS_CACHE": str(folder.parent / f"{folder.name}-cache")}
    load = os.getloadavg()[0]
    rss = folder.parent / f"{folder.name}.rss"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--peak-rss", str(rss), *cmd], cwd=REPO, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    report = next(line for line in proc.stdout.splitlines() if line.startswith("hfdist: data: "))
    return {"seconds": seconds, "peak_rss_bytes": int(rss.read_text()), "report": report, "load_before": load,
            "command": recorded(cmd)}


def peak_rss(path: str, cmd: list[str]) -> int:
    """Run `cmd`; write the largest RSS of it and its workers (ru_maxrss of the waited-for children) to `path`."""
    code = subprocess.run(cmd).returncode
    Path(path).write_text(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))
    return code


def _data_phase(folder: Path, data: Path, args) -> dict[str, float]:
    """The job's data phase on the prepared folder, in a fresh process (worker mode)."""
    out = folder.parent / "phase.json"
    cmd = [sys.executable, __file__, "--worker", str(folder), "--data", str(data), "--seq-len", str(args.seq_len),
           "--out", str(out)]
    subprocess.run(cmd, cwd=REPO, env=worker_env(1), check=True, capture_output=True)
    return json.loads(out.read_text())


def worker(args) -> None:
    """Time hfdist.job.data.job_data on a prepared folder, as a rank runs it after loading its tokenizer."""
    from hfdist.config.finetune import parse_args
    from hfdist.data import load_tokenizer

    tok = load_tokenizer(None, is_preset=True)
    cfg = parse_args(["--dataset", args.data, "--seq-len", str(args.seq_len), "--eval-fraction", "0.01",
                      "--global-batch-size", "16", "--prepared-data", args.worker])
    start = time.perf_counter()
    import datasets  # noqa: F401  (a rank's first data step imports it)

    imported = time.perf_counter()
    from hfdist.job.data import job_data

    prepared = job_data(cfg, tok)
    done = time.perf_counter()
    Path(args.out).write_text(json.dumps({"with_import_s": done - start, "without_import_s": done - imported,
                                          "train_blocks": len(prepared.train), "eval_blocks": len(prepared.eval)}))


def _markdown(result: dict[str, Any], hardware: str) -> str:
    big, small = result["prepare"], result["prepare_quarter"]
    phases = result["data_phase"]
    with_import = [p["with_import_s"] for p in phases]
    without = [p["without_import_s"] for p in phases]
    gib = 1024 ** 3
    return (
        f"# `hfdist prepare`, then the job's data phase ({hardware})\n\n`{result['command']}`\n\n"
        f"`{big['command']}` on {result['rows']:,} `messages` rows (1-3 exchanges each; {small['rows']:,} for the "
        f"second row), --seq-len {result['seq_len']}, 1% held out. Load average before: {big['load_before']:.1f} / "
        f"{small['load_before']:.1f} (2 cores shared with other jobs: seconds are indicative only).\n\n"
        f"| | rows | seconds | rows/s | peak RSS of the process tree |\n|---|---|---|---|---|\n"
        f"| `hfdist prepare` | {result['rows']:,} | {big['seconds']:.1f} | {result['rows'] / big['seconds']:,.0f} | "
        f"{big['peak_rss_bytes'] / gib:.2f} GiB |\n"
        f"| `hfdist prepare` | {small['rows']:,} | {small['seconds']:.1f} | {small['rows'] / small['seconds']:,.0f} | "
        f"{small['peak_rss_bytes'] / gib:.2f} GiB |\n\n"
        f"{big['report']}\n\n"
        f"The job's data phase on the prepared folder (hfdist.job.data.job_data: settings checked, train and eval "
        f"blocks memory-mapped; {phases[0]['train_blocks']:,} + {phases[0]['eval_blocks']:,} blocks), "
        f"{len(phases)} fresh processes: median {statistics.median(with_import):.2f} s with datasets' import "
        f"(max {max(with_import):.2f} s), {statistics.median(without):.2f} s without.\n"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    if len(sys.argv) > 2 and sys.argv[1] == "--peak-rss":
        raise SystemExit(peak_rss(sys.argv[2], sys.argv[3:]))
    args = p.parse_args()
    if args.worker:
        return worker(args)
    command = recorded([sys.executable, *sys.argv])
    with tempfile.TemporaryDirectory() as tmp:
        data, quarter = Path(tmp) / "rows.jsonl", Path(tmp) / "quarter.jsonl"
        _write_rows(data, args.rows)
        _write_rows(quarter, args.rows // 4)
        small = {**_prepare(quarter, Path(tmp) / "prepared-quarter", args), "rows": args.rows // 4}
        big = _prepare(data, Path(tmp) / "prepared", args)
        phases = [_data_phase(Path(tmp) / "prepared", data, args) for _ in range(args.repeats)]
    result = {"command": command, "rows": args.rows, "seq_len": args.seq_len, "prepare": big,
              "prepare_quarter": small, "data_phase": phases}
    from hfdist.report.matrix import hardware_name

    out = results_dir(args.out, MEASURED_ON)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prepare.json").write_text(json.dumps(result, indent=2))
    (out / "prepare.md").write_text(_markdown(result, hardware_name(MEASURED_ON)))
    print((out / "prepare.md").read_text())


if __name__ == "__main__":
    main()
