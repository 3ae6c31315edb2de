"""Resuming a run: what a checkpoint must share with the run that resumes it, and which checkpoint to resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hfdist.job.config import ConfigError, FinetuneConfig
from hfdist.job.ladder import Rung

__all__ = ["checkpoint_identity", "resume_point"]


def checkpoint_identity(cfg: FinetuneConfig, rung: Rung) -> dict[str, Any]:
    """What a checkpoint must share with a run that resumes it: the strategy's layout and the workload."""
    from hfdist.models.presets import DEFAULT_PRESET

    return {"strategy": rung.name, "world_size": rung.num_processes, "dims": rung.dims.to_dict(),
            "pp_schedule": rung.pipeline.schedule if rung.pipeline else None, "lora": cfg.lora,
            "model": cfg.model or DEFAULT_PRESET, "global_batch_size": cfg.global_batch_size, "seq_len": cfg.seq_len}


def resume_point(cfg: FinetuneConfig, rung: Rung) -> Path | None:
    """With --resume: the latest complete checkpoint in --output-dir (None: start from scratch), checked to be
    resumable by this run. Without --resume: None.

    Raises:
        CheckpointError: the checkpoint was written by another strategy, world or workload.
        ConfigError: the checkpoint is already at --max-steps (the Trainer would train one step past it).
    """
    if not cfg.resume:
        return None
    from hfdist.train.checkpoint import MARKER, check_resumable, latest_checkpoint

    latest = latest_checkpoint(Path(cfg.output_dir))
    if latest is None:
        return None
    check_resumable(latest, checkpoint_identity(cfg, rung))
    step = json.loads((latest / MARKER).read_text())["step"]
    if cfg.num_epochs is None and step >= cfg.max_steps:  # with epochs the length is known after packing
        raise ConfigError(f"{latest} is already at step {step}, and --max-steps is {cfg.max_steps}: nothing is left "
                          "to train, so nothing was changed. Pass a larger --max-steps to train further from it, or "
                          "a new --output-dir for a new run.")
    return latest
