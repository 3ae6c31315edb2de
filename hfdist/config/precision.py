"""The precision rules: what a run trains in given its rung, the device and --mixed-precision, what a CPU run
changes of a rung's GPU-only settings, and the part of the precision accelerate is told to apply.

Read by the hand-over (hfdist.job.launch), by every rank before training (hfdist.job.run), by the memory planner's
check and by the resume rules (a checkpoint saved in one precision resumed in another), so they live here with the
rest of a run's configuration rather than in the launcher.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hfdist.config.ladder import Rung

__all__ = ["CpuTranslation", "effective_mixed_precision", "effective_fp8", "cpu_translation", "settle_mixed_precision"]


@dataclass(frozen=True)
class CpuTranslation:
    """GPU-only settings of a rung replaced for a CPU run, and why."""

    mixed_precision: str
    notes: tuple[str, ...]

    def line(self, rung: Rung) -> str:
        """The one line a CPU run prints about what it changed."""
        return f"hfdist: no GPU, so {rung.name} runs on CPU with gloo: " + "; ".join(self.notes)


def effective_mixed_precision(rung: Rung, on_gpu: bool, asked: str = "auto") -> str:
    """The precision a run trains in: --mixed-precision as given ("no" or "bf16", on any device), or for "auto"
    the rung's own setting on a GPU and fp32 on a CPU."""
    if asked != "auto":
        return asked
    return rung.mixed_precision if on_gpu else "no"


def effective_fp8(rung: Rung, on_gpu: bool, asked: str | None = None) -> str | None:
    """The float8 recipe a run trains with (None: no FP8): --fp8 as given, on any device; else the YAML's
    `mixed_precision: fp8` (Rung.fp8) on a GPU. A CPU leaves the YAML's FP8 off, as it does the YAML's bf16."""
    return asked or (rung.fp8 if on_gpu else None)


def cpu_translation(rung: Rung, on_gpu: bool, asked: str = "auto", fp8: str | None = None) -> CpuTranslation | None:
    """What a rung's GPU-only settings become on CPU, or None on a GPU machine. bf16 asked for on CPU stays bf16
    (CPU autocast, FSDP2's policy, DeepSpeed's bf16 all run there); "auto" trains the CPU in fp32. The YAML's FP8
    is off on CPU unless --fp8 (`fp8`) asks for it (torchao's float8 matmuls run on a CPU too, slowly)."""
    if on_gpu:
        return None
    mixed = effective_mixed_precision(rung, on_gpu, asked)
    notes = ["backend nccl -> gloo"]
    if rung.fp8 is not None and fp8 is None:
        notes.append(f"fp8 ({rung.fp8}) -> off (--fp8 keeps float8 matmuls)")
    if asked == "auto" and rung.mixed_precision != mixed:
        notes.append(f"mixed_precision {rung.mixed_precision} -> fp32 (--mixed-precision bf16 keeps bf16)")
    if rung.fsdp is not None and rung.fsdp.offload_params:
        notes.append("fsdp_offload_params -> off (params already live in CPU memory)")
    return CpuTranslation(mixed_precision=mixed, notes=tuple(notes))


def settle_mixed_precision(rung: Rung, on_gpu: bool, asked: str = "auto") -> str:
    """The mixed precision this rank trains with; accelerate is told the part it applies.

    TrainingArguments reads ACCELERATE_MIXED_PRECISION (set by `accelerate launch` from the YAML), so the setting
    must reach the environment: the run's precision for DDP and DeepSpeed (accelerate's autocast, DeepSpeed's bf16
    section), "no" for hfdist's mesh rungs, whose FSDP2 policy computes in bf16 (autocast on top of it would cast
    twice and keep fp32 copies of every output).
    """
    mixed = effective_mixed_precision(rung, on_gpu, asked)
    os.environ["ACCELERATE_MIXED_PRECISION"] = "no" if rung.owns_sharding else mixed
    return mixed
