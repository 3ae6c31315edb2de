"""The GPU suite behind `bash benchmarks/gpu/run.sh`: every cell of benchmarks/gpu/cells.py on the GPUs visible, in
parts that each fit one command of a lent machine (under 9 minutes), resuming where the last part stopped.

    bash benchmarks/gpu/run.sh                 # the next part not yet run (run it again until it says done)
    bash benchmarks/gpu/run.sh --all           # every remaining part, one after another
    bash benchmarks/gpu/run.sh --list          # the parts and their cells (--gpus N: as N GPUs would run them)
    bash benchmarks/gpu/run.sh --dry-run --all --out /tmp/suite   # the CPU stand-in (tiny shapes, a few steps)

It writes results/<gpu>/gpu_suite.md (the table: tokens/s per device, MFU, peak memory against `hfdist plan`, loss;
the plain Trainer and TRL baselines beside hfdist's runs), gpu_suite.json (the same, and every cell's command),
gpu_suite_commands.sh (every command, rerunnable from the repository root) and, on two or more GPUs, the ladder's
matrix (matrix.md / .csv / .png through `hfdist compare`). gpu_suite_state.json records the finished cells: a run
of the script skips them, so a part cut short (the machine given back) loses only the cell it was in. The runs'
own folders (models, logs) go under outputs/gpu_suite/ and their weights are deleted once read (a 1B model is 5 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: measure.py

from cells import DRY_RUN, FIRST_PART_S, GPU, Cell, Shape, suite_cells  # noqa: E402
from measure import REPO, recorded  # noqa: E402

PART_BUDGET_S = 500  # a lent machine runs one command for at most 10 minutes; start-up and the report take the rest
END_GRACE_S = 10  # a timed-out cell's ranks get this long to leave after SIGTERM (its results are not kept)


def _finetune_takes(flag: str) -> bool:
    from hfdist.config.finetune import build_parser

    return any(flag in action.option_strings for action in build_parser()._actions)


def _planned(cell: Cell, shape: Shape, gpus: int, mem: int) -> dict | None:
    """`hfdist plan`'s prediction for the cell's rung and workload on this device: bytes per device, fits."""
    from hfdist.config.ladder import load_rung
    from hfdist.models.presets import load_config
    from hfdist.plan import plan_rungs

    if cell.kind != "hfdist":
        return None
    rung = "fsdp_full_shard" if "--config" in cell.args else "ddp"  # single: the planner's 1-process ddp
    plan = plan_rungs(load_config(cell.model), [load_rung(rung)], gpus_per_node=gpus if rung != "ddp" else 1,
                      gpu_mem_bytes=mem, seq=cell.seq, micro_batch=1, lora=cell.lora,
                      activation_checkpointing=cell.checkpointing, dtype="bf16", fp8=cell.fp8, model=cell.model)
    found = plan.rungs[0]
    return {"bytes": found.bytes.total if found.bytes else None, "fits": found.fits}


def _cells(shape: Shape, gpus: int, dry_run: bool, mem: int) -> list[Cell]:
    """The suite for this machine, asking the planner what the long sequence and the 8B shape need."""
    short, long = shape.seqs
    probe = Cell("probe", "hfdist", (), long, shape.model)
    needs_ckpt = not _planned(probe, shape, 1, mem)["fits"]
    big = Cell("probe", "hfdist", (), short, shape.big or shape.model, lora=True, checkpointing=True)
    big_fits = bool(shape.big) and _planned(big, shape, 1, mem)["fits"]
    return suite_cells(shape, gpus, dry_run, _finetune_takes("--attn-implementation"), needs_ckpt, big_fits)


def parts(cells: list[Cell], budget_s: int = PART_BUDGET_S, first_s: int | None = FIRST_PART_S) -> list[list[Cell]]:
    """The cells in order, cut into parts whose estimates add up to at most `budget_s` (a longer cell alone), the
    first to at most `first_s` (the headline figures early in a lent machine's time; None: `budget_s`)."""
    out: list[list[Cell]] = [[]]
    for cell in cells:
        limit = min(budget_s, first_s) if len(out) == 1 and first_s is not None else budget_s
        if out[-1] and sum(c.estimate_s for c in out[-1]) + cell.estimate_s > limit:
            out.append([])
        out[-1].append(cell)
    return out


def _assets(shape: Shape, runs: Path) -> tuple[Path, Path]:
    """The 1B-class model (seeded weights) with hfdist's embedded tokenizer as a HF folder the baselines load, and
    the embedded conversations as text: made once."""
    from hfdist.data import load_raw_dataset, load_tokenizer
    from hfdist.models.build import build_model

    folder = runs / f"assets-{shape.model}"
    model, data = folder / "model", folder / "text.jsonl"
    if not (model / "config.json").is_file():
        tokenizer = load_tokenizer(None, is_preset=True)
        build_model(shape.model, vocab_size=len(tokenizer), seed=0).save_pretrained(model)
        tokenizer.save_pretrained(model)
        with data.open("w") as f:
            for row in load_raw_dataset(None):
                f.write(json.dumps({"text": "\n".join(f"{m['role']}: {m['content']}" for m in row["messages"])}) + "\n")
    return model, data


def command(cell: Cell, shape: Shape, gpus: int, out: Path, runs: Path) -> list[str]:
    """The cell's command line (bf16, the shape's steps, one sequence per forward, the global batch per device)."""
    run = runs / cell.name
    batch = shape.global_batch * (gpus if cell.kind == "compare" or "--config" in cell.args else 1)
    if cell.kind == "hfdist":
        return [sys.executable, "-m", "hfdist.cli", "finetune", "--model", cell.model, *cell.args,
                "--seq-len", str(cell.seq), "--max-steps", str(shape.steps), "--global-batch-size", str(batch),
                "--micro-batch-size", "1", "--mixed-precision", "bf16", "--save-steps", "0", "--no-save-model",
                "--no-wandb", "--overwrite", "--output-dir", str(run)]
    if cell.kind == "compare":
        return [sys.executable, "-m", "hfdist.cli", "compare", "--model", cell.model, *cell.args,
                "--seq-len", str(cell.seq), "--max-steps", str(shape.steps), "--global-batch-size", str(batch),
                "--out", str(out / cell.name), "--runs-dir", str(run)]
    if cell.kind == "kernels":
        return [sys.executable, str(Path(__file__).with_name("kernels.py")), "--out", str(run / "figures.json"),
                *(("--dry-run",) if shape is DRY_RUN else ())]
    model, data = _assets(shape, runs)
    return [sys.executable, str(Path(__file__).with_name("baseline.py")), "--trainer", cell.kind,
            "--model", str(model), "--data", str(data), "--output-dir", str(run), "--figures", str(run / "figures.json"),
            "--seq-len", str(cell.seq), "--steps", str(shape.steps), "--batch", "1",
            "--grad-accum", str(shape.global_batch), "--bf16"]


def _figures(run: Path, cell: Cell) -> dict:
    """Tokens/s per device (mean over ranks; tp x pp ranks share one batch), MFU, peak memory (max over ranks) and
    losses of a finished cell, from its run's own records in `run`."""
    if cell.kind == "kernels":
        return {"kernels": json.loads((run / "figures.json").read_text())}
    if cell.kind == "compare":
        from hfdist.report.matrix import load_rows

        rows = load_rows(sorted(run.glob("*/hfdist_summary.json")))
        return {"rows": rows}
    if cell.kind == "hfdist":
        summary = json.loads((run / "hfdist_summary.json").read_text())
        ranks, share = summary["ranks"], summary["strategy"]["tp"] * summary["strategy"]["pp"]
        losses = summary["losses"]
    else:
        record = json.loads((run / "figures.json").read_text())
        ranks, share, losses = record["ranks"], 1, record["losses"]
    return {"tokens_per_s_per_device": sum(r["tokens_per_second"] for r in ranks) / len(ranks) / share,
            "mfu": sum(r.get("mfu") or 0.0 for r in ranks) / len(ranks),
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ranks), "losses": losses}


