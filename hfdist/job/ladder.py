"""The config ladder: each rung of the decision table as a matched Accelerate YAML (+ DeepSpeed JSON).

The YAML files in accelerate_configs/ are the source of truth for a rung's launch settings (process count,
distributed type, FSDP options, parallelism sizes); this module parses them into a typed `Rung` and adds what a
user needs to choose one (scenario, what is sharded, when to pick it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from hfdist.errors import HfdistError
from hfdist.parallel.dims import DimsError, ParallelDims

__all__ = [
    "StrategyKind",
    "Rung",
    "FsdpSettings",
    "PipelineSettings",
    "LadderError",
    "CONFIG_ROOT",
    "RUNG_INFO",
    "known_rung_names",
    "load_rung",
    "single_process_rung",
    "ds_mixed_precision",
    "deepspeed_rung",
]

# accelerate_configs/ and ds_configs/ live beside the package in the repository (editable install).
CONFIG_ROOT = Path(os.environ.get("HFDIST_CONFIG_ROOT", Path(__file__).resolve().parents[2]))


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
class RungInfo:
    """What a user reads in the ladder table."""

    table_row: int
    scenario: str
    sharded: str
    when: str


# Decision-table order (the README's ladder table): rows 1 DDP, 2 FSDP FULL_SHARD / ZeRO-2, 3 HYBRID / ZeRO-3,
# 4 PP or TP (pipeline stages first, then tensor parallelism), 5 3D, 6 ZeRO-3 + offload. ZeRO-1 sits between rows
# 1 and 2.
RUNG_INFO: dict[str, RungInfo] = {
    "ddp": RungInfo(1, "LoRA fine-tune <= 7B; the model fits on one device", "nothing (full replica per rank)",
                    "the model, grads and Adam state fit one device; fastest"),
    "zero1": RungInfo(1, "model + grads fit one device, Adam state does not", "optimizer state",
                      "a small step past DDP: frees 12 of 16 bytes/param of Adam state"),
    "fsdp_full_shard": RungInfo(2, "full fine-tune 7B-13B on one node", "params + grads + optimizer state",
                                "the model states do not fit one device; one node"),
    "zero2": RungInfo(2, "full fine-tune 7B-13B on one node", "grads + optimizer state",
                      "weights fit one device but grads + Adam state do not"),
    "fsdp_hybrid": RungInfo(3, "full fine-tune 30B-70B on several nodes", "params + grads + optimizer state "
                            "inside a node; replicated across nodes", "multi-node, slow inter-node fabric"),
    "zero3": RungInfo(3, "full fine-tune 30B-70B", "params + grads + optimizer state",
                      "like FSDP FULL_SHARD, when you want DeepSpeed's offload/ecosystem"),
    "pp": RungInfo(4, "beyond ~30B: the model's depth spread over GPUs or nodes",
                   "decoder layers over pp ranks (pipeline stages, 1F1B schedule)",
                   "stages fit one device each; only point-to-point activations cross links, so pp spans nodes"),
    "fsdp_tp": RungInfo(4, "pretrain / full fine-tune 70B on 64-128 GPUs", "params + grads + optimizer state "
                        "over dp (FSDP2) and every matrix over tp (Megatron TP, sequence parallel)",
                        "sharding alone is not enough or its all-gathers dominate; tp inside a node"),
    "zero2_tp": RungInfo(4, "pretrain / full fine-tune 70B on 64-128 GPUs, with DeepSpeed", "every Linear over tp "
                         "(DeepSpeed AutoTP) x grads + optimizer state over dp (ZeRO-2)",
                         "the DeepSpeed stack and TP; ZeRO-3 does not compose with AutoTP in DeepSpeed 0.19"),
    "3d": RungInfo(5, "pretraining / frontier scale (100B+), hundreds of GPUs", "params + grads + optimizer "
                   "state over dp (FSDP2) x layers over pp (pipeline stages) x every matrix over tp",
                   "the model needs tp inside a node and pp across nodes to fit; dp for the rest"),
    "zero3_offload_cpu": RungInfo(6, "single-node fine-tune, model exceeds the GPUs' memory",
                                  "params + grads + optimizer state, offloaded to CPU RAM",
                                  "not enough GPU memory at any sharding; slow but feasible"),
    "zero3_offload_nvme": RungInfo(6, "single node, model exceeds GPU and CPU memory",
                                   "params + optimizer state offloaded to NVMe", "last resort: even CPU RAM is short"),
}


@dataclass(frozen=True)
class FsdpSettings:
    """The FSDP2 options hfdist honours from a YAML's fsdp_config."""

    layer_cls_to_wrap: str | None = None  # None: the model's decoder layer (hfdist.parallel.fsdp.fsdp_unit_class)
    reshard_after_forward: bool = True
    offload_params: bool = False
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class PipelineSettings:
    """hfdist's pipeline options, read from a YAML's parallelism_config (accelerate has no PP for HF models and
    passes these keys over untouched): parallelism_config_pp_size / _pp_schedule / _pp_microbatches."""

    schedule: str = "1F1B"
    n_microbatches: int = 4


