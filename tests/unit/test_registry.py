"""The model-facts registry: every registered architecture is described right, others are refused by name, and
the surgery that reads the facts (TP plan, pipeline stages, FSDP unit) follows them.

One process; simulated ranks through a fake process group.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial

from hfdist.models.build import build_model
from hfdist.models.presets import PRESETS, load_config
from hfdist.models.registry import REGISTRY, UnsupportedModelError, facts_for, is_supported
from hfdist.parallel.fsdp import fsdp_unit_class
from hfdist.parallel.pipeline.plan import split_stages
from hfdist.parallel.pipeline.stage import build_stage_module
from hfdist.parallel.tensor import apply_tp, tp_plan
from hfdist.parallel.tensor_styles import LocalNorm

from helpers import fake_world

TINY = ["llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny", "smollm3-tiny"]


@pytest.mark.parametrize("preset", TINY)
def test_facts_name_the_real_modules(preset):
    """Layer class, projection shapes and biases, head norms: read off a built model of each architecture."""
    model = build_model(preset)
    facts = facts_for(model)
    layer = model.model.layers[0]
    assert type(layer).__name__ == facts.decoder_layer == fsdp_unit_class(model)
    for short, (n_in, n_out, bias) in facts.linear_shapes(model.config).items():
        linear = next(m for n, m in layer.named_modules() if n.endswith(short))
        assert (linear.in_features, linear.out_features, linear.bias is not None) == (n_in, n_out, bias), short
    for norm in facts.head_norms:
        assert layer.get_submodule(norm).weight.shape == (facts.head_dim(model.config),)
    assert facts.lora_targets == ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj", "down_proj")
    assert PRESETS[preset].model_type == facts.model_type


def test_unknown_architecture_is_refused_by_name():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError,
                       match=r"'gpt2' has none: hfdist supports llama, mistral, qwen2, qwen3, smollm3"):
        facts_for(GPT2Config(), "Tensor parallelism")
    assert not is_supported(GPT2Config()) and is_supported(load_config("qwen3-tiny"))


@pytest.mark.parametrize("model_type", sorted(REGISTRY))
def test_tp_split_is_transformers_plan(model_type):
    """The column / row split and the per-head norms are read from transformers' base_model_tp_plan, never
    restated: each decoder-layer entry of the config class's plan (an MoE architecture's attention entries) has
    exactly its role in hfdist's facts."""
    from transformers import CONFIG_MAPPING

    from hfdist.models.registry import _plan_in_source

    plan = CONFIG_MAPPING[model_type].base_model_tp_plan
    assert _plan_in_source(model_type) == plan  # what the torch-free read finds is the class's own plan
    facts = REGISTRY[model_type]
    assert REGISTRY[model_type].tp_plan is None  # no entry restates it
    if facts.moe is not None:  # the attention's part: the MLP is the MoE facts' to describe
        plan = {key: style for key, style in plan.items() if key.startswith("layers.*.self_attn.")}
    roles = {"colwise": facts.colwise, "rowwise": facts.rowwise, "replicated_with_grad_allreduce": facts.head_norms}
    assert {f"layers.*.{path}": style for style, paths in roles.items() for path in paths} == plan


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "mixtral-tiny", "llama4-tiny"])
def test_moe_entries_name_their_real_decoder_layers(preset):
    """The decoder-layer class (transformers' _no_split_modules) is the class of the model's layers, MoE ones too."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(preset))
    assert {type(layer).__name__ for layer in model.model.layers} == {facts_for(model).decoder_layer}


def test_llama_split_and_qwen3_head_norms():
    assert REGISTRY["llama"].colwise == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                         "mlp.gate_proj", "mlp.up_proj")
    assert REGISTRY["llama"].rowwise == ("self_attn.o_proj", "mlp.down_proj")
    assert REGISTRY["qwen3"].head_norms == ("self_attn.q_norm", "self_attn.k_norm")
    assert REGISTRY["llama"].head_norms == ()


def test_a_plan_style_hfdist_does_not_implement_is_refused():
    """Olmo2's plan gathers q/k/v outputs (colwise_gather_output) for its norm over all heads: hfdist's TP does not
    do that layout, and an entry following transformers' plan says so by name instead of splitting wrongly."""
    from hfdist.models.registry import ModelFacts

    with pytest.raises(UnsupportedModelError, match=r"olmo2 TP plan uses colwise_gather_output, rowwise_split_input"):
        ModelFacts("olmo2").colwise
    assert ModelFacts("olmo2", tp_plan={"mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}).linears == (
        "mlp.up_proj", "mlp.down_proj")


def test_projections_an_architecture_lacks_are_not_counted():
    """Apertus has no gate_proj (its plan lists up / down only): its shapes and LoRA targets leave it out."""
    from hfdist.models.registry import ModelFacts

    facts = ModelFacts("apertus")
    assert facts.head_norms == ("self_attn.q_norm", "self_attn.k_norm")
    assert "gate_proj" not in facts.linear_shapes(load_config("llama-tiny")) and "gate_proj" not in facts.lora_targets


def test_sliding_windows_follow_the_config():
    mistral = load_config("mistral-tiny")
    assert REGISTRY["mistral"].mask_kinds(mistral) == ["sliding_attention"] * 4
    mistral.sliding_window = None
    assert REGISTRY["mistral"].mask_kinds(mistral) == ["full_attention"] * 4
    qwen2 = load_config("qwen2-tiny")
    qwen2.layer_types = ["full_attention", "sliding_attention"] * 2
    assert REGISTRY["qwen2"].mask_kinds(qwen2) == qwen2.layer_types
    assert REGISTRY["llama"].mask_kinds(load_config("llama-tiny")) == ["full_attention"] * 4
    smollm3 = load_config("smollm3-tiny")
    smollm3.use_sliding_window, smollm3.sliding_window = True, 16
    smollm3.layer_types = None
    smollm3.__post_init__()  # SmolLM3's rule: its no-rope layers slide
    assert REGISTRY["smollm3"].mask_kinds(smollm3) == ["full_attention"] * 3 + ["sliding_attention"]


def test_qwen3_plan_splits_head_norms_over_heads():
    plan = tp_plan(facts_for(load_config("qwen3-tiny")))
    for norm in ("self_attn.q_norm", "self_attn.k_norm"):
        style = plan[f"model.layers.*.{norm}"]
        # Computed on the rank's heads; the replicated weight's gradient is a partial sum over tp.
        assert type(style) is LocalNorm and style.weight_grad == (Partial(),)
    assert not any("q_norm" in key for key in tp_plan(REGISTRY["llama"]))


@pytest.mark.parametrize("preset", ["mistral-tiny", "qwen2-tiny", "qwen3-tiny", "smollm3-tiny"])
def test_apply_tp_splits_every_architecture(preset):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = apply_tp(build_model(preset), mesh["tp"])
        attn = model.model.layers[0].self_attn
        facts = facts_for(model)
        head_dim, heads, kv = facts.head_dim(model.config), model.config.num_attention_heads, \
            model.config.num_key_value_heads
        assert attn.q_proj.weight.to_local().shape[0] == heads * head_dim // 2
        assert attn.k_proj.weight.to_local().shape[0] == kv * head_dim // 2
        if facts.qkv_bias:
            assert attn.q_proj.bias.to_local().shape == (heads * head_dim // 2,)
        assert all(isinstance(p, DTensor) for p in model.parameters())


@pytest.mark.parametrize("preset", ["mistral-tiny", "qwen2-tiny", "qwen3-tiny", "smollm3-tiny"])
def test_chained_stages_equal_the_model_with_sliding_layers(preset):
    """Pipeline stages rebuild each layer's own mask kind: a model with sliding-window layers (a window shorter
    than the sequence) gives the same logits split into stages as whole."""
    config = load_config(preset)
    if preset == "mistral-tiny":
        config.sliding_window = 4
    else:
        config.use_sliding_window, config.sliding_window = True, 4
        config.layer_types = ["full_attention", "sliding_attention"] * 2
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        ranges = split_stages(4, 2)
        hidden = ids
        for i, layers in enumerate(ranges):
            hidden = build_stage_module(model, i, 2, layers)(hidden)
        window_free = AutoModelForCausalLM.from_config(load_config(preset))
        window_free.load_state_dict(model.state_dict())
        full = window_free.eval()(input_ids=ids).logits
    torch.testing.assert_close(hidden, ref, rtol=0, atol=0)
    assert not torch.allclose(full, ref)  # the window really changed the result, so the stages honoured it
