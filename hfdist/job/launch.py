"""Make `hfdist finetune --config NAME` (or `accelerate launch scripts/finetune.py --config NAME`) start the world
the named rung needs.

A plain `accelerate launch script.py` (or `python script.py`, or `hfdist finetune`) starts one process. Every rung
but `single` trains in a launched world (a process group, even of one process), so that process hands over to
`accelerate launch --config_file <rung yaml> ...` with the same arguments and waits for it; inside that world each
rank checks that the launcher's settings are the rung's. `single` on a machine with several GPUs restarts itself
with one GPU visible (transformers would otherwise spread it over all of them with nn.DataParallel).

The hand-over runs accelerate's launcher in its own process (hfdist.job.quiet_launch), so a failed run ends with
hfdist's paragraph, not with the launch stack's tracebacks: ranks leave their error paragraphs in a folder the
hand-over reads when the launch fails, and the hand-over prints each distinct paragraph once, last.

Preemption (hfdist.train.preemption): the process that hands over is the one Kubernetes signals (a container's first
process only); it relays the first preemption signal to the processes it started (the ranks, or the single rung's
restart on one GPU) and ignores the rest (hfdist.job.signal_relay), while torch elastic's agent, running in it, waits
for the ranks as long as they checkpoint (hfdist.config.preemption.elastic_env). A run whose ranks stopped for a
preemption exits PREEMPTED_EXIT_CODE, whichever process got the signal and however many times.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Sequence

from hfdist import console
from hfdist.config.finetune import FinetuneConfig
from hfdist.config.ladder import Rung, StrategyKind
from hfdist.config.precision import cpu_translation
from hfdist.config.preemption import PREEMPTED_EXIT_CODE, elastic_env, preempt_signals, preempted_note
from hfdist.errors import DIVERGED_EXIT_CODE, ERROR_DIR_ENV, HfdistError, collected_errors
from hfdist.job.signal_relay import SignalRelay
from hfdist.job.world import Node

__all__ = ["LaunchError", "accelerate_arguments", "single_gpu_env", "ensure_world", "HANDED_OVER_ENV"]

HANDED_OVER_ENV = "HFDIST_HANDED_OVER"
# accelerate's FSDP switches: hfdist applies FSDP2 itself (launch.py docstring, parallel/fsdp.py), so these are read
# for checking and then removed, or the Trainer's accelerator would try to wrap the model a second time on GPU.
# The same for its FP8 settings (a YAML's `mixed_precision: fp8`): hfdist converts the model itself.
_ACCELERATE_FSDP_ENV_PREFIXES = ("FSDP_", "PARALLELISM_CONFIG_", "ACCELERATE_FP8_")
_ACCELERATE_FSDP_ENV = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG")


class LaunchError(HfdistError, RuntimeError):
    """The process world does not match the rung, and hfdist cannot start the right one from here."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_arguments(rung: Rung, entry: Sequence[str], script_args: list[str], on_gpu: bool) -> list[str]:
    """The arguments of the `accelerate launch --config_file <rung yaml> ...` that starts `entry` (a script path, or
    ["-m", module, ...]) in the rung's world."""
    assert rung.yaml_path is not None
    # One machine: hfdist starts every process on this node (several nodes: one launcher each, docs/multi-node.md).
    cmd = ["--config_file", str(rung.yaml_path), "--num_processes", str(rung.num_processes), "--num_machines", "1",
           "--main_process_port", str(_free_port())]
    translation = cpu_translation(rung, on_gpu)
    # DeepSpeed takes precision from its JSON only. A YAML's fp8 is hfdist's to apply (hfdist.parallel.float8):
    # accelerate is told the precision of the rest, or it would convert the model with its own FP8 recipe.
    if not rung.uses_deepspeed and (translation is not None or rung.fp8 is not None):
        cmd += ["--mixed_precision", translation.mixed_precision if translation else rung.mixed_precision]
    if rung.ds_config_path is not None:
        # Absolute, so the YAML's relative path works from any working directory.
        cmd += ["--deepspeed_config_file", str(rung.ds_config_path)]
    return cmd + [*entry, *script_args]


def _check_launcher_env(rung: Rung) -> None:
    """Inside a launched world: the launcher's strategy switches must be the rung's."""
    use_ds = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if use_ds != rung.uses_deepspeed:
        raise LaunchError(
            f"The launcher {'enabled' if use_ds else 'did not enable'} DeepSpeed but --config {rung.name} is a "
            f"{rung.kind.value} rung. The accelerate config used to launch disagrees with --config: run "
            f"`hfdist finetune --config {rung.name}` (or `accelerate launch scripts/finetune.py --config "
            f"{rung.name}`) without another --config_file (or with --config_file {rung.yaml_path})."
        )
    for key in [k for k in os.environ if k.startswith(_ACCELERATE_FSDP_ENV_PREFIXES) or k in _ACCELERATE_FSDP_ENV]:
        del os.environ[key]


