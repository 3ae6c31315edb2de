"""Weights in and out, in one process: the seeded init, loading a checkpoint slice-wise through DCP, the streamed
HF checkpoint writer, the refusal of a checkpoint folder without safetensors.

The multi-rank behaviour (each rank fills / sends only its shards) is exercised end to end in
tests/e2e/test_scale_memory.py; here the single-process semantics are pinned down against transformers and peft.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hfdist.checkpoint.hf_export import save_hf_checkpoint
from hfdist.models.build import build_model, check_checkpoint_weights, inject_lora, materialize, meta_model
from hfdist.models.init import initial_values
from hfdist.models.load import load_weights, weight_plan
from hfdist.models.presets import ModelSpecError

VOCAB = 1024


def _tiny_checkpoint(folder, tied: bool = False, dtype=torch.bfloat16):
    """A tiny Llama saved as HF ships models: bf16 safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                  tie_word_embeddings=tied)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(folder)
    return folder


def _lora_model(spec="llama-tiny"):
    model = inject_lora(meta_model(spec, VOCAB), r=4, alpha=8)
    plan = weight_plan(model, None, seed=0)
    materialize(model, torch.device("cpu"))
    load_weights(dict(model.named_parameters()), plan)
    return model


def test_seeded_init_follows_transformers_and_peft():
    model = _lora_model()
    attn = model.base_model.model.model.layers[0].self_attn.q_proj
    assert attn.lora_B.default.weight.abs().max() == 0  # peft: B starts at zero, so the adapter starts as a no-op
    bound = 1 / math.sqrt(attn.lora_A.default.weight.shape[1])  # kaiming_uniform(a=sqrt(5)) = 1/sqrt(fan_in)
    assert 0.9 * bound < attn.lora_A.default.weight.abs().max() <= bound
    base = model.get_base_model()
    assert torch.equal(base.model.norm.weight, torch.ones_like(base.model.norm.weight))
    assert base.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.05)  # initializer_range
    assert base.model.rotary_emb.inv_freq[1] == pytest.approx(10000 ** (-2 / 16))  # buffers as built


def test_seeded_init_is_a_function_of_seed_and_name_only():
    rule = weight_plan(meta_model("llama-tiny", VOCAB), None, 0).tensors["model.embed_tokens.weight"].rule
    a = initial_values("model.embed_tokens.weight", (VOCAB, 64), rule, seed=0)
    assert torch.equal(a, initial_values("model.embed_tokens.weight", (VOCAB, 64), rule, seed=0))
    assert not torch.equal(a, initial_values("model.embed_tokens.weight", (VOCAB, 64), rule, seed=1))
    assert not torch.equal(a, initial_values("lm_head.weight", (VOCAB, 64), rule, seed=0))


def test_a_lora_run_starts_from_the_preset_base():
    """The base under LoRA adapters is the preset without them, so PeftModel.from_pretrained(build_model(preset),
    adapter) reproduces a LoRA run."""
    plain = dict(build_model("llama-tiny", VOCAB, seed=0).named_parameters())
    lora = _lora_model()
    for name, p in lora.named_parameters():
        if "lora_" not in name:
            key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(p, plain[key]), name


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_checkpoint_loads_into_fp32_as_from_pretrained(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    folder = _tiny_checkpoint(tmp_path / "ckpt", tied=tied)
    ours = build_model(str(folder))
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    assert ours_state.keys() == theirs_state.keys()
    for key, value in theirs_state.items():
        assert torch.equal(ours_state[key], value), key
    if tied:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_an_incomplete_checkpoint_is_refused(tmp_path):
    folder = _tiny_checkpoint(tmp_path / "ckpt")
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        weight_plan(meta_model(str(folder)), folder, seed=0)


def test_a_checkpoint_folder_without_safetensors_is_refused(tmp_path):
    folder = _tiny_checkpoint(tmp_path / "ckpt")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ModelSpecError, match="without safetensors.*pytorch_model.bin"):
        check_checkpoint_weights(str(folder))
    check_checkpoint_weights("llama-tiny")  # presets and complete folders pass
    check_checkpoint_weights(str(_tiny_checkpoint(tmp_path / "ok")))


def test_streamed_checkpoint_is_what_save_pretrained_writes(tmp_path):
    """One process: the writer's output loads with from_pretrained to the very tensors, in fp32, with the config;
    split into shards with an index above max_shard_bytes, as save_pretrained does."""
    from transformers import AutoModelForCausalLM

    model = build_model("llama-tiny", VOCAB, seed=0)
    for name, shard_bytes in (("one", 10**12), ("many", 300_000)):
        save_hf_checkpoint(tmp_path / name, meta_model("llama-tiny", VOCAB), dict(model.named_parameters()),
                           max_shard_bytes=shard_bytes)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        assert loaded.dtype == torch.float32
        assert json.loads((tmp_path / name / "config.json").read_text())["dtype"] == "float32"
        for key, value in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], value), key
    files = sorted(p.name for p in (tmp_path / "many").glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "many" / "model.safetensors.index.json").is_file()
    with safe_open(str(tmp_path / "one" / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_streamed_lora_adapter_loads_in_peft(tmp_path):
    from peft import PeftModel

    model = _lora_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # as if trained: a non-zero adapter
    skeleton = inject_lora(meta_model("llama-tiny", VOCAB), r=4, alpha=8)
    save_hf_checkpoint(tmp_path, skeleton, dict(model.named_parameters()), adapter_only=True)
    assert (tmp_path / "adapter_model.safetensors").is_file() and (tmp_path / "adapter_config.json").is_file()
    reloaded = PeftModel.from_pretrained(build_model("llama-tiny", VOCAB, seed=0), tmp_path)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert reloaded(input_ids=ids).logits.allclose(model(input_ids=ids).logits, atol=1e-6)


def test_a_saved_tensor_counts_as_freed_only_when_its_last_reference_goes():
    """The streamed save waits on this before making the next full tensor: a view (as a gloo worker thread keeps of
    a collective's buffer for a moment after the call returns) keeps the memory alive, and so the event unset."""
    from hfdist.checkpoint.hf_export import _freed

    full = torch.zeros(8)
    view = full[2:]
    freed = _freed(full)
    del full
    assert not freed.is_set()
    del view
    assert freed.wait(1.0)
