"""Resuming a run: what a checkpoint must share with the run that resumes it, which checkpoint to resume, and what
resuming it on another layout changes (resharding).

A checkpoint of every rung but DeepSpeed is a DCP folder keyed by parameter name (hfdist.checkpoint.format): it
resumes on any of those rungs and world sizes, so the layout (strategy, world, degrees, schedule) may change; the
workload (model, LoRA, global batch, sequence length, precision, device) may not, since the run would no longer
continue the same optimisation. DeepSpeed's ZeRO partitions resume only onto the layout that wrote them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hfdist.config.finetune import ConfigError, FinetuneConfig
from hfdist.config.ladder import Rung
from hfdist.config.precision import effective_fp8, effective_mixed_precision
from hfdist.models.fingerprint import base_fingerprint, fingerprint_difference

__all__ = ["adapter_checkpoints", "checkpoint_identity", "resume_point", "resume_line", "LAYOUT_KEYS", "WORKLOAD_KEYS"]

LAYOUT_KEYS = ("strategy", "world_size", "dims", "pp_schedule")  # may change on resume (DCP formats only)
WORKLOAD_KEYS = ("model", "lora", "qlora", "lora_r", "lora_alpha", "lora_target_modules", "global_batch_size",
                 "seq_len")  # may not
_ABSENT = {"qlora": False}  # what a record written before a key existed means by its absence
DCP_FORMAT, DEEPSPEED_FORMAT = "dcp", "deepspeed"
_FLAGS = {"model": "--model", "global_batch_size": "--global-batch-size", "seq_len": "--seq-len", "lora": "--lora",
          "qlora": "--qlora", "lora_r": "--lora-r", "lora_alpha": "--lora-alpha",
          "lora_target_modules": "--lora-target-modules"}
_DEEPSPEED_CONVERTER = (
    "DeepSpeed's ZeRO partitions are laid out per rank; DeepSpeed reshards them only through its universal "
    "checkpoint converter (python -m deepspeed.checkpoint.ds_to_universal --input_folder {ckpt}/global_step{step} "
    "--output_folder UNIVERSAL), whose output the HF Trainer does not load, so hfdist does not convert them. To "
    "continue on another layout, write the trained weights out with `hfdist checkpoint export {ckpt} --to hf OUT` "
    "and start a new run from them (--model OUT; the optimizer state starts afresh)")


def adapter_checkpoints(cfg: FinetuneConfig) -> bool:
    """Whether the run's checkpoints hold its adapters without the frozen base: every LoRA / QLoRA run unless
    --checkpoint-base (QLoRA always: its 4-bit base is quantised anew from --model by every run)."""
    return cfg.lora and not cfg.checkpoint_base


def checkpoint_identity(cfg: FinetuneConfig, rung: Rung) -> dict[str, Any]:
    """What a checkpoint records about itself: the layout that wrote it (may change on resume for DCP checkpoints),
    the workload (may not), the precision and device it trained in (DeepSpeed's bf16 and fp32 states differ in
    layout, and an fp32 run continued in bf16 would silently change its numerics), and what it holds."""
    import torch

    from hfdist.models.presets import DEFAULT_PRESET

    on_gpu = torch.cuda.is_available()
    fmt = DEEPSPEED_FORMAT if rung.uses_deepspeed else DCP_FORMAT
    adapters_only = adapter_checkpoints(cfg)
    weights = ("the adapters (the base is rebuilt from --model, checked against `base`)" if adapters_only
               else "the adapters and the frozen base" if cfg.lora else "the model")
    holds = (f"DeepSpeed's per-rank ZeRO partitions of {weights} + optimizer state" if rung.uses_deepspeed
             else f"{weights} + optimizer state (DCP, keyed by the full model's parameter names, any layout loads it)")
    return {"strategy": rung.name, "world_size": rung.num_processes, "dims": rung.dims.to_dict(),
            "pp_schedule": rung.pipeline.schedule if rung.pipeline else None, "format": fmt,
            "holds": f"{holds}; LR scheduler; data position (trainer_state.json); RNG streams per rank",
            "adapters_only": adapters_only, "base": base_fingerprint(cfg.model, cfg.seed) if cfg.lora else None,
            "lora": cfg.lora, "qlora": cfg.qlora, "lora_r": cfg.lora_r if cfg.lora else None,
            "lora_alpha": cfg.lora_alpha if cfg.lora else None,
            "lora_target_modules": list(cfg.lora_target_modules) if cfg.lora and cfg.lora_target_modules else None,
            "model": cfg.model or DEFAULT_PRESET, "seed": cfg.seed, "global_batch_size": cfg.global_batch_size,
            "seq_len": cfg.seq_len,
            "mixed_precision": effective_mixed_precision(rung, on_gpu, cfg.mixed_precision),
            "fp8": effective_fp8(rung, on_gpu, cfg.fp8), "device": "cuda" if on_gpu else "cpu"}


def _check_precision_and_device(checkpoint: Path, saved: dict[str, Any], identity: dict[str, Any]) -> None:
    """Refuse, with the fix, a checkpoint trained in another precision or on another kind of device."""
    from hfdist.checkpoint.format import CheckpointError

    fixes = []
    if saved.get("mixed_precision", "no") != identity["mixed_precision"]:
        fixes.append(f"it trained with --mixed-precision {saved.get('mixed_precision', 'no')}, this run with "
                     f"{identity['mixed_precision']}: pass --mixed-precision {saved.get('mixed_precision', 'no')}")
    if saved.get("fp8") != identity["fp8"]:
        asked = f"--fp8 {saved['fp8']}" if saved.get("fp8") else "no --fp8"
        fixes.append(f"it trained with {asked}, this run with "
                     f"{'--fp8 ' + identity['fp8'] if identity['fp8'] else 'no --fp8'}: pass {asked}")
    if saved.get("device", "cpu") != identity["device"]:
        fixes.append(f"it trained on {saved.get('device', 'cpu')}, this run is on {identity['device']}: resume on "
                     f"a {saved.get('device', 'cpu')} machine")
    if fixes:
        raise CheckpointError(f"Checkpoint {checkpoint} cannot continue here: {'; '.join(fixes)}. hfdist resumes a "
                              "run in the precision and on the device it trained in (its states and numerics depend "
                              "on them). Or start a new --output-dir.")


def _check_workload(checkpoint: Path, saved: dict[str, Any], identity: dict[str, Any]) -> None:
    """Refuse a checkpoint of another workload, naming both values of each difference and the flag that fixes it."""
    from hfdist.checkpoint.format import CheckpointError

    saved = {**_ABSENT, **saved}
    diff = [k for k in WORKLOAD_KEYS if saved.get(k) != identity[k]]
    if diff:
        what = "; ".join(f"{k}: checkpoint {saved.get(k)!r}, this run {identity[k]!r}" for k in diff)
        fix = " ".join(f"{_FLAGS[k]} {','.join(v) if isinstance(v := saved.get(k), list) else v}" for k in diff
                       if k not in ("lora", "qlora") and saved.get(k) is not None)
        switches = "".join(f" {_FLAGS[k]}" for k in ("lora", "qlora") if saved.get(k) and not identity[k])
        settings = (fix + switches).strip() or "as it was written"
        raise CheckpointError(
            f"Checkpoint {checkpoint} was written by another workload ({what}). A resumed run continues the same "
            "optimisation: its data position and LR schedule count global batches of the same rows, and its states "
            f"fit only the same model. Resume with the checkpoint's settings ({settings}), or start a new "
            "--output-dir.")


def _check_base(checkpoint: Path, saved: dict[str, Any], identity: dict[str, Any]) -> None:
    """Refuse adapters trained on another base than the one --model gives now (overwritten weights, another
    revision, another seed's preset), naming both fingerprints (hfdist.models.fingerprint)."""
    from hfdist.checkpoint.format import CheckpointError

    before, now = saved.get("base"), identity["base"]
    if before is None or now is None:  # a full fine-tune's checkpoint holds its weights; older records: no base
        return
    differ = fingerprint_difference(before, now)
    if differ:
        raise CheckpointError(
            f"Checkpoint {checkpoint} holds LoRA adapters trained on another base than --model {now['model']} gives "
            f"now: checkpoint {before}, this run {now} ({'; '.join(differ)}). Adapters resumed onto other weights "
            "would not continue the same optimisation. Resume with the base the run started from (the same folder "
            "contents, hub revision or preset --seed), or start a new --output-dir.")


def _check_layout(checkpoint: Path, saved: dict[str, Any], identity: dict[str, Any]) -> None:
    """DCP checkpoints reshard onto any layout; DeepSpeed's resume only onto their own (refused naming the
    converter); a checkpoint without a format record is of an older hfdist and is refused."""
    from hfdist.checkpoint.format import CheckpointError

    same_layout = all(saved.get(k) == identity[k] for k in LAYOUT_KEYS)
    fmt = saved.get("format")
    if fmt == identity["format"] == DCP_FORMAT or (same_layout and fmt == identity["format"]):
        return
    if fmt is None:
        raise CheckpointError(f"Checkpoint {checkpoint} was written by an older hfdist (no format in its record), "
                              "whose checkpoints resume only on their own layout and are not read by this version. "
                              "Start a new --output-dir.")
    ckpt_layout = f"--config {saved.get('strategy')} --num-processes {saved.get('world_size')}"
    converter = _DEEPSPEED_CONVERTER.format(ckpt=checkpoint, step=saved.get("step"))
    raise CheckpointError(
        f"Checkpoint {checkpoint} was written by {saved.get('strategy')} on {saved.get('world_size')} ranks "
        f"({fmt} format); this run is {identity['strategy']} on {identity['world_size']} ranks ({identity['format']} "
        f"format). {converter}. Or resume with the checkpoint's layout ({ckpt_layout}).")


def resume_point(cfg: FinetuneConfig, rung: Rung) -> Path | None:
    """With --resume: the latest complete checkpoint in --output-dir (None: start from scratch), checked to be
    resumable by this run (on its layout, or resharded onto it). Without --resume: None.

    Raises:
        CheckpointError: the checkpoint is of another workload, precision or device, holds adapters of another
            base, is a DeepSpeed one of another layout, or lacks shard files.
        ConfigError: the checkpoint is already at --max-steps (the Trainer would train one step past it).
    """
    if not cfg.resume:
        return None
    from hfdist.checkpoint.format import check_shard_files, latest_checkpoint, read_marker

    latest = latest_checkpoint(Path(cfg.output_dir))
    if latest is None:
        return None
    saved, identity = read_marker(latest), checkpoint_identity(cfg, rung)
    _check_precision_and_device(latest, saved, identity)
    _check_workload(latest, saved, identity)
    _check_base(latest, saved, identity)
    _check_layout(latest, saved, identity)
    if saved.get("format") == DCP_FORMAT:
        check_shard_files(latest)
    step = saved["step"]
    if cfg.num_epochs is None and step >= cfg.max_steps:  # with epochs the length is known after packing
        raise ConfigError(f"{latest} is already at step {step}, and --max-steps is {cfg.max_steps}: nothing is left "
                          "to train, so nothing was changed. Pass a larger --max-steps to train further from it, or "
                          "a new --output-dir for a new run.")
    return latest


def _layout(record: dict[str, Any]) -> str:
    degrees = " x ".join(f"{k} {v}" for k, v in (record.get("dims") or {}).items() if v > 1) or "one replica"
    schedule = f", {record['pp_schedule']}" if record.get("pp_schedule") else ""
    return f"{record.get('strategy')} on {record.get('world_size')} ranks ({degrees}{schedule})"


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def resume_line(checkpoint: Path, cfg: FinetuneConfig, rung: Rung) -> str:
    """The line `--resume` prints: the checkpoint, its step, what it reshards from and to, what carries over, and
    what cannot continue exactly across layouts (the per-rank RNG streams)."""
    from hfdist.checkpoint.format import read_marker

    saved, identity = read_marker(checkpoint), checkpoint_identity(cfg, rung)
    head = f"hfdist: resuming from {checkpoint} (step {saved.get('step')})"
    if all(saved.get(k) == identity[k] for k in LAYOUT_KEYS):
        return f"{head} on the layout that wrote it: {_layout(identity)}."
    before, now = saved.get("world_size"), identity["world_size"]
    restored = _ranks(0, min(before, now) - 1)
    rng = (f"RNG: {restored} restore the streams the same ranks saved"
           + (f", {_ranks(before, now - 1)} start from --seed (none saved)" if now > before else "")
           + (f", the streams of {_ranks(now, before - 1)} are unused" if before > now else "")
           + "; the data order does not depend on them (it is drawn from --seed), but random ops in the model "
             "(dropout) draw differently than in the uninterrupted run, as a rank's stream no longer meets the same "
             "work")
    return (f"{head}: resharding {_layout(saved)} -> {_layout(identity)}. Model and optimizer state by parameter "
            f"name, LR scheduler and data position (step {saved.get('step')} of global batch "
            f"{saved.get('global_batch_size')}) carry over exactly. {rng}.")
