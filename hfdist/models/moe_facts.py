"""The mixture-of-experts facts of the registered MoE architectures (Qwen3-MoE, Mixtral, Llama 4's text model), read
from a config without torch: where the router, the stacked experts and a shared expert are, which layers are MoE,
how a token's weights are computed, whether the model adds a load-balancing loss. The registry
(hfdist.models.registry) holds one per MoE architecture; hfdist.models.moe finds them in a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MoeFacts", "QWEN3_MOE", "MIXTRAL", "LLAMA4_TEXT"]


@dataclass(frozen=True)
class MoeFacts:
    """Where one architecture keeps its experts, and how it routes.

    Attributes:
        block: the MoE block of a decoder layer, relative to the layer ("mlp", Llama 4: "feed_forward"); a dense
            layer keeps its MLP (gate/up/down projections) under the same name.
        router: the router inside the block ("gate", Llama 4: "router"), whose weight is (experts, hidden).
        experts: the module holding the stacked expert parameters, inside the block.
        shared_expert: the MLP every token also goes through, inside the block (Llama 4), or None.
        experts_field: the config field giving the number of routed experts.
        expert_width_field: the config field giving one expert's intermediate width.
        dense_width_field: the config field giving a dense (non-MoE) layer's MLP width.
        shared_width_field: the config field giving the shared expert's width (None: no shared expert).
        transposed: the stacked weights are (experts, in, out) (Llama 4) rather than (experts, out, in).
        weights_input: the router's weight scales a token's input to an expert (Llama 4: the sigmoid of its top-k
            logits) rather than the expert's output (softmax over the experts, top-k, Qwen3-MoE / Mixtral).
        aux_loss: the causal LM adds `router_aux_loss_coef` x the load-balancing loss to its loss (Qwen3-MoE,
            Mixtral; Llama 4 has none).
    """

    block: str
    router: str
    experts: str = "experts"
    shared_expert: str | None = None
    experts_field: str = "num_experts"
    expert_width_field: str = "moe_intermediate_size"
    dense_width_field: str = "intermediate_size"
    shared_width_field: str | None = None
    transposed: bool = False
    weights_input: bool = False
    aux_loss: bool = True
    layer_rule: str = "all"  # which layers hold the MoE block: "all", "qwen3" or "llama4" (moe_layer_indices)

    def num_experts(self, config: Any) -> int:
        """Routed experts per MoE layer."""
        return int(getattr(config, self.experts_field))

    def top_k(self, config: Any) -> int:
        """Experts each token is routed to."""
        return int(config.num_experts_per_tok)

    def expert_width(self, config: Any) -> int:
        """One expert's intermediate width."""
        return int(getattr(config, self.expert_width_field))

    def dense_width(self, config: Any) -> int:
        """A dense layer's MLP intermediate width."""
        return int(getattr(config, self.dense_width_field))

    def shared_width(self, config: Any) -> int:
        """The shared expert's intermediate width (0: none)."""
        return int(getattr(config, self.shared_width_field)) if self.shared_width_field else 0

    def moe_layer_indices(self, config: Any) -> list[int]:
        """The decoder layers that hold an MoE block (the others a dense MLP), as transformers builds them; read from
        a config's raw fields too (a preset's, before transformers derives its own lists)."""
        n = int(config.num_hidden_layers)
        if self.layer_rule == "qwen3":
            step = int(getattr(config, "decoder_sparse_step", 1) or 1)
            dense = set(getattr(config, "mlp_only_layers", None) or [])
            return [i for i in range(n) if i not in dense and self.num_experts(config) > 0 and (i + 1) % step == 0]
        if self.layer_rule == "llama4":
            listed = getattr(config, "moe_layers", None)
            step = int(getattr(config, "interleave_moe_layer_step", 1) or 1)
            return list(listed) if listed is not None else list(range(step - 1, n, step))
        return list(range(n))

    def stacked_shapes(self, config: Any) -> dict[str, tuple[int, int, int]]:
        """The stacked parameters' shapes (experts first), by name inside the experts module."""
        e, h, i = self.num_experts(config), int(config.hidden_size), self.expert_width(config)
        if self.transposed:
            return {"gate_up_proj": (e, h, 2 * i), "down_proj": (e, i, h)}
        return {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}


QWEN3_MOE = MoeFacts(block="mlp", router="gate", layer_rule="qwen3")
MIXTRAL = MoeFacts(block="mlp", router="gate", experts_field="num_local_experts",
                   expert_width_field="intermediate_size")
LLAMA4_TEXT = MoeFacts(block="feed_forward", router="router", shared_expert="shared_expert",
                       experts_field="num_local_experts", expert_width_field="intermediate_size",
                       dense_width_field="intermediate_size_mlp", shared_width_field="intermediate_size",
                       transposed=True, weights_input=True, aux_loss=False, layer_rule="llama4")
