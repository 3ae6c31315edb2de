"""`hfdist prepare` at growing sizes (rows/s, the process tree's peak memory), its workers' speed-up, then the job's
data phase reading what it wrote.

    python benchmarks/bench_prepare.py                       # writes results/<hardware>/prepare.{json,md}
    python benchmarks/bench_prepare.py --rows 20000,40000 --speedup-rows 20000 --repeats 1 --out /tmp/p   # a check

1. `hfdist prepare` (a subprocess, as a user runs it) on N `messages` conversations (1-3 exchanges each) for each N
   of --rows, at --seq-len 128, holding out 1%, with --num-proc workers: wall and CPU seconds (the whole process
   tree's), rows/s, and the tree's peak memory: the sum of its processes' RSS, sampled every 0.2 s, and the largest
   single process's peak RSS. Preparation streams (hfdist.data.documents): the peak should not grow with N.
2. The speed-up of workers: the same prepare at each of --speedup-rows with --num-proc 1 and with --num-proc, rows/s
   and CPU seconds of each, memory not sampled (the start-up, about 2 s of imports, is not parallel: the speed-up
   grows with the rows).
3. The job's data phase on the largest folder, in a fresh process per repeat (what each rank of `hfdist finetune`
   does once its tokenizer is loaded: hfdist.job.data.job_data, the prepared folder checked and memory-mapped):
   seconds with datasets' import included (a rank's first data step) and without.
--profile prints where one process's time goes (cProfile of `hfdist prepare --num-proc 1` at the first
--speedup-rows).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from measure import REPO, recorded, results_dir, worker_env

MEASURED_ON = "cpu"  # tokenising and reading files: results/cpu-<cores>core on any machine
_CHUNK = 50_000  # conversations generated (and written) at a time


def _write_rows(path: Path, rows: int) -> None:
    """`rows` conversations of the embedded generator, written a chunk at a time (each chunk its own seed)."""
    from hfdist.data.default import generate_conversations

    with open(path, "w") as f:
        for chunk, start in enumerate(range(0, rows, _CHUNK)):
            n = min(_CHUNK, rows - start)
            f.writelines(json.dumps(c) + "\n" for c in generate_conversations(3 * n, seed=12 + chunk)[:n])


def _tree(root: int) -> list[int]:
    """`root` and every process below it (the kernel's list of each thread's children: a few small reads)."""
    found, frontier = [], [root]
    while frontier:
        found += frontier
        below = []
        for pid in frontier:
            try:
                for task in os.scandir(f"/proc/{pid}/task"):
                    with open(f"{task.path}/children") as f:
                        below += [int(child) for child in f.read().split()]
            except OSError:
                continue
        frontier = below
    return found


def _rss(pid: int) -> int:
    """A process's resident bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def measure(out: str, sample: str, cmd: list[str]) -> int:
    """Run `cmd`; with `sample` "yes", add up its process tree's RSS every 0.2 s (cheap reads, so the sampling takes
    no core the workers need) and keep the peak; write it, the largest process's peak RSS and the tree's CPU
    seconds to `out`."""
    proc = subprocess.Popen(cmd)
    peak = [0]
    done = threading.Event()

    def run() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], sum(_rss(pid) for pid in _tree(proc.pid)))

    sampler = threading.Thread(target=run, daemon=True)
    if sample == "yes":
        sampler.start()
    code = proc.wait()
    done.set()
    if sample == "yes":
        sampler.join()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # every waited-for descendant: the workers too
    Path(out).write_text(json.dumps({"tree_rss_bytes": peak[0], "largest_process_rss_bytes": usage.ru_maxrss * 1024,
                                     "cpu_seconds": usage.ru_utime + usage.ru_stime}))
    return code


def _prepare(data: Path, folder: Path, rows: int, num_proc: int, args, sample: bool = True) -> dict[str, Any]:
    """One `hfdist prepare` run, measured (its memory sampled when `sample`)."""
    cmd = [sys.executable, "-m", "hfdist.cli", "prepare", "--dataset", str(data), "--seq-len", str(args.seq_len),
           "--eval-fraction", "0.01", "--global-batch-size", "16", "--num-proc", str(num_proc),
           "--prepared-data", str(folder)]
    load = os.getloadavg()[0]
    figures = folder.parent / f"{folder.name}.json"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--measure", str(figures), "yes" if sample else "no", *cmd],
                          cwd=REPO, env=worker_env(1),
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    report = next(line for line in proc.stdout.splitlines() if line.startswith("hfdist: data: "))
    return {"rows": rows, "num_proc": num_proc, "seconds": seconds, "rows_per_s": rows / seconds, "report": report,
            "load_before": load, "command": recorded(cmd), **json.loads(figures.read_text())}


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


def profile(data: Path, folder: Path, args) -> None:
    """Where one process's time goes: cProfile of `hfdist prepare --num-proc 1`, the top functions by own time."""
    import cProfile
    import pstats

    from hfdist.cli import main as hfdist

    argv = ["prepare", "--dataset", str(data), "--seq-len", str(args.seq_len), "--eval-fraction", "0.01",
            "--global-batch-size", "16", "--num-proc", "1", "--prepared-data", str(folder)]
    stats = folder.parent / "profile.out"
    cProfile.runctx("hfdist(argv)", globals(), {"hfdist": hfdist, "argv": argv}, str(stats))
    pstats.Stats(str(stats)).sort_stats("tottime").print_stats(25)


