"""The GPU suite's report (benchmarks/gpu/suite.py), rewritten after every cell so a part cut short keeps what it
measured: gpu_suite.md (one row per cell), gpu_suite.json, gpu_suite_commands.sh and, from the ladder's cells, the
strategy matrix (hfdist.report.matrix)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from cells import Cell, Shape

GiB = 2**30
_COLUMNS = ("cell", "tokens/s per device", "MFU", "peak GiB", "planned GiB", "peak / planned", "loss first -> last",
            "wall s", "exit")


def _row(cell: Cell, record: dict | None) -> list[str]:
    if record is None:
        return [cell.name, *["not run yet"] + [""] * (len(_COLUMNS) - 2)]
    if "kernels" in record:
        ring, hybrid, moe = (record["kernels"]["attention"]["ring"], record["kernels"]["attention"]["hybrid"],
                             record["kernels"]["moe"])
        what = (f"ring blocks {ring['blocks_over_flash']:.2f} x, hybrid {hybrid['blocks_over_flash']:.2f} x one flash "
                f"call at {ring['seq']} tokens; MoE loop {moe['loop_over_grouped']:.2f} x grouped GEMM")
        return [cell.name, what, *[""] * (len(_COLUMNS) - 4), str(record["wall_s"]), str(record["exit"])]
    if record["exit"] != 0 or "rows" in record:
        what = f"{len(record['rows'])} rungs: matrix.md" if "rows" in record else record["error"].splitlines()[-1][:160]
        return [cell.name, what, *[""] * (len(_COLUMNS) - 4), str(record["wall_s"]), str(record["exit"])]
    planned = (record.get("planned") or {}).get("bytes")
    peak = record["peak_memory_bytes"]
    losses = record["losses"]
    return [cell.name, f"{record['tokens_per_s_per_device']:,.0f}", f"{100 * record['mfu']:.1f}%",
            f"{peak / GiB:.2f}", f"{planned / GiB:.2f}" if planned else "", f"{peak / planned:.2f}" if planned else "",
            f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "", str(record["wall_s"]), "0"]


def _environment(gpus: int) -> list[str]:
    import torch

    device = torch.cuda.get_device_name(0) if gpus else f"CPU ({os.cpu_count()} cores)"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return [f"Device: {gpus or 'no'} x {device}; torch {torch.__version__}; Python {platform.python_version()}; "
            f"written {time.strftime('%Y-%m-%d %H:%M')} at load {load:.1f}."]


def write_report(out: Path, cells: list[Cell], done: dict[str, dict], shape: Shape, gpus: int) -> None:
    """Write the suite's files into `out` from the records of the cells run so far."""
    lines = ["# GPU suite: hfdist against a plain Trainer and TRL", "",
             "Written by `bash benchmarks/gpu/run.sh` (benchmarks/gpu/suite.py; the cells: benchmarks/gpu/cells.py).",
             *_environment(gpus),
             f"Model {shape.model} (seeded weights, the embedded conversations), bf16, {shape.steps} steps of "
             f"{shape.global_batch} sequences per device (one per forward), tokens/s per device leaving out the first "
             "step; MFU against the device's bf16 peak (also for --fp8 runs); peak memory is CUDA's max allocated "
             "(the process's peak RSS on CPU), planned is `hfdist plan` for the same rung and workload. The plain "
             "Trainer and TRL read their figures with hfdist's callback; they pack the text without hfdist's "
             "document masks.", "",
             "| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_row(c, done.get(c.name))) + " |" for c in cells]
    lines += ["", "Commands (from the repository root):", "", "```bash",
              *(done[c.name]["command"] for c in cells if c.name in done), "```"]
    (out / "gpu_suite.md").write_text("\n".join(lines) + "\n")
    (out / "gpu_suite.json").write_text(json.dumps({"cells": [done.get(c.name, {"name": c.name}) for c in cells]},
                                                   indent=2))
    (out / "gpu_suite_commands.sh").write_text(
        "# Every command the GPU suite ran, from the repository root (benchmarks/gpu/run.sh).\n"
        + "\n".join(done[c.name]["command"] for c in cells if c.name in done) + "\n")
    ladder = [row for c in cells if "rows" in done.get(c.name, {}) for row in done[c.name]["rows"]]
    if ladder:
        from hfdist.report.matrix import write_matrix

        write_matrix(ladder, out, out.name, [f"The ladder of `bash benchmarks/gpu/run.sh` ({shape.model}, bf16 and "
                                             "--fp8, global batch = 4 x devices); commands in gpu_suite_commands.sh."])
