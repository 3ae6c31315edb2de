"""The comparison matrix: run summaries (hfdist_summary.json) -> one row per strategy -> CSV, Markdown, PNG plots.

Every figure comes from a run's own measurements; nothing here computes a throughput or a memory figure.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from statistics import mean
from typing import Any, Iterable

from hfdist.errors import HfdistError

__all__ = ["MatrixError", "COLUMNS", "matrix_row", "load_rows", "write_matrix", "hardware_name", "objective_note"]

COLUMNS = ("strategy", "world_size", "dp_replicate", "dp_shard", "tp", "pp", "zero_stage", "lora", "qlora",
           "micro_batch", "global_batch", "seq_len", "attn_implementation", "tokens_per_s_per_device",
           "tflops_per_device", "mfu",
           "peak_mem_max_mb", "peak_mem_min_mb", "param_mb_per_rank", "grad_mb_per_rank", "optimizer_mb_per_rank",
           "final_loss", "final_grad_norm", "eval_loss", "same_math")
_MB = 1e6


class MatrixError(HfdistError, ValueError):
    """No usable run summaries where the matrix was asked to look."""


def hardware_name(device: str | None = None) -> str:
    """A folder name for results measured on `device`: "cuda", the GPU model and count; "cpu", the CPU core count
    (whatever GPUs the machine has: a benchmark whose workers run gloo on CPU tensors measured the CPU). None:
    this machine's GPUs when it has any, else its CPU."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        name = torch.cuda.get_device_name(0).replace("NVIDIA ", "").lower()
        return f"{'-'.join(name.split())}-x{torch.cuda.device_count()}"
    return f"cpu-{os.cpu_count()}core"


def matrix_row(summary: dict[str, Any]) -> dict[str, Any]:
    """One row of the matrix from one run summary (per-rank figures: max over ranks unless named min/mean)."""
    s, ranks = summary["strategy"], summary["ranks"]
    schedule = f"[{s['pp_schedule']}]" if s.get("pp_schedule") else ""  # which pipeline schedule ran
    fp8 = {None: "", "tensorwise": "+fp8"}.get(s.get("fp8"), f"+fp8-{s.get('fp8')}")  # which float8 recipe ran
    qlora = bool(s.get("qlora"))  # summaries written before --qlora existed have no such key
    objective = (summary.get("objective") or {}).get("name", "sft")  # summaries before --objective: sft
    name = s["name"] + schedule + ("+qlora" if qlora else "+lora" if s["lora"] else "") + fp8 + \
        (f"+{objective}" if objective != "sft" else "")
    row: dict[str, Any] = {"strategy": name, **{k: s[k] for k in COLUMNS[1:12] if k != "qlora"}, "qlora": qlora,
                           "attn_implementation": s.get("attn_implementation", "sdpa")}  # summaries before the flag: sdpa
    # Ranks of one tp x pp group process the same tokens: a device's share is its rate over tp x pp.
    row["tokens_per_s_per_device"] = round(mean(r["tokens_per_second"] for r in ranks) / (s["tp"] * s["pp"]), 1)
    row["tflops_per_device"] = round(mean(r["tflops_per_device"] for r in ranks), 4)
    row["mfu"] = round(mean(r["mfu"] for r in ranks), 4) if all("mfu" in r for r in ranks) else None
    row["peak_mem_max_mb"] = round(max(r["peak_memory_bytes"] for r in ranks) / _MB, 1)
    row["peak_mem_min_mb"] = round(min(r["peak_memory_bytes"] for r in ranks) / _MB, 1)
    for key in ("param", "grad"):
        row[f"{key}_mb_per_rank"] = round(max(r[f"{key}_bytes"] for r in ranks) / _MB, 3)
    row["optimizer_mb_per_rank"] = round(max(r["optimizer_bytes"] + r["master_bytes"] for r in ranks) / _MB, 3)
    row["final_loss"] = round(summary["losses"][-1], 4)
    norms = summary.get("grad_norms") or [None]  # summaries before gradient norms were recorded have none
    row["final_grad_norm"] = round(norms[-1], 4) if norms[-1] is not None else None
    evaluated = summary.get("eval")  # held-out data: the last evaluation's loss
    row["eval_loss"] = round(evaluated["loss"], 4) if evaluated else None
    return row


