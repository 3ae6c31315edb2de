"""The fine-tuning job behind scripts/finetune.py, in phases: rung -> world -> data -> model -> parallelize ->
train -> save -> summary.

The model is built and LoRA injected here; hfdist.parallel.parallelize applies the mesh rungs' parallelism (TP ->
activation checkpointing -> pipeline stages -> FSDP2); DDP and DeepSpeed are applied by the Trainer; the Trainer
(hfdist.train.trainer) verifies the strategy in effect before the first step.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from hfdist.job import console
from hfdist.job.config import ConfigError, FinetuneConfig
from hfdist.job.ladder import Rung, StrategyKind
from hfdist.job.launch import HANDED_OVER_ENV, cpu_translation, ensure_world, settle_mixed_precision
from hfdist.job.preflight import batch_layout, preflight
from hfdist.job.summary import check_blocks, first_blocks, write_summary
from hfdist.job.world import resolve_rung
from hfdist.train.resume import checkpoint_identity, resume_point

if TYPE_CHECKING:  # heavy imports (transformers, wandb) stay out of the launcher process
    from hfdist.callbacks.distributed_metrics import DistributedMetricsCallback
    from hfdist.callbacks.losses import LossRecorder
    from hfdist.callbacks.wandb_sink import WandbSink
    from hfdist.train.trainer import HfdistTrainer

__all__ = ["FinetuneConfig", "ConfigError", "finetune"]


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _training_arguments(cfg: FinetuneConfig, rung: Rung, micro: int, grad_accum: int, mixed: str, on_gpu: bool):
    from transformers import TrainingArguments

    deepspeed = None
    if rung.ds_config_path is not None:
        from hfdist.job.translate import deepspeed_config_for_run

        deepspeed, note = deepspeed_config_for_run(rung.ds_config_path, mixed, tp=rung.dims.tp, nvme_path=cfg.nvme_path)
        if note and _is_rank0():
            print(note, flush=True)
    return TrainingArguments(
        output_dir=cfg.output_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=grad_accum,
        max_steps=cfg.max_steps if cfg.num_epochs is None else -1, num_train_epochs=cfg.num_epochs or 1.0,
        learning_rate=cfg.learning_rate, lr_scheduler_type="cosine",
        warmup_steps=cfg.warmup_steps if cfg.num_epochs else min(cfg.warmup_steps, cfg.max_steps // 10),
        weight_decay=0.0, max_grad_norm=1.0,
        seed=cfg.seed, data_seed=cfg.seed, logging_steps=1, eval_strategy="no",
        save_strategy="steps" if cfg.save_steps > 0 else "no", save_steps=max(cfg.save_steps, 1),
        save_total_limit=cfg.save_total_limit,
        report_to="none", bf16=mixed == "bf16", fp16=mixed == "fp16", use_cpu=not on_gpu, deepspeed=deepspeed,
        dataloader_drop_last=True, remove_unused_columns=False, ddp_find_unused_parameters=False,
        # Mesh rungs get it from hfdist.parallel.parallelize (the Trainer cannot reach layers inside stages).
        activation_checkpointing=cfg.activation_checkpointing and not rung.owns_sharding,
        activation_checkpointing_kwargs={"use_reentrant": False} if cfg.activation_checkpointing else None,
        log_level="warning", log_level_replica="error", disable_tqdm=False,
    )


def _build_model(cfg: FinetuneConfig, tokenizer):
    from hfdist.models.build import build_model

    model = build_model(cfg.model, vocab_size=len(tokenizer), seed=cfg.seed)
    model.config.pad_token_id = tokenizer.pad_token_id
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and cfg.seq_len > limit:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's max_position_embeddings {limit}. Use "
                          f"--seq-len <= {limit}.")
    if cfg.lora:
        from peft import LoraConfig, get_peft_model

        from hfdist.models.registry import LORA_TARGETS

        torch.manual_seed(cfg.seed)  # identical adapter init on every rank: FSDP/ZeRO-3 shard what each rank has
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                          target_modules=list(LORA_TARGETS))
        model = get_peft_model(model, lora)
    return model


def _prepare_data(cfg: FinetuneConfig, tokenizer, args):
    """Packed rows on every rank (rank 0 tokenizes and packs first, the others read its cache), refused when they
    cannot fill one global batch."""
    from hfdist.data import load_raw_dataset, prepare_with_report
    from hfdist.data.preparation import check_enough_blocks

    with args.main_process_first(desc="dataset"):
        dataset, report = prepare_with_report(load_raw_dataset(cfg.dataset), tokenizer, cfg.seq_len,
                                              long_documents=cfg.long_documents)
    if _is_rank0():
        print(report.line(), flush=True)
    check_enough_blocks(len(dataset), cfg.global_batch_size, cfg.seq_len)
    return dataset


@dataclass
class Run:
    """What one rank holds once the strategy is applied: the Trainer and the callbacks that measure it."""

    trainer: HfdistTrainer
    dataset: Any
    strategy: dict[str, Any]
    losses: LossRecorder
    metrics: DistributedMetricsCallback
    sink: WandbSink
    flops_per_token: float


def _set_up(cfg: FinetuneConfig, rung: Rung, micro: int, grad_accum: int) -> Run:
    """Tokenizer, data, model, strategy and Trainer with hfdist's callbacks, on this rank."""
    from transformers.trainer_callback import ProgressCallback

    from hfdist.callbacks.distributed_metrics import DistributedMetricsCallback
    from hfdist.callbacks.losses import LossRecorder
    from hfdist.callbacks.progress import MetricsProgressCallback
    from hfdist.callbacks.wandb_logs import WandbLogsCallback
    from hfdist.callbacks.wandb_sink import WandbSink
    from hfdist.data import collator_for, load_tokenizer
    from hfdist.metrics.flops import model_flops_per_token
    from hfdist.models.presets import is_preset
    from hfdist.train.trainer import HfdistTrainer

    on_gpu = torch.cuda.is_available()
    mixed = settle_mixed_precision(rung, on_gpu)
    translation = cpu_translation(rung, on_gpu)
    if translation is not None and rung.kind is not StrategyKind.SINGLE and _is_rank0():
        print(translation.line(rung), flush=True)
    tokenizer = load_tokenizer(cfg.model, is_preset=is_preset(cfg.model))
    # Built before TrainingArguments exist: a DeepSpeed config in them makes transformers build under
    # deepspeed.zero.Init, which the shipped ZeRO-3 YAMLs turn off (zero3_init_flag: false).
    model = _build_model(cfg, tokenizer)
    collator = collator_for(model.config, cfg.seq_len)  # the model's attention implementation decides the mask
    args = _training_arguments(cfg, rung, micro, grad_accum, mixed, on_gpu)
    dataset = _prepare_data(cfg, tokenizer, args)
    if rung.owns_sharding:
        from hfdist.parallel.parallelize import parallelize

        model = parallelize(model, rung, on_gpu=on_gpu, mixed_precision=mixed,
                            activation_checkpointing=cfg.activation_checkpointing)

    nodes = rung.num_processes // int(os.environ.get("LOCAL_WORLD_SIZE", rung.num_processes))
    strategy = {"name": rung.name, "world_size": rung.num_processes, "nodes": nodes, **rung.dims.to_dict(),
                "zero_stage": rung.zero_stage, "lora": cfg.lora, "mixed_precision": mixed, "micro_batch": micro,
                "grad_accum": grad_accum, "global_batch": cfg.global_batch_size, "seq_len": cfg.seq_len,
                "pp_schedule": rung.pipeline.schedule if rung.pipeline else None,
                "pp_microbatches": rung.pipeline.n_microbatches if rung.pipeline else None,
                "device": "cuda" if on_gpu else "cpu"}
    # The table closes the run once the model is saved (hfdist.job.summary), naming where everything went.
    losses, metrics = LossRecorder(), DistributedMetricsCallback(print_table=False)
    # The command line first, the strategy in effect last: --tp/--pp/--dp-replicate asked for (or None) must not
    # hide the degrees that ran.
    sink = WandbSink(output_dir=cfg.output_dir, active=cfg.wandb and cfg.metrics and _is_rank0(),
                     project=cfg.wandb_project, name=f"{rung.name}{'-lora' if cfg.lora else ''}",
                     group=cfg.compare_id, job_type=rung.kind.value, config={**asdict(cfg), **strategy})
    flops_per_token = model_flops_per_token(model, cfg.seq_len)
    # --no-metrics keeps only the loss record: the baseline of the callbacks' cost (benchmarks/bench_callbacks.py).
    callbacks = [losses, metrics, WandbLogsCallback(sink)] if cfg.metrics else [losses]
    trainer = HfdistTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                            processing_class=tokenizer, callbacks=callbacks, rung=rung, lora=cfg.lora,
                            checkpoint_identity=checkpoint_identity(cfg, rung))
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(MetricsProgressCallback())
    return Run(trainer, dataset, strategy, losses, metrics, sink, flops_per_token)


