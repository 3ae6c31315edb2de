"""Tensor parallelism in one process: validation and the plan as pure data, the loss against HF's own, apply_tp's
layouts and refusals under a fake process group. (The 4-rank gloo training runs are in
tests/integration/test_tensor_parallel.py.)
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from hfdist.models.build import build_model
from hfdist.models.loss import count_loss_tokens
from hfdist.models.presets import load_config
from hfdist.models.registry import LORA_TARGETS, REGISTRY
from hfdist.parallel.tensor import (
    TPError,
    apply_tp,
    tp_causal_lm_loss,
    tp_plan,
    valid_tp_degrees,
    validate_tp,
)
from hfdist.parallel.tensor_styles import GatherSequence, LocalLinear, LocalNorm, LocalResidual, ReduceOutput

from helpers import fake_world

# ---------------------------------------------------------------- pure: validation and the plan


@pytest.mark.parametrize("preset,tps", [("llama-tiny", [1, 2]), ("llama-small", [1, 2, 4]),
                                        ("llama-3.1-8b", [1, 2, 4, 8]), ("llama-3.1-70b", [8])])
def test_validate_tp_accepts_presets(preset, tps):
    config = load_config(preset, vocab_size=1024)
    for tp in tps:
        validate_tp(config, tp)
        assert tp in valid_tp_degrees(config)


def test_validate_tp_names_sizes_and_working_degrees():
    config = load_config("llama-tiny", vocab_size=1024)  # heads 4, kv heads 2, intermediate 256, hidden 64
    with pytest.raises(TPError) as err:
        validate_tp(config, 4 * 2)
    msg = str(err.value)
    assert "tp=8" in msg and "num_attention_heads=4" in msg and "num_key_value_heads=2" in msg
    assert "intermediate_size=256" in msg and "vocab_size=1024" in msg  # every size is listed ...
    assert "does not divide num_attention_heads=4, num_key_value_heads=2." in msg  # ... the failing ones named
    assert "would work: [1, 2]" in msg
    assert "pad_to_multiple_of" not in msg  # the vocabulary is fine here

    config.num_key_value_heads = 1  # multi-query attention: kv heads cannot be split at all
    with pytest.raises(TPError, match=r"does not divide num_key_value_heads=1\. .*would work: \[1\]"):
        validate_tp(config, 2)


def test_validate_tp_vocab_hint_and_bad_degree():
    config = load_config("llama-tiny", vocab_size=1001)
    with pytest.raises(TPError, match=r"vocab_size=1001.*pad_to_multiple_of=2"):
        validate_tp(config, 2)
    assert valid_tp_degrees(config) == [1]
    with pytest.raises(TPError, match="positive integer"):
        validate_tp(config, 0)


def test_plan_is_data_with_megatron_layout():
    plan = tp_plan(REGISTRY["llama"])
    layer = "model.layers.*"
    for name in REGISTRY["llama"].colwise:  # local tensors, column-split weights
        style = plan[f"{layer}.{name}"]
        assert type(style) is LocalLinear and style.split == 0 and style.reduce_to is None
    for name in REGISTRY["llama"].rowwise:
        style = plan[f"{layer}.{name}"]
        assert type(style) is LocalLinear and style.split == 1 and style.reduce_to == Shard(1)  # reduce-scatter
    for norm in (f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm", "model.norm"):
        assert type(plan[norm]) is LocalNorm and plan[norm].weight_grad == (Partial(),)  # 1/tp of the tokens
    # Local tensors inside a layer, a DTensor between layers; attention and MLP gather the sequence.
    assert type(plan[layer]) is LocalResidual and plan[layer].residual == Shard(1)
    assert all(type(plan[f"{layer}.{block}"]) is GatherSequence for block in ("self_attn", "mlp"))
    assert plan["lm_head"].output_layouts == (Shard(-1),) and not plan["lm_head"].use_local_output
    assert type(plan["model.embed_tokens"]) is ColwiseParallel  # untied: hidden-split, gradient stays sharded

    plain = tp_plan(REGISTRY["llama"], sequence_parallel=False, loss_parallel=False, tied_embeddings=True)
    assert plain[f"{layer}.self_attn.o_proj"].reduce_to == Replicate()  # all-reduce without SP
    assert type(plain["model.norm"]) is LocalNorm and plain["model.norm"].weight_grad == (Replicate(),)
    assert plain["lm_head"].output_layouts == (Replicate(),) and plain["lm_head"].use_local_output
    assert type(plain["model.embed_tokens"]) is RowwiseParallel  # tied: shares lm_head's vocab split


def test_plan_splits_lora_adapters_like_their_base():
    plan = tp_plan(REGISTRY["llama"], lora_targets=frozenset({"q_proj", "o_proj"}))
    q, o = "model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.o_proj"
    assert q not in plan  # the wrapper of a colwise base needs no style: its parts do the splitting
    parts = ("base_layer", "lora_A.*", "lora_B.*")
    assert all(type(plan[f"{path}.{part}"]) is LocalLinear for path in (q, o) for part in parts)
    # Column-split base: A replicated, B split like the base's outputs; nothing reduced inside.
    assert [plan[f"{q}.{part}"].split for part in parts] == [0, None, 0]
    # Row-split base: A split like the base's inputs, B replicated; base + adapter reduced once, by the wrapper.
    assert [plan[f"{o}.{part}"].split for part in parts] == [1, 1, None]
    assert all(plan[f"{o}.{part}"].reduce_to is None for part in parts)
    assert type(plan[o]) is ReduceOutput and plan[o].reduce_to == Shard(1)  # the sum leaves as a local shard
    k = plan["model.layers.*.self_attn.k_proj"]
    assert type(k) is LocalLinear and k.split == 0  # not a LoRA target: unchanged


# ---------------------------------------------------------------- one process: the loss is HF's loss


def _batch(vocab: int = 1024) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :5] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_loss_equals_hf_loss_and_global_normaliser():
    """Same shift, -100 handling and reduction as LlamaForCausalLM's own loss, also with num_items_in_batch."""
    model = build_model("llama-tiny", vocab_size=1024, seed=0)
    batch = _batch()
    n = count_loss_tokens(batch["labels"])
    assert n == int((batch["labels"][:, 1:] != -100).sum()) == 3 * 11 - 4 - 4
    with torch.no_grad():
        assert tp_causal_lm_loss(model, batch).item() == pytest.approx(model(**batch).loss.item(), rel=1e-6)
        ours = tp_causal_lm_loss(model, batch, num_items_in_batch=2 * n).item()
        assert ours == pytest.approx(model(**batch, num_items_in_batch=2 * n).loss.item(), rel=1e-6)
        assert ours == pytest.approx(tp_causal_lm_loss(model, batch).item() / 2, rel=1e-6)


