"""The benchmarks on a multi-GPU host, without running them: torch.cuda mocked as an 8 x H100 node, each
benchmark's command is taken apart the way its launcher and hfdist would read it in a rank, and hfdist's world
checks run on it there. What must hold: every rank trains in the world the benchmark started (no refusal, no restart
that leaves the benchmark's clock behind), and results measured on CPU are filed under the CPU's name.
"""

from __future__ import annotations

import importlib
import os
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

import hfdist.callbacks.distributed_metrics  # noqa: F401 (transformers' Trainer imports before torch.cuda is mocked)
import hfdist.job.run
from hfdist.config.finetune import parse_args
from hfdist.job import launch
from hfdist.job.world import resolve_rung

from helpers import REPO

BENCHMARKS = REPO / "benchmarks"
FINETUNE = str(REPO / "scripts" / "finetune.py")
CLOCK = str(BENCHMARKS / "step_clock.py")
# The benchmarks whose workers run gloo on CPU tensors (or train on the CPU) whatever the host has.
MEASURED_ON_CPU = {"bench_chunked_loss", "bench_cp", "bench_load_memory", "bench_packing", "bench_pipeline",
                   "bench_prepare", "bench_tp_native"}


@pytest.fixture
def bench(monkeypatch):
    """Imports a benchmark module as its script does (benchmarks/ first on sys.path, for its sibling imports)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module


@pytest.fixture
def not_a_rank(monkeypatch):
    """This process as a user starts it: no launcher's world around it."""
    for key in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "ACCELERATE_USE_DEEPSPEED",
                launch.HANDED_OVER_ENV):
        monkeypatch.delenv(key, raising=False)


def _trains_in_this_rank(monkeypatch, script_args: list[str], world: int, deepspeed: bool = False) -> None:
    """Rank 0 of the `world` processes `accelerate launch` started runs scripts/finetune.py with `script_args`:
    hfdist must train in that world (ensure_world returns None), neither refuse it nor start another."""
    if world > 1:
        env = {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_WORLD_SIZE": str(world), "LOCAL_RANK": "0",
               "ACCELERATE_USE_DEEPSPEED": str(deepspeed).lower()}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
    cfg = parse_args(script_args)
    assert launch.ensure_world(resolve_rung(cfg), cfg, [FINETUNE], script_args) is None


def _launch(cmd: list[str], script: str) -> tuple[int, list[str]]:
    """(--num_processes, the arguments after `script`) of an `accelerate launch` command."""
    return int(cmd[cmd.index("--num_processes") + 1]), cmd[cmd.index(script) + 1:]


def test_overhead_benchmark_starts_on_an_8_gpu_host(gpu_host, bench, not_a_rank, monkeypatch, tmp_path):
    """gpu-readiness A4: its 2-process worlds, where hfdist's rung would scale to the host's 8 GPUs by default."""
    overhead = bench("bench_overhead")
    args = Namespace(seq_len=128, steps=20, global_batch=16)
    for rung in overhead.RUNGS:
        cmd = overhead._command(f"hfdist-{rung}", args, tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "o")
        nproc, script_args = _launch(cmd, FINETUNE)
        assert nproc == overhead.NPROC and cmd[cmd.index(FINETUNE) - 1] == CLOCK
        _trains_in_this_rank(monkeypatch, script_args, nproc, deepspeed=rung == "zero2")


@pytest.mark.parametrize("config", ["single", "ddp", "fsdp_tp"])
def test_compile_benchmark_starts_with_its_clock_in_every_rank_on_an_8_gpu_host(gpu_host, bench, not_a_rank,
                                                                                 monkeypatch, tmp_path, config):
    """gpu-readiness A5: the single rung on a multi-GPU host restarted itself with one GPU visible, without the
    step clock (no clock file); a multi-process rung handed over to accelerate without it too."""
    compile_bench = bench("bench_compile")
    args = Namespace(config=config, seq_len=128, global_batch=16, steps=20)
    cmd, env = compile_bench.command("compile", args, tmp_path)
    assert cmd[cmd.index(FINETUNE) - 1] == CLOCK  # every process started runs the clock around the job
    if config == "single":
        assert env["CUDA_VISIBLE_DEVICES"] == "0"
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(env["CUDA_VISIBLE_DEVICES"].split(",")))
        _trains_in_this_rank(monkeypatch, cmd[cmd.index(FINETUNE) + 1:], world=1)
    else:
        nproc, script_args = _launch(cmd, FINETUNE)
        assert nproc == 8  # one process per GPU, as hfdist's own hand-over starts
        _trains_in_this_rank(monkeypatch, script_args, nproc)


def test_callbacks_benchmark_starts_on_an_8_gpu_host(gpu_host, bench, not_a_rank, monkeypatch, tmp_path):
    """gpu-readiness A6: the timed run handed hfdist its entry script as a str (a hand-over split it into
    characters), and on a multi-GPU host the single rung's restart would leave the timed callbacks behind."""
    callbacks = bench("bench_callbacks")
    for with_callbacks in (False, True):
        cmd, env = callbacks.command(with_callbacks, 40, tmp_path / "o")
        assert env["CUDA_VISIBLE_DEVICES"] == "0"  # one GPU from the start: hfdist trains in that process
    seen = {}
    monkeypatch.setattr(hfdist.job.run, "finetune", lambda cfg, entry, args: seen.update(entry=entry, args=args))
    callbacks._train_timed(["--max-steps", "2", "--output-dir", str(tmp_path / "o")], tmp_path)
    restart = [sys.executable, *seen["entry"], *seen["args"]]  # what ensure_world runs on a hand-over
    assert restart[:4] == [sys.executable, FINETUNE, "--max-steps", "2"]


def test_results_measured_on_cpu_are_filed_under_the_cpu_on_a_gpu_host(gpu_host, bench):
    """gpu-readiness B9: a benchmark names its results folder after the device its workers measured."""
    measure = bench("measure")
    # Every benchmark that files its results by hardware (bench_simulate's go to results/simulate).
    names = sorted(p.stem for p in BENCHMARKS.glob("bench_*.py") if "results_dir(" in p.read_text())
    assert MEASURED_ON_CPU < set(names)
    for name in names:
        folder = measure.results_dir(None, bench(name).MEASURED_ON)
        want = f"cpu-{os.cpu_count()}core" if name in MEASURED_ON_CPU else "h100-80gb-hbm3-x8"
        assert folder == REPO / "results" / want, name
    assert measure.results_dir(Path("mine"), "cpu") == Path("mine")  # --out wins