def _gib(n: int) -> str:
    return f"{n / 1024 ** 3:.2f} GiB"


def _markdown(result: dict[str, Any], hardware: str) -> str:
    sizes, speed, phases = result["sizes"], result["speedup"], result["data_phase"]
    base = sizes[0]
    lines = [f"# `hfdist prepare` at growing sizes, then the job's data phase ({hardware})", "",
             f"`{result['command']}`", "",
             f"`{base['command']}` (--dataset: N `messages` rows of 1-3 exchanges; --num-proc {base['num_proc']}), "
             f"--seq-len {result['seq_len']}, 1% held out. Memory: the process tree's peak (the sum of its processes' "
             "RSS, sampled every 0.2 s) and the largest single process's peak RSS. Load average before each run in "
             "the last column (2 cores shared with other jobs: seconds are indicative only).", "",
             "| rows | seconds | CPU seconds | rows/s | tree RSS | largest process | x the first size's tree RSS | "
             "load |", "|---|---|---|---|---|---|---|---|"]
    for s in sizes:
        lines.append(f"| {s['rows']:,} | {s['seconds']:.1f} | {s['cpu_seconds']:.1f} | {s['rows_per_s']:,.0f} | "
                     f"{_gib(s['tree_rss_bytes'])} | {_gib(s['largest_process_rss_bytes'])} | "
                     f"{s['tree_rss_bytes'] / base['tree_rss_bytes']:.2f} | {s['load_before']:.1f} |")
    lines += ["", "| rows | --num-proc 1 rows/s (CPU s) | --num-proc N rows/s (CPU s) | speed-up | load |",
              "|---|---|---|---|---|"]
    for one, many in zip(speed[::2], speed[1::2]):
        lines.append(f"| {one['rows']:,} | {one['rows_per_s']:,.0f} ({one['cpu_seconds']:.1f}) | "
                     f"{many['rows_per_s']:,.0f} ({many['cpu_seconds']:.1f}), N = {many['num_proc']} | "
                     f"{many['rows_per_s'] / one['rows_per_s']:.2f} x | {one['load_before']:.1f} / "
                     f"{many['load_before']:.1f} |")
    lines += ["", sizes[-1]["report"], "",
              f"The job's data phase on the largest prepared folder (hfdist.job.data.job_data: settings checked, train "
              f"and eval blocks memory-mapped; {phases[0]['train_blocks']:,} + {phases[0]['eval_blocks']:,} blocks), "
              f"{len(phases)} fresh processes: median {statistics.median(p['with_import_s'] for p in phases):.2f} s "
              f"with datasets' import (max {max(p['with_import_s'] for p in phases):.2f} s), "
              f"{statistics.median(p['without_import_s'] for p in phases):.2f} s without."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="100000,400000,1600000", help="Comma-separated dataset sizes, smallest first.")
    p.add_argument("--speedup-rows", default="100000,400000",
                   help="Comma-separated dataset sizes of the --num-proc 1 vs N comparison.")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="Fresh processes timing the job's data phase.")
    p.add_argument("--profile", action="store_true", help="Print a profile of one process instead of measuring.")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    if len(sys.argv) > 3 and sys.argv[1] == "--measure":
        raise SystemExit(measure(sys.argv[2], sys.argv[3], sys.argv[4:]))
    args = p.parse_args()
    if args.worker:
        return worker(args)
    command = recorded([sys.executable, *sys.argv])
    sizes = [int(n) for n in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        speed_sizes = [int(n) for n in args.speedup_rows.split(",")]
        if args.profile:
            _write_rows(root / "rows.jsonl", speed_sizes[0])
            return profile(root / "rows.jsonl", root / "prepared", args)
        measured = []
        for n in sizes:
            _write_rows(root / f"rows-{n}.jsonl", n)
            measured.append(_prepare(root / f"rows-{n}.jsonl", root / f"prepared-{n}", n, args.num_proc, args))
            if n != sizes[-1]:  # the disk is shared: keep only what the later steps read
                (root / f"rows-{n}.jsonl").unlink()
                shutil.rmtree(root / f"prepared-{n}")
        speedup = []
        for n in speed_sizes:
            _write_rows(root / "speed.jsonl", n)
            for k in (1, args.num_proc):
                speedup.append(_prepare(root / "speed.jsonl", root / f"speed-{n}-{k}", n, k, args, sample=False))
                shutil.rmtree(root / f"speed-{n}-{k}")
        largest = root / f"prepared-{sizes[-1]}"
        phases = [_data_phase(largest, root / f"rows-{sizes[-1]}.jsonl", args) for _ in range(args.repeats)]
    result = {"command": command, "seq_len": args.seq_len, "sizes": measured, "speedup": speedup,
              "data_phase": phases}
    from hfdist.report.matrix import hardware_name

    out = results_dir(args.out, MEASURED_ON)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prepare.json").write_text(json.dumps(result, indent=2))
    (out / "prepare.md").write_text(_markdown(result, hardware_name(MEASURED_ON)))
    print((out / "prepare.md").read_text())


if __name__ == "__main__":
    main()
