"""Model presets and config loading: a preset name, a local checkpoint folder or a HF id -> a HF config.

Presets make the project self-contained (nothing is downloaded): tiny ones of each registered architecture train
on a CPU in seconds, the real-shape ones (Llama-3.2-1B, 3.1-8B/70B/405B, Qwen3-30B-A3B, Llama 4 Scout) feed the
planner and meta-device code.
`preset_shape` reads a preset without importing transformers, so `hfdist plan` on a preset starts in a blink.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

from hfdist.errors import HfdistError

__all__ = ["PRESETS", "DEFAULT_PRESET", "EMBEDDED_VOCAB_SIZE", "Preset", "ModelSpecError", "preset_names", "is_preset",
           "load_config", "preset_shape"]

# The vocabulary of hfdist's embedded tokenizer (hfdist.data.default trains it to this size), which the presets take
# unless they fix their own.
EMBEDDED_VOCAB_SIZE = 1024

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_theta": 500000.0}


class Preset(NamedTuple):
    """A model built from a config alone: its architecture and config fields (vocab: the embedded tokenizer's
    unless given)."""

    model_type: str
    fields: dict[str, Any]


# Tiny presets: sizes chosen so tp in {1, 2, 4} divides heads, kv heads, intermediate, hidden and vocab.
_TINY = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
PRESETS: dict[str, Preset] = {
    "llama-tiny": Preset("llama", _TINY),
    # An odd layer count (pipeline stages of unequal size) with GQA: layouts that hide nothing (resume tests).
    "llama-tiny-odd": Preset("llama", {**_TINY, "num_hidden_layers": 5}),
    # 6 query heads over 2 kv heads (head dim 16): cp=4, or cp=2 under tp=2 (3 heads per tp rank), cannot split the
    # heads, so context parallelism runs its ring there (hfdist.parallel.context_check.plan_cp).
    "llama-tiny-6h": Preset("llama", {**_TINY, "hidden_size": 96, "num_attention_heads": 6}),
    # Mistral's sliding window, shorter than many packed documents at the tests' --seq-len 64: every layer slides.
    "mistral-tiny": Preset("mistral", {**_TINY, "sliding_window": 32}),
    "qwen2-tiny": Preset("qwen2", {**_TINY, "use_sliding_window": False}),
    # Qwen3 sets head_dim apart from hidden / heads; 32 here (hidden 64 / 4 heads would give 16).
    "qwen3-tiny": Preset("qwen3", {**_TINY, "head_dim": 32, "use_sliding_window": False}),
    # SmolLM3 (no hfdist TP entry: transformers' base_model_tp_plan is read); its 4th layer has no rotary embedding.
    # Its config's default token ids (128000-128004) lie outside the tiny vocabulary; the tokenizer sets pad.
    "smollm3-tiny": Preset("smollm3", {**_TINY, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}),
    # Mixture-of-experts (hfdist.models.moe): 8 experts so ep in {1, 2, 4, 8} splits them whole. Qwen3-MoE with
    # one dense layer among its MoE layers (mlp_only_layers), Mixtral's top-2 of 8, Llama 4's top-1 with a shared
    # expert, dense and MoE layers interleaved and a NoPE layer (the fourth).
    "qwen3-moe-tiny": Preset("qwen3_moe", {**_TINY, "head_dim": 32, "use_sliding_window": False, "num_experts": 8,
                                           "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                           "norm_topk_prob": True, "mlp_only_layers": [3]}),
    "mixtral-tiny": Preset("mixtral", {**_TINY, "intermediate_size": 64, "num_local_experts": 8,
                                       "num_experts_per_tok": 2}),
    "llama4-tiny": Preset("llama4_text", {**_TINY, "head_dim": 16, "intermediate_size": 64,
                                          "intermediate_size_mlp": 128, "num_local_experts": 8,
                                          "num_experts_per_tok": 1, "interleave_moe_layer_step": 2}),
    "llama-small": Preset("llama", dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                                        tie_word_embeddings=False)),
    # 153 M parameters: big enough that loading and saving memory (per rank, against the model's bytes) is measured
    # above the noise of a process, small enough to train a few steps on a CPU.
    "llama-medium": Preset("llama", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
                                         num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=1024,
                                         tie_word_embeddings=False)),
    "llama-3.2-1b": Preset("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                         max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                         rope_parameters=_LLAMA3_ROPE)),
    "llama-3.1-8b": Preset("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                         max_position_embeddings=131072, tie_word_embeddings=False, rms_norm_eps=1e-5,
                                         rope_parameters=_LLAMA3_ROPE)),
    "llama-3.1-70b": Preset("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                          max_position_embeddings=131072, tie_word_embeddings=False,
                                          rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE)),
    "llama-3.1-405b": Preset("llama", dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                           num_attention_heads=128, num_key_value_heads=8, vocab_size=128256,
                                           max_position_embeddings=131072, tie_word_embeddings=False,
                                           rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE)),
    # Mixture-of-experts models at their real shapes (config only: the planner and meta-device code).
    "qwen3-30b-a3b": Preset("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                              num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                              vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                                              moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
                                              mlp_only_layers=[], max_position_embeddings=40960,
                                              use_sliding_window=False, tie_word_embeddings=False, rms_norm_eps=1e-6,
                                              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "llama-4-scout": Preset("llama4_text", dict(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                                                num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                                                head_dim=128, vocab_size=202048, num_local_experts=16,
                                                num_experts_per_tok=1, interleave_moe_layer_step=1,
                                                max_position_embeddings=10485760, attention_chunk_size=8192,
                                                tie_word_embeddings=False, rms_norm_eps=1e-5,
                                                rope_parameters={"rope_type": "llama3", "factor": 16.0,
                                                                 "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                                                 "original_max_position_embeddings": 8192,
                                                                 "rope_theta": 500000.0})),
}

DEFAULT_PRESET = "llama-small"


class ModelSpecError(HfdistError, ValueError):
    """A --model value that names no preset, folder or reachable hub model."""


def preset_names() -> list[str]:
    """All preset names, tiny ones first."""
    return list(PRESETS)


def is_preset(spec: str | None) -> bool:
    """Whether `spec` names a preset (None means the default preset)."""
    return spec is None or spec in PRESETS


def _preset_fields(spec: str, vocab_size: int | None) -> dict[str, Any]:
    fields = dict(PRESETS[spec].fields)
    fields.setdefault("vocab_size", vocab_size or EMBEDDED_VOCAB_SIZE)
    return fields


def load_config(spec: str | None, vocab_size: int | None = None):
    """The HF config for a preset name (None: the default), a local folder or a HF id, without loading weights.

    Args:
        vocab_size: vocabulary for presets that do not fix one (default: the embedded tokenizer's size).
    """
    from transformers import AutoConfig

    spec = spec or DEFAULT_PRESET
    if spec in PRESETS:
        return AutoConfig.for_model(PRESETS[spec].model_type, **_preset_fields(spec, vocab_size))
    path = Path(spec)
    if path.exists() and not (path / "config.json").is_file():
        raise ModelSpecError(f"--model {spec} is a path without a config.json: not a HF checkpoint folder. Point it "
                             f"at a folder saved by save_pretrained, or use a preset: {', '.join(PRESETS)}.")
    try:
        return AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as exc:
        if path.exists():
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise ModelSpecError(f"--model {spec}: its config.json is not a model config transformers can read "
                                 f"({type(exc).__name__}: {first}). Replace it with the config.json the model was "
                                 "saved with (save_pretrained writes it).") from exc
        raise ModelSpecError(
            f"Cannot load model '{spec}': not a preset ({', '.join(PRESETS)}), not a local checkpoint folder, and the "
            f"Hub did not answer ({type(exc).__name__}). Use a preset, or download the model once and pass its "
            "folder."
        ) from exc


def preset_shape(spec: str, vocab_size: int | None = None) -> SimpleNamespace:
    """A preset's config fields as plain attributes, without importing transformers (seconds) or torch.

    Enough for code that only reads sizes (the memory planner); use load_config for a real HF config.
    """
    if spec not in PRESETS:
        raise ModelSpecError(f"'{spec}' is not a preset; presets: {', '.join(PRESETS)}.")
    return SimpleNamespace(model_type=PRESETS[spec].model_type, **_preset_fields(spec, vocab_size))
