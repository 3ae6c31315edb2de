"""The fine-tuning job behind scripts/finetune.py, in phases: rung -> world -> data -> model -> parallelize ->
train -> save -> summary.

The job is the thinnest user of hfdist.api, the calls a user's own script makes: the rung (resolved here, with the
launcher's world and the command line's overrides) becomes a Strategy, whose training arguments the Trainer gets;
prepare_model builds the model (the mesh rungs' parallelism by hfdist.parallel.parallelize: TP -> activation
checkpointing -> pipeline stages -> FSDP2; DDP and DeepSpeed are applied by the Trainer); strategy_trainer makes the
Trainer, which verifies the strategy in effect before the first step. The job adds what a comparison needs: its
callbacks, the check batch's loss, the measured load and save, the summary.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from hfdist import console
from hfdist.checkpoint.resume import checkpoint_identity, resume_line, resume_point
from hfdist.config.dims import batch_layout
from hfdist.config.finetune import FinetuneConfig, evaluation_arguments, lora_settings, optimisation_arguments
from hfdist.config.ladder import Rung, StrategyKind
from hfdist.config.precision import cpu_translation, effective_fp8, settle_mixed_precision
from hfdist.config.preemption import PREEMPTED_EXIT_CODE, advertised_grace, preempt_signals
from hfdist.job.launch import HANDED_OVER_ENV, ensure_world
from hfdist.job.preflight import plan_context_parallel, preflight
from hfdist.job.summary import (
    RunRecord,
    check_blocks,
    first_blocks,
    source_figures,
    with_rank_records,
    write_job_file,
    write_summary,
)
from hfdist.job.world import launcher_argv, resolve_rung

if TYPE_CHECKING:  # heavy imports (transformers, wandb) stay out of the launcher process
    from hfdist.api import Strategy
    from hfdist.callbacks.distributed_metrics import DistributedMetricsCallback
    from hfdist.callbacks.losses import LossRecorder
    from hfdist.callbacks.trackers import Trackers
    from hfdist.train.nonfinite import Diverged
    from hfdist.train.trainer import StrategyMixin
    from hfdist.train.watchdog import CollectiveWatch

__all__ = ["FinetuneConfig", "finetune"]


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def dataloader_settings(on_gpu: bool) -> dict[str, Any]:
    """The job's DataLoader as TrainingArguments keywords: on GPU two worker processes collate the next batches while
    the device computes (pinned, for an asynchronous copy); on CPU they would take cores from the ranks, and
    collation is O(tokens) anyway."""
    return {"dataloader_num_workers": 2 if on_gpu else 0, "dataloader_persistent_workers": on_gpu,
            "dataloader_pin_memory": on_gpu}


def _training_arguments(cfg: FinetuneConfig, strategy: Strategy):
    """The job's TrainingArguments (TRL's DPOConfig / GRPOConfig for those objectives, with theirs): the strategy's
    settings (hfdist.api.Strategy.training_arguments: batch layout, device, precision, DeepSpeed config, no placement
    by the Trainer) and the job's schedule, saving and logging."""
    from transformers import TrainingArguments

    arguments_cls, objective = TrainingArguments, {}
    if cfg.objective != "sft":
        from hfdist.objectives.trainer import objective_arguments

        arguments_cls, objective = objective_arguments(cfg)
    note = strategy.deepspeed_config()[1]
    if note and _is_rank0():
        print(note, flush=True)
    micro = strategy.batch_layout(cfg.global_batch_size, cfg.micro_batch_size)[0]
    on_gpu = torch.cuda.is_available()
    return strategy.training_arguments(
        arguments_cls, global_batch_size=cfg.global_batch_size, micro_batch_size=cfg.micro_batch_size,
        output_dir=cfg.output_dir, **optimisation_arguments(cfg), **evaluation_arguments(cfg, micro),
        seed=cfg.seed, data_seed=cfg.seed, logging_steps=1,
        save_strategy="steps" if cfg.save_steps > 0 else "no", save_steps=max(cfg.save_steps, 1),
        save_total_limit=cfg.save_total_limit, report_to="none",
        dataloader_drop_last=True, remove_unused_columns=False, ddp_find_unused_parameters=False,
        **dataloader_settings(on_gpu),
        log_level="warning", log_level_replica="error", disable_tqdm=False,
        ddp_timeout=cfg.collective_timeout,  # reaches the GPU world's group; hfdist.train.watchdog sets it on all
        **objective,
    )


