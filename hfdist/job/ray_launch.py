"""`hfdist finetune --launcher ray`: Ray Train starts the ranks.

The process that runs the command is Ray's driver. Once the job's checks pass (preflight), it connects to the Ray
cluster RAY_ADDRESS names (host:port of its head; without it, Ray starts a local cluster) and hands Ray Train's
TorchTrainer one worker per rank of the rung: one per GPU of the cluster, or the rung's process count on CPU
(--num-processes sets either). Ray initialises torch.distributed in every worker (gloo on CPU, NCCL on GPUs) and sets
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and MASTER_ADDR / MASTER_PORT; each worker then runs the job as a rank
of a world a launcher started (hfdist.job.run.finetune), and everything it builds adopts Ray's process group:
accelerate and the Trainer find it initialised, the rung's mesh and groups are made on it.

Checkpoints stay hfdist's: DCP folders (DeepSpeed's own on ZeRO rungs) in --output-dir, which every node must share;
Ray's run records go to OUTPUT_DIR/ray. With --max-failures N a lost worker (a process killed, a node gone) makes Ray
Train stop the group and start a new one, up to N times; the new group resumes from the latest complete checkpoint this
launch wrote (or, with --resume, any in --output-dir). The driver exits as the ranks did: 0, PREEMPTED_EXIT_CODE when
they stopped for a preemption, 1 with the first worker's error when Ray gave up.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hfdist import console
from hfdist.config.finetune import FinetuneConfig
from hfdist.config.ladder import Rung
from hfdist.config.preemption import PREEMPTED_EXIT_CODE
from hfdist.errors import HfdistError

__all__ = ["RayLaunchError", "ray_launch", "worker_env"]

# What the workers' environment takes from the driver's (Ray starts workers with the raylet's environment, not the
# driver's): hfdist's own settings and test hooks, the libraries' offline / logging switches.
_FORWARDED_PREFIXES = ("HFDIST_", "WANDB_", "HF_", "TRANSFORMERS_", "MLFLOW_", "TOKENIZERS_")


class RayLaunchError(HfdistError, RuntimeError):
    """Ray Train cannot start the run: Ray is not installed, or its cluster cannot be reached."""


def _import_ray():
    """Ray and its Train package, or the refusal naming how to install them."""
    try:
        import ray
        import ray.train.torch  # noqa: F401 (TorchTrainer)
    except ImportError as exc:
        raise RayLaunchError(
            f"--launcher ray needs Ray Train, which this environment lacks ({exc}). Install it with "
            "`pip install 'hfdist[ray]'` (ray[train] 2.60 or newer) on the driver and on every node of the cluster, "
            "or drop --launcher ray: hfdist then starts the processes itself (or joins the world torchrun / Slurm "
            "started).") from exc
    return ray


def _check_reachable(address: str) -> None:
    """Refuse, before Ray retries for minutes, a cluster address whose head does not answer (a TCP connect)."""
    if address == "auto":
        return  # Ray looks for a cluster started on this machine, and raises at once when there is none
    parts = urlsplit(address if "://" in address else f"ray://{address}")
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), timeout=10):
            return
    except OSError as exc:
        raise RayLaunchError(_unreachable(address, f"{type(exc).__name__}: {exc}")) from exc


def _unreachable(address: str, why: str) -> str:
    return (f"--launcher ray cannot reach the Ray cluster at RAY_ADDRESS={address} ({why}). Start it (`ray start "
            "--head` on its head node; KubeRay starts it for a RayJob), point RAY_ADDRESS at its head (host:6379 from a "
            "node of the cluster, ray://host:10001 from outside), or unset RAY_ADDRESS to run on a local cluster that "
            "hfdist starts on this machine.")


def _connect(ray, address: str | None, workers: int, env: dict[str, str]) -> None:
    """Join the cluster at `address`, or start a local one with a CPU per worker at least (CPU ranks are processes like
    any other: a 2-core machine runs 4 of them, as the hand-over does). `env`: every worker's environment (Ray starts
    workers with the raylet's environment, not the driver's)."""
    runtime_env = {"env_vars": env}
    if address is None:
        ray.init(num_cpus=max(os.cpu_count() or 1, workers), runtime_env=runtime_env)
        return
    _check_reachable(address)
    try:
        ray.init(address=address, runtime_env=runtime_env)
    except ConnectionError as exc:
        raise RayLaunchError(_unreachable(address, str(exc).splitlines()[0])) from exc


def _source_path() -> str | None:
    """The folder holding this hfdist when it is a source checkout (not installed into site-packages): workers on this
    machine import it from there."""
    root = Path(__file__).resolve().parents[2]
    return None if "site-packages" in root.parts else str(root)


def worker_env(output_dir: str, verbose: bool) -> dict[str, str]:
    """The environment of every Ray worker: the driver's hfdist and library settings, what hfdist's hand-over gives a
    rank (the checks done, the logs' folder), and this checkout on PYTHONPATH when hfdist is not installed."""
    from hfdist.job.launch import HANDED_OVER_ENV

    env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_PREFIXES)}
    env.update({HANDED_OVER_ENV: "1", **console.launch_env(output_dir, verbose)})
    source = _source_path()
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
    return env


