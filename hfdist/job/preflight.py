"""Checks that cost nothing and must fail before any process starts (or, in a world another launcher started,
before any rank writes): batch layout, the model against the rung (hfdist.parallel.fit), pipeline
(hfdist.parallel.pipeline.plan) and DeepSpeed settings against the command line and the model, the memory plan, the output folder and the checkpoint to resume. Each failure is one
paragraph naming the fix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from hfdist.config.dims import batch_layout
from hfdist.config.finetune import ConfigError, FinetuneConfig, holds_out
from hfdist.config.job_file import JOB_FILE_NAME
from hfdist.config.ladder import Rung, StrategyKind, load_rung
from hfdist.config.precision import effective_fp8, effective_mixed_precision
from hfdist.job.op_builds import check_deepspeed_build_locks
from hfdist.job.world import Node
from hfdist.parallel.context_check import check_cp_attention
from hfdist.parallel.fit import check_context_parallel, check_model_fits, plan_context
from hfdist.parallel.pipeline.plan import check_pipeline

__all__ = ["plan_context_parallel", "check_deepspeed_json", "plan_check", "check_nvme_offload",
           "check_qlora", "check_attention", "check_dense_mask", "check_evaluation", "check_lora", "check_trackers", "preflight"]


def plan_context_parallel(cfg: FinetuneConfig, rung: Rung) -> Rung:
    """The rung with its context parallelism planned for the job's model and --seq-len (hfdist.parallel.fit
    .plan_context: --cp-method, or auto's choice and why); the rung itself without cp. Run by the launcher and by
    every rank, so all apply the plan checked before launch.

    Raises:
        ContextParallelError: a method that cannot split the model or cut --seq-len, naming what would work.
    """
    if rung.dims.cp == 1:
        return rung
    from hfdist.models.presets import load_config

    return plan_context(load_config(cfg.model), rung, cfg.seq_len)


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
               "gradient_clipping": (cfg.max_grad_norm, "--max-grad-norm")}
    params = (ds.get("optimizer") or {}).get("params") or {}
    for key, want, flag in (("lr", cfg.learning_rate, "--learning-rate"),
                            ("weight_decay", cfg.weight_decay, "--weight-decay")):
        if params.get(key) is not None:
            implied[f"optimizer.params.{key}"] = (want, flag)
    values = {**{k: ds.get(k, "auto") for k in implied},
              **{f"optimizer.params.{k}": params.get(k) for k in ("lr", "weight_decay")}}
    clashes = [f"{key} is {values[key]} but {flag} makes it {want}" for key, (want, flag) in implied.items()
               if values[key] not in ("auto", None) and float(values[key]) != float(want)]
    if clashes:
        raise ConfigError(f"{rung.ds_config_path} contradicts the command line: {'; '.join(clashes)}. Set these "
                          "keys to \"auto\" (the Trainer fills them from the command line, as the shipped JSONs "
                          "do), or pass flags that match the JSON.")


def check_lora(cfg: FinetuneConfig, rung: Rung, config) -> None:
    """--lora on a rung that takes it (the rung table); --lora-target-modules must name decoder projections of the
    model; LoRA dropout cannot run under tensor parallelism (each rank would drop other entries of the same replicated input: not the one-process computation).

    Raises:
        ConfigError: naming the modules the model has, or the rung's tp degree, and the fix.
    """
    if cfg.checkpoint_base and (cfg.qlora or not cfg.lora):
        raise ConfigError("--checkpoint-base keeps a LoRA run's frozen base in its checkpoints, and this run "
                          + ("is a QLoRA run, whose 4-bit base every run quantises anew from --model (its packed codes "
                             "are not a state to resume)" if cfg.qlora else "trains every weight: its checkpoints "
                             "hold the whole model already") + ". Drop --checkpoint-base.")
    if not cfg.lora:
        return
    from hfdist.config.features import refuse_unless
    from hfdist.models.registry import LORA_TARGETS, facts_for, is_supported

    refuse_unless(rung, "lora")  # the rung table says which rungs take it, and why the others do not
    known = facts_for(config).lora_targets if is_supported(config) else LORA_TARGETS
    if is_supported(config) and facts_for(config).moe is not None:
        from hfdist.models.moe import peft_converted_targets

        converted = peft_converted_targets(config.model_type)
        asked = [m for m in cfg.lora_target_modules or () if m in converted]
        if asked:
            raise ConfigError(f"--lora-target-modules {','.join(asked)} on this mixture-of-experts model: peft 0.21 "
                              "would adapt the routed experts' stacked weights under those names, which hfdist's expert "
                              "parallelism cannot split by whole experts; hfdist keeps the routed experts frozen "
                              "(docs/moe.md). Target the attention projections (q_proj,k_proj,v_proj,o_proj).")
        known = tuple(t for t in known if t not in converted)
    unknown = [m for m in cfg.lora_target_modules or () if m not in known]
    if unknown:
        raise ConfigError(f"--lora-target-modules names {', '.join(unknown)}, which {'are' if len(unknown) > 1 else 'is'} "
                          f"not a decoder projection of this model; LoRA can adapt {', '.join(known)}. Pick from "
                          "these (comma-separated), or leave the flag out to adapt all of them.")
    if cfg.lora_dropout > 0 and rung.dims.tp > 1:
        raise ConfigError(f"--lora-dropout {cfg.lora_dropout:g} on {rung.name}, which splits the projections over "
                          f"tp={rung.dims.tp} ranks: each rank would drop other entries of the same input, which is "
                          "not the one-process computation. Use --lora-dropout 0 on tensor-parallel rungs, or a rung "
                          "without tp (fsdp_full_shard, zero3).")


def check_evaluation(cfg: FinetuneConfig, rung: Rung | None = None) -> None:
    """Evaluation settings need held-out data, --load-best needs checkpoints to choose from, and --eval-prompts a
    file of prompts (or a number of held-out rows) and a rung that can generate.

    Raises:
        ConfigError: naming the flag and what it needs; DataError / GenerationError for sources that do not go
            together or a prompts file that holds no prompts.
    """
    from hfdist.job.data import job_sources

    job_sources(cfg)  # the sources go together (weights on all or none, names, eval shares)
    held_out = holds_out(cfg)
    for flag, asked in (("--eval-steps", cfg.eval_steps), ("--load-best", cfg.load_best),
                        (f"--eval-prompts {cfg.eval_prompts}", cfg.eval_prompts is not None)):
        if asked and not held_out:
            raise ConfigError(f"{flag} evaluates on held-out data, and the job has none. Pass --eval-fraction F "
                              "(hold out that share of --dataset's rows) or --eval-dataset PATH.")
    if cfg.load_best and cfg.save_steps == 0:
        raise ConfigError("--load-best saves the best checkpoint as the model, and --save-steps 0 writes no "
                          "checkpoint to choose from. Pass --save-steps N (each checkpoint is evaluated).")
    if cfg.eval_prompts is None:
        return
    if not cfg.eval_prompts.isdigit():
        from hfdist.train.generation import read_prompt_file

        read_prompt_file(cfg.eval_prompts)
    if rung is not None and rung.pipeline is not None and rung.pipeline.schedule == "ZBVZeroBubble":
        raise ConfigError("--eval-prompts generates through the pipeline's forward-only schedule, which torch 2.13 "
                          "cannot run for ZBVZeroBubble. Use another --pp-schedule (1F1B, Interleaved1F1B, ...) with "
                          "--eval-prompts, or leave it out.")
    if rung is not None and rung.pipeline is not None and rung.dims.cp > 1:
        raise ConfigError(f"--eval-prompts on {rung.name} with cp={rung.dims.cp}: generation runs whole rows through "
                          "the pipeline's stages, which under context parallelism take a part of each row. Generate "
                          "on pipeline stages without --cp, or on a rung with cp alone (fsdp_cp), or leave "
                          "--eval-prompts out.")


def check_trackers(cfg: FinetuneConfig) -> None:
    """Every tracker --report-to names must have its package installed (they are optional dependencies).

    Raises:
        ConfigError: naming the trackers, their packages and the install command.
    """
    from hfdist.callbacks.trackers import TRACKER_PACKAGES, missing_trackers

    missing = missing_trackers(cfg.report_to) if cfg.metrics else []
    if missing:
        packages = " ".join(TRACKER_PACKAGES[m][1] for m in missing)
        raise ConfigError(f"--report-to {','.join(missing)}: {'these trackers need packages that are' if len(missing) > 1 else 'this tracker needs a package that is'} "
                          f"not installed ({packages}). Install them with pip install 'hfdist[trackers]' (or pip "
                          f"install {packages}), or leave {','.join(missing)} out of --report-to.")


def _device_memory_bytes(cfg: FinetuneConfig) -> int | None:
    """Memory per device to plan against: --gpu-mem-gb, else the GPU's own; None on CPU (nothing to check)."""
    if cfg.gpu_mem_gb is not None:
        return int(cfg.gpu_mem_gb * 1e9)
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return None


