"""What a checkpoint may change on resume (hfdist.checkpoint.resume), without launching anything: a DCP checkpoint of
another layout and world reshards, a DeepSpeed one is refused naming the converter, another workload or lost shard
files are refused naming what differs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hfdist.checkpoint.format import CheckpointError, write_marker
from hfdist.checkpoint.resume import checkpoint_identity, resume_line, resume_point
from hfdist.config.finetune import FinetuneConfig
from hfdist.config.ladder import load_rung


def _checkpoint(tmp_path, written_by: str, **changes) -> FinetuneConfig:
    """checkpoint-2 as `written_by` would leave it (marker + a DCP folder), and the config of a run resuming it."""
    cfg = FinetuneConfig(config="fsdp_full_shard", output_dir=str(tmp_path), resume=True, max_steps=10)
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    write_marker(folder, {**checkpoint_identity(cfg, load_rung(written_by)), **changes}, step=2)
    dcp.save({"model": {"w": torch.zeros(2)}, "optimizer": {"v": torch.ones(3)}},
             checkpoint_id=str(folder / "sharded"), no_dist=True)
    return cfg


def test_dcp_checkpoint_of_another_layout_reshards(tmp_path):
    cfg = _checkpoint(tmp_path, "fsdp_hybrid")
    rung = load_rung("fsdp_full_shard")
    assert resume_point(cfg, rung) == tmp_path / "checkpoint-2"
    line = resume_line(tmp_path / "checkpoint-2", cfg, rung)
    assert "(step 2): resharding fsdp_hybrid on 4 ranks (dp_replicate 2 x dp_shard 2) -> fsdp_full_shard on 2 " \
           "ranks (dp_shard 2)" in line
    assert "RNG: ranks 0-1 restore the streams the same ranks saved, the streams of ranks 2-3 are unused" in line


def test_same_layout_says_so(tmp_path):
    cfg = _checkpoint(tmp_path, "fsdp_full_shard")
    assert resume_line(tmp_path / "checkpoint-2", cfg, load_rung("fsdp_full_shard")).endswith(
        "on the layout that wrote it: fsdp_full_shard on 2 ranks (dp_shard 2).")


def test_deepspeed_checkpoint_on_another_layout_names_the_converter(tmp_path):
    cfg = _checkpoint(tmp_path, "zero3")
    with pytest.raises(CheckpointError, match="ds_to_universal") as exc:
        resume_point(cfg, load_rung("fsdp_full_shard"))
    assert "hfdist checkpoint export" in str(exc.value) and "--config zero3 --num-processes 2" in str(exc.value)


def test_another_global_batch_is_refused_naming_both(tmp_path):
    cfg = _checkpoint(tmp_path, "ddp", global_batch_size=32)
    with pytest.raises(CheckpointError, match="global_batch_size: checkpoint 32, this run 16") as exc:
        resume_point(cfg, load_rung("fsdp_full_shard"))
    assert "--global-batch-size 32" in str(exc.value)


def test_lost_shard_files_are_named(tmp_path):
    cfg = _checkpoint(tmp_path, "fsdp_full_shard")
    (shard,) = (tmp_path / "checkpoint-2" / "sharded").glob("*.distcp")
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"lacks shards its metadata lists: {shard.name} \(missing\)"):
        resume_point(cfg, load_rung("fsdp_full_shard"))