def _written_since(output_dir: str, started: float) -> bool:
    """Whether --output-dir holds a complete checkpoint written after `started` (by an earlier group of this launch)."""
    from hfdist.checkpoint.format import MARKER, latest_checkpoint

    latest = latest_checkpoint(Path(output_dir))
    return latest is not None and (latest / MARKER).stat().st_mtime >= started


def _worker(config: dict[str, Any]) -> None:
    """One rank, in a Ray Train worker (a thread of its actor): the job, as a rank of the world Ray made."""
    if config["deepspeed"]:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # as accelerate's launch sets it for a ZeRO rung
    from hfdist.config.finetune import MODULE_ENTRY
    from hfdist.job.run import finetune

    cfg: FinetuneConfig = config["cfg"]
    if not cfg.resume and _written_since(cfg.output_dir, config["started"]):
        cfg = replace(cfg, resume=True)  # a group Ray restarted: continue what the lost one saved
    try:
        code = finetune(cfg, MODULE_ENTRY, [])
    finally:
        console.finish()
        console.stop()
    if code not in (0, PREEMPTED_EXIT_CODE):
        raise RuntimeError(f"rank {os.environ.get('RANK')} of {cfg.config} ended with exit code {code}")


def _first_failure(exc: BaseException) -> str:
    """The first worker's error inside Ray Train's TrainingFailedError, as one line."""
    failures = getattr(exc, "worker_failures", None) or {}
    cause = failures[min(failures)] if failures else getattr(exc, "controller_failure", exc)
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else 'no message'}"


def _resolve(cfg: FinetuneConfig, gpus: int) -> Rung:
    """The rung on a cluster of `gpus` GPUs (0: CPU ranks), checked as the hand-over checks it (preflight)."""
    from hfdist.config.dims import batch_layout
    from hfdist.job.preflight import preflight
    from hfdist.job.world import Node, resolve_rung

    rung = resolve_rung(cfg, Node(gpus=gpus))
    preflight(cfg, rung, batch_layout(cfg.global_batch_size, cfg.micro_batch_size, rung.dims.dp)[0])
    return rung


def ray_launch(cfg: FinetuneConfig) -> int:
    """Run the job on Ray Train (module docstring). Without RAY_ADDRESS the job is checked before a local cluster
    starts (its GPUs are this machine's); with it, once the cluster answers (its GPUs decide the process count).

    Returns:
        The exit code: 0, PREEMPTED_EXIT_CODE, or 1 when Ray Train gave up (its first worker error printed).

    Raises:
        RayLaunchError: Ray is missing, or RAY_ADDRESS does not answer. Bad input: as the hand-over's preflight.
    """
    ray = _import_ray()
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from hfdist.job.world import Node

    address = os.environ.get("RAY_ADDRESS")
    env = worker_env(cfg.output_dir, cfg.verbose)
    # Ray's own messages (its start-up, its controller's) go to OUTPUT_DIR/logs/ray.log; the workers' hfdist lines it
    # forwards reach the screen (hfdist.console). Ray Train's print patch would log every worker line a second time.
    console.start(console.log_path(cfg.output_dir, "ray"), cfg.verbose)
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    if address is None:
        gpus = Node.detect().gpus
        rung = _resolve(cfg, gpus)
        _connect(ray, None, rung.num_processes, env)
    else:
        _connect(ray, address, 0, env)
        gpus = int(ray.cluster_resources().get("GPU", 0))
        rung = _resolve(cfg, gpus)
    started = time.time()
    output = Path(cfg.output_dir).resolve()
    workers = replace(cfg, num_processes=rung.num_processes, output_dir=str(output))
    print(f"hfdist: Ray Train starts {rung.num_processes} worker{'s' if rung.num_processes > 1 else ''} for "
          f"{rung.name} ({rung.dims.layout()}, {'a GPU each' if gpus else 'on CPU'}); restarts after a lost worker: "
          f"{cfg.max_failures}", flush=True)
    trainer = TorchTrainer(
        _worker, train_loop_config={"cfg": workers, "deepspeed": rung.uses_deepspeed, "started": started},
        torch_config=TorchConfig(timeout_s=int(cfg.collective_timeout)),
        scaling_config=ScalingConfig(num_workers=rung.num_processes, use_gpu=gpus > 0),
        run_config=RunConfig(name=f"hfdist-{rung.name}-{int(started)}", storage_path=str(output / "ray"),
                             failure_config=FailureConfig(max_failures=cfg.max_failures)))
    try:
        trainer.fit()
    except Exception as exc:  # noqa: BLE001 (Ray Train's TrainingFailedError and its subclasses)
        print(f"hfdist: {rung.name} failed under Ray Train after {cfg.max_failures} restart(s): {_first_failure(exc)}. "
              f"The workers' output is above; library messages are in {console.log_dir(output)}.", file=sys.stderr,
              flush=True)
        return 1
    finally:
        ray.shutdown()
    return PREEMPTED_EXIT_CODE if _preempted_since(output, started) else 0


def _preempted_since(output: Path, started: float) -> bool:
    """Whether the summary this launch's rank 0 wrote records a preemption."""
    import json

    from hfdist.job.summary import SUMMARY_NAME

    summary = output / SUMMARY_NAME
    return (summary.is_file() and summary.stat().st_mtime >= started
            and json.loads(summary.read_text()).get("preempted") is not None)
