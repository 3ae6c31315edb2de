"""Simulation at scale (issue 13): `hfdist simulate` for Llama-3.1 8B / 70B / 405B on 8, 64 and 512 ranks over
the mesh rungs, each cell's per-rank state bytes against the planner's, verification, and its seconds.

    python benchmarks/bench_simulate.py          # writes results/simulate/scale.{json,md}

Each cell is hfdist.plan.simulate.simulate in this process (what `hfdist simulate` runs; its command is recorded
per cell), so the seconds are the simulation's own: the meta build, the recipe for every pipeline stage under a
fake process group, verification and an AdamW step on the meta shards, without the interpreter's start and imports.
A layout the world cannot hold (3d with tp 8 x pp 4 on 8 ranks) is recorded with the one-paragraph refusal the
command gives.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from measure import REPO, recorded

MODELS = ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b")
WORLDS = (8, 64, 512)
# (rung, its flags); 3d at pp 8 needs 8 micro-batches for 1F1B.
LAYOUTS = (("fsdp_full_shard", ()), ("fsdp_hybrid", ()), ("fsdp_tp", ("--tp", "8")),
           ("3d", ("--tp", "8", "--pp", "4")), ("3d", ("--tp", "8", "--pp", "8", "--pp-microbatches", "8")))
TOLERANCE = 0.02


def _flags(flags: tuple[str, ...]) -> dict:
    names = {"--tp": "tp", "--pp": "pp", "--pp-microbatches": "pp_microbatches"}
    return {names[k]: int(v) for k, v in zip(flags[::2], flags[1::2])}


def run_cell(model: str, config: str, world: int, flags: tuple[str, ...]) -> dict:
    """One simulation; the refusal's message instead when the layout cannot exist on `world` ranks."""
    from hfdist.errors import HfdistError
    from hfdist.models.presets import load_config
    from hfdist.plan.simulate import simulate, simulation_rung

    command = recorded(["python", "-m", "hfdist.cli", "simulate", "--model", model, "--config", config,
                        "--num-processes", str(world), *flags])
    cell = {"model": model, "config": config, "num_processes": world, "flags": " ".join(flags), "command": command}
    try:
        rung = simulation_rung(config, world, model_config=load_config(model), **_flags(flags))
    except HfdistError as exc:
        return {**cell, "refused": str(exc)}
    sim = simulate(model, rung)
    out = sim.to_json()
    return {**cell, **out, "max_relative_error": max(r["relative_error"] for r in out["ranks"])}


def _gb(x: int) -> str:
    return f"{x / 1e9:.3f}"


def markdown(cells: list[dict], command: str, load: str) -> str:
    """The results table: one row per cell, the worst pipeline stage's bytes (the one a GPU must fit)."""
    lines = ["# `hfdist simulate` at scale: Llama-3.1 8B / 70B / 405B on 8, 64 and 512 ranks", "",
             f"Command: `{command}` (each row's own command: `python -m hfdist.cli simulate ...` with the row's "
             "model, rung, ranks and flags; see scale.json).", "",
             "The real parallelize recipe (TP -> pipeline split -> FSDP2) on a meta model under torch's fake process "
             "group, one rank per pipeline stage (rank = stage x tp), verified with hfdist.parallel.verify; "
             "params / grads / optimizer (Adam's moments) are the rank's local shard bytes (fp32, bf16 compute). "
             "'predicted' is hfdist.plan.predict_state_bytes for the same stage. The row shows the stage with the "
             f"most parameter bytes; `error` is the largest relative error over every stage and component "
             f"(tolerance {TOLERANCE:.0%}). Seconds: the simulation alone, in one process ({load}).", "",
             "| model | rung | ranks | layout | verify | params GB | grads GB | optim GB | predicted p/g/o GB | "
             "error | s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        name = c["model"].removeprefix("llama-3.1-")
        rung = f"{c['config']} {c['flags']}".strip()
        if "refused" in c:
            lines.append(f"| {name} | {rung} | {c['num_processes']} | refused: {c['refused']} | | | | | | | |")
            continue
        worst = max(c["ranks"], key=lambda r: r["param_bytes"])
        p = worst["predicted"]
        layout = " x ".join(f"{k}={v}" for k, v in c["dims"].items() if v > 1)
        lines.append(f"| {name} | {rung} | {c['num_processes']} | {layout} | "
                     f"{'pass' if c['verified'] else 'FAIL'} | {_gb(worst['param_bytes'])} | "
                     f"{_gb(worst['grad_bytes'])} | {_gb(worst['optimizer_bytes'])} | "
                     f"{_gb(p['param_bytes'])}/{_gb(p['grad_bytes'])}/{_gb(p['optimizer_bytes'])} | "
                     f"{c['max_relative_error']:.3%} | {c['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "results" / "simulate", help="default: results/simulate")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated presets")
    args = p.parse_args(argv)
    command = recorded(["python", "benchmarks/bench_simulate.py", *argv])
    load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the start"
    cells = []
    for model in args.models.split(","):
        for config, flags in LAYOUTS:
            for world in WORLDS:
                cell = run_cell(model, config, world, flags)
                cells.append(cell)
                status = cell.get("refused") or (f"verified={cell['verified']} error="
                                                 f"{cell['max_relative_error']:.3%} {cell['seconds']:.1f} s")
                print(f"{model} {config} {' '.join(flags)} N={world}: {status}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    bad = [c for c in cells if "refused" not in c and (not c["verified"] or c["max_relative_error"] >= TOLERANCE)]
    (args.out / "scale.json").write_text(json.dumps(
        {"command": command, "machine": platform.machine(), "load": load,
         "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cells": cells}, indent=2) + "\n")
    (args.out / "scale.md").write_text(markdown(cells, command, load))
    print(f"wrote {args.out / 'scale.md'}; {len(bad)} cells failed verification or the {TOLERANCE:.0%} tolerance")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
