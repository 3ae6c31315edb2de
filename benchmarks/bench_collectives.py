"""What one collective of tensor parallelism costs on this machine's backend, per call.

    python benchmarks/bench_collectives.py    # writes results/<hardware>/collectives.{json,md}

Sequence parallelism replaces each block's all-reduce by an all-gather + reduce-scatter pair: on NCCL the pair moves
the same bytes as the all-reduce; on gloo it need not, so this measures the three on the residual stream of
benchmarks/bench_tp_native.py (batch x seq x hidden fp32, the full tensor for all-reduce and reduce-scatter, one
rank's 1/world of it for all-gather), 2 processes, alternating rounds, the median per-call time of each round.
Run by itself it launches 2 ranks with torchrun (gloo on CPU, NCCL where CUDA is available) and writes the result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import recorded, results_dir, torchrun, worker_env

# results/<hardware> names the GPUs where there are any: the ranks run NCCL on them there, else gloo.
MEASURED_ON = None

OPS = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=int, nargs=3, default=[8, 128, 256], metavar=("BATCH", "SEQ", "HIDDEN"),
                   help="the residual stream's shape (default: bench_tp_native's llama-small batch)")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds of every collective")
    p.add_argument("--calls", type=int, default=50, help="timed calls per collective per round")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # set when torchrun runs this file
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/<hardware>)")
    return p.parse_args()


def worker(args: argparse.Namespace) -> None:
    """In each rank: time every collective, round by round; rank 0 writes {op: [median us per round]}."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    full = torch.randn(*args.shape, device=device)
    part = torch.empty(args.shape[0] // world, *args.shape[1:], device=device)
    calls = {"all_reduce": lambda: dist.all_reduce(full),
             "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(part, full),
             "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, part)}
    rounds: dict[str, list[float]] = {op: [] for op in OPS}
    for _ in range(args.rounds):
        for op in OPS:
            times = []
            for _ in range(args.calls + 5):  # the first 5 calls of a round warm the connection up, untimed
                dist.barrier()
                start = time.perf_counter()
                calls[op]()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            rounds[op].append(statistics.median(times[5:]) * 1e6)
    if dist.get_rank() == 0:
        args.worker.write_text(json.dumps({"backend": dist.get_backend(), "world": world, "rounds_us": rounds}))
    dist.destroy_process_group()


def main() -> int:
    args = parse_args()
    if args.worker is not None:
        worker(args)
        return 0
    base = [*map(str, ["--shape", *args.shape, "--rounds", args.rounds, "--calls", args.calls])]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out_json = Path(tmp) / "rank0.json"
        subprocess.run(torchrun(2, Path(__file__), *base, "--worker", str(out_json)), env=worker_env(), check=True)
        measured = json.loads(out_json.read_text())
    medians = {op: statistics.median(us) for op, us in measured["rounds_us"].items()}
    megabytes = 4 * args.shape[0] * args.shape[1] * args.shape[2] / 2**20
    result = {"command": recorded([sys.executable, "benchmarks/bench_collectives.py", *sys.argv[1:]]),
              **measured, "shape": args.shape, "full_tensor_mib": megabytes, "median_us": medians,
              "load_average": {"before": list(load_before), "after": list(os.getloadavg())}, "cpu_count": os.cpu_count()}
    out = results_dir(args.out, MEASURED_ON)
    out.mkdir(parents=True, exist_ok=True)
    (out / "collectives.json").write_text(json.dumps(result, indent=1) + "\n")
    rows = "\n".join(f"| {op} | {medians[op]:,.0f} | {', '.join(f'{v:,.0f}' for v in measured['rounds_us'][op])} |"
                     for op in OPS)
    load = result["load_average"]
    (out / "collectives.md").write_text(
        f"# Collective cost per call ({out.name})\n\n`{result['command']}`\n\n"
        f"{measured['world']} ranks, {measured['backend']}, tensor {'x'.join(map(str, args.shape))} fp32 "
        f"({megabytes:.2f} MiB; all-gather sends 1/{measured['world']} of it from each rank), {args.calls} timed calls "
        f"per collective per round, {args.rounds} alternating rounds (each a median of its calls, a barrier before "
        "every call).\n\n| collective | median of rounds, us per call | rounds |\n|---|---|---|\n"
        f"{rows}\n\nreduce-scatter / all-reduce: **{medians['reduce_scatter_tensor'] / medians['all_reduce']:.2f}**; "
        f"(all-gather + reduce-scatter) / all-reduce: **"
        f"{(medians['all_gather_into_tensor'] + medians['reduce_scatter_tensor']) / medians['all_reduce']:.2f}** "
        "(sequence parallelism's pair per block against the all-reduce it replaces).\n\n"
        f"Load average (1/5/15 min) on {result['cpu_count']} cores: "
        f"{' / '.join(f'{v:.2f}' for v in load['before'])} before, {' / '.join(f'{v:.2f}' for v in load['after'])} "
        "after.\n")
    print(f"wrote {out / 'collectives.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