def _plan(cfg: FinetuneConfig, rung: Rung, micro: int, mem: int, attention: str, with_others: bool):
    """(the plan of every rung for this job on this world, or None without `with_others`; the plan of this job's own
    layout), or None for an architecture the planner does not count (others run unplanned on the data-parallel
    rungs)."""
    from hfdist.config.ladder import known_rung_names
    from hfdist.models.presets import DEFAULT_PRESET, load_config
    from hfdist.models.registry import is_supported
    from hfdist.plan import plan_rungs
    from hfdist.plan.bytes import Workload
    from hfdist.plan.layouts import Cluster, Layout
    from hfdist.plan.planner import plan_layout

    spec = cfg.model or DEFAULT_PRESET
    config = load_config(spec)
    if not is_supported(config):
        return None
    planned = rung if rung.kind is not StrategyKind.SINGLE else load_rung("ddp").with_num_processes(1)
    dtype = "bf16" if effective_mixed_precision(rung, torch.cuda.is_available(), cfg.mixed_precision) == "bf16" \
        else "fp32"
    cluster = Cluster(planned.num_processes)
    workload = Workload(seq=cfg.seq_len, lora=cfg.lora, lora_r=cfg.lora_r, qlora=cfg.qlora, dtype=dtype,
                        loss_chunk_size=cfg.loss_chunk_size or None, attention=attention)
    layout = Layout(planned, micro, cfg.activation_checkpointing, cfg.global_batch_size)
    mine = plan_layout(config, layout, cluster, gpu_mem_bytes=mem, workload=workload, model=spec)
    if not with_others:
        return None, mine
    others = [load_rung(n) for n in known_rung_names()]
    plan = plan_rungs(config, others, gpus_per_node=cluster.gpus_per_node, gpu_mem_bytes=mem, seq=cfg.seq_len,
                      global_batch=cfg.global_batch_size, micro_batch=None, activation_checkpointing=None,
                      lora=cfg.lora, lora_r=cfg.lora_r, qlora=cfg.qlora, dtype=dtype, model=spec,
                      loss_chunk_size=cfg.loss_chunk_size or None, attention=attention)
    return plan, mine