def _build_model(cfg: FinetuneConfig, strategy: Strategy, tokenizer, args, attention: str, fp8: str | None):
    """This rank's model (hfdist.api.prepare_model: sharded as it is built on the mesh rungs, partitioned under
    ZeRO-3, whole on DDP / ZeRO-1/2 / single), attending with `attention` (a resolved --attn-implementation), its
    decoder projections in float8 under `fp8`, and what loading it cost this rank. A DPO job's LoRA model carries
    the frozen reference adapter TRL scores the reference with."""
    import time

    from hfdist.api import prepare_model
    from hfdist.metrics.memory import freed_memory_returned_to_os, peak_memory_bytes, start_peak_window
    from hfdist.models.build import lora_config

    with freed_memory_returned_to_os():  # the load figures count tensors, not glibc's heap
        baseline = start_peak_window(args.device)
        start = time.perf_counter()
        zero3_init = args.deepspeed_plugin.is_zero3_init_enabled() if args.deepspeed_plugin is not None else None
        model = prepare_model(strategy, cfg.model, tokenizer=tokenizer, seed=cfg.seed,
                              lora=lora_config(*lora_settings(cfg)) if cfg.lora else None, qlora=cfg.qlora,
                              activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile,
                              attn_implementation=attention, fp8=fp8, zero3_init=zero3_init,
                              reference_adapter=cfg.objective == "dpo" and cfg.lora)
        cost = {"baseline_memory_bytes": baseline, "load_peak_memory_bytes": peak_memory_bytes(args.device),
                "load_seconds": time.perf_counter() - start}
    return model, cost


def _prepare_data(cfg: FinetuneConfig, tokenizer, args):
    """Packed blocks on every rank (hfdist.job.data: rank 0 prepares first, the others read its cache or folder)."""
    import time

    from hfdist.job.data import job_data, report_lines
    from hfdist.job.world import Node

    started = time.perf_counter()
    with args.main_process_first(desc="dataset"):
        prepared = job_data(cfg, tokenizer, write=_is_rank0())
    # The process that started this world printed them already, when it prepared the data (hfdist.job.preflight).
    if _is_rank0() and Node.detect().launched and not os.environ.get(HANDED_OVER_ENV):
        print("\n".join(report_lines(cfg, prepared, time.perf_counter() - started)), flush=True)
    return prepared


@dataclass
class Run:
    """What one rank holds once the strategy is applied: the Trainer and the callbacks that measure it."""

    trainer: StrategyMixin
    dataset: Any
    strategy: dict[str, Any]
    losses: LossRecorder
    metrics: DistributedMetricsCallback
    sink: Trackers
    flops_per_token: float
    load: dict[str, float]
    sources: list[dict[str, Any]]  # each training source's name, rows and label tokens (hfdist.data.preparation)
    objective: str  # sft, dpo or grpo
    rollout_gather: str | None  # GRPO on FSDP2: "layer" or "once" (--rollout-gather); None elsewhere

    def record(self, diverged: Diverged | None = None) -> RunRecord:
        """What the summary reports of this run, once it has trained (or stopped at a non-finite step: `diverged`,
        whose loss and gradient norm, never logged, close the series)."""
        losses, steps, norms = list(self.losses.losses), list(self.losses.steps), list(self.losses.grad_norms)
        if diverged is not None and diverged.loss is not None:
            losses, steps, norms = losses + [diverged.loss], steps + [diverged.step], norms + [diverged.grad_norm]
        return RunRecord(strategy=self.strategy, losses=losses, loss_steps=steps, grad_norms=norms,
                         diverged=diverged.record() if diverged is not None else None,
                         check_blocks=check_blocks(self.trainer.rung, len(self.dataset)),
                         flops_per_token=self.flops_per_token, peak_flops=self.metrics.peak, sink=self.sink,
                         closing_table=self.metrics.closing_table, evaluations=self.losses.evaluations,
                         best_step=self.losses.best_step, sources=self.sources,
                         checkpoints=self.trainer.checkpoint_costs,
                         checkpoint_contents=self.trainer.checkpoint_contents(),
                         objective={"name": self.objective, "series": self.losses.series,
                                    "rollout_gather": self.rollout_gather})


