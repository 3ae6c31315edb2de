"""The memory planner: per-rank GPU bytes of every rung of the ladder for a model and a cluster, and the simplest
rung that fits, with its launch command, from the model config alone (no weights; a 405B plan takes milliseconds).

The accounting (16 or 20 bytes per parameter, sharding per rung, offload, activations, buffers) is documented in
hfdist.plan.bytes and hfdist.models.shape; this module walks the ladder in decision-table order (ddp, zero1, zero2,
fsdp_full_shard, zero3, fsdp_hybrid, TP/3D rungs, offload rungs last), picks the first that fits, and says what
to change when only offload or nothing fits.

    plan = plan_rungs(load_config("llama-3.1-70b"), gpus_per_node=8, nodes=4, gpu_mem_bytes=80 * GB)
    print(plan.table()); plan.to_json(); plan.recommended.command
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable

from hfdist.config.dims import ParallelDims
from hfdist.config.finetune import DEFAULT_LOSS_CHUNK_SIZE
from hfdist.config.ladder import Rung, known_rung_names, load_rung
from hfdist.models.attention import AUTO, uses_dense_mask
from hfdist.models.registry import LORA_TARGETS
from hfdist.models.shape import ModelShape
from hfdist.parallel.float8_check import check_fp8, float8_params_per_layer
from hfdist.plan.bytes import GB, PlanError, RankBytes, Workload, dims_on_cluster, offload_device, rung_rank_bytes

__all__ = ["Plan", "RungPlan", "plan_rungs", "plan_order"]

@dataclass(frozen=True)
class RungPlan:
    """One rung on this cluster: its layout, predicted bytes and launch command (bytes None if it cannot run)."""

    name: str
    dims: ParallelDims | None
    bytes: RankBytes | None
    fits: bool
    command: str
    offload: str = "none"
    note: str = ""


@dataclass(frozen=True)
class Plan:
    """Every rung's per-rank memory for one model, cluster and workload; the recommendation is the first that fits."""

    model: str
    shape: ModelShape
    trainable_params: int
    gpus_per_node: int
    nodes: int
    gpu_mem_bytes: int
    workload: Workload
    rungs: tuple[RungPlan, ...]
    hint: str = ""

    @property
    def world(self) -> int:
        """GPUs in the cluster."""
        return self.gpus_per_node * self.nodes

    @property
    def recommended(self) -> RungPlan | None:
        """The simplest rung that fits (decision-table order), or None."""
        return next((r for r in self.rungs if r.fits), None)

    def assumptions(self) -> list[str]:
        """The accounting behind the numbers, one line each (shown under the table and in the JSON)."""
        w = self.workload
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
                     f"of the frozen base at {frozen}/param; adapters ({self.trainable_params:,} params) carry grads "
                     "+ optimizer; one projection dequantised at a time (bf16) under buffers; rungs that do not take "
                     "--qlora are n/a")
        elif w.lora:
            train = (f"LoRA r={w.lora_r} on {targets}: frozen base weights only, at {frozen}/param as hfdist holds "
                     f"them; adapters ({self.trainable_params:,} params) carry grads + optimizer")
        else:
            train = f"full fine-tune ({self.trainable_params:,} trainable params)"
        if w.reference_model:
            train += ("; DPO: a frozen reference copy of the weights beside the policy, sharded like it, at the frozen "
                      "rate" if not w.lora else "; DPO: the reference is the base with the adapters off (no copy)")
        ckpt = "with" if w.activation_checkpointing else "without"
        logits = (f"one {w.loss_chunk_size}-position chunk of the sequence (hfdist's chunked loss)"
                  if w.loss_chunk_size and w.loss_chunk_size < w.seq else "the whole sequence, counted once")
        attention = {"sdpa": "sdpa with a dense S x S document mask (the mask + its bias saved per layer counted)",
                     "eager": "eager with a dense S x S document mask (the mask + every head's S x S weights saved "
                              "per layer counted)"}.get(
            w.attention, f"{w.attention} attention (document boundaries or a BlockMask: nothing S x S)")
        return [
            states,
            train,
            f"activations: seq {w.seq} x micro-batch {w.micro_batch}, {attention}, {ckpt} activation "
            f"checkpointing, fp32 logits of {logits}; PP: 1F1B with pp micro-batches in flight",
            "buffers: 1 GiB CUDA context/workspace + DDP/DeepSpeed gradient buckets + FSDP/ZeRO-3 gathered layers"
            + (f"; --fp8 {w.fp8}: decoder projections in float8, gathered at 1 B/param where FSDP2 shards them "
               "(tensorwise); model states and activations as without" if w.fp8 else ""),
            "offload rungs count GPU bytes only; 1 GB = 1e9 bytes; allocator fragmentation not modelled",
        ]

    def table(self) -> str:
        """The human-readable plan: one row per rung, the recommendation and its command."""
        s = self.shape
        n = s.total_params
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        head = (f"hfdist plan: {self.model} ({size} params, {s.layers} layers, hidden "
                f"{s.hidden}) on {self.nodes} node(s) x {self.gpus_per_node} GPUs = {self.world} ranks, "
                f"{self.gpu_mem_bytes / GB:g} GB each")
        cols = ("rung", "layout", "weights", "grads", "master", "optim", "activ", "buffers", "total", "fits")
        rows = []
        for r in self.rungs:
            layout = _describe_dims(r.dims) if r.dims else "-"
            if r.bytes is None:
                rows.append((r.name, layout, *["-"] * 7, "n/a"))
                continue
            b = r.bytes
            nums = (b.weights, b.grads, b.master, b.optimizer, b.activations, b.buffers, b.total)
            fits = "yes" if r.fits else "no"
            if r.offload != "none":
                fits += f" (+{b.offloaded / GB:.1f} on {r.offload})"
            rows.append((r.name, layout, *[f"{n / GB:.1f}" for n in nums], fits))
        widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
        fmt = "  ".join([f"{{:<{widths[0]}}}", f"{{:<{widths[1]}}}"]
                        + [f"{{:>{wd}}}" for wd in widths[2:-1]] + [f"{{:<{widths[-1]}}}"])
        lines = [head, "", fmt.format(*cols).rstrip(), *(fmt.format(*row).rstrip() for row in rows),
                 "", "per-rank GB on the GPU (worst pipeline stage). Assumptions:"]
        lines += [f"  - {a}" for a in self.assumptions()]
        lines.append("")
        rec = self.recommended
        if rec is None:
            lines.append(self.failure_message())
        else:
            lines.append(f"Recommended: {rec.name} ({rec.bytes.total / GB:.1f} of {self.gpu_mem_bytes / GB:g} GB "
                         f"per GPU)")
            lines.append(f"  {rec.command}")
            if rec.note:
                lines.append(f"  note: {rec.note}")
        if self.hint and rec is not None:  # without a recommendation the failure message carries the fix
            lines.append(f"Hint: {self.hint}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """{"rungs": [{"name", "fits", "per_rank_bytes": {...}}, ...], "recommended": {"name", "command"} | None}
        plus the inputs, the assumptions and any hint."""
        rec = self.recommended
        out: dict[str, Any] = {
            "model": {"spec": self.model, "params": self.shape.total_params, "trainable_params": self.trainable_params,
                      "layers": self.shape.layers, "hidden": self.shape.hidden},
            "cluster": {"gpus_per_node": self.gpus_per_node, "nodes": self.nodes, "world": self.world,
                        "gpu_mem_bytes": self.gpu_mem_bytes},
            "workload": asdict(self.workload),
            "assumptions": self.assumptions(),
            "rungs": [
                {"name": r.name, "fits": r.fits,
                 "per_rank_bytes": r.bytes.to_json() if r.bytes else None,
                 "dims": r.dims.to_dict() if r.dims else None, "offload": r.offload, "command": r.command,
                 **({"note": r.note} if r.note else {})}
                for r in self.rungs
            ],
            "recommended": {"name": rec.name, "command": rec.command} if rec else None,
        }
        if rec is None:
            out["error"] = self.failure_message()
        if self.hint:
            out["hint"] = self.hint
        return out

    def failure_message(self) -> str:
        """One paragraph for when no rung fits: what is too big, and the fix."""
        sized = [r for r in self.rungs if r.bytes is not None]
        if not sized:
            return ("Nothing fits: no rung can run on this cluster (see the notes per rung). Fix: change "
                    "--gpus-per-node / --nodes so the rungs' tensor/pipeline degrees divide them.")
        best = min(sized, key=lambda r: r.bytes.total)
        b = best.bytes
        parts = {"activations": b.activations, "model states": b.model_states, "buffers": b.buffers}
        big = max(parts, key=parts.get)
        fix = self.hint or "use GPUs with more memory, or a shorter --seq."
        return (f"Nothing fits: even the leanest rung, {best.name}, needs {b.total / GB:.1f} GB per GPU "
                f"({big} {parts[big] / GB:.1f} GB of it) but each GPU has {self.gpu_mem_bytes / GB:g} GB. "
                f"Fix: {fix}")


def _describe_dims(d: ParallelDims) -> str:
    return d.layout()


def plan_order(rungs: Iterable[Rung]) -> list[Rung]:
    """Rungs in the order the recommendation walks: the rung table's plan_order ((single,) ddp, zero1, zero2,
    fsdp_full_shard, zero3, fsdp_hybrid, pp, fsdp_tp, zero2_tp, 3d, fsdp_cp), then rungs the table does not list,
    offload rungs last."""
    def key(r: Rung) -> tuple:
        return (offload_device(r) != "none", r.info is None, r.info.plan_order if r.info else 0, r.name)

    return sorted(rungs, key=key)


def _command(rung: Rung, model: str, world: int, dims: ParallelDims, w: Workload) -> str:
    # Under PP the planned micro-batch is a pipeline micro-batch; a rank's batch holds n_microbatches of them.
    per_rank = w.micro_batch * (rung.pipeline.n_microbatches if rung.pipeline is not None else 1)
    if w.reference_model:  # preference training runs in a script of the user's, as examples/dpo_trl.py
        return shlex.join(["torchrun", "--nproc-per-node", str(world), "examples/dpo_trl.py", "--config", rung.name,
                           "--model", model, "--global-batch-size", str(max(per_rank * dims.dp // 2, 1))])
    parts = ["accelerate", "launch", "scripts/finetune.py", "--config", f"{rung.name}.yaml",
             "--num-processes", str(world), "--model", model]
    if w.lora:
        parts += ["--qlora" if w.qlora else "--lora", "--lora-r", str(w.lora_r)]
    parts += ["--seq-len", str(w.seq), "--micro-batch-size", str(per_rank),
              "--global-batch-size", str(per_rank * dims.dp)]
    if w.activation_checkpointing:
        parts.append("--activation-checkpointing")
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


def _rung_plan(shape: ModelShape, config, rung: Rung, model: str, gpus_per_node: int, nodes: int,
               gpu_mem_bytes: int, w: Workload) -> RungPlan:
    offload = offload_device(rung)
    try:
        if w.qlora:
            _check_takes_qlora(rung)
        dims = dims_on_cluster(rung, gpus_per_node, nodes)
        if dims.tp > 1:
            from hfdist.parallel.tensor_check import validate_tp

            validate_tp(config, dims.tp)
        if dims.cp > 1:
            from hfdist.parallel.context_check import check_cp

            check_cp(config, dims.cp, w.seq, tp=dims.tp, method=w.cp_method)
        if w.fp8:
            check_fp8(w.fp8, replace(rung, dims=dims), config, seq_len=w.seq, lora=w.lora)
        if w.reference_model and dims.pp > 1:
            raise PlanError("DPO's loss compares whole sequences of two models; pipeline stages compute only the "
                            "last stage's token cross-entropy (hfdist.api refuses it)")
    except (PlanError, ValueError) as exc:
        return RungPlan(rung.name, None, None, False, "", offload, note=f"cannot run here: {exc}")
    if rung.fsdp is not None and rung.fsdp.activation_checkpointing:
        w = replace(w, activation_checkpointing=True)
    b = rung_rank_bytes(shape, rung, dims, w, float8_params_per_layer(config, dims.tp) if w.fp8 else 0.0)
    note = ""
    if rung.owns_sharding and rung.dims.dp_replicate > 1 and rung.dims.dp_shard != dims.dp_shard:
        note = (f"set parallelism_config_dp_shard_size: {dims.dp_shard} and parallelism_config_dp_replicate_size: "
                f"{dims.dp_replicate} in accelerate_configs/{rung.name}.yaml (it ships with dp_shard "
                f"{rung.dims.dp_shard} x dp_replicate {rung.dims.dp_replicate})")
    if nodes > 1:
        note = "; ".join(x for x in (note, f"run the command on each of the {nodes} nodes with accelerate's "
                                     "--num_machines/--machine_rank/--main_process_ip") if x)
    return RungPlan(rung.name, dims, b, b.total <= gpu_mem_bytes, _command(rung, model, gpus_per_node * nodes,
                                                                            dims, w), offload, note)


def _plan(config, rungs: list[Rung], model: str, gpus_per_node: int, nodes: int, gpu_mem_bytes: int,
          w: Workload) -> Plan:
    shape = ModelShape.from_config(config)
    trainable = shape.layers * shape.lora_layer_params(w.lora_r, w.lora_targets) if w.lora else shape.total_params
    plans = tuple(_rung_plan(shape, config, r, model, gpus_per_node, nodes, gpu_mem_bytes, w)
                  for r in plan_order(rungs))
    return Plan(model, shape, trainable, gpus_per_node, nodes, gpu_mem_bytes, w, plans)


def _find_fix(config, rungs: list[Rung], model: str, gpus_per_node: int, nodes: int, gpu_mem_bytes: int,
              w: Workload, avoid_offload: bool) -> str:
    """The first single change (in order of cost to the user) after which a rung fits, as advice."""
    candidates: list[tuple[str, int, Workload]] = []
    if uses_dense_mask(w.attention):
        candidates.append(("use --attn-implementation auto (no S x S mask)", nodes, replace(w, attention=AUTO)))
    if not w.activation_checkpointing:
        candidates.append(("add --activation-checkpointing", nodes, replace(w, activation_checkpointing=True)))
    ckpt = replace(w, activation_checkpointing=True)
    if w.micro_batch > 1:
        candidates.append(("use --micro-batch 1 with --activation-checkpointing", nodes, replace(ckpt, micro_batch=1)))
    qlora = ("train QLoRA adapters on a 4-bit base (--qlora) with --activation-checkpointing", nodes,
             replace(ckpt, lora=True, qlora=True))
    if w.lora and not w.qlora:  # the same adapters on a 4-bit base: cheaper than more nodes
        candidates.append(qlora)
    for k in (2, 4, 8, 16, 32):
        candidates.append((f"use {nodes * k} nodes (--nodes {nodes * k}) with --activation-checkpointing",
                           nodes * k, ckpt))
    if not w.lora:
        candidates.append(("train LoRA adapters (--lora) with --activation-checkpointing", nodes,
                           replace(ckpt, lora=True)))
    if not w.lora:
        candidates.append(qlora)
    for advice, k, cand in candidates:
        rec = next((r for r in _plan(config, rungs, model, gpus_per_node, k, gpu_mem_bytes, cand).rungs
                    if r.fits and not (avoid_offload and r.offload != "none")), None)
        if rec is not None:
            return f"{advice}: then {rec.name} fits ({rec.bytes.total / GB:.1f} GB per GPU)."
    what = "without offload" if avoid_offload else "at all"
    return (f"no single change (activation checkpointing, micro-batch 1, up to {nodes * 32} nodes, LoRA, QLoRA) makes "
            f"a rung fit {what}: use GPUs with more memory or a shorter --seq.")


def plan_rungs(
    config,
    rungs: Iterable[Rung | str] | None = None,
    *,
    gpus_per_node: int,
    nodes: int = 1,
    gpu_mem_bytes: int,
    seq: int = 2048,
    micro_batch: int = 1,
    lora: bool = False,
    lora_r: int = 16,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
    activation_checkpointing: bool = False,
    dtype: str = "bf16",
    bytes_per_param_adam: int = 16,
    model: str = "model",
    loss_chunk_size: int | None = DEFAULT_LOSS_CHUNK_SIZE,
    attention: str = AUTO,
    fp8: str | None = None,
    qlora: bool = False,
    reference_model: bool = False,
) -> Plan:
    """Plan every rung for `config` on `nodes` x `gpus_per_node` GPUs of `gpu_mem_bytes` each.

    Args:
        config: a transformers LlamaConfig (hfdist.models.load_config gives one for presets, folders, hub ids).
        rungs: Rung objects or names; default every shipped rung (hfdist.config.ladder.known_rung_names()).
        model: the --model value, used in the launch commands.
        Others: see Workload and the module docstring.

    Returns:
        A Plan whose rungs are in decision-table order; `plan.recommended` is the first that fits. When none fits,
        or only an offload rung does, `plan.hint` names the cheapest change that would make a (non-offload) rung fit.

    Raises:
        PlanError: non-positive sizes, unknown dtype or accounting. PlanModelError: not a Llama config.
    """
    bad = {k: v for k, v in (("gpus_per_node", gpus_per_node), ("nodes", nodes), ("gpu_mem_bytes", gpu_mem_bytes))
           if not isinstance(v, int) or v < 1}
    if bad:
        raise PlanError(f"{bad} must be positive integers: describe the cluster as --nodes K x --gpus-per-node G "
                        "GPUs of --gpu-mem-gb M each.")
    w = Workload(seq, micro_batch, lora, lora_r, qlora, tuple(lora_targets), activation_checkpointing, dtype,
                 bytes_per_param_adam, loss_chunk_size, attention, fp8, reference_model)
    loaded = [r if isinstance(r, Rung) else load_rung(r) for r in (rungs if rungs is not None else known_rung_names())]
    plan = _plan(config, loaded, model, gpus_per_node, nodes, gpu_mem_bytes, w)
    rec = plan.recommended
    if rec is None or rec.offload != "none":
        plan = replace(plan, hint=_find_fix(config, loaded, model, gpus_per_node, nodes, gpu_mem_bytes, w,
                                            avoid_offload=rec is not None))
    return plan

