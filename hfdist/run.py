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

from hfdist.finetune_config import ConfigError, FinetuneConfig
from hfdist.ladder import Rung, load_rung
from hfdist.launch import (
    HANDED_OVER_ENV,
    cpu_translation,
    ensure_world,
    rung_from_launcher_env,
    settle_mixed_precision,
)
from hfdist.preflight import (
    batch_layout,
    checkpoint_identity,
    preflight,
    resume_point,
    with_pipeline_overrides,
)

if TYPE_CHECKING:  # heavy imports (transformers, wandb) stay out of the launcher process
    from hfdist.callbacks.losses import LossRecorder
    from hfdist.callbacks.memory import MemoryCallback
    from hfdist.callbacks.rank_metrics import RankMetricsCallback
    from hfdist.callbacks.throughput import ThroughputCallback
    from hfdist.callbacks.wandb_sink import WandbSink
    from hfdist.metrics.flops import PeakFlops
    from hfdist.trainer import HfdistTrainer

__all__ = ["FinetuneConfig", "ConfigError", "finetune", "SUMMARY_NAME"]

SUMMARY_NAME = "hfdist_summary.json"
CHECK_BLOCKS = 4  # packed blocks every rank scores after training; the saved model must reproduce that loss


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


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
    loss = runner.evaluate(batch["input_ids"], batch["labels"], batch.get("attention_mask"))
    box = [loss]
    dist.broadcast_object_list(box, group=runner.pp_group, group_src=runner.last_stage_rank)
    return float(box[0])


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
        preflight(cfg, rung, micro)
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