def finetune(cfg: FinetuneConfig, entry: list[str], script_args: list[str]) -> int:
    """Run one fine-tune (handing over to `accelerate launch` first when the rung needs its own world).

    Args:
        entry: what a hand-over starts in each rank, followed by `script_args` (hfdist.job.launch.ensure_world).

    Returns:
        The process exit code.
    """
    # No --config: one process, or the world `accelerate launch --config_file X` started (read back from it).
    rung = resolve_rung(cfg)
    micro, grad_accum = batch_layout(cfg.global_batch_size, cfg.micro_batch_size, rung.dims.dp)
    if not os.environ.get(HANDED_OVER_ENV):
        # Before hand-over, or on every rank of a world another launcher started (nothing is written before these
        # checks end: the process group forms after them, and only then are files written).
        preflight(cfg, rung, micro)
    handed_over = ensure_world(rung, cfg, entry, script_args)
    if handed_over is not None:
        return handed_over
    console.start(console.log_path(cfg.output_dir, f"rank-{os.environ.get('RANK', '0')}"), cfg.verbose)

    run = _set_up(cfg, rung, micro, grad_accum)
    run.sink.start()  # W&B's start-up (seconds) stays out of the measured training loop
    resume_from = resume_point(cfg, rung)
    if resume_from is not None and _is_rank0():
        print(f"hfdist: resuming from {resume_from}", flush=True)
    train_output = run.trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    check_loss = run.trainer.batch_loss(first_blocks(run.dataset, check_blocks(rung, len(run.dataset)),
                                                     run.trainer.data_collator))
    run.trainer.save_model(cfg.output_dir)

    if _is_rank0():
        write_summary(cfg, run, train_output.metrics.get("train_runtime"), check_loss, run.metrics.ranks,
                      resume_from)
    _leave_process_group()
    return 0


def _leave_process_group() -> None:
    """Tear the group down explicitly: gloo's threads abort the process if it is left to interpreter exit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
