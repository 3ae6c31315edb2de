"""Training FLOPs per token of the registered architectures (hfdist.models.registry), and MFU.

Conventions (the PaLM appendix B / Megatron / torchtitan `get_num_flop_per_token` count):
- Matmul FLOPs: a matmul with an N-parameter weight costs 2N FLOPs per token forward, 2N for the gradient of its
  input and 2N for the gradient of its weight: 6N for a trained weight. A frozen weight (the LoRA base) skips the
  weight-gradient matmul: 4N. N counts the q/k/v/o (GQA aware), gate/up/down projections of every layer and the
  lm_head; the embedding is a lookup, not a matmul, and is left out (a tied lm_head still does its matmul, so it
  is counted). An MoE layer counts what a token's matmuls use: its top-k routed experts (gate, up, down), the router
  and a shared expert (active parameters; the dispatch's all-to-all and the expert sort are not FLOPs).
- Attention: 12·L·H·Q·T per token (QKᵀ and ·V, 2 FLOPs per multiply-add, forward + 2× in backward). Causal
  masking makes half of these FLOPs useless, and causal-aware counts (FlashAttention's benchmarks) halve the
  term; like torchtitan and PaLM we count full attention, so MFU here is comparable with theirs. FlashAttention's
  backward recomputation is not counted either (it is not model work).
- Not counted: norms, softmax, rotary embeddings, SiLU·mul, residual adds, the loss and the optimizer. These are
  elementwise, well under 1% of the matmul FLOPs at Llama sizes; torch's FlopCounterMode leaves them out too.
MFU = achieved model FLOP/s per device / dense peak FLOP/s of the device (no 2:4 sparsity; hfdist.metrics.peaks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hfdist.models.registry import LORA_TARGETS
from hfdist.models.shape import ModelShape

if TYPE_CHECKING:  # the counts need no torch: the planner's cost model (hfdist.plan.cost) imports them torch-free
    import torch

__all__ = ["LORA_TARGETS", "TokenFlops", "matmul_params", "flops_per_token", "model_token_flops",
           "model_flops_per_token", "batch_lengths", "mfu", "tflops_per_device"]


def _shape(config: Any) -> ModelShape:
    return ModelShape.from_config(config)


def matmul_params(config: Any) -> int:
    """Weights that take part in a matmul: every layer's projection weights plus the lm_head; of an MoE layer, the
    ones a token's matmuls use (its top-k experts, the router, the shared expert: active parameters, so MFU counts
    the work done, not the experts held).

    Biases, norms and the embedding table (a lookup) are left out; a tied lm_head is counted once.
    """
    return _shape(config).matmul_params


def flops_per_token(config: Any, seq_len: int, *, include_attention: bool = True, lora: bool = False,
                    lora_r: int = 16, lora_targets: tuple[str, ...] | list[str] = LORA_TARGETS,
                    trainable_fraction: float | None = None) -> float:
    """Training FLOPs (forward + backward) per token of a config; see the module docstring for conventions.

    Args:
        config: a HF config of a registered architecture, e.g. `hfdist.models.presets.load_config("llama-3.1-8b")`.
        seq_len: tokens per sequence the attention spans (the packed block length).
        include_attention: add the 12·L·H·Q·T attention term (full, not causal-halved).
        lora: LoRA fine-tune: adds 6·N_lora for the adapters (rank `lora_r` on `lora_targets` in every layer)
            and freezes the base unless `trainable_fraction` says otherwise.
        trainable_fraction: share of the base matmul weights that get a weight gradient; default 1.0 for a full
            fine-tune, 0.0 with `lora`. FLOPs = (4 + 2·fraction)·N_matmul + 6·N_lora + attention.

    A LoRA count is an upper bound by 2·(q, k, v and their lora_A params of layer 0) per token: nothing before
    layer 0 trains, so autograd skips those input gradients (<0.2% for Llama-3.1-8B).
    """
    shape = _shape(config)
    lora_params = shape.layers * shape.lora_layer_params(lora_r, tuple(lora_targets)) if lora else 0
    if trainable_fraction is None:
        trainable_fraction = 0.0 if lora else 1.0
    return shape.training_flops_per_token(seq_len if include_attention else 0, lora_params=lora_params,
                                          trainable_fraction=trainable_fraction)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose `.config` is the model's, below DDP / DeepSpeed wrappers (peft and FSDP2 models are not
    wrappers in this sense; DeepSpeed's engine has a `.config` of its own, hence the field check)."""
    while not hasattr(getattr(model, "config", None), "num_hidden_layers") and hasattr(model, "module"):
        model = model.module
    return model


def _model_lora_params(model: torch.nn.Module) -> int:
    """LoRA adapter matmul params from peft's layer attributes (shapes of the base layer, so sharding-proof)."""
    total = 0
    for module in model.modules():
        ranks = getattr(module, "r", None)
        if not isinstance(ranks, dict) or not hasattr(module, "lora_A"):
            continue
        for adapter in getattr(module, "active_adapters", ()):
            if adapter in module.lora_A:
                total += ranks[adapter] * (module.in_features + module.out_features)
    return total


