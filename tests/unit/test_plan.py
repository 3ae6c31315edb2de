"""The memory planner: exact counts, the references' figures, DeepSpeed's estimators, sharding semantics, CLI.

Pure logic (no process group, no weights): meta-device models, a tiny CPU layer for the activation count.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from hfdist.cli import main
from hfdist.config.dims import ParallelDims
from hfdist.config.ladder import known_rung_names, load_rung
from hfdist.config.rungs import RUNG_INFO
from hfdist.models.presets import load_config
from hfdist.models.shape import ModelShape
from hfdist.plan import GB, plan_rungs, predict_state_bytes
from hfdist.plan.planner import SPEED_TIE

H100 = 80 * GB


def _llama(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**kw)


def _llama2_7b():
    return _llama(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False)


def _rung(plan, name):
    return next(r for r in plan.rungs if r.name == name)


# ---------------------------------------------------------------------------------------------- parameter counts


@pytest.mark.parametrize("spec", ["llama-tiny", "llama-3.2-1b", "llama-3.1-8b", "custom", "mistral-tiny",
                                  "qwen2-tiny", "qwen3-tiny", "qwen3-tied", "smollm3-tiny", "qwen3-moe-tiny",
                                  "mixtral-tiny", "llama4-tiny", "qwen3-30b-a3b", "llama-4-scout"])
def test_param_count_matches_meta_model(spec):
    """Every registered architecture: Qwen2's q/k/v biases, Qwen3's per-head norms and separate head_dim, the MoE
    models' stacked experts, routers, shared expert and dense layers among the MoE ones."""
    from transformers import AutoModelForCausalLM

    if spec == "custom":
        config = _llama(hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
                        num_key_value_heads=2, head_dim=32, vocab_size=300, attention_bias=True, mlp_bias=True,
                        tie_word_embeddings=True)
    elif spec == "qwen3-tied":
        config = load_config("qwen3-tiny")
        config.tie_word_embeddings = True
    else:
        config = load_config(spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert ModelShape.from_config(config).total_params == sum(p.numel() for p in model.parameters())


def test_lora_param_count_matches_peft():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    config = load_config("llama-tiny")
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(
        r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = ModelShape.from_config(config)
    assert shape.layers * shape.lora_layer_params(16) == trainable


def test_non_llama_config_is_refused():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3"):
        ModelShape.from_config(GPT2Config())


# ------------------------------------------------------------------------------------------------- activations


def _saved_bytes(config, dtype, autocast=False, checkpoint=False, batch=2, seq=48):
    """Bytes of the distinct non-parameter tensors autograd saves for one decoder layer (seq x batch = 96 tokens
    matches no weight dimension, so autocast's saved bf16 weight casts are told apart by shape)."""
    from torch.utils.checkpoint import checkpoint as ckpt
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).to(torch.float32 if autocast else dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {s for p in model.parameters() for s in (tuple(p.shape), tuple(p.shape)[::-1])}
    h = torch.randn(batch, seq, config.hidden_size, dtype=torch.float32 if autocast else dtype, requires_grad=True)
    cos_sin = model.model.rotary_emb(h, torch.arange(seq).unsqueeze(0).expand(batch, seq))
    shared = {t.untyped_storage().data_ptr() for t in cos_sin}  # computed once per forward, used by every layer
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in shared and tuple(t.shape) not in weight_shapes:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    layer = model.model.layers[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if checkpoint:
            ckpt(layer, h, position_embeddings=cos_sin, use_reentrant=False)
        else:
            layer(h, position_embeddings=cos_sin)
    return sum(saved.values())


def _layer_config(model_type: str):
    from transformers import AutoConfig

    extra = {"head_dim": 32} if model_type == "qwen3" else {}  # Qwen3: head_dim apart from hidden / heads (16)
    return AutoConfig.for_model(model_type, hidden_size=128, intermediate_size=352, num_hidden_layers=1,
                                num_attention_heads=8, num_key_value_heads=2, vocab_size=256, **extra)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype, elem, autocast", [(torch.bfloat16, 2, False), (torch.float32, 4, False),
                                                   (torch.bfloat16, 2, True)])
def test_layer_activation_formula_matches_autograd(dtype, elem, autocast, model_type):
    config = _layer_config(model_type)
    predicted = ModelShape.from_config(config).layer_activation_bytes(2 * 48, elem, autocast=autocast)
    assert _saved_bytes(config, dtype, autocast) == predicted


def test_checkpointed_layer_keeps_only_its_input():
    config = _llama(hidden_size=128, intermediate_size=352, num_hidden_layers=1, num_attention_heads=8,
                    num_key_value_heads=2, vocab_size=256)
    assert _saved_bytes(config, torch.bfloat16, checkpoint=True) == \
        ModelShape.from_config(config).checkpointed_layer_bytes(2 * 48, 2)


# ------------------------------------------------------------------------------------- the references' figures


def test_seed_002_7b_needs_140_gb_static_at_20_bytes_per_param():
    """002 N.1.1: ~20 B/param for mixed-precision Adam, so a 7B model needs ~140 GB before any activation and an
    80 GB H100 cannot hold it without sharding (DDP is not an option)."""
    config = _llama2_7b()
    plan = plan_rungs(config, ["ddp"], gpus_per_node=8, gpu_mem_bytes=H100, bytes_per_param_adam=20)
    params = ModelShape.from_config(config).total_params
    states = _rung(plan, "ddp").bytes.model_states
    assert states == 20 * params
    assert states == pytest.approx(140 * GB, rel=0.04)  # 6.74B params: "7B" x 20 B = 140 GB
    assert not _rung(plan, "ddp").fits


def test_seed_000_70b_fsdp_over_8_gpus_is_105_gb_per_gpu():
    """000 (FSDP card): 70B on 8 GPUs, FSDP: weights 17.5 + grads 17.5 + optimizer 70 = 105 GB per GPU (DDP: 140 +
    140 + 560 = 840 GB). The seed counts 2 B weights, 2 B grads and 8 B "optimizer" per param and no fp32 master:
    the planner's 16 B accounting without its master column."""
    config = load_config("llama-3.1-70b")
    params = ModelShape.from_config(config).total_params  # 70.55B
    plan = plan_rungs(config, ["fsdp_full_shard", "ddp"], gpus_per_node=8, gpu_mem_bytes=H100)
    fsdp, ddp = _rung(plan, "fsdp_full_shard").bytes, _rung(plan, "ddp").bytes
    assert (fsdp.weights, fsdp.grads, fsdp.optimizer) == (2 * params // 8, 2 * params // 8, 8 * params // 8)
    assert fsdp.weights + fsdp.grads + fsdp.optimizer == pytest.approx(105 * GB, rel=0.01)
    assert ddp.weights + ddp.grads + ddp.optimizer == pytest.approx(840 * GB, rel=0.01)
    assert fsdp.master == 4 * params // 8  # what the seed leaves out: 141 GB of model states per GPU in all


def test_seed_004_10b_table():
    """004: 10B in mixed precision: weights 20 + grads 20 + optimizer 80 + fp32 master 40 GB, + ~20 GB activations
    + ~10 GB temporary buffers = 190 GB (~176 GiB). (Its optimizer row reads "2 x (10B x 2 bytes)" but states 80
    GB, i.e. two fp32 moments.) The planner's per-parameter bytes reproduce the four model-state rows."""
    config = load_config("llama-3.1-8b")
    params = ModelShape.from_config(config).total_params
    ddp = _rung(plan_rungs(config, ["ddp"], gpus_per_node=1, gpu_mem_bytes=H100), "ddp").bytes
    per_param = [x / params for x in (ddp.weights, ddp.grads, ddp.master, ddp.optimizer)]
    rows = [b * 10e9 / GB for b in per_param]
    assert rows == [20, 20, 40, 80]
    assert sum(rows) + 20 + 10 == 190
    assert 190 * GB / 2**30 == pytest.approx(176.95, abs=0.01)


@pytest.mark.parametrize("gpus, nodes", [(8, 1), (8, 4), (4, 2)])
def test_zero_paper_16_bytes(gpus, nodes):
    """ZeRO (Rajbhandari et al., 004's figure, K = 12): P_os 4 + 12/N, P_os+g 2 + 14/N, P_os+g+p 16/N bytes/param."""
    config = load_config("llama-3.1-8b")
    p, n = ModelShape.from_config(config).total_params, gpus * nodes
    plan = plan_rungs(config, ["zero1", "zero2", "zero3", "fsdp_full_shard"], gpus_per_node=gpus, nodes=nodes,
                      gpu_mem_bytes=H100)
    expected = {"zero1": 4 * p + 12 * p / n, "zero2": 2 * p + 14 * p / n, "zero3": 16 * p / n,
                "fsdp_full_shard": 16 * p / n}
    for name, value in expected.items():
        assert _rung(plan, name).bytes.model_states == pytest.approx(value, abs=8)


# -------------------------------------------------------------------------------- DeepSpeed's own estimators


@pytest.fixture(scope="module")
def ds_estimators():
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as zero3
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as zero2

    return zero2, zero3


@pytest.mark.parametrize("gpus, nodes", [(8, 1), (8, 4), (2, 1)])
def test_agrees_with_deepspeed_estimators(ds_estimators, gpus, nodes):
    """At DeepSpeed's accounting (20 B/param: + fp32 grads) the GPU model states equal its estimators', and the
    gathered-parameter buffer of ZeRO-3 covers its 4 x largest-layer term."""
    zero2_est, zero3_est = ds_estimators
    config = load_config("llama-3.1-8b")
    shape = ModelShape.from_config(config)
    p = shape.total_params
    largest = shape.embed_params  # DeepSpeed's largest layer: the module with most own params (embed / lm_head)
    zero2, zero3, offload = (load_rung(n) for n in ("zero2", "zero3", "zero3_offload_cpu"))
    rungs = [zero2, replace(zero2, name="zero2_offload", offload_optimizer="cpu"), zero3,
             replace(zero3, name="zero3_offload_opt", offload_optimizer="cpu"), offload]
    plan = plan_rungs(config, rungs, gpus_per_node=gpus, nodes=nodes, gpu_mem_bytes=H100, bytes_per_param_adam=20)
    kw = dict(num_gpus_per_node=gpus, num_nodes=nodes)

    def states(name):
        return _rung(plan, name).bytes.model_states

    assert states("zero2") == pytest.approx(zero2_est(p, cpu_offload=False, **kw)[1], abs=8)
    assert states("zero2_offload") == pytest.approx(zero2_est(p, cpu_offload=True, **kw)[1], abs=8)
    for name, offload_opt, offload_params in (("zero3", False, False), ("zero3_offload_opt", True, False),
                                              ("zero3_offload_cpu", True, True)):
        _, gpu, largest_mem = zero3_est(p, largest, cpu_offload=offload_opt, cpu_offload_params=offload_params, **kw)
        assert states(name) == pytest.approx(gpu - largest_mem, abs=8)
        assert _rung(plan, name).bytes.buffers >= largest_mem
    # Everything ZeRO-3 offloads lands in the node's CPU RAM: DeepSpeed's 18 B/param per node (buffer factor 1).
    cpu, _, _ = zero3_est(p, largest, cpu_offload=True, cpu_offload_params=True, additional_buffer_factor=1, **kw)
    assert _rung(plan, "zero3_offload_cpu").bytes.offloaded * gpus == pytest.approx(cpu, rel=1e-6)


# ------------------------------------------------------------------------------------------ sharding semantics


def test_sharding_per_rung():
    config = load_config("llama-3.1-8b")
    p = ModelShape.from_config(config).total_params
    plan = plan_rungs(config, gpus_per_node=4, nodes=2, gpu_mem_bytes=H100)
    # Every shipped rung, in the rung table's plan_order (ddp, zero1, zero2, fsdp_full_shard, zero3, ..., offload last),
    # but the expert-parallel one (fsdp_ep: for MoE models only).
    assert [r.name for r in plan.rungs] == sorted((n for n in known_rung_names() if load_rung(n).dims.ep == 1),
                                                  key=lambda n: RUNG_INFO[n].plan_order)
    b = {r.name: r.bytes for r in plan.rungs}
    assert (b["ddp"].weights, b["ddp"].grads, b["ddp"].master, b["ddp"].optimizer) == (2 * p, 2 * p, 4 * p, 8 * p)
    assert b["zero1"].grads == 2 * p and b["zero1"].optimizer == 8 * p // 8
    assert b["zero2"].weights == 2 * p and b["zero2"].grads == 2 * p // 8
    assert b["fsdp_full_shard"].weights == b["zero3"].weights == 2 * p // 8
    hybrid = _rung(plan, "fsdp_hybrid")
    assert hybrid.dims == ParallelDims(dp_replicate=2, dp_shard=4)  # shard inside a node of 4, replicate over 2
    assert hybrid.bytes.weights == 2 * p // 4
    assert "parallelism_config_dp_shard_size: 4" in hybrid.note  # the YAML ships dp_shard=2
    for name in ("zero3_offload_cpu", "zero3_offload_nvme"):
        off = b[name]
        assert off.weights == off.grads == off.master == off.optimizer == 0
        assert off.offloaded == pytest.approx(16 * p / 8, abs=8)
        assert off.total == off.activations + off.buffers
    # Activations do not depend on data-parallel sharding.
    assert b["zero3"].activations == b["zero2"].activations == b["fsdp_full_shard"].activations


def test_lora_freezes_the_base():
    config = load_config("llama-3.1-8b")
    shape = ModelShape.from_config(config)
    plan = plan_rungs(config, ["ddp", "zero3"], gpus_per_node=8, gpu_mem_bytes=H100, lora=True, lora_r=8)
    lora = shape.layers * shape.lora_layer_params(8)
    assert plan.trainable_params == lora
    ddp, zero3 = _rung(plan, "ddp").bytes, _rung(plan, "zero3").bytes
    assert ddp.weights == 4 * shape.total_params + 2 * lora  # DDP keeps the frozen base in fp32
    assert (ddp.grads, ddp.master, ddp.optimizer) == (2 * lora, 4 * lora, 8 * lora)
    assert zero3.weights == 2 * (shape.total_params + lora) // 8 and zero3.optimizer == 8 * lora // 8  # bf16 cast


def test_dpo_counts_the_reference_model_sharded_like_the_policy():
    """`hfdist plan --objective dpo`: a frozen fp32 copy of the weights beside the policy (DeepSpeed: its bf16), sharded as the
    policy is; none under LoRA (the base with the adapters off); pipeline rungs cannot run it; the command is the
    job's with --objective dpo."""
    config = load_config("llama-3.1-8b")
    p = ModelShape.from_config(config).total_params
    rungs = ["ddp", "zero3", "fsdp_full_shard", "fsdp_tp", "pp"]
    kw = dict(gpus_per_node=8, gpu_mem_bytes=H100)
    plain, dpo = (plan_rungs(config, rungs, objective=objective, **kw) for objective in ("sft", "dpo"))
    extra = {r.name: _rung(dpo, r.name).bytes.weights - r.bytes.weights for r in plain.rungs if r.name != "pp"}
    assert extra["ddp"] == 4 * p and extra["zero3"] == pytest.approx(2 * p / 8, abs=1)
    assert extra["fsdp_full_shard"] == pytest.approx(4 * p / 8, abs=1)
    assert _rung(dpo, "pp").bytes is None and "pipeline stages" in _rung(dpo, "pp").note
    assert _rung(dpo, "fsdp_tp").command.startswith("accelerate launch scripts/finetune.py --config fsdp_tp.yaml")
    assert "--objective dpo" in _rung(dpo, "fsdp_tp").command
    lora = [plan_rungs(config, rungs[:-1], lora=True, objective=objective, **kw).rungs for objective in ("sft", "dpo")]
    assert [r.bytes.weights for r in lora[0]] == [r.bytes.weights for r in lora[1]]
    assert any("reference" in line for line in dpo.assumptions())


def test_grpo_counts_the_rollouts_kv_cache_or_the_steps_completion_logits():
    """`hfdist plan --objective grpo`: a rank's activations are the larger of its rollout's KV cache (its share of the
    step's completions, kv heads over tp) and the step's, the last stage's completion logits in the compute dtype and
    fp32 on top; the rungs the table refuses GRPO on are left out with its reason."""
    config = load_config("llama-3.1-8b")
    shape = ModelShape.from_config(config)
    kw = dict(gpus_per_node=8, gpu_mem_bytes=H100, seq=2048, micro_batch=1)
    sft = _rung(plan_rungs(config, ["fsdp_full_shard"], global_batch=64, **kw), "fsdp_full_shard").bytes
    grpo = plan_rungs(config, ["fsdp_full_shard", "fsdp_tp", "pp"], global_batch=64, objective="grpo",
                      completion_len=1024, generations=8, **kw)
    full = _rung(grpo, "fsdp_full_shard")
    kv = 8 * 2048 * shape.layers * 2 * shape.kv_heads * shape.head_dim * 2  # 64 completions over 8 dp ranks, bf16
    logits = 1 * 1024 * shape.vocab * (2 + 4)
    assert full.bytes.activations == max(sft.activations + logits, kv)
    assert "--objective grpo --num-generations 8 --max-completion-length 1024" in full.command
    once = _rung(plan_rungs(config, ["fsdp_full_shard"], global_batch=64, objective="grpo", completion_len=1024,
                            generations=8, rollout_gather="once", **kw), "fsdp_full_shard")
    params = shape.total_params  # one stage, no tp: the whole model gathered in bf16 beside the rollout's cache
    assert once.bytes.activations == max(sft.activations + logits, kv + 2 * params)
    assert "--max-completion-length 1024 --rollout-gather once" in once.command
    for refused in ("fsdp_tp", "pp"):
        assert _rung(grpo, refused).bytes is None and "--objective grpo does not run" in _rung(grpo, refused).note
    assert any("GRPO: the larger of the rollout" in line for line in grpo.assumptions())


def test_activation_checkpointing_and_batch_scale_activations():
    config = load_config("llama-3.1-8b")
    shape = ModelShape.from_config(config)
    kw = dict(gpus_per_node=8, gpu_mem_bytes=H100)
    full = _rung(plan_rungs(config, ["fsdp_full_shard"], seq=4096, **kw), "fsdp_full_shard").bytes.activations
    ckpt = _rung(plan_rungs(config, ["fsdp_full_shard"], seq=4096, activation_checkpointing=True, **kw),
                 "fsdp_full_shard").bytes.activations
    tokens = 4096
    head = shape.head_activation_bytes(tokens, 2, logit_tokens=512)  # one chunk of the chunked loss
    assert full == shape.layers * shape.layer_activation_bytes(tokens, 2) + head
    # With recompute the head's tensors are freed before backward recomputes a layer: the larger of the two counts.
    assert ckpt == shape.layers * tokens * 2 * shape.hidden + max(shape.layer_activation_bytes(tokens, 2), head)
    assert shape.layer_activation_bytes(tokens, 2) / (tokens * shape.hidden) == pytest.approx(49, abs=0.1)
    double = _rung(plan_rungs(config, ["fsdp_full_shard"], seq=4096, micro_batch=2, **kw), "fsdp_full_shard")
    assert double.bytes.activations == pytest.approx(2 * full, rel=1e-6)
    # Final norm, lm_head's input, the fused loss's hidden-state gradient; one chunk's fp32 logits and the bf16
    # copy of their gradient (the fused loss's matmul operand).
    assert head == tokens * (4 * 4096 + 2 * 4096 + 2 * 4096 + 2 * 4096) + 512 * (4 + 2) * 128256


@pytest.mark.parametrize("rung, tp, micro_batch", [("fsdp_full_shard", 1, 1), ("fsdp_full_shard", 1, 2),
                                                   ("fsdp_tp", 2, 1)])
def test_chunked_loss_counts_one_chunk_of_logits(rung, tp, micro_batch):
    """The planner counts B x chunk x V x 6 bytes (bf16: fp32 logits and the bf16 copy of their gradient, per tp
    rank) instead of B x S x V x 6; with the loss unchunked (loss_chunk_size=None, --loss-chunk-size 0) the whole
    batch's."""
    config = load_config("llama-3.1-8b")
    kw = dict(gpus_per_node=8, gpu_mem_bytes=H100, seq=4096, micro_batch=micro_batch)
    chunked = _rung(plan_rungs(config, [rung], **kw), rung).bytes.activations
    whole = _rung(plan_rungs(config, [rung], loss_chunk_size=None, **kw), rung).bytes.activations
    assert whole - chunked == micro_batch * (4096 - 512) * 128256 * 6 // tp
    bigger = _rung(plan_rungs(config, [rung], loss_chunk_size=8192, **kw), rung).bytes.activations
    assert bigger == whole  # a chunk longer than the sequence is the whole sequence


def test_tensor_and_pipeline_rungs_are_planned_generically():
    """Rungs of any degrees are planned by the same accounting; pinned degrees are planned as given, and a degree
    the model cannot take leaves the rung out with the reason."""
    config = load_config("llama-3.1-8b")
    shape = ModelShape.from_config(config)
    base = load_rung("fsdp_full_shard")
    tp2 = replace(base, name="fsdp_tp2", num_processes=8, dims=ParallelDims(dp_shard=4, tp=2))
    tp_pp = replace(base, name="fsdp_tp2_pp2", num_processes=8, dims=ParallelDims(dp_shard=2, pp=2, tp=2))
    kw = dict(gpus_per_node=8, gpu_mem_bytes=H100)
    plan = plan_rungs(config, [tp_pp, base, tp2], tp=2, **kw)
    assert [r.name for r in plan.rungs] == ["fsdp_full_shard", "fsdp_tp2", "fsdp_tp2_pp2"]
    assert "has no tp axis" in _rung(plan, "fsdp_full_shard").note
    h = shape.hidden
    per_tp_rank = shape.layers * (shape.layer_linear_params / 2 + 2 * h) + shape.embed_params / 2 \
        + shape.head_params / 2 + h
    assert _rung(plan, "fsdp_tp2").dims == ParallelDims(dp_shard=4, tp=2)
    assert _rung(plan, "fsdp_tp2").bytes.weights == int(2 * per_tp_rank / 4)
    # 1F1B over 4 micro-batches: the first of 2 stages (16 layers, per split_stages) holds 2 in flight and their
    # outputs, the last 1 and 3 input gradients (hfdist.plan.bytes._pipeline_bytes); both peak in a backward, the
    # MLP's three bf16 intermediate-wide gradients and the largest projection's bf16 gradient on each tp rank, or
    # (the last) in its loss head, whichever is larger.
    pp_rung = _rung(plan_rungs(config, [tp_pp], tp=2, pp=2, **kw), "fsdp_tp2_pp2")
    assert pp_rung.dims == ParallelDims(dp_shard=2, pp=2, tp=2)
    hidden = 2048 * h * 2
    working = (2048 * 3 * shape.intermediate * 2 + shape.largest_projection * 2) // 2
    stage0 = 2 * 16 * shape.layer_activation_bytes(2048, 2, tp=2) + 2 * hidden + working
    stage1 = 16 * shape.layer_activation_bytes(2048, 2, tp=2) + 3 * hidden + \
        max(working, shape.head_activation_bytes(2048, 2, tp=2))
    assert pp_rung.bytes.activations in (stage0, stage1)
    assert pp_rung.bytes.weights < _rung(plan, "fsdp_tp2").bytes.weights
    wide = _rung(plan_rungs(config, [tp2], tp=16, **kw), "fsdp_tp2")  # 8 kv heads cannot be split 16 ways
    assert not wide.fits and wide.bytes is None and "cannot run here" in wide.note


def test_the_search_finds_what_the_rungs_default_degrees_miss():
    """The fourth round's case: 70B at 131,072 tokens on 4 x 8 x 80 GB fits nowhere at the rungs' shipped degrees
    (tp=2, cp=2), but fsdp_tp at tp=8 does; the recommendation fits and its command is one the job parses."""
    from hfdist.config.finetune import parse_args

    config = load_config("llama-3.1-70b")
    kw = dict(gpus_per_node=8, nodes=4, gpu_mem_bytes=H100, seq=131072, activation_checkpointing=True,
              global_batch=32, model="llama-3.1-70b")
    shipped = plan_rungs(config, ["fsdp_tp", "fsdp_cp"], micro_batch=1, **kw, tp=2)
    assert not _rung(shipped, "fsdp_tp").fits
    plan = plan_rungs(config, micro_batch=None, **kw)
    tp = _rung(plan, "fsdp_tp")
    assert tp.fits and tp.dims == ParallelDims(dp_shard=4, tp=8) and tp.bytes.total < 80 * GB
    rec = plan.recommended
    assert rec is not None and rec.fits and rec.bytes.total <= H100
    argv = shlex.split(rec.command)[3:]  # after `accelerate launch scripts/finetune.py`
    job = parse_args(argv)
    assert (job.config, job.num_processes, job.micro_batch_size) == (f"{rec.name}.yaml", 32, rec.layout.micro_batch)
    assert (job.tp or 1, job.pp or 1, job.cp or 1) == (rec.dims.tp, rec.dims.pp, rec.dims.cp)
    assert load_rung(rec.name).with_num_processes(32, tp=job.tp, pp=job.pp, cp=job.cp,
                                                  node_size=8).dims == rec.dims


# ----------------------------------------------------------------------------------------- recommendations


@pytest.mark.parametrize("model, gpus, nodes, lora, expected", [
    ("llama-3.1-8b", 8, 1, True, "ddp"),  # 002 row 1: LoRA <= 7B on 8 x H100 (ZeRO-1 ties it: the simpler wins)
    ("llama-3.1-8b", 8, 1, False, "zero1"),  # row 2 (full 7B-13B): ZeRO-1 already fits; DDP does not
    ("llama-3.1-405b", 8, 1, False, "zero3_offload_cpu"),  # row 6: single node, model exceeds VRAM
])
def test_recommendation_is_the_fastest_predicted_that_fits(model, gpus, nodes, lora, expected):
    plan = plan_rungs(load_config(model), gpus_per_node=gpus, nodes=nodes, gpu_mem_bytes=H100, lora=lora,
                      activation_checkpointing=True, model=model)
    rec = plan.recommended
    assert rec.name == expected and rec.fits
    assert rec.command.startswith(
        f"accelerate launch scripts/finetune.py --config {expected}.yaml --num-processes {gpus * nodes} "
        f"--model {model}")
    others = [r for r in plan.rungs if r.fits and r.offload == rec.offload]
    assert all(rec.cost.tokens_per_second >= (1 - SPEED_TIE) * r.cost.tokens_per_second for r in others)


def test_every_rungs_best_layout_is_its_fastest_that_fits():
    """70B on 32 GPUs at a small global batch: every rung's row is its fastest fitting layout (or its leanest when
    none fits), among all the layouts the rung has on the cluster."""
    from hfdist.plan.layouts import Cluster, rung_layouts

    config = load_config("llama-3.1-70b")
    plan = plan_rungs(config, ["fsdp_full_shard", "fsdp_tp", "3d"], gpus_per_node=8, nodes=4, gpu_mem_bytes=H100,
                      activation_checkpointing=None, micro_batch=None, global_batch=64)
    for r in plan.rungs:
        layouts, _ = rung_layouts(load_rung(r.name), config, Cluster(8, 4), global_batch=64, seq=2048)
        assert r.layouts == len(layouts) > 0
        single = [plan_rungs(config, [r.name], gpus_per_node=8, nodes=4, gpu_mem_bytes=H100, global_batch=64,
                             tp=lay.dims.tp if lay.dims.tp > 1 else None, pp=lay.dims.pp if lay.dims.pp > 1 else None,
                             micro_batch=lay.pipeline_micro_batch,
                             activation_checkpointing=lay.activation_checkpointing).rungs[0] for lay in layouts]
        fitting = [x for x in single if x.fits]
        if fitting:
            assert r.fits and r.cost.tokens_per_second == max(x.cost.tokens_per_second for x in fitting)
        else:
            assert not r.fits and r.bytes.total == min(x.bytes.total for x in single)


def test_offload_recommendation_hints_at_cheaper_fix():
    data_parallel = ["ddp", "zero1", "zero2", "fsdp_full_shard", "zero3", "fsdp_hybrid", "zero3_offload_cpu",
                     "zero3_offload_nvme"]  # without the TP rungs, which fit 70B on 32 GPUs
    config = load_config("llama-3.1-70b")
    plan = plan_rungs(config, data_parallel, gpus_per_node=8, nodes=4, gpu_mem_bytes=H100)
    assert plan.recommended.name == "zero3_offload_cpu"
    assert plan.hint.startswith("allow --activation-checkpointing: then ")
    named = plan.hint.split("then ")[1].split()[0]
    assert named in data_parallel and "offload" not in named
    # The advice is true of the planner: with checkpointing allowed, the rung it names fits.
    assert _rung(plan_rungs(config, [named], gpus_per_node=8, nodes=4, gpu_mem_bytes=H100,
                            activation_checkpointing=None), named).fits


# ---------------------------------------------------------------------------------- predicted measured bytes


def test_predict_state_bytes_fp32_cpu_runs():
    config = load_config("llama-tiny")
    p = ModelShape.from_config(config).total_params
    ddp = predict_state_bytes(config, load_rung("ddp"), 2)
    assert (ddp.param_bytes, ddp.grad_bytes, ddp.optimizer_bytes, ddp.master_bytes) == (4 * p, 4 * p, 8 * p, 0)
    fsdp = predict_state_bytes(config, load_rung("fsdp_full_shard"), 2)
    assert (fsdp.param_bytes, fsdp.grad_bytes, fsdp.optimizer_bytes) == (2 * p, 2 * p, 4 * p)
    # DeepSpeed keeps an fp32 master partition (a clone even of fp32 weights) beside the Adam moments ...
    zero1 = predict_state_bytes(config, load_rung("zero1"), 2)
    assert (zero1.param_bytes, zero1.grad_bytes, zero1.optimizer_bytes, zero1.master_bytes) == \
        (4 * p, 4 * p, 6 * p, 2 * p)
    zero2 = predict_state_bytes(config, load_rung("zero2"), 2)
    assert (zero2.param_bytes, zero2.grad_bytes, zero2.optimizer_bytes) == (4 * p, 2 * p, 6 * p)
    zero3 = predict_state_bytes(config, load_rung("zero3"), 4)
    assert (zero3.param_bytes, zero3.grad_bytes, zero3.optimizer_bytes) == (p, p, 3 * p)
    # ... and so does offload.
    offload = predict_state_bytes(config, load_rung("zero3_offload_cpu"), 2)
    assert (offload.optimizer_bytes, offload.master_bytes) == (6 * p, 2 * p)
    tp = predict_state_bytes(config, load_rung("fsdp_tp"), 4)  # 2 x 2: every weight split over dp and tp
    assert (tp.param_bytes, tp.grad_bytes, tp.optimizer_bytes) == (p, p, 2 * p)
    hybrid = predict_state_bytes(config, load_rung("fsdp_hybrid"), 4)  # the YAML's 2 x 2: sharded over 2
    assert hybrid.param_bytes == 2 * p


def test_predict_state_bytes_lora_and_bf16():
    config = load_config("llama-tiny")
    shape = ModelShape.from_config(config)
    p, lora = shape.total_params, shape.layers * shape.lora_layer_params(16)
    ddp = predict_state_bytes(config, load_rung("ddp"), 2, lora=True)
    assert (ddp.param_bytes, ddp.grad_bytes, ddp.optimizer_bytes) == (4 * (p + lora), 4 * lora, 8 * lora)
    zero2 = predict_state_bytes(config, load_rung("zero2"), 2, dtype="bf16")  # bf16 model + fp32 grad partition
    assert (zero2.param_bytes, zero2.grad_bytes, zero2.optimizer_bytes) == (2 * p, 3 * p, 6 * p)


# ---------------------------------------------------------------------------------------------------- the CLI


def test_cli_table_on_preset(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus-per-node", "8", "--nodes", "1", "--gpu-mem-gb", "80",
                 "--activation-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "Recommended: zero1, dp_shard=8, micro-batch 1, recompute" in out
    assert "accelerate launch scripts/finetune.py --config zero1.yaml --num-processes 8 --model llama-3.1-8b" in out
    assert "2 weight + 2 grad + 4 fp32 master + 8 Adam" in out


def test_cli_json_on_local_checkpoint(tmp_path, capsys):
    _llama(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=128).save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--gpus-per-node", "2", "--gpu-mem-gb", "8", "--lora", "--lora-r",
                 "4", "--seq", "128", "--micro-batch", "2", "--dtype", "fp32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"name", "command"} <= set(data["recommended"])
    assert data["recommended"]["name"] == "ddp" and str(tmp_path) in data["recommended"]["command"]
    for rung in data["rungs"]:
        assert {"name", "fits", "per_rank_bytes"} <= set(rung)
        if rung["name"] in ("3d", "pp", "fsdp_tp_cp"):  # 3d's tp x pp and fsdp_tp_cp's tp x cp cannot fit on 2 GPUs,
            # pp's 4 micro-batches of 2 do not split a rank's 4 sequences: said, not planned
            assert rung["per_rank_bytes"] is None and not rung["fits"] and "cannot run here" in rung["note"]
            continue
        assert {"weights", "grads", "master", "optimizer", "activations", "total"} <= set(rung["per_rank_bytes"])
    ddp = data["rungs"][0]["per_rank_bytes"]
    assert ddp["master"] == 0  # fp32 training keeps no master copy outside DeepSpeed
    assert data["workload"]["lora_r"] == 4 and data["workload"]["dtype"] == "fp32"


def test_cli_nothing_fits(capsys):
    code = main(["plan", "--model", "llama-3.1-405b", "--gpus-per-node", "1", "--gpu-mem-gb", "8", "--seq", "8192",
                 "--json"])
    assert code == 1
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["recommended"] is None and data["error"].startswith("Nothing fits")
    assert "Nothing fits: even the leanest layout" in captured.err and "Fix:" in captured.err


def test_cli_bad_model_is_one_clear_error(capsys, tmp_path):
    assert main(["plan", "--model", str(tmp_path), "--gpus-per-node", "1"]) == 2
    assert "not a HF checkpoint folder" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "hfdist.cli", "plan", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--bytes-per-param-adam" in out and "--activation-checkpointing" in out


def test_presets_plan_without_importing_torch():
    """`hfdist plan --model <preset>` reads sizes only: no torch/transformers import, so it answers at once."""
    import subprocess
    import sys

    code = ("import sys; from hfdist.cli import main; rc = main(['plan', '--model', 'llama-3.1-405b', "
            "'--gpus-per-node', '8', '--nodes', '16', '--gpu-mem-gb', '80', '--activation-checkpointing', "
            "'--json']); print('torch' in sys.modules, 'transformers' in sys.modules, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr.strip().endswith("False False"), proc.stderr


def test_pipeline_with_one_data_parallel_rank_gathers_only_under_bf16():
    """pp with dp = 1 gets FSDP2 only for bf16 (its precision policy): then each stage holds bf16 copies of all its
    units through the step; in fp32 nothing is gathered: the workspace and the stage's receive buffers."""
    from hfdist.plan.bytes import WORKSPACE_BYTES, Workload, rung_rank_bytes

    shape = ModelShape.from_config(load_config("llama-3.1-8b"))
    dims = ParallelDims(pp=2)
    fp32 = rung_rank_bytes(shape, load_rung("pp"), dims, Workload(dtype="fp32"))
    bf16 = rung_rank_bytes(shape, load_rung("pp"), dims, Workload(dtype="bf16"))
    receive = 4 * Workload().seq * shape.hidden * 4  # one fp32 receive buffer per micro-batch (pipeline_bytes)
    assert fp32.buffers == WORKSPACE_BYTES + receive
    assert bf16.buffers - WORKSPACE_BYTES >= 2 * (shape.layers // 2) * shape.layer_linear_params  # bf16 stage copy


def test_cli_loss_chunk_size_counts_one_chunk_or_the_whole_sequence(capsys):
    """`--loss-chunk-size` plans what finetune's flag of the same name runs: one chunk's fp32 logits, or with 0 the
    whole sequence's; Llama-3's 128256-entry vocabulary makes the difference (8192 - 512) x 128256 x 6 bytes (bf16:
    fp32 logits and the bf16 copy of their gradient) when every layer's activations are kept (with recompute the
    head and the recomputed layer are never held together: the larger counts)."""
    activations = {}
    for chunk in ("512", "0"):
        assert main(["plan", "--model", "llama-3.1-8b", "--seq", "8192", "--loss-chunk-size", chunk,
                     "--no-activation-checkpointing", "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["workload"]["loss_chunk_size"] == (int(chunk) or None)
        activations[chunk] = data["rungs"][0]["per_rank_bytes"]["activations"]
    assert activations["0"] - activations["512"] == (8192 - 512) * 128256 * 6
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "llama-3.1-8b", "--loss-chunk-size", "-1"])
    assert exit_info.value.code == 2 and "must be 0 or more, got -1" in capsys.readouterr().err