def objective_note(objective: str, rows: list[dict[str, Any]], summary_paths: Iterable[Path]) -> str:
    """The matrix's note on a DPO or GRPO comparison: each run's objective figures over its last quarter of steps
    (GRPO: mean reward, and rank 0's rollout seconds and completion tokens/s; DPO: reward accuracy and margin)."""
    parts = []
    for row, path in zip(rows, summary_paths):
        series = json.loads(Path(path).read_text())["objective"]["series"]

        def tail(key: str) -> float:
            values = [v for v in series.get(key, []) if v is not None]
            return mean(values[-max(len(values) // 4, 1):]) if values else float("nan")

        if objective == "grpo":
            parts.append(f"{row['strategy']}: reward {tail('reward'):.3f}, rollout {tail('rollout_seconds'):.2f} s at "
                         f"{tail('rollout_tokens_per_s'):,.0f} completion tokens/s")
        else:
            parts.append(f"{row['strategy']}: accuracy {tail('rewards/accuracies'):.2f}, margin "
                         f"{tail('rewards/margins'):.3f}")
    return f"--objective {objective}, over each run's last quarter of steps: " + "; ".join(parts) + "."


def load_rows(summary_paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Rows for every summary file, in the order given, each with its `same_math` verdict (`_same_math`).

    Raises:
        MatrixError: no summary file among the paths.
    """
    summaries = [json.loads(Path(p).read_text()) for p in summary_paths if Path(p).is_file()]
    if not summaries:
        raise MatrixError("No hfdist_summary.json found: run scripts/compare.py (or scripts/finetune.py) first, "
                          "and point the matrix at the folders they wrote.")
    rows = [matrix_row(s) for s in summaries]
    for row, verdict in zip(rows, _same_math(summaries)):
        row["same_math"] = verdict
    return rows


def _same_math(summaries: list[dict[str, Any]]) -> list[str]:
    """Each run against the reference of the runs of its job (model, adapters, precision, batch, steps): the run of
    the simplest rung (the rung table's plan order). "reference", "yes", or "NO (x)" with the largest relative
    difference of a step's loss or gradient norm (hfdist.report.same_math)."""
    from hfdist.config.rungs import RUNG_INFO
    from hfdist.report.same_math import largest_difference, numerics, same_math

    def job(s: dict[str, Any]) -> tuple:
        st = s["strategy"]
        return (s["config"].get("model"), st.get("lora"), st.get("qlora"), numerics(st), st.get("global_batch"),
                st.get("seq_len"), len(s["losses"]))

    def simplicity(s: dict[str, Any]) -> int:
        info = RUNG_INFO.get(s["strategy"]["name"])
        return info.plan_order if info is not None else 10**6

    references: dict[tuple, dict[str, Any]] = {}
    for s in summaries:
        key = job(s)
        if key not in references or simplicity(s) < simplicity(references[key]):
            references[key] = s
    out = []
    for s in summaries:
        ref = references[job(s)]
        if s is ref:
            out.append("reference")
        else:
            out.append("yes" if same_math(s, ref, numerics(s["strategy"])) else
                       f"NO ({largest_difference(s, ref):.1e} vs {ref['strategy']['name']})")
    return out


def _markdown(rows: list[dict[str, Any]], title: str, notes: list[str]) -> str:
    lines = [f"# {title}", "", *notes, "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join("" if row[c] is None else str(row[c]) for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def _plots(rows: list[dict[str, Any]], out_dir: Path, hardware: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["strategy"] for r in rows]
    x = range(len(rows))
    # Two panels: peak memory is dominated by libraries and buffers on a small model, so the model states the
    # sharding acts on get their own scale.
    fig, (peak, states) = plt.subplots(1, 2, figsize=(max(10, 1.6 * len(rows)), 4.8))
    peak.bar(x, [r["peak_mem_max_mb"] for r in rows], color="tab:blue", label="max over ranks")
    peak.scatter(x, [r["peak_mem_min_mb"] for r in rows], color="black", marker="_", s=300, zorder=3,
                 label="min over ranks")
    peak.set_ylabel("MB per rank")
    peak.set_title("Peak memory per rank")
    peak.legend(fontsize=8)
    bottom = [0.0] * len(rows)
    for key, color in (("param_mb_per_rank", "tab:orange"), ("grad_mb_per_rank", "tab:red"),
                       ("optimizer_mb_per_rank", "tab:gray")):
        values = [r[key] for r in rows]
        states.bar(x, values, bottom=bottom, color=color, label=key.removesuffix("_mb_per_rank"))
        bottom = [b + v for b, v in zip(bottom, values)]
    states.set_ylabel("MB per rank (max over ranks)")
    states.set_title("Model states held: params + grads + optimizer (+ master)")
    states.legend(fontsize=8)
    for ax in (peak, states):
        ax.set_xticks(list(x), names, rotation=30, ha="right")
    fig.suptitle(f"Per-rank memory by strategy ({hardware})")
    fig.tight_layout()
    memory = out_dir / "memory.png"
    fig.savefig(memory, dpi=120)
    plt.close(fig)

    fig, (left, right) = plt.subplots(1, 2, figsize=(max(10, 1.6 * len(rows)), 4.5))
    left.bar(x, [r["tokens_per_s_per_device"] for r in rows], color="tab:green")
    left.set_ylabel("tokens/s per device")
    left.set_title("Throughput")
    right.bar(x, [100 * (r["mfu"] or 0) for r in rows], color="tab:purple")
    right.set_ylabel("MFU (%)")
    right.set_title("Model FLOPs utilisation")
    for ax in (left, right):
        ax.set_xticks(list(x), names, rotation=30, ha="right")
    fig.suptitle(f"Throughput by strategy ({hardware})")
    fig.tight_layout()
    throughput = out_dir / "throughput.png"
    fig.savefig(throughput, dpi=120)
    plt.close(fig)
    return [memory, throughput]


def write_matrix(rows: list[dict[str, Any]], out_dir: Path, hardware: str, notes: list[str]) -> list[Path]:
    """Write matrix.csv, matrix.md and the plots into `out_dir`; return the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "matrix.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (out_dir / "matrix.md").write_text(_markdown(rows, f"Strategy matrix: {hardware}", notes))
    return [out_dir / "matrix.csv", out_dir / "matrix.md", *_plots(rows, out_dir, hardware)]
