"""Make `accelerate launch scripts/finetune.py --config NAME` start the world the named rung needs.

A plain `accelerate launch script.py` (or `python script.py`) starts one process. When the rung needs more, the
script hands over to `accelerate launch --config_file <rung yaml> script.py ...` with the same arguments and waits
for it; inside that world it checks that the launcher's settings are the rung's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hfdist.errors import HfdistError
from hfdist.job.ladder import (
    CONFIG_ROOT,
    RUNG_INFO,
    FsdpSettings,
    Rung,
    StrategyKind,
    deepspeed_rung,
    known_rung_names,
    load_rung,
)
from hfdist.parallel.dims import ParallelDims

__all__ = ["LaunchError", "CpuTranslation", "effective_mixed_precision", "cpu_translation", "settle_mixed_precision",
           "accelerate_command",
           "ensure_world", "rung_from_launcher_env", "HANDED_OVER_ENV"]

HANDED_OVER_ENV = "HFDIST_HANDED_OVER"
# accelerate's FSDP switches: hfdist applies FSDP2 itself (launch.py docstring, parallel/fsdp.py), so these are read
# for checking and then removed, or the Trainer's accelerator would try to wrap the model a second time on GPU.
_ACCELERATE_FSDP_ENV_PREFIXES = ("FSDP_", "PARALLELISM_CONFIG_")
_ACCELERATE_FSDP_ENV = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG")


class LaunchError(HfdistError, RuntimeError):
    """The process world does not match the rung, and hfdist cannot start the right one from here."""


@dataclass(frozen=True)
class CpuTranslation:
    """GPU-only settings of a rung replaced for a CPU run, and why."""

    mixed_precision: str
    notes: tuple[str, ...]

    def line(self, rung: Rung) -> str:
        """The one line a CPU run prints about what it changed."""
        return f"hfdist: no GPU, so {rung.name} runs on CPU with gloo: " + "; ".join(self.notes)


def effective_mixed_precision(rung: Rung, on_gpu: bool, asked: str = "auto") -> str:
    """The precision a run trains in: --mixed-precision as given ("no" or "bf16", on any device), or for "auto"
    the rung's own setting on a GPU and fp32 on a CPU."""
    if asked != "auto":
        return asked
    return rung.mixed_precision if on_gpu else "no"


def cpu_translation(rung: Rung, on_gpu: bool, asked: str = "auto") -> CpuTranslation | None:
    """What a rung's GPU-only settings become on CPU, or None on a GPU machine. bf16 asked for on CPU stays bf16
    (CPU autocast, FSDP2's policy, DeepSpeed's bf16 all run there); "auto" trains the CPU in fp32."""
    if on_gpu:
        return None
    mixed = effective_mixed_precision(rung, on_gpu, asked)
    notes = ["backend nccl -> gloo"]
    if asked == "auto" and rung.mixed_precision != mixed:
        notes.append(f"mixed_precision {rung.mixed_precision} -> fp32 (--mixed-precision bf16 keeps bf16)")
    if rung.fsdp is not None and rung.fsdp.offload_params:
        notes.append("fsdp_offload_params -> off (params already live in CPU memory)")
    return CpuTranslation(mixed_precision=mixed, notes=tuple(notes))


def settle_mixed_precision(rung: Rung, on_gpu: bool, asked: str = "auto") -> str:
    """The mixed precision this rank trains with; accelerate is told the part it applies.

    TrainingArguments reads ACCELERATE_MIXED_PRECISION (set by `accelerate launch` from the YAML), so the setting
    must reach the environment: the run's precision for DDP and DeepSpeed (accelerate's autocast, DeepSpeed's bf16
    section), "no" for hfdist's mesh rungs, whose FSDP2 policy computes in bf16 (autocast on top of it would cast
    twice and keep fp32 copies of every output).
    """
    mixed = effective_mixed_precision(rung, on_gpu, asked)
    os.environ["ACCELERATE_MIXED_PRECISION"] = "no" if rung.owns_sharding else mixed
    return mixed


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_command(rung: Rung, script: str, script_args: list[str], on_gpu: bool) -> list[str]:
    """The `accelerate launch` command line that starts `script` in the rung's world."""
    assert rung.yaml_path is not None
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(rung.yaml_path),
           "--num_processes", str(rung.num_processes), "--main_process_port", str(_free_port())]
    if rung.num_processes == 1:
        cmd += ["--num_machines", "1"]
    translation = cpu_translation(rung, on_gpu)
    if translation is not None and not rung.uses_deepspeed:  # DeepSpeed takes precision from its JSON only
        cmd += ["--mixed_precision", translation.mixed_precision]
    if rung.ds_config_path is not None:
        # Absolute, so the YAML's repository-relative path works from any working directory.
        cmd += ["--deepspeed_config_file", str(rung.ds_config_path)]
    return cmd + [script, *script_args]


