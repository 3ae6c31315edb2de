"""Helpers every test layer shares: run scripts/finetune.py the way a user does, launch gloo workers, read what the
runs wrote, and a fake process group for simulated ranks in one process.

Test layers: tests/unit (one process; simulated ranks through a fake process group at most), tests/integration
(library code on several gloo ranks, launched by torchrun), tests/e2e (launches of the job as a user runs it).
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
FINETUNE = REPO / "scripts" / "finetune.py"
# Small enough for 2 CPU cores; big enough that every rank gets several sequences and the loss moves.
TINY_ARGS = ["--model", "llama-tiny", "--max-steps", "4", "--global-batch-size", "8", "--seq-len", "64",
             "--learning-rate", "3e-3", "--warmup-steps", "0"]


# Configs other projects ship, as users bring them (tests/unit/test_translate.py, tests/e2e/test_byo_configs.py).
# accelerate's examples/config_yaml_templates/fsdp.yaml: FSDP1 keys, no fsdp_version.
ACCELERATE_FSDP1_TEMPLATE = {
    "distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 2,
    "fsdp_config": {"fsdp_activation_checkpointing": False, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                    "fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_cpu_ram_efficient_loading": True,
                    "fsdp_forward_prefetch": False, "fsdp_offload_params": False,
                    "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                    "fsdp_sync_module_states": True, "fsdp_use_orig_params": True},
}
# axolotl's deepspeed_configs/zero3_bf16.json, verbatim.
AXOLOTL_ZERO3_BF16 = {
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 0,
                          "reduce_bucket_size": "auto", "prefetch_bucket_size": "auto",
                          "param_persistence_threshold": "auto", "max_live_parameters": 0, "max_reuse_distance": 0,
                          "gather_16bit_weights_on_model_save": True},
    "bf16": {"enabled": True}, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def run_cmd(cmd: list[str], timeout: int = 900, cwd: Path = REPO,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a command (from the repository root unless `cwd`) with a quiet, offline environment (plus `env`)."""
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1", **(env or {})}
    env.pop("HFDIST_HANDED_OVER", None)
    # A W&B service started by an in-process test (WANDB_SERVICE and friends) would adopt the child's runs.
    for key in [k for k in env if k.startswith("WANDB_") and k != "WANDB_MODE"]:
        del env[key]
    return run_tree(cmd, timeout, cwd=cwd, env=env)


def run_tree(cmd: list[str], timeout: float, **popen: Any) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout), except that a timeout ends every process
    `cmd` started (hfdist.processes.end_process_tree), not only `cmd`: a launcher killed alone leaves its ranks
    running, or waiting in a collective, through the rest of the suite."""
    from hfdist.processes import end_process_tree

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_process_tree(proc, grace=10)
        stdout, stderr = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


# fp32 gradient norms against one process: the first step's within reduction order (the losses' 1e-5); the later
# ones 5e-5, AdamW's rounding room (hfdist.report.same_math.LATER_GRAD_NORM_RTOL says why; tests/e2e/test_cells.py).
GRAD_NORM_RTOL = (1e-5, 5e-5)


def assert_same_grad_norms(got: dict, ref: dict, rtol: tuple[float, float] = GRAD_NORM_RTOL, what: str = "") -> None:
    """Every step's gradient norm (before clipping, global over every rank and mesh: the summary's) of two runs'
    summaries agrees, the first step's within rtol[0], the later within rtol[1]: a gradient off by a constant factor,
    which Adam hides from the losses, shows here."""
    a, b = got["grad_norms"], ref["grad_norms"]
    assert len(a) == len(b) and all(x is not None and y is not None for x, y in zip(a, b)), f"{what}: {a} vs {b}"
    for step, (x, y) in enumerate(zip(a, b), 1):
        tol = rtol[0] if step == 1 else rtol[1]
        assert math.isclose(x, y, rel_tol=tol), f"{what} gradient norm at step {step}: {x} vs {y} (rtol {tol:g})"


def torchrun_json(worker: Path, nproc: int, out: Path, timeout: int) -> dict:
    """Run a test worker on `nproc` gloo ranks (torchrun picks a free port) and return the JSON it writes to `out`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(worker), str(out)]
    proc = run_tree(cmd, timeout, env=env, cwd=REPO)
    assert proc.returncode == 0, f"{worker.name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


CASES_WORKER = REPO / "tests" / "e2e" / "cells_worker.py"