def plan_check(cfg: FinetuneConfig, rung: Rung, micro: int, attention: str = "auto") -> None:
    """Refuse a layout the memory planner predicts cannot fit, showing the ladder's best layouts and the one that
    would fit.

    Raises:
        ConfigError: the layout's predicted per-rank bytes exceed the device memory (--skip-plan-check overrides).
    """
    mem = _device_memory_bytes(cfg)
    if mem is None or cfg.skip_plan_check:
        return
    planned = _plan(cfg, rung, micro, mem, attention, with_others=True)
    if planned is None or planned[1].fits:
        return
    plan, mine = planned
    rec = plan.recommended
    advice = (f"The fastest predicted layout that fits is {rec.name} at {rec.layout.describe()}: {rec.command}"
              if rec is not None else f"No rung fits: {plan.hint}")
    need = f"{mine.bytes.total / 1e9:.1f} GB" if mine.bytes is not None else "more than it can hold"
    raise ConfigError(
        f"{rung.name} is predicted to need {need} per device, more than the {mem / 1e9:.1f} GB available, so it "
        f"would run out of memory. {advice}. Pass --skip-plan-check to run anyway (e.g. if the plan is too "
        f"pessimistic for your setup).\n\n{plan.table()}"
    )


def check_dense_mask(cfg: FinetuneConfig, rung: Rung, micro: int, attention: str) -> None:
    """The explicit sdpa / eager choice holds a dense (B, 1, S, S) document mask and its per-layer copies on every
    rank (hfdist.models.attention.dense_mask_bytes): refuse it where those alone exceed a rank's memory (the GPU's,
    --gpu-mem-gb, or on CPU the host's RAM shared by the rung's processes), naming the fix.

    Raises:
        ConfigError: the mask bytes do not fit (--skip-plan-check overrides).
    """
    from hfdist.models.attention import AUTO, uses_dense_mask

    if not uses_dense_mask(attention) or cfg.skip_plan_check:
        return
    mem = _device_memory_bytes(cfg) or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // rung.num_processes
    dense, free = (_plan(cfg, rung, micro, mem, a, with_others=False) for a in (attention, AUTO))
    if dense is None or dense[1].bytes is None or free[1].bytes is None:
        return
    mask = dense[1].bytes.activations - free[1].bytes.activations
    if mask > mem:
        raise ConfigError(
            f"--attn-implementation {attention} attends through a dense document mask of --seq-len {cfg.seq_len} x "
            f"{cfg.seq_len} per sequence, which with its per-layer copies needs {mask / 1e9:.1f} GB per rank on "
            f"{rung.name}, more than the {mem / 1e9:.1f} GB a rank has here. Use --attn-implementation auto (packed "
            "documents kept apart by their boundaries, nothing S x S), or a shorter --seq-len; --skip-plan-check "
            "runs anyway.")