@dataclass(frozen=True)
class Rung:
    """One launchable strategy: where its configs are and what it does to the model."""

    name: str
    kind: StrategyKind
    num_processes: int
    dims: ParallelDims
    mixed_precision: str = "no"
    yaml_path: Path | None = None
    ds_config_path: Path | None = None
    zero_stage: int = 0
    offload_param: str = "none"
    offload_optimizer: str = "none"
    fsdp: FsdpSettings | None = None
    pipeline: PipelineSettings | None = None
    info: RungInfo | None = None

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
        """hfdist applies FSDP2: every mesh rung, except a pipeline with one data-parallel rank."""
        return self.owns_sharding and not (self.uses_pipeline and self.dims.dp == 1)

    def with_num_processes(self, num_processes: int) -> "Rung":
        """The same rung on another process count: the data-parallel axis absorbs the change."""
        if num_processes == self.num_processes:
            return self
        d = self.dims
        if self.kind is StrategyKind.DDP:
            dims = replace(d, dp_replicate=num_processes)
        elif self.owns_sharding and d.dp_replicate > 1:
            if num_processes % d.dp_shard:
                raise LadderError(
                    f"--num-processes {num_processes} is not a multiple of {self.name}'s dp_shard={d.dp_shard} "
                    f"(processes per node). Use a multiple of {d.dp_shard}, or edit parallelism_config in "
                    f"{self.yaml_path}."
                )
            dims = replace(d, dp_replicate=num_processes // d.dp_shard)
        elif self.owns_sharding or self.uses_deepspeed:
            model_parallel = d.tp * d.pp
            if num_processes % model_parallel:
                raise LadderError(f"--num-processes {num_processes} is not a multiple of {self.name}'s tp x pp = "
                                  f"{model_parallel}. Use a multiple of {model_parallel}.")
            dims = replace(d, dp_shard=num_processes // model_parallel)
        else:
            raise LadderError(f"The {self.name} rung runs one process; --num-processes does not apply to it.")
        return replace(self, num_processes=num_processes, dims=dims)


def known_rung_names() -> list[str]:
    """Names of the shipped rungs, in decision-table order."""
    shipped = {p.stem for p in (CONFIG_ROOT / "accelerate_configs").glob("*.yaml")}
    ordered = [n for n in RUNG_INFO if n in shipped]
    return ordered + sorted(shipped - set(ordered))


def single_process_rung() -> Rung:
    """No distribution at all: the reference every strategy is compared against."""
    return Rung(name="single", kind=StrategyKind.SINGLE, num_processes=1, dims=ParallelDims(), mixed_precision="bf16")


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


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise LadderError(f"{path} is not valid YAML ({exc}). Fix the file or pick a shipped rung.") from exc
    if not isinstance(data, dict) or "distributed_type" not in data:
        raise LadderError(f"{path} is not an Accelerate config (no distributed_type). Create one with "
                          "`accelerate config` or copy a file from accelerate_configs/.")
    return data


def _fsdp_settings(cfg: dict[str, Any], path: Path) -> FsdpSettings:
    fsdp = cfg.get("fsdp_config") or {}
    version = int(fsdp.get("fsdp_version", 1))
    if version != 2:
        raise LadderError(f"{path} asks for FSDP version {version}; hfdist applies FSDP2 (fully_shard) only. "
                          "Set fsdp_config.fsdp_version: 2.")
    return FsdpSettings(
        layer_cls_to_wrap=fsdp.get("fsdp_transformer_layer_cls_to_wrap") or None,
        reshard_after_forward=bool(fsdp.get("fsdp_reshard_after_forward", True)),
        offload_params=bool(fsdp.get("fsdp_offload_params", False)),
        activation_checkpointing=bool(fsdp.get("fsdp_activation_checkpointing", False)),
    )


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
    json_path = Path(json_ref)
    if not json_path.is_absolute():
        # Relative to the repository (how the shipped YAMLs are written), else to the YAML's folder.
        json_path = next((p for p in (CONFIG_ROOT / json_ref, path.parent / json_ref) if p.is_file()), json_path)
    if not json_path.is_file():
        raise LadderError(f"{path} points at DeepSpeed config {json_ref}, which does not exist. Fix the path.")
    return json_path


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


def load_rung(name_or_path: str) -> Rung:
    """Parse a shipped rung name ('fsdp_hybrid', 'fsdp_hybrid.yaml') or a YAML path into a Rung.

    Raises:
        LadderError: unknown name, unreadable file, or settings hfdist cannot honour; the message names the fix.
    """
    if name_or_path in ("single", "single.yaml"):
        return single_process_rung()
    path = _resolve_yaml(name_or_path)
    cfg = _read_yaml(path)
    name = path.stem
    num_processes = int(cfg.get("num_processes", 1))  # accelerate counts all machines' processes
    mixed = str(cfg.get("mixed_precision", "no"))
    dtype = str(cfg["distributed_type"]).upper()
    common = dict(name=name, num_processes=num_processes, yaml_path=path, info=RUNG_INFO.get(name))
    try:
        if dtype in ("MULTI_GPU", "MULTI_CPU", "NO"):
            rung = Rung(kind=StrategyKind.DDP, dims=ParallelDims(dp_replicate=num_processes), mixed_precision=mixed, **common)
        elif dtype == "FSDP":
            pc = cfg.get("parallelism_config") or {}
            replicate = int(pc.get("parallelism_config_dp_replicate_size", 1))
            tp = int(pc.get("parallelism_config_tp_size", 1))
            pp = int(pc.get("parallelism_config_pp_size", 1))
            shard = int(pc.get("parallelism_config_dp_shard_size", num_processes // max(replicate * tp * pp, 1)))
            dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, pp=pp, tp=tp)
            dims.check_world(num_processes)
            pipeline = PipelineSettings(
                schedule=str(pc.get("parallelism_config_pp_schedule", PipelineSettings.schedule)),
                n_microbatches=int(pc.get("parallelism_config_pp_microbatches", PipelineSettings.n_microbatches)),
            ) if pp > 1 else None
            rung = Rung(kind=StrategyKind.MESH, dims=dims, fsdp=_fsdp_settings(cfg, path), pipeline=pipeline,
                        mixed_precision=mixed, **common)
        elif dtype == "DEEPSPEED":
            rung = deepspeed_rung(name, _deepspeed_json_path(cfg, path), num_processes, yaml_path=path,
                                  info=RUNG_INFO.get(name))
        else:
            raise LadderError(f"{path} has distributed_type {dtype}, which hfdist does not run. Use MULTI_GPU (DDP), "
                              "FSDP or DEEPSPEED.")
    except DimsError as exc:
        raise LadderError(f"{path}: num_processes={num_processes} does not match its parallelism_config. {exc}") from exc
    return rung