def run_cases(cases: list[dict], world: int, root: Path, tag: str = "") -> dict[str, dict]:
    """Train `cases` one after the other in one world of `world` processes (tests/e2e/cells_worker.py, each through
    the job's own path; one process runs without a launcher): {case id: {"error", "seconds", "summary"}}.

    Args:
        cases: {"id", "args" (the job's command line), "output_dir"[, "env"]} each, in the order they run.
        tag: tells this launch's case and result files apart from another launch's of the same world in `root`.
    """
    cases_file, out = root / f"cases{tag}-{world}.json", root / f"results{tag}-{world}.json"
    cases_file.write_text(json.dumps(cases))
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    launcher = [] if world == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    proc = run_cmd([sys.executable, *launcher, str(CASES_WORKER), str(cases_file), str(out)], timeout=2400, env=env)
    log = proc.stdout[-6000:] + proc.stderr[-6000:]
    results = json.loads(out.read_text()) if out.is_file() else {}
    started = [line.split("cell: start ", 1)[1] for line in proc.stdout.splitlines() if "cell: start " in line]
    for case in cases:
        if case["id"] not in results:  # the world ended before it finished: name where
            last = started[-1] if started else None
            results[case["id"]] = {"error": f"the {world}-process launch exited {proc.returncode} "
                                            f"{'while running ' + last if last else 'before its first case'}:\n{log}"}
        summary = Path(case["output_dir"]) / "hfdist_summary.json"
        results[case["id"]]["summary"] = json.loads(summary.read_text()) if summary.is_file() else None
    return results


def accelerate(*args: str) -> list[str]:
    """`accelerate launch ...` through this interpreter (the venv's accelerate, whatever PATH says)."""
    return [sys.executable, "-m", "accelerate.commands.launch", *args]


def finetune(out: Path, *extra: str, config_file: str | None = None, via: str = "python",
             cwd: Path = REPO, env: dict[str, str] | None = None) -> dict:
    """Run the main job into `out` (from `cwd`, with `env` added to the environment) and return its
    hfdist_summary.json, with the run's stdout and stderr under "_stdout" / "_stderr"; fail the test with the log if
    it fails.

    via="python": `python scripts/finetune.py ...` (what `hfdist finetune` runs; hfdist hands over to accelerate);
    via="accelerate": `accelerate launch scripts/finetune.py ...` (the README's form: the same hand-over behind one
    more process, which SHARED_RUNS takes on every kind of strategy); config_file: `accelerate launch --config_file F
    ...`.
    """
    args = [str(FINETUNE), *TINY_ARGS, "--output-dir", str(out), *extra]
    if config_file is not None:
        # A port of its own (hfdist's hand-over picks one too): launches run side by side (finetune_all), and
        # accelerate's default port would be taken by the other one.
        cmd = accelerate("--config_file", config_file, "--main_process_port", str(free_port()), *args)
    elif via == "accelerate":
        cmd = accelerate("--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
                         "--dynamo_backend", "no", *args)
    else:
        cmd = [sys.executable, *args]
    proc = run_cmd(cmd, cwd=cwd, env=env)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                    f"--- stderr\n{proc.stderr[-8000:]}")
    summary = json.loads((out / "hfdist_summary.json").read_text())
    summary["_stdout"], summary["_stderr"] = proc.stdout, proc.stderr
    return summary


# Launches at once in finetune_all: the suite's CI host has 2 cores, and one launch leaves a core idle for much of its
# life (the launcher chain's imports before the ranks start, rank 0 alone saving and summarising, one-process runs).
# Three at once took the suite on the 2-core, 24 GiB machine to 35:56, against 37:09 with two (39:10 on a fresh
# clone), with at least 10 GiB of memory left free throughout (docs/testing.md has the runs). Each launch is its own
# job (output folder, port, process group), so running several together
# changes no figure a test asserts (losses, bytes, dtypes, saved weights); the one timed assertion (test_faults.py's
# stopped rank) runs alone. HFDIST_TEST_LAUNCHES=1 runs them one at a time (a machine shared with other work, or
# short of memory: under ~16 GiB, 2).
LAUNCHES_AT_ONCE = int(os.environ.get("HFDIST_TEST_LAUNCHES", "3"))


def side_by_side(calls: dict[Hashable, Callable[[], Any]]) -> dict[Hashable, Any]:
    """Each call (one that starts processes and waits for them), LAUNCHES_AT_ONCE at a time: {key: its result}. A
    call that raises (a failed launch) fails the test once the others have finished."""
    with ThreadPoolExecutor(LAUNCHES_AT_ONCE) as pool:
        futures = {key: pool.submit(call) for key, call in calls.items()}
        return {key: future.result() for key, future in futures.items()}


def table_rungs(module: str | None = None, option: str | None = None) -> list[str]:
    """The rungs the rung table (hfdist.config.rungs.RUNG_INFO) has the suite train end to end, in table order: those
    of e2e `module` (an E2E_MODULES key), those it also trains with `option` ("lora", "compile", ...), or both."""
    from hfdist.config.rungs import rungs_where

    return rungs_where(lambda info: (module is None or info.e2e == module)
                       and (option is None or option in info.tested_with))


