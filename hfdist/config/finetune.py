"""FinetuneConfig: every setting of one fine-tune, its command-line parser (the only place arguments are parsed),
and its error type."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

from hfdist.config.arg_types import (
    TRACKERS,
    fraction,
    names,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    probability,
    timeout_seconds,
    trackers,
)
from hfdist.config.job_file import CommandParser, job_yaml, parse_with_job_file
from hfdist.parallel.context_check import CP_METHODS
from hfdist.errors import HfdistError

__all__ = ["FinetuneConfig", "ConfigError", "DEFAULT_LOSS_CHUNK_SIZE", "FP8_RECIPES", "USAGE", "LR_SCHEDULERS",
           "TRACKERS", "add_finetune_arguments", "build_parser", "config_from_namespace", "parse_args",
           "parse_command", "job_text", "optimisation_arguments", "evaluation_arguments", "lora_settings",
           "non_negative_int", "positive_int"]

USAGE = """Fine-tune a Hugging Face causal LM with a parallelism strategy from the config ladder.

    hfdist finetune --config fsdp_hybrid.yaml
    hfdist finetune job.yaml --max-steps 50          (a job file holding the flags; flags given here win)
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
# torchao's float8 training recipes --fp8 takes (hfdist.parallel.float8), the first the default of a bare --fp8.
FP8_RECIPES = ("tensorwise", "rowwise")
# The Trainer's learning-rate schedules that need no settings beyond warm-up and length (transformers'
# SchedulerType values; tests/unit/test_job_file.py builds each).
LR_SCHEDULERS = ("cosine", "linear", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")


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
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] | None = None
    max_steps: int = 120
    num_epochs: float | None = None
    global_batch_size: int = 16
    micro_batch_size: int | None = None
    seq_len: int = 128
    long_documents: str = "split"
    prepared_data: str | None = None
    eval_dataset: str | None = None
    eval_fraction: float | None = None
    eval_steps: int = 0
    load_best: bool = False
    learning_rate: float = 1e-3
    lr_scheduler: str = "cosine"
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    output_dir: str = "outputs/finetune"
    overwrite: bool = False
    save_steps: int = 50
    save_total_limit: int = 2
    save_async: bool = True
    resume: bool = False
    collective_timeout: float = 300.0
    num_processes: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    cp_method: str = "auto"
    dp_replicate: int | None = None
    nvme_path: str | None = None
    activation_checkpointing: bool = False
    loss_chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE
    attn_implementation: str = "auto"
    compile: bool = False
    mixed_precision: str = "auto"
    fp8: str | None = None
    pp_schedule: str | None = None
    pp_microbatches: int | None = None
    gpu_mem_gb: float | None = None
    skip_plan_check: bool = False
    report_to: tuple[str, ...] = ("wandb",)
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
    flag = argparse.BooleanOptionalAction  # every on/off setting has its --no- form, to override a job file
    g = p.add_argument_group("Job file", "Every flag below as one YAML file (keys: the flags' names with "
                             "underscores); flags given on the command line win over the file's values.")
    g.add_argument("job", nargs="?", default=None, metavar="JOB.yaml",
                   help="A job file (hfdist finetune --print-job writes one with every setting).")
    g.add_argument("--job", dest="job_file", default=None, metavar="JOB.yaml", help="The job file, as an option.")
    g.add_argument("--print-job", action="store_true",
                   help="Print the resolved job (the file's values, then the flags) as a job file, and exit.")
    g = p.add_argument_group("Strategy", "Which rung of the ladder, on how many processes, with which degrees.")
    g.add_argument("--config", default=d.config,
                   help="Rung name (ddp, zero1, fsdp_full_shard, zero2, fsdp_hybrid, zero3, pp, fsdp_tp, zero2_tp, 3d, "
                        "fsdp_cp, fsdp_tp_cp, zero3_offload_cpu, zero3_offload_nvme; with or without .yaml), a path to your own accelerate "
                        "YAML (FSDP1 keys are translated), or 'single'. Default: the world `accelerate launch "
                        "--config_file` started, else one process.")
    g.add_argument("--num-processes", type=positive_int, default=d.num_processes,
                   help="Processes to run; the data-parallel axis absorbs the change. Default: one per GPU of this "
                        "node on a GPU machine, the YAML's num_processes on CPU.")
    g.add_argument("--tp", type=positive_int, default=d.tp, help="Tensor-parallel degree (overrides the YAML's).")
    g.add_argument("--pp", type=positive_int, default=d.pp, help="Pipeline stages (overrides the YAML's).")
    g.add_argument("--cp", type=positive_int, default=d.cp,
                   help="Context-parallel degree: ranks that split every sequence (overrides the YAML's; fsdp_cp, "
                        "fsdp_tp_cp, 3d and the other FSDP2 rungs).")
    g.add_argument("--cp-method", default=d.cp_method, choices=CP_METHODS,
                   help="How the cp ranks split attention: ulysses (all-to-all over heads; cp x tp must divide "
                        "them), ring (keys and values around the cp ranks; any head count), hybrid (Ulysses inside "
                        "groups, ring across), or auto (default: ulysses where the heads allow, else hybrid, else "
                        "ring; the summary says why). Refused before launch where it cannot run "
                        "(docs/long-context.md).")
    g.add_argument("--dp-replicate", type=positive_int, default=d.dp_replicate,
                   help="Model replicas of a hybrid-sharded rung (default: one per node; overrides the YAML's).")
    g.add_argument("--mixed-precision", default=d.mixed_precision, choices=["auto", "no", "bf16"],
                   help="bf16: compute in bf16 (fp32 weights, gradient reduction and loss), on GPU and CPU alike; "
                        "no: fp32; auto (default): the config's setting on GPU, fp32 on CPU (bf16 under --qlora).")
    g.add_argument("--fp8", nargs="?", const=FP8_RECIPES[0], default=d.fp8, choices=FP8_RECIPES, metavar="RECIPE",
                   help="Compute the decoder layers' projections in float8 (torchao; recipe tensorwise (a bare --fp8) "
                        "or rowwise); the rest in --mixed-precision, weights and gradients fp32. FSDP2 gathers the "
                        "weights in float8 where it shards them (tensorwise). Runs on single, ddp and the FSDP2 / "
                        "TP / PP rungs; refused with --lora and on DeepSpeed rungs (docs/fp8.md).")
    g.add_argument("--pp-schedule", default=d.pp_schedule,
                   choices=["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"],
                   help="Pipeline schedule of a pp rung (default: the YAML's parallelism_config_pp_schedule).")
    g.add_argument("--pp-microbatches", type=positive_int, default=d.pp_microbatches,
                   help="Pipeline micro-batches per step; must divide the per-rank batch (default: the YAML's).")
    g.add_argument("--activation-checkpointing", action=flag, default=d.activation_checkpointing,
                   help="Recompute each decoder layer in backward instead of keeping its activations.")
    g.add_argument("--loss-chunk-size", type=non_negative_int, default=d.loss_chunk_size, metavar="N",
                   help=f"Compute lm_head and the fp32 cross-entropy N sequence positions at a time, so the whole "
                        f"batch's logits never exist (default {d.loss_chunk_size}; the same loss). 0: unchunked, "
                        "as transformers does.")
    g.add_argument("--attn-implementation", default=d.attn_implementation, metavar="NAME",
                   help="Attention kernel; every choice keeps packed documents apart. auto (default): flash varlen "
                        "(flash_attention_3/2) where installed on a GPU, else flex_attention; on CPU "
                        "hfdist_documents (exact per-document attention, no S x S tensor). Also: sdpa, eager (a "
                        "dense S x S document mask: memory grows with the square of --seq-len), flash_attention_2, "
                        "flash_attention_3, flex_attention (GPU), hfdist_documents, or a kernels-hub flash kernel "
                        "id. Refused before launch where it cannot run (docs/attention.md).")
    g.add_argument("--compile", action=flag, default=d.compile,
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
    g.add_argument("--seq-len", type=positive_int, default=d.seq_len, help=f"Tokens per packed block (default {d.seq_len}).")
    g.add_argument("--long-documents", choices=["split", "error"], default=d.long_documents,
                   help="A document longer than --seq-len: split it (conversations between exchanges, each piece "
                        "restating the system turn; a single over-long answer truncated) or refuse the dataset "
                        f"(default {d.long_documents}).")
    g.add_argument("--prepared-data", default=d.prepared_data, metavar="DIR",
                   help="Packed data `hfdist prepare` wrote (the job loads it in seconds, refusing one made for "
                        "another tokenizer, --seq-len or template); a folder that does not exist yet is written by "
                        "the job's own preparation, for the next run.")
    g.add_argument("--lora", action=flag, default=d.lora, help="Train LoRA adapters (peft) instead of all weights.")
    g.add_argument("--qlora", action=flag, default=d.qlora,
                   help="QLoRA: LoRA adapters (fp32) on a frozen 4-bit NF4 base (bitsandbytes, double quantisation), "
                        "computing in bf16 (--mixed-precision no: fp32); on the rungs that shard it or run it whole "
                        "(docs/qlora.md lists them; the others refuse it before launch).")
    g.add_argument("--lora-r", type=positive_int, default=d.lora_r, help=f"LoRA rank (default {d.lora_r}).")
    g.add_argument("--lora-alpha", type=positive_int, default=d.lora_alpha,
                   help=f"LoRA alpha (default {d.lora_alpha}).")
    g.add_argument("--lora-dropout", type=probability, default=d.lora_dropout, metavar="P",
                   help="Dropout on the LoRA branch's input (default 0; refused on tensor-parallel rungs, where each "
                        "rank would drop other entries of the same input).")
    g.add_argument("--lora-target-modules", type=names, default=d.lora_target_modules, metavar="NAMES",
                   help="Comma-separated decoder projections LoRA adapts, e.g. q_proj,v_proj (default: all of "
                        "them: q/k/v/o_proj, gate/up/down_proj).")
    g = p.add_argument_group("Training")
    length = g.add_mutually_exclusive_group()
    length.add_argument("--max-steps", type=positive_int, default=None,
                        help=f"Optimizer steps (default {d.max_steps}, unless --num-epochs is given).")
    length.add_argument("--num-epochs", type=positive_float, default=d.num_epochs,
                        help="Passes over the packed dataset instead of --max-steps (may be fractional); the Trainer "
                             "reshuffles every epoch.")
    g.add_argument("--global-batch-size", type=positive_int, default=d.global_batch_size,
                   help=f"Sequences per optimizer step over all ranks (default {d.global_batch_size}).")
    g.add_argument("--micro-batch-size", type=positive_int, default=d.micro_batch_size,
                   help="Sequences per rank per forward (default: global batch / data-parallel ranks).")
    g.add_argument("--learning-rate", "--lr", type=positive_float, default=d.learning_rate,
                   help=f"Peak learning rate of the schedule (default {d.learning_rate}).")
    g.add_argument("--lr-scheduler", choices=LR_SCHEDULERS, default=d.lr_scheduler,
                   help=f"Learning-rate schedule after the warm-up, the Trainer's (default {d.lr_scheduler}).")
    g.add_argument("--warmup-steps", type=non_negative_int, default=d.warmup_steps,
                   help=f"Linear warm-up steps (default {d.warmup_steps}, at most a tenth of --max-steps).")
    g.add_argument("--weight-decay", type=non_negative_float, default=d.weight_decay,
                   help=f"AdamW weight decay, on every weight but biases and norms, as the Trainer applies it "
                        f"(default {d.weight_decay:g}).")
    g.add_argument("--max-grad-norm", type=non_negative_float, default=d.max_grad_norm,
                   help=f"Clip the gradients' global norm to this (default {d.max_grad_norm:g}; 0: no clipping).")
    g.add_argument("--seed", type=int, default=d.seed, help=f"Seed of the model init and data order (default {d.seed}).")
    g.add_argument("--gpu-mem-gb", type=float, default=d.gpu_mem_gb,
                   help="Memory per device to plan against (default: the GPU's own; no check on CPU without it).")
    g.add_argument("--skip-plan-check", action=flag, default=d.skip_plan_check,
                   help="Launch even if the memory planner predicts the rung cannot fit.")
    g = p.add_argument_group("Evaluation", "Eval loss and perplexity on held-out data, on every rung.")
    held_out = g.add_mutually_exclusive_group()
    held_out.add_argument("--eval-dataset", default=d.eval_dataset, metavar="PATH|ID",
                          help="Held-out data, in any format --dataset takes (default: none).")
    held_out.add_argument("--eval-fraction", type=fraction, default=d.eval_fraction, metavar="F",
                          help="Hold out this share of --dataset's rows (whole documents, drawn by --seed) before "
                               "packing.")
    g.add_argument("--eval-steps", type=non_negative_int, default=d.eval_steps, metavar="N",
                   help="Evaluate every N optimizer steps (default 0: at the end only).")
    g.add_argument("--load-best", action=flag, default=d.load_best,
                   help="Save the checkpoint with the lowest eval loss as the model, not the last step's "
                        "(evaluates at every saved checkpoint).")
    g = p.add_argument_group("Output and checkpoints")
    g.add_argument("--output-dir", default=d.output_dir, help=f"Where everything is written (default {d.output_dir}).")
    g.add_argument("--overwrite", action=flag, default=d.overwrite, help="Allow writing into a non-empty --output-dir.")
    g.add_argument("--save-steps", type=non_negative_int, default=d.save_steps,
                   help=f"Write OUTPUT_DIR/checkpoint-N every N optimizer steps (0: none; default {d.save_steps}).")
    g.add_argument("--save-total-limit", type=positive_int, default=d.save_total_limit,
                   help=f"Checkpoints kept, newest first (default {d.save_total_limit}).")
    g.add_argument("--save-async", action=flag, default=d.save_async,
                   help="Write checkpoints in the background: the saving step copies the model and optimizer state to "
                        "host memory and training goes on while a thread writes it (default; DeepSpeed rungs always "
                        "save synchronously). --no-save-async: every rank waits until its checkpoint is written.")
    g.add_argument("--resume", action=flag, default=d.resume,
                   help="Continue the run in --output-dir from its latest complete checkpoint (from scratch if it has "
                        "none); use it under launchers that restart failed jobs.")
    g.add_argument("--collective-timeout", type=timeout_seconds, default=d.collective_timeout, metavar="SECONDS",
                   help=f"How long a rank waits in one collective before the job stops with a report naming the "
                        f"ranks that never joined (default {d.collective_timeout:g}; docs/troubleshooting.md).")
    g = p.add_argument_group("Metrics and console")
    g.add_argument("--report-to", type=trackers, default=d.report_to, metavar="NAMES",
                   help="Comma-separated trackers that get the run's series, every rank's figures included, one run "
                        "per job: wandb (offline unless you are logged in), mlflow (OUTPUT_DIR/mlruns, or "
                        "MLFLOW_TRACKING_URI), tensorboard (OUTPUT_DIR/tensorboard), trackio; none for no tracker "
                        "(default wandb). A tracker that fails warns once and training goes on.")
    g.add_argument("--no-wandb", action="store_true", help="Leave wandb out of --report-to.")
    g.add_argument("--metrics", action=flag, default=d.metrics,
                   help="hfdist's memory/throughput callbacks and trackers (--no-metrics leaves them out, to measure "
                        "their cost).")
    g.add_argument("--wandb-project", default=d.wandb_project, help="W&B project (default hfdist).")
    g.add_argument("--compare-id", default=d.compare_id, help="W&B group shared by the runs of one comparison.")
    g.add_argument("--verbose", action=flag, default=d.verbose,
                   help="Show the libraries' messages on the screen too (they always go to OUTPUT_DIR/logs/).")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The fine-tune command line."""
    p = CommandParser(prog=prog, description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_finetune_arguments(p)
    return p


def config_from_namespace(args: argparse.Namespace) -> FinetuneConfig:
    """Parsed fine-tune options -> FinetuneConfig (other attributes of `args`, such as a CLI verb's, are left out).
    argparse refuses --max-steps together with --num-epochs (exit 2); without either, training runs the default
    --max-steps. --no-wandb takes wandb out of --report-to."""
    fields = FinetuneConfig.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in fields}
    if values.get("max_steps") is None:
        values["max_steps"] = FinetuneConfig.max_steps
    if getattr(args, "no_wandb", False):
        values["report_to"] = tuple(t for t in values.get("report_to", FinetuneConfig.report_to) if t != "wandb")
    return FinetuneConfig(**values)


def parse_command(argv: list[str], prog: str | None = None) -> tuple[FinetuneConfig, bool]:
    """Command line (and the job file it names) -> (FinetuneConfig, whether --print-job asks only for the resolved
    job): the only place arguments are parsed.

    Raises:
        JobFileError: a job file that cannot be read, or holds an unknown key or a bad value (hfdist.config.job_file).
    """
    args = parse_with_job_file(build_parser(prog=prog), argv, FinetuneConfig.__dataclass_fields__)
    return config_from_namespace(args), args.print_job


def parse_args(argv: list[str], prog: str | None = None) -> FinetuneConfig:
    """Command line (and the job file it names) -> FinetuneConfig; see `parse_command`."""
    return parse_command(argv, prog)[0]


def optimisation_arguments(cfg: FinetuneConfig) -> dict[str, Any]:
    """The run's length, optimiser and learning-rate schedule as TrainingArguments keywords (the Trainer's semantics:
    weight decay on all but biases and norms, no clipping at --max-grad-norm 0). Warm-up takes at most a tenth of
    --max-steps."""
    return {"max_steps": cfg.max_steps if cfg.num_epochs is None else -1,
            "num_train_epochs": cfg.num_epochs or 1.0, "learning_rate": cfg.learning_rate,
            "lr_scheduler_type": cfg.lr_scheduler,
            "warmup_steps": cfg.warmup_steps if cfg.num_epochs else min(cfg.warmup_steps, cfg.max_steps // 10),
            "weight_decay": cfg.weight_decay, "max_grad_norm": cfg.max_grad_norm}


def evaluation_arguments(cfg: FinetuneConfig, per_rank_batch: int) -> dict[str, Any]:
    """When and how the Trainer evaluates, as TrainingArguments keywords: every --eval-steps (the job adds the last
    step, and with --load-best every checkpoint), `per_rank_batch` rows per rank, the best checkpoint by eval loss."""
    if not (cfg.eval_fraction or cfg.eval_dataset):
        return {"eval_strategy": "no"}
    out: dict[str, Any] = {"eval_strategy": "steps" if cfg.eval_steps else "no",
                           "per_device_eval_batch_size": per_rank_batch, "prediction_loss_only": True}
    if cfg.eval_steps:
        out["eval_steps"] = cfg.eval_steps
    if cfg.load_best:
        out.update(metric_for_best_model="eval_loss", greater_is_better=False)
    return out


def lora_settings(cfg: FinetuneConfig) -> tuple[int, int, float, tuple[str, ...] | None]:
    """(rank, alpha, dropout, target modules or None for all): hfdist.models.build.inject_lora's arguments."""
    return cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules


def job_text(cfg: FinetuneConfig) -> str:
    """`cfg` as a job file (every setting, resolved): what `--print-job` prints and the run saves as
    OUTPUT_DIR/hfdist_job.yaml; `hfdist finetune` on it runs the same job."""
    values = asdict(cfg)
    if cfg.num_epochs is not None:
        values["max_steps"] = None  # the two exclude each other; --num-epochs decides the length
    return job_yaml(values, build_parser(), "hfdist finetune")
