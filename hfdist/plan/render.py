"""A plan: what it holds (Plan, RungPlan: each rung's best layout and the recommendation, which hfdist.plan.planner
makes) and how it reads, as a person reads it (the table `hfdist plan` prints, with its assumptions and the failure
paragraph) and as JSON (`hfdist plan --json`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hfdist.models.shape import ModelShape
from hfdist.plan.bytes import GB, RankBytes, Workload
from hfdist.plan.cost import NOMINAL_HARDWARE, Hardware, StepCost
from hfdist.plan.layouts import Layout

__all__ = ["Plan", "RungPlan", "SPEED_TIE", "assumptions", "table", "to_json", "failure_message"]

# Predicted speeds this close are a tie (the cost model leaves out overheads of this order), which the simpler rung
# wins.
SPEED_TIE = 0.03


@dataclass(frozen=True)
class RungPlan:
    """One rung on this cluster: its best layout, that layout's predicted bytes and step time and its launch command
    (bytes None if no layout of the rung can run here, with the reason in `note`)."""

    name: str
    layout: Layout | None
    bytes: RankBytes | None
    fits: bool
    command: str
    offload: str = "none"
    note: str = ""
    cost: StepCost | None = None
    layouts: int = 0  # the layouts considered
    fitting: int = 0  # of which fit

    @property
    def dims(self):
        """The best layout's degrees (None when the rung cannot run here)."""
        return self.layout.dims if self.layout is not None else None


@dataclass(frozen=True)
class Plan:
    """Every rung's best layout for one model, cluster and workload; the recommendation is the fastest that fits."""

    model: str
    shape: ModelShape
    trainable_params: int
    gpus_per_node: int
    nodes: int
    gpu_mem_bytes: int
    workload: Workload
    rungs: tuple[RungPlan, ...]
    hardware: Hardware = NOMINAL_HARDWARE
    hint: str = ""

    @property
    def world(self) -> int:
        """GPUs in the cluster."""
        return self.gpus_per_node * self.nodes

    @property
    def checkpoint_bytes(self) -> int:
        """One training checkpoint's trained state: each trainable parameter's fp32 value (or master copy) and
        AdamW's two fp32 moments, 12 bytes (an adapter run's frozen base is not in it: hfdist.checkpoint); the
        scheduler, RNG and trainer state add kilobytes, DeepSpeed's bf16 rungs their 2-byte weights."""
        return 12 * self.trainable_params

    @property
    def recommended(self) -> RungPlan | None:
        """The fastest predicted rung that fits without offload (else with it), or None; of rungs predicted within
        SPEED_TIE of the fastest, the simplest (the plan's order): the cost model cannot tell them apart."""
        fitting = [r for r in self.rungs if r.fits]
        candidates = [r for r in fitting if r.offload == "none"] or fitting
        if not candidates:
            return None
        fastest = max(r.cost.tokens_per_second for r in candidates)
        return next(r for r in candidates if r.cost.tokens_per_second >= (1 - SPEED_TIE) * fastest)

    def assumptions(self) -> list[str]:
        """The accounting behind the numbers, one line each (shown under the table and in the JSON)."""
        return assumptions(self)

    def table(self) -> str:
        """The human-readable plan: one row per rung (its best layout), the recommendation and its command."""
        return table(self)

    def to_json(self) -> dict[str, Any]:
        """{"rungs": [{"name", "fits", "layout", "per_rank_bytes", "predicted", ...}, ...], "recommended": {"name",
        "command"} | None} plus the inputs, the assumptions and any hint."""
        return to_json(self)

    def failure_message(self) -> str:
        """One paragraph for when no rung fits: what is too big, and the fix."""
        return failure_message(self)


