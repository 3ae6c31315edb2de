"""Simulated ranks: the real parallelize recipe at any scale, in one process, with no memory and no GPU.

For each distinct rank role of a mesh rung (one per pipeline stage; without pp every rank holds the same shapes)
`simulate` does what that rank of a launched job does up to its first step, but on the meta device and under
torch's `fake` process group (collectives are no-ops, ranks and meshes exist):

    meta_model(spec)                      hfdist.models.build: the structure, no weights (any size)
    parallelize(model, rung, ...)         hfdist.parallel.parallelize, the job's own call, without weights:
                                          TP -> AC -> pipeline split -> FSDP2, the model stays on meta, sharded
    verify_strategy(rung, model, model)   hfdist.parallel.verify: the checks a run makes before step 1
    AdamW(params).step()                  on the sharded meta parameters, gradients shaped as FSDP2 leaves them
                                          (the parameter's local shard): Adam's state as torch allocates it

and reads the rank's bytes from the local shards (parameters, gradients, Adam's moments; its step counters left
out, as the planner leaves them out), next to hfdist.plan.predict_state_bytes for the same stage.

Stage s is represented by the rank at (dp 0, stage s, tp 0) = s x tp (others differ by at most one row per tensor
where FSDP2's dim-0 split is uneven); middle stages with as many layers hold the same shapes (`RoleBytes.stages`).

Only hfdist's own rungs can be simulated: DeepSpeed's engine places its flat partitions in real memory and runs
real collectives while it builds; DDP and the single process hold the whole model (`hfdist plan` counts them).
"""

from __future__ import annotations

import copy
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from unittest import mock

from hfdist.config.ladder import LadderError, Rung, StrategyKind, load_rung
from hfdist.errors import HfdistError
from hfdist.parallel.pipeline.plan import MULTI_STAGE_SCHEDULES
from hfdist.plan.state_bytes import StateBytes, predict_state_bytes

__all__ = ["SimulateError", "RoleBytes", "Simulation", "simulation_rung", "simulate"]


class SimulateError(HfdistError, ValueError):
    """A simulation hfdist cannot run: a rung it does not apply itself, or degrees that do not fit."""


@dataclass(frozen=True)
class StepPeak:
    """A simulated training step's memory peak on one rank (FSDP2's memory tracker over fake tensors)."""

    seq: int
    micro_batch: int
    activation_bytes: int  # activations (and recomputed ones) held at the step's peak
    peak_bytes: int  # everything the tracker counts at that moment: states, gathered layers, temporaries
    predicted_activation_bytes: int  # the planner's activations for the same rung and workload

    def relative_error(self) -> float:
        """|measured - predicted| / predicted activation bytes."""
        return abs(self.activation_bytes - self.predicted_activation_bytes) / self.predicted_activation_bytes


@dataclass(frozen=True)
class RoleBytes:
    """Model-state bytes one simulated rank holds, and what the planner predicts for it."""

    rank: int
    stage: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    predicted: StateBytes
    step: StepPeak | None = None
    stages: tuple[int, ...] = ()  # every pipeline stage this role stands for (same layers, neither end)

    def relative_error(self) -> float:
        """The largest |measured - predicted| / predicted over params, grads and optimizer state."""
        pairs = ((self.param_bytes, self.predicted.param_bytes), (self.grad_bytes, self.predicted.grad_bytes),
                 (self.optimizer_bytes, self.predicted.optimizer_bytes))
        return max(abs(got - want) / want if want else float(got != 0) for got, want in pairs)

    def to_json(self) -> dict:
        """One entry of `ranks` in `hfdist simulate --json`."""
        return {"rank": self.rank, "stage": self.stage, "stages": list(self.stages), "param_bytes": self.param_bytes,
                "grad_bytes": self.grad_bytes, "optimizer_bytes": self.optimizer_bytes,
                "predicted": asdict(self.predicted), "relative_error": self.relative_error(),
                **({"step": {**asdict(self.step), "relative_error": self.step.relative_error()}} if self.step else {})}


