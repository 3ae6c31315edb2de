"""The model-facts registry: what hfdist needs to know about an architecture that transformers does not say.

Surgery (TP plan, pipeline stages, FSDP units, activation checkpointing), the memory planner, the FLOPs count and
the data path all read these facts instead of hard-coding Llama's. The registered architectures share one module
layout (`model.embed_tokens`, `model.layers[i].{self_attn,mlp}`, `model.norm`, `model.rotary_emb`, `lm_head`).
What transformers already ships is read from it, not restated:

- which decoder-layer projections tensor parallelism splits on their output dim ("colwise") or input dim
  ("rowwise"), and which per-head norms keep a replicated weight whose gradient is summed over ranks
  ("replicated_with_grad_allreduce", Qwen3's q_norm / k_norm): the config class's `base_model_tp_plan`;
- the decoder-layer class (the FSDP and activation-checkpointing unit): the model class's `_no_split_modules`.

An entry holds the rest: projection biases the modeling code always adds (Qwen2's q/k/v), which layers' attention
slides, the norms on the residual stream. A new architecture with Llama's layout and a `base_model_tp_plan` is an
entry of only those facts. The mixture-of-experts architectures (Qwen3-MoE, Mixtral, Llama 4's text model) add their
MoE facts (hfdist.models.moe_facts: router, stacked experts, shared expert, aux loss); of their TP plan hfdist reads
the attention's part, present in every layer (a layer's MLP is the MoE facts' to describe). An architecture not
listed here is refused by name (`facts_for`), never guessed.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfdist.errors import HfdistError
from hfdist.models.moe_facts import LLAMA4_TEXT, MIXTRAL, QWEN3_MOE, MoeFacts

__all__ = ["ModelFacts", "UnsupportedModelError", "REGISTRY", "LORA_TARGETS", "IGNORE_INDEX", "facts_for",
           "is_supported", "supported_types", "transformers_tp_plan"]

# The label value HF causal LMs' loss skips (prompt tokens, padding); every registered architecture uses it.
IGNORE_INDEX = -100

# What `--lora` adapts by default, where no model is at hand (the planner), and on an MoE model (its routed experts
# stay frozen): Llama's decoder-layer projections (short names, as peft's target_modules take them). With a dense
# model, `ModelFacts.lora_targets` is its own list.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj", "down_proj")

# transformers' TP style names (base_model_tp_plan values) -> the role hfdist's own plan gives the module.
# "replicated_with_grad_allreduce" marks a norm computed on the rank's heads whose replicated weight needs the sum
# of every rank's gradient: the per-head norm hfdist splits with LocalNorm. Any other style (gather_output
# variants, packed or expert styles) is a layout hfdist's TP plan does not implement and is refused by name.
_STYLE_ROLES = {"colwise": "colwise", "rowwise": "rowwise", "replicated_with_grad_allreduce": "head_norms"}
_LAYER_PREFIX = "layers.*."
_ATTENTION = "self_attn."  # the part of an MoE architecture's plan hfdist's TP plan follows (module docstring)


class UnsupportedModelError(HfdistError, ValueError):
    """A model whose architecture has no entry in the registry (or a TP plan hfdist cannot follow)."""


@functools.cache
def transformers_tp_plan(model_type: str) -> dict[str, str]:
    """The decoder-layer part of transformers' `base_model_tp_plan` for `model_type`: module path relative to a
    decoder layer -> transformers' style name. Entries outside the decoder layers (hfdist splits the embedding
    and lm_head itself) are left out.

    Read from the config class's source without importing transformers (the planner sizes presets without torch or
    transformers, `hfdist plan`); from the class itself where the source does not spell the plan out.

    Raises:
        UnsupportedModelError: the config class ships no TP plan.
    """
    plan = _plan_in_source(model_type)
    if plan is None:
        from transformers import CONFIG_MAPPING

        plan = getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None)
    if not plan:
        raise UnsupportedModelError(
            f"transformers' {model_type} config ships no base_model_tp_plan, so hfdist cannot tell which projections "
            "tensor parallelism splits. Give its registry entry an explicit `tp_plan` "
            "(hfdist/models/registry.py), as transformers' plans are written.")
    return {key.removeprefix(_LAYER_PREFIX): style for key, style in plan.items() if key.startswith(_LAYER_PREFIX)}


def _plan_in_source(model_type: str) -> dict[str, str] | None:
    """`base_model_tp_plan` as the literal transformers' configuration module assigns it in the class whose
    `model_type` is `model_type`; None where the file or the literal is not there."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("transformers")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    models = Path(spec.submodule_search_locations[0]) / "models"
    # Its own module, or its family's (llama4_text's config lives in models/llama4/configuration_llama4.py).
    paths = [models / name / f"configuration_{name}.py" for name in (model_type, model_type.rsplit("_", 1)[0])]
    path = next((p for p in paths if p.is_file()), None)
    if path is None:
        return None
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ClassDef):
            continue
        values = {}
        for statement in node.body:
            target = statement.targets[0] if isinstance(statement, ast.Assign) else getattr(statement, "target", None)
            if isinstance(target, ast.Name) and getattr(statement, "value", None) is not None:
                values[target.id] = statement.value
        if "model_type" in values and "base_model_tp_plan" in values:
            try:
                if ast.literal_eval(values["model_type"]) == model_type:
                    return ast.literal_eval(values["base_model_tp_plan"])
            except ValueError:
                return None
    return None


