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

and reads the rank's bytes from the local shards: parameters, gradients, Adam's moments (its step counters, a
few bytes per tensor, left out as the planner leaves them out). Next to them, hfdist.plan.predict_state_bytes
for the same stage: what `hfdist plan` and the run summaries compare against.

The representative rank of pipeline stage s is the one at mesh coordinates (dp 0, stage s, tp 0) = s x tp; other
ranks of a stage differ by at most one row per tensor where FSDP2's dim-0 split is uneven.

Only hfdist's own rungs can be simulated. DeepSpeed rungs are refused: DeepSpeed's engine (and zero.Init) places
its flat partitions in real memory and runs real collectives while it builds, neither of which the meta device
and a fake group provide; DDP and the single process hold the whole model on every rank (`hfdist plan` counts
them exactly).
"""

from __future__ import annotations

import copy
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

from hfdist.errors import HfdistError
from hfdist.job.ladder import LadderError, Rung, StrategyKind, load_rung
from hfdist.parallel.pipeline.plan import MULTI_STAGE_SCHEDULES
from hfdist.plan.bytes import StateBytes, predict_state_bytes

__all__ = ["SimulateError", "RoleBytes", "Simulation", "simulation_rung", "simulate"]


class SimulateError(HfdistError, ValueError):
    """A simulation hfdist cannot run: a rung it does not apply itself, or degrees that do not fit."""


@dataclass(frozen=True)
class RoleBytes:
    """Model-state bytes one simulated rank holds, and what the planner predicts for it."""

    rank: int
    stage: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    predicted: StateBytes

    def relative_error(self) -> float:
        """The largest |measured - predicted| / predicted over params, grads and optimizer state."""
        pairs = ((self.param_bytes, self.predicted.param_bytes), (self.grad_bytes, self.predicted.grad_bytes),
                 (self.optimizer_bytes, self.predicted.optimizer_bytes))
        return max(abs(got - want) / want if want else float(got != 0) for got, want in pairs)

    def to_json(self) -> dict:
        """One entry of `ranks` in `hfdist simulate --json`."""
        return {"rank": self.rank, "stage": self.stage, "param_bytes": self.param_bytes,
                "grad_bytes": self.grad_bytes, "optimizer_bytes": self.optimizer_bytes,
                "predicted": asdict(self.predicted), "relative_error": self.relative_error()}


@dataclass(frozen=True)
class Simulation:
    """What `simulate` found for one model, rung and world."""

    model: str
    rung: Rung
    mixed_precision: str
    roles: tuple[RoleBytes, ...]
    seconds: float
    failure: str = ""  # verify's message for the first role that failed it

    @property
    def verified(self) -> bool:
        """Whether every simulated role passed hfdist.parallel.verify."""
        return not self.failure

    def to_json(self) -> dict:
        """The `hfdist simulate --json` object."""
        return {"model": self.model, "config": self.rung.name, "num_processes": self.rung.num_processes,
                "dims": self.rung.dims.to_dict(), "mixed_precision": self.mixed_precision,
                "verified": self.verified, "seconds": round(self.seconds, 2),
                "ranks": [r.to_json() for r in self.roles], **({"failure": self.failure} if self.failure else {})}

    def table(self) -> str:
        """Per-role bytes against the prediction, as `hfdist simulate` prints them."""
        gb = 1e9
        lines = [f"hfdist simulate: {self.model} on {self.rung.name}, {self.rung.num_processes} ranks "
                 f"({self.rung.dims.layout()}), {self.mixed_precision}: verify "
                 f"{'passed' if self.verified else 'FAILED'} ({self.seconds:.1f} s)",
                 f"{'rank':>6} {'stage':>5} {'params GB':>10} {'grads GB':>9} {'optim GB':>9}  "
                 f"{'predicted p / g / o GB':>24} {'error':>7}"]
        for r in self.roles:
            p = r.predicted
            predicted = f"{p.param_bytes / gb:.3f} / {p.grad_bytes / gb:.3f} / {p.optimizer_bytes / gb:.3f}"
            lines.append(f"{r.rank:>6} {r.stage:>5} {r.param_bytes / gb:>10.3f} {r.grad_bytes / gb:>9.3f} "
                         f"{r.optimizer_bytes / gb:>9.3f}  {predicted:>24} {r.relative_error():>7.2%}")
        if self.failure:
            lines.append(f"hfdist: verify failed: {self.failure}")
        return "\n".join(lines)


def simulation_rung(config_name: str, num_processes: int, *, tp: int | None = None, pp: int | None = None,
                    dp_replicate: int | None = None, pp_schedule: str | None = None,
                    pp_microbatches: int | None = None, gpus_per_node: int = 8, model_config=None) -> Rung:
    """The rung `config_name` fitted to `num_processes` ranks on nodes of `gpus_per_node` GPUs, as a GPU launch
    would fit it (hfdist.job.world), with the pipeline schedule / micro-batches given, checked against the model's
    heads and layers when `model_config` is given (as the launcher's preflight checks them).

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
        rung = rung.with_num_processes(num_processes, tp=tp, pp=pp, dp_replicate=dp_replicate,
                                       node_size=min(gpus_per_node, num_processes))
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
        from hfdist.job.preflight import check_pipeline
        from hfdist.parallel.tensor_check import validate_tp

        if rung.dims.tp > 1:
            validate_tp(model_config, rung.dims.tp)
        check_pipeline(rung, rung.pipeline.n_microbatches if rung.pipeline else 1, model_config.num_hidden_layers)
    return rung


@contextmanager
def _fake_rank(rank: int, world_size: int, local_world_size: int):
    """This process as rank `rank` of a fake world (no communication), with the node size verify reads."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise SimulateError("hfdist simulate needs a process without a process group; this one already has one. "
                            "Run it as its own command (hfdist simulate ...).")
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved


def _local_bytes(t) -> int:
    """Bytes of this rank's piece of `t` (a DTensor's local shard, a plain tensor whole)."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _rank_state_bytes(model) -> tuple[int, int, int]:
    """(param, grad, optimizer) bytes of a sharded meta model: gradients as FSDP2 leaves them after its
    reduce-scatter (a DTensor shaped like the parameter's shard), Adam's state from a real AdamW step on them."""
    import torch

    params = list(model.runner.parameters() if hasattr(model, "runner") else model.parameters())
    trainable = [p for p in params if p.requires_grad]
    for p in trainable:
        p.grad = torch.zeros_like(p)
    # The Trainer's AdamW keeps the same state (fused or not): exp_avg and exp_avg_sq like the parameter.
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, foreach=False)
    optimizer.step()
    moments = sum(_local_bytes(v) for state in optimizer.state.values() for k, v in state.items()
                  if k != "step" and torch.is_tensor(v))
    return (sum(_local_bytes(p) for p in params), sum(_local_bytes(p.grad) for p in trainable), moments)