@dataclass(frozen=True)
class Simulation:
    """What `simulate` found for one model, rung and world."""

    model: str
    rung: Rung
    mixed_precision: str
    roles: tuple[RoleBytes, ...]
    seconds: float
    failure: str = ""  # verify's message for the first role that failed it
    attention: str = "auto"  # --attn-implementation the simulated step's memory stands for

    @property
    def verified(self) -> bool:
        """Whether every simulated role passed hfdist.parallel.verify."""
        return not self.failure

    def to_json(self) -> dict:
        """The `hfdist simulate --json` object."""
        return {"model": self.model, "config": self.rung.name, "num_processes": self.rung.num_processes,
                "dims": self.rung.dims.to_dict(), "mixed_precision": self.mixed_precision,
                "attn_implementation": self.attention, "verified": self.verified, "seconds": round(self.seconds, 2),
                **({"cp_method": self.rung.context.method} if self.rung.dims.cp > 1 else {}),
                "ranks": [r.to_json() for r in self.roles], **({"failure": self.failure} if self.failure else {})}

    def table(self) -> str:
        """Per-role bytes against the prediction, as `hfdist simulate` prints them."""
        # GB for real models, MB for the tiny ones (whose shards would all read 0.000 GB).
        gb, unit = (1e9, "GB") if max(r.param_bytes for r in self.roles) >= 1e8 else (1e6, "MB")
        c, n = self.rung.context, self.rung.dims.cp
        cp = f", cp by {c.method} (Ulysses over {c.ulysses}, a ring of {n // c.ulysses})" if n > 1 and c.ulysses else ""
        lines = [f"hfdist simulate: {self.model} on {self.rung.name}, {self.rung.num_processes} ranks "
                 f"({self.rung.dims.layout()}{cp}), {self.mixed_precision}: verify "
                 f"{'passed' if self.verified else 'FAILED'} ({self.seconds:.1f} s)",
                 f"{'rank':>6} {'stages':>6} {'params ' + unit:>10} {'grads ' + unit:>9} {'optim ' + unit:>9}  "
                 f"{'predicted p / g / o ' + unit:>24} {'error':>7}"]
        for r in self.roles:
            p = r.predicted
            predicted = f"{p.param_bytes / gb:.3f} / {p.grad_bytes / gb:.3f} / {p.optimizer_bytes / gb:.3f}"
            stages = ",".join(map(str, r.stages or (r.stage,)))
            lines.append(f"{r.rank:>6} {stages:>6} {r.param_bytes / gb:>10.3f} {r.grad_bytes / gb:>9.3f} "
                         f"{r.optimizer_bytes / gb:>9.3f}  {predicted:>24} {r.relative_error():>7.2%}")
        for r in self.roles:
            if r.step is not None:
                attention = "" if self.attention == "auto" else f", {self.attention} attention"
                lines.append(f"rank {r.rank}: a simulated step (seq {r.step.seq} x micro-batch {r.step.micro_batch}"
                             f"{attention}) "
                             f"peaks at {r.step.peak_bytes / gb:.3f} {unit}, activations "
                             f"{r.step.activation_bytes / gb:.3f} {unit}; planner "
                             f"{r.step.predicted_activation_bytes / gb:.3f} {unit} "
                             f"({r.step.relative_error():.2%})")
        if self.failure:
            lines.append(f"hfdist: verify failed: {self.failure}")
        return "\n".join(lines)


