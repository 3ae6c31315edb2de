"""The layouts a rung can take on a cluster: every degree of its model-parallel axes, micro-batch and recompute
setting the job accepts there, each as the options `hfdist finetune` runs it with.

A rung varies the axes its config has above 1 (fsdp_tp: tp; pp: pp; 3d: tp and pp; fsdp_cp: cp; the data-parallel
rungs none); the data-parallel axes absorb the rest of the world, as the job does (hfdist.config.ladder
`Rung.with_num_processes`, which every layout goes through, so every degree listed is one the job takes). Degrees:

    tp   divisors of the GPUs of a node (tensor parallelism stays inside a node), that split the heads, kv heads
         and projections (hfdist.parallel.tensor_check.validate_tp)
    cp   divisors of the ranks left by tp that cut the sequence, each with every method that can split the model
         there (hfdist.parallel.context_check.plan_cp: Ulysses where the heads per tp rank allow, ring, hybrid):
         Ulysses' all-to-alls want a node, the ring's point-to-point messages may cross nodes; the cost model
         prices each (hfdist.plan.cost)
    pp   divisors of the ranks left by tp x cp, at most one decoder layer per stage
    micro-batch  sequences per rank per forward: divisors of the rank's share of the global batch (under a pipeline
         multiples of its micro-batches), the accumulation making up the rest
    recompute    activation checkpointing off and on

`--tp / --pp / --cp / --cp-method / --micro-batch / --activation-checkpointing` pin one; a rung without the pinned
axis is left out with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable

from hfdist.config.dims import ParallelDims
from hfdist.config.ladder import ContextSettings, LadderError, Rung, StrategyKind
from hfdist.errors import HfdistError
from hfdist.plan.expert_bytes import ep_rungs

__all__ = ["Cluster", "Layout", "Pins", "rung_axes", "rung_layouts", "divisors"]

_AXES = ("tp", "cp", "pp")


@dataclass(frozen=True)
class Cluster:
    """Where the layouts run: `nodes` nodes of `gpus_per_node` devices (processes on a CPU host)."""

    gpus_per_node: int
    nodes: int = 1

    @property
    def world(self) -> int:
        """Devices (ranks) in all."""
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Pins:
    """Settings the user fixed; None: searched."""

    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    micro_batch: int | None = None
    activation_checkpointing: bool | None = None
    no_accumulation: bool = False  # the micro-batch is a rank's whole share of the global batch (the job's default)
    cp_method: str | None = None  # None or "auto": every method that can run

    def degree(self, axis: str) -> int | None:
        """The pinned degree of `axis` ("tp", "pp" or "cp"), or None."""
        return getattr(self, axis)


@dataclass(frozen=True)
class Layout:
    """One way to run a rung: its degrees on the cluster (`rung.dims`), the sequences each rank runs per forward and
    whether each decoder layer is recomputed in backward."""

    rung: Rung
    micro_batch: int  # the job's --micro-batch-size: sequences per rank per forward (a pipeline splits them)
    activation_checkpointing: bool
    global_batch: int  # sequences per optimizer step over all ranks

    @property
    def accumulation(self) -> int:
        """Forward/backward passes per optimizer step."""
        return self.global_batch // (self.micro_batch * self.dims.dp)

    @property
    def dims(self) -> ParallelDims:
        """The layout's degrees."""
        return self.rung.dims

    @property
    def pipeline_micro_batch(self) -> int:
        """Sequences per pipeline micro-batch (the micro-batch itself off a pipeline): what one stage's forward
        holds, and the planner's `Workload.micro_batch`."""
        if self.rung.pipeline is None:
            return self.micro_batch
        return self.micro_batch // self.rung.pipeline.n_microbatches

    def describe(self) -> str:
        """e.g. "tp=8 x dp_shard=4, micro-batch 2, recompute" ("dp_shard=4 x tp=8 x cp=4 by ring, ..." under cp)."""
        method = f" by {self.rung.context.method}" if self.dims.cp > 1 else ""
        parts = [self.dims.layout() + method, f"micro-batch {self.micro_batch}"]
        if self.activation_checkpointing:
            parts.append("recompute")
        return ", ".join(parts)

    def job_options(self) -> dict[str, Any]:
        """The FinetuneConfig fields that run this layout (rung, processes, every degree, micro-batch, recompute)."""
        d, own = self.dims, self.rung
        out: dict[str, Any] = {"config": own.name, "num_processes": own.num_processes,
                               "global_batch_size": self.global_batch, "micro_batch_size": self.micro_batch,
                               "activation_checkpointing": self.activation_checkpointing}
        for axis in _AXES:
            if getattr(d, axis) > 1:
                out[axis] = getattr(d, axis)
        if d.cp > 1:
            out["cp_method"] = own.context.method
        if d.ep > 1:
            out["ep"] = d.ep
        if own.fsdp is not None and own.fsdp.hybrid and own.kind is StrategyKind.MESH:
            out["dp_replicate"] = d.dp_replicate
        return out

    def flags(self) -> list[str]:
        """job_options as `hfdist finetune` flags."""
        out = []
        for key, value in self.job_options().items():
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                out += [flag] if value else []
            else:
                out += [flag, str(value if key != "config" else f"{value}.yaml")]
        return out


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def rung_axes(rung: Rung) -> tuple[str, ...]:
    """The model-parallel axes a rung varies: those its config sets above 1."""
    return tuple(axis for axis in _AXES if getattr(rung.dims, axis) > 1)


