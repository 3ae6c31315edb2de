"""The config ladder: each rung of the decision table as a matched Accelerate YAML (+ DeepSpeed JSON).

The YAML files in hfdist/configs/accelerate_configs/ (with their DeepSpeed JSONs in hfdist/configs/ds_configs/;
the repository's accelerate_configs/ and ds_configs/ link there) are the source of truth for a rung's launch
settings (process count, distributed type, FSDP options, parallelism sizes); this module parses them into a typed
`Rung` and adds what a user needs to choose one (scenario, what is sharded, when to pick it). Users' own YAMLs go
through the same parser, with other projects' keys translated or refused by name (hfdist.config.translate).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from hfdist.config.dims import DimsError, ParallelDims
from hfdist.config.finetune import ConfigError
from hfdist.config.rungs import RUNG_INFO, RungInfo
from hfdist.config.translate import read_fp8, read_fsdp_config, refuse_unimplemented
from hfdist.errors import HfdistError

__all__ = [
    "StrategyKind",
    "Rung",
    "FsdpSettings",
    "PipelineSettings",
    "ContextSettings",
    "LadderError",
    "CONFIG_ROOT",
    "RUNG_INFO",
    "known_rung_names",
    "load_rung",
    "single_process_rung",
    "ds_mixed_precision",
    "deepspeed_rung",
    "read_accelerate_yaml",
    "resolve_deepspeed_json",
]

# The ladder ships inside the package (package data), so an installed hfdist finds it from any directory.
CONFIG_ROOT = Path(__file__).resolve().parents[1] / "configs"


class LadderError(HfdistError, ValueError):
    """A config name or file that is not a usable rung."""


class StrategyKind(str, Enum):
    """Who applies a rung's parallelism to the model."""

    SINGLE = "single"  # one process, no distribution: the reference every strategy is compared with
    DDP = "ddp"  # the Trainer wraps the model in DistributedDataParallel
    DEEPSPEED = "deepspeed"  # the Trainer hands the model to DeepSpeed (ZeRO 1/2/3, AutoTP, offload)
    MESH = "mesh"  # hfdist applies FSDP2 / TP / PP itself on one DeviceMesh before the Trainer sees the model

    @property
    def owns_sharding(self) -> bool:
        """hfdist places the model states itself (the Trainer must neither wrap nor move the model)."""
        return self is StrategyKind.MESH

    @property
    def trainer_wraps(self) -> bool:
        """The Trainer / accelerate applies the strategy (DDP or DeepSpeed)."""
        return self in (StrategyKind.DDP, StrategyKind.DEEPSPEED)


@dataclass(frozen=True)
class FsdpSettings:
    """The FSDP2 options hfdist honours from a YAML's fsdp_config (FSDP1 keys translated: hfdist.config.translate)."""

    layer_cls_to_wrap: str | None = None  # None: the model's decoder layer (hfdist.parallel.fsdp.fsdp_unit_class)
    reshard_after_forward: bool = True
    offload_params: bool = False
    activation_checkpointing: bool = False
    hybrid: bool = False  # HSDP: shard inside a node, replicate across nodes


@dataclass(frozen=True)
class PipelineSettings:
    """hfdist's pipeline options, read from a YAML's parallelism_config (accelerate has no PP for HF models and
    passes these keys over untouched): parallelism_config_pp_size / _pp_schedule / _pp_microbatches."""

    schedule: str = "1F1B"
    n_microbatches: int = 4


@dataclass(frozen=True)
class ContextSettings:
    """How the cp ranks split attention (--cp-method; hfdist.parallel.context_check.plan_cp): the method asked for,
    and once planned for the model and --seq-len, the method chosen, its Ulysses degree and why."""

    method: str = "auto"
    ulysses: int | None = None  # None: not planned yet
    reason: str = ""


