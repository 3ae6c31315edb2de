"""FinetuneConfig: every setting of one fine-tune (parsed only in scripts/finetune.py), and its error type."""

from __future__ import annotations

from dataclasses import dataclass

from hfdist.errors import HfdistError

__all__ = ["FinetuneConfig", "ConfigError"]


class ConfigError(HfdistError, ValueError):
    """Command-line settings that contradict each other or the data/model."""


@dataclass(frozen=True)
class FinetuneConfig:
    """Every setting of one fine-tune; precedence CLI > config file > these defaults."""

    config: str | None = None
    model: str | None = None
    dataset: str | None = None
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    max_steps: int = 120
    global_batch_size: int = 16
    micro_batch_size: int | None = None
    seq_len: int = 128
    learning_rate: float = 1e-3
    warmup_steps: int = 10
    seed: int = 0
    output_dir: str = "outputs/finetune"
    overwrite: bool = False
    save_steps: int = 50
    save_total_limit: int = 2
    resume: bool = False
    num_processes: int | None = None
    nvme_path: str | None = None
    activation_checkpointing: bool = False
    pp_schedule: str | None = None
    pp_microbatches: int | None = None
    gpu_mem_gb: float | None = None
    skip_plan_check: bool = False
    wandb: bool = True
    metrics: bool = True
    wandb_project: str | None = None
    compare_id: str | None = None
