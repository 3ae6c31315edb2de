"""`hfdist checkpoint export DIR --to hf OUT`: a training checkpoint of any layout written as a HF model (or LoRA
adapter) that from_pretrained loads with the trained loss: from a 3d checkpoint (DCP shards of 8 ranks:
dp_shard x pp x tp), a zero3 one (DeepSpeed partitions) and a one-process LoRA run's. The runs are the session's
shared ones (helpers.SHARED_RUNS: checkpoints at steps 2 and 4), whose losses the ladder and pipeline tests check."""

from __future__ import annotations

import sys
from functools import partial

import pytest
import torch

from helpers import check_batch, run_cmd, side_by_side

pytestmark = pytest.mark.multiproc

RUNS = ["3d", "zero3", "lora_single"]
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def exported(tmp_path_factory, shared_runs):
    """{name: (summary, export folder)}: each run's final checkpoint (step 4) exported."""
    root = tmp_path_factory.mktemp("export")
    shared_runs.launch(RUNS)
    folders = {name: (shared_runs[name]["_dir"] / "checkpoint-4", root / f"{name}-hf") for name in RUNS}
    procs = side_by_side({name: partial(run_cmd, [sys.executable, "-m", "hfdist.cli", "checkpoint", "export",
                                                  str(checkpoint), "--to", "hf", str(target)], timeout=600)
                          for name, (checkpoint, target) in folders.items()})
    for name, (checkpoint, target) in folders.items():
        assert procs[name].returncode == 0, procs[name].stderr[-4000:]
        assert f"hfdist: exported {checkpoint} -> {target}" in procs[name].stdout
    return {name: (shared_runs[name], target) for name, (_, target) in folders.items()}


@pytest.mark.parametrize("name", ["3d", "zero3"])
def test_exported_model_loads_with_the_trained_loss(exported, name):
    from transformers import AutoModelForCausalLM

    summary, target = exported[name]
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    with torch.no_grad():
        loss = model(**check_batch(summary)).loss.item()
    assert loss == pytest.approx(summary["check_batch_loss"], rel=LOSS_RTOL)
    assert loss < summary["losses"][0]


def test_exported_lora_adapter_loads_with_the_trained_loss(exported):
    from peft import PeftModel

    from hfdist.models.build import build_model

    summary, target = exported["lora_single"]
    assert sorted(p.name for p in target.glob("adapter_*")) == ["adapter_config.json", "adapter_model.safetensors"]
    base = build_model("llama-tiny", vocab_size=1024, seed=summary["config"]["seed"])
    model = PeftModel.from_pretrained(base, target).eval()
    with torch.no_grad():
        loss = model(**check_batch(summary)).loss.item()
    assert loss == pytest.approx(summary["check_batch_loss"], rel=LOSS_RTOL)


def test_export_refuses_a_folder_without_checkpoints_and_a_non_empty_target(exported, tmp_path):
    summary, target = exported["zero3"]
    proc = run_cmd([sys.executable, "-m", "hfdist.cli", "checkpoint", "export", str(tmp_path), "--to", "hf",
                    str(tmp_path / "x")], timeout=120)
    assert proc.returncode == 2 and "neither a complete hfdist checkpoint" in proc.stderr
    proc = run_cmd([sys.executable, "-m", "hfdist.cli", "checkpoint", "export", str(summary["_dir"]), "--to",
                    "hf", str(target)], timeout=120)
    assert proc.returncode == 2 and "is not empty" in proc.stderr
