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


def test_adapters_of_another_preset_seed_are_refused_naming_both_fingerprints(tmp_path):
    """A LoRA checkpoint records its base's fingerprint; a preset's weights are drawn from --seed, so another seed is
    another base."""
    cfg = _checkpoint(tmp_path, "fsdp_full_shard")
    lora = FinetuneConfig(**{**cfg.__dict__, "lora": True})
    write_marker(tmp_path / "checkpoint-2", checkpoint_identity(lora, load_rung("fsdp_full_shard")), step=2)
    assert resume_point(lora, load_rung("fsdp_full_shard")) == tmp_path / "checkpoint-2"
    other = FinetuneConfig(**{**lora.__dict__, "seed": lora.seed + 1})
    saved, now = (checkpoint_identity(c, load_rung("fsdp_full_shard"))["base"] for c in (lora, other))
    with pytest.raises(CheckpointError, match="trained on another base") as exc:
        resume_point(other, load_rung("fsdp_full_shard"))
    assert f"weights {saved['weights']} vs {now['weights']}" in str(exc.value)


def test_base_fingerprint_reads_the_weights_not_the_name(tmp_path):
    """Two checkpoints of the same shapes under one path (another seed's weights) differ in their sampled data; the
    same bytes agree; a hub snapshot's commit is the folder's name."""
    from safetensors.torch import save_file

    from hfdist.models.fingerprint import base_fingerprint, fingerprint_difference

    folder = tmp_path / "snapshots" / "0123abc"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.randn(300_000, generator=torch.Generator().manual_seed(1)), "b": torch.ones(10)},
              str(folder / "model.safetensors"))
    first = base_fingerprint(str(folder), seed=0)
    assert first["revision"] == "0123abc" and base_fingerprint(str(folder), seed=5) == first  # seed: presets only
    save_file({"w": torch.randn(300_000, generator=torch.Generator().manual_seed(2)), "b": torch.ones(10)},
              str(folder / "model.safetensors"))
    assert fingerprint_difference(first, base_fingerprint(str(folder), seed=0)) == [
        f"weights {first['weights']} vs {base_fingerprint(str(folder), seed=0)['weights']}"]


def test_checkpoint_base_is_refused_where_it_means_nothing():
    from hfdist.config.finetune import ConfigError
    from hfdist.job.preflight import check_lora

    for cfg, why in ((FinetuneConfig(checkpoint_base=True), "trains every weight"),
                     (FinetuneConfig(checkpoint_base=True, qlora=True), "quantises anew")):
        with pytest.raises(ConfigError, match=why):
            check_lora(cfg, load_rung("ddp"), None)