def finetune_all(jobs: dict[Hashable, tuple[Path, tuple[str, ...], dict]]) -> dict[Hashable, dict]:
    """`finetune(out, *args, **kwargs)` for each job {key: (out, args, kwargs)}, side by side: {key: summary}."""
    return side_by_side({key: partial(finetune, out, *args, **kwargs) for key, (out, args, kwargs) in jobs.items()})


def pid_of_rank(rank: int, marker: str) -> int | None:
    """PID of the training process (scripts/finetune.py) with RANK=rank whose command line contains `marker`."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            environ = (proc / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if marker in cmdline and "finetune.py" in cmdline and f"RANK={rank}" in environ:
            return int(proc.name)
    return None


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Runs several test modules read, each launched once per session (on first use), checkpointed and evaluated on
# held-out data (eval_args) at steps 2 and 4:
# the ladder, pipeline, byo and fault tests compare their losses, bytes and saved models; test_resume resumes their
# checkpoint-2 on the same layout, test_resume_reshard on another, test_checkpoint_export exports their checkpoint-4;
# test_chunked_loss_job reads the two runs with the loss in sequence chunks (LOSS_CHUNKS).
# name -> (finetune arguments, accelerate config file under accelerate_configs/ or None, via).
LOSS_CHUNKS = ("--loss-chunk-size", "16")  # 4 chunks of the 64 positions (the default chunk holds all of them)
BF16_ARGS = ("--mixed-precision", "bf16", "--no-wandb")
SHARED_RUNS: dict[str, tuple[tuple[str, ...], str | None, str]] = {
    "single": ((), None, "python"),
    "lora_single": (("--lora",), None, "python"),
    # The README's form (`accelerate launch scripts/finetune.py`) on DDP, FSDP2 x TP, ZeRO-3 and 3d; the rest as
    # `hfdist finetune` runs it (`python scripts/finetune.py`: the same hand-over, one process less) ...
    "ddp": (("--config", "ddp.yaml"), None, "accelerate"),
    "fsdp_full_shard": (("--config", "fsdp_full_shard.yaml"), None, "python"),
    "fsdp_tp": (("--config", "fsdp_tp.yaml"), None, "accelerate"),
    "zero3": (("--config", "zero3.yaml"), None, "accelerate"),
    "lora_fsdp_full_shard": (("--config", "fsdp_full_shard", "--lora"), None, "python"),
    # ... or `accelerate launch --config_file` (hfdist finds the rung through the launcher).
    # (It also reports to MLflow and TensorBoard: test_finetune_ladder reads every rank's series back from them.)
    "fsdp_hybrid": (("--report-to", "wandb,mlflow,tensorboard"), "fsdp_hybrid.yaml", "accelerate"),
    "pp": ((), "pp.yaml", "accelerate"),
    "3d": (("--config", "3d.yaml"), None, "accelerate"),
    # The ladder's zero2 (the Trainer's loss through DeepSpeed's engine) and the pipeline module's Interleaved1F1B
    # (the last stage's loss) compute the loss in chunks: each launch answers its own module's tests and the chunked
    # loss's, since chunking changes no loss beyond the 1e-5 those modules allow against the unchunked single run.
    "zero2": (("--config", "zero2.yaml", *LOSS_CHUNKS), None, "python"),
    "pp_Interleaved1F1B": (("--config", "pp", "--pp-schedule", "Interleaved1F1B", *LOSS_CHUNKS), None, "python"),
    # The bf16 runs test_bf16.py checks and test_fp8.py compares its float8 runs with (BF16_SHARED).
    **{f"bf16_{name}": ((*(("--config", name) if name != "single" else ()), *BF16_ARGS), None, "python")
       for name in ("single", "fsdp_full_shard")},
}
# Background checkpoints asked for explicitly (a CPU run saves synchronously by default): test_resume.py and
# test_resume_reshard.py resume from these, so resuming from background-written checkpoints stays tested.
SHARED_SAVE_STEPS = ("--save-steps", "2", "--save-async")
EVAL_ROWS = 96  # instruction/response pairs of the held-out conversations (eval_args): ~50 packed blocks of 64


def eval_args(root: Path) -> tuple[str, ...]:
    """Evaluation on held-out conversations no run trains on (written under `root` once: another seed than the
    embedded data's), at steps 2 and 4 and the end: what every shared and ladder run adds, so their eval losses
    compare (the training data, and so the losses, stay as without evaluation)."""
    path = root / "eval.jsonl"
    if not path.is_file():
        from hfdist.data.default import generate_conversations

        path.write_text("".join(json.dumps(c) + "\n" for c in generate_conversations(EVAL_ROWS, seed=4321)))
    return ("--eval-dataset", str(path), "--eval-steps", "2")


def evaluate_saved(summary: dict, model=None) -> float:
    """A run's saved model (or `model`) evaluated in one process on the run's held-out data: its token-loss sum over
    the held-out blocks (packed and collated as the run did) / their label tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from hfdist.data import collate, load_raw_dataset, load_tokenizer, prepare
    from hfdist.data.cached import prepare_split
    from hfdist.models.chunked_loss import causal_lm_loss

    config, tok, seq_len = summary["config"], load_tokenizer(None, is_preset=True), summary["strategy"]["seq_len"]
    if config["eval_fraction"]:  # held out of --dataset's rows, by the seed
        (dataset,) = config["dataset"] or [None]  # one source: its spec is its path
        blocks = prepare_split(load_raw_dataset(dataset), tok, seq_len, eval_fraction=config["eval_fraction"],
                               seed=config["seed"]).eval
    else:
        blocks = prepare(load_raw_dataset(config["eval_dataset"]), tok, seq_len)
    model = (model or AutoModelForCausalLM.from_pretrained(summary["_dir"])).eval()
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(blocks), 8):
            batch = collate([blocks[i] for i in range(start, min(start + 8, len(blocks)))])
            loss_sum += float(causal_lm_loss(model, batch, num_items_in_batch=1))
            tokens += int((batch["labels"][:, 1:] != -100).sum())
    return loss_sum / tokens