@functools.cache
def _no_split_layer(model_type: str) -> str:
    """The decoder-layer class transformers keeps whole (`_no_split_modules`) in `model_type`'s causal LM."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping[type(AutoConfig.for_model(model_type))]
    return model_class._no_split_modules[0]


@dataclass(frozen=True)
class ModelFacts:
    """Everything architecture-specific hfdist uses; the fields hold what transformers does not ship.

    Attributes:
        model_type: the HF config's `model_type`.
        decoder_layer: class name of a decoder layer (the FSDP unit and the activation-checkpointing unit); None:
            the first of transformers' `_no_split_modules` for the architecture.
        tp_plan: decoder-layer projection / norm path -> transformers' style name; None: the config class's
            `base_model_tp_plan` (`transformers_tp_plan`).
        layer_norms: the RMSNorms on a decoder layer's residual stream (sequence-parallel under TP).
        qkv_bias: q/k/v projections always carry a bias (Qwen2); otherwise `config.attention_bias` decides.
        sliding_window_everywhere: a set `config.sliding_window` makes every layer's attention sliding (Mistral).
        window_from_layer_types: attention masks follow `config.layer_types`, full or sliding per layer (Qwen2/3).
        ignore_index: the label value the loss skips.
        moe: the mixture-of-experts facts (hfdist.models.moe), None for a dense architecture.
    """

    model_type: str
    decoder_layer_class: str | None = None
    tp_plan: Mapping[str, str] | None = None
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
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
    def decoder_layer(self) -> str:
        """Class name of a decoder layer: the entry's, else transformers' `_no_split_modules`."""
        return self.decoder_layer_class or _no_split_layer(self.model_type)

    def _paths(self, role: str) -> tuple[str, ...]:
        """The decoder-layer paths the TP plan gives `role` ("colwise", "rowwise", "head_norms"), in plan order."""
        plan = self.tp_plan if self.tp_plan is not None else transformers_tp_plan(self.model_type)
        if self.moe is not None:
            plan = {path: style for path, style in plan.items() if path.startswith(_ATTENTION)}
        unknown = sorted({style for style in plan.values() if style not in _STYLE_ROLES})
        if unknown:
            raise UnsupportedModelError(
                f"The {self.model_type} TP plan uses {', '.join(unknown)}, a layout hfdist's tensor parallelism does "
                f"not implement (it follows {', '.join(_STYLE_ROLES)}). Give the registry entry an explicit "
                "`tp_plan` in those terms (hfdist/models/registry.py), or train on a rung without tp.")
        return tuple(path for path, style in plan.items() if _STYLE_ROLES[style] == role)

    @property
    def colwise(self) -> tuple[str, ...]:
        """Decoder-layer projections split on their output dim by tensor parallelism."""
        return self._paths("colwise")

    @property
    def rowwise(self) -> tuple[str, ...]:
        """Decoder-layer projections split on their input dim by tensor parallelism."""
        return self._paths("rowwise")

    @property
    def head_norms(self) -> tuple[str, ...]:
        """RMSNorms applied per attention head (Qwen3's q_norm / k_norm): weight of size head_dim."""
        return self._paths("head_norms")

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
        """(in_features, out_features, has_bias) of each decoder-layer projection the architecture has, keyed by
        short name (of an MoE architecture: a dense layer's, whose MLP is `moe.dense_width` wide)."""
        h, hd = int(config.hidden_size), self.head_dim(config)
        i = self.moe.dense_width(config) if self.moe is not None else int(config.intermediate_size)
        heads = int(config.num_attention_heads)
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        attn_bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        qkv_bias = self.qkv_bias or attn_bias
        shapes = {"q_proj": (h, heads * hd, qkv_bias), "k_proj": (h, kv * hd, qkv_bias),
                  "v_proj": (h, kv * hd, qkv_bias), "o_proj": (heads * hd, h, attn_bias),
                  "gate_proj": (h, i, mlp_bias), "up_proj": (h, i, mlp_bias), "down_proj": (i, h, mlp_bias)}
        return {name: shapes[name] for name in self.lora_targets}

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


# Only what transformers does not say (the module docstring lists what it does).
REGISTRY: dict[str, ModelFacts] = {
    "llama": ModelFacts("llama"),
    "mistral": ModelFacts("mistral", sliding_window_everywhere=True),
    "qwen2": ModelFacts("qwen2", qkv_bias=True, window_from_layer_types=True),
    "qwen3": ModelFacts("qwen3", window_from_layer_types=True),
    # SmolLM3: Llama's layout; every 4th layer without rotary embeddings (config.no_rope_layers, read by its own
    # attention), and those layers slide when use_sliding_window is set (config.layer_types).
    "smollm3": ModelFacts("smollm3", window_from_layer_types=True),
    "qwen3_moe": ModelFacts("qwen3_moe", window_from_layer_types=True, moe=QWEN3_MOE),
    "mixtral": ModelFacts("mixtral", sliding_window_everywhere=True, moe=MIXTRAL),
    # Llama 4's text model: its qk norm is a weightless L2 norm; its chunked-attention layers are full attention at
    # the sequence lengths hfdist trains it on (hfdist.parallel.expert_check refuses longer ones).
    "llama4_text": ModelFacts("llama4_text", moe=LLAMA4_TEXT),
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
