"""An MoE model's router statistics during training: its load-balancing (aux) loss over the whole global batch, and
the tokens routed to each expert (the load an MoE fine-tune is watched by).

transformers' load-balancing loss (Switch Transformer's, as `load_balancing_loss_func` computes it over every MoE
layer of one forward) is

    aux = E * sum_e f_e * P_e,   f_e = C_e / N,   P_e = S_e / N

with C_e the top-k assignments to expert e and S_e the sum of the softmax probabilities of e, both summed over the
tokens of every MoE layer, and N the rows counted (tokens x MoE layers). It is not a sum over tokens: f_e and P_e
are means over the batch, so a data-parallel rank computing it on its own tokens gets another number. hfdist
computes it over the global micro-batch, exactly as one process holding every rank's tokens would:

    C_e and N are summed over the ranks (one all-reduce; C has no gradient, as in transformers);
    rank r's share E * sum_e f_e * S_e^(r) / N has the gradient of its own tokens' probabilities;
    the shares sum to aux, and their gradients to aux's, whatever the layout.

The ranks whose routers see different tokens are every rank of the rungs that hold MoE models (data parallel,
expert parallel, and tensor parallel: hfdist's MoE blocks route each tp rank's own sequence shard), so the sum is
over the world. Each micro-step's aux is divided by the gradient-accumulation steps (the step's aux is the mean of
its micro-batches'). The routers are read through forward hooks while `recording()` is on: a training forward,
not an activation-checkpointing recompute in backward or an evaluation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from hfdist.models.moe import moe_layers

__all__ = ["RouterRecorder", "router_recorder"]


class RouterRecorder:
    """Forward hooks on an MoE model's routers: the logits of each MoE layer while recording, turned into the aux
    loss term and the tokens routed per expert.

    Args:
        distributed: sum the statistics over the world (every rank's routers see other tokens); False: this
            process's tokens are the whole batch.

    Attributes:
        num_experts, top_k: the routing's. coef: the model's router_aux_loss_coef (0 where it has no aux loss).
    """

    def __init__(self, model: nn.Module, distributed: bool = True) -> None:
        layers = moe_layers(model)
        if not layers:
            raise ValueError("RouterRecorder needs a model with MoE layers")
        config, facts = _config(model), layers[0].facts
        self.num_experts, self.top_k = facts.num_experts(config), facts.top_k(config)
        self.coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if facts.aux_loss else 0.0
        self._logits_at = 1 if facts.weights_input else 0  # Llama 4's router returns (scores, logits)
        self._recording, self.distributed = False, distributed
        self._logits: list[torch.Tensor] = []
        # Tokens routed to each expert per MoE layer, summed over the window's micro-steps: this rank's, everyone's.
        self._local = torch.zeros(self.num_experts, dtype=torch.float64)
        self._global = torch.zeros(self.num_experts, dtype=torch.float64)
        for layer in layers:
            layer.router.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args, output) -> None:
        if self._recording:
            self._logits.append(output[self._logits_at])

    @contextlib.contextmanager
    def recording(self) -> Iterator[RouterRecorder]:
        """Record the routers of the forwards run inside (one training micro-step)."""
        self._logits, self._recording = [], True
        try:
            yield self
        finally:
            self._recording = False

    def _statistics(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(C: top-k assignments per expert, S: summed probabilities per expert, N: rows) of the recorded layers,
        computed as transformers' load_balancing_loss_func does (softmax of the logits, top-k of it)."""
        counts = probs = None
        rows = 0
        for logits in self._logits:
            weights = torch.softmax(logits, dim=-1)
            chosen = torch.topk(weights, self.top_k, dim=-1).indices.reshape(-1)
            c = torch.bincount(chosen, minlength=self.num_experts).to(torch.float32)
            s = weights.float().sum(dim=0)
            counts, probs = (c, s) if counts is None else (counts + c, probs + s)
            rows += logits.shape[0]
        return counts, probs, torch.tensor(float(rows), device=counts.device)

    def aux_term(self, grad_accum: int = 1, value_scale: float = 1.0) -> torch.Tensor | None:
        """This rank's part of `router_aux_loss_coef x aux` for the recorded micro-step (module docstring), to add
        to its loss, and the micro-step's tokens per expert into the metrics window; collective over the world.
        None when nothing was recorded or the model has no aux loss.

        Its gradient is the rank's share's; its value is coef x aux / (grad_accum x value_scale) on every rank, so
        a Trainer that scales each rank's loss by `value_scale` and averages the ranks logs coef x aux.
        """
        if not self._logits:
            return None
        counts, probs, rows = self._statistics()
        totals = torch.cat([counts, probs.detach(), rows.view(1)])
        if self.distributed and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(totals)
        e, layers = self.num_experts, len(self._logits)
        global_counts, global_probs, n = totals[:e], totals[e:2 * e], totals[2 * e]
        self._local += counts.detach().double().cpu() / layers
        self._global += global_counts.detach().double().cpu() / layers
        self._logits = []
        if self.coef == 0.0:
            return None
        share = self.coef * e * (global_counts / n * probs / n).sum() / grad_accum
        value = self.coef * e * (global_counts / n * global_probs / n).sum() / (grad_accum * value_scale)
        return share + (value - share).detach()

    def take_window(self, steps: int) -> tuple[dict[str, float], dict[str, float]]:
        """(this rank's, the global batch's) tokens routed to each expert per MoE layer per step since the last call:
        the least and the most loaded expert, and the most loaded over the mean (1: balanced)."""
        figures = []
        for totals in (self._local, self._global):
            if steps <= 0 or not totals.any():
                figures.append({})
                continue
            per_step = totals / steps
            figures.append({"expert_tokens_min": float(per_step.min()), "expert_tokens_max": float(per_step.max()),
                            "expert_load_imbalance": float(per_step.max() / per_step.mean())})
        self._local, self._global = torch.zeros_like(self._local), torch.zeros_like(self._global)
        return figures[0], figures[1]


def _config(model: nn.Module):
    from hfdist.models.moe import causal_lm_of

    return causal_lm_of(model).config


def router_recorder(model: nn.Module) -> RouterRecorder | None:
    """The model's RouterRecorder (made on first use and kept on the model), or None for a dense model."""
    recorder = getattr(model, "hfdist_router", None)
    if recorder is None:
        recorder = RouterRecorder(model) if moe_layers(model) else False
        model.hfdist_router = recorder
    return recorder or None
