"""Model presets and loading: a HF id, a local checkpoint folder, or a preset built from a LlamaConfig.

Presets make the project self-contained (nothing is downloaded): tiny ones train on a CPU in seconds, the
real-shape ones (Llama-3.2-1B, 3.1-8B/70B/405B) feed the memory planner and meta-device code.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from hfdist.errors import HfdistError

__all__ = ["PRESETS", "ModelSpecError", "preset_names", "load_config", "preset_shape", "build_model", "is_llama"]

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_theta": 500000.0}

# Dimensions of the small presets are chosen so tp in {1, 2, 4} divides heads, kv heads, intermediate and vocab.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False),
    "llama-small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         tie_word_embeddings=False, rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE),
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                          tie_word_embeddings=False, rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE),
    "llama-3.1-405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                           num_attention_heads=128, num_key_value_heads=8, vocab_size=128256,
                           max_position_embeddings=131072, tie_word_embeddings=False, rms_norm_eps=1e-5,
                           rope_parameters=_LLAMA3_ROPE),
}

DEFAULT_PRESET = "llama-small"


class ModelSpecError(HfdistError, ValueError):
    """A --model value that names no preset, folder or reachable hub model."""


def preset_names() -> list[str]:
    """All preset names, smallest first."""
    return list(PRESETS)


def load_config(spec: str, vocab_size: int | None = None):
    """The model config for a preset name, a local folder or a HF id, without loading any weights.

    Args:
        spec: preset name, local checkpoint folder, or hub id.
        vocab_size: vocabulary for presets that do not fix one (the embedded tokenizer's size).
    """
    from transformers import AutoConfig, LlamaConfig

    if spec in PRESETS:
        kwargs = dict(PRESETS[spec])
        kwargs.setdefault("vocab_size", vocab_size or 1024)
        return LlamaConfig(**kwargs)
    path = Path(spec)
    if path.exists() and not (path / "config.json").is_file():
        raise ModelSpecError(f"--model {spec} is a path without a config.json: not a HF checkpoint folder. Point it "
                             f"at a folder saved by save_pretrained, or use a preset: {', '.join(PRESETS)}.")
    try:
        return AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as exc:
        raise ModelSpecError(
            f"Cannot load model '{spec}': not a preset ({', '.join(PRESETS)}), not a local checkpoint folder, and the "
            f"Hub did not answer ({type(exc).__name__}). Use a preset, or download the model once and pass its "
            "folder."
        ) from exc


def preset_shape(spec: str, vocab_size: int | None = None) -> SimpleNamespace:
    """A preset's config fields as plain attributes, without importing transformers (seconds) or torch.

    Enough for code that only reads sizes (the memory planner); use load_config for a real LlamaConfig.
    """
    if spec not in PRESETS:
        raise ModelSpecError(f"'{spec}' is not a preset; presets: {', '.join(PRESETS)}.")
    fields = {"model_type": "llama", "vocab_size": vocab_size or 1024, **PRESETS[spec]}
    return SimpleNamespace(**fields)


def build_model(spec: str, vocab_size: int | None = None, seed: int = 0, dtype: "torch.dtype | None" = None):
    """Instantiate the model (fp32 unless `dtype`): presets from their config with a seeded init, others with
    from_pretrained.

    The seed makes every rank (and the single-process reference) start from identical weights.
    """
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32

    config = load_config(spec, vocab_size)
    torch.manual_seed(seed)
    if spec in PRESETS:
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)


def is_llama(config) -> bool:
    """Whether hfdist's Llama-specific surgery (TP plan, stage split) applies to this config."""
    return getattr(config, "model_type", None) == "llama"