def _check_output_dir(cfg: FinetuneConfig) -> None:
    import os

    from hfdist.console import log_dir

    out = Path(cfg.output_dir)
    existing = next(p for p in (out, *out.parents) if p.exists() or p == Path(p.anchor))
    if not existing.is_dir():
        what = "is a file" if existing == out else f"lies inside {existing}, which is a file"
        raise ConfigError(f"--output-dir {out} {what}, not a folder. Nothing was changed. Pass a folder path (a new "
                          "one, or an existing run's with --resume / --overwrite).")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--output-dir {out} cannot be written: {existing} is not writable by this user. Nothing "
                          "was changed. Pass a folder where you can write.")
    # hfdist's own library logs (OUTPUT_DIR/logs) and the job file do not count: a run that crashed before writing
    # anything else leaves only them, and they are appended to / rewritten.
    held = [p for p in out.iterdir() if p not in (log_dir(out), out / JOB_FILE_NAME)] if out.is_dir() else []
    if held and not (cfg.overwrite or cfg.resume):
        raise ConfigError(f"--output-dir {out} already holds files (a previous run?). Nothing was changed. Pass "
                          "--resume to continue that run from its latest checkpoint, a new --output-dir, or "
                          "--overwrite to replace its contents.")


def _check_seq_len(config, seq_len: int) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings {limit}. Use "
                          f"--seq-len <= {limit}.")


def check_nvme_offload(rung: Rung) -> None:
    """A rung that offloads to NVMe needs DeepSpeed's async I/O op, which DeepSpeed JIT-builds in the first rank that
    swaps (minutes into the run) unless it was pre-built at install: check here that it can be built.

    On a CUDA host DeepSpeed builds the op against the CUDA toolkit's headers and libraries (CUDA_HOME), which a
    pip-installed torch does not bring; without them the build fails inside every rank with a TypeError.

    Raises:
        ConfigError: naming what is missing and the fixes (install it, pre-build the op, or offload to CPU).
    """
    from hfdist.plan.bytes import offload_device

    if offload_device(rung) != "nvme":
        return
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get("async_io"):  # pre-built when DeepSpeed was installed (DS_BUILD_AIO=1)
        return
    import torch.utils.cpp_extension as cpp
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    missing = []
    if not builder.is_compatible(verbose=False):
        missing.append("libaio's headers and library (apt install libaio-dev, or yum install libaio-devel)")
    if (isinstance(builder, CUDAOpBuilder) and torch.cuda.is_available() and not builder.is_rocm_pytorch()
            and cpp.CUDA_HOME is None):
        missing.append(f"the CUDA toolkit (nvcc and headers; torch.utils.cpp_extension.CUDA_HOME is unset, as with "
                       f"a pip-installed torch): install the toolkit for CUDA {torch.version.cuda} and set CUDA_HOME")
    if not cpp.is_ninja_available():
        missing.append("ninja (pip install ninja)")
    if missing:
        raise ConfigError(f"{rung.name} offloads to NVMe through DeepSpeed's async I/O op, which is not pre-built "
                          f"and cannot be built here: missing {'; '.join(missing)}. Install what is missing, or "
                          "install DeepSpeed with the op pre-built (DS_BUILD_AIO=1 pip install deepspeed), or "
                          "offload to CPU memory instead (--config zero3_offload_cpu).")


def check_attention(cfg: FinetuneConfig, rung: Rung) -> str:
    """The attention implementation the run will use (hfdist.models.attention.resolve_attention).

    Raises:
        AttentionChoiceError: one that cannot keep packed documents apart or cannot run on this machine.
    """
    from hfdist.models.attention import resolve_attention

    return resolve_attention(cfg.attn_implementation, on_gpu=torch.cuda.is_available(), cp=rung.dims.cp)


