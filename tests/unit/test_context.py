"""Context parallelism's pure parts: the cp axis in ParallelDims and the mesh, the sequence sharding (labels shifted
before the cut; contiguous under Ulysses, head-tail under a ring), the kv-head repeats for GQA, the method auto chooses
and why, the refusals before launch (--cp-method, --cp, the sequence length, the attention), the planner's
activation term."""

from __future__ import annotations

import pytest
import torch

from hfdist.config.dims import ParallelDims
from hfdist.config.ladder import load_rung
from hfdist.errors import HfdistError
from hfdist.models.presets import load_config
from hfdist.parallel.context import CpPlan, check_cp, kv_repeats, shard_batch
from hfdist.parallel.context_check import plan_cp

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
    ulysses = CpPlan("ulysses", 3, 3)
    parts = [shard_batch(batch, r, ulysses) for r in range(3)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], 1), ids)
    assert torch.equal(torch.cat([p["position_ids"] for p in parts], 1), ids % 5)
    shifted = torch.cat([p["shift_labels"] for p in parts], 1)
    # HF's causal-LM shift on the whole row: token t predicts t + 1, the last predicts nothing
    assert torch.equal(shifted[:, :-1], labels[:, 1:]) and (shifted[:, -1] == -100).all()
    assert parts[1]["labels"][0, -1] == ids[0, 8]  # a chunk's last token predicts the next chunk's first
    assert parts[0]["attention_mask"].shape == (2, 1, 12, 12)  # attention inputs stay whole
    with pytest.raises(HfdistError, match="multiple of 5"):
        shard_batch(batch, 0, CpPlan("ulysses", 5, 5))


def test_a_ring_holds_head_and_tail_chunks_with_their_shifted_labels():
    """Ring cp=3 on rows of 12: 6 chunks of 2, rank r holds chunks r and 5 - r (equal causal work), each token with
    the label of the next token of the whole row; pipeline stages also get the whole rows' position ids."""
    ids = torch.arange(24).reshape(2, 12)
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": ids % 5}
    ring = CpPlan("ring", 3, 1)
    parts = [shard_batch(batch, r, ring, row_positions=True) for r in range(3)]
    assert parts[0]["input_ids"][0].tolist() == [0, 1, 10, 11] and parts[2]["input_ids"][0].tolist() == [4, 5, 6, 7]
    assert parts[0]["labels"][0].tolist() == [1, 2, 11, -100]
    assert all(torch.equal(p["row_position_ids"], ids % 5) for p in parts)
    with pytest.raises(HfdistError, match="multiple of 6"):
        shard_batch({**batch, "input_ids": torch.zeros(1, 9, dtype=torch.long)}, 0, ring)


@pytest.mark.parametrize("kv, cp, repeats", [(8, 2, 1), (8, 8, 1), (2, 4, 2), (1, 4, 4), (6, 4, 2)])
def test_kv_heads_repeated_only_as_much_as_cp_needs(kv, cp, repeats):
    assert kv_repeats(kv, cp) == repeats
    assert (kv * repeats) % cp == 0