def simulation_rung(config_name: str, num_processes: int, *, tp: int | None = None, pp: int | None = None,
                    cp: int | None = None, dp_replicate: int | None = None, ep: int | None = None,
                    pp_schedule: str | None = None, pp_microbatches: int | None = None, gpus_per_node: int = 8,
                    model_config=None, cp_method: str = "auto") -> Rung:
    """The rung `config_name` fitted to `num_processes` ranks on nodes of `gpus_per_node` GPUs, as a GPU launch
    would fit it (hfdist.job.world), with the pipeline schedule / micro-batches and cp method given, checked against
    the model's heads and layers when `model_config` is given, its cp planned then (as the launcher's preflight).

    Raises:
        SimulateError / LadderError / TPError: a rung simulate cannot run, degrees that do not divide the world
        or the heads; each names the fix.
    """
    rung = load_rung(config_name)
    if not rung.owns_sharding:
        what = ("DeepSpeed builds its flat ZeRO partitions in real memory and runs real collectives while its "
                "engine starts, which the meta device and a fake process group cannot give it"
                if rung.kind is StrategyKind.DEEPSPEED else
                "nothing is sharded there: every rank holds the whole model")
        raise SimulateError(
            f"hfdist simulate runs hfdist's own parallelize recipe, which {rung.name} does not use: {what}. "
            f"For {rung.name}'s per-rank bytes use `hfdist plan --model MODEL` (it counts every rung); simulate "
            "the mesh rungs: fsdp_full_shard, fsdp_hybrid, fsdp_tp, pp, 3d.")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise SimulateError(f"--num-processes must be a positive integer, got {num_processes!r}.")
    if gpus_per_node < 1:
        raise SimulateError(f"--gpus-per-node must be a positive integer, got {gpus_per_node!r}.")
    try:
        rung = rung.with_num_processes(num_processes, tp=tp, pp=pp, cp=cp, dp_replicate=dp_replicate, ep=ep,
                                       node_size=min(gpus_per_node, num_processes)).with_context(cp_method)
    except LadderError as exc:
        raise SimulateError(str(exc)) from exc
    if pp_schedule is not None or pp_microbatches is not None:
        if rung.pipeline is None:
            raise SimulateError(f"--pp-schedule / --pp-microbatches apply to pipeline rungs only, and {rung.name} "
                                "runs without pipeline stages here (pp=1). Use --config pp or 3d, or drop them.")
        rung = replace(rung, pipeline=replace(rung.pipeline, **{k: v for k, v in (
            ("schedule", pp_schedule), ("n_microbatches", pp_microbatches)) if v is not None}))
    if rung.pipeline is not None and rung.pipeline.schedule in MULTI_STAGE_SCHEDULES:
        raise SimulateError(f"{rung.pipeline.schedule} puts several pipeline stages on each rank, and the planner "
                            "predicts one stage per rank, so simulate has nothing to compare with. Simulate with "
                            "--pp-schedule 1F1B (the same parameters, split once per rank).")
    if model_config is not None:
        from hfdist.parallel.fit import plan_context
        from hfdist.parallel.pipeline.plan import check_pipeline
        from hfdist.parallel.tensor_check import validate_tp

        if rung.dims.tp > 1:
            validate_tp(model_config, rung.dims.tp)
        check_pipeline(rung, rung.pipeline.n_microbatches if rung.pipeline else 1, model_config.num_hidden_layers)
        rung = plan_context(model_config, rung)
    return rung


@contextmanager
def _fake_rank(rank: int, world_size: int, local_world_size: int):
    """This process as rank `rank` of a fake world (no communication), with the node size verify reads."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise SimulateError("hfdist simulate needs a process without a process group; this one already has one. "
                            "Run it as its own command (hfdist simulate ...).")
    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": str(local_world_size)}):
        dist.init_process_group("fake", rank=rank, world_size=world_size)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _local_bytes(t) -> int:
    from hfdist.parallel.dtensors import local_tensor

    return local_tensor(t).numel() * local_tensor(t).element_size()


def _state_bytes(params: list, optimizer, extra: list = ()) -> tuple[int, int, int]:
    """(param, grad, optimizer) bytes of this rank: local shards (and `extra` tensors it holds whole: QLoRA's
    quantisation states), their gradients, Adam's moments."""
    import torch

    moments = sum(_local_bytes(v) for state in optimizer.state.values() for k, v in state.items()
                  if k != "step" and torch.is_tensor(v))
    grads = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    return sum(_local_bytes(p) for p in [*params, *extra]), grads, moments


def _rank_params(model) -> list:
    return list(model.runner.parameters() if hasattr(model, "runner") else model.parameters())


