"""Run rungs of the ladder on the same model, data, sequence length and global batch; write the comparison matrix.

    hfdist compare                                  # every shipped rung, embedded default, results/<hardware>/
    hfdist compare --configs ddp fsdp_full_shard zero3 --lora --max-steps 30
    hfdist compare --configs ddp fsdp_full_shard zero3 --qlora    # + a QLoRA row for each rung that takes it
    python scripts/compare.py ...                   # the same, from a clone

Each rung runs as `hfdist finetune` (`python -m hfdist.cli finetune`: its own world, its own W&B run in one group),
so this works wherever hfdist is installed; paths count from the working directory. The matrix is built from the
runs' hfdist_summary.json files only (hfdist.report.matrix): results/<hardware>/matrix.md, matrix.csv,
memory.png, throughput.png, plus a W&B table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

__all__ = ["add_arguments", "build_parser", "run_comparison"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The comparison's options (`hfdist compare` and scripts/compare.py share them)."""
    from hfdist.config.finetune import FP8_RECIPES, OBJECTIVES
    from hfdist.config.ladder import known_rung_names

    g = p.add_argument_group("Rungs and workload", "Every rung runs the same model, data and global batch.")
    g.add_argument("--configs", nargs="+", default=known_rung_names(),
                   help="Rungs to run, in this order (default: every shipped rung).")
    g.add_argument("--model", default="llama-small", help="HF id, local folder or preset (default llama-small).")
    g.add_argument("--lora", action="store_true", help="Train LoRA adapters instead of all weights.")
    g.add_argument("--fp8", nargs="?", const=FP8_RECIPES[0], default=None, choices=FP8_RECIPES, metavar="RECIPE",
                   help="Every rung with float8 matmuls (hfdist finetune --fp8; tensorwise or rowwise); leave the "
                        "rungs that refuse it (DeepSpeed, fsdp_cp) out of --configs.")
    g.add_argument("--qlora", action="store_true",
                   help="Also train QLoRA (LoRA on a 4-bit base) on every listed rung that takes --qlora: rows "
                        "+qlora beside the full fine-tune (or --lora) rows.")
    g.add_argument("--objective", choices=OBJECTIVES, default="sft",
                   help="What every rung trains, as `hfdist finetune --objective` (default sft); the rungs that do not "
                        "take dpo / grpo are refused before any run (docs/objectives.md).")
    g.add_argument("--max-steps", type=int, default=20, help="Optimizer steps per rung (default 20).")
    g.add_argument("--global-batch-size", type=int, default=16, help="Sequences per step over all ranks (default 16).")
    g.add_argument("--seq-len", type=int, default=128, help="Tokens per sequence (default 128).")
    g.add_argument("--attn-implementation", default="auto", metavar="NAME",
                   help="Attention of every run, as `hfdist finetune --attn-implementation` (default auto); the "
                        "matrix records what each run resolved it to.")
    g.add_argument("--eval-fraction", type=float, default=None, metavar="F",
                   help="Hold out this share of the data and evaluate every rung on it at the end (the matrix's "
                        "eval_loss column; default: no evaluation).")
    g = p.add_argument_group("Output")
    g.add_argument("--out", type=Path, default=None, help="Matrix folder (default results/<hardware>).")
    g.add_argument("--runs-dir", type=Path, default=None, help="Where the runs write (default outputs/compare/<id>).")
    g.add_argument("--compare-id", default=None, help="W&B group of the runs (default: a new id).")


def _runs(configs: list[str], qlora: bool) -> list[tuple[str, str, list[str]]]:
    """(label, rung, extra arguments) of every run: each rung as asked, and under `qlora` its QLoRA run beside it
    where the rung table says the rung takes --qlora."""
    from hfdist.config.features import refuse_unless
    from hfdist.config.finetune import ConfigError
    from hfdist.config.ladder import load_rung

    runs = []
    for name in configs:
        runs.append((name, name, []))
        if qlora:
            try:
                refuse_unless(load_rung(name), "qlora")
            except ConfigError:
                continue
            runs.append((f"{name}-qlora", name, ["--qlora"]))
    return runs