def simulate(model_spec: str, rung: Rung, *, mixed_precision: str = "bf16", activation_checkpointing: bool = False,
             gpus_per_node: int = 8) -> Simulation:
    """Run the parallelize recipe for every distinct rank role of `rung` (from `simulation_rung`) on a meta
    `model_spec` under a fake process group; see the module docstring.

    A role that fails verification (a bug in the recipe, not bad input) is reported in `failure`; its bytes are
    still read.

    Raises:
        SimulateError: a process group already exists.
    """
    import torch

    from hfdist.models.build import meta_model
    from hfdist.parallel.parallelize import parallelize
    from hfdist.parallel.verify import StrategyNotInEffect, verify_strategy

    start = time.perf_counter()
    dims = rung.dims
    template = meta_model(model_spec)
    roles, failure = [], ""
    for stage in range(dims.pp):
        rank = stage * dims.tp  # mesh coordinates (dp_replicate 0, dp_shard 0, pp stage, tp 0)
        with _fake_rank(rank, rung.num_processes, min(gpus_per_node, rung.num_processes)):
            model = parallelize(copy.deepcopy(template), rung, device=torch.device("cpu"),
                                mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing)
            try:
                verify_strategy(rung, model, model, lora=False)
            except StrategyNotInEffect as exc:
                failure = failure or f"rank {rank}: {exc}"
            param, grad, optimizer = _rank_state_bytes(model)
        predicted = predict_state_bytes(template.config, rung, dtype=mixed_precision, stage=stage)
        roles.append(RoleBytes(rank, stage, param, grad, optimizer, predicted))
    return Simulation(model_spec, rung, mixed_precision, tuple(roles), time.perf_counter() - start, failure)