def _meta_state_bytes(model) -> tuple[int, int, int]:
    """State bytes of a sharded meta model: gradients as FSDP2 leaves them after its reduce-scatter (a DTensor
    shaped like the parameter's shard), Adam's state from a real AdamW step on them."""
    import torch
    from torch import nn

    from hfdist.parallel.dtensors import local_tensor

    params = _rank_params(model)
    trainable = [p for p in params if p.requires_grad]
    for p in trainable:
        p.grad = torch.zeros_like(p)
    # The Trainer's AdamW keeps the same state (fused or not): exp_avg and exp_avg_sq like the parameter, for a
    # DTensor a DTensor whose local tensor is shaped like the local shard. Stepped on the local shards here: the
    # same tensors, without DTensor's per-op dispatch (a third of a 70B simulation's time).
    local = [nn.Parameter(local_tensor(p)) for p in trainable]
    for p, shard in zip(local, trainable):
        p.grad = local_tensor(shard.grad)
    optimizer = torch.optim.AdamW(local, lr=1e-5, foreach=False)
    optimizer.step()
    from hfdist.models.quantize import quant_state_tensors

    return _state_bytes(params, optimizer, quant_state_tensors(model))


def step_attention(attention: str, cp: int = 1) -> str:
    """The implementation a simulated step runs for `attention`: sdpa / eager as asked, with their dense mask (what
    the step is to show); every mask-free choice as sdpa without a mask: the step's rows are one document each, so
    causal attention is their document attention, and sdpa's causal kernel holds what flash varlen holds. Under cp
    (no step) hfdist's document attention, as the job builds it: its boundaries are what every cp method reads."""
    from hfdist.models.attention import DOCUMENT_ATTENTION, uses_dense_mask

    return attention if uses_dense_mask(attention) else DOCUMENT_ATTENTION if cp > 1 else "sdpa"


def _dense_mask(attention: str, seq: int, micro_batch: int) -> dict:
    """A simulated step's dense mask (one document per row; fake like every tensor of the step: no memory at any
    length), or nothing for a mask-free `attention`."""
    import torch

    from hfdist.data.collation import attention_inputs
    from hfdist.models.attention import uses_dense_mask

    if not uses_dense_mask(attention):
        return {}
    return attention_inputs(torch.arange(seq).repeat(micro_batch, 1), attention)


