"""A diverging run stops, as a user launches it: fsdp_full_shard on 2 processes at a learning rate that makes the
weights explode (1e8, no warm-up), a checkpoint every step, three kept. Before the guard it exited 0 having logged
the NaN steps as 0.0, rotated its finite checkpoints out and saved a model of NaNs.

What must hold: the job exits DIVERGED_EXIT_CODE (4) with one paragraph naming the step, the value and what usually
causes it; the summary and the console show the non-finite value (never 0.0); no model is written; every file left
holds finite tensors only; the checkpoint of the last finite step is still there.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from hfdist.errors import DIVERGED_EXIT_CODE

from helpers import FINETUNE, TINY_ARGS, run_cmd

pytestmark = pytest.mark.multiproc

DIVERGING = ["--config", "fsdp_full_shard", "--learning-rate", "1e8", "--warmup-steps", "0", "--save-steps", "1",
             "--save-total-limit", "3", "--max-steps", "8", "--no-wandb"]


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    out = tmp_path_factory.mktemp("diverged") / "run"
    proc = run_cmd([sys.executable, str(FINETUNE), *TINY_ARGS, *DIVERGING, "--output-dir", str(out)])
    return proc, out, json.loads((out / "hfdist_summary.json").read_text())


def test_exits_with_its_code_and_one_paragraph(diverged):
    proc, _, summary = diverged
    assert proc.returncode == DIVERGED_EXIT_CODE, proc.stdout[-3000:] + proc.stderr[-3000:]
    step = summary["diverged"]["step"]
    assert f"training diverged at step {step}: " in proc.stderr and "--learning-rate" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_summary_and_console_show_the_value_never_zero(diverged):
    proc, _, summary = diverged
    record = summary["diverged"]
    assert record["what"] in ("loss", "grad_norm") and record["value"] in ("nan", "inf", "-inf")
    assert summary["loss_steps"][-1] == record["step"] and len(summary["losses"]) == len(summary["grad_norms"])
    last = summary["losses"][-1] if record["what"] == "loss" else summary["grad_norms"][-1]
    assert not math.isfinite(last)
    assert all(x != 0.0 for x in summary["losses"])  # the Trainer's NaN filter would log 0.0
    assert f"was {record['value']}" in proc.stdout


def test_nothing_non_finite_is_written_and_the_last_finite_checkpoint_stays(diverged):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, out, summary = diverged
    step = summary["diverged"]["step"]
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    checkpoints = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert checkpoints and checkpoints[-1] == step - 1  # every step saved up to the last finite one, and kept
    for n in checkpoints:
        flat = out / f"state-{n}.pt"
        dcp_to_torch_save(out / f"checkpoint-{n}" / "sharded", flat)
        tensors = [t for t in _tensors(torch.load(flat, weights_only=False)) if t.is_floating_point()]
        assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors), f"checkpoint-{n}"


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)