# ---------------------------------------------------------------- apply_tp under a fake process group


def test_apply_tp_shards_heads_and_refuses_misuse():
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        model = apply_tp(build_model("llama-tiny", vocab_size=1024), mesh["tp"])
        attn = model.model.layers[0].self_attn
        # heads/tp query heads and kv_heads/tp kv heads per rank (head_dim 16): 4/2 * 16 and 2/2 * 16 rows.
        assert attn.q_proj.weight.to_local().shape == (32, 64) and attn.k_proj.weight.to_local().shape == (16, 64)
        assert attn.o_proj.weight.to_local().shape == (64, 32)
        with pytest.raises(TPError, match="must run once"):
            apply_tp(model, mesh["tp"])
        with pytest.raises(TPError, match="1-D tensor-parallel sub-mesh"):
            apply_tp(build_model("llama-tiny", vocab_size=1024), mesh)
        with pytest.raises(TPError, match="tp=2 cannot split"):
            apply_tp(build_model("llama-tiny", vocab_size=1001), mesh["tp"])

        base = build_model("llama-tiny", vocab_size=1024)
        with pytest.raises(TPError, match="LoRA on lm_head"):
            apply_tp(get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "lm_head"])), mesh["tp"])
        base = build_model("llama-tiny", vocab_size=1024)
        with pytest.raises(TPError, match="other than plain LoRA"):
            apply_tp(get_peft_model(base, LoraConfig(r=2, target_modules=["v_proj"], use_dora=True)), mesh["tp"])
        base = build_model("llama-tiny", vocab_size=1024)
        with pytest.raises(TPError, match="LoRA dropout > 0.*lora_dropout=0"):
            apply_tp(get_peft_model(base, LoraConfig(r=2, target_modules=["v_proj"], lora_dropout=0.1)), mesh["tp"])
        base = build_model("llama-tiny", vocab_size=1024)
        lora = get_peft_model(base, LoraConfig(r=2, target_modules=list(LORA_TARGETS), layers_to_transform=[0, 1]))
        with pytest.raises(TPError, match="differ between decoder layers"):
            apply_tp(lora, mesh["tp"])