def _set_up(cfg: FinetuneConfig, rung: Rung, micro: int, grad_accum: int, watch: CollectiveWatch) -> Run:
    """Tokenizer, data, model, strategy and Trainer with hfdist's callbacks, on this rank."""
    from transformers import Trainer
    from transformers.trainer_callback import ProgressCallback

    from hfdist.api import Strategy, strategy_trainer
    from hfdist.callbacks.distributed_metrics import DistributedMetricsCallback
    from hfdist.callbacks.losses import LossRecorder
    from hfdist.callbacks.progress import MetricsProgressCallback
    from hfdist.callbacks.tracker_logs import TrackerLogsCallback
    from hfdist.callbacks.trackers import make_trackers
    from hfdist.data import collator_for, load_tokenizer
    from hfdist.job.collector import resume_collector
    from hfdist.metrics.flops import model_flops_per_token
    from hfdist.models.attention import resolve_attention
    from hfdist.models.presets import is_preset
    from hfdist.train.evaluation import EvaluationSchedule
    from hfdist.train.injected_faults import injected_faults
    from hfdist.train.watchdog import StepWatchCallback

    resume_collector()  # the imports are done; the data, the weights and training make garbage of their own
    on_gpu = torch.cuda.is_available()
    mixed = settle_mixed_precision(rung, on_gpu, cfg.mixed_precision)
    chosen = Strategy(rung, mixed, nvme_path=cfg.nvme_path)
    fp8 = effective_fp8(rung, on_gpu, cfg.fp8)
    translation = cpu_translation(rung, on_gpu, cfg.mixed_precision, cfg.fp8)
    if translation is not None and rung.kind is not StrategyKind.SINGLE and _is_rank0():
        print(translation.line(rung), flush=True)
    if rung.dims.cp > 1 and _is_rank0():
        print(f"hfdist: context parallelism cp={rung.dims.cp} by {rung.context.method}: {rung.context.reason}",
              flush=True)
    tokenizer = load_tokenizer(cfg.model, is_preset=is_preset(cfg.model))
    attention = resolve_attention(cfg.attn_implementation, on_gpu=on_gpu, cp=rung.dims.cp)
    args = _training_arguments(cfg, chosen)
    watch.start()  # the world has formed (TrainingArguments formed it): its timeout, this rank's heartbeat
    prepared, dataset, sources = None, None, []
    if cfg.objective == "sft":
        with watch.alone("preparing data", "DATA"):  # rank 0 tokenizes while the others wait for its cache
            prepared = _prepare_data(cfg, tokenizer, args)
        dataset, sources = prepared.train, list(prepared.train_report.sources)
    else:  # TRL's trainer tokenizes the rows itself
        from hfdist.objectives.data import objective_dataset

        dataset = objective_dataset(cfg)
        sources = [{"name": cfg.objective, "format": cfg.objective, "rows": len(dataset), "label_tokens": 0}]
    model, load = _build_model(cfg, chosen, tokenizer, args, attention, fp8)
    if fp8 is not None and _is_rank0():
        from hfdist.parallel.float8_check import check_fp8

        print(check_fp8(fp8, rung, model.hfdist_prepared.skeleton.config, seq_len=cfg.seq_len, lora=cfg.lora,
                        compile=cfg.compile, mixed_precision=mixed, on_gpu=on_gpu), flush=True)
    watch.cover_groups()  # the mesh's groups
    # The attention implementation the model computes with decides the mask (or boundaries) the batches carry.
    record = model.hfdist_prepared
    collator = collator_for(record.skeleton.config, cfg.seq_len, record.attention) if prepared is not None else None

    nodes = rung.num_processes // int(os.environ.get("LOCAL_WORLD_SIZE", rung.num_processes))
    strategy = {"name": rung.name, "world_size": rung.num_processes, "nodes": nodes, **rung.dims.to_dict(),
                "zero_stage": rung.zero_stage, "lora": cfg.lora, "qlora": cfg.qlora, "mixed_precision": mixed,
                "micro_batch": micro,
                "grad_accum": grad_accum, "global_batch": cfg.global_batch_size, "seq_len": cfg.seq_len,
                "pp_schedule": rung.pipeline.schedule if rung.pipeline else None,
                "pp_microbatches": rung.pipeline.n_microbatches if rung.pipeline else None,
                "compile": cfg.compile, "fp8": fp8, "attn_implementation": attention,
                **_context_record(rung), "device": "cuda" if on_gpu else "cpu"}
    # The table closes the run once the model is saved (hfdist.job.summary), naming where everything went.
    from hfdist.objectives.trainer import SERIES

    losses, metrics = LossRecorder(SERIES[cfg.objective]), DistributedMetricsCallback(print_table=False)
    # The command line first, the strategy in effect last: --tp/--pp/--dp-replicate asked for (or None) must not
    # hide the degrees that ran.
    adapters = "-qlora" if cfg.qlora else "-lora" if cfg.lora else ""
    sink = make_trackers(cfg.report_to if cfg.metrics else (), output_dir=cfg.output_dir, active=_is_rank0(),
                         project=cfg.wandb_project, name=f"{rung.name}{adapters}",
                         group=cfg.compare_id, job_type=rung.kind.value, config={**asdict(cfg), **strategy})
    # the skeleton, not the local model: a pipeline stage holds only its own layers (and their adapters)
    flops_per_token = model_flops_per_token(record.skeleton, cfg.seq_len)
    # --no-metrics keeps only the loss record: the baseline of the callbacks' cost (benchmarks/bench_callbacks.py).
    callbacks = ([losses, metrics, TrackerLogsCallback(sink)] if cfg.metrics else [losses]) + [StepWatchCallback(watch)]
    held_out = prepared.eval if prepared is not None else None
    if held_out is not None:  # at the end, at --eval-steps, and with --load-best at every checkpoint
        callbacks.append(EvaluationSchedule(at_saves=cfg.load_best))
    # The job's callbacks replace the API's default metrics callback (print_table=False: the summary closes the run).
    common = dict(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=callbacks, metrics=False,
        checkpoint_identity=checkpoint_identity(cfg, rung), save_async=cfg.save_async,
        checkpoint_base=cfg.checkpoint_base, preempt_signals=preempt_signals(cfg.preempt_signal),
        preempt_grace=advertised_grace(launcher_argv=launcher_argv(), handed_over=bool(os.environ.get(HANDED_OVER_ENV))))
    if cfg.objective == "sft":
        trainer = strategy_trainer(Trainer, chosen)(**common, eval_dataset=held_out, data_collator=collator,
                                                    loss_chunk_size=cfg.loss_chunk_size or None)
    else:
        from hfdist.objectives.trainer import objective_inputs, objective_trainer_class

        trainer = strategy_trainer(objective_trainer_class(cfg.objective, cfg.rollout_gather == "once"), chosen)(
            **common, **objective_inputs(cfg, chosen, tokenizer, attention))
    trainer.gradient_hooks += injected_faults(int(os.environ.get("RANK", "0")), rung.name)  # tests only: HFDIST_INJECT_*
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(MetricsProgressCallback())
    if cfg.eval_prompts is not None and held_out is not None:
        from hfdist.train.generation import job_generation

        trainer.generation = job_generation(cfg.eval_prompts, cfg.eval_max_new_tokens, cfg.output_dir, tokenizer,
                                            held_out, sink.log_table)
    gather = cfg.rollout_gather if cfg.objective == "grpo" and rung.owns_sharding and rung.fsdp is not None else None
    return Run(trainer, dataset, strategy, losses, metrics, sink, flops_per_token, load, sources, cfg.objective, gather)