def assumptions(plan: Plan) -> list[str]:
    """The accounting behind the numbers, one line each (shown under the table and in the JSON)."""
    w = plan.workload
    if w.dtype == "fp32":
        states = "fp32: 4 weight + 4 grad + 8 Adam B/param (DeepSpeed adds a 4 B fp32 partition copy)"
    elif w.bytes_per_param_adam == 16:
        states = "bf16 mixed precision, Adam 16 B/param: 2 weight + 2 grad + 4 fp32 master + 8 Adam"
    else:
        states = ("bf16 mixed precision, Adam 20 B/param (DeepSpeed's accounting): 2 weight + 2 grad + 4 fp32 "
                  "grad + 4 fp32 master + 8 Adam")
    frozen = "4 B (fp32; DeepSpeed: 2 B)" if w.dtype == "bf16" else "4 B"
    targets = ",".join(t.removesuffix("_proj") for t in w.lora_targets)
    if w.qlora:
        train = (f"QLoRA r={w.lora_r} on {targets}: decoder projections in 4-bit NF4 (0.5 B/param, sharded "
                 "like weights) + their double-quantised states (~1/64 B/param, whole on every rank), the rest "
                 f"of the frozen base at {frozen}/param; adapters ({plan.trainable_params:,} params) carry grads "
                 "+ optimizer; one projection dequantised at a time (bf16) under buffers; rungs that do not take "
                 "--qlora are n/a")
    elif w.lora:
        train = (f"LoRA r={w.lora_r} on {targets}: frozen base weights only, at {frozen}/param as hfdist holds "
                 f"them; adapters ({plan.trainable_params:,} params) carry grads + optimizer")
    else:
        train = f"full fine-tune ({plan.trainable_params:,} trainable params)"
    if w.reference_model:
        train += ("; DPO: a frozen reference copy of the weights beside the policy, sharded like it, at the frozen "
                  "rate" if not w.lora else "; DPO: the reference is the base with the adapters off (no copy)")
    if w.objective == "grpo":
        train += (f"; GRPO: the larger of the rollout (each rank's share of the step's completions, {w.generations} a "
                  f"prompt, their {w.seq}-token KV cache, kv heads over tp) and the step with its {w.completion_len} "
                  "completion positions' logits (compute dtype + fp32, TRL's loss)")
    logits = (f"one {w.loss_chunk_size}-position chunk of the sequence (hfdist's chunked loss)"
              if w.loss_chunk_size and w.loss_chunk_size < w.seq else "the whole sequence, counted once")
    attention = {"sdpa": "sdpa with a dense S x S document mask (the mask + its bias saved per layer counted)",
                 "eager": "eager with a dense S x S document mask (the mask + every head's S x S weights saved "
                          "per layer counted)"}.get(
        w.attention, f"{w.attention} attention (document boundaries or a BlockMask: nothing S x S)")
    return [
        states,
        train,
        f"activations: seq {w.seq} x each layout's micro-batch, {attention}, with or without recompute as the "
        f"layout says, fp32 logits of {logits}; PP: 1F1B with pp micro-batches in flight",
        "buffers: 1 GiB CUDA context/workspace + DDP/DeepSpeed gradient buckets + FSDP/ZeRO-3 gathered layers"
        + (f"; --fp8 {w.fp8}: decoder projections in float8, gathered at 1 B/param where FSDP2 shards them "
           "(tensorwise); model states and activations as without" if w.fp8 else ""),
        "offload rungs count GPU bytes only; 1 GB = 1e9 bytes; allocator fragmentation not modelled",
        f"a checkpoint: {plan.checkpoint_bytes / 1e9:.3g} GB a save (12 B a trainable param: fp32 "
        + ("adapters + AdamW's two moments; the frozen base is rebuilt from --model" if w.lora else
           "weights or master + AdamW's two moments") + ")",
        f"speed (hfdist.plan.cost): FLOPs over the matmul rate, collectives' bytes over the bandwidth, the "
        f"optimizer's traffic and the pipeline bubble, on {plan.hardware.source}",
    ]

