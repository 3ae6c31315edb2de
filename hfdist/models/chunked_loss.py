"""The causal-LM loss without the whole batch's logits: lm_head + cross-entropy one sequence chunk at a time.

A batch's fp32 logits (B x S x V x 4 bytes: 2 GiB for Llama-3's 128K vocabulary at B=1, S=4096) are usually the
largest activation of a fine-tune. `causal_lm_loss` runs the model with its lm_head swapped, for that one call, for
a `_ChunkedLossHead`: HF's ForCausalLM forward hands it the final hidden states (B x S x H) and gets back the summed
token loss where it expects logits. The head calls the real lm_head on `chunk_size` positions of the sequence at a
time, each chunk under non-reentrant activation checkpointing, so one chunk's logits (and their log-softmax) exist
at a time: in the forward, and again in the backward, which recomputes them chunk by chunk.

Swapping the head rather than calling the decoder and lm_head separately keeps every wrapper's contract: the call
still enters through the outer model (DDP's forward, DeepSpeed's engine, FSDP2's root unshard), and the real lm_head
module is called per chunk, so the hooks on it run for each chunk (tensor parallelism's input/output layouts,
ZeRO-3's parameter gather). Under tensor parallelism with loss parallelism each chunk's logits are vocab-sharded and
their cross-entropy runs under `loss_parallel()`, which the caller enters. A pipeline's last stage, which is not a
HF model, calls `chunked_token_sum_cross_entropy` on its hidden states directly.

The sum over chunks is the same sum of token losses as over the whole batch, added in another order (fp32: relative
differences near 1e-7). chunk_size=None (or >= S) is one chunk without recomputation: the unchunked loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hfdist.config.finetune import DEFAULT_LOSS_CHUNK_SIZE
from hfdist.errors import HfdistError
from hfdist.models.loss import IGNORE_INDEX, shift_labels, token_sum_cross_entropy
from hfdist.models.registry import facts_for, is_supported

__all__ = ["DEFAULT_LOSS_CHUNK_SIZE", "VocabShardedLogitsError", "causal_lm_loss", "chunked_token_sum_cross_entropy",
           "find_causal_lm_head", "loss_parallel_active"]


class VocabShardedLogitsError(HfdistError, RuntimeError):
    """lm_head returns vocab-sharded DTensor logits outside `loss_parallel()`."""


def loss_parallel_active() -> bool:
    """Whether `torch.distributed.tensor.parallel.loss_parallel()` is in effect.

    torch keeps no public flag for it; while active it installs DTensor handlers for these ops.
    """
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    return torch.ops.aten._log_softmax.default in handlers


def _replicated_sequence(hidden: torch.Tensor) -> torch.Tensor:
    """The hidden states as lm_head takes them whole: a sequence-sharded DTensor (sequence parallelism) is gathered
    once here, since slicing it per chunk would gather the whole sequence for every chunk."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(hidden, DTensor) and any(not p.is_replicate() for p in hidden.placements):
        return hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
    return hidden