@pytest.mark.parametrize("heads, kv, tp, cp, seq, method, ulysses", [
    (32, 8, 1, 8, 32768, "ulysses", 8),  # Llama-3.1-8B, cp inside a node: the heads allow Ulysses
    (4, 2, 2, 2, 512, "ulysses", 2),  # llama-tiny at tp 2 x cp 2
    (64, 8, 8, 4, 131072, "ulysses", 4),  # Llama-3.1-70B, tp 8 x cp 4: 8 heads per tp rank
    (64, 8, 8, 16, 131072, "hybrid", 8),  # ... tp 8 x cp 16: Ulysses over 8, a ring of 2
    (6, 2, 1, 4, 512, "hybrid", 2),  # 6 heads, cp 4: Ulysses over 2, a ring of 2
    (6, 2, 2, 2, 512, "ring", 1),  # 3 heads per tp rank, cp 2
    (32, 8, 1, 64, 65536, "hybrid", 32),  # cp past the heads: a ring of 2 groups of 32
    (6, 2, 1, 4, 516, "hybrid", 2),  # hybrid cuts rows into multiples of lcm(2 x 2, 4) = 4 (a ring alone: 8)
])
def test_auto_chooses_ulysses_then_hybrid_then_ring_and_says_why(heads, kv, tp, cp, seq, method, ulysses):
    plan = plan_cp(heads, kv, tp, cp, seq)
    assert (plan.method, plan.ulysses, plan.ring) == (method, ulysses, cp // ulysses)
    assert plan.reason.startswith("auto:") and f"cp={cp}" in plan.reason
    assert seq % plan.seq_multiple == 0


def test_asked_methods_run_where_they_can():
    assert (plan_cp(32, 8, 1, 8, 4096, "ring").method, plan_cp(32, 8, 1, 8, 4096, "ring").ulysses) == ("ring", 1)
    assert plan_cp(32, 8, 1, 8, 4096, "hybrid").ulysses == 4  # the largest Ulysses degree that leaves a ring
    assert plan_cp(32, 8, 1, 8, 4096, "ulysses").reason == "asked for (--cp-method ulysses)"


@pytest.mark.parametrize("args, said", [
    ((4, 2, 1, 3, 512, "ulysses"), "4 attention heads do not divide by cp=3. Use --cp-method ring"),
    ((6, 2, 2, 2, 512, "ulysses"), "3 attention heads per tp rank (the model has 6, tp=2) do not divide by cp=2"),
    ((6, 2, 1, 4, 512, "ulysses"), "--cp-method hybrid (Ulysses over 2 ranks, a ring of 2)"),
    ((6, 2, 2, 2, 512, "hybrid"), "gcd(3, 2) = 1 leaves none. Use --cp-method ring"),
    ((2, 2, 1, 2, 512, "hybrid"), "leaves none. Use --cp-method ring or ulysses"),
    ((4, 2, 1, 2, 511, "auto"), "--seq-len must be a multiple of 2, and 511 is not. Use --seq-len 510 or 512"),
    ((4, 2, 1, 2, 514, "ring"), "2 x 2 chunks (each ring member holds a head and a tail chunk"),
    ((4, 2, 1, 2, 512, "zigzag"), "use one of auto, ulysses, ring, hybrid"),
])
def test_methods_that_cannot_run_are_refused_naming_what_would(args, said):
    with pytest.raises(HfdistError) as err:
        plan_cp(*args)
    assert said in str(err.value)


def test_check_cp_reads_the_config_and_refuses_rings_over_sliding_windows():
    tiny = load_config("llama-tiny")  # 4 heads, 2 kv
    assert check_cp(tiny, 1) is None and check_cp(tiny, 4, 512).method == "ulysses"
    assert check_cp(tiny, 3, 516).method == "ring"
    with pytest.raises(HfdistError, match=r"2 attention heads per tp rank \(the model has 4, tp=2\) do not divide by cp=4"):
        check_cp(tiny, 4, 512, tp=2, method="ulysses")
    mistral = load_config("mistral-tiny")  # every layer slides a 32-token window
    assert check_cp(mistral, 2, 512).method == "ulysses"
    with pytest.raises(HfdistError, match="slide a window of 32 tokens"):
        check_cp(mistral, 2, 512, method="ring")


def test_rings_need_the_batchs_document_boundaries():
    from hfdist.parallel.context_check import check_cp_attention

    check_cp_attention(CpPlan("ulysses", 2, 2), "sdpa")  # Ulysses attends with the dense mask
    check_cp_attention(CpPlan("ring", 2, 1), "hfdist_documents")
    check_cp_attention(CpPlan("ring", 2, 1), "flash_attention_2")
    with pytest.raises(HfdistError, match="--attn-implementation sdpa does not give the batch"):
        check_cp_attention(CpPlan("hybrid", 4, 2), "sdpa")


def test_cp_degree_and_method_from_the_command_line():
    """--cp rescales like --tp / --pp (the data-parallel axis absorbs it) on the FSDP2 rungs, 3d included; it and
    --cp-method are refused where there is no cp axis; a pipeline rung with cp plans like any other."""
    from hfdist.parallel.fit import plan_context

    assert load_rung("fsdp_cp").with_num_processes(8, cp=4).dims == ParallelDims(dp_shard=2, cp=4)
    tp_cp = load_rung("fsdp_tp_cp")
    assert (tp_cp.dims.cp, tp_cp.dims.tp, tp_cp.num_processes) == (2, 2, 4)
    assert tp_cp.with_num_processes(32, tp=8).dims == ParallelDims(dp_shard=2, cp=2, tp=8)
    three = load_rung("3d").with_num_processes(8, cp=2)
    assert three.dims == ParallelDims(dp_shard=1, cp=2, pp=2, tp=2) and three.uses_fsdp
    planned = plan_context(load_config("llama-tiny-6h"), three.with_context("ring"), 512)
    assert (planned.context.method, planned.context.ulysses) == ("ring", 1)
    auto = plan_context(load_config("llama-tiny-6h"), load_rung("fsdp_cp").with_num_processes(4, cp=4), 512)
    assert (auto.context.method, auto.context.ulysses) == ("hybrid", 2) and auto.context.reason.startswith("auto:")
    with pytest.raises(HfdistError, match="--cp 2 cannot apply to ddp"):
        load_rung("ddp").with_num_processes(4, cp=2)
    with pytest.raises(HfdistError, match="no pipeline stages, context parallelism or replica groups"):
        load_rung("zero2").with_num_processes(4, cp=2)
    with pytest.raises(HfdistError, match="--cp-method ring applies to rungs with context parallelism"):
        load_rung("fsdp_tp").with_context("ring")


def test_planner_activations_divide_by_cp_plus_the_methods_own():
    """A cp rank's activations are one process's / cp, plus what its method holds in flight (Ulysses: the
    exchanged copies of q, k, v; hfdist.plan.context_bytes); the chunked loss's one chunk of logits does not divide."""
    from hfdist.models.shape import ModelShape
    from hfdist.plan.bytes import Workload, rung_rank_bytes
    from hfdist.plan.context_bytes import cp_layer_costs

    rung = load_rung("fsdp_cp")
    shape = ModelShape.from_config(load_config("llama-3.1-8b"))
    w = Workload(seq=32768, micro_batch=1, dtype="bf16", loss_chunk_size=None)  # the whole sequence's logits
    exchanged = cp_layer_costs(shape, 32768 // 2, 2, 1, CpPlan("ulysses", 2, 2))
    assert exchanged.saved == 0 and exchanged.in_flight == 2 * 16384 * 128 * (32 + 2 * 8) * 2
    one = rung_rank_bytes(shape, rung, ParallelDims(dp_shard=4), w)
    two = rung_rank_bytes(shape, rung, ParallelDims(dp_shard=2, cp=2), w)
    assert two.activations - exchanged.in_flight == pytest.approx(one.activations / 2, rel=1e-6)
    assert two.weights == one.weights  # states sharded over dp_shard x cp: the same 4 ranks
    chunked = Workload(seq=32768, micro_batch=1, dtype="bf16")
    chunk_logits = 512 * shape.vocab * (4 + 2)  # fp32 logits and the bf16 copy of their gradient (fused loss)
    one = rung_rank_bytes(shape, rung, ParallelDims(dp_shard=4), chunked).activations - chunk_logits
    two = rung_rank_bytes(shape, rung, ParallelDims(dp_shard=2, cp=2), chunked).activations - chunk_logits
    assert two - exchanged.in_flight == pytest.approx(one / 2, rel=1e-6)


def test_each_methods_bytes_in_flight_and_sent():
    """hfdist.plan.context_bytes on Llama-3.1-8B per tp rank (32 heads, 8 kv, head dim 128), 4,096 tokens per rank,
    bf16: the ring holds two key/value blocks + three fp32 kv-gradient blocks in flight + the fp32 query gradient,
    O(tokens per rank) whatever cp; Ulysses sends (cp - 1)/cp of q, k, v and the output each way; the ring sends its
    keys and values r - 1 times each way and their fp32 gradients r times; hybrid adds the two on its shares."""
    from hfdist.models.shape import ModelShape
    from hfdist.plan.context_bytes import cp_layer_costs, cp_step_send_bytes

    shape = ModelShape.from_config(load_config("llama-3.1-8b"))
    t, d = 4096, 128
    block = t * 8 * d
    ring = cp_layer_costs(shape, t, 2, 1, CpPlan("ring", 8, 1))
    assert ring.saved == 0 and ring.in_flight == 4 * block * 2 + 6 * block * 4 + t * 32 * d * 4
    assert cp_layer_costs(shape, t, 2, 1, CpPlan("ring", 64, 1)).in_flight == ring.in_flight  # O(S / cp)
    assert (ring.sent_forward, ring.sent_backward) == (2 * 7 * block * 2, 2 * 7 * block * 2 + 2 * 8 * block * 4)
    ulysses = cp_layer_costs(shape, t, 2, 1, CpPlan("ulysses", 8, 8))
    assert ulysses.sent_forward == ulysses.sent_backward == 7 * t * d * (2 * 32 + 2 * 8) * 2 // 8
    hybrid = cp_layer_costs(shape, t, 2, 1, CpPlan("hybrid", 64, 32))  # kv 8 repeated to 32 for 32 ranks
    assert hybrid.saved == 2 * t * d * (32 - 8) * 2
    assert hybrid.sent_backward > hybrid.sent_forward > 0
    assert cp_step_send_bytes(shape, 32, t, 2, 1, CpPlan("ring", 8, 1), activation_checkpointing=True) == \
        32 * (2 * ring.sent_forward + ring.sent_backward)


def test_70b_at_128k_plans_fsdp_tp_cp_layouts_the_job_accepts():
    """`hfdist plan --model llama-3.1-70b --gpus-per-node 8 --nodes 4 --gpu-mem-gb 80 --activation-checkpointing --seq
    131072`: fsdp_tp_cp has layouts that fit, each cp layout names its method, and the recommended command for it is
    one the job parses and lays out exactly so (degrees and method)."""
    import shlex

    from hfdist.config.finetune import parse_args
    from hfdist.job.preflight import plan_context_parallel
    from hfdist.job.world import Node, resolve_rung
    from hfdist.models.presets import preset_shape
    from hfdist.plan import GB, plan_rungs

    plan = plan_rungs(preset_shape("llama-3.1-70b"), gpus_per_node=8, nodes=4, gpu_mem_bytes=80 * GB, seq=131072,
                      global_batch=32, micro_batch=None, activation_checkpointing=True, model="llama-3.1-70b")
    row = next(r for r in plan.rungs if r.name == "fsdp_tp_cp")
    assert row.fits and row.layout.dims.tp > 1 and row.layout.dims.cp > 1
    assert f"--cp-method {row.layout.rung.context.method}" in row.command
    argv = shlex.split(row.command)
    cfg = parse_args(argv[argv.index("scripts/finetune.py") + 1:])
    rung = plan_context_parallel(cfg, resolve_rung(cfg, Node(gpus=8, world=32, local_world=8)))
    assert rung.dims == row.layout.dims and rung.context.method == row.layout.rung.context.method


def test_the_search_plans_rings_where_tp_x_cp_exceeds_the_heads():
    """Llama-3.1-8B (32 heads) on 8 nodes of 8: tp 8 x cp 8 = 64 ranks split the sequence past the heads, so its
    layouts run hybrid (Ulysses over the 4 heads per tp rank, a ring of 2) or ring, never Ulysses alone."""
    from hfdist.config.ladder import load_rung
    from hfdist.models.presets import preset_shape
    from hfdist.plan.layouts import Cluster, Pins, rung_layouts

    layouts, _ = rung_layouts(load_rung("fsdp_tp_cp"), preset_shape("llama-3.1-8b"), Cluster(8, 8), global_batch=64,
                              seq=131072, pins=Pins(tp=8, cp=8, micro_batch=1, activation_checkpointing=True))
    planned = {(lay.rung.context.method, lay.rung.context.ulysses) for lay in layouts}
    assert planned == {("hybrid", 4), ("ring", 1)}