def single_gpu_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with only the first visible GPU left visible (CUDA_VISIBLE_DEVICES keeps its own numbering)."""
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "0").split(",") if d.strip()]
    return {**env, "CUDA_VISIBLE_DEVICES": visible[0] if visible else "0"}


# How a hand-over starts its launch: given the launch's environment, run it to its end and return its exit code and
# {rank: exit code} of the ranks that failed (when it knows them).
Start = Callable[[Mapping[str, str]], tuple[int, dict[int, int]]]


def _in_a_process(cmd: list[str]) -> Start:
    """Start `cmd` as a child process (the hand-over relays preemption signals to it)."""
    def start(env: Mapping[str, str]) -> tuple[int, dict[int, int]]:
        return subprocess.Popen(cmd, env=dict(env)).wait(), {}
    return start


def _accelerate_here(arguments: list[str]) -> Start:
    """Run `accelerate launch <arguments>` in this process (hfdist.job.quiet_launch)."""
    def start(env: Mapping[str, str]) -> tuple[int, dict[int, int]]:
        from hfdist.job.quiet_launch import launch_here

        return launch_here(arguments, env)
    return start


def _hand_over(start: Start, env: dict[str, str], what: str, signals: Sequence[str]) -> int:
    """Run the launch, relaying the preemption `signals` this process receives to the processes it starts
    (hfdist.job.signal_relay), and when it fails end the screen with the ranks' hfdist paragraphs (or one line saying
    which rank failed); returns the exit code (2 when the ranks stopped on bad input, as one process does;
    PREEMPTED_EXIT_CODE when they stopped for a preemption: rank 0 printed why; DIVERGED_EXIT_CODE with rank 0's
    paragraph when a non-finite step stopped them; 128 + the signal when a relayed
    signal ended them outside training, before they could checkpoint)."""
    from hfdist.job.collector import resume_collector

    resume_collector()  # the launcher's imports are done; it waits for its ranks as long as they train
    with tempfile.TemporaryDirectory(prefix="hfdist-errors-") as errors, SignalRelay(signals) as relay:
        code, failures = start({**env, ERROR_DIR_ENV: errors})
        if code == 0:
            return 0
        if preempted_note(errors) is not None:
            return PREEMPTED_EXIT_CODE
        if relay.received is not None:
            print(f"hfdist: {what} got {relay.received} outside training (before its first step or after its last), "
                  "so it wrote no checkpoint for it; --resume continues from the last checkpoint in the output "
                  "folder, if there is one.", file=sys.stderr, flush=True)
            return 128 + int(signal.Signals[relay.received])
        paragraphs = collected_errors(Path(errors))
    for text in paragraphs:
        print(text, file=sys.stderr, flush=True)
    if paragraphs:  # bad input (2), or a run that diverged (its own code: hfdist.train.nonfinite)
        return DIVERGED_EXIT_CODE if code == DIVERGED_EXIT_CODE else 2
    failed = ", ".join(f"rank {r} (exit code {c})" for r, c in sorted(failures.items())) or f"exit code {code}"
    print(f"hfdist: {what} failed: {failed}. The failing rank's output is above; library messages are in "
          f"{env.get(console.LOG_DIR_ENV, 'the output folder')}.", file=sys.stderr, flush=True)
    return code


def ensure_world(rung: Rung, cfg: FinetuneConfig, entry: Sequence[str], script_args: list[str],
                 node: Node | None = None) -> int | None:
    """Start the rung's world if this process is not in it yet (module docstring).

    Args:
        entry: what the hand-over starts in each rank with `script_args`: [path of scripts/finetune.py] or
            ["-m", "hfdist.cli", "finetune"].

    Returns:
        None when this process is a rank of the right world and should train; otherwise the exit code of the
        launch it handed over to (the caller exits with it).

    Raises:
        LaunchError: a world of the wrong size is already running (naming the sizes and the fix).
    """
    node = Node.detect() if node is None else node
    if node.launched or os.environ.get(HANDED_OVER_ENV):
        world = node.world or 1
        if world != rung.num_processes:
            raise LaunchError(
                f"--config {rung.name} needs {rung.num_processes} processes ({rung.dims.describe()}), but this world "
                f"has {world}. Run it as `hfdist finetune --config {rung.name}` (hfdist starts the right number), "
                f"or pass --num-processes {world} to rescale the rung to this world.")
        _check_launcher_env(rung)
        if int(os.environ.get("RANK", "0")) == 0:
            for note in rung.notes:
                print(note, flush=True)
        return None
    signals = preempt_signals(cfg.preempt_signal)
    env = {**os.environ, HANDED_OVER_ENV: "1", **console.launch_env(cfg.output_dir, cfg.verbose),
           **elastic_env(signals, os.environ)}
    if rung.kind is StrategyKind.SINGLE:
        if node.gpus <= 1:
            return None
        # transformers would wrap a process that sees several GPUs in nn.DataParallel (batch x n_gpu, a loss per
        # replica): the single rung restarts itself with one GPU visible.
        print(f"hfdist: single runs on one GPU of {node.gpus}: restarting with CUDA_VISIBLE_DEVICES="
              f"{single_gpu_env(env)['CUDA_VISIBLE_DEVICES']}", flush=True)
        return _hand_over(_in_a_process([sys.executable, *entry, *script_args]), single_gpu_env(env),
                          "the single run", signals)
    arguments = accelerate_arguments(rung, entry, script_args, on_gpu=node.gpus > 0)
    print(f"hfdist: starting {rung.num_processes} process{'es' if rung.num_processes > 1 else ''} for {rung.name} "
          f"({rung.dims.layout()}): accelerate launch --config_file {rung.yaml_path} ...",
          flush=True)
    return _hand_over(_accelerate_here(arguments), env, rung.name, signals)
