"""FLOPs per token (hand counts for Llama-3.1-8B, FlopCounterMode on llama-tiny), peak FLOP/s table, MFU.

Pure logic plus one tiny CPU forward+backward per case; no process group.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hfdist.metrics.flops import flops_per_token, matmul_params, mfu, model_flops_per_token, tflops_per_device
from hfdist.metrics.peaks import CPU_PEAK_SOURCE, PEAK_FLOPS, device_peak_flops, measure_cpu_peak_flops, peak_flops_for
from hfdist.models.build import build_model
from hfdist.models.presets import load_config

# Llama-3.1-8B by hand: d=4096, 32 layers, 32 heads of 128, 8 kv heads, intermediate 14336, vocab 128256.
#   per layer: q 4096*4096 = 16,777,216; k = v = 4096*1024 = 4,194,304; o = 16,777,216;
#              gate = up = down = 4096*14336 = 58,720,256  -> 218,103,808
#   32 layers: 6,979,321,856; lm_head 4096*128256 = 525,336,576 -> N_matmul 7,504,658,432 (embedding excluded)
#   attention at T=8192: 12*32*32*128*8192 = 12,884,901,888
#   LoRA r=16 on all 7 projections: 16*(sum of in+out) = 16*81,920 = 1,310,720 per layer -> 41,943,040
N_8B = 7_504_658_432
ATTN_8B_8K = 12_884_901_888
LORA_8B_R16 = 41_943_040

SEQ, BATCH, VOCAB = 64, 2, 1024


def test_llama_8b_matches_the_hand_count():
    config = load_config("llama-3.1-8b")
    assert matmul_params(config) == N_8B
    assert flops_per_token(config, 8192) == 6 * N_8B + ATTN_8B_8K
    assert flops_per_token(config, 8192) == pytest.approx(6 * 7.5e9 + ATTN_8B_8K, rel=1e-3)
    assert flops_per_token(config, 8192, include_attention=False) == 6 * N_8B
    # LoRA: the frozen base skips its weight-gradient matmul (4N), the adapters train (6·N_lora)
    assert flops_per_token(config, 8192, lora=True) == 4 * N_8B + 6 * LORA_8B_R16 + ATTN_8B_8K
    assert flops_per_token(config, 8192, trainable_fraction=0.5) == 5 * N_8B + ATTN_8B_8K
    with pytest.raises(ValueError, match=r"Unknown LoRA target\(s\) \[.lm_head.\]"):
        flops_per_token(config, 8192, lora=True, lora_targets=["lm_head"])


def test_tied_lm_head_still_counts_its_matmul():
    config = load_config("llama-3.2-1b")  # tie_word_embeddings=True
    layer = 2048 * 2048 * 2 + 2048 * 512 * 2 + 3 * 2048 * 8192
    assert matmul_params(config) == 16 * layer + 2048 * 128256


def _measured_flops_per_token(model) -> float:
    """FlopCounterMode over one forward+backward; it counts matmul-class ops (mm, bmm, sdpa on GPU) only."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    # eager attention: torch has no FLOP formula for the CPU SDPA kernel, so SDPA would count no attention
    model.set_attn_implementation("eager")
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.get_total_flops() / (BATCH * SEQ)


@pytest.mark.parametrize("preset", ["llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny", "smollm3-tiny",
                                    "qwen3-moe-tiny", "mixtral-tiny"])
def test_tiny_models_match_flop_counter(preset):
    """Exact for what both count; norms, softmax, rotary, SiLU, residuals, biases and the loss are in neither. An MoE
    model's experts count their routed rows (T x k: active parameters, transformers' eager experts on CPU compute
    exactly those; Llama 4's transformers experts compute every expert on every token, zeros included, so its
    executed FLOPs are not its model FLOPs and it is left out)."""
    model = build_model(preset, vocab_size=VOCAB)
    formula = flops_per_token(model.config, SEQ)
    assert model_flops_per_token(model, SEQ) == formula
    assert _measured_flops_per_token(model) == pytest.approx(formula, rel=1e-9)


