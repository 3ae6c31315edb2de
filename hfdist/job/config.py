"""FinetuneConfig: every setting of one fine-tune, its command-line parser (the only place arguments are parsed),
and its error type."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from hfdist.errors import HfdistError

__all__ = ["FinetuneConfig", "ConfigError", "USAGE", "build_parser", "parse_args"]

USAGE = """Fine-tune a model with a parallelism strategy from the config ladder.

    accelerate launch scripts/finetune.py --config fsdp_hybrid.yaml
    accelerate launch --config_file accelerate_configs/zero3.yaml scripts/finetune.py --lora

With no --model/--dataset it fine-tunes hfdist's embedded default (a small Llama built from a config, on shipped
instruction data). Writes the model (or LoRA adapter) and OUTPUT_DIR/hfdist_summary.json.
"""


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
    mixed_precision: str = "auto"
    pp_schedule: str | None = None
    pp_microbatches: int | None = None
    gpu_mem_gb: float | None = None
    skip_plan_check: bool = False
    wandb: bool = True
    metrics: bool = True
    wandb_project: str | None = None
    compare_id: str | None = None


def build_parser(description: str = USAGE) -> argparse.ArgumentParser:
    """The fine-tune command line (scripts/finetune.py and `hfdist finetune` share it)."""
    d = FinetuneConfig()
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=d.config,
                   help="rung name (ddp, zero1, fsdp_full_shard, zero2, fsdp_hybrid, zero3, pp, fsdp_tp, zero2_tp, 3d, "
                        "zero3_offload_cpu, zero3_offload_nvme; with or without .yaml), a path to an Accelerate "
                        "YAML, or 'single'. "
                        "Default: the world `accelerate launch --config_file` started, else one process")
    p.add_argument("--model", default=d.model, help="HF id, local checkpoint folder, or preset (default llama-small)")
    p.add_argument("--dataset", default=d.dataset,
                   help="HF id or local json/jsonl/csv/parquet with instruction/response or text columns "
                        "(default: the embedded instruction data)")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) instead of all weights")
    p.add_argument("--lora-r", type=int, default=d.lora_r)
    p.add_argument("--lora-alpha", type=int, default=d.lora_alpha)
    p.add_argument("--max-steps", type=int, default=d.max_steps)
    p.add_argument("--global-batch-size", type=int, default=d.global_batch_size,
                   help="sequences per optimizer step over all ranks")
    p.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size,
                   help="sequences per rank per forward (default: global / data-parallel ranks)")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--learning-rate", "--lr", type=float, default=d.learning_rate)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--output-dir", default=d.output_dir)
    p.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty --output-dir")
    p.add_argument("--save-steps", type=int, default=d.save_steps,
                   help="write a checkpoint every N optimizer steps into OUTPUT_DIR/checkpoint-N (0: none)")
    p.add_argument("--save-total-limit", type=int, default=d.save_total_limit, help="checkpoints kept (newest)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --output-dir from its latest complete checkpoint (from scratch if it "
                        "has none); use it under launchers that restart failed jobs")
    p.add_argument("--num-processes", type=int, default=d.num_processes,
                   help="rescale the rung's data-parallel axis to this many processes")
    p.add_argument("--nvme-path", default=d.nvme_path, help="NVMe folder for zero3_offload_nvme")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--mixed-precision", default=d.mixed_precision, choices=["auto", "no", "bf16"],
                   help="bf16: compute in bf16 (fp32 weights, gradient reduction and loss), on GPU and CPU alike; "
                        "no: fp32; auto (default): the config's setting on GPU, fp32 on CPU")
    p.add_argument("--pp-schedule", default=d.pp_schedule,
                   choices=["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"],
                   help="pipeline schedule of a pp rung (default: the YAML's parallelism_config_pp_schedule)")
    p.add_argument("--pp-microbatches", type=int, default=d.pp_microbatches,
                   help="pipeline micro-batches per step; must divide the per-rank batch (default: the YAML's)")
    p.add_argument("--gpu-mem-gb", type=float, default=d.gpu_mem_gb,
                   help="memory per device to plan against (default: the GPU's own; no check on CPU without it)")
    p.add_argument("--skip-plan-check", action="store_true",
                   help="launch even if the memory planner predicts the rung cannot fit")
    p.add_argument("--no-wandb", dest="wandb", action="store_false",
                   help="no W&B run (default: one per run, offline unless you are logged in)")
    p.add_argument("--no-metrics", dest="metrics", action="store_false",
                   help="leave out hfdist's memory/throughput callbacks (and W&B); to measure their cost")
    p.add_argument("--wandb-project", default=d.wandb_project, help="W&B project (default hfdist)")
    p.add_argument("--compare-id", default=d.compare_id, help="W&B group shared by the runs of one comparison")
    return p


def parse_args(argv: list[str]) -> FinetuneConfig:
    """Command line -> FinetuneConfig (the only place arguments are parsed)."""
    a = build_parser().parse_args(argv)
    return FinetuneConfig(**{k.replace("-", "_"): v for k, v in vars(a).items()})
