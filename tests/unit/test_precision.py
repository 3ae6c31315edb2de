"""--mixed-precision: what each rung trains in on CPU and GPU, what accelerate is told, and checkpoints that record
precision and device (a resume across them is refused with the fix)."""

from __future__ import annotations

import os

import pytest

from hfdist.config.finetune import FinetuneConfig
from hfdist.config.ladder import load_rung
from hfdist.config.precision import cpu_translation, effective_mixed_precision, settle_mixed_precision


@pytest.mark.parametrize("asked, on_gpu, want", [("auto", True, "bf16"), ("auto", False, "no"), ("no", True, "no"),
                                                 ("bf16", False, "bf16"), ("bf16", True, "bf16")])
def test_effective_precision(asked, on_gpu, want):
    assert effective_mixed_precision(load_rung("fsdp_full_shard"), on_gpu, asked) == want  # the YAML says bf16


def test_cpu_translation_keeps_an_asked_bf16():
    rung = load_rung("ddp")
    auto = cpu_translation(rung, on_gpu=False)
    assert auto.mixed_precision == "no" and any("bf16 -> fp32" in note for note in auto.notes)
    asked = cpu_translation(rung, on_gpu=False, asked="bf16")
    assert asked.mixed_precision == "bf16" and not any("fp32" in note for note in asked.notes)
    assert cpu_translation(rung, on_gpu=True) is None


@pytest.mark.parametrize("name, accelerate_sees", [("ddp", "bf16"), ("zero3", "bf16"), ("fsdp_full_shard", "no"),
                                                   ("pp", "no")])
def test_one_mechanism_per_rung(monkeypatch, name, accelerate_sees):
    """Mesh rungs compute in bf16 through FSDP2's policy: accelerate must not autocast on top of it."""
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert settle_mixed_precision(load_rung(name), on_gpu=False, asked="bf16") == "bf16"
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == accelerate_sees


@pytest.mark.parametrize("saved, message", [({"mixed_precision": "bf16"}, "pass --mixed-precision bf16"),
                                            ({"device": "cuda"}, "resume on a cuda machine")])
def test_resume_across_precision_or_device_is_refused(tmp_path, saved, message):
    from hfdist.checkpoint.format import CheckpointError, write_marker
    from hfdist.checkpoint.resume import checkpoint_identity, resume_point

    cfg = FinetuneConfig(config="fsdp_full_shard", output_dir=str(tmp_path), resume=True, max_steps=10)
    rung = load_rung("fsdp_full_shard")
    identity = checkpoint_identity(cfg, rung)
    assert identity["mixed_precision"] == "no" and identity["device"] == "cpu"
    (tmp_path / "checkpoint-2").mkdir()
    write_marker(tmp_path / "checkpoint-2", {**identity, **saved}, step=2)
    with pytest.raises(CheckpointError, match=message):
        resume_point(cfg, rung)
    write_marker(tmp_path / "checkpoint-2", identity, step=2)
    import torch
    import torch.distributed.checkpoint as dcp

    # The shard files its DCP metadata lists must be there (hfdist.checkpoint.format.check_shard_files).
    dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=str(tmp_path / "checkpoint-2" / "sharded"), no_dist=True)
    assert resume_point(cfg, rung) == tmp_path / "checkpoint-2"