def _check_launcher_env(rung: Rung) -> None:
    """Inside a launched world: the launcher's strategy switches must be the rung's."""
    use_ds = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if use_ds != rung.uses_deepspeed:
        raise LaunchError(
            f"The launcher {'enabled' if use_ds else 'did not enable'} DeepSpeed but --config {rung.name} is a "
            f"{rung.kind.value} rung. The accelerate config used to launch disagrees with --config: run "
            f"`accelerate launch scripts/finetune.py --config {rung.name}` without another --config_file (or with "
            f"--config_file {rung.yaml_path})."
        )
    for key in [k for k in os.environ if k.startswith(_ACCELERATE_FSDP_ENV_PREFIXES) or k in _ACCELERATE_FSDP_ENV]:
        del os.environ[key]


def ensure_world(rung: Rung, script: str, script_args: list[str]) -> int | None:
    """Start the rung's world if this process is not in it yet.

    Returns:
        None when this process is a rank of the right world and should train; otherwise the exit code of the
        `accelerate launch` it handed over to (the caller exits with it).

    Raises:
        LaunchError: a world of the wrong size is already running (naming the sizes and the fix).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == rung.num_processes:
        if world > 1 or os.environ.get(HANDED_OVER_ENV):
            _check_launcher_env(rung)
        return None
    if world == 1 and not os.environ.get(HANDED_OVER_ENV):
        on_gpu = torch.cuda.is_available()
        cmd = accelerate_command(rung, script, script_args, on_gpu)
        print(f"hfdist: starting {rung.num_processes} processes for {rung.name}: accelerate launch --config_file "
              f"{rung.yaml_path} ...", flush=True)
        return subprocess.call(cmd, env={**os.environ, HANDED_OVER_ENV: "1"})
    raise LaunchError(
        f"--config {rung.name} needs {rung.num_processes} processes ({rung.dims.describe()}), but this world has "
        f"{world}. Launch it as `accelerate launch scripts/finetune.py --config {rung.name}` (hfdist starts the "
        f"right number), or pass --num-processes {world} to rescale the rung to this world."
    )


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
    ref = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "")
    path = next((p for p in (Path(ref), CONFIG_ROOT / ref) if ref and p.is_file()), None)
    if path is None:
        raise LaunchError(
            f"This world was launched with DeepSpeed but its config file '{ref}' cannot be found from here. Launch "
            "from the repository root, or pass --config with the rung's YAML."
        )
    rung = deepspeed_rung(path.stem, path, world)
    twin = _shipped_twin(StrategyKind.DEEPSPEED, rung.dims, path)  # the same JSON as a shipped rung: named and checked as it
    return replace(rung, name=twin.name, yaml_path=twin.yaml_path, info=twin.info) if twin else rung


def launcher_config_file() -> Path | None:
    """The --config_file of the `accelerate launch` that started this rank, from the launcher's command line.

    accelerate starts the ranks from its own process (torch's elastic agent runs inside it), so on Linux the
    parent's /proc cmdline holds it. None when not found (another launcher, another OS).
    """
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--config_file" and i + 1 < len(argv) else None
        if arg.startswith("--config_file="):
            value = arg.split("=", 1)[1]
        if value and Path(value).is_file():
            return Path(value).resolve()
    return None


def rung_from_launcher_env() -> Rung:
    """The rung of a world started by `accelerate launch --config_file X.yaml` without --config.

    accelerate passes its config to the processes as environment variables only; they are read back here (the
    shipped rung they match when there is one, so the run is named and checked like it). Pipeline settings have no
    environment variable, so a pipeline YAML is found through the launcher's command line; when that is not
    possible a pipeline config cannot be told from its FSDP (x TP) twin, and --config must name it.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mixed = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if world == 1:
        return load_rung("single")
    yaml_path = launcher_config_file()
    if yaml_path is not None:
        rung = load_rung(str(yaml_path))
        if rung.dims.pp > 1:
            return replace(rung.with_num_processes(world), mixed_precision=mixed)
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
        )
        twin = _shipped_twin(StrategyKind.MESH, dims)
        name = twin.name if twin is not None else "fsdp"
        return Rung(name=name, kind=StrategyKind.MESH, num_processes=world, dims=dims, mixed_precision=mixed, fsdp=settings,
                    yaml_path=twin.yaml_path if twin else None, info=RUNG_INFO.get(name))
    return replace(load_rung("ddp").with_num_processes(world), mixed_precision=mixed)