class SharedRuns:
    """The SHARED_RUNS of one test session under `root`: `runs[name]` is that run's summary (finetune's, plus
    "_dir": its output folder), launched the first time a test asks for it."""

    def __init__(self, root: Path):
        self.root = root
        self._done: dict[str, dict] = {}

    def __getitem__(self, name: str) -> dict:
        self.launch([name])
        return self._done[name]

    def launch(self, names: list[str], also: dict[str, tuple[Path, tuple[str, ...], dict]] | None = None
               ) -> dict[str, dict]:
        """Launch those of `names` not launched yet and a module's own jobs `also` (as finetune_all's), all side by
        side; returns the summaries of `also`, each with "_dir"."""
        jobs = {("shared", name): (self.root / name, (*args, *SHARED_SAVE_STEPS, *eval_args(self.root)),
                                   {"config_file": None if file is None else str(REPO / "accelerate_configs" / file),
                                    "via": via})
                for name, (args, file, via) in ((n, SHARED_RUNS[n]) for n in dict.fromkeys(names))
                if name not in self._done}
        jobs.update({("own", name): job for name, job in (also or {}).items()})
        own = {}
        for (whose, name), summary in finetune_all(jobs).items():
            summary["_dir"] = jobs[whose, name][0]
            (self._done if whose == "shared" else own)[name] = summary
        return own


def check_batch(summary: dict):
    """The packed blocks a run scored after training (summary["check_batch_loss"]), as a model input batch (sdpa's
    block mask: the attention a reloaded model runs on CPU), tokenized as the run did: by the embedded tokenizer for
    a preset, by the checkpoint folder's own otherwise (transformers picks its class by the folder's model type)."""
    from hfdist.data import collate, load_raw_dataset, load_tokenizer, prepare
    from hfdist.models.presets import is_preset

    model = summary["config"]["model"]
    tok = load_tokenizer(model, is_preset=is_preset(model))
    ds = prepare(load_raw_dataset(None), tok, summary["strategy"]["seq_len"])
    return collate([ds[i] for i in range(summary["check_blocks"])])


def finished_offline_run(root, timeout: float = 60.0):
    """The offline run under `root` once its exit record is on disk. wandb's writer is a separate process
    (wandb-core) that may still be flushing when `finish()` returns (seen once in CI: an empty file)."""
    import time

    from hfdist.report.wandb_offline import WandbFileError, read_offline_run

    deadline = time.time() + timeout
    while True:
        try:
            run = read_offline_run(root)
            if run.exit_code is not None:
                return run
        except (WandbFileError, IndexError):
            pass
        if time.time() > deadline:
            raise AssertionError(f"W&B did not finish writing the offline run under {root} in {timeout:.0f} s")
        time.sleep(0.2)


@contextmanager
def fake_world(world_size: int, rank: int = 0):
    """A fake process group of `world_size` ranks in this process (torch's "fake" backend: collectives are no-ops),
    for code that only needs ranks and meshes to exist: plans, layouts, simulated scale."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this test process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def mlflow_series(uri: str) -> list[tuple[str, dict[str, list[tuple[int, float]]]]]:
    """Every run of the store at `uri`: (run name, {metric: [(step, value)]}) each (MLflow's own client)."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return [(run.info.run_name, {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
                                 for key in run.data.metrics})
            for experiment in client.search_experiments() for run in client.search_runs([experiment.experiment_id])]


def tensorboard_series(log_dir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} from the event files in `log_dir` (TensorBoard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