def finetune(cfg: FinetuneConfig, entry: list[str], script_args: list[str]) -> int:
    """Run one fine-tune (handing over to `accelerate launch` first when the rung needs its own world).

    Args:
        entry: what a hand-over starts in each rank, followed by `script_args` (hfdist.job.launch.ensure_world).

    Returns:
        The process exit code.
    """
    # No --config: one process, or the world `accelerate launch --config_file X` started (read back from it).
    rung = plan_context_parallel(cfg, resolve_rung(cfg))  # every rank applies the plan the launcher checked
    micro, grad_accum = batch_layout(cfg.global_batch_size, cfg.micro_batch_size, rung.dims.dp)
    if not os.environ.get(HANDED_OVER_ENV):
        # Before hand-over, or on every rank of a world another launcher started (nothing is written before these
        # checks end: the process group forms after them, and only then are files written).
        preflight(cfg, rung, micro)
    handed_over = ensure_world(rung, cfg, entry, script_args)
    if handed_over is not None:
        return handed_over
    console.start(console.log_path(cfg.output_dir, f"rank-{os.environ.get('RANK', '0')}"), cfg.verbose)
    code = train_in_world(cfg, rung)
    _leave_process_group()
    return code


def train_in_world(cfg: FinetuneConfig, rung: Rung) -> int:
    """What every rank of the run's world does once it is formed: set up, train, save, write the summary (rank 0).

    The job's whole path after the launch, callable again in the same world: the suite's cell worker
    (tests/e2e/cells_worker.py) trains many cases this way in one launch. The process group stays formed.

    Returns:
        The rank's exit code: 0, PREEMPTED_EXIT_CODE when a preemption stopped it, DIVERGED_EXIT_CODE when a
        non-finite loss, gradient norm or update did (hfdist.train.nonfinite; rank 0 reports the paragraph).
    """
    from hfdist.train.nonfinite import DIVERGED_EXIT_CODE, TrainingDiverged

    micro, grad_accum = batch_layout(cfg.global_batch_size, cfg.micro_batch_size, rung.dims.dp)
    if _is_rank0():
        write_job_file(cfg)
    watch = _arm_watch(cfg)
    run = _set_up(cfg, rung, micro, grad_accum, watch)
    with watch.alone("starting the trackers", "TRACKERS"):  # rank 0's tracker start-up stays out of the measured loop
        run.sink.start()
        run.sink.set_summary(source_figures(run.sources))
    resume_from = resume_point(cfg, rung)
    if resume_from is not None and _is_rank0():
        print(resume_line(resume_from, cfg, rung), flush=True)
    with watch.watching():  # a collective timeout: every surviving rank reports who never joined, and leaves
        diverged = None
        try:
            train_output = run.trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
            runtime = train_output.metrics.get("train_runtime")
        except TrainingDiverged as stop:  # raised on every rank at the same step: nothing of it was written
            diverged, runtime = stop.diverged, None
            run.trainer.preemption.disarm()
            run.trainer.land_checkpoints()  # an earlier, finite checkpoint still being written lands
        preempted = run.trainer.preempted  # a checkpoint of the last step is written: no more work in the grace
        check_loss, saved = None, {}
        if cfg.load_best and preempted is None and diverged is None:
            watch.where("loading the best checkpoint")
            run.losses.best_step = run.trainer.load_best_checkpoint()
        if cfg.save_model and preempted is None and diverged is None:
            if cfg.objective == "sft":  # the check batch is packed blocks, scored by the token loss
                watch.where("scoring the check batch")
                check_loss = run.trainer.batch_loss(first_blocks(run.dataset, check_blocks(rung, len(run.dataset)),
                                                                 run.trainer.data_collator))
            watch.where("saving the model")
            saved = _save_measured(run, cfg.output_dir)
    watch.stop()

    precision = run.trainer.precision.record(rung, run.trainer.model_wrapped, run.trainer.model)
    ranks = with_rank_records(run.metrics.ranks, {"rank": int(os.environ.get("RANK", "0")), **run.load, **saved,
                                                  "precision": precision, **_compile_record(cfg, rung, run),
                                                  **_fp8_record(run), **run.trainer.preemption.rank_record(),
                                                  **(run.trainer.rollout_record() if cfg.objective == "grpo" else {})})
    with watch.alone("writing the summary", "SUMMARY"):  # and finishing W&B's run (an upload, online)
        if _is_rank0():
            write_summary(cfg, run.record(diverged), runtime, check_loss, ranks, resume_from,
                          preempted.record() if preempted else None)
    if diverged is not None:
        if _is_rank0():
            from hfdist.errors import report_error

            report_error(diverged.paragraph())
        return DIVERGED_EXIT_CODE
    return PREEMPTED_EXIT_CODE if preempted else 0


