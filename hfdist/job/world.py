"""The run's world: which rung, on how many processes, over which devices.

Process count, in precedence order (CLI > YAML > default):
    --num-processes N
    the world a launcher already started (torchrun, `accelerate launch --config_file`, Slurm)
    on a GPU machine: the GPUs of this node (one process per GPU)
    on CPU: the YAML's num_processes (what each shipped rung is tested with)
--tp / --pp / --cp / --dp-replicate / --ep override the YAML's degrees (--cp-method: how cp splits attention); the
data-parallel axis absorbs the rest, and a hybrid (HSDP) rung shards over the processes of one node. More processes on a node than it has GPUs is refused before any
process starts (a rank past the last GPU would die in set_device).

A world started by `accelerate launch --config_file X.yaml` without --config is read back from the launcher: its
YAML when the launcher's command line shows it, else accelerate's environment variables.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

from hfdist.config.dims import ParallelDims
from hfdist.config.finetune import FinetuneConfig
from hfdist.config.ladder import (
    RUNG_INFO,
    FsdpSettings,
    LadderError,
    Rung,
    StrategyKind,
    deepspeed_rung,
    known_rung_names,
    load_rung,
    resolve_deepspeed_json,
)

__all__ = ["Node", "WorldError", "resolve_rung", "rung_from_launcher_env", "launcher_argv", "launcher_config_file"]


class WorldError(LadderError):
    """A process count this machine cannot give the rung (more processes than GPUs, a count that does not fit)."""


@dataclass(frozen=True)
class Node:
    """What this machine and its launcher give the run.

    Attributes:
        gpus: CUDA devices visible to this process (0 on CPU).
        world: WORLD_SIZE of a world a launcher started (None before hfdist hands over).
        local_world: processes per node in that world (LOCAL_WORLD_SIZE).
    """

    gpus: int = 0
    world: int | None = None
    local_world: int | None = None

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> "Node":
        """This process's node: GPUs from torch, the world from the launcher's environment variables."""
        import torch

        env = os.environ if env is None else env
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if "WORLD_SIZE" not in env or "RANK" not in env:
            return cls(gpus=gpus)
        world = int(env["WORLD_SIZE"])
        return cls(gpus=gpus, world=world, local_world=int(env.get("LOCAL_WORLD_SIZE", world)))

    @property
    def launched(self) -> bool:
        """A launcher started this process as a rank of a world (it must not start another)."""
        return self.world is not None


def _process_count(cfg: FinetuneConfig, rung: Rung, node: Node) -> tuple[int, str]:
    """How many processes the run gets, and where that number comes from (for error messages)."""
    if cfg.num_processes:
        return cfg.num_processes, f"--num-processes {cfg.num_processes}"
    if rung.kind is StrategyKind.SINGLE:
        return 1, "the single rung"
    if node.launched and (not cfg.config or not node.gpus):
        # A world another launcher started: its size (CPU), or the rung read back from it.
        return (node.world if not cfg.config else rung.num_processes), "the launched world"
    if node.gpus:
        nodes = node.world // node.local_world if node.launched else 1
        return nodes * node.gpus, f"{node.gpus} GPUs per node x {nodes} node(s)"
    return rung.num_processes, f"num_processes in {rung.yaml_path.name if rung.yaml_path else rung.name}"


def _check_gpus(rung: Rung, node: Node) -> None:
    """One process per GPU: a node asked to run more processes than it has GPUs is refused."""
    if not node.gpus or rung.kind is StrategyKind.SINGLE:
        return
    per_node = node.local_world if node.launched else rung.num_processes
    if per_node <= node.gpus:
        return
    if node.launched:
        raise WorldError(f"This node runs {per_node} processes of the launched world but has {node.gpus} GPUs, so "
                         f"ranks past GPU {node.gpus - 1} have no device. Launch at most {node.gpus} processes per "
                         f"node (torchrun --nproc-per-node {node.gpus}).")
    raise WorldError(
        f"{rung.name} would start {per_node} processes ({rung.dims.describe()}) on this node, which has "
        f"{node.gpus} GPUs: each process needs its own. Pass --num-processes {node.gpus} (the default here) or "
        "fewer, lower --tp / --pp, or run on several nodes with one launcher per node (docs/multi-node.md).")


def resolve_rung(cfg: FinetuneConfig, node: Node | None = None) -> Rung:
    """The rung this run trains with, fitted to its process count and degrees (module docstring).

    Raises:
        LadderError: an unknown config or settings hfdist cannot honour; WorldError: a process count or degrees
        that do not fit the rung or the node. Each names the fix.
    """
    node = Node.detect() if node is None else node
    rung = load_rung(cfg.config) if cfg.config else rung_from_launcher_env(node)
    count, origin = _process_count(cfg, rung, node)
    # Hybrid rungs shard over one node: the launched world's processes per node, else (hfdist starts every process
    # on this node) all of them on a GPU machine; on CPU the YAML's shard group stands in for a node.
    node_size = node.local_world if node.launched and node.gpus else (count if node.gpus else None)
    try:
        rung = rung.with_num_processes(count, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, dp_replicate=cfg.dp_replicate,
                                       node_size=node_size, ep=cfg.ep)
    except LadderError as exc:
        raise WorldError(f"{exc} (The process count {count} comes from {origin}.)") from exc
    _check_gpus(rung, node)
    return rung.with_pipeline(cfg.pp_schedule, cfg.pp_microbatches).with_context(cfg.cp_method)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def _shipped_twin(kind: StrategyKind, dims: ParallelDims, ds_config: Path | None = None) -> Rung | None:
    """The shipped rung a launcher environment describes, rescaled to its world, if there is one."""
    for name in known_rung_names():
        rung = load_rung(name)
        if rung.kind is not kind:
            continue
        if kind is StrategyKind.DEEPSPEED:
            if json.loads(rung.ds_config_path.read_text()) == json.loads(ds_config.read_text()):
                return rung.with_num_processes(dims.world_size)
        elif (rung.dims.dp_replicate > 1) == (dims.dp_replicate > 1) and rung.dims.tp == dims.tp:
            try:
                twin = rung.with_num_processes(dims.world_size)
            except ValueError:
                continue
            if twin.dims == dims:
                return twin
    return None


def _deepspeed_rung_from_env(world: int) -> Rung:
    path = resolve_deepspeed_json(os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", ""), None)
    rung = deepspeed_rung(path.stem, path, world)
    twin = _shipped_twin(StrategyKind.DEEPSPEED, rung.dims, path)  # the same JSON as a shipped rung: named and checked as it
    return replace(rung, name=twin.name, yaml_path=twin.yaml_path, info=twin.info) if twin else rung


def launcher_argv() -> list[str]:
    """The command line of the process that started this one (torchrun, or `accelerate launch`: torch's elastic
    agent runs inside it and starts the ranks), from /proc on Linux; [] where it cannot be read."""
    try:
        return Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def launcher_config_file() -> Path | None:
    """The --config_file of the `accelerate launch` that started this rank, from the launcher's command line
    (launcher_argv). None when not found (another launcher, another OS).
    """
    argv = launcher_argv()
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--config_file" and i + 1 < len(argv) else None
        if arg.startswith("--config_file="):
            value = arg.split("=", 1)[1]
        if value and Path(value).is_file():
            return Path(value).resolve()
    return None


def rung_from_launcher_env(node: Node) -> Rung:
    """The rung of a world started by `accelerate launch --config_file X.yaml` without --config.

    The launcher's YAML when its command line shows it (parsed like --config X.yaml, so other projects' keys are
    translated or refused the same way); else accelerate's environment variables, matched to the shipped rung they
    describe when there is one (so the run is named and checked like it). Pipeline settings have no environment
    variable: without the YAML a pipeline config cannot be told from its FSDP (x TP) twin, and --config must name it.
    """
    world = node.world or 1
    mixed = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if world == 1 and not node.launched:
        return load_rung("single")
    yaml_path = launcher_config_file()
    if yaml_path is not None:
        rung = load_rung(str(yaml_path))
        # accelerate's --mixed_precision overrides the YAML's; a DeepSpeed rung takes its precision from the JSON
        return rung if rung.uses_deepspeed else replace(rung, mixed_precision=mixed)
    if _env_flag("ACCELERATE_USE_DEEPSPEED"):
        return _deepspeed_rung_from_env(world)
    if _env_flag("ACCELERATE_USE_FSDP"):
        replicate = int(os.environ.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1"))
        tp = int(os.environ.get("PARALLELISM_CONFIG_TP_SIZE", "1"))
        dims = ParallelDims(dp_replicate=replicate, dp_shard=world // (replicate * tp), tp=tp)
        dims.check_world(world)
        settings = FsdpSettings(
            layer_cls_to_wrap=os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP") or None,
            reshard_after_forward=_env_flag("FSDP_RESHARD_AFTER_FORWARD") or "FSDP_RESHARD_AFTER_FORWARD" not in os.environ,
            offload_params=_env_flag("FSDP_OFFLOAD_PARAMS"),
            activation_checkpointing=_env_flag("FSDP_ACTIVATION_CHECKPOINTING"),
            hybrid=replicate > 1,
        )
        twin = _shipped_twin(StrategyKind.MESH, dims)
        name = twin.name if twin is not None else "fsdp"
        return Rung(name=name, kind=StrategyKind.MESH, num_processes=world, dims=dims, mixed_precision=mixed, fsdp=settings,
                    yaml_path=twin.yaml_path if twin else None, info=RUNG_INFO.get(name))
    return replace(load_rung("ddp").with_num_processes(world), mixed_precision=mixed)
