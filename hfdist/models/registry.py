"""The model-facts registry: what hfdist needs to know about an architecture, written once per architecture.

Surgery (TP plan, pipeline stages, FSDP units, activation checkpointing), the memory planner, the FLOPs count and
the data path all read these facts instead of hard-coding Llama's. Llama, Mistral, Qwen2 and Qwen3 share one
module layout (`model.embed_tokens`, `model.layers[i].{self_attn,mlp}`, `model.norm`, `model.rotary_emb`,
`lm_head`), so an entry differs only in its layer class, projection biases, per-head norms and attention masks.
The mixture-of-experts architectures (Qwen3-MoE, Mixtral, Llama 4's text model) add their MoE facts
(hfdist.models.moe_facts: router, stacked experts, shared expert, aux loss); their `colwise` / `rowwise` projections are
the attention's, present in every layer (a dense layer's MLP is the MoE facts' to describe).
An architecture not listed here is refused by name (`facts_for`), never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hfdist.errors import HfdistError
from hfdist.models.moe_facts import LLAMA4_TEXT, MIXTRAL, QWEN3_MOE, MoeFacts

__all__ = ["ModelFacts", "UnsupportedModelError", "REGISTRY", "LORA_TARGETS", "IGNORE_INDEX", "facts_for",
           "is_supported", "supported_types"]

# The label value HF causal LMs' loss skips (prompt tokens, padding); every registered architecture uses it.
IGNORE_INDEX = -100

# Decoder-layer projections, relative to a decoder layer, by how tensor parallelism splits their weight.
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
ATTENTION_COLWISE, ATTENTION_ROWWISE = COLWISE[:3], ROWWISE[:1]
# What `--lora` adapts: every decoder-layer projection (short names, as peft's target_modules take them).
LORA_TARGETS = tuple(name.split(".")[-1] for name in COLWISE + ROWWISE)


class UnsupportedModelError(HfdistError, ValueError):
    """A model whose architecture has no entry in the registry."""


@dataclass(frozen=True)
class ModelFacts:
    """Everything architecture-specific hfdist uses.

    Attributes:
        model_type: the HF config's `model_type`.
        decoder_layer: class name of a decoder layer: the FSDP unit and the activation-checkpointing unit.
        colwise, rowwise: decoder-layer projections split on their output / input dim by tensor parallelism.
        layer_norms: the RMSNorms on a decoder layer's residual stream (sequence-parallel under TP).
        head_norms: RMSNorms applied per attention head (Qwen3's q_norm / k_norm): weight of size head_dim.
        qkv_bias: q/k/v projections always carry a bias (Qwen2); otherwise `config.attention_bias` decides.
        sliding_window_everywhere: a set `config.sliding_window` makes every layer's attention sliding (Mistral).
        window_from_layer_types: attention masks follow `config.layer_types`, full or sliding per layer (Qwen2/3).
        ignore_index: the label value the loss skips.
        moe: the mixture-of-experts facts (hfdist.models.moe), None for a dense architecture.
    """

    model_type: str
    decoder_layer: str
    colwise: tuple[str, ...] = COLWISE
    rowwise: tuple[str, ...] = ROWWISE
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    head_norms: tuple[str, ...] = ()
    qkv_bias: bool = False
    sliding_window_everywhere: bool = False
    window_from_layer_types: bool = False
    ignore_index: int = IGNORE_INDEX
    moe: MoeFacts | None = None
    # Paths inside the causal LM (the same for every registered architecture).
    embed: str = "model.embed_tokens"
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    rotary: str = "model.rotary_emb"
    head: str = "lm_head"

    @property
    def linears(self) -> tuple[str, ...]:
        """Every decoder-layer projection (column- then row-split)."""
        return self.colwise + self.rowwise

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """Short names of the projections `--lora` adapts: all of them (an MoE model's dense MLP and shared expert
        projections too; its routed experts stay frozen: hfdist.models.moe.moe_lora_config)."""
        return LORA_TARGETS if self.moe is not None else tuple(name.split(".")[-1] for name in self.linears)

    def head_dim(self, config: Any) -> int:
        """Per-head width (configs may set it apart from hidden / heads, as Qwen3 does)."""
        return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)

    def linear_shapes(self, config: Any) -> dict[str, tuple[int, int, bool]]:
        """(in_features, out_features, has_bias) of each decoder-layer projection, keyed by short name (of an MoE
        architecture: a dense layer's, whose MLP is `moe.dense_width` wide)."""
        h, hd = int(config.hidden_size), self.head_dim(config)
        i = self.moe.dense_width(config) if self.moe is not None else int(config.intermediate_size)
        heads = int(config.num_attention_heads)
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        attn_bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        qkv_bias = self.qkv_bias or attn_bias
        return {"q_proj": (h, heads * hd, qkv_bias), "k_proj": (h, kv * hd, qkv_bias),
                "v_proj": (h, kv * hd, qkv_bias), "o_proj": (heads * hd, h, attn_bias),
                "gate_proj": (h, i, mlp_bias), "up_proj": (h, i, mlp_bias), "down_proj": (i, h, mlp_bias)}

    def head_norm_params(self, config: Any) -> int:
        """Parameters of one layer's per-head norms."""
        return len(self.head_norms) * self.head_dim(config)

    def mask_kinds(self, config: Any) -> list[str]:
        """The attention mask each decoder layer takes: "full_attention" or "sliding_attention"."""
        n = int(config.num_hidden_layers)
        if self.window_from_layer_types and getattr(config, "layer_types", None):
            return list(config.layer_types)
        if self.sliding_window_everywhere and getattr(config, "sliding_window", None) is not None:
            return ["sliding_attention"] * n
        return ["full_attention"] * n


REGISTRY: dict[str, ModelFacts] = {
    "llama": ModelFacts("llama", "LlamaDecoderLayer"),
    "mistral": ModelFacts("mistral", "MistralDecoderLayer", sliding_window_everywhere=True),
    "qwen2": ModelFacts("qwen2", "Qwen2DecoderLayer", qkv_bias=True, window_from_layer_types=True),
    "qwen3": ModelFacts("qwen3", "Qwen3DecoderLayer", head_norms=("self_attn.q_norm", "self_attn.k_norm"),
                        window_from_layer_types=True),
    "qwen3_moe": ModelFacts("qwen3_moe", "Qwen3MoeDecoderLayer", ATTENTION_COLWISE, ATTENTION_ROWWISE,
                            head_norms=("self_attn.q_norm", "self_attn.k_norm"), window_from_layer_types=True,
                            moe=QWEN3_MOE),
    "mixtral": ModelFacts("mixtral", "MixtralDecoderLayer", ATTENTION_COLWISE, ATTENTION_ROWWISE,
                          sliding_window_everywhere=True, moe=MIXTRAL),
    # Llama 4's text model: its qk norm is a weightless L2 norm; its chunked-attention layers are full attention at
    # the sequence lengths hfdist trains it on (hfdist.parallel.expert_check refuses longer ones).
    "llama4_text": ModelFacts("llama4_text", "Llama4TextDecoderLayer", ATTENTION_COLWISE, ATTENTION_ROWWISE,
                              moe=LLAMA4_TEXT),
}


def supported_types() -> list[str]:
    """model_type values hfdist's surgery, planner and FLOPs count support."""
    return list(REGISTRY)


def _config_of(config_or_model: Any) -> Any:
    """The HF config of a config, a model, or a wrapper (peft, DDP, DeepSpeed) around a model."""
    seen = set()
    obj = config_or_model
    while id(obj) not in seen:
        seen.add(id(obj))
        if getattr(obj, "model_type", None) is not None and hasattr(obj, "num_hidden_layers"):
            return obj
        config = getattr(obj, "config", None)
        if getattr(config, "model_type", None) is not None and hasattr(config, "num_hidden_layers"):
            return config
        inner = getattr(obj, "module", None) or getattr(obj, "base_model", None)
        if inner is None or inner is obj:
            break
        obj = inner
    return None


def is_supported(config_or_model: Any) -> bool:
    """Whether the registry has an entry for this config's (or model's) architecture."""
    config = _config_of(config_or_model)
    return config is not None and getattr(config, "model_type", None) in REGISTRY


def facts_for(config_or_model: Any, purpose: str = "hfdist") -> ModelFacts:
    """The registry entry of a config or model.

    Args:
        purpose: what needs the facts, for the error message (e.g. "tensor parallelism").

    Raises:
        UnsupportedModelError: the architecture has no entry; the message names the supported ones.
    """
    config = _config_of(config_or_model)
    model_type = getattr(config, "model_type", None)
    if model_type not in REGISTRY:
        raise UnsupportedModelError(
            f"{purpose} needs hfdist's facts about the model's architecture, and '{model_type}' has none: hfdist "
            f"supports {', '.join(REGISTRY)} (model_type in config.json). Use a model of one of these "
            "architectures, or a data-parallel rung (ddp, zero1/2/3), which need no model facts."
        )
    return REGISTRY[model_type]
