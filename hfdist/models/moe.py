"""A mixture-of-experts model's MoE layers, found through the registry's MoE facts (hfdist.models.moe_facts), without
importing torch: the blocks themselves (`moe_layers`, for the surgery and the router statistics), the sizes that
decide parameters, FLOPs and memory (`MoeShape`, for the planner), and the LoRA targets that leave the routed
experts frozen (`moe_lora_config`).

transformers 5 keeps a layer's routed experts stacked in two 3-D parameters of one module (`experts.gate_up_proj`,
the gate and up projections of every expert concatenated, and `experts.down_proj`); a router (`gate` / `router`)
picks each token's top-k experts; Llama 4 adds a shared expert every token goes through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hfdist.models.moe_facts import MoeFacts

if TYPE_CHECKING:
    from torch import nn

__all__ = ["MoeFacts", "MoeLayer", "MoeShape", "causal_lm_of", "moe_layers", "moe_lora_config",
           "peft_converted_targets"]


@dataclass(frozen=True)
class MoeLayer:
    """One decoder layer's MoE block and where it sits."""

    index: int
    path: str  # the block's name in the causal LM
    block: nn.Module
    facts: MoeFacts

    @property
    def experts(self) -> nn.Module:
        """The module holding the stacked expert weights."""
        return self.block.get_submodule(self.facts.experts)

    @property
    def router(self) -> nn.Module:
        """The router (its weight: experts x hidden)."""
        return self.block.get_submodule(self.facts.router)


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The causal LM inside DDP / DeepSpeed (`.module`) and peft (`get_base_model`) wrappers."""
    inner, seen = model, set()
    while id(inner) not in seen:
        seen.add(id(inner))
        if hasattr(getattr(inner, "module", None), "named_modules"):
            inner = inner.module
        elif hasattr(inner, "get_base_model"):
            inner = inner.get_base_model()
    return inner


def moe_layers(model: nn.Module) -> list[MoeLayer]:
    """The MoE blocks of a registered MoE causal LM (or a peft / DDP wrapper around one); [] for a dense model."""
    from hfdist.models.registry import facts_for, is_supported

    causal_lm = causal_lm_of(model)
    if not is_supported(causal_lm) or facts_for(causal_lm).moe is None:
        return []
    facts = facts_for(causal_lm)
    layers = causal_lm.get_submodule(facts.layers)
    found = []
    for i in facts.moe.moe_layer_indices(causal_lm.config):
        if i < len(layers):
            path = f"{facts.layers}.{i}.{facts.moe.block}"
            found.append(MoeLayer(i, path, causal_lm.get_submodule(path), facts.moe))
    return found


def peft_converted_targets(model_type: str | None) -> frozenset[str]:
    """The projection names peft 0.21 turns into adapters on an MoE model's stacked experts (its conversion of
    transformers-4 target names, keyed by the architecture's conversion pattern): Qwen3-MoE's gate_proj, up_proj,
    down_proj (and its router, `gate`); empty for an architecture peft does not convert (Llama 4)."""
    from peft.utils.transformers_weight_conversion import _MOE_TARGET_MODULE_MAPPING
    from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN

    base = _MODEL_TO_CONVERSION_PATTERN.get(model_type, model_type)
    return frozenset(_MOE_TARGET_MODULE_MAPPING.get(base, {}))


def moe_lora_config(model: nn.Module, lora):
    """`lora` (a peft LoraConfig) for an MoE model, its routed experts left frozen on every rung: without the
    projection names peft 0.21 would turn into adapters on the stacked expert weights (`peft_converted_targets`;
    peft then also drops them from the dense layers). Those adapters (peft's ParamWrapper) interleave the experts in
    lora_B's columns (r x E, expert index fastest), which cannot be split by whole experts over ep ranks, and
    re-parametrise the whole stacked weight on every forward. Returned unchanged for a dense model or a pattern."""
    from dataclasses import replace

    from hfdist.models.registry import is_supported

    causal_lm = causal_lm_of(model)
    targets = getattr(lora, "target_modules", None)
    if not is_supported(causal_lm) or not moe_layers(causal_lm) or isinstance(targets, str) or not targets:
        return lora
    converted = peft_converted_targets(causal_lm.config.model_type)
    return replace(lora, target_modules={t for t in targets if t not in converted})


@dataclass(frozen=True)
class MoeShape:
    """The sizes of a config's MoE layers that decide parameters, FLOPs and memory (hfdist.models.shape)."""

    experts: int
    top_k: int
    expert_width: int
    shared_width: int  # 0: no shared expert
    layers: int  # decoder layers holding an MoE block (the others a dense MLP)

    @classmethod
    def from_config(cls, config: Any, facts: MoeFacts) -> "MoeShape":
        return cls(facts.num_experts(config), facts.top_k(config), facts.expert_width(config),
                   facts.shared_width(config), len(facts.moe_layer_indices(config)))

    def expert_params(self, hidden: int) -> int:
        """One MoE layer's routed experts (stacked gate, up and down weights)."""
        return self.experts * 3 * hidden * self.expert_width

    def block_params(self, hidden: int) -> int:
        """One MoE block: its routed experts, router and shared expert."""
        return self.expert_params(hidden) + self.experts * hidden + 3 * hidden * self.shared_width

    def active_params(self, hidden: int) -> int:
        """The weights one token's matmuls use in an MoE block: its top-k experts, the router, the shared expert."""
        return self.top_k * 3 * hidden * self.expert_width + self.experts * hidden + 3 * hidden * self.shared_width

    def activation_elements(self, hidden: int) -> tuple[int, int]:
        """(elements in the compute dtype, fp32 elements) one token's MoE block saves for backward: the router's
        input and its fp32 softmax (E), the token's k rows as dispatched (the sorted input the first matmul saves,
        the expert output the weighting saves), each expert's gate/up output, activation and down input (4 I per
        row, as a dense MLP's 4 I), and the shared expert's four I-wide tensors."""
        rows = self.top_k * (2 * hidden + 4 * self.expert_width)
        return hidden + rows + 4 * self.shared_width, 2 * self.experts
