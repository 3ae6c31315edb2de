"""The candidates `hfdist tune` may probe: every layout the planner finds for the job on this machine (the rungs
asked for, their degrees, and the micro-batches, recompute, compile and fp8 settings tune may change), each with
its planned per-rank bytes and predicted step time on the measured hardware, kept when it fits with a margin, in
order of predicted speed.

A candidate changes how the job trains, never what it trains: the model, data, sequence length, global batch,
optimizer and schedule are the job's; degrees the job pins (--tp / --pp / --cp) stay pinned.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hfdist.config.finetune import FinetuneConfig
from hfdist.config.ladder import Rung, known_rung_names, load_rung
from hfdist.config.rungs import RUNG_INFO
from hfdist.plan.bytes import RankBytes, Workload, offload_device
from hfdist.plan.cost import Hardware, StepCost
from hfdist.plan.layouts import Cluster, Layout, Pins, rung_layouts
from hfdist.tune.options import TuneOptions

__all__ = ["Candidate", "Skipped", "default_rungs", "tune_candidates", "tiebreak_candidates", "simplicity",
           "workload_of"]


@dataclass(frozen=True)
class Candidate:
    """One layout with the compile / fp8 settings it runs with, and what the planner expects of it."""

    layout: Layout
    compile: bool
    fp8: str | None
    planned: RankBytes
    predicted: StepCost
    numerics: str  # the precision it trains in: fp32, bf16 or fp8-RECIPE (probes' losses compare within one)

    @property
    def key(self) -> str:
        """A stable name: rung, degrees, micro-batch, recompute, compile, fp8 (the probe's folder and log key)."""
        d = self.layout.dims
        parts = [self.layout.rung.name] + [f"{axis}{getattr(d, axis)}" for axis in
                                            ("dp_replicate", "dp_shard", "cp", "pp", "tp", "ep") if getattr(d, axis) > 1]
        if d.cp > 1:
            parts.append(self.layout.rung.context.method)
        parts.append(f"mb{self.layout.micro_batch}")
        parts += ["ac"] * self.layout.activation_checkpointing + ["compile"] * self.compile
        parts += [f"fp8{self.fp8}"] if self.fp8 else []
        return "-".join(parts)

    def describe(self) -> str:
        """The rung and its layout, in words."""
        extra = [x for x, on in (("compile", self.compile), (f"fp8 {self.fp8}", self.fp8)) if on]
        return f"{self.layout.rung.name}: {', '.join([self.layout.describe(), *extra])}"

    def job_options(self) -> dict[str, Any]:
        """The FinetuneConfig fields that run this candidate."""
        return {**self.layout.job_options(), "compile": self.compile, "fp8": self.fp8}


@dataclass(frozen=True)
class Skipped:
    """A rung or layout left out, and why."""

    what: str
    reason: str


def default_rungs(on_gpu: bool) -> list[str]:
    """Every shipped rung but the single process and, off a GPU (where nothing offloads), the offload rungs."""
    out = []
    for name in known_rung_names():
        rung = load_rung(name)
        if name == "single" or (offload_device(rung) != "none" and not on_gpu):
            continue
        out.append(name)
    return out


def simplicity(rung: str) -> int:
    """The rung's place in the rung table's plan order: the simplest and most tested first (the single process,
    ddp, zero1, ...); a rung the table does not list after them all."""
    info = RUNG_INFO.get(rung)
    return info.plan_order if info is not None else 10**6


def workload_of(cfg: FinetuneConfig, mixed_precision: str, hardware: Hardware, fp8: str | None = None) -> Workload:
    """The planner's Workload of the job on `hardware` (its micro-batch and recompute are each layout's)."""
    return Workload(seq=cfg.seq_len, lora=cfg.lora, lora_r=cfg.lora_r, qlora=cfg.qlora,
                    lora_targets=cfg.lora_target_modules or Workload.lora_targets,
                    dtype="bf16" if mixed_precision == "bf16" else "fp32",
                    loss_chunk_size=cfg.loss_chunk_size or None, fp8=fp8, workspace=hardware.workspace_bytes)


def _takes(rung: Rung, feature: str) -> bool:
    info = rung.info or RUNG_INFO.get(rung.name)
    return info is not None and info.takes(feature)


def tune_candidates(cfg: FinetuneConfig, opts: TuneOptions, config, cluster: Cluster, *, memory_bytes: int,
                    hardware: Hardware, on_gpu: bool) -> tuple[list[Candidate], list[Skipped]]:
    """The candidates tune may probe, fastest predicted first, and what was left out with the reason.

    Raises:
        LadderError: a --configs name that is no rung.
    """
    from hfdist.config.precision import effective_mixed_precision
    from hfdist.plan.planner import assess_layouts

    consider = set(opts.consider)
    searched = "micro-batch" in consider
    pins = Pins(tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, cp_method=cfg.cp_method,
                micro_batch=None if searched else cfg.micro_batch_size,
                activation_checkpointing=None if "recompute" in consider else cfg.activation_checkpointing,
                no_accumulation=not searched and cfg.micro_batch_size is None)
    compiles = (False, True) if "compile" in consider else (cfg.compile,)
    fp8s = (None, cfg.fp8 or "tensorwise") if "fp8" in consider else (cfg.fp8,)
    out, skipped = [], []
    limit = (1 - opts.margin) * memory_bytes
    for name in opts.configs or default_rungs(on_gpu):
        rung = load_rung(name)
        layouts, reason = rung_layouts(rung, config, cluster, global_batch=cfg.global_batch_size, seq=cfg.seq_len,
                                       pins=_pins_for(rung, pins, cfg))
        if not layouts:
            skipped.append(Skipped(name, reason))
            continue
        for compile_, fp8 in ((c, f) for c in compiles for f in fp8s):
            why = _feature_refusal(rung, compile_, fp8, cfg)
            if why:
                skipped.append(Skipped(f"{name}{' --compile' if compile_ else ''}{f' --fp8 {fp8}' if fp8 else ''}",
                                       why))
                continue
            mixed = effective_mixed_precision(rung, on_gpu, cfg.mixed_precision)
            workload = workload_of(cfg, mixed, hardware, fp8)
            numerics = f"fp8-{fp8}" if fp8 else ("bf16" if mixed == "bf16" else "fp32")
            for a in assess_layouts(config, layouts, cluster, workload=workload, hardware=hardware):
                what = f"{name}: {a.layout.describe()}"
                if a.refusal:
                    skipped.append(Skipped(what, a.refusal))
                elif a.bytes.total > limit:
                    skipped.append(Skipped(what, f"planned {a.bytes.total / 1e9:.2f} GB per rank, more than "
                                                 f"{limit / 1e9:.2f} GB ({1 - opts.margin:.0%} of a device)"))
                else:
                    out.append(Candidate(a.layout, compile_, fp8, a.bytes, a.cost, numerics))
    out.sort(key=lambda c: -c.predicted.tokens_per_second)
    return out, skipped


def _pins_for(rung: Rung, pins: Pins, cfg: FinetuneConfig) -> Pins:
    """A pinned job micro-batch under a pipeline is the rank's batch, split into the rung's micro-batches."""
    if pins.micro_batch is not None and rung.dims.pp > 1 and rung.pipeline is not None:
        n = rung.pipeline.n_microbatches
        return replace(pins, micro_batch=pins.micro_batch // n if pins.micro_batch % n == 0 else 0)
    return pins


def _feature_refusal(rung: Rung, compile_: bool, fp8: str | None, cfg: FinetuneConfig) -> str:
    for feature, on in (("compile", compile_), ("fp8", fp8 is not None), ("qlora", cfg.qlora)):
        if on and not _takes(rung, feature):
            info = rung.info or RUNG_INFO.get(rung.name)
            reason = getattr(info, feature, None) if info is not None else None
            return f"does not take --{feature}" + (f": {reason}" if isinstance(reason, str) else "")
    if fp8 is not None and cfg.lora:
        return "--fp8 is refused with --lora (docs/fp8.md)"
    return ""


def tiebreak_candidates(cfg: FinetuneConfig, opts: TuneOptions, config, cluster: Cluster, candidates: list[Candidate],
                        *, memory_bytes: int, single_memory_bytes: int, hardware: Hardware,
                        on_gpu: bool) -> list[Candidate]:
    """The layouts that may break a tie between probes that disagree (hfdist.tune.session), simplest rung first:
    of each rung and precision, the fastest predicted layout that fits with tune's margin, without --compile. The
    rungs are the single process (on one device of `single_memory_bytes`, the same global batch accumulated), every
    default rung and those of `candidates` (the rungs asked for, already assessed): a tie-break may need a rung
    --configs left out, and is never chosen unless it is a candidate itself."""
    plain = replace(opts, consider=tuple(c for c in opts.consider if c != "compile"))
    found = [c for c in candidates if not c.compile]
    asked = {c.layout.rung.name for c in candidates}
    found += tune_candidates(cfg, replace(plain, configs=("single",)), config, Cluster(1),
                             memory_bytes=single_memory_bytes, hardware=hardware, on_gpu=on_gpu)[0]
    rest = tuple(name for name in default_rungs(on_gpu) if name not in asked)
    if rest:
        found += tune_candidates(cfg, replace(plain, configs=rest), config, cluster, memory_bytes=memory_bytes,
                                 hardware=hardware, on_gpu=on_gpu)[0]
    best: dict[tuple[str, str], Candidate] = {}
    for c in found:
        kind = (c.layout.rung.name, c.numerics)
        if kind not in best or c.predicted.tokens_per_second > best[kind].predicted.tokens_per_second:
            best[kind] = c
    return sorted(best.values(), key=lambda c: simplicity(c.layout.rung.name))