def _degree_options(rung: Rung, axis: str, config: Any, cluster: Cluster, pins: Pins, seq: int,
                    taken: dict[str, int]) -> list[int]:
    """The degrees `axis` may take given the degrees already chosen (`taken`)."""
    pinned = pins.degree(axis)
    if axis not in rung_axes(rung):
        return [1]
    tp = taken.get("tp", 1)
    if axis == "tp":
        candidates = [d for d in divisors(cluster.gpus_per_node) if d > 1]
    elif axis == "cp":
        candidates = [d for d in divisors(cluster.world // tp) if d > 1] if cluster.world % tp == 0 else []
    else:
        rest = cluster.world // (tp * taken.get("cp", 1))
        candidates = [d for d in divisors(rest) if 1 < d <= int(config.num_hidden_layers)]
    if pinned is not None:
        candidates = [pinned] if pinned > 1 else []
    return [d for d in candidates if _degree_valid(axis, d, config, seq, tp)]


def _degree_valid(axis: str, degree: int, config: Any, seq: int, tp: int) -> bool:
    from hfdist.parallel.context_check import check_cp
    from hfdist.parallel.tensor_check import validate_tp

    try:
        if axis == "tp":
            validate_tp(config, degree)
        elif axis == "cp":
            check_cp(config, degree, seq, tp=tp)
    except (HfdistError, ValueError):
        return False
    return True


def _degrees(rung: Rung, config: Any, cluster: Cluster, pins: Pins, seq: int) -> list[dict[str, int]]:
    combos: list[dict[str, int]] = [{}]
    for axis in _AXES:  # tp first (cp's options depend on it), pp last (it takes what tp x cp leave)
        combos = [{**taken, axis: d} for taken in combos
                  for d in _degree_options(rung, axis, config, cluster, pins, seq, taken)]
    return combos


def _with_methods(rung: Rung, config: Any, seq: int, pins: Pins) -> list[Rung]:
    """`rung` once per cp method that can split the model and cut the sequence at its degrees, each planned
    (hfdist.parallel.context_check.check_cp); itself without cp. A pinned --cp-method is the only one tried."""
    if rung.dims.cp == 1:
        return [rung]
    from hfdist.parallel.context_check import check_cp

    methods = ("ulysses", "ring", "hybrid") if pins.cp_method in (None, "auto") else (pins.cp_method,)
    out = []
    for method in methods:
        try:
            plan = check_cp(config, rung.dims.cp, seq, tp=rung.dims.tp, method=method)
        except (HfdistError, ValueError):
            continue
        out.append(replace(rung, context=ContextSettings(plan.method, plan.ulysses, plan.reason)))
    return out


def _micro_batches(rung: Rung, per_rank: int, pins: Pins) -> list[int]:
    """Micro-batches that split the rank's share of the global batch (a pipeline's: into whole pipeline
    micro-batches); a pinned one is a stage's micro-batch (Pins.micro_batch)."""
    step = rung.pipeline.n_microbatches if rung.pipeline is not None else 1
    options = [m for m in divisors(per_rank) if m % step == 0]
    if pins.micro_batch is not None:
        options = [m for m in options if m // step == pins.micro_batch]
    if pins.no_accumulation:
        options = [m for m in options if m == per_rank]
    return options


def rung_layouts(rung: Rung, config: Any, cluster: Cluster, *, global_batch: int | None, seq: int,
                 pins: Pins = Pins(), recompute: Iterable[bool] = (False, True)) -> tuple[list[Layout], str]:
    """Every layout of `rung` on `cluster` for `global_batch` sequences of `seq` tokens per step, and why there is
    none when the list is empty (module docstring).

    global_batch None: no fixed global batch; every layout runs the pinned micro-batch (default 1) per rank per
    forward with no accumulation (a pipeline: its micro-batches of that size), so its global batch follows its
    data-parallel degree.

    A rung that cannot take a pinned degree, or whose degrees divide neither the cluster nor the model, has no
    layouts; the reason names the first obstacle met.
    """
    asked = {axis for axis in _AXES if pins.degree(axis) not in (None, 1)}
    missing = sorted(asked - set(rung_axes(rung)))
    if missing:
        return [], f"has no {' / '.join(missing)} axis (--{' / --'.join(missing)} pinned)"
    if rung.kind is StrategyKind.SINGLE and cluster.world != 1:
        return [], f"runs one process, not {cluster.world}"
    ac_options = [pins.activation_checkpointing] if pins.activation_checkpointing is not None else list(recompute)
    if rung.fsdp is not None and rung.fsdp.activation_checkpointing:
        ac_options = [True]  # the YAML turns it on
    layouts, reason = [], ""
    for degrees in _degrees(rung, config, cluster, pins, seq):
        try:
            laid = rung.with_num_processes(cluster.world, node_size=cluster.gpus_per_node,
                                           **{k: v for k, v in degrees.items() if k in rung_axes(rung)})
        except LadderError as exc:
            reason = reason or str(exc)
            continue
        step = laid.pipeline.n_microbatches if laid.pipeline is not None else 1
        batch = global_batch if global_batch is not None else (pins.micro_batch or 1) * step * laid.dims.dp
        if batch % laid.dims.dp:
            reason = reason or (f"its {laid.dims.dp} data-parallel ranks at {laid.dims.layout()} do not divide the "
                                f"global batch of {batch}")
            continue
        micro = _micro_batches(laid, batch // laid.dims.dp, pins)
        if not micro:
            reason = reason or f"no micro-batch splits {global_batch // laid.dims.dp} sequences per rank at " \
                               f"{laid.dims.layout()}" + (" into its pipeline micro-batches" if laid.pipeline else "")
        planned = _with_methods(laid, config, seq, pins)
        if not planned:
            reason = reason or f"--cp-method {pins.cp_method} cannot split the model at {laid.dims.layout()}"
        # an MoE model's ep degrees on the rungs that take --ep (hfdist.plan.expert_bytes)
        planned = [r for method in planned for r in ep_rungs(method, config, cluster.gpus_per_node)]
        if not planned and not reason:
            reason = "splits an MoE model's experts (expert parallelism), and this model has none"
        layouts += [Layout(method, m, ac, batch) for method in planned for m in micro for ac in ac_options]
    if not layouts and not reason:
        reason = "no degree of its axes splits this model on this cluster" if rung_axes(rung) else \
            "does not fit this cluster"
    return layouts, reason