@dataclass(frozen=True)
class Rung:
    """One launchable strategy: where its configs are and what it does to the model."""

    name: str
    kind: StrategyKind
    num_processes: int
    dims: ParallelDims
    mixed_precision: str = "no"
    fp8: str | None = None  # the YAML's `mixed_precision: fp8` as hfdist's --fp8 recipe (hfdist.config.translate)
    yaml_path: Path | None = None
    ds_config_path: Path | None = None
    zero_stage: int = 0
    offload_param: str = "none"
    offload_optimizer: str = "none"
    fsdp: FsdpSettings | None = None
    pipeline: PipelineSettings | None = None
    context: ContextSettings = ContextSettings()
    info: RungInfo | None = None
    notes: tuple[str, ...] = ()  # what hfdist translated from the config file, printed once by the run

    @property
    def owns_sharding(self) -> bool:
        """hfdist applies this rung's parallelism itself (FSDP2, TP, PP on a DeviceMesh)."""
        return self.kind.owns_sharding

    @property
    def uses_deepspeed(self) -> bool:
        """DeepSpeed runs this rung."""
        return self.kind is StrategyKind.DEEPSPEED

    @property
    def uses_pipeline(self) -> bool:
        """The model is cut into pipeline stages (pp > 1)."""
        return self.dims.pp > 1

    @property
    def uses_tp(self) -> bool:
        """Tensor parallelism splits the model's matrices (hfdist's DTensor plan, or DeepSpeed's AutoTP)."""
        return self.dims.tp > 1

    @property
    def uses_fsdp(self) -> bool:
        """hfdist applies FSDP2: every mesh rung, except a pipeline with one data-parallel rank and no cp (FSDP2
        reduces the cp ranks' gradients)."""
        return self.owns_sharding and not (self.uses_pipeline and self.dims.dp * self.dims.cp == 1)

    def with_num_processes(self, num_processes: int, *, tp: int | None = None, pp: int | None = None,
                           cp: int | None = None, dp_replicate: int | None = None,
                           node_size: int | None = None, ep: int | None = None) -> "Rung":
        """The same rung on `num_processes` processes, with the tp / pp / cp / dp_replicate / ep degrees given (None:
        the rung's own; precedence CLI > YAML). The data-parallel axis absorbs the rest; ep borrows from it.

        A hybrid (HSDP) rung shards over the ranks of one node: `node_size` // (tp x pp) when the node is known (a
        GPU node, or a launched world), else its configured dp_shard (the CPU runs' simulated node).

        Raises:
            LadderError: degrees that do not divide the processes, or that the rung's strategy does not have.
        """
        d = self.dims
        tp, pp, cp, ep = tp or d.tp, pp or d.pp, cp or d.cp, ep or d.ep
        self._check_degrees_apply(tp, pp, cp, dp_replicate)
        self._check_ep_applies(ep, cp)
        model_parallel = tp * pp * cp
        if num_processes < 1 or num_processes % model_parallel:
            what, sizes = ("tensor x pipeline", f"tp x pp = {tp} x {pp}") if cp == 1 else \
                ("tensor x pipeline x context", f"tp x pp x cp = {tp} x {pp} x {cp}")
            raise LadderError(f"{self.name} cannot run on {num_processes} processes: its {what} degrees {sizes} = "
                              f"{model_parallel} must divide the processes. Use a multiple of {model_parallel} "
                              "processes, or other --tp / --pp / --cp.")
        dp = num_processes // model_parallel
        hybrid = self.fsdp is not None and self.fsdp.hybrid
        if self.kind is StrategyKind.SINGLE:
            if num_processes != 1:
                raise LadderError(f"The single rung runs one process, not {num_processes}. Pick a distributed rung "
                                  "(e.g. --config ddp) to use more.")
            return self
        if self.kind is StrategyKind.DDP:
            dims = ParallelDims(dp_replicate=num_processes)
        elif self.uses_deepspeed:
            dims = ParallelDims(dp_shard=dp, tp=tp)
        else:
            if dp_replicate is None and hybrid:
                if node_size is not None and node_size % model_parallel:
                    raise LadderError(f"{self.name} keeps tp x pp = {model_parallel} ranks inside a node, which does "
                                      f"not divide the node's {node_size} processes. Use --tp / --pp dividing "
                                      f"{node_size}.")
                shard = min(node_size // model_parallel if node_size is not None else d.dp_shard, dp)
                if dp % shard:
                    raise LadderError(f"{self.name} shards over {shard} ranks per node (dp_shard) and replicates "
                                      f"across nodes, so its {dp} data-parallel ranks must be a multiple of {shard}. "
                                      f"Use a multiple of {shard * model_parallel} processes, or set --dp-replicate.")
                dp_replicate = dp // shard
            replicate = dp_replicate or 1
            if dp % replicate:
                raise LadderError(f"--dp-replicate {replicate} does not divide {self.name}'s {dp} data-parallel ranks "
                                  f"({num_processes} processes / tp x pp = {model_parallel}). Use a divisor of {dp}.")
            if (dp // replicate) % ep:
                raise LadderError(f"--ep {ep} borrows its ranks from {self.name}'s {dp // replicate} dp_shard ranks "
                                  f"({num_processes} processes / tp x pp x cp = {model_parallel}), which it does not "
                                  f"divide. Use an --ep dividing {dp // replicate}, or a multiple of "
                                  f"{ep * model_parallel * replicate} processes.")
            dims = ParallelDims(dp_replicate=replicate, dp_shard=dp // replicate, pp=pp, tp=tp, cp=cp, ep=ep)
        pipeline = (self.pipeline or PipelineSettings()) if dims.pp > 1 else None
        fsdp = replace(self.fsdp, hybrid=hybrid or dims.dp_replicate > 1) if self.fsdp is not None else None
        return replace(self, num_processes=num_processes, dims=dims, pipeline=pipeline, fsdp=fsdp)

    def with_pipeline(self, schedule: str | None = None, n_microbatches: int | None = None) -> "Rung":
        """The rung with --pp-schedule / --pp-microbatches applied (they override the YAML's pp settings; None keeps
        the YAML's).

        Raises:
            ConfigError: a pipeline option given for a rung without pipeline stages.
        """
        if schedule is None and n_microbatches is None:
            return self
        if self.pipeline is None:
            raise ConfigError(f"--pp-schedule / --pp-microbatches apply to pipeline rungs only, and {self.name} has "
                              "no pipeline stages (pp=1). Use --config pp.yaml or 3d.yaml, or drop these options.")
        given = {k: v for k, v in (("schedule", schedule), ("n_microbatches", n_microbatches)) if v is not None}
        return replace(self, pipeline=replace(self.pipeline, **given))

    def with_context(self, method: str) -> "Rung":
        """The rung with --cp-method applied ("auto" keeps the rung's own choice: planned per model).

        Raises:
            ConfigError: a method given for a rung without context parallelism.
        """
        if method == "auto":
            return self
        if self.dims.cp == 1:
            raise ConfigError(f"--cp-method {method} applies to rungs with context parallelism, and {self.name} has "
                              "none (cp=1). Use --config fsdp_cp / fsdp_tp_cp, or --cp N on a mesh rung, or drop "
                              "--cp-method.")
        return replace(self, context=ContextSettings(method))

    def _check_ep_applies(self, ep: int, cp: int) -> None:
        """--ep only where the rung table says the rung splits experts (its `takes_ep`; a YAML of the user's: an
        FSDP2 mesh without pipeline or context parallelism, fsdp_ep's and fsdp_tp's shapes)."""
        plain_mesh = self.kind is StrategyKind.MESH and not self.uses_pipeline and cp == 1
        if ep == 1 or (plain_mesh and (self.info is None or self.info.takes_ep)):
            return
        takers = ", ".join(n for n, i in RUNG_INFO.items() if i.takes_ep)
        raise LadderError(f"--ep {ep} cannot apply to {self.name}: expert parallelism splits a mixture-of-experts "
                          f"model's experts over FSDP2's ranks on {takers} only, without pipeline or context "
                          "parallelism. Use --config fsdp_ep (or fsdp_tp) with --ep, or drop --ep.")

    def _check_degrees_apply(self, tp: int, pp: int, cp: int, dp_replicate: int | None) -> None:
        """Degrees the rung's strategy has no axis for are refused (a silently ignored --tp is a wrong run)."""
        asked = [f"{flag} {v}" for flag, v, base in (("--tp", tp, self.dims.tp), ("--pp", pp, self.dims.pp),
                                                     ("--cp", cp, self.dims.cp))
                 if v != base] + ([f"--dp-replicate {dp_replicate}"] if dp_replicate is not None else [])
        if not asked:
            return
        what = ", ".join(asked)
        if self.kind in (StrategyKind.SINGLE, StrategyKind.DDP):
            raise LadderError(f"{what} cannot apply to {self.name}, which replicates the whole model on every rank. "
                              "Pick a rung with those axes: fsdp_tp (--tp), pp (--pp), 3d (both), fsdp_cp (--cp), "
                              "fsdp_hybrid (--dp-replicate).")
        if self.uses_deepspeed and (pp > 1 or cp > 1 or dp_replicate is not None):
            raise LadderError(f"{what} cannot apply to {self.name}: DeepSpeed's ZeRO has no pipeline stages, context "
                              "parallelism or replica groups for an HF model here. Use pp / 3d / fsdp_cp / "
                              "fsdp_hybrid for those axes.")
        if self.uses_deepspeed and tp > 1 and self.zero_stage == 3:
            raise LadderError(f"--tp {tp} cannot apply to {self.name}: DeepSpeed's AutoTP does not compose with ZeRO-3 "
                              "(DeepSpeed 0.19). Use zero2_tp (ZeRO-2 + AutoTP) or fsdp_tp.")


def known_rung_names() -> list[str]:
    """Names of the shipped rungs, in decision-table order."""
    shipped = {p.stem for p in (CONFIG_ROOT / "accelerate_configs").glob("*.yaml")}
    ordered = [n for n in RUNG_INFO if n in shipped]
    return ordered + sorted(shipped - set(ordered))


def single_process_rung() -> Rung:
    """No distribution at all: the reference every strategy is compared against."""
    return Rung(name="single", kind=StrategyKind.SINGLE, num_processes=1, dims=ParallelDims(), mixed_precision="bf16",
                info=RUNG_INFO["single"])


def _resolve_yaml(name_or_path: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") and candidate.is_file():
        return candidate.resolve()
    stem = candidate.name.removesuffix(".yaml").removesuffix(".yml")
    shipped = CONFIG_ROOT / "accelerate_configs" / f"{stem}.yaml"
    if shipped.is_file():
        return shipped
    raise LadderError(
        f"Unknown config '{name_or_path}': it is neither a YAML file nor a shipped rung. Known rungs: "
        f"{', '.join(known_rung_names())} (or 'single' for one process). Pass one of these names, e.g. "
        f"--config fsdp_hybrid.yaml, or a path to your own Accelerate YAML."
    )


def read_accelerate_yaml(path: Path) -> dict[str, Any]:
    """An accelerate YAML as a dict; refused unless it is one."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise LadderError(f"{path} is not valid YAML ({exc}). Fix the file or pick a shipped rung.") from exc
    if not isinstance(data, dict) or "distributed_type" not in data:
        raise LadderError(f"{path} is not an Accelerate config (no distributed_type). Create one with "
                          "`accelerate config` or copy a file from accelerate_configs/.")
    return data


def ds_mixed_precision(ds: dict[str, Any]) -> str:
    """A DeepSpeed JSON's precision on GPU. accelerate refuses mixed_precision in a YAML that has a JSON, so the
    JSON decides: "auto" (filled from TrainingArguments) means hfdist's GPU default, bf16."""
    for name in ("bf16", "fp16"):
        if (ds.get(name) or {}).get("enabled") in (True, "auto"):
            return name
    return "no"


def _deepspeed_json_path(cfg: dict[str, Any], path: Path) -> Path:
    # zero3_init_flag reaches the ranks through accelerate (ACCELERATE_DEEPSPEED_ZERO3_INIT): true builds a ZeRO-3
    # model under deepspeed.zero.Init, partitioned as it is created; false builds it whole on every rank first.
    ds = cfg.get("deepspeed_config") or {}
    json_ref = ds.get("deepspeed_config_file")
    if not json_ref:
        raise LadderError(f"{path} uses DeepSpeed without deepspeed_config_file; hfdist keeps the DeepSpeed "
                          "settings in a JSON of ds_configs/. Point deepspeed_config_file at one.")
    return resolve_deepspeed_json(str(json_ref), path)


def resolve_deepspeed_json(json_ref: str, yaml_path: Path | None) -> Path:
    """Where a YAML's deepspeed_config_file is. A relative path is resolved as accelerate resolves it: from the
    working directory (accelerate's HfDeepSpeedConfig opens it as given, in every rank). The shipped YAMLs are
    written relative to the config root (= the repository root through the accelerate_configs/ and ds_configs/
    links), so theirs resolve from there wherever hfdist is installed.

    Raises:
        LadderError: the file is not there, naming where it was looked for.
    """
    json_path = Path(json_ref).expanduser()
    shipped = yaml_path is not None and yaml_path.resolve().is_relative_to(CONFIG_ROOT)
    if not json_path.is_absolute():
        json_path = (CONFIG_ROOT if shipped else Path.cwd()) / json_path
    if json_path.is_file():
        return json_path.resolve()
    beside = yaml_path.parent / json_ref if yaml_path is not None else None
    hint = (f" It does exist next to the YAML ({beside}), but accelerate resolves relative paths from the working "
            "directory: run from the YAML's folder, or make the path absolute." if beside and beside.is_file() else
            " Fix the path (relative paths count from the working directory, as accelerate reads them).")
    raise LadderError(f"{yaml_path or 'The launcher'} points at DeepSpeed config {json_ref}, which is not at "
                      f"{json_path}.{hint}")


def deepspeed_rung(name: str, json_path: Path, num_processes: int, **extra: Any) -> Rung:
    """A DeepSpeed rung from its JSON: ZeRO stage, offload devices, AutoTP degree and precision all come from it.

    Raises:
        LadderError: the JSON is invalid or its tp does not divide the processes.
    """
    try:
        ds_json = json.loads(json_path.read_text())
    except json.JSONDecodeError as exc:
        raise LadderError(f"{json_path} is not valid JSON ({exc}). Fix the file.") from exc
    zero = ds_json.get("zero_optimization", {})
    tp = int((ds_json.get("tensor_parallel") or {}).get("autotp_size", 1))
    dims = ParallelDims(dp_shard=num_processes // tp, tp=tp)
    try:
        dims.check_world(num_processes)
    except DimsError as exc:
        raise LadderError(f"{json_path}: autotp_size={tp} does not divide {num_processes} processes. {exc}") from exc
    return Rung(name=name, kind=StrategyKind.DEEPSPEED, num_processes=num_processes, dims=dims,
                mixed_precision=ds_mixed_precision(ds_json), ds_config_path=json_path.resolve(),
                zero_stage=int(zero.get("stage", 0)),
                offload_param=(zero.get("offload_param") or {}).get("device", "none"),
                offload_optimizer=(zero.get("offload_optimizer") or {}).get("device", "none"), **extra)


def _refuse_cp_outside_fsdp(cfg: dict[str, Any], path: Path) -> None:
    """Context parallelism lives on hfdist's FSDP2 mesh only: a DDP or DeepSpeed YAML asking for it is refused."""
    cp = int((cfg.get("parallelism_config") or {}).get("parallelism_config_cp_size", 1) or 1)
    dtype = str(cfg.get("distributed_type", "")).upper()
    if cp > 1 and dtype != "FSDP":
        raise LadderError(f"{path} sets parallelism_config_cp_size: {cp} with distributed_type {dtype}; hfdist's "
                          "context parallelism (Ulysses attention over sequence chunks) runs on its FSDP2 mesh. Use "
                          "distributed_type: FSDP (e.g. the fsdp_cp rung), or parallelism_config_cp_size: 1.")


def load_rung(name_or_path: str) -> Rung:
    """Parse a shipped rung name ('fsdp_hybrid', 'fsdp_hybrid.yaml') or a YAML path into a Rung.

    Raises:
        LadderError: unknown name, unreadable file, or settings hfdist cannot honour; the message names the fix.
    """
    if name_or_path in ("single", "single.yaml"):
        return single_process_rung()
    path = _resolve_yaml(name_or_path)
    cfg = read_accelerate_yaml(path)
    refuse_unimplemented(cfg, path)
    _refuse_cp_outside_fsdp(cfg, path)
    name = path.stem
    num_processes = int(cfg.get("num_processes", 1))  # accelerate counts all machines' processes
    mixed, fp8, fp8_note = read_fp8(cfg, path)
    dtype = str(cfg["distributed_type"]).upper()
    common = dict(name=name, num_processes=num_processes, yaml_path=path, info=RUNG_INFO.get(name), fp8=fp8)
    try:
        if dtype in ("MULTI_GPU", "MULTI_CPU", "NO"):
            rung = Rung(kind=StrategyKind.DDP, dims=ParallelDims(dp_replicate=num_processes), mixed_precision=mixed,
                        notes=(fp8_note,) if fp8_note else (), **common)
        elif dtype == "FSDP":
            pc = cfg.get("parallelism_config") or {}
            replicate = int(pc.get("parallelism_config_dp_replicate_size", 1))
            tp = int(pc.get("parallelism_config_tp_size", 1))
            pp = int(pc.get("parallelism_config_pp_size", 1))
            cp = int(pc.get("parallelism_config_cp_size", 1) or 1)
            ep = int(pc.get("parallelism_config_ep_size", 1) or 1)  # hfdist's key (accelerate passes it over)
            shard = int(pc.get("parallelism_config_dp_shard_size", num_processes // max(replicate * tp * pp * cp, 1)))
            fsdp = read_fsdp_config(cfg.get("fsdp_config"), path)
            if fsdp.hybrid and "parallelism_config_dp_replicate_size" not in pc:
                # FSDP1 HYBRID_SHARD: shard over one machine's processes, replicate across the machines.
                replicate = int(cfg.get("num_machines", 1) or 1)
                shard = num_processes // max(replicate * tp * pp * cp, 1)
            dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, pp=pp, tp=tp, cp=cp, ep=ep)
            dims.check_world(num_processes)
            pipeline = PipelineSettings(
                schedule=str(pc.get("parallelism_config_pp_schedule", PipelineSettings.schedule)),
                n_microbatches=int(pc.get("parallelism_config_pp_microbatches", PipelineSettings.n_microbatches)),
            ) if pp > 1 else None
            notes = tuple(n for n in (fsdp.note, fp8_note) if n)
            if fsdp.ddp and cp > 1:
                raise LadderError(f"{path} sets parallelism_config_cp_size: {cp} with NO_SHARD (DDP); hfdist's context "
                                  "parallelism runs on its FSDP2 mesh. Use a sharding strategy (FULL_SHARD), or "
                                  "parallelism_config_cp_size: 1.")
            if fsdp.ddp:
                return Rung(kind=StrategyKind.DDP, dims=ParallelDims(dp_replicate=num_processes), notes=notes,
                            mixed_precision=mixed, **common)
            settings = FsdpSettings(layer_cls_to_wrap=fsdp.layer_cls_to_wrap, offload_params=fsdp.offload_params,
                                    reshard_after_forward=fsdp.reshard_after_forward,
                                    activation_checkpointing=fsdp.activation_checkpointing,
                                    hybrid=fsdp.hybrid or replicate > 1)
            rung = Rung(kind=StrategyKind.MESH, dims=dims, fsdp=settings, pipeline=pipeline, notes=notes,
                        mixed_precision=mixed, **common)
        elif dtype == "DEEPSPEED":
            rung = deepspeed_rung(name, _deepspeed_json_path(cfg, path), num_processes, yaml_path=path,
                                  info=RUNG_INFO.get(name), fp8=fp8)
        else:
            raise LadderError(f"{path} has distributed_type {dtype}, which hfdist does not run. Use MULTI_GPU (DDP), "
                              "FSDP or DEEPSPEED.")
    except DimsError as exc:
        raise LadderError(f"{path}: num_processes={num_processes} does not match its parallelism_config. {exc}") from exc
    return rung
