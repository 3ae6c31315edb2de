"""What every benchmark shares: where results go, how workers are launched, how commands are recorded.

Measurement readers themselves (peak / current memory, saved-activation bytes, live tensor bytes, FLOPs, MFU) live
in the library (hfdist.metrics), so the benchmarks, the tests and the training callbacks read memory the same way.
Commands are recorded with repository-relative paths and `python`, so a result names a command anyone can rerun
from the repository root.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

__all__ = ["REPO", "results_dir", "worker_env", "torchrun", "recorded", "gather"]


def results_dir(out: Path | None, measured_on: str | None) -> Path:
    """`out`, or results/<hardware> of the repository, named after the device the benchmark measured (each
    benchmark's MEASURED_ON): "cpu" for workers that run gloo on CPU tensors, results/cpu-<cores>core on any machine
    (a GPU host's included); None for what runs where hfdist's job trains, the GPUs when the machine has any
    (hfdist.report.matrix.hardware_name)."""
    from hfdist.report.matrix import hardware_name

    return out or REPO / "results" / hardware_name(measured_on)


def worker_env(threads: int = 1) -> dict[str, str]:
    """The environment of a benchmark worker: fixed thread count, offline, the repository importable."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def torchrun(nproc: int, script: Path, *args: str) -> list[str]:
    """A torchrun command on `nproc` local ranks (--standalone: torchrun picks a free rendezvous port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            str(script), *args]


def recorded(cmd: list[str], env: dict[str, str] | None = None) -> str:
    """`cmd` as a result records it: `python` for this interpreter, paths relative to the repository, temporary
    files as <tmp>/..., and OMP_NUM_THREADS when set."""
    tmp = tempfile.gettempdir()

    def clean(arg: str) -> str:
        if arg == sys.executable:
            return "python"
        for root, name in ((str(REPO) + os.sep, ""), (tmp + os.sep, "<tmp>/")):
            arg = arg.replace(root, name)
        return arg

    prefix = [f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"] if env and "OMP_NUM_THREADS" in env else []
    return shlex.join([*prefix, *(clean(a) for a in cmd)])


def gather(value: object) -> list:
    """`value` from every rank, in rank order, on every rank (inside a worker's process group)."""
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