def _simulated_step(model, rung: Rung, seq: int, micro_batch: int, mixed_precision: str,
                    attention: str) -> tuple[tuple[int, int, int], dict[str, int]]:
    """One training step of a sharded meta model in fake tensors (shapes and dtypes, no data), under torch's FSDP2
    memory tracker: forward with the job's loss (vocab-parallel under TP), backward, AdamW step. Returns the state
    bytes after the step and the tracker's breakdown at the step's peak ("Total", ...), with "Activation" the
    activations' own high-water mark."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.tensor.parallel import loss_parallel

    from hfdist.models.build import materialize
    from hfdist.models.chunked_loss import causal_lm_loss

    with FakeTensorMode(allow_non_fake_inputs=True):
        materialize(model, torch.device("cpu"))
        params = _rank_params(model)
        optimizer = torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-5, foreach=False)
        batch = {"input_ids": torch.randint(0, model.config.vocab_size, (micro_batch, seq)),
                 **_dense_mask(attention, seq, micro_batch)}
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((batch["input_ids"],))
        with tracker, (loss_parallel() if rung.uses_tp else contextlib.nullcontext()):
            # The job's loss (HfdistTrainer.causal_lm_loss): chunked over the sequence (the planner's default
            # chunk), each chunk's logits vocab-parallel under TP.
            loss = causal_lm_loss(model, batch)
            forward = [*tracker.get_tracker_snapshot("peak").values(), *tracker.get_tracker_snapshot("current").values()]
            loss.backward()
            optimizer.step()
        (peak,) = tracker.get_tracker_snapshot("peak").values()
        named = {getattr(k, "value", k): int(v) for k, v in peak.items()}
        # The tracker keeps the breakdown at a total peak; where the optimizer step is the step's (small models,
        # short sequences) the activations are gone by then, and their high-water mark is the forward's own peak
        # (inside the loss, while a chunk's logits exist) or, where that peak came earlier (activation
        # checkpointing: a layer's all-gather), the end of forward.
        activations = max(named["Activation"], *(int(v) for snapshot in forward for k, v in snapshot.items()
                                                 if getattr(k, "value", k) == "Activation"))
        # The fused loss computes lm_head's weight gradient in the forward, so the tracker files it under activations
        # (at the end of forward, hence in that maximum); the planner counts it with the gradients, where it ends up.
        activations -= _fused_head_grad_bytes(model, rung.dims.tp, 2 if mixed_precision == "bf16" else 4)
        return _state_bytes(params, optimizer), {**named, "Activation": activations}


def _fused_head_grad_bytes(model, tp: int, elem: int) -> int:
    """Bytes of the lm_head weight gradient the job's fused loss computes in the forward on this rank: of the
    weight FSDP2 gathers (its tp shard) in the compute dtype (`elem` bytes); 0 where lm_head is frozen. (The
    simulated rungs keep lm_head a plain Linear, gathered with the root: the fused loss applies.)"""
    from hfdist.models.chunked_loss import find_causal_lm_head

    causal_lm, name = find_causal_lm_head(model)
    weight = getattr(causal_lm, name).weight
    return weight.numel() // tp * elem if weight.requires_grad else 0


def _distinct_stages(num_layers: int, pp: int) -> list[tuple[int, tuple[int, ...]]]:
    """(representative stage, the stages it stands for): stages holding the same number of layers and neither the
    embedding nor the head hold the same shapes, so one of them is simulated (a 405B model on pp=8: 4 roles)."""
    from hfdist.parallel.pipeline.plan import split_stages

    groups: dict[tuple, list[int]] = {}
    for stage, layers in enumerate(split_stages(num_layers, pp)):
        groups.setdefault((len(layers), stage == 0, stage == pp - 1), []).append(stage)
    return sorted((stages[0], tuple(stages)) for stages in groups.values())


def _planned_activations(config, rung: Rung, mixed_precision: str, activation_checkpointing: bool, seq: int,
                         micro_batch: int, attention: str) -> int:
    from hfdist.models.shape import ModelShape
    from hfdist.plan.bytes import Workload, rung_rank_bytes

    workload = Workload(seq=seq, micro_batch=micro_batch, dtype=mixed_precision,
                        activation_checkpointing=activation_checkpointing or rung.fsdp.activation_checkpointing,
                        attention=attention)
    return rung_rank_bytes(ModelShape.from_config(config), rung, rung.dims, workload).activations


def _check_qlora_simulation(rung: Rung, step_seq: int | None) -> None:
    """Refuse a --qlora simulation this module does not run: a rung that does not take --qlora, pipeline stages
    (the prediction of an adapter run is per rank, not per stage) or a simulated step (bitsandbytes' 4-bit matmul on
    fake tensors is not verified)."""
    from hfdist.config.features import refuse_unless
    from hfdist.config.finetune import ConfigError
    try:
        refuse_unless(rung, "qlora")
    except ConfigError as exc:
        raise SimulateError(str(exc)) from exc
    if rung.uses_pipeline or step_seq is not None:
        raise SimulateError(f"hfdist simulate --qlora runs the recipe without pipeline stages and without --step; "
                            f"{rung.name} {'has pipeline stages' if rung.uses_pipeline else 'was asked for --step'}. "
                            "Simulate fsdp_full_shard, fsdp_hybrid, fsdp_offload or fsdp_cp, without --step.")


def simulate(model_spec: str, rung: Rung, *, mixed_precision: str = "bf16", activation_checkpointing: bool = False,
             gpus_per_node: int = 8, step_seq: int | None = None, micro_batch: int = 1,
             attention: str = "auto", qlora: bool = False, lora_r: int = 16, lora_alpha: int = 32) -> Simulation:
    """Run the parallelize recipe for every distinct rank role of `rung` (from `simulation_rung`) on a meta
    `model_spec` under a fake process group; see the module docstring.

    `step_seq`: also run one training step of `micro_batch` sequences of that length in fake tensors under FSDP2's
    memory tracker (hfdist's own non-pipeline rungs; a pipeline's schedule exchanges activations between stages,
    which this does not drive) and report its activation peak against the planner's; the state bytes then come
    from that step's real gradients and optimizer state. `attention`: the --attn-implementation the step stands
    for (`step_attention`: sdpa / eager hold their dense mask in the step and in the planner's figure).

    A role that fails verification (a bug in the recipe, not bad input) is reported in `failure` (bytes still read).

    `qlora`: the model QLoRA trains (4-bit projections, hfdist.models.quantize.quantize_meta, then LoRA r=`lora_r`),
    on the rungs that take --qlora, without pipeline stages or a simulated step; each rank also holds its 4-bit
    layers' quantisation states whole.

    Raises:
        SimulateError: a process group already exists, or --qlora where it is not simulated.
    """
    import torch

    from hfdist.models.build import meta_model
    from hfdist.parallel.expert_check import check_moe
    from hfdist.parallel.parallelize import parallelize
    from hfdist.parallel.verify import StrategyNotInEffect, verify_strategy

    if step_seq is not None and (rung.uses_pipeline or rung.dims.cp > 1):
        kind, why = ("pipeline", "runs a schedule across stages") if rung.uses_pipeline else \
            ("context-parallel", f"cuts each row over cp={rung.dims.cp} ranks before the model sees it")
        raise SimulateError(f"A simulated step drives one model's forward and backward on whole rows; {rung.name} "
                            f"{why}. Leave out --step for {kind} rungs (their state bytes are simulated all the same).")
    if qlora:
        _check_qlora_simulation(rung, step_seq)
    start = time.perf_counter()
    dims = rung.dims
    template = meta_model(model_spec, attn_implementation=step_attention(attention, dims.cp))
    check_moe(template.config, rung, simulated_step=step_seq is not None)  # an MoE model against the rung

    def fresh_model():
        """The role's own copy of the model (bitsandbytes' meta parameters cannot be deep-copied: built anew)."""
        if not qlora:
            return copy.deepcopy(template)
        from hfdist.models.build import inject_lora
        from hfdist.models.quantize import quantize_meta

        built = meta_model(model_spec, attn_implementation=step_attention(attention, dims.cp))
        return inject_lora(quantize_meta(built), lora_r, lora_alpha)
    roles, failure = [], ""
    for stage, stages in _distinct_stages(template.config.num_hidden_layers, dims.pp):
        rank = stage * dims.tp  # mesh coordinates (dp_replicate 0, dp_shard 0, pp stage, tp 0)
        with _fake_rank(rank, rung.num_processes, min(gpus_per_node, rung.num_processes)):
            model = parallelize(fresh_model(), rung, device=torch.device("cpu"),
                                mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing)
            try:
                verify_strategy(rung, model, model, lora=qlora, qlora=qlora)
            except StrategyNotInEffect as exc:
                failure = failure or f"rank {rank}: {exc}"
            step = None
            if step_seq is None:
                param, grad, optimizer = _meta_state_bytes(model)
            else:
                (param, grad, optimizer), peak = _simulated_step(model, rung, step_seq, micro_batch, mixed_precision,
                                                                 attention)
                step = StepPeak(step_seq, micro_batch, peak["Activation"], peak["Total"],
                                _planned_activations(template.config, rung, mixed_precision, activation_checkpointing,
                                                     step_seq, micro_batch, attention))
        predicted = predict_state_bytes(template.config, rung, dtype=mixed_precision, qlora=qlora, lora_r=lora_r,
                                        stage=None if qlora else stage)
        roles.append(RoleBytes(rank, stage, param, grad, optimizer, predicted, step, stages))
    return Simulation(model_spec, rung, mixed_precision, tuple(roles), time.perf_counter() - start, failure, attention)
