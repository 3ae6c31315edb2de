"""Context parallelism's pure parts: the cp axis in ParallelDims and the mesh, the sequence sharding (labels shifted
before the cut), the kv-head repeats for GQA, the checks before launch, the planner's activation term."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hfdist.config.dims import ParallelDims
from hfdist.config.ladder import load_rung
from hfdist.errors import HfdistError
from hfdist.models.presets import load_config
from hfdist.parallel.context import check_cp, kv_repeats, shard_batch

from helpers import fake_world


def test_cp_is_an_axis_of_the_world_and_the_mesh():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=2)
    assert dims.world_size == 16 and dims.dp == 4 and dims.ranks_per_batch == 4
    assert dims.mesh_shape() == (("dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 2, 2))
    assert "cp=2" in dims.describe() and dims.to_dict()["cp"] == 2
    with fake_world(16, rank=5):
        mesh = dims.build_mesh("cpu")
        fsdp = dims.fsdp_mesh(mesh)  # FSDP2 shards over dp_shard x cp, under the replicas
        assert fsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp") and tuple(fsdp.shape) == (2, 4)
        assert mesh["cp"].size() == 2


def test_fsdp_cp_rung_reads_accelerates_key():
    rung = load_rung("fsdp_cp")
    assert (rung.dims.dp_shard, rung.dims.cp, rung.num_processes) == (2, 2, 4)
    assert rung.with_num_processes(8).dims == ParallelDims(dp_shard=4, cp=2)  # the data-parallel axis absorbs


def test_shard_batch_shifts_labels_before_the_cut():
    ids = torch.arange(24).reshape(2, 12)
    labels = ids.clone()
    labels[:, :2] = -100
    batch = {"input_ids": ids, "labels": labels, "position_ids": ids % 5, "attention_mask": torch.ones(2, 1, 12, 12)}
    parts = [shard_batch(batch, r, 3) for r in range(3)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], 1), ids)
    assert torch.equal(torch.cat([p["position_ids"] for p in parts], 1), ids % 5)
    shifted = torch.cat([p["shift_labels"] for p in parts], 1)
    # HF's causal-LM shift on the whole row: token t predicts t + 1, the last predicts nothing
    assert torch.equal(shifted[:, :-1], labels[:, 1:]) and (shifted[:, -1] == -100).all()
    assert parts[1]["labels"][0, -1] == ids[0, 8]  # a chunk's last token predicts the next chunk's first
    assert parts[0]["attention_mask"].shape == (2, 1, 12, 12)  # attention inputs stay whole
    with pytest.raises(HfdistError, match="multiple of 5"):
        shard_batch(batch, 0, 5)


@pytest.mark.parametrize("kv, cp, repeats", [(8, 2, 1), (8, 8, 1), (2, 4, 2), (1, 4, 4), (6, 4, 2)])
def test_kv_heads_repeated_only_as_much_as_cp_needs(kv, cp, repeats):
    assert kv_repeats(kv, cp) == repeats
    assert (kv * repeats) % cp == 0


def test_check_cp_names_heads_and_sequence():
    tiny = load_config("llama-tiny")  # 4 heads
    check_cp(tiny, 4, 512)
    with pytest.raises(HfdistError, match="4 attention heads do not divide by cp=3") as err:
        check_cp(tiny, 3, 512)
    assert "divisor of 4 (2, 4)" in str(err.value)
    with pytest.raises(HfdistError, match="/ tp=2 do not divide by cp=4"):
        check_cp(tiny, 4, 512, tp=2)
    with pytest.raises(HfdistError, match="--seq-len 513 does not divide by 2"):
        check_cp(tiny, 2, 513)


def test_preflight_refuses_cp_with_pipeline_stages():
    from hfdist.job.preflight import check_context_parallel

    rung = load_rung("3d")
    with pytest.raises(HfdistError, match="supports no pipeline schedule with cp"):
        check_context_parallel(load_config("llama-tiny"), replace(rung, dims=replace(rung.dims, cp=2)), 64)


def test_planner_activations_divide_by_cp():
    from hfdist.models.shape import ModelShape
    from hfdist.plan.bytes import Workload, rung_rank_bytes

    rung = load_rung("fsdp_cp")
    shape = ModelShape.from_config(load_config("llama-3.1-8b"))
    w = Workload(seq=32768, micro_batch=1, dtype="bf16", loss_chunk_size=None)  # the whole sequence's logits
    one = rung_rank_bytes(shape, rung, ParallelDims(dp_shard=4), w)
    two = rung_rank_bytes(shape, rung, ParallelDims(dp_shard=2, cp=2), w)
    assert two.activations == pytest.approx(one.activations / 2, rel=1e-6)
    assert two.weights == one.weights  # states sharded over dp_shard x cp: the same 4 ranks
    # The chunked loss (default) holds one 512-position chunk of logits on every cp rank: that term does not divide.
    chunked = Workload(seq=32768, micro_batch=1, dtype="bf16")
    chunk_logits = 512 * shape.vocab * (4 + 2)  # fp32 logits and the bf16 copy of their gradient (fused loss)
    one = rung_rank_bytes(shape, rung, ParallelDims(dp_shard=4), chunked).activations - chunk_logits
    two = rung_rank_bytes(shape, rung, ParallelDims(dp_shard=2, cp=2), chunked).activations - chunk_logits
    assert two == pytest.approx(one / 2, rel=1e-6)
