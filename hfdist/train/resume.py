"""Resuming a run: what a checkpoint must share with the run that resumes it, and which checkpoint to resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hfdist.job.config import ConfigError, FinetuneConfig
from hfdist.job.ladder import Rung

__all__ = ["checkpoint_identity", "resume_point"]


def checkpoint_identity(cfg: FinetuneConfig, rung: Rung) -> dict[str, Any]:
    """What a checkpoint must share with a run that resumes it: the strategy's layout, the workload, and the
    precision and device it trained in (DeepSpeed's bf16 and fp32 states differ in layout, and an fp32 run
    continued in bf16 would silently change its numerics)."""
    import torch

    from hfdist.job.launch import effective_mixed_precision
    from hfdist.models.presets import DEFAULT_PRESET

    on_gpu = torch.cuda.is_available()
    return {"strategy": rung.name, "world_size": rung.num_processes, "dims": rung.dims.to_dict(),
            "pp_schedule": rung.pipeline.schedule if rung.pipeline else None, "lora": cfg.lora,
            "model": cfg.model or DEFAULT_PRESET, "global_batch_size": cfg.global_batch_size, "seq_len": cfg.seq_len,
            "mixed_precision": effective_mixed_precision(rung, on_gpu, cfg.mixed_precision),
            "device": "cuda" if on_gpu else "cpu"}


def _check_precision_and_device(checkpoint: Path, identity: dict[str, Any]) -> None:
    """Refuse, with the fix, a checkpoint trained in another precision or on another kind of device."""
    from hfdist.train.checkpoint import MARKER, CheckpointError

    try:
        saved = json.loads((checkpoint / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return  # check_resumable reports an unreadable marker
    fixes = []
    if saved.get("mixed_precision", "no") != identity["mixed_precision"]:
        fixes.append(f"it trained with --mixed-precision {saved.get('mixed_precision', 'no')}, this run with "
                     f"{identity['mixed_precision']}: pass --mixed-precision {saved.get('mixed_precision', 'no')}")
    if saved.get("device", "cpu") != identity["device"]:
        fixes.append(f"it trained on {saved.get('device', 'cpu')}, this run is on {identity['device']}: resume on "
                     f"a {saved.get('device', 'cpu')} machine")
    if fixes:
        raise CheckpointError(f"Checkpoint {checkpoint} cannot continue here: {'; '.join(fixes)}. hfdist resumes a "
                              "run in the precision and on the device it trained in (its states and numerics depend "
                              "on them). Or start a new --output-dir.")


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
    identity = checkpoint_identity(cfg, rung)
    _check_precision_and_device(latest, identity)
    check_resumable(latest, identity)
    step = json.loads((latest / MARKER).read_text())["step"]
    if cfg.num_epochs is None and step >= cfg.max_steps:  # with epochs the length is known after packing
        raise ConfigError(f"{latest} is already at step {step}, and --max-steps is {cfg.max_steps}: nothing is left "
                          "to train, so nothing was changed. Pass a larger --max-steps to train further from it, or "
                          "a new --output-dir for a new run.")
    return latest