def _context_record(rung: Rung) -> dict[str, Any]:
    """How the cp ranks split attention, and why (the summary's strategy; None without cp)."""
    context = rung.context if rung.dims.cp > 1 else None
    return {"cp_method": context and context.method, "cp_ulysses": context and context.ulysses,
            "cp_method_reason": context and context.reason}


def _compile_record(cfg: FinetuneConfig, rung: Rung, run: Run) -> dict[str, Any]:
    """Under --compile, this rank's compiled layers and dynamo's graphs after training ({} otherwise)."""
    if not cfg.compile:
        return {}
    from hfdist.parallel.parallelize import compile_record

    return {"compile": compile_record(run.trainer.model, rung.fsdp.layer_cls_to_wrap if rung.fsdp else None)}


def _fp8_record(run: Run) -> dict[str, Any]:
    """Under --fp8, what this rank computed in float8 ({} otherwise; hfdist.parallel.float8.float8_record)."""
    if run.strategy["fp8"] is None:
        return {}
    from hfdist.parallel.float8 import float8_record

    return {"fp8": float8_record(run.trainer.model)}


def _arm_watch(cfg: FinetuneConfig) -> CollectiveWatch:
    """The flight recorder on (before the process group forms; a user's own settings win), and this rank's watch."""
    from hfdist.train.watchdog import CollectiveWatch, flight_recorder_env

    for key, value in flight_recorder_env(cfg.output_dir).items():
        os.environ.setdefault(key, value)
    if torch.cuda.is_available():  # where NCCL dumps its record on a timeout
        os.makedirs(os.path.dirname(os.environ["TORCH_FR_DUMP_TEMP_FILE"]), exist_ok=True)
    return CollectiveWatch(cfg.output_dir, cfg.collective_timeout)


def _save_measured(run: Run, output_dir: str) -> dict[str, int]:
    """Save the trained model; what the save cost this rank: memory before it and at its peak (as the allocator or
    the OS sees it), and the peak bytes of the tensors the save itself created (the gathered full tensors)."""
    from hfdist.metrics.memory import LiveTensorBytes, freed_memory_returned_to_os, peak_memory_bytes, start_peak_window

    device = run.trainer.args.device
    with freed_memory_returned_to_os():  # the save figures count tensors, not glibc's heap
        before = start_peak_window(device)
        with LiveTensorBytes() as created:
            run.trainer.save_model(output_dir)
    return {"save_baseline_memory_bytes": before, "save_peak_memory_bytes": peak_memory_bytes(device),
            "save_tensor_peak_bytes": created.peak}


def _leave_process_group() -> None:
    """Tear the group down explicitly: gloo's threads abort the process if it is left to interpreter exit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