def _chunk_token_sum(lm_head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed fp32 cross-entropy of one chunk: its logits live only inside this call."""
    from torch.distributed.tensor import DTensor

    logits = lm_head(hidden)
    if isinstance(logits, DTensor) and not loss_parallel_active():
        raise VocabShardedLogitsError(
            "lm_head returns vocab-sharded logits: compute the loss (tp_causal_lm_loss) and call loss.backward() "
            "inside torch.distributed.tensor.parallel.loss_parallel().")
    loss = token_sum_cross_entropy(logits, targets)
    return loss.to_local() if isinstance(loss, DTensor) else loss


def chunked_token_sum_cross_entropy(lm_head: nn.Module, hidden: torch.Tensor, shifted_labels: torch.Tensor,
                                    chunk_size: int | None = DEFAULT_LOSS_CHUNK_SIZE) -> torch.Tensor:
    """Summed fp32 token cross-entropy of `lm_head(hidden)` against `shifted_labels`, `chunk_size` sequence
    positions at a time (None: all at once), never holding more than one chunk's logits.

    Args:
        lm_head: the output projection module (called once per chunk, so its hooks run).
        hidden: final hidden states (B, S, H), a plain tensor or a DTensor (tensor parallelism).
        shifted_labels: (B, S) targets aligned with `hidden` (hfdist.models.loss.shift_labels), IGNORE_INDEX
            where no loss is taken.

    Returns:
        A plain 0-dim fp32 tensor: the sum over every scored position.
    """
    seq = hidden.shape[1]
    targets = shifted_labels.to(hidden.device)
    if chunk_size is None or chunk_size >= seq:
        return _chunk_token_sum(lm_head, hidden, targets)
    hidden = _replicated_sequence(hidden)
    total = None
    for start in range(0, seq, chunk_size):
        part = checkpoint(_chunk_token_sum, lm_head, hidden[:, start:start + chunk_size],
                          targets[:, start:start + chunk_size], use_reentrant=False)
        total = part if total is None else total + part
    return total


class _ChunkedLossHead(nn.Module):
    """Stands in for lm_head during one forward: takes the hidden states, returns the summed token loss."""

    def __init__(self, lm_head: nn.Module, shifted_labels: torch.Tensor, chunk_size: int | None):
        super().__init__()
        # Held outside _modules: the swap must not rename lm_head's parameters (lm_head.lm_head.weight).
        object.__setattr__(self, "lm_head", lm_head)
        self.shifted_labels = shifted_labels
        self.chunk_size = chunk_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return chunked_token_sum_cross_entropy(self.lm_head, hidden, self.shifted_labels, self.chunk_size)


def find_causal_lm_head(model: nn.Module) -> tuple[nn.Module, str] | None:
    """(the causal LM inside `model`, its lm_head attribute name), looking through DDP / DeepSpeed (`.module`) and
    peft (`get_base_model`); None when it is not a registered architecture (hfdist.models.registry), whose
    forward is known to end in a plain lm_head and the standard causal-LM loss."""
    inner = model
    while hasattr(inner, "module") and isinstance(inner.module, nn.Module):
        inner = inner.module
    if hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    if not is_supported(inner):
        return None
    head = facts_for(inner).head
    return (inner, head) if isinstance(getattr(inner, head, None), nn.Module) else None


@contextlib.contextmanager
def _head_swapped(causal_lm: nn.Module, name: str, shifted: torch.Tensor, chunk_size: int | None) -> Iterator[None]:
    real = getattr(causal_lm, name)
    setattr(causal_lm, name, _ChunkedLossHead(real, shifted, chunk_size))
    try:
        yield
    finally:
        setattr(causal_lm, name, real)


def causal_lm_loss(model: nn.Module, batch: Mapping[str, torch.Tensor],
                   num_items_in_batch: int | torch.Tensor | None = None,
                   chunk_size: int | None = DEFAULT_LOSS_CHUNK_SIZE) -> torch.Tensor:
    """The causal-LM loss of `model` on `batch`: summed token cross-entropy (fp32) / `num_items_in_batch`.

    Labels are shifted as HF does (pad with IGNORE_INDEX, drop the first position); a batch may bring them already
    shifted as `shift_labels` (context parallelism cuts rows after shifting). The lm_head runs in chunks of
    `chunk_size` sequence positions (None: unchunked); a model of an architecture hfdist does not know gets HF's
    own loss instead.

    Args:
        model: a causal LM, possibly inside peft, DDP, DeepSpeed's engine, FSDP2 or tensor parallelism.
        batch: `input_ids`, optional `labels` (default: input_ids), and any other model inputs.
        num_items_in_batch: the token count to divide by (summed over accumulation steps and data-parallel ranks
            when the gradients are to be a global token mean); None: this batch's own count.

    Returns:
        A plain 0-dim fp32 tensor.
    """
    labels = batch.get("labels", batch["input_ids"])
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
    found = find_causal_lm_head(model)
    if found is None:
        return model(**inputs, labels=labels, num_items_in_batch=num_items_in_batch).loss
    targets = batch["shift_labels"] if "shift_labels" in batch else shift_labels(labels)
    with _head_swapped(*found, targets, chunk_size):  # the model's forward as HF's own loss calls it
        loss = model(**inputs).logits
    if num_items_in_batch is None:
        num_items_in_batch = (targets != IGNORE_INDEX).sum()
    return loss / num_items_in_batch