@dataclass(frozen=True)
class TokenFlops:
    """A model's training FLOPs split by what they scale with (conventions in the module docstring).

    Attributes:
        matmul: FLOPs every token costs alike: (4 + 2·trainable fraction)·N_matmul + 6·N_lora.
        attention: 12·L·H·Q, the attention FLOPs of one token per position of its sequence: a sequence of T tokens
            costs attention·T² (full attention, not causal-halved).
    """

    matmul: float
    attention: float

    def per_token(self, seq_len: int) -> float:
        """FLOPs per token of sequences `seq_len` long (flops_per_token's figure)."""
        return self.matmul + self.attention * seq_len

    def of_batch(self, tokens: float, sum_squared_lengths: float) -> float:
        """FLOPs of batches holding `tokens` real tokens in sequences whose squared lengths sum to the second
        argument (batch_lengths gives both)."""
        return self.matmul * tokens + self.attention * sum_squared_lengths


def model_token_flops(model: torch.nn.Module) -> TokenFlops:
    """TokenFlops of a built (possibly peft-wrapped, sharded or DDP/DeepSpeed-wrapped) HF model.

    Shapes come from `model.config`; LoRA adapters are counted from peft's layers, and a peft model's base is
    taken as frozen (an lm_head in peft's `modules_to_save` would make the count low by 2·N_lm_head per token).

    Raises:
        hfdist.models.registry.UnsupportedModelError: an architecture the registry does not describe.
    """
    inner = _unwrap(model)
    lora_params = _model_lora_params(inner)
    config = inner.config
    frozen_base = lora_params > 0 or hasattr(inner, "peft_config")
    shape = _shape(config)
    matmul = shape.training_flops_per_token(0, lora_params=lora_params, trainable_fraction=0.0 if frozen_base else 1.0)
    return TokenFlops(matmul=matmul, attention=shape.training_flops_per_token(1) - shape.training_flops_per_token(0))


def model_flops_per_token(model: torch.nn.Module, seq_len: int, *, include_attention: bool = True) -> float:
    """flops_per_token for a built model (see model_token_flops) and sequences `seq_len` long."""
    counts = model_token_flops(model)
    return counts.per_token(seq_len) if include_attention else counts.matmul


def _row_positions(input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                   position_ids: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(positions of each token inside its sequence, 0/1 mask of real tokens) as (B, S) tensors, or Nones."""
    mask = attention_mask.long() if attention_mask is not None and attention_mask.dim() == 2 else None
    if position_ids is not None and position_ids.dim() == 2:
        shape = mask.shape if mask is not None else input_ids.shape[:2] if input_ids is not None else position_ids.shape
        return position_ids.expand(shape), mask
    if mask is not None:
        return mask.cumsum(dim=1) - 1, mask
    return None, None


def batch_lengths(input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor | int, torch.Tensor | int]:
    """(real tokens, sum over sequences of length²) of one model input batch, for TokenFlops.of_batch.

    `input_ids` may be any (batch, seq, ...) tensor of the batch (inputs_embeds when there are no ids).

    Sequences are what the attention spans: documents packed into a row with `position_ids` restarting at 0
    (padding-free batches), else each row's real tokens (a 2-D attention_mask, left or right padding), else whole
    rows. A 4-D mask is not read (its blocks would need the mask's own layout): rows or position_ids count.
    The sum of squares comes without a device sync: a sequence of T tokens at positions 0..T-1 has
    Σ(2·pos + 1) = T², so it is one masked sum over tokens. Results are tensors on the batch's device when computed
    from tensors (read them later, once per logging window), ints otherwise.
    """
    positions, mask = _row_positions(input_ids, attention_mask, position_ids)
    if positions is not None:
        odd = 2 * positions + 1
        if mask is None:
            return positions.numel(), odd.sum()
        return mask.sum(), (odd * mask).sum()
    if input_ids is None:
        return 0, 0
    rows, seq = input_ids.shape[0], input_ids.shape[1]
    return rows * seq, rows * seq * seq


def tflops_per_device(tokens_per_second_per_device: float, flops_per_token: float) -> float:
    """Achieved model TFLOP/s per device.

    tokens_per_second_per_device is the global token rate / world size: under TP and PP the ranks of one replica
    share each token's FLOPs, so a rank's own token count (which sees every token of its replica) must be divided
    by tp·pp first.
    """
    return tokens_per_second_per_device * flops_per_token / 1e12


def mfu(tokens_per_second_per_device: float, flops_per_token: float, peak: float) -> float:
    """Model FLOPs utilisation (0..1): achieved model FLOP/s per device over the device's dense peak FLOP/s.

    Same token-rate convention as tflops_per_device. With LoRA pass the LoRA-aware flops_per_token (4·N base):
    counting 6·N would credit weight gradients that are never computed.
    """
    if peak <= 0:
        raise ValueError(f"peak FLOP/s must be positive, got {peak}.")
    return tokens_per_second_per_device * flops_per_token / peak
