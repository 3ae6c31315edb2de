"""The run's record: hfdist_summary.json (strategy, losses, per-rank measurements) written by rank 0, the trackers'
runs closed with the peaks, and the resolved job file (hfdist_job.yaml)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from hfdist.config.finetune import FinetuneConfig, job_text
from hfdist.config.job_file import JOB_FILE_NAME
from hfdist.config.ladder import Rung
from hfdist.config.preemption import PREEMPTED_EXIT_CODE, leave_preempted_note, preempted_line
from hfdist.errors import DIVERGED_EXIT_CODE

if TYPE_CHECKING:
    from hfdist.callbacks.trackers import Trackers
    from hfdist.metrics.peaks import PeakFlops

__all__ = ["SUMMARY_NAME", "CHECK_BLOCKS", "RunRecord", "check_blocks", "first_blocks", "source_figures",
           "with_rank_records", "write_summary", "write_job_file"]

SUMMARY_NAME = "hfdist_summary.json"
CHECK_BLOCKS = 4  # packed blocks every rank scores after training; the saved model must reproduce that loss


@dataclass(frozen=True)
class RunRecord:
    """What the summary reports of a trained run beyond its settings, filled in by hfdist.job.run from its Trainer
    and callbacks (so this module reads no state of the job)."""

    strategy: dict[str, Any]
    losses: list[float]
    loss_steps: list[int]
    grad_norms: list[float | None]  # each step's, before clipping (hfdist.callbacks.losses.LossRecorder)
    check_blocks: int
    flops_per_token: float
    peak_flops: PeakFlops | None
    sink: Trackers  # finished here, once the peaks are set
    closing_table: Callable[[Mapping[str, str]], str]  # every rank's figures, then `outputs`
    evaluations: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> eval loss, perplexity, tokens
    best_step: int | None = None  # under --load-best: the checkpoint saved as the model
    # Every checkpoint's cost (hfdist.checkpoint.trainer_hooks.CheckpointCost: step, background, held_s, write_s,
    # bytes) and what they hold (CheckpointingMixin.checkpoint_contents: holds, counted, counted_bytes)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    checkpoint_contents: dict[str, Any] | None = None
    sources: list[dict[str, Any]] = field(default_factory=list)  # each training source's name, rows, label tokens
    # Where a non-finite loss, gradient norm or update stopped the run (hfdist.train.nonfinite.Diverged.record)
    diverged: dict[str, Any] | None = None
    # The objective (sft, dpo, grpo) and its per-step figures beside the loss (hfdist.objectives.trainer.SERIES)
    objective: dict[str, Any] = field(default_factory=lambda: {"name": "sft", "series": {}})


def source_figures(sources: list[dict[str, Any]]) -> dict[str, float]:
    """The trackers' record of the training data: each source's rows, label tokens and share of the label tokens
    (data/NAME/...)."""
    total = max(sum(s["label_tokens"] for s in sources), 1)
    return {f"data/{s['name']}/{key}": value for s in sources
            for key, value in (("rows", s["rows"]), ("label_tokens", s["label_tokens"]),
                               ("share", s["label_tokens"] / total))}


def check_blocks(rung: Rung, available: int) -> int:
    """How many packed blocks the post-training check scores: CHECK_BLOCKS, rounded up to a multiple of the
    pipeline micro-batches (a pipeline splits the batch evenly)."""
    n = rung.pipeline.n_microbatches if rung.pipeline is not None else 1
    return min(-(-CHECK_BLOCKS // n) * n, available)


def first_blocks(dataset, n: int, collate: Callable[[list], dict[str, Any]]) -> dict[str, Any]:
    """The first `n` packed blocks of `dataset` as one model-input batch (made by `collate`, as in training)."""
    return collate([dataset[i] for i in range(n)])


def with_rank_records(ranks: list[dict], record: dict) -> list[dict]:
    """`ranks` (the metrics callback's per-rank figures; none under --no-metrics) with every rank's `record` (its
    load and save costs and precision, not all numbers) merged in by rank. Collective: one all_gather_object."""
    import torch.distributed as dist

    records = [record]
    if dist.is_available() and dist.is_initialized():
        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, record)
    figures = {r["rank"]: r for r in ranks}
    return [{**figures.get(r["rank"], {}), **r} for r in records]


def _write_json_atomically(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _evaluation(run: RunRecord) -> dict[str, Any] | None:
    """The summary's eval record: every evaluation by step, the last, and the checkpoint kept under --load-best."""
    if not run.evaluations:
        return None
    steps = sorted(run.evaluations)
    return {"steps": steps, "losses": [run.evaluations[s]["loss"] for s in steps],
            "perplexities": [run.evaluations[s]["perplexity"] for s in steps],
            "tokens": run.evaluations[steps[-1]]["tokens"], "loss": run.evaluations[steps[-1]]["loss"],
            "perplexity": run.evaluations[steps[-1]]["perplexity"], "best_step": run.best_step,
            "best_loss": run.evaluations[run.best_step]["loss"] if run.best_step in run.evaluations else None}


def _evaluation_line(record: dict[str, Any]) -> str:
    text = (f"hfdist: eval loss {record['loss']:.4f} (perplexity {record['perplexity']:.2f}) over "
            f"{record['tokens']} held-out tokens at step {record['steps'][-1]}")
    if record["best_step"] is not None:
        text += f"; the saved model is step {record['best_step']}'s (eval loss {record['best_loss']:.4f}, the best)"
    return text


def write_job_file(cfg: FinetuneConfig) -> Path:
    """Rank 0, as the run starts: the resolved job (every setting) as OUTPUT_DIR/hfdist_job.yaml, so
    `hfdist finetune OUTPUT_DIR/hfdist_job.yaml --output-dir NEW` runs it again."""
    path = Path(cfg.output_dir) / JOB_FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(job_text(cfg))
    return path


def write_summary(cfg: FinetuneConfig, run: RunRecord, train_runtime: float | None, check_loss: float | None,
                  ranks: list[dict], resume_from: Path | None, preempted: dict[str, Any] | None = None) -> None:
    """Rank 0: close the W&B run with the peaks, write OUTPUT_DIR/hfdist_summary.json and print the closing table.

    Args:
        check_loss: the check batch's loss after training (None: preempted, nothing scored).
        preempted: where a preempted run stopped (hfdist.train.preemption.Preempted.record), else None; the
            trackers get `preempted_at_step` and close with the preempted exit code.
    """
    summary = {
        "strategy": run.strategy,
        "config": asdict(cfg),
        "losses": run.losses,
        "loss_steps": run.loss_steps,
        "grad_norms": run.grad_norms,
        "resumed_from": str(resume_from) if resume_from else None,
        "check_batch_loss": check_loss,
        "check_blocks": run.check_blocks,
        "train_runtime": train_runtime,
        "flops_per_token": run.flops_per_token,
        "peak_flops": {"flops": run.peak_flops.flops, "source": run.peak_flops.source} if run.peak_flops else None,
        "ranks": sorted(ranks, key=lambda r: r["rank"]),
        "eval": _evaluation(run),
        "data": {"sources": [{k: s[k] for k in ("name", "format", "rows", "label_tokens")} for s in run.sources]},
        "checkpoints": run.checkpoints,
        "checkpoint_contents": run.checkpoint_contents,
        "preempted": preempted,
        "diverged": run.diverged,
        "objective": run.objective,
    }
    peaks = {f"peak/{k}": max(r.get(k, 0) for r in ranks)
             for k in ("peak_memory_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "load_peak_memory_bytes")
             if any(k in r for r in ranks)}
    costs = {f"checkpoint/total_{k}": sum(c[k] for c in run.checkpoints) for k in ("held_s", "write_s")}
    if run.checkpoints:
        costs["checkpoint/bytes"] = run.checkpoints[-1]["bytes"]
    run.sink.set_summary({**peaks, **(costs if run.checkpoints else {})})
    if preempted is not None:
        run.sink.set_summary({"preempted_at_step": preempted["step"]})
    where = {sink.label: sink.location for sink in run.sink.sinks.values() if sink.location}
    records = run.sink.finish(PREEMPTED_EXIT_CODE if preempted else DIVERGED_EXIT_CODE if run.diverged else 0)
    summary["wandb"] = records.pop("wandb", {"mode": "disabled", "run_dir": None, "error": None})
    summary["trackers"] = records
    _write_json_atomically(Path(cfg.output_dir) / SUMMARY_NAME, summary)
    losses = run.losses
    if preempted is not None:
        line = preempted_line(run.strategy["name"], preempted["step"], preempted["signal"],
                              sorted(r["rank"] for r in ranks if "preempt_signal" in r), preempted["save_seconds"],
                              preempted["checkpoint"])
        print(line, flush=True)
        leave_preempted_note(line)
    elif run.diverged is not None:
        print(f"hfdist: {run.strategy['name']} stopped at step {run.diverged['step']}: the "
              f"{run.diverged['what'].replace('_', ' ')} was {run.diverged['value']}; losses "
              f"{', '.join(f'{x:.4f}' for x in losses[-4:])}", flush=True)
    else:
        print(f"hfdist: {run.strategy['name']} done: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} "
              f"steps", flush=True)
    if summary["eval"] is not None:
        print(_evaluation_line(summary["eval"]), flush=True)
    saved = {"checkpoint": preempted["checkpoint"]} if preempted else {"model": cfg.output_dir} if cfg.save_model \
        else {}
    outputs = {**saved, "summary": str(Path(cfg.output_dir) / SUMMARY_NAME)}
    outputs.update({f"{label} run": location for label, location in where.items()})
    print(run.closing_table(outputs), flush=True)


