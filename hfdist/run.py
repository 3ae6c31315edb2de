"""The fine-tuning job behind scripts/finetune.py: rung -> world -> data -> model -> strategy -> train -> save.

Order of the strategy steps (design.md): [LoRA] -> apply_tp -> apply_fsdp -> Trainer (DDP / DeepSpeed wrap) -> verify;
under pipeline parallelism: [LoRA] -> apply_tp (whole model) -> split into stages -> apply_fsdp per stage.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hfdist.errors import HfdistError
from hfdist.ladder import Rung, load_rung
from hfdist.launch import (
    HANDED_OVER_ENV,
    cpu_translation,
    ensure_world,
    rung_from_launcher_env,
    settle_mixed_precision,
)

if TYPE_CHECKING:  # heavy imports (transformers, wandb) stay out of the launcher process
    from hfdist.callbacks.losses import LossRecorder
    from hfdist.callbacks.memory import MemoryCallback
    from hfdist.callbacks.rank_metrics import RankMetricsCallback
    from hfdist.callbacks.throughput import ThroughputCallback
    from hfdist.callbacks.wandb_sink import WandbSink
    from hfdist.metrics.flops import PeakFlops
    from hfdist.trainer import HfdistTrainer

__all__ = ["FinetuneConfig", "ConfigError", "finetune", "batch_layout", "plan_check", "check_model_fits_rung",
           "SUMMARY_NAME"]

SUMMARY_NAME = "hfdist_summary.json"
CHECK_BLOCKS = 4  # packed blocks every rank scores after training; the saved model must reproduce that loss


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


def batch_layout(global_batch: int, micro_batch: int | None, dp: int) -> tuple[int, int]:
    """(micro batch per rank, gradient accumulation steps) for a global batch over `dp` data-parallel ranks."""
    if global_batch % dp:
        raise ConfigError(f"--global-batch-size {global_batch} is not divisible by the {dp} data-parallel ranks. "
                          f"Use a multiple of {dp}.")
    micro = micro_batch or global_batch // dp
    if global_batch % (micro * dp):
        raise ConfigError(f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size {micro} x "
                          f"{dp} data-parallel ranks = {micro * dp}. Pick sizes where it is.")
    return micro, global_batch // (micro * dp)


def with_pipeline_overrides(rung: Rung, cfg: FinetuneConfig) -> Rung:
    """The rung with --pp-schedule / --pp-microbatches applied (they override the YAML's pp settings).

    Raises:
        ConfigError: a pipeline option given for a rung without pipeline stages.
    """
    if cfg.pp_schedule is None and cfg.pp_microbatches is None:
        return rung
    if rung.pipeline is None:
        raise ConfigError(f"--pp-schedule / --pp-microbatches apply to pipeline rungs only, and {rung.name} has no "
                          "pipeline stages (pp=1). Use --config pp.yaml or 3d.yaml, or drop these options.")
    from dataclasses import replace

    pipeline = replace(rung.pipeline, **{k: v for k, v in (("schedule", cfg.pp_schedule),
                                                            ("n_microbatches", cfg.pp_microbatches)) if v is not None})
    return replace(rung, pipeline=pipeline)


def check_pipeline(rung: Rung, micro: int, num_layers: int) -> None:
    """A pipeline rung's schedule, micro-batches and stages against the batch and the model, before any process.

    Raises:
        ConfigError: naming the value that does not work and the values that would.
    """
    if rung.pipeline is None:
        return
    from hfdist.parallel.pipeline_plan import PipelineConfigError, default_stages_per_rank, validate_microbatches

    p, pp = rung.pipeline, rung.dims.pp
    try:
        per_rank = default_stages_per_rank(p.schedule)
        if pp * per_rank > num_layers:
            raise ConfigError(f"{rung.name} cuts the model into {pp * per_rank} pipeline stages (pp={pp} x "
                              f"{per_rank} per rank for {p.schedule}), but the model has only {num_layers} decoder "
                              f"layers and every stage needs one. Use pp <= {num_layers // per_rank}, a one-stage "
                              "schedule (1F1B, GPipe), or a deeper model.")
        validate_microbatches(p.schedule, p.n_microbatches, pp, per_rank)
    except PipelineConfigError as exc:
        raise ConfigError(f"{rung.name}: {exc} Set it with --pp-schedule / --pp-microbatches or in "
                          "parallelism_config_pp_* of the YAML.") from exc
    if micro % p.n_microbatches:
        raise ConfigError(f"{rung.name}: each data-parallel rank gets {micro} sequences per step, which the "
                          f"{p.n_microbatches} pipeline micro-batches must divide evenly. Pick --pp-microbatches "
                          f"dividing {micro}, or a --global-batch-size / --micro-batch-size that it divides.")


def check_deepspeed_json(rung: Rung, cfg: FinetuneConfig, micro: int, grad_accum: int) -> None:
    """Values a DeepSpeed JSON fixes (not "auto") must equal what the command line sets, or DeepSpeed and the
    Trainer would disagree mid-launch (the Trainer raises there, after the processes started).

    Raises:
        ConfigError: listing each contradiction and the fix.
    """
    if rung.ds_config_path is None:
        return
    ds = json.loads(rung.ds_config_path.read_text())
    implied = {"train_micro_batch_size_per_gpu": (micro, "--micro-batch-size"),
               "gradient_accumulation_steps": (grad_accum, "--global-batch-size / --micro-batch-size"),
               "train_batch_size": (cfg.global_batch_size, "--global-batch-size"),
               "gradient_clipping": (1.0, "hfdist's max grad norm")}
    optimizer_lr = ((ds.get("optimizer") or {}).get("params") or {}).get("lr")
    if optimizer_lr is not None:
        implied["optimizer.params.lr"] = (cfg.learning_rate, "--learning-rate")
    values = {**{k: ds.get(k, "auto") for k in implied}, "optimizer.params.lr": optimizer_lr}
    clashes = [f"{key} is {values[key]} but {flag} makes it {want}" for key, (want, flag) in implied.items()
               if values[key] not in ("auto", None) and float(values[key]) != float(want)]
    if clashes:
        raise ConfigError(f"{rung.ds_config_path} contradicts the command line: {'; '.join(clashes)}. Set these "
                          "keys to \"auto\" (the Trainer fills them from the command line, as the shipped JSONs "
                          "do), or pass flags that match the JSON.")


def _device_memory_bytes(cfg: FinetuneConfig) -> int | None:
    """Memory per device to plan against: --gpu-mem-gb, else the GPU's own; None on CPU (nothing to check)."""
    if cfg.gpu_mem_gb is not None:
        return int(cfg.gpu_mem_gb * 1e9)
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return None


def plan_check(cfg: FinetuneConfig, rung: Rung, micro: int) -> None:
    """Refuse a rung the memory planner predicts cannot fit, showing the ladder and the rung that would.

    Raises:
        ConfigError: the rung's predicted per-rank bytes exceed the device memory (--skip-plan-check overrides).
    """
    mem = _device_memory_bytes(cfg)
    if mem is None or cfg.skip_plan_check:
        return
    from hfdist.ladder import known_rung_names
    from hfdist.models import DEFAULT_PRESET, is_llama, load_config
    from hfdist.plan import plan_rungs

    spec = cfg.model or DEFAULT_PRESET
    config = load_config(spec)
    if not is_llama(config):
        return  # the planner models Llama layers only; other models run unplanned on the data-parallel rungs
    planned = rung if rung.kind != "single" else load_rung("ddp").with_num_processes(1)
    others = [load_rung(n) for n in known_rung_names() if n != planned.name]
    on_gpu = torch.cuda.is_available()
    dtype = "bf16" if (rung.mixed_precision == "bf16" and on_gpu) else "fp32"
    # A pipeline stage holds the activations of pipeline micro-batches, a fraction of the rank's batch.
    plan_micro = micro // rung.pipeline.n_microbatches if rung.pipeline is not None else micro
    plan = plan_rungs(config, [planned, *others], gpus_per_node=rung.num_processes, nodes=1,
                      gpu_mem_bytes=mem, seq=cfg.seq_len, micro_batch=plan_micro, lora=cfg.lora, lora_r=cfg.lora_r,
                      activation_checkpointing=cfg.activation_checkpointing, dtype=dtype, model=spec)
    mine = next(r for r in plan.rungs if r.name == planned.name)
    if mine.fits:
        return
    rec = plan.recommended
    advice = (f"The simplest rung that fits is {rec.name}: {rec.command}" if rec is not None
              else f"No rung fits: {plan.hint}")
    need = f"{mine.bytes.total / 1e9:.1f} GB" if mine.bytes is not None else "more than it can hold"
    raise ConfigError(
        f"{rung.name} is predicted to need {need} per device, more than the {mem / 1e9:.1f} GB available, so it "
        f"would run out of memory. {advice}. Pass --skip-plan-check to run anyway (e.g. if the plan is too "
        f"pessimistic for your setup).\n\n{plan.table()}"
    )


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _check_output_dir(cfg: FinetuneConfig) -> None:
    out = Path(cfg.output_dir)
    if out.exists() and any(out.iterdir()) and not (cfg.overwrite or cfg.resume):
        raise ConfigError(f"--output-dir {out} already holds files (a previous run?). Nothing was changed. Pass "
                          "--resume to continue that run from its latest checkpoint, a new --output-dir, or "
                          "--overwrite to replace its contents.")


def checkpoint_identity(cfg: FinetuneConfig, rung: Rung) -> dict[str, Any]:
    """What a checkpoint must share with a run that resumes it: the strategy's layout and the workload."""
    from hfdist.models import DEFAULT_PRESET

    return {"strategy": rung.name, "world_size": rung.num_processes, "dims": rung.dims.to_dict(),
            "pp_schedule": rung.pipeline.schedule if rung.pipeline else None, "lora": cfg.lora,
            "model": cfg.model or DEFAULT_PRESET, "global_batch_size": cfg.global_batch_size, "seq_len": cfg.seq_len}


def resume_point(cfg: FinetuneConfig, rung: Rung) -> Path | None:
    """With --resume: the latest complete checkpoint in --output-dir (None: start from scratch), checked to be
    resumable by this run. Without --resume: None.

    Raises:
        CheckpointError: the checkpoint was written by another strategy, world or workload.
    """
    if not cfg.resume:
        return None
    from hfdist.checkpoint import check_resumable, latest_checkpoint

    latest = latest_checkpoint(Path(cfg.output_dir))
    if latest is not None:
        check_resumable(latest, checkpoint_identity(cfg, rung))
    return latest


def _training_arguments(cfg: FinetuneConfig, rung: Rung, micro: int, grad_accum: int, mixed: str, on_gpu: bool):
    from transformers import TrainingArguments

    deepspeed = None
    if rung.ds_config_path is not None:
        deepspeed = json.loads(rung.ds_config_path.read_text())
        if cfg.nvme_path:
            for key in ("offload_param", "offload_optimizer"):
                section = deepspeed.get("zero_optimization", {}).get(key)
                if section and section.get("device") == "nvme":
                    section["nvme_path"] = cfg.nvme_path
    return TrainingArguments(
        output_dir=cfg.output_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=grad_accum,
        max_steps=cfg.max_steps, learning_rate=cfg.learning_rate, lr_scheduler_type="cosine",
        warmup_steps=min(cfg.warmup_steps, cfg.max_steps // 10), weight_decay=0.0, max_grad_norm=1.0,
        seed=cfg.seed, data_seed=cfg.seed, logging_steps=1, eval_strategy="no",
        save_strategy="steps" if cfg.save_steps > 0 else "no", save_steps=max(cfg.save_steps, 1),
        save_total_limit=cfg.save_total_limit,
        report_to="none", bf16=mixed == "bf16", use_cpu=not on_gpu, deepspeed=deepspeed,
        dataloader_drop_last=True, remove_unused_columns=False, ddp_find_unused_parameters=False,
        # Under PP, _split_pipeline enables it on the decoder layers; the Trainer cannot reach them through the stages.
        activation_checkpointing=cfg.activation_checkpointing and rung.dims.pp == 1,
        activation_checkpointing_kwargs={"use_reentrant": False} if cfg.activation_checkpointing else None,
        log_level="warning", log_level_replica="error", disable_tqdm=False,
    )


def _build_model(cfg: FinetuneConfig, tokenizer):
    from hfdist.models import DEFAULT_PRESET, build_model

    spec = cfg.model or DEFAULT_PRESET
    model = build_model(spec, vocab_size=len(tokenizer), seed=cfg.seed)
    model.config.pad_token_id = tokenizer.pad_token_id
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and cfg.seq_len > limit:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's max_position_embeddings {limit}. Use "
                          f"--seq-len <= {limit}.")
    if cfg.lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(cfg.seed)  # identical adapter init on every rank: FSDP/ZeRO-3 shard what each rank has
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj"])
        model = get_peft_model(model, lora)
    return model


def _apply_strategy(model, rung: Rung, mixed: str, on_gpu: bool, activation_checkpointing: bool = False):
    """Shard the model where hfdist owns the strategy (FSDP2, TP, PP); DDP and ZeRO are applied by the Trainer."""
    if rung.kind != "fsdp":
        return model
    from hfdist.parallel.fsdp import apply_fsdp

    assert rung.fsdp is not None
    device_type = "cuda" if on_gpu else "cpu"
    if on_gpu:
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    mesh = rung.dims.build_mesh(device_type)
    dp_mesh = mesh["dp_replicate", "dp_shard"] if rung.dims.dp_replicate > 1 else mesh["dp_shard"]
    if rung.dims.tp > 1:  # TP first, then FSDP over the data-parallel axes of the same mesh (design.md order)
        from hfdist.parallel.tensor import apply_tp

        apply_tp(model, mesh["tp"])

    def shard(module):
        return apply_fsdp(module, dp_mesh, layer_cls_name=rung.fsdp.layer_cls_to_wrap,
                          reshard_after_forward=rung.fsdp.reshard_after_forward,
                          param_dtype=torch.bfloat16 if mixed == "bf16" else None,
                          offload_params=rung.fsdp.offload_params and on_gpu)

    if rung.dims.pp == 1:
        return shard(model)
    return _split_pipeline(model, rung, mesh, shard if rung.dims.dp > 1 else None, activation_checkpointing)


def _split_pipeline(model, rung: Rung, mesh, shard, activation_checkpointing: bool):
    """Cut the (TP-split) model into this rank's pipeline stages, each FSDP-sharded over dp when dp > 1."""
    from hfdist.parallel.pipeline import PipelineRunner
    from hfdist.parallel.pipeline_model import PipelineModel, meta_skeleton

    assert rung.pipeline is not None
    if activation_checkpointing:
        # On the decoder layers, before the split: the Trainer cannot reach them through the stage wrapper.
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    skeleton = meta_skeleton(model)
    runner = PipelineRunner(model, mesh["pp"], schedule=rung.pipeline.schedule,
                            n_microbatches=rung.pipeline.n_microbatches, parallelize=shard,
                            activation_mesh=mesh["tp"] if rung.dims.tp > 1 else None)
    # FSDP2 averages gradients over the dp replicas; the loss normaliser is scaled by dp to undo that.
    return PipelineModel(runner, skeleton, loss_scale=rung.dims.dp if shard is not None else 1)


@torch.no_grad()
def _check_batch_loss(trainer, dataset) -> float:
    """Loss of the first CHECK_BLOCKS packed blocks through the trained (still distributed) model."""
    from transformers import default_data_collator

    batch = default_data_collator([dataset[i] for i in range(check_blocks(trainer.rung, len(dataset)))])
    batch = {k: v.to(trainer.args.device) for k, v in batch.items()}
    model = trainer.model_wrapped
    model.eval()
    with trainer.loss_context():
        if trainer.rung.dims.pp > 1:
            return _pipeline_check_loss(model, batch)
        loss = trainer.causal_lm_loss(model, batch)
    return float(loss.detach().float().cpu())


def check_blocks(rung: Rung, available: int) -> int:
    """How many packed blocks the post-training check scores: CHECK_BLOCKS, rounded up to a multiple of the
    pipeline micro-batches (a pipeline splits the batch evenly)."""
    n = rung.pipeline.n_microbatches if rung.pipeline is not None else 1
    return min(-(-CHECK_BLOCKS // n) * n, available)


def _pipeline_check_loss(model, batch) -> float:
    """The pipeline's forward-only loss, sent from the last stage to pp rank 0 (global rank 0 writes it)."""
    import torch.distributed as dist

    runner = model.runner
    loss = model.evaluate_loss(batch["input_ids"], batch["labels"], batch.get("attention_mask"))
    box = [loss]
    dist.broadcast_object_list(box, group=runner.pp_group, group_src=runner.last_stage_rank)
    return float(box[0])


def check_model_fits_rung(config, rung: Rung) -> None:
    """Model-specific checks of a rung, before any process or surgery: Llama for TP and PP, tp dividing its sizes.

    Raises:
        ConfigError / TPError: naming the sizes and what would work.
    """
    from hfdist.models import is_llama

    if rung.dims.pp > 1 and not is_llama(config):
        raise ConfigError(f"{rung.name} cuts the model into hfdist's Llama pipeline stages, but the model is a "
                          f"'{getattr(config, 'model_type', '?')}'. Use a Llama model, or a rung without PP "
                          "(fsdp_full_shard, zero3).")
    if rung.dims.tp > 1:
        if not is_llama(config):
            raise ConfigError(f"{rung.name} applies hfdist's Llama tensor-parallel plan, but the model is a "
                              f"'{getattr(config, 'model_type', '?')}'. Use a Llama model, or a rung without TP "
                              "(fsdp_full_shard, zero3).")
        from hfdist.parallel.tensor_check import validate_tp

        validate_tp(config, rung.dims.tp)


def _gather_ranks(record: dict) -> list[dict]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [record]
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return records


def _write_json_atomically(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _preflight(cfg: FinetuneConfig, rung: Rung, micro: int) -> None:
    """Checks that cost nothing and must fail before any process starts: output dir, memory plan, model vs rung."""
    from hfdist.models import DEFAULT_PRESET, load_config

    _check_output_dir(cfg)
    resume_point(cfg, rung)  # a checkpoint this run cannot resume fails here, before any process starts
    # Presets take the embedded tokenizer's vocabulary (1024); other models bring their own.
    config = load_config(cfg.model or DEFAULT_PRESET, 1024)
    check_model_fits_rung(config, rung)
    check_pipeline(rung, micro, config.num_hidden_layers)
    check_deepspeed_json(rung, cfg, micro, batch_layout(cfg.global_batch_size, cfg.micro_batch_size, rung.dims.dp)[1])
    plan_check(cfg, rung, micro)


@dataclass
class _Run:
    """What one rank holds once the strategy is applied: the Trainer and the callbacks that measure it."""

    trainer: HfdistTrainer
    dataset: Any
    strategy: dict[str, Any]
    losses: LossRecorder
    memory: MemoryCallback
    throughput: ThroughputCallback
    metrics: RankMetricsCallback
    sink: WandbSink
    flops_per_token: float
    peak: PeakFlops | None


def _set_up(cfg: FinetuneConfig, rung: Rung, micro: int, grad_accum: int) -> _Run:
    """Tokenizer, data, model, strategy and Trainer with hfdist's callbacks, on this rank."""
    from transformers import default_data_collator
    from transformers.trainer_callback import ProgressCallback

    from hfdist.callbacks.losses import LossRecorder
    from hfdist.callbacks.memory import MemoryCallback
    from hfdist.callbacks.progress import QuietProgressCallback
    from hfdist.callbacks.rank_metrics import RankMetricsCallback
    from hfdist.callbacks.throughput import ThroughputCallback
    from hfdist.callbacks.wandb_sink import WandbSink
    from hfdist.data import load_raw_dataset, load_tokenizer, tokenize_and_pack
    from hfdist.metrics.flops import device_peak_flops, model_flops_per_token
    from hfdist.models import PRESETS
    from hfdist.trainer import HfdistTrainer

    on_gpu = torch.cuda.is_available()
    mixed = settle_mixed_precision(rung, on_gpu)
    translation = cpu_translation(rung, on_gpu)
    if translation is not None and rung.kind != "single" and _is_rank0():
        print(translation.line(rung), flush=True)
    tokenizer = load_tokenizer(cfg.model, is_preset=cfg.model is None or cfg.model in PRESETS)
    # Built before TrainingArguments exist: a DeepSpeed config in them makes transformers build under
    # deepspeed.zero.Init, which the shipped ZeRO-3 YAMLs turn off (zero3_init_flag: false).
    model = _build_model(cfg, tokenizer)
    args = _training_arguments(cfg, rung, micro, grad_accum, mixed, on_gpu)
    with args.main_process_first(desc="dataset"):  # rank 0 tokenizes first; the others reuse its cache
        dataset = tokenize_and_pack(load_raw_dataset(cfg.dataset), tokenizer, cfg.seq_len)
    model = _apply_strategy(model, rung, mixed, on_gpu, cfg.activation_checkpointing)

    nodes = rung.num_processes // int(os.environ.get("LOCAL_WORLD_SIZE", rung.num_processes))
    strategy = {"name": rung.name, "world_size": rung.num_processes, "nodes": nodes, **rung.dims.to_dict(),
                "zero_stage": rung.zero_stage, "lora": cfg.lora, "mixed_precision": mixed, "micro_batch": micro,
                "grad_accum": grad_accum, "global_batch": cfg.global_batch_size, "seq_len": cfg.seq_len,
                "pp_schedule": rung.pipeline.schedule if rung.pipeline else None,
                "pp_microbatches": rung.pipeline.n_microbatches if rung.pipeline else None,
                "device": "cuda" if on_gpu else "cpu"}
    losses, memory, throughput = LossRecorder(), MemoryCallback(), ThroughputCallback()
    sink = WandbSink(output_dir=cfg.output_dir, active=cfg.wandb and cfg.metrics and _is_rank0(),
                     project=cfg.wandb_project, name=f"{rung.name}{'-lora' if cfg.lora else ''}",
                     group=cfg.compare_id, job_type=rung.kind, config={**strategy, **asdict(cfg)})
    flops_per_token = model_flops_per_token(model, cfg.seq_len)
    peak = device_peak_flops(args.device, torch.bfloat16 if mixed == "bf16" else torch.float32)
    metrics = RankMetricsCallback(memory, throughput, sink, flops_per_token, peak.flops if peak else None,
                                  ranks_per_replica=rung.dims.tp * rung.dims.pp)
    # --no-metrics keeps only the loss record: the baseline of the callbacks' cost (scripts/bench_callbacks.py).
    callbacks = [losses, memory, throughput, metrics] if cfg.metrics else [losses]
    trainer = HfdistTrainer(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator,
                            processing_class=tokenizer, callbacks=callbacks, rung=rung, lora=cfg.lora,
                            checkpoint_identity=checkpoint_identity(cfg, rung))
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(QuietProgressCallback())
    return _Run(trainer, dataset, strategy, losses, memory, throughput, metrics, sink, flops_per_token, peak)


def _write_summary(cfg: FinetuneConfig, run: _Run, train_runtime: float | None, check_loss: float,
                   ranks: list[dict], resume_from: Path | None) -> None:
    """Rank 0: close the W&B run with the peaks and write OUTPUT_DIR/hfdist_summary.json."""
    summary = {
        "strategy": run.strategy,
        "config": asdict(cfg),
        "losses": run.losses.losses,
        "loss_steps": run.losses.steps,
        "resumed_from": str(resume_from) if resume_from else None,
        "check_batch_loss": check_loss,
        "check_blocks": check_blocks(run.trainer.rung, len(run.dataset)),
        "train_runtime": train_runtime,
        "flops_per_token": run.flops_per_token,
        "peak_flops": {"flops": run.peak.flops, "source": run.peak.source} if run.peak else None,
        "ranks": sorted(ranks, key=lambda r: r["rank"]),
    }
    run.sink.set_summary({f"peak/{k}": max(r.get(k, 0) for r in ranks)
                          for k in ("peak_memory_bytes", "peak_allocated_bytes", "peak_reserved_bytes")
                          if any(k in r for r in ranks)})
    run_dir = run.sink.run_dir  # gone once the run is finished
    run.sink.finish()
    summary["wandb"] = {"mode": run.sink.mode, "run_dir": str(run_dir) if run_dir else None,
                        "error": run.sink.error}
    _write_json_atomically(Path(cfg.output_dir) / SUMMARY_NAME, summary)
    losses = run.losses.losses
    print(f"hfdist: {run.strategy['name']} done: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} "
          f"steps; model and {SUMMARY_NAME} in {cfg.output_dir}", flush=True)


def finetune(cfg: FinetuneConfig, script: str, script_args: list[str]) -> int:
    """Run one fine-tune (handing over to `accelerate launch` first when the rung needs more processes).

    Returns:
        The process exit code.
    """
    # No --config: one process, or the world `accelerate launch --config_file X` started (read back from it).
    rung = load_rung(cfg.config) if cfg.config else rung_from_launcher_env()
    if cfg.num_processes:
        rung = rung.with_num_processes(cfg.num_processes)
    rung = with_pipeline_overrides(rung, cfg)
    micro, grad_accum = batch_layout(cfg.global_batch_size, cfg.micro_batch_size, rung.dims.dp)
    if not os.environ.get(HANDED_OVER_ENV):
        # Before hand-over, or on every rank of a world another launcher started (nothing is written before these
        # checks end: the process group forms after them, and only then are files written).
        _preflight(cfg, rung, micro)
    handed_over = ensure_world(rung, script, script_args)
    if handed_over is not None:
        return handed_over

    run = _set_up(cfg, rung, micro, grad_accum)
    run.sink.start()  # W&B's start-up (seconds) stays out of the measured training loop
    resume_from = resume_point(cfg, rung)
    if resume_from is not None and _is_rank0():
        print(f"hfdist: resuming from {resume_from}", flush=True)
    train_output = run.trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    check_loss = _check_batch_loss(run.trainer, run.dataset)
    run.trainer.save_model(cfg.output_dir)

    own = {**run.memory.record(), **run.throughput.record()} if cfg.metrics else {}
    rates = run.metrics.rates(own["tokens_per_second"]) if cfg.metrics else {}
    ranks = _gather_ranks({"rank": int(os.environ.get("RANK", "0")), **own, **rates})
    if _is_rank0():
        _write_summary(cfg, run, train_output.metrics.get("train_runtime"), check_loss, ranks, resume_from)
    _leave_process_group()
    return 0


def _leave_process_group() -> None:
    """Tear the group down explicitly: gloo's threads abort the process if it is left to interpreter exit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
