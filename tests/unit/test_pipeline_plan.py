"""Pipeline parallelism in one process: pure planning, the stage module, torch's rules under a fake process group.
(The 2-rank gloo training runs are in tests/integration/test_pipeline.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hfdist.models.loss import shift_labels
from hfdist.parallel.pipeline.plan import (
    SCHEDULES,
    PipelineConfigError,
    ideal_bubble_fraction,
    split_stages,
    stage_indices_for_rank,
    validate_microbatches,
)
from hfdist.parallel.pipeline.runner import PipelineRunner, token_sum_loss
from hfdist.parallel.pipeline.stage import PipelineModelError, build_stage_module

from helpers import fake_world

# ---------------------------------------------------------------- pure planning


def _sizes(ranges):
    return [len(r) for r in ranges]


def test_split_stages_balances_embedding_and_head():
    assert _sizes(split_stages(4, 2)) == [2, 2]
    assert _sizes(split_stages(4, 4)) == [1, 1, 1, 1]
    # 32 layers + embed + head = 34 effective over 4 stages: loads 9, 8, 9, 8.
    assert _sizes(split_stages(32, 4)) == [8, 8, 9, 7]
    assert _sizes(split_stages(32, 4, embed_weight=0, head_weight=0)) == [8, 8, 8, 8]
    # An expensive lm_head (large vocabulary) moves layers off the last stage.
    assert _sizes(split_stages(16, 4, embed_weight=0, head_weight=4)) == [5, 5, 5, 1]
    for layers, stages in [(4, 1), (7, 3), (16, 4), (80, 8), (126, 16), (5, 5)]:
        ranges = split_stages(layers, stages)
        assert ranges[0].start == 0 and ranges[-1].stop == layers
        assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
        assert all(len(r) >= 1 for r in ranges)


def test_split_stages_override_and_errors():
    assert split_stages(6, 3, layers_per_stage=[1, 3, 2]) == [range(0, 1), range(1, 4), range(4, 6)]
    with pytest.raises(PipelineConfigError, match="at least 5 decoder layers"):
        split_stages(4, 5)
    for bad in ([2, 2], [2, 2, 1], [0, 3, 3], [2.0, 2, 2]):
        with pytest.raises(PipelineConfigError, match="layers_per_stage"):
            split_stages(6, 3, layers_per_stage=bad)
    with pytest.raises(PipelineConfigError, match="head_weight"):
        split_stages(8, 2, head_weight=-1)
    with pytest.raises(PipelineConfigError, match="num_stages"):
        split_stages(8, 0)


def test_stage_indices_for_rank():
    assert [stage_indices_for_rank(r, 2, 1) for r in range(2)] == [[0], [1]]
    assert [stage_indices_for_rank(r, 4, 2) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_indices_for_rank(r, 2, 2, "v") for r in range(2)] == [[0, 3], [1, 2]]
    with pytest.raises(PipelineConfigError, match="exactly 2"):
        stage_indices_for_rank(0, 2, 3, "v")
    with pytest.raises(PipelineConfigError, match="outside"):
        stage_indices_for_rank(2, 2, 1)


def test_validate_microbatches_errors():
    validate_microbatches("1F1B", 4, pp=4, stages_per_rank=1)
    with pytest.raises(PipelineConfigError, match=r"n_microbatches >= 4"):
        validate_microbatches("1F1B", 3, pp=4, stages_per_rank=1)
    with pytest.raises(PipelineConfigError, match=r"nearby valid values: \[3, 4, 6\]"):
        validate_microbatches("Interleaved1F1B", 5, pp=2, stages_per_rank=2)
    with pytest.raises(PipelineConfigError, match="one stage per rank"):
        validate_microbatches("GPipe", 4, pp=2, stages_per_rank=2)
    with pytest.raises(PipelineConfigError, match="exactly 2 stages per rank"):
        validate_microbatches("ZBVZeroBubble", 4, pp=2, stages_per_rank=3)
    with pytest.raises(PipelineConfigError, match="positive integer"):
        validate_microbatches("GPipe", 0, pp=2, stages_per_rank=1)
    with pytest.raises(PipelineConfigError, match="Unknown pipeline schedule"):
        validate_microbatches("PipeDream", 4, pp=2, stages_per_rank=1)


def test_ideal_bubble_fraction():
    assert ideal_bubble_fraction(2, 1) == pytest.approx(0.5)
    assert ideal_bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert ideal_bubble_fraction(4, 8, stages_per_rank=2) == pytest.approx(3 / 19)


# ---------------------------------------------------------------- stage modules in one process


def _tiny(tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


def _padded_batch(vocab: int = 128):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, :2] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[3, :4] = -100
    return ids, mask, labels


@pytest.mark.parametrize("with_position_ids", [False, True])
def test_chained_stages_equal_the_model(with_position_ids):
    model = _tiny()
    ids, mask, labels = _padded_batch()
    # Two packed sequences per row exercise explicit position ids.
    pos = torch.cat([torch.arange(6), torch.arange(4)]).expand(4, -1) if with_position_ids else None
    ref = model(input_ids=ids, attention_mask=mask, labels=labels, position_ids=pos)
    ranges = split_stages(4, 3)
    stages = [build_stage_module(model, i, 3, r) for i, r in enumerate(ranges)]

    def run(rows: slice, **last_stage_kwargs) -> torch.Tensor:
        hidden = ids[rows]
        for stage in stages:
            hidden = stage(hidden, attention_mask=mask[rows], position_ids=None if pos is None else pos[rows],
                           **(last_stage_kwargs if stage is stages[-1] else {}))
        return hidden

    torch.testing.assert_close(run(slice(None)), ref.logits, rtol=0, atol=0)
    target = shift_labels(labels)
    # Micro-batch shares (the last stage's token sum, over sequence chunks of 3 / batch token count) add up to
    # HF's mean over real tokens.
    stages[-1].loss_chunk_size = 3
    n = int((target != -100).sum())
    shares = [token_sum_loss(run(slice(i, i + 2), loss_target=target[i:i + 2]), target[i:i + 2], n) for i in (0, 2)]
    torch.testing.assert_close(sum(shares), ref.loss, rtol=1e-6, atol=0)


def test_stage_names_cover_the_state_dict():
    for tied in (False, True):
        model = _tiny(tied)
        ranges = split_stages(4, 2)
        names = set()
        for i in range(2):
            stage = build_stage_module(model, i, 2, ranges[i])
            names |= {stage.original_name(k) for k in stage.state_dict()}
            assert [int(k) for k in stage.layers] == list(ranges[i]) == [m.self_attn.layer_idx
                                                                         for m in stage.decoder_layers]
        assert names == set(model.state_dict())


def test_stage_names_under_peft():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny(), LoraConfig(r=2, target_modules=["q_proj"]))
    last = build_stage_module(model, 1, 2, range(2, 4))
    names = {last.original_name(k) for k in last.state_dict()}
    assert "base_model.model.model.layers.2.self_attn.q_proj.lora_A.default.weight" in names
    assert names <= set(model.state_dict())
    assert {n for n, p in last.named_parameters() if p.requires_grad} == {
        f"layers.{i}.self_attn.q_proj.lora_{ab}.default.weight" for i in (2, 3) for ab in "AB"}


def test_build_stage_module_errors():
    model = _tiny()
    with pytest.raises(PipelineModelError, match="inside the model's 4 decoder layers"):
        build_stage_module(model, 0, 2, range(3, 6))
    with pytest.raises(PipelineModelError, match="outside the 2 pipeline stages"):
        build_stage_module(model, 2, 2, range(0, 2))
    with pytest.raises(PipelineModelError, match="not a HF causal LM"):
        build_stage_module(torch.nn.Linear(2, 2), 0, 2, range(0, 1))


# ---------------------------------------------------------------- torch's rules under a fake process group


def _torch_accepts(schedule: str, n: int, pp: int, spr: int, group) -> bool:
    import torch.distributed.pipelining as pipelining

    stages = [pipelining.PipelineStage(torch.nn.Linear(2, 2), i, pp * spr, torch.device("cpu"), group=group)
              for i in range(spr)]
    cls = getattr(pipelining, SCHEDULES[schedule])
    try:
        cls(stages if spr > 1 or schedule not in ("GPipe", "1F1B") else stages[0], n, loss_fn=torch.nn.MSELoss())
    except ValueError:
        return False
    return True


def test_microbatch_rules_match_torch():
    with fake_world(4):
        for pp in (2, 3, 4):
            group = dist.new_group(list(range(pp)))
            for schedule in SCHEDULES:
                for spr in {"GPipe": [1], "1F1B": [1], "ZBVZeroBubble": [2]}.get(schedule, [1, 2, 3]):
                    for n in range(1, 13):
                        try:
                            validate_microbatches(schedule, n, pp, spr)
                            ours = True
                        except PipelineConfigError:
                            ours = False
                        assert ours == _torch_accepts(schedule, n, pp, spr, group), (schedule, pp, spr, n)


def test_runner_layout_and_errors():
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(2):
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard", "pp"))
        runner = PipelineRunner(_tiny(), mesh["pp"], schedule="Interleaved1F1B", n_microbatches=2)
        assert runner.stage_indices == [0, 2] and runner.has_first_stage and not runner.has_last_stage
        assert [s.layer_range for s in runner.stages] == [range(0, 1), range(2, 3)]
        assert [n for n, _ in runner.named_parameters()][0] == "model.embed_tokens.weight"
        v = PipelineRunner(_tiny(True), mesh["pp"], schedule="ZBVZeroBubble", n_microbatches=2)
        assert v.stage_indices == [0, 3] and v.has_last_stage
        assert len(list(v.parameters())) == len({id(p) for s in v.stages for p in s.parameters()})
        ids, mask, labels = _padded_batch()
        with pytest.raises(PipelineConfigError, match="not a multiple of n_microbatches=3"):
            PipelineRunner(_tiny(), mesh["pp"], schedule="GPipe", n_microbatches=3).step(ids, labels, mask)
        with pytest.raises(PipelineConfigError, match="n_microbatches >= 2"):
            PipelineRunner(_tiny(), mesh["pp"], schedule="1F1B", n_microbatches=1)
        with pytest.raises(PipelineConfigError, match="at least 6 decoder layers"):
            PipelineRunner(_tiny(), mesh["pp"], schedule="Interleaved1F1B", stages_per_rank=3)
        with pytest.raises(PipelineModelError, match="share the tied embedding"):
            PipelineRunner(_tiny(True), mesh["pp"], schedule="ZBVZeroBubble", parallelize=lambda stage: stage)
        with pytest.raises(PipelineConfigError, match="1-D pipeline sub-mesh"):
            PipelineRunner(_tiny(), mesh, schedule="1F1B")


# ---------------------------------------------------------------- FSDP2 on pipeline stages


def _layers_reshard_after_forward(module: torch.nn.Module) -> list[bool]:
    """For each decoder layer FSDP2 made a unit of: whether it frees its gathered parameters after forward (FSDP2
    keeps a post-forward mesh only for units that reshard)."""
    from torch.distributed.fsdp import fully_shard
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return [fully_shard.state(m)._fsdp_param_group.post_forward_mesh_info is not None
            for m in module.modules() if isinstance(m, LlamaDecoderLayer)]


@pytest.mark.parametrize("name", ["pp", "3d"])
def test_pipeline_stages_keep_their_layers_gathered_through_the_step(name):
    """gpu-readiness C15: the shipped YAMLs say fsdp_reshard_after_forward: true, which holds for the layers of an
    unpipelined model; on pipeline stages every micro-batch's backward would all-gather each layer again, so stages
    never reshard after forward (torchtitan's rule under pipelining)."""
    from hfdist.config.ladder import load_rung
    from hfdist.models.build import meta_model
    from hfdist.parallel.parallelize import parallelize

    rung = load_rung(name)
    assert rung.fsdp.reshard_after_forward and rung.uses_pipeline  # what the YAML asks for
    with fake_world(rung.num_processes):
        model = parallelize(meta_model("llama-tiny", vocab_size=1024), rung, device=torch.device("cpu"),
                            mixed_precision="bf16", activation_checkpointing=False)
        flags = [f for stage in model.runner.stages for f in _layers_reshard_after_forward(stage)]
    assert flags and not any(flags)
    flat = load_rung("fsdp_full_shard")
    with fake_world(flat.num_processes):
        model = parallelize(meta_model("llama-tiny", vocab_size=1024), flat, device=torch.device("cpu"),
                            mixed_precision="no", activation_checkpointing=False)
        assert all(_layers_reshard_after_forward(model))  # without stages the YAML's setting stands