def _drop_weights(run: Path) -> None:
    """A run's saved weights are not a result: deleted once read (disk, and the next cell's time)."""
    for path in run.rglob("*.safetensors"):
        path.unlink()
    for path in run.rglob("checkpoint-*"):
        shutil.rmtree(path, ignore_errors=True)


def run_cell(cell: Cell, shape: Shape, gpus: int, out: Path, runs: Path, env: dict[str, str],
             timeout_s: float) -> dict:
    """Run one cell, return its record: command, exit code ("timeout" when cut off: the cell is ended with every
    process it started, its ranks included), wall seconds, figures (or the last lines it printed)."""
    from hfdist.processes import run_logged

    cmd = command(cell, shape, gpus, out, runs)
    run = runs / cell.name
    run.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    log_path = runs / f"{cell.name}.log"
    exit_code = run_logged(cmd, log_path, timeout=timeout_s, grace=END_GRACE_S, env=env, cwd=REPO)
    code = "timeout" if exit_code is None else exit_code
    log = log_path.read_text(errors="replace")
    record = {"name": cell.name, "kind": cell.kind, "command": recorded(cmd), "exit": code,
              "wall_s": round(time.perf_counter() - start, 1)}
    if code == 0:
        record.update(_figures(run, cell))
    else:  # a refusal (exit 2) is a result too: what hfdist says it cannot run here
        record["error"] = "\n".join(log.strip().splitlines()[-6:]) or f"exit {code}"
    _drop_weights(run)
    return record


