"""FinetuneConfig: every setting of one fine-tune, its command-line parser (the only place arguments are parsed),
and its error type."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace
from typing import Any

from hfdist.config.arg_types import (
    TRACKERS,
    dataset_spec,
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
from hfdist.config.options import OptionGroup, add_options, dataclass_from_namespace, option
from hfdist.config.preemption import PREEMPTED_EXIT_CODE, signal_name
from hfdist.config.rungs import RUNG_INFO
from hfdist.errors import HfdistError

__all__ = ["FinetuneConfig", "ConfigError", "DEFAULT_LOSS_CHUNK_SIZE", "FP8_RECIPES", "LAUNCHERS", "MODULE_ENTRY", "PP_SCHEDULES",
           "CP_METHODS", "OBJECTIVES", "ARITHMETIC_REWARDS", "USAGE", "LR_SCHEDULERS", "TRACKERS", "add_finetune_arguments", "build_parser",
           "config_from_namespace", "parse_args", "parse_command", "job_text", "optimisation_arguments",
           "evaluation_arguments", "holds_out", "lora_settings", "non_negative_int", "positive_int"]

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
# torch.distributed.pipelining's schedules --pp-schedule takes, by torch's class names minus "Schedule"
# (hfdist.parallel.pipeline.plan.SCHEDULES maps them to the classes).
# What starts the ranks (--launcher): accelerate's launch (hfdist's hand-over, or a world torchrun started) or Ray Train.
LAUNCHERS = ("accelerate", "ray")
# What a hand-over starts in each rank (hfdist.job.launch.ensure_world): `hfdist finetune`, as a module.
MODULE_ENTRY = ["-m", "hfdist.cli", "finetune"]
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
# How context-parallel ranks split attention (--cp-method; hfdist.parallel.context_check.plan_cp), auto first.
CP_METHODS = ("auto", "ulysses", "ring", "hybrid")
# What the job trains (--objective; hfdist.objectives): the first is the default.
OBJECTIVES = ("sft", "dpo", "grpo")
# The embedded GRPO task's reward functions (hfdist.objectives.arithmetic), by import path, as --reward-funcs takes them.
ARITHMETIC_REWARDS = ("hfdist.objectives.arithmetic:digits_only", "hfdist.objectives.arithmetic:correct_sum")
LR_SCHEDULERS = ("cosine", "linear", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")


class ConfigError(HfdistError, ValueError):
    """Command-line settings that contradict each other or the data/model."""


# The sections of `hfdist finetune --help`, of a printed job file and of docs/options.md, in this order.
JOB_FILE = OptionGroup("Job file", "Every flag below as one YAML file (keys: the flags' names with underscores); "
                       "flags given on the command line win over the file's values.")
STRATEGY = OptionGroup("Strategy", "Which rung of the ladder, on how many processes, with which degrees.")
MODEL_DATA = OptionGroup("Model and data")
TRAINING = OptionGroup("Training")
OBJECTIVE = OptionGroup("Objective", "What the job trains: next-token SFT, or preference (DPO) and online RL (GRPO) "
                        "on TRL's trainers (docs/objectives.md).")
EVALUATION = OptionGroup("Evaluation", "Eval loss and perplexity on held-out data, on every rung.")
OUTPUT = OptionGroup("Output and checkpoints")
METRICS = OptionGroup("Metrics and console")


@dataclass(frozen=True)
class FinetuneConfig:
    """Every setting of one fine-tune; precedence CLI > job file > these defaults. Each field is also its
    command-line option, job-file key and row of docs/options.md (hfdist.config.options).

    `qlora` implies `lora` (the adapters are the same; only the base they adapt is 4-bit) and, with
    mixed_precision "auto", bf16 compute on every device (QLoRA's compute dtype); --mixed-precision no keeps fp32.
    """

    # Strategy
    config: str | None = option(
        None, f"Rung name ({', '.join(name for name in RUNG_INFO if name != 'single')}; with or without .yaml), a path to your own accelerate YAML (FSDP1 "
        "keys are translated), or 'single'. Default: the world that accelerate launch's --config_file started, else "
        "one process.", group=STRATEGY)
    num_processes: int | None = option(
        None, "Processes to run; the data-parallel axis absorbs the change. Default: one per GPU of this node on a "
        "GPU machine, the YAML's num_processes on CPU.", group=STRATEGY, type=positive_int)
    launcher: str = option(
        "accelerate", "What starts the processes: accelerate (default: hfdist hands over to accelerate launch, or "
        "joins the world torchrun or Slurm started) or ray (Ray Train's TorchTrainer, one worker per GPU of the Ray "
        "cluster or --num-processes on CPU; RAY_ADDRESS names the cluster, else a local one starts; "
        "docs/clusters.md).", group=STRATEGY, choices=LAUNCHERS)
    max_failures: int = option(
        0, "Under --launcher ray: how many times Ray Train restarts the worker group after a lost worker, each time "
        "from the latest checkpoint (default {default}; torchrun's --max-restarts does this for a world it starts).",
        group=STRATEGY,
        type=non_negative_int, metavar="N")
    tp: int | None = option(None, "Tensor-parallel degree (overrides the YAML's).", group=STRATEGY, type=positive_int)
    pp: int | None = option(None, "Pipeline stages (overrides the YAML's).", group=STRATEGY, type=positive_int)
    cp: int | None = option(
        None, "Context-parallel degree: ranks that each hold 1/cp of every sequence (overrides the YAML's; "
        "docs/long-context.md).", group=STRATEGY, type=positive_int)
    cp_method: str = option(
        "auto", "How the cp ranks split attention: ulysses (all-to-all over heads; cp x tp must divide them), ring "
        "(keys and values passed around the cp ranks; any head count), hybrid (Ulysses inside groups, a ring across), "
        "or auto (default: ulysses where the heads allow, else hybrid, else ring; the run says why). Refused before "
        "launch where it cannot run (docs/long-context.md).", group=STRATEGY, choices=CP_METHODS)
    dp_replicate: int | None = option(
        None, "Model replicas of a hybrid-sharded rung (default: one per node; overrides the YAML's).",
        group=STRATEGY, type=positive_int)
    ep: int | None = option(
        None, "Expert-parallel degree of a mixture-of-experts model on fsdp_ep or fsdp_tp: each of ep ranks holds 1/ep "
        "of every MoE layer's experts, borrowed from the data-parallel ranks (overrides the YAML's; docs/moe.md).",
        group=STRATEGY, type=positive_int)
    mixed_precision: str = option(
        "auto", "bf16: compute in bf16 (fp32 weights, gradient reduction and loss), on GPU and CPU alike; no: fp32; "
        "auto (default): the config's setting on GPU, fp32 on CPU (bf16 under --qlora).", group=STRATEGY,
        choices=("auto", "no", "bf16"))
    fp8: str | None = option(
        None, "Compute the decoder layers' projections in float8 (torchao; recipe tensorwise (a bare --fp8) or "
        "rowwise); the rest in --mixed-precision, weights and gradients fp32. FSDP2 gathers the weights in float8 "
        "where it shards them (tensorwise). Runs on single, ddp and the FSDP2 / TP / PP rungs; refused with --lora "
        "and on DeepSpeed rungs (docs/fp8.md).", group=STRATEGY, nargs="?", const=FP8_RECIPES[0],
        choices=FP8_RECIPES, metavar="RECIPE")
    pp_schedule: str | None = option(
        None, "Pipeline schedule of a pp rung (default: the YAML's parallelism_config_pp_schedule).", group=STRATEGY,
        choices=PP_SCHEDULES)
    pp_microbatches: int | None = option(
        None, "Pipeline micro-batches per step; must divide the per-rank batch (default: the YAML's).",
        group=STRATEGY, type=positive_int)
    activation_checkpointing: bool = option(
        False, "Recompute each decoder layer in backward instead of keeping its activations.", group=STRATEGY)
    loss_chunk_size: int = option(
        DEFAULT_LOSS_CHUNK_SIZE, "Compute lm_head and the fp32 cross-entropy N sequence positions at a time, so the "
        "whole batch's logits never exist (default {default}; the same loss). 0: unchunked, as transformers does.",
        group=STRATEGY, type=non_negative_int, metavar="N")
    attn_implementation: str = option(
        "auto", "Attention kernel; every choice keeps packed documents apart. auto (default): flash varlen "
        "(flash_attention_3/2) where installed on a GPU, else flex_attention; on CPU hfdist_documents (exact "
        "per-document attention, no S x S tensor). Also: sdpa, eager (a dense S x S document mask: memory grows with "
        "the square of --seq-len), flash_attention_2, flash_attention_3, flex_attention (GPU), hfdist_documents, or "
        "a kernels-hub flash kernel id. Refused before launch where it cannot run (docs/attention.md).",
        group=STRATEGY, metavar="NAME")
    compile: bool = option(
        False, "torch.compile each decoder layer (regional; inductor on CPU and GPU). Runs on single, ddp and the "
        "FSDP2 / TP rungs; refused on pipeline, context-parallel and DeepSpeed rungs, and for MoE models.",
        group=STRATEGY)
    nvme_path: str | None = option(None, "NVMe folder for zero3_offload_nvme.", group=STRATEGY)
    # Model and data
    model: str | None = option(
        None, "HF id, local checkpoint folder, or preset (llama-tiny, llama-small (default), llama-3.2-1b, "
        "llama-3.1-8b, ...).", group=MODEL_DATA)
    dataset: tuple[str, ...] | None = option(
        None, "HF id, saved dataset folder, or local json/jsonl/csv/parquet with messages, conversations "
        "(ShareGPT), prompt/completion, instruction/input/output, instruction/response, question/answer or text "
        "columns (default: the embedded conversations). Give it again for a mixture, each source with its settings "
        "after commas: weight=W (its share of the label tokens), epochs=E, format=F, split=S, eval_fraction=F, "
        "name=N, column.FIELD=NAME, e.g. --dataset a.jsonl,weight=0.7 --dataset b.parquet,weight=0.3; in a job file "
        "datasets: a list of {path, weight, ...} (docs/data.md).", group=MODEL_DATA, type=dataset_spec,
        metavar="PATH[,key=value...]", aliases=("--datasets",), repeatable=True)
    seq_len: int = option(128, "Tokens per packed block (default {default}).", group=MODEL_DATA, type=positive_int)
    long_documents: str = option(
        "split", "A document longer than --seq-len: split it (conversations between exchanges, each piece "
        "restating the system turn; a single over-long answer truncated) or refuse the dataset (default "
        "{default}).", group=MODEL_DATA, choices=("split", "error"))
    prepared_data: str | None = option(
        None, "Packed data `hfdist prepare` wrote (the job loads it in seconds, refusing one made for another "
        "tokenizer, --seq-len or template); a folder that does not exist yet is written by the job's own "
        "preparation, for the next run.", group=MODEL_DATA, metavar="DIR")
    lora: bool = option(False, "Train LoRA adapters (peft) instead of all weights.", group=MODEL_DATA)
    qlora: bool = option(
        False, "QLoRA: LoRA adapters (fp32) on a frozen 4-bit NF4 base (bitsandbytes, double quantisation), "
        "computing in bf16 (--mixed-precision no: fp32); on the rungs that shard it or run it whole (docs/qlora.md "
        "lists them; the others refuse it before launch).", group=MODEL_DATA)
    lora_r: int = option(16, "LoRA rank (default {default}).", group=MODEL_DATA, type=positive_int)
    lora_alpha: int = option(32, "LoRA alpha (default {default}).", group=MODEL_DATA, type=positive_int)
    lora_dropout: float = option(
        0.0, "Dropout on the LoRA branch's input (default 0; refused on tensor-parallel rungs, where each rank would "
        "drop other entries of the same input).", group=MODEL_DATA, type=probability, metavar="P")
    lora_target_modules: tuple[str, ...] | None = option(
        None, "Comma-separated decoder projections LoRA adapts, e.g. q_proj,v_proj (default: all of them: "
        "q/k/v/o_proj, gate/up/down_proj).", group=MODEL_DATA, type=names, metavar="NAMES")
    # Training
    max_steps: int = option(
        120, "Optimizer steps (default {default}, unless --num-epochs is given).", group=TRAINING, type=positive_int,
        exclusive="length")
    num_epochs: float | None = option(
        None, "Passes over the packed dataset instead of --max-steps (may be fractional); the Trainer reshuffles "
        "every epoch.", group=TRAINING, type=positive_float, exclusive="length")
    global_batch_size: int = option(
        16, "Sequences per optimizer step over all ranks (default {default}).", group=TRAINING, type=positive_int)
    micro_batch_size: int | None = option(
        None, "Sequences per rank per forward (default: global batch / data-parallel ranks).", group=TRAINING,
        type=positive_int)
    learning_rate: float = option(
        1e-3, "Peak learning rate of the schedule (default {default}).", group=TRAINING, type=positive_float,
        aliases=("--lr",))
    lr_scheduler: str = option(
        "cosine", "Learning-rate schedule after the warm-up, the Trainer's (default {default}).", group=TRAINING,
        choices=LR_SCHEDULERS)
    warmup_steps: int = option(
        10, "Linear warm-up steps (default {default}, at most a tenth of --max-steps).", group=TRAINING,
        type=non_negative_int)
    weight_decay: float = option(
        0.0, "AdamW weight decay, on every weight but biases and norms, as the Trainer applies it (default "
        "{default}).", group=TRAINING, type=non_negative_float)
    max_grad_norm: float = option(
        1.0, "Clip the gradients' global norm to this (default {default}; 0: no clipping).", group=TRAINING,
        type=non_negative_float)
    seed: int = option(0, "Seed of the model init and data order (default {default}).", group=TRAINING, type=int)
    # Objective
    objective: str = option(
        "sft", "sft (default): the next-token loss on packed --dataset blocks; dpo: TRL's DPOTrainer on prompt / "
        "chosen / rejected rows (default: pairs made from the embedded conversations), a frozen reference model "
        "sharded like the policy; grpo: TRL's GRPOTrainer on prompt rows, --num-generations sampled completions per "
        "prompt scored by --reward-funcs (default: the embedded arithmetic task). dpo and grpo are refused on "
        "pipeline rungs and with --qlora, --fp8, --compile, context parallelism or evaluation, before launch.",
        group=OBJECTIVE, choices=OBJECTIVES)
    reward_funcs: tuple[str, ...] | None = option(
        None, "GRPO: comma-separated reward functions by import path, module:function (TRL's signature: "
        "f(prompts, completions, **columns) -> list[float]); their sum is the reward (default: "
        f"{','.join(ARITHMETIC_REWARDS)}, the embedded task's).", group=OBJECTIVE, type=names, metavar="MOD:FN,...")
    num_generations: int = option(
        4, "GRPO: completions sampled per prompt, the group each advantage is relative to; must divide "
        "--global-batch-size (default {default}).", group=OBJECTIVE, type=positive_int, metavar="G")
    max_completion_length: int = option(
        16, "GRPO: most tokens a sampled completion has (default {default}).", group=OBJECTIVE, type=positive_int,
        metavar="L")
    rollout_gather: str = option(
        "layer", "GRPO on a rung whose FSDP2 shards the model: layer (default) generates as training runs, each "
        "layer all-gathered for every generated token; once all-gathers the whole model once per rollout and "
        "generates on it (far fewer collectives; the whole model in the compute dtype held on every rank meanwhile: "
        "`hfdist plan --objective grpo --rollout-gather once` counts it).", group=OBJECTIVE,
        choices=("layer", "once"))
    beta: float | None = option(
        None, "DPO: the preference loss's temperature (TRL's default 0.1). GRPO trains without a KL term (0, TRL's "
        "default); a KL coefficient above 0 is refused, as its reference model is not sharded yet.", group=OBJECTIVE,
        type=non_negative_float)
    gpu_mem_gb: float | None = option(
        None, "Memory per device to plan against (default: the GPU's own; no check on CPU without it).",
        group=TRAINING, type=float)
    skip_plan_check: bool = option(
        False, "Launch even if the memory planner predicts the rung cannot fit.", group=TRAINING)
    # Evaluation
    eval_dataset: str | None = option(
        None, "Held-out data, in any format --dataset takes (default: none).", group=EVALUATION, metavar="PATH|ID",
        exclusive="held_out")
    eval_fraction: float | None = option(
        None, "Hold out this share of --dataset's rows (whole documents, drawn by --seed) before packing.",
        group=EVALUATION, type=fraction, metavar="F", exclusive="held_out")
    eval_steps: int = option(
        0, "Evaluate every N optimizer steps (default 0: at the end only).", group=EVALUATION, type=non_negative_int,
        metavar="N")
    load_best: bool = option(
        False, "Save the checkpoint with the lowest eval loss as the model, not the last step's (evaluates at every "
        "saved checkpoint).", group=EVALUATION)
    eval_prompts: str | None = option(
        None, "Prompts the model answers at every evaluation, greedily: a JSON Lines file (a {\"prompt\": ...} or "
        "{\"messages\": [...]} object a line) or N, the first N held-out documents' prompts; written to "
        "OUTPUT_DIR/generations/step-N.jsonl and to the trackers as a table.", group=EVALUATION, metavar="FILE|N")
    eval_max_new_tokens: int = option(
        64, "Most tokens a generation adds (default {default}; it stops at EOS).", group=EVALUATION,
        type=positive_int, metavar="N")
    # Output and checkpoints
    output_dir: str = option("outputs/finetune", "Where everything is written (default {default}).", group=OUTPUT)
    overwrite: bool = option(False, "Allow writing into a non-empty --output-dir.", group=OUTPUT)
    save_model: bool = option(
        True, "Save the trained model (or adapter) to --output-dir at the end and score the check batch it must "
        "reproduce (default); --no-save-model leaves both out (a throughput run, `hfdist tune`'s probes).",
        group=OUTPUT)
    save_steps: int = option(
        50, "Write OUTPUT_DIR/checkpoint-N every N optimizer steps (0: none; default {default}).", group=OUTPUT,
        type=non_negative_int)
    save_total_limit: int = option(
        2, "Checkpoints kept, newest first (default {default}).", group=OUTPUT, type=positive_int)
    save_async: bool | None = option(
        None, "Write checkpoints in the background: the saving step copies the model and optimizer state to host "
        "memory and training goes on while a thread writes it. --no-save-async: every rank waits until its "
        "checkpoint is written. Default: in the background where training runs on GPUs, synchronously on a "
        "machine without any, whose cores all train (docs/checkpoints.md); DeepSpeed rungs always save "
        "synchronously.", group=OUTPUT)
    checkpoint_base: bool = option(
        False, "LoRA: checkpoints hold the frozen base weights too. By default a LoRA run's checkpoints hold the "
        "adapters, their optimizer state, the scheduler, RNG and data position, and a fingerprint of the base, which "
        "--resume and `hfdist checkpoint export` rebuild from --model (docs/checkpoints.md).", group=OUTPUT)
    resume: bool = option(
        False, "Continue the run in --output-dir from its latest complete checkpoint (from scratch if it has none); "
        "use it under launchers that restart failed jobs.", group=OUTPUT)
    preempt_signal: str | None = option(
        None, "A signal that preempts the run besides SIGTERM and SIGUSR1 (a name such as SIGUSR2, or a number): "
        "received by any rank, every rank writes a checkpoint at the end of the step in progress and the job exits "
        f"{PREEMPTED_EXIT_CODE}; --resume continues it (docs/clusters.md).", group=OUTPUT, type=signal_name,
        metavar="SIGNAL")
    collective_timeout: float = option(
        300.0, "How long a rank waits in one collective before the job stops with a report naming the ranks that "
        "never joined (default {default}; docs/troubleshooting.md).", group=OUTPUT, type=timeout_seconds,
        metavar="SECONDS")
    # Metrics and console
    report_to: tuple[str, ...] = option(
        ("wandb",), "Comma-separated trackers that get the run's series, every rank's figures included, one run per "
        "job: wandb (offline unless you are logged in), mlflow (OUTPUT_DIR/mlruns, or MLFLOW_TRACKING_URI), "
        "tensorboard (OUTPUT_DIR/tensorboard), trackio; none for no tracker (default {default}). A tracker that fails "
        "warns once and training goes on.", group=METRICS, type=trackers, metavar="NAMES")
    metrics: bool = option(
        True, "hfdist's memory/throughput callbacks and trackers (--no-metrics leaves them out, to measure their "
        "cost).", group=METRICS)
    wandb_project: str | None = option(None, "W&B project (default hfdist).", group=METRICS)
    compare_id: str | None = option(None, "W&B group shared by the runs of one comparison.", group=METRICS)
    verbose: bool = option(
        False, "Show the libraries' messages on the screen too (they always go to OUTPUT_DIR/logs/).", group=METRICS)

    def __post_init__(self) -> None:
        if isinstance(self.dataset, (str, list)):  # one spec, or the command line's list: a tuple of specs
            object.__setattr__(self, "dataset", (self.dataset,) if isinstance(self.dataset, str) else
                               tuple(self.dataset))
        if self.qlora:
            object.__setattr__(self, "lora", True)
            if self.mixed_precision == "auto":
                object.__setattr__(self, "mixed_precision", "bf16")


def add_finetune_arguments(p: argparse.ArgumentParser) -> None:
    """The fine-tune options (scripts/finetune.py, `hfdist finetune` and `hfdist prepare` share them): the job file
    first, then every FinetuneConfig field (hfdist.config.options), in accelerate's style: argument groups, each
    option a sentence with its default."""
    g = p.add_argument_group(JOB_FILE.title, JOB_FILE.description)
    g.add_argument("job", nargs="?", default=None, metavar="JOB.yaml",
                   help="A job file (hfdist finetune --print-job writes one with every setting).")
    g.add_argument("--job", dest="job_file", default=None, metavar="JOB.yaml", help="The job file, as an option.")
    g.add_argument("--print-job", action="store_true",
                   help="Print the resolved job (the file's values, then the flags) as a job file, and exit.")
    add_options(p, FinetuneConfig)
    metrics = next(g for g in p._action_groups if g.title == METRICS.title)
    metrics.add_argument("--no-wandb", action="store_true", help="Leave wandb out of --report-to.")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The fine-tune command line."""
    p = CommandParser(prog=prog, description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_finetune_arguments(p)
    return p


def config_from_namespace(args: argparse.Namespace) -> FinetuneConfig:
    """Parsed fine-tune options -> FinetuneConfig (other attributes of `args`, such as a CLI verb's, are left out).
    argparse refuses --max-steps together with --num-epochs (exit 2); without either, training runs the default
    --max-steps. --no-wandb takes wandb out of --report-to."""
    config = dataclass_from_namespace(FinetuneConfig, args)
    if getattr(args, "no_wandb", False):
        config = replace(config, report_to=tuple(t for t in config.report_to if t != "wandb"))
    return config


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


def holds_out(cfg: FinetuneConfig) -> bool:
    """Whether the job has held-out data: --eval-fraction, --eval-dataset, or a source's own eval_fraction."""
    from hfdist.config.sources import parse_source

    return bool(cfg.eval_fraction or cfg.eval_dataset or any(parse_source(s).eval_fraction for s in cfg.dataset or ()))


def evaluation_arguments(cfg: FinetuneConfig, per_rank_batch: int) -> dict[str, Any]:
    """When and how the Trainer evaluates, as TrainingArguments keywords: every --eval-steps (the job adds the last
    step, and with --load-best every checkpoint), `per_rank_batch` rows per rank, the best checkpoint by eval loss."""
    if not holds_out(cfg):
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