def build_parser() -> argparse.ArgumentParser:
    """The comparison's command line (scripts/compare.py)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def run_comparison(args: argparse.Namespace, command: str) -> int:
    """Run the comparison `args` describe (see add_arguments); `command` is how it was invoked, recorded with the
    matrix. Returns the exit code."""
    from hfdist.callbacks.wandb_sink import WandbSink, sync_instructions
    from hfdist.errors import run_with_clear_errors
    from hfdist.report.matrix import COLUMNS, hardware_name, load_rows, objective_note, write_matrix

    compare_id = args.compare_id or f"compare-{uuid.uuid4().hex[:8]}"
    hardware = hardware_name()
    out = args.out or Path("results") / hardware
    runs_dir = args.runs_dir or Path("outputs") / "compare" / compare_id
    shared = ["--model", args.model, "--max-steps", str(args.max_steps), "--global-batch-size",
              str(args.global_batch_size), "--seq-len", str(args.seq_len), "--compare-id", compare_id,
              "--attn-implementation", args.attn_implementation]
    if args.lora:
        shared.append("--lora")
    if args.fp8:
        shared += ["--fp8", args.fp8]
    if args.eval_fraction:
        shared += ["--eval-fraction", str(args.eval_fraction)]
    if args.objective != "sft":
        shared += ["--objective", args.objective]

    runs = _runs(args.configs, args.qlora)

    def job() -> int:
        import torch

        from hfdist.models.attention import resolve_attention

        resolve_attention(args.attn_implementation, on_gpu=torch.cuda.is_available())  # refused before any run
        if args.objective != "sft":
            from hfdist.config.features import refuse_unless
            from hfdist.config.ladder import load_rung

            for name in dict.fromkeys(name for _, name, _ in runs):
                refuse_unless(load_rung(name), args.objective)
        summaries = []
        for i, (label, name, extra) in enumerate(runs, 1):
            cmd = [sys.executable, "-m", "hfdist.cli", "finetune", "--config", name, *shared, *extra,
                   "--output-dir", str(runs_dir / label)]
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            took = time.perf_counter() - start
            status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
            print(f"[{i}/{len(runs)}] {label}: {status} in {took:.0f}s", flush=True)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            summaries.append(runs_dir / label / "hfdist_summary.json")
        rows = load_rows(summaries)
        trained = f"{' + LoRA' if args.lora else ''}{f' in FP8 ({args.fp8})' if args.fp8 else ''}"
        notes = [f"Measured by `{command.strip()}` (compare id {compare_id}) on {hardware}.",
                 f"Model {args.model}{trained}, global batch {args.global_batch_size} x "
                 f"{args.seq_len} tokens, {args.max_steps} steps; tokens/s per device excludes the first step.",
                 "MFU on CPU is against the measured fp32 matmul peak of one process (hfdist.metrics.flops); "
                 "peak memory is the process's peak RSS on CPU, CUDA max allocated on GPU."]
        if args.objective != "sft":
            notes.append(objective_note(args.objective, rows, summaries))
        if args.qlora:
            notes.append("+qlora rows: LoRA adapters on a 4-bit NF4 base, computing in bf16 (QLoRA's compute "
                         "dtype); the other rows in their rung's precision (fp32 on CPU). Rungs that do not take "
                         "--qlora have no such row (docs/qlora.md).")
        cores = os.cpu_count() or 1
        crowded = [r["strategy"] for r in rows if hardware.startswith("cpu") and r["world_size"] > cores]
        if crowded:
            notes.append(f"{', '.join(crowded)} run more processes than this machine has cores ({cores}): their "
                         "per-device rates share cores and are not comparable with the others'.")
        written = write_matrix(rows, out, hardware, notes)
        sink = WandbSink(output_dir=runs_dir, active=True, name="matrix", group=compare_id, job_type="matrix")
        sink.log_table("matrix", list(COLUMNS), [[r[c] for c in COLUMNS] for r in rows])
        sink.finish()
        print("\n".join(f"wrote {p}" for p in written))
        if sink.mode == "online" and sink.error is None:
            from hfdist.report.wandb_report import build_comparison_report

            try:
                print(f"W&B report: {build_comparison_report(sink.project, compare_id)}")
            except Exception as exc:  # the matrix is written; a report is a view of it
                print(f"hfdist: warning: could not build the W&B report ({exc}); the runs are in group {compare_id}")
        else:
            print(sync_instructions(sorted(runs_dir.glob("*/wandb/offline-run-*")) +
                                    sorted(runs_dir.glob("wandb/offline-run-*")), group=compare_id))
        return 0

    return run_with_clear_errors(job)