def main(argv: list[str] | None = None) -> int:
    from report import write_report

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU stand-in: tiny shapes, a few steps (the test's mode)")
    p.add_argument("--part", type=int, default=None, help="run this part (1-based) only, finished cells skipped")
    p.add_argument("--all", action="store_true", help="run every remaining part")
    p.add_argument("--list", action="store_true", help="print the parts and their cells, run nothing")
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/<gpu>)")
    p.add_argument("--runs", type=Path, default=REPO / "outputs" / "gpu_suite",
                   help="where the runs write (default outputs/gpu_suite; their weights are deleted once read)")
    p.add_argument("--budget-s", type=int, default=PART_BUDGET_S, help="wall seconds of one part (default %(default)s)")
    p.add_argument("--gpus", type=int, default=None,
                   help="with --list: the parts this many GPUs would run (default: the GPUs visible)")
    args = p.parse_args(argv)
    import torch

    from hfdist.report.matrix import hardware_name

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    gpus = 0 if args.dry_run else torch.cuda.device_count()
    if args.list and args.gpus is not None and not args.dry_run:
        gpus = args.gpus
    if not gpus and not args.dry_run:
        print("benchmarks/gpu/run.sh: no GPU visible. On a CPU, --dry-run runs the suite's CPU stand-in.",
              file=sys.stderr)
        return 2
    shape = DRY_RUN if args.dry_run else GPU
    mem = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() and gpus else 80 * 10**9
    out = args.out or REPO / "results" / hardware_name("cuda" if gpus and torch.cuda.is_available() else "cpu")
    cells = _cells(shape, gpus, args.dry_run, mem)
    plan = parts(cells, args.budget_s, None if args.dry_run else FIRST_PART_S)
    state_file = out / "gpu_suite_state.json"
    done = json.loads(state_file.read_text()) if state_file.is_file() else {}
    if args.list:
        for i, part in enumerate(plan, 1):
            names = [f"{c.name}{' (done)' if c.name in done else ''}" for c in part]
            seconds = sum(c.estimate_s for c in part)
            print(f"part {i} (~{seconds} s, {seconds / 60:.1f} min): {', '.join(names)}")
        return 0
    todo = [i for i, part in enumerate(plan, 1) if any(c.name not in done for c in part)]
    chosen = [args.part] if args.part else (todo if args.all else todo[:1])
    out.mkdir(parents=True, exist_ok=True)
    for number in chosen:
        deadline = time.perf_counter() + args.budget_s
        for cell in plan[number - 1]:
            left = deadline - time.perf_counter()
            if cell.name in done or left < min(cell.estimate_s, args.budget_s) / 2:
                continue  # finished, or no time left in this part: the next run of the script takes it
            print(f"gpu suite: part {number}/{len(plan)}: {cell.name} ...", flush=True)
            record = run_cell(cell, shape, gpus, out, args.runs, env, timeout_s=max(left, 60))
            if record["exit"] == "timeout" and left < args.budget_s:
                print(f"gpu suite: {cell.name} ran out of this part's time: the next run starts it afresh", flush=True)
                break
            record["planned"] = _planned(cell, shape, gpus, mem)
            done[cell.name] = record
            state_file.write_text(json.dumps(done, indent=2))
            write_report(out, cells, done, shape, gpus)
            print(f"gpu suite: {cell.name}: exit {record['exit']} in {record['wall_s']} s", flush=True)
    remaining = [c.name for c in cells if c.name not in done]
    print(f"gpu suite: {len(cells) - len(remaining)} of {len(cells)} cells done; "
          + (f"run it again for the next part ({remaining[0]} ...)" if remaining else f"results in {out}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
