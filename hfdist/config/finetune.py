"""FinetuneConfig: every setting of one fine-tune, its command-line parser (the only place arguments are parsed),
and its error type."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from hfdist.errors import HfdistError

__all__ = ["FinetuneConfig", "ConfigError", "DEFAULT_LOSS_CHUNK_SIZE", "USAGE", "add_finetune_arguments",
           "build_parser", "config_from_namespace", "parse_args"]

USAGE = """Fine-tune a Hugging Face causal LM with a parallelism strategy from the config ladder.

    hfdist finetune --config fsdp_hybrid.yaml
    accelerate launch scripts/finetune.py --config fsdp_hybrid.yaml          (the same job)
    accelerate launch --config_file accelerate_configs/zero3.yaml scripts/finetune.py --lora

With no --model/--dataset it fine-tunes hfdist's embedded default (a small Llama built from a config, on shipped
instruction data). hfdist starts the processes the rung needs (one per GPU on a GPU machine), checks that the
strategy asked for is in effect, and writes the model (or LoRA adapter), hfdist_summary.json and the libraries'
log (logs/) into --output-dir. `hfdist configs` lists the rungs.
"""

# Sequence positions per lm_head + cross-entropy chunk of hfdist's loss (hfdist.models.chunked_loss), a setting's
# default kept here, torch-free, so the command line and the planner read it too: B x 512 x V x 4 bytes of fp32
# logits at once (256 MiB at B=1 for a 128K vocabulary), matmuls still large enough to run at full speed.
DEFAULT_LOSS_CHUNK_SIZE = 512


class ConfigError(HfdistError, ValueError):
    """Command-line settings that contradict each other or the data/model."""


@dataclass(frozen=True)
class FinetuneConfig:
    """Every setting of one fine-tune; precedence CLI > config file > these defaults.

    `qlora` implies `lora` (the adapters are the same; only the base they adapt is 4-bit) and, with
    mixed_precision "auto", bf16 compute on every device (QLoRA's compute dtype); --mixed-precision no keeps fp32.
    """

    config: str | None = None
    model: str | None = None
    dataset: str | None = None
    lora: bool = False
    qlora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    max_steps: int = 120
    num_epochs: float | None = None
    global_batch_size: int = 16
    micro_batch_size: int | None = None
    seq_len: int = 128
    long_documents: str = "split"
    learning_rate: float = 1e-3
    warmup_steps: int = 10
    seed: int = 0
    output_dir: str = "outputs/finetune"
    overwrite: bool = False
    save_steps: int = 50
    save_total_limit: int = 2
    resume: bool = False
    collective_timeout: float = 300.0
    num_processes: int | None = None
    tp: int | None = None
    pp: int | None = None
    dp_replicate: int | None = None
    nvme_path: str | None = None
    activation_checkpointing: bool = False
    loss_chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE
    compile: bool = False
    mixed_precision: str = "auto"
    pp_schedule: str | None = None
    pp_microbatches: int | None = None
    gpu_mem_gb: float | None = None
    skip_plan_check: bool = False
    wandb: bool = True
    metrics: bool = True
    wandb_project: str | None = None
    compare_id: str | None = None
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.qlora:
            object.__setattr__(self, "lora", True)
            if self.mixed_precision == "auto":
                object.__setattr__(self, "mixed_precision", "bf16")


def add_finetune_arguments(p: argparse.ArgumentParser) -> None:
    """The fine-tune options (scripts/finetune.py and `hfdist finetune` share them), in accelerate's style: argument
    groups, each option a sentence with its default."""
    d = FinetuneConfig()
    g = p.add_argument_group("Strategy", "Which rung of the ladder, on how many processes, with which degrees.")
    g.add_argument("--config", default=d.config,
                   help="Rung name (ddp, zero1, fsdp_full_shard, zero2, fsdp_hybrid, zero3, pp, fsdp_tp, zero2_tp, 3d, "
                        "fsdp_cp, zero3_offload_cpu, zero3_offload_nvme; with or without .yaml), a path to your own accelerate "
                        "YAML (FSDP1 keys are translated), or 'single'. Default: the world `accelerate launch "
                        "--config_file` started, else one process.")
    g.add_argument("--num-processes", type=int, default=d.num_processes,
                   help="Processes to run; the data-parallel axis absorbs the change. Default: one per GPU of this "
                        "node on a GPU machine, the YAML's num_processes on CPU.")
    g.add_argument("--tp", type=int, default=d.tp, help="Tensor-parallel degree (overrides the YAML's).")
    g.add_argument("--pp", type=int, default=d.pp, help="Pipeline stages (overrides the YAML's).")
    g.add_argument("--dp-replicate", type=int, default=d.dp_replicate,
                   help="Model replicas of a hybrid-sharded rung (default: one per node; overrides the YAML's).")
    g.add_argument("--mixed-precision", default=d.mixed_precision, choices=["auto", "no", "bf16"],
                   help="bf16: compute in bf16 (fp32 weights, gradient reduction and loss), on GPU and CPU alike; "
                        "no: fp32; auto (default): the config's setting on GPU, fp32 on CPU (bf16 under --qlora).")
    g.add_argument("--pp-schedule", default=d.pp_schedule,
                   choices=["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"],
                   help="Pipeline schedule of a pp rung (default: the YAML's parallelism_config_pp_schedule).")
    g.add_argument("--pp-microbatches", type=int, default=d.pp_microbatches,
                   help="Pipeline micro-batches per step; must divide the per-rank batch (default: the YAML's).")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="Recompute each decoder layer in backward instead of keeping its activations.")
    g.add_argument("--loss-chunk-size", type=non_negative_int, default=d.loss_chunk_size, metavar="N",
                   help=f"Compute lm_head and the fp32 cross-entropy N sequence positions at a time, so the whole "
                        f"batch's logits never exist (default {d.loss_chunk_size}; the same loss). 0: unchunked, "
                        "as transformers does.")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer (regional; inductor on CPU and GPU). Runs on single, ddp "
                        "and the FSDP2 / TP rungs; refused on pipeline, context-parallel and DeepSpeed rungs.")
    g.add_argument("--nvme-path", default=d.nvme_path, help="NVMe folder for zero3_offload_nvme.")
    g = p.add_argument_group("Model and data")
    g.add_argument("--model", default=d.model,
                   help="HF id, local checkpoint folder, or preset (llama-tiny, llama-small (default), llama-3.2-1b, "
                        "llama-3.1-8b, ...).")
    g.add_argument("--dataset", default=d.dataset,
                   help="HF id, saved dataset folder, or local json/jsonl/csv/parquet with messages, conversations "
                        "(ShareGPT), prompt/completion, instruction/input/output, instruction/response, "
                        "question/answer or text columns (default: the embedded conversations).")
    g.add_argument("--seq-len", type=int, default=d.seq_len, help=f"Tokens per packed block (default {d.seq_len}).")
    g.add_argument("--long-documents", choices=["split", "error"], default=d.long_documents,
                   help="A document longer than --seq-len: split it (conversations between exchanges, each piece "
                        "restating the system turn; a single over-long answer truncated) or refuse the dataset "
                        f"(default {d.long_documents}).")
    g.add_argument("--lora", action="store_true", help="Train LoRA adapters (peft) instead of all weights.")
    g.add_argument("--qlora", action="store_true",
                   help="QLoRA: LoRA adapters (fp32) on a frozen 4-bit NF4 base (bitsandbytes, double quantisation), "
                        "computing in bf16 (--mixed-precision no: fp32). Runs on single, ddp, fsdp_full_shard, "
                        "fsdp_hybrid, zero3 (docs/qlora.md).")
    g.add_argument("--lora-r", type=int, default=d.lora_r, help=f"LoRA rank (default {d.lora_r}).")
    g.add_argument("--lora-alpha", type=int, default=d.lora_alpha, help=f"LoRA alpha (default {d.lora_alpha}).")
    g = p.add_argument_group("Training")
    length = g.add_mutually_exclusive_group()
    length.add_argument("--max-steps", type=int, default=None,
                        help=f"Optimizer steps (default {d.max_steps}, unless --num-epochs is given).")
    length.add_argument("--num-epochs", type=_positive_float, default=d.num_epochs,
                        help="Passes over the packed dataset instead of --max-steps (may be fractional); the Trainer "
                             "reshuffles every epoch.")
    g.add_argument("--global-batch-size", type=int, default=d.global_batch_size,
                   help=f"Sequences per optimizer step over all ranks (default {d.global_batch_size}).")
    g.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size,
                   help="Sequences per rank per forward (default: global batch / data-parallel ranks).")
    g.add_argument("--learning-rate", "--lr", type=float, default=d.learning_rate,
                   help=f"Peak learning rate of the cosine schedule (default {d.learning_rate}).")
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                   help=f"Linear warm-up steps (default {d.warmup_steps}, at most a tenth of --max-steps).")
    g.add_argument("--seed", type=int, default=d.seed, help=f"Seed of the model init and data order (default {d.seed}).")
    g.add_argument("--gpu-mem-gb", type=float, default=d.gpu_mem_gb,
                   help="Memory per device to plan against (default: the GPU's own; no check on CPU without it).")
    g.add_argument("--skip-plan-check", action="store_true",
                   help="Launch even if the memory planner predicts the rung cannot fit.")
    g = p.add_argument_group("Output and checkpoints")
    g.add_argument("--output-dir", default=d.output_dir, help=f"Where everything is written (default {d.output_dir}).")
    g.add_argument("--overwrite", action="store_true", help="Allow writing into a non-empty --output-dir.")
    g.add_argument("--save-steps", type=int, default=d.save_steps,
                   help=f"Write OUTPUT_DIR/checkpoint-N every N optimizer steps (0: none; default {d.save_steps}).")
    g.add_argument("--save-total-limit", type=int, default=d.save_total_limit,
                   help=f"Checkpoints kept, newest first (default {d.save_total_limit}).")
    g.add_argument("--resume", action="store_true",
                   help="Continue the run in --output-dir from its latest complete checkpoint (from scratch if it has "
                        "none); use it under launchers that restart failed jobs.")
    g.add_argument("--collective-timeout", type=_timeout_seconds, default=d.collective_timeout, metavar="SECONDS",
                   help=f"How long a rank waits in one collective before the job stops with a report naming the "
                        f"ranks that never joined (default {d.collective_timeout:g}; docs/troubleshooting.md).")
    g = p.add_argument_group("Metrics and console")
    g.add_argument("--no-wandb", dest="wandb", action="store_false",
                   help="No W&B run (default: one per run, offline unless you are logged in).")
    g.add_argument("--no-metrics", dest="metrics", action="store_false",
                   help="Leave out hfdist's memory/throughput callbacks (and W&B), to measure their cost.")
    g.add_argument("--wandb-project", default=d.wandb_project, help="W&B project (default hfdist).")
    g.add_argument("--compare-id", default=d.compare_id, help="W&B group shared by the runs of one comparison.")
    g.add_argument("--verbose", action="store_true",
                   help="Show the libraries' messages on the screen too (they always go to OUTPUT_DIR/logs/).")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The fine-tune command line."""
    p = argparse.ArgumentParser(prog=prog, description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_finetune_arguments(p)
    return p


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _timeout_seconds(text: str) -> float:
    value = float(text)
    if not value >= 1.0:  # NaN too
        raise argparse.ArgumentTypeError(
            f"{text} s is below 1 s: every collective would time out (a step's collectives take longer). Pass "
            "at least 1; the default is 300 (long enough for a first step's set-up and a large checkpoint)")
    return value


def config_from_namespace(args: argparse.Namespace) -> FinetuneConfig:
    """Parsed fine-tune options -> FinetuneConfig (other attributes of `args`, such as a CLI verb's, are left out).
    argparse refuses --max-steps together with --num-epochs (exit 2); without either, training runs the default
    --max-steps."""
    fields = FinetuneConfig.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in fields}
    if values.get("max_steps") is None:
        values["max_steps"] = FinetuneConfig.max_steps
    return FinetuneConfig(**values)


def parse_args(argv: list[str], prog: str | None = None) -> FinetuneConfig:
    """Command line -> FinetuneConfig (the only place arguments are parsed)."""
    return config_from_namespace(build_parser(prog=prog).parse_args(argv))