def test_tiny_lora_matches_flop_counter_up_to_layer0_input_grads():
    """LoRA: 4·N base + 6·N_lora + attention, minus what autograd skips because nothing before layer 0 trains.

    The input gradients of layer 0's q/k/v projections and of their lora_A matmuls are never computed
    (2 FLOPs per param per token); the formula keeps them, an over-count of 1.3% here and <0.2% on Llama-3.1-8B.
    """
    from peft import LoraConfig, get_peft_model

    r = 8
    base = build_model("llama-tiny", vocab_size=VOCAB)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=16, lora_dropout=0.0,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"]))
    config = model.config
    formula = flops_per_token(config, SEQ, lora=True, lora_r=r)
    assert model_flops_per_token(model, SEQ) == formula  # adapters counted from peft's layers agree with config
    d, kv = config.hidden_size, config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    skipped = 2 * (d * (d + 2 * kv) + 3 * r * d)
    measured = _measured_flops_per_token(model)
    assert measured == pytest.approx(formula - skipped, rel=1e-9)
    assert measured == pytest.approx(formula, rel=0.02)


@pytest.mark.parametrize("name, dtype, key", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, "H100 SXM"),
    ("NVIDIA H100 PCIe", torch.bfloat16, "H100 PCIe"),
    ("NVIDIA H100 NVL", "bf16", "H100 NVL"),
    ("NVIDIA H200", torch.bfloat16, "H200"),
    ("NVIDIA GH200 480GB", torch.bfloat16, "GH200"),
    ("NVIDIA A100-SXM4-80GB", torch.float16, "A100 SXM"),
    ("NVIDIA A100-SXM4-40GB", "tf32", "A100 SXM"),
    ("NVIDIA A100-PCIE-40GB", torch.float32, "A100 PCIe"),
    ("NVIDIA A100 80GB PCIe", torch.bfloat16, "A100 PCIe"),
    ("NVIDIA L40S", torch.bfloat16, "L40S"),
    ("NVIDIA L4", torch.bfloat16, "L4"),
    ("NVIDIA A10G", torch.bfloat16, "A10G"),
    ("NVIDIA A10", torch.bfloat16, "A10"),
    ("NVIDIA GeForce RTX 4090", torch.bfloat16, "RTX 4090"),
    ("Tesla V100-SXM2-16GB", torch.float16, "V100 SXM2"),
    ("Tesla V100-PCIE-32GB", torch.float16, "V100 PCIe"),
    ("Tesla T4", torch.float16, "T4"),
    ("AMD Instinct MI300X", torch.bfloat16, "MI300X"),
])
def test_peak_flops_by_device_name(name, dtype, key):
    dt = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, dtype)
    assert peak_flops_for(name, dtype) == PEAK_FLOPS[key][dt]


def test_peak_flops_dense_values_and_gaps():
    assert peak_flops_for("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12  # not the 1979 "with sparsity"
    assert peak_flops_for("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert peak_flops_for("Tesla V100-SXM2-16GB", torch.bfloat16) is None  # Volta has no bf16 tensor cores
    assert peak_flops_for("Some Future GPU", torch.bfloat16) is None
    for row in PEAK_FLOPS.values():  # tensor paths are never slower than the CUDA-core fp32 rate
        rates = [row[k] for k in ("fp32", "tf32", "bf16") if k in row]
        assert rates == sorted(rates)
    with pytest.raises(ValueError, match="dtype"):
        peak_flops_for("NVIDIA H100 PCIe", torch.int8)


def test_measured_cpu_peak_is_cached_and_named():
    first = measure_cpu_peak_flops(size=256, repeats=3)
    assert first > 1e8  # any CPU of this decade does >0.1 GFLOP/s on a matmul
    assert measure_cpu_peak_flops(size=256, repeats=3) == first
    peak = device_peak_flops("cpu", torch.float32)
    assert peak.source == f"{CPU_PEAK_SOURCE} (fp32)" and peak.flops > 0


def test_mfu_and_tflops():
    config = load_config("llama-3.1-8b")
    per_token = flops_per_token(config, 8192)
    # torchtitan's Llama 3 8B FSDP figure on H100: 5,762 tokens/s per GPU
    assert tflops_per_device(5762, per_token) == pytest.approx(5762 * per_token / 1e12)
    assert mfu(5762, per_token, PEAK_FLOPS["H100 SXM"]["bf16"]) == pytest.approx(5762 * per_token / 989e12)
    assert 0.3 < mfu(5762, per_token, 989e12) < 0.4
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0.0)
