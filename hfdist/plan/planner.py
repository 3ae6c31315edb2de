"""The planner: every rung's layouts on a cluster (degrees, micro-batch, recompute: hfdist.plan.layouts), each
one's per-rank bytes (hfdist.plan.bytes) and predicted step time (hfdist.plan.cost), each rung's best layout, and the
fastest one that fits with its launch command, from the model config alone (no weights; a 405B plan takes a
fraction of a second).

A rung's best layout is its fastest predicted one that fits (or, when none fits, its leanest); the recommendation is
the fastest predicted of the rungs' best, offload rungs only when nothing else fits. When nothing fits, or only an
offload rung does, the plan names the cheapest single change after which a rung fits, found by planning again with
it (so the advice is true of the planner).

    plan = plan_rungs(load_config("llama-3.1-70b"), gpus_per_node=8, nodes=4, gpu_mem_bytes=80 * GB, seq=131072,
                      activation_checkpointing=True, global_batch=32)
    print(plan.table()); plan.to_json(); plan.recommended.command
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from typing import Any, Iterable

from hfdist.config.finetune import DEFAULT_LOSS_CHUNK_SIZE
from hfdist.config.ladder import Rung, known_rung_names, load_rung
from hfdist.models.attention import AUTO, uses_dense_mask
from hfdist.models.registry import LORA_TARGETS
from hfdist.models.shape import ModelShape
from hfdist.parallel.float8_check import check_fp8, float8_params_per_layer
from hfdist.plan.bytes import GB, PlanError, RankBytes, Workload, offload_device, rung_rank_bytes
from hfdist.plan.cost import NOMINAL_HARDWARE, Hardware, StepCost, step_cost
from hfdist.plan.expert_bytes import moe_note
from hfdist.plan.layouts import Cluster, Layout, Pins, rung_layouts
from hfdist.plan.render import SPEED_TIE, Plan, RungPlan

__all__ = ["Plan", "RungPlan", "Assessment", "plan_rungs", "plan_layout", "assess_layouts", "plan_order", "Cluster",
           "Pins", "SPEED_TIE"]

def plan_order(rungs: Iterable[Rung]) -> list[Rung]:
    """Rungs in the order the plan lists them: the rung table's plan_order ((single,) ddp, zero1, zero2,
    fsdp_full_shard, zero3, fsdp_hybrid, pp, fsdp_tp, zero2_tp, 3d, fsdp_cp), then rungs the table does not list,
    offload rungs last."""
    def key(r: Rung) -> tuple:
        return (offload_device(r) != "none", r.info is None, r.info.plan_order if r.info else 0, r.name)

    return sorted(rungs, key=key)


def _command(layout: Layout, model: str, w: Workload) -> str:
    flags = layout.flags()
    parts = ["accelerate", "launch", "scripts/finetune.py", *flags[:4], "--model", model]
    if w.objective != "sft":
        parts += ["--objective", w.objective]
    if w.objective == "grpo":
        parts += ["--num-generations", str(w.generations), "--max-completion-length", str(w.completion_len)]
        parts += ["--rollout-gather", "once"] if w.rollout_gather == "once" else []
    if w.lora:
        parts += ["--qlora" if w.qlora else "--lora", "--lora-r", str(w.lora_r)]
    parts += ["--seq-len", str(w.seq), *flags[4:]]
    if w.attention != AUTO:
        parts += ["--attn-implementation", w.attention]
    if w.fp8:
        parts += ["--fp8", w.fp8]
    return shlex.join(parts)


def _check_takes_qlora(rung: Rung) -> None:
    """Raise PlanError (one line) unless the rung table says `rung` trains QLoRA."""
    from hfdist.config.features import refuse_unless
    from hfdist.config.finetune import ConfigError

    try:
        refuse_unless(rung, "qlora")
    except ConfigError as exc:
        raise PlanError("does not take --qlora (docs/qlora.md)") from exc


def _check_holds_moe(config, rung: Rung, w: Workload) -> None:
    """Raise PlanError (one line) for an MoE model on a rung that does not train MoE models, or under --qlora
    (hfdist.parallel.expert_check)."""
    from hfdist.parallel.expert_check import moe_facts, moe_refusal

    if moe_facts(config) is None:
        return
    if (why := moe_refusal(rung)) is not None:
        raise PlanError(f"does not hold MoE models: {why}")
    if w.qlora:
        raise PlanError("--qlora: an MoE model's stacked experts have no 4-bit form here (docs/moe.md)")


def _refusal(config, layout: Layout, w: Workload) -> str:
    """Why this layout cannot run the workload ("" when it can): the checks the job makes before launch."""
    rung = layout.rung
    try:
        _check_holds_moe(config, rung, w)
        if w.qlora:
            _check_takes_qlora(rung)
        if w.fp8:
            check_fp8(w.fp8, rung, config, seq_len=w.seq, lora=w.lora)
        if w.objective != "sft":  # the rung table's verdict, as `hfdist finetune --objective` reads it
            from hfdist.config.features import refuse_unless

            refuse_unless(rung, w.objective)
    except (PlanError, ValueError) as exc:
        return str(exc)
    return ""


@dataclass(frozen=True)
class _Context:
    """What every layout of one plan shares."""

    config: Any
    shape: ModelShape
    model: str
    cluster: Cluster
    gpu_mem_bytes: int
    workload: Workload
    hardware: Hardware
    flops_per_token: float


def _evaluate(ctx: _Context, layout: Layout) -> tuple[RankBytes, StepCost]:
    w = replace(ctx.workload, micro_batch=layout.pipeline_micro_batch,
                activation_checkpointing=layout.activation_checkpointing,
                cp_method=layout.rung.context.method if layout.dims.cp > 1 else "auto")
    fp8 = float8_params_per_layer(ctx.config, layout.dims.tp) if w.fp8 else 0.0
    b = rung_rank_bytes(ctx.shape, layout.rung, layout.dims, w, fp8)
    cost = step_cost(ctx.shape, layout.rung, layout.dims, w, global_batch=layout.global_batch,
                     hardware=ctx.hardware, gpus_per_node=ctx.cluster.gpus_per_node,
                     flops_per_token=ctx.flops_per_token)
    return b, cost


def _note(rung: Rung, layout: Layout, nodes: int) -> str:
    note = ""
    if rung.owns_sharding and rung.dims.dp_replicate > 1 and rung.dims.dp_shard != layout.dims.dp_shard:
        note = (f"set parallelism_config_dp_shard_size: {layout.dims.dp_shard} and "
                f"parallelism_config_dp_replicate_size: {layout.dims.dp_replicate} in accelerate_configs/"
                f"{rung.name}.yaml (it ships with dp_shard {rung.dims.dp_shard} x dp_replicate "
                f"{rung.dims.dp_replicate})")
    if nodes > 1:
        from hfdist.config.dims import ParallelDims

        note = "; ".join(x for x in (note, f"run the command on each of the {nodes} nodes with accelerate's "
                                     f"--num_machines/--machine_rank/--main_process_ip ({ParallelDims.placement_rule()})")
                         if x)
    return note


def _rung_plan(ctx: _Context, rung: Rung, layouts: list[Layout], reason: str) -> RungPlan:
    offload = offload_device(rung)
    runnable, refusals = [], []
    for layout in layouts:
        why = _refusal(ctx.config, layout, ctx.workload)
        (refusals if why else runnable).append(why or layout)
    if not runnable:
        why = refusals[0] if refusals else reason
        return RungPlan(rung.name, None, None, False, "", offload, note=f"cannot run here: {why}",
                        layouts=len(layouts))
    scored = [(layout, *_evaluate(ctx, layout)) for layout in runnable]
    fitting = [s for s in scored if s[1].total <= ctx.gpu_mem_bytes]
    if fitting:  # the fastest predicted; of ties (SPEED_TIE), the simplest: no recompute, fewest model-parallel ranks
        fastest = max(s[2].tokens_per_second for s in fitting)
        tied = [s for s in fitting if s[2].tokens_per_second >= (1 - SPEED_TIE) * fastest]
        layout, b, cost = min(tied, key=lambda s: (s[0].activation_checkpointing, s[0].dims.tp * s[0].dims.pp
                                                   * s[0].dims.cp, -s[2].tokens_per_second))
    else:
        layout, b, cost = min(scored, key=lambda s: s[1].total)
    note = "; ".join(x for x in (_note(rung, layout, ctx.cluster.nodes), moe_note(
        ctx.shape.moe, ctx.shape.hidden, layout.dims, ctx.workload.seq * layout.pipeline_micro_batch,
        2 if ctx.workload.dtype == "bf16" else 4, ctx.workload.bytes_per_param_adam)) if x)
    return RungPlan(rung.name, layout, b, bool(fitting), _command(layout, ctx.model, ctx.workload), offload, note,
                    cost, len(scored), len(fitting))


def _context(config, model: str, cluster: Cluster, gpu_mem_bytes: int, w: Workload, hardware: Hardware) -> _Context:
    shape = ModelShape.from_config(config)
    lora = shape.layers * shape.lora_layer_params(w.lora_r, w.lora_targets) if w.lora else 0
    fpt = shape.training_flops_per_token(w.seq, lora_params=lora, trainable_fraction=0.0 if w.lora else 1.0)
    return _Context(config, shape, model, cluster, gpu_mem_bytes, w, hardware, fpt)


def _plan(ctx: _Context, rungs: list[Rung], pins: Pins, global_batch: int | None) -> Plan:
    w = ctx.workload
    trainable = (ctx.shape.layers * ctx.shape.lora_layer_params(w.lora_r, w.lora_targets) if w.lora
                 else ctx.shape.total_params)
    plans = []
    # An expert-parallel rung (fsdp_ep) is for MoE models only: left out of a dense model's plan.
    for rung in (r for r in plan_order(rungs) if ctx.shape.moe is not None or r.dims.ep == 1):
        layouts, reason = rung_layouts(rung, ctx.config, ctx.cluster, global_batch=global_batch, seq=w.seq,
                                       pins=pins)
        plans.append(_rung_plan(ctx, rung, layouts, reason))
    return Plan(ctx.model, ctx.shape, trainable, ctx.cluster.gpus_per_node, ctx.cluster.nodes, ctx.gpu_mem_bytes, w,
                tuple(plans), ctx.hardware)


def _find_fix(ctx: _Context, rungs: list[Rung], pins: Pins, global_batch: int | None, avoid_offload: bool) -> str:
    """The first single change (in order of cost to the user) after which a rung fits, found by planning with it."""
    w, nodes = ctx.workload, ctx.cluster.nodes
    candidates: list[tuple[str, int, Workload, Pins]] = []
    if uses_dense_mask(w.attention):
        candidates.append(("use --attn-implementation auto (no S x S mask)", nodes, replace(w, attention=AUTO), pins))
    pinned = [f"--{axis} {pins.degree(axis)}" for axis in ("tp", "pp", "cp") if pins.degree(axis) is not None]
    if pinned:
        candidates.append((f"leave the degrees to the planner (drop {' '.join(pinned)})", nodes, w,
                           replace(pins, tp=None, pp=None, cp=None)))
    ckpt = replace(pins, activation_checkpointing=None if pins.activation_checkpointing is False else
                   pins.activation_checkpointing)
    if pins.activation_checkpointing is False:
        candidates.append(("allow --activation-checkpointing", nodes, w, ckpt))
    if (pins.micro_batch or 1) > 1:
        candidates.append(("use --micro-batch 1", nodes, w, replace(ckpt, micro_batch=1)))
    qlora = ("train QLoRA adapters on a 4-bit base (--qlora)", nodes, replace(w, lora=True, qlora=True), ckpt)
    if w.lora and not w.qlora:  # the same adapters on a 4-bit base: cheaper than more nodes
        candidates.append(qlora)
    for k in (2, 4, 8, 16, 32):
        candidates.append((f"use {nodes * k} nodes (--nodes {nodes * k})", nodes * k, w, ckpt))
    if not w.lora:
        candidates += [("train LoRA adapters (--lora)", nodes, replace(w, lora=True), ckpt), qlora]
    for advice, k, cand, cand_pins in candidates:
        cluster = replace(ctx.cluster, nodes=k)
        trial = _plan(replace(ctx, cluster=cluster, workload=cand), rungs, cand_pins, global_batch)
        fitting = [r for r in trial.rungs if r.fits and not (avoid_offload and r.offload != "none")]
        rec = replace(trial, rungs=tuple(fitting)).recommended
        if rec is not None:
            return f"{advice}: then {rec.name} fits at {rec.layout.describe()} ({rec.bytes.total / GB:.1f} GB per GPU)."
    what = "without offload" if avoid_offload else "at all"
    return (f"no single change (the degrees, activation checkpointing, micro-batch 1, up to {nodes * 32} nodes, LoRA, "
            f"QLoRA) makes a rung fit {what}: use GPUs with more memory or a shorter --seq.")


def _workload(seq, micro_batch, lora, lora_r, qlora, lora_targets, activation_checkpointing, dtype,
              bytes_per_param_adam, loss_chunk_size, attention, fp8, objective, generations, completion_len,
              rollout_batch, rollout_gather) -> Workload:
    return Workload(seq, micro_batch or 1, lora, lora_r, qlora, tuple(lora_targets), bool(activation_checkpointing),
                    dtype, bytes_per_param_adam, loss_chunk_size, attention, fp8, objective, generations,
                    completion_len, rollout_batch, rollout_gather)


def _check_cluster(gpus_per_node, nodes, gpu_mem_bytes) -> None:
    bad = {k: v for k, v in (("gpus_per_node", gpus_per_node), ("nodes", nodes), ("gpu_mem_bytes", gpu_mem_bytes))
           if not isinstance(v, int) or v < 1}
    if bad:
        raise PlanError(f"{bad} must be positive integers: describe the cluster as --nodes K x --gpus-per-node G "
                        "GPUs of --gpu-mem-gb M each.")


def plan_rungs(
    config,
    rungs: Iterable[Rung | str] | None = None,
    *,
    gpus_per_node: int,
    nodes: int = 1,
    gpu_mem_bytes: int,
    seq: int = 2048,
    global_batch: int | None = None,
    micro_batch: int | None = 1,
    activation_checkpointing: bool | None = False,
    tp: int | None = None,
    pp: int | None = None,
    cp: int | None = None,
    cp_method: str | None = None,
    lora: bool = False,
    lora_r: int = 16,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
    dtype: str = "bf16",
    bytes_per_param_adam: int = 16,
    model: str = "model",
    loss_chunk_size: int | None = DEFAULT_LOSS_CHUNK_SIZE,
    attention: str = AUTO,
    fp8: str | None = None,
    qlora: bool = False,
    objective: str = "sft",
    generations: int = 4,
    completion_len: int = 0,
    rollout_gather: str = "layer",
    hardware: Hardware = NOMINAL_HARDWARE,
) -> Plan:
    """Plan every rung for `config` on `nodes` x `gpus_per_node` GPUs of `gpu_mem_bytes` each.

    Args:
        config: a transformers config of a registered architecture (hfdist.models.load_config gives one for presets,
            folders, hub ids).
        rungs: Rung objects or names; default every shipped rung (hfdist.config.ladder.known_rung_names()).
        global_batch: sequences per optimizer step over all ranks, the same for every layout; None: each layout runs
            `micro_batch` per rank with no accumulation (its global batch follows its data-parallel degree).
        micro_batch, activation_checkpointing, tp, pp, cp, cp_method: pinned settings; None searches them
            (hfdist.plan.layouts; micro_batch is a pipeline stage's micro-batch, what one forward holds; every cp
            method that can split the model at a cp degree is a layout of its own).
        model: the --model value, used in the launch commands.
        objective: sft, dpo (a frozen reference beside the policy) or grpo (the rollout's KV cache of `seq`-token
            sequences, `completion_len` of them completion, and the completion logits; global_batch counts
            completions, `generations` a prompt; rollout_gather "once": the whole model gathered on FSDP2 rungs
            during the rollout); the layouts the rung table refuses the objective are left out.
        hardware: the rates the cost model predicts step times with (default: nominal H100 figures).
        Others: see Workload and the module docstring.

    Returns:
        A Plan whose rungs are in decision-table order, each at its best layout; `plan.recommended` is the fastest
        that fits. When none fits, or only an offload rung does, `plan.hint` names the cheapest change that would
        make a (non-offload) rung fit.

    Raises:
        PlanError: non-positive sizes, unknown dtype or accounting. PlanModelError: an architecture the registry does
        not describe.
    """
    _check_cluster(gpus_per_node, nodes, gpu_mem_bytes)
    w = _workload(seq, micro_batch, lora, lora_r, qlora, lora_targets, activation_checkpointing, dtype,
                  bytes_per_param_adam, loss_chunk_size, attention, fp8, objective, generations, completion_len,
                  global_batch, rollout_gather)
    pins = Pins(tp=tp, pp=pp, cp=cp, micro_batch=micro_batch, activation_checkpointing=activation_checkpointing,
                cp_method=cp_method)
    if global_batch is not None and (not isinstance(global_batch, int) or global_batch < 1):
        raise PlanError(f"global_batch must be a positive integer, got {global_batch!r}.")
    loaded = [r if isinstance(r, Rung) else load_rung(r) for r in (rungs if rungs is not None else known_rung_names())]
    ctx = _context(config, model, Cluster(gpus_per_node, nodes), gpu_mem_bytes, w, hardware)
    plan = _plan(ctx, loaded, pins, global_batch)
    rec = plan.recommended
    if rec is None or rec.offload != "none":
        plan = replace(plan, hint=_find_fix(ctx, loaded, pins, global_batch, avoid_offload=rec is not None))
    return plan


@dataclass(frozen=True)
class Assessment:
    """One layout for one workload: why it cannot run (empty when it can), else its bytes and predicted step."""

    layout: Layout
    refusal: str
    bytes: RankBytes | None
    cost: StepCost | None


def assess_layouts(config, layouts: Iterable[Layout], cluster: Cluster, *, workload: Workload,
                   hardware: Hardware = NOMINAL_HARDWARE) -> list[Assessment]:
    """Each layout's refusal (the checks the job makes before launch), or its per-rank bytes and predicted step time
    (hfdist tune's candidates)."""
    ctx = _context(config, "model", cluster, 1, workload, hardware)
    out = []
    for layout in layouts:
        why = _refusal(config, layout, workload)
        out.append(Assessment(layout, why, *((None, None) if why else _evaluate(ctx, layout))))
    return out


def plan_layout(config, layout: Layout, cluster: Cluster, *, gpu_mem_bytes: int, workload: Workload,
                model: str = "model", hardware: Hardware = NOMINAL_HARDWARE) -> RungPlan:
    """The plan of one exact layout (a launched job's: hfdist.job.preflight), its micro-batch and recompute taken
    from the layout."""
    ctx = _context(config, model, cluster, gpu_mem_bytes, workload, hardware)
    return _rung_plan(ctx, layout.rung, [layout], "")