def check_qlora(cfg: FinetuneConfig, rung: Rung, config) -> None:
    """--qlora on a rung that trains it, with a model whose projections split into whole 4-bit blocks per row and
    shard into whole rows, and without --compile.

    Raises:
        ConfigError / QuantizeError: naming the rung or the projection, and the fix.
    """
    if not cfg.qlora:
        return
    from hfdist.config.features import refuse_unless

    refuse_unless(rung, "qlora")  # the rung table says which rungs take it, and why the others do not
    if cfg.compile:
        raise ConfigError("--qlora does not run with --compile: bitsandbytes' 4-bit layers re-wrap their packed "
                          "weight on every call, which hfdist has not verified under torch.compile. Drop --compile.")
    from hfdist.models.quantize import check_quantizable
    from hfdist.parallel.expert_check import check_moe

    check_moe(config, rung, cfg.seq_len, qlora=True)  # an MoE model's experts have no 4-bit form: refused
    check_quantizable(config, shard=rung.dims.dp_shard * rung.dims.cp if rung.owns_sharding else 1)


def _check_gpu_settings(rung: Rung) -> None:
    """YAML settings hfdist does not implement on a GPU (hfdist.config.translate.refuse_on_gpu)."""
    if rung.yaml_path is None or not torch.cuda.is_available():
        return
    from hfdist.config.ladder import read_accelerate_yaml
    from hfdist.config.translate import refuse_on_gpu

    refuse_on_gpu(read_accelerate_yaml(rung.yaml_path), rung.owns_sharding, rung.yaml_path)


def _check_launcher(cfg: FinetuneConfig) -> None:
    """--max-failures is Ray Train's restarts; torchrun has its own."""
    if cfg.max_failures and cfg.launcher != "ray":
        raise ConfigError(f"--max-failures {cfg.max_failures} restarts Ray Train's worker group, so it needs --launcher "
                          "ray. Without Ray, launch with torchrun --max-restarts N and pass --resume (each restart "
                          "continues from the latest checkpoint; docs/multi-node.md), or drop --max-failures.")


def preflight(cfg: FinetuneConfig, rung: Rung, micro: int) -> None:
    """Checks that cost nothing and must fail before any process starts: output dir, memory plan, model vs rung."""
    from hfdist.checkpoint.resume import resume_point
    from hfdist.models.build import check_checkpoint_weights
    from hfdist.models.presets import load_config
    from hfdist.objectives.checks import check_objective

    _check_launcher(cfg)
    _check_output_dir(cfg)
    check_objective(cfg, rung)
    check_evaluation(cfg, rung)
    check_trackers(cfg)
    _check_gpu_settings(rung)
    attention = check_attention(cfg, rung)
    resume_point(cfg, rung)  # a checkpoint this run cannot resume fails here, before any process starts
    config = load_config(cfg.model)
    if cfg.compile:
        from hfdist.parallel.parallelize import check_compile

        check_compile(rung, config)
    _check_seq_len(config, cfg.seq_len)
    check_qlora(cfg, rung, config)
    check_model_fits(config, rung, cfg.seq_len)
    check_cp_attention(check_context_parallel(config, rung, cfg.seq_len), attention)
    on_gpu = torch.cuda.is_available()
    fp8 = effective_fp8(rung, on_gpu, cfg.fp8)
    if fp8 is not None:
        from hfdist.parallel.float8_check import check_fp8

        check_fp8(fp8, rung, config, seq_len=cfg.seq_len, lora=cfg.lora, compile=cfg.compile,
                  mixed_precision=effective_mixed_precision(rung, on_gpu, cfg.mixed_precision), on_gpu=on_gpu)
    check_lora(cfg, rung, config)
    check_pipeline(rung, micro, config.num_hidden_layers)
    check_deepspeed_json(rung, cfg, micro, batch_layout(cfg.global_batch_size, cfg.micro_batch_size, rung.dims.dp)[1])
    check_nvme_offload(rung)
    check_deepspeed_build_locks(rung)
    check_checkpoint_weights(cfg.model, config)
    check_dense_mask(cfg, rung, micro, attention)
    plan_check(cfg, rung, micro, attention)
    # This process starts the ranks (or is the only one): SFT's packed data before any rank (TRL's trainers tokenize
    # a DPO / GRPO job's rows themselves).
    if not Node.detect().launched and cfg.objective == "sft":
        from hfdist.job.data import prepare_before_launch

        prepare_before_launch(cfg)