def table(plan: Plan) -> str:
    """The human-readable plan: one row per rung (its best layout), the recommendation and its command."""
    s = plan.shape
    n = s.total_params
    size = (f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M") + " params"
    if s.moe is not None:  # a mixture of experts: what a token uses too
        a = s.active_params
        size += (f" ({a / 1e9:.2f}B" if a >= 1e9 else f" ({a / 1e6:.1f}M") + \
            f" active: {s.moe.experts} experts, top-{s.moe.top_k})"
    head = (f"hfdist plan: {plan.model} ({size}, {s.layers} layers, hidden "
            f"{s.hidden}) on {plan.nodes} node(s) x {plan.gpus_per_node} GPUs = {plan.world} ranks, "
            f"{plan.gpu_mem_bytes / GB:g} GB each")
    cols = ("rung", "best layout", "weights", "grads", "master", "optim", "activ", "buffers", "total", "fits",
            "tok/s/GPU")
    rows = []
    for r in plan.rungs:
        layout = r.layout.describe() if r.layout else "-"
        if r.bytes is None:
            rows.append((r.name, layout, *["-"] * 7, "n/a", "-"))
            continue
        b = r.bytes
        nums = (b.weights, b.grads, b.master, b.optimizer, b.activations, b.buffers, b.total)
        fits = f"yes ({r.fitting}/{r.layouts})" if r.fits else f"no (0/{r.layouts})"
        if r.offload != "none":
            fits += f" +{b.offloaded / GB:.1f} on {r.offload}"
        rows.append((r.name, layout, *[f"{n / GB:.1f}" for n in nums], fits,
                     f"{r.cost.tokens_per_second_per_device:,.0f}"))
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    fmt = "  ".join([f"{{:<{widths[0]}}}", f"{{:<{widths[1]}}}"]
                    + [f"{{:>{wd}}}" for wd in widths[2:-2]] + [f"{{:<{widths[-2]}}}", f"{{:>{widths[-1]}}}"])
    lines = [head, "", fmt.format(*cols).rstrip(), *(fmt.format(*row).rstrip() for row in rows),
             "", "per-rank GB on the GPU (worst pipeline stage) of each rung's best layout: its fastest predicted "
             "that fits (fits: layouts that fit / considered), else its leanest. Assumptions:"]
    lines += [f"  - {a}" for a in assumptions(plan)]
    lines.append("")
    rec = plan.recommended
    if rec is None:
        lines.append(failure_message(plan))
    else:
        lines.append(f"Recommended: {rec.name}, {rec.layout.describe()} ({rec.bytes.total / GB:.1f} of "
                     f"{plan.gpu_mem_bytes / GB:g} GB per GPU; predicted fastest, "
                     f"{rec.cost.tokens_per_second_per_device:,.0f} tokens/s per GPU)")
        lines.append(f"  {rec.command}")
        if rec.note:
            lines.append(f"  note: {rec.note}")
        lines.append("  `hfdist tune` measures the candidates on your own machine.")
    if plan.hint and rec is not None:  # without a recommendation the failure message carries the fix
        lines.append(f"Hint: {plan.hint}")
    return "\n".join(lines)

def to_json(plan: Plan) -> dict[str, Any]:
    """{"rungs": [{"name", "fits", "layout", "per_rank_bytes", "predicted", ...}, ...], "recommended": {"name",
    "command"} | None} plus the inputs, the assumptions and any hint."""
    rec = plan.recommended
    out: dict[str, Any] = {
        "model": {"spec": plan.model, "params": plan.shape.total_params, "trainable_params": plan.trainable_params,
                  "checkpoint_bytes": plan.checkpoint_bytes,
                  "layers": plan.shape.layers, "hidden": plan.shape.hidden,
                  **({"active_params": plan.shape.active_params, "experts": plan.shape.moe.experts,
                      "top_k": plan.shape.moe.top_k} if plan.shape.moe else {})},
        "cluster": {"gpus_per_node": plan.gpus_per_node, "nodes": plan.nodes, "world": plan.world,
                    "gpu_mem_bytes": plan.gpu_mem_bytes},
        "workload": asdict(plan.workload),
        "hardware": asdict(plan.hardware),
        "assumptions": assumptions(plan),
        "rungs": [_rung_json(r) for r in plan.rungs],
        "recommended": {"name": rec.name, "command": rec.command} if rec else None,
    }
    if rec is None:
        out["error"] = failure_message(plan)
    if plan.hint:
        out["hint"] = plan.hint
    return out

def failure_message(plan: Plan) -> str:
    """One paragraph for when no rung fits: what is too big, and the fix."""
    sized = [r for r in plan.rungs if r.bytes is not None]
    if not sized:
        return ("Nothing fits: no rung can run on this cluster (see the notes per rung). Fix: change "
                "--gpus-per-node / --nodes so the rungs' tensor/pipeline degrees divide them.")
    best = min(sized, key=lambda r: r.bytes.total)
    b = best.bytes
    parts = {"activations": b.activations, "model states": b.model_states, "buffers": b.buffers}
    big = max(parts, key=parts.get)
    fix = plan.hint or "use GPUs with more memory, or a shorter --seq."
    return (f"Nothing fits: even the leanest layout, {best.name} at {best.layout.describe()}, needs "
            f"{b.total / GB:.1f} GB per GPU ({big} {parts[big] / GB:.1f} GB of it) but each GPU has "
            f"{plan.gpu_mem_bytes / GB:g} GB. Fix: {fix}")


def _rung_json(r: RungPlan) -> dict[str, Any]:
    out: dict[str, Any] = {"name": r.name, "fits": r.fits, "per_rank_bytes": r.bytes.to_json() if r.bytes else None,
                           "dims": r.dims.to_dict() if r.dims else None, "offload": r.offload, "command": r.command,
                           "layouts": r.layouts, "fitting": r.fitting}
    if r.layout is not None:
        out["layout"] = {"micro_batch": r.layout.micro_batch, "global_batch": r.layout.global_batch,
                         "activation_checkpointing": r.layout.activation_checkpointing,
                         "options": r.layout.job_options()}
    if r.cost is not None:
        out["predicted"] = {"step_seconds": r.cost.seconds, "tokens_per_second": r.cost.tokens_per_second,
                            "tokens_per_second_per_device": r.cost.tokens_per_second_per_device,
                            "compute_seconds": r.cost.compute, "bubble_seconds": r.cost.bubble,
                            "optimizer_seconds": r.cost.optimizer, "exposed_comm_seconds": r.cost.exposed_comm}
    if r.note:
        out["note"] = r.note
    return out
