"""End-to-end: what `--mixed-precision bf16` saves, by one mechanism per rung, on llama-tiny, as a user launches it.

ddp (accelerate's CPU autocast over fp32 weights), fsdp_full_shard (FSDP2's MixedPrecisionPolicy: bf16 compute, fp32
parameters and gradient reduction; fsdp_tp and pp save through the same streamed export) and zero3 / zero2_tp
(DeepSpeed's bf16 section, gradients accumulated and reduced in fp32; the saved weights are its fp32 masters). What
must hold: the saved model in the one documented dtype, fp32, DeepSpeed's its fp32 masters (its checkpoint exported
the same). The ddp launch also runs with a 3 s collective timeout and rank 0 held alone past it wherever it works
alone (the run must still finish and save). Every rung trains bf16 against the single-process bf16 run (2e-2), the
dtypes each rank computed, reduced and kept checked, in tests/e2e/test_cells.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from hfdist.config.ladder import load_rung

from helpers import BF16_ARGS, SHARED_RUNS, table_rungs

pytestmark = pytest.mark.multiproc

RUNGS = [n for n in table_rungs(option="bf16") if n != "single"]  # the rung table: one rung per mechanism
DEEPSPEED = [n for n in RUNGS if load_rung(n).uses_deepspeed]  # zero3, zero2_tp
# zero2_tp on 2 processes (tp 2 x dp 1): its bf16 save is what this module checks; the ladder's fp32 run assembles
# it over dp 2 x tp 2 (tests/e2e/test_finetune_ladder.py).
WORLD = {"zero2_tp": ("--num-processes", "2")}
# The ddp run also holds rank 0 alone, past its short --collective-timeout, in each phase where it works alone
# (hfdist.train.watchdog's test hold; gpu-readiness A2): the run must finish and save as the others do.
HELD_PHASES = ("DATA", "SAVE", "SUMMARY")
HOLD_S, SHORT_TIMEOUT_S = 5, 3


@pytest.fixture(scope="module")
def runs(shared_runs, tmp_path_factory) -> dict[str, dict]:
    """The bf16 runs: those test_fp8.py compares with too are the session's shared ones (helpers.SHARED_RUNS)."""
    root = tmp_path_factory.mktemp("bf16")
    held = {"env": {f"HFDIST_TEST_HOLD_{p}": str(HOLD_S) for p in HELD_PHASES}}
    shared = [name for name in ["single", *RUNGS] if f"bf16_{name}" in SHARED_RUNS]
    jobs = {name: (root / name, ("--config", name, *WORLD.get(name, ()), *BF16_ARGS), {})
            for name in RUNGS if name not in shared}
    jobs["ddp"] = (root / "ddp", ("--config", "ddp", *BF16_ARGS, "--collective-timeout", str(SHORT_TIMEOUT_S)),
                   {**held})
    out = shared_runs.launch([f"bf16_{name}" for name in shared], also=jobs)
    return {**out, **{name: shared_runs[f"bf16_{name}"] for name in shared}}


@pytest.mark.parametrize("name", ["single", *RUNGS])
def test_saved_weights_are_fp32_on_every_rung(runs, name):
    from safetensors import safe_open

    folder = runs[name]["_dir"]
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}


@pytest.mark.parametrize("name", DEEPSPEED)
def test_deepspeed_saves_its_fp32_master_weights_not_its_bf16_model(runs, name):
    """DeepSpeed trains a bf16 copy against fp32 master partitions: the save writes the masters (gpu-readiness B12:
    zero2_tp, whose AutoTP layers the Trainer used to gather and save in bf16, too). After 4 Adam steps hardly any
    master value is a bf16 number; an upcast bf16 model would be all of them."""
    from safetensors import safe_open

    with safe_open(str(runs[name]["_dir"] / "model.safetensors"), framework="pt") as f:
        for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
            weight = f.get_tensor(key)
            assert (weight.bfloat16().float() != weight).float().mean() > 0.9, key


def test_zero2_tp_checkpoint_exports_its_fp32_masters(runs, tmp_path):
    """`hfdist checkpoint export` of a zero2_tp checkpoint (DeepSpeed's converter cannot merge AutoTP's tp-split
    partitions): the fp32 masters, equal to the run's saved model at the same step."""
    from safetensors.torch import load_file

    from hfdist.checkpoint.convert import export_checkpoint

    run = runs["zero2_tp"]["_dir"]
    export_checkpoint(run / "checkpoint-4", tmp_path / "hf")
    exported, saved = load_file(tmp_path / "hf" / "model.safetensors"), load_file(run / "model.safetensors")
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)


def test_rank0_alone_longer_than_the_collective_timeout_finishes_and_saves(runs):
    """gpu-readiness A2: rank 0 prepares the data, writes the model and the summary alone while the other ranks wait
    in a collective; held there longer than --collective-timeout, the run still finishes and saves (the timeout is
    widened for those phases and restored after them, so training itself kept the short one)."""
    summary = runs["ddp"]
    log = summary["_stdout"] + summary["_stderr"]
    for phase in ("preparing data", "saving the model", "writing the summary"):
        assert f"hfdist: test hold: rank 0 alone in {phase} for {HOLD_S} s" in log, log[-3000:]
    assert summary["config"]["collective_timeout"] == SHORT_TIMEOUT_S
    assert (summary["_dir"] / "model.safetensors").is_file() and len(summary["losses"]) == 4
