"""The causal-LM loss without the whole batch's logits: lm_head + cross-entropy one sequence chunk at a time.

A batch's fp32 logits (B x S x V x 4 bytes: 2 GiB for Llama-3's 128K vocabulary at B=1, S=4096) are usually the
largest activation of a fine-tune. `causal_lm_loss` runs the model's own forward with its lm_head replaced, for that
one call, by a `_LossHead`: HF's ForCausalLM forward hands it the final hidden states (B x S x H) and gets back the
summed token loss where it expects logits (so `.logits` of that forward's output is the loss). Replacing the head
rather than calling the decoder and lm_head separately keeps every wrapper's contract: the call still enters through
the outer model (DDP's forward, DeepSpeed's engine, FSDP2's root unshard, so lm_head's weight is the gathered one
while the loss runs). A pipeline's last stage, which is not a HF model, calls `chunked_token_sum_cross_entropy` on
its hidden states directly.

Two ways to compute a chunk, the same numbers up to fp32 rounding of the same sums in another order:
- fused (the default; hfdist.models.fused_loss, which says why it is not torch's `F.linear_cross_entropy`): each
  chunk's logits -> loss and, in the same pass, the gradients of the hidden states and of lm_head's weight (and
  bias); nothing of the logits is kept and backward only scales those gradients. Under tensor parallelism it computes
  the vocab-parallel softmax itself on lm_head's vocab-sharded weight (loss_parallel() is then not needed). It reads
  lm_head's weight directly, so it runs only where that is the module's whole computation (`fused_loss_blocker`);
- recomputing (fused=False, and where the fused loss does not apply, with a warning): the real lm_head module is
  called per chunk under non-reentrant activation checkpointing, so its hooks run for each chunk (DeepSpeed ZeRO-3's
  parameter gather, an adapter on lm_head), and backward recomputes each chunk's logits. Under tensor parallelism
  each chunk's logits are vocab-sharded and their cross-entropy runs under `loss_parallel()`, which the caller
  enters (for backward too).

A chunk is `chunk_size` sequence positions of every row of the batch (B x chunk_size tokens' logits at a time);
chunk_size=None (or >= S) is the whole sequence: fused, one pass; not fused, the plain unchunked loss.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hfdist.config.finetune import DEFAULT_LOSS_CHUNK_SIZE
from hfdist.errors import HfdistError
from hfdist.models.fused_loss import fused_linear_cross_entropy, vocab_parallel_cross_entropy
from hfdist.models.loss import IGNORE_INDEX, shift_labels, token_sum_cross_entropy
from hfdist.models.registry import facts_for, is_supported
from hfdist.torch_private import loss_parallel_active

__all__ = ["DEFAULT_LOSS_CHUNK_SIZE", "VocabShardedLogitsError", "causal_lm_loss", "chunked_token_sum_cross_entropy",
           "find_causal_lm_head", "fused_loss_blocker"]


class VocabShardedLogitsError(HfdistError, RuntimeError):
    """lm_head returns vocab-sharded DTensor logits outside `loss_parallel()`."""


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


def fused_loss_blocker(lm_head: nn.Module, hidden: torch.Tensor | None = None) -> str | None:
    """Why the fused loss cannot run on `lm_head` (and `hidden`, the states it gets), or None when it can.

    The fused loss reads lm_head's weight and bias and computes `hidden @ weight.T + bias` itself, so lm_head must
    be a plain Linear whose weight is the whole matrix while the model's forward runs: plain (DDP, ZeRO-1/2, the
    gathered root of FSDP2) or the vocab-sharded DTensor of tensor parallelism, whose layout hooks it replaces.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(lm_head, nn.Linear) or type(lm_head).forward is not nn.Linear.forward:
        return (f"lm_head is a {type(lm_head).__name__}, not a plain Linear (an adapter or a quantised layer "
                "computes its own output)")
    if isinstance(lm_head, FSDPModule):
        return "lm_head is an FSDP2 unit of its own, whose weight is gathered only by its own forward"
    weight = lm_head.weight
    if isinstance(weight, DTensor):
        if weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
            return (f"lm_head's weight is a DTensor placed {tuple(weight.placements)} on a {weight.device_mesh.ndim}"
                    "-D mesh, not tensor parallelism's vocabulary split (Shard(0) on the tp mesh)")
        if isinstance(hidden, DTensor) and hidden.device_mesh != weight.device_mesh:
            return "the hidden states are a DTensor on another mesh than lm_head's weight"
    elif lm_head._forward_pre_hooks or lm_head._forward_hooks:
        return ("lm_head has forward hooks (DeepSpeed ZeRO-3 gathers its partitioned weight in one), which a loss "
                "reading the weight directly would bypass")
    elif isinstance(hidden, DTensor):
        return "the hidden states are a DTensor but lm_head's weight is not"
    if not weight.is_floating_point() or tuple(weight.shape) != (lm_head.out_features, lm_head.in_features):
        return f"lm_head's weight is a {weight.dtype} tensor of shape {tuple(weight.shape)}, not the whole matrix"
    return None


def _warn_unfused(reason: str) -> None:
    warnings.warn(f"The fused loss does not apply here ({reason}): each loss chunk's logits are recomputed in "
                  "backward instead (the same numbers, one more lm_head matmul per chunk).", stacklevel=3)


def _fused_token_sum(lm_head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor,
                     chunk_size: int | None) -> torch.Tensor:
    """The fused loss on a head `fused_loss_blocker` accepts: vocab-parallel where its weight is a DTensor."""
    from torch.distributed.tensor import DTensor

    rows = None if chunk_size is None else chunk_size * hidden.shape[0]  # chunk_size positions of every row
    if isinstance(lm_head.weight, DTensor):
        return vocab_parallel_cross_entropy(hidden, lm_head.weight, lm_head.bias, targets, rows)
    return fused_linear_cross_entropy(hidden.flatten(0, -2), lm_head.weight, lm_head.bias, targets.flatten(), rows)


def chunked_token_sum_cross_entropy(lm_head: nn.Module, hidden: torch.Tensor, shifted_labels: torch.Tensor,
                                    chunk_size: int | None = DEFAULT_LOSS_CHUNK_SIZE,
                                    fused: bool = True) -> torch.Tensor:
    """Summed fp32 token cross-entropy of `lm_head(hidden)` against `shifted_labels`, `chunk_size` sequence
    positions at a time (None: all at once), never holding more than one chunk's logits.

    Args:
        lm_head: the output projection module.
        hidden: final hidden states (B, S, H), a plain tensor or a DTensor (tensor parallelism).
        shifted_labels: (B, S) targets aligned with `hidden` (hfdist.models.loss.shift_labels), IGNORE_INDEX
            where no loss is taken.
        fused: compute the gradients with the loss (hfdist.models.fused_loss) where `fused_loss_blocker` allows,
            else (or with False) call lm_head per chunk and recompute each chunk's logits in backward.

    Returns:
        A plain 0-dim fp32 tensor: the sum over every scored position.
    """
    seq = hidden.shape[1]
    targets = shifted_labels.to(hidden.device)
    if fused:
        blocker = fused_loss_blocker(lm_head, hidden)
        if blocker is None:
            return _fused_token_sum(lm_head, hidden, targets, chunk_size)
        _warn_unfused(blocker)
    if chunk_size is None or chunk_size >= seq:
        return _chunk_token_sum(lm_head, hidden, targets)
    hidden = _replicated_sequence(hidden)
    total = None
    for start in range(0, seq, chunk_size):
        part = checkpoint(_chunk_token_sum, lm_head, hidden[:, start:start + chunk_size],
                          targets[:, start:start + chunk_size], use_reentrant=False)
        total = part if total is None else total + part
    return total


class _LossHead(nn.Module):
    """Stands in for lm_head during one forward: hidden states in, `loss_of` them out (the summed token loss).

    It holds a function, not the real head module, so the real head's parameters keep their names while it is
    out of the model (a submodule would rename them lm_head.lm_head.*)."""

    def __init__(self, loss_of: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.loss_of = loss_of

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.loss_of(hidden)


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
def _head_replaced(causal_lm: nn.Module, name: str, stand_in: nn.Module) -> Iterator[None]:
    """`causal_lm.<name>` is `stand_in` inside the block, the real head again after it (errors included)."""
    real = getattr(causal_lm, name)
    setattr(causal_lm, name, stand_in)
    try:
        yield
    finally:
        setattr(causal_lm, name, real)


def causal_lm_loss(model: nn.Module, batch: Mapping[str, torch.Tensor],
                   num_items_in_batch: int | torch.Tensor | None = None,
                   chunk_size: int | None = DEFAULT_LOSS_CHUNK_SIZE, fused: bool = True) -> torch.Tensor:
    """The causal-LM loss of `model` on `batch`: summed token cross-entropy (fp32) / `num_items_in_batch`.

    Labels are shifted as HF does (pad with IGNORE_INDEX, drop the first position); a batch may bring them already
    shifted as `shift_labels` (context parallelism cuts rows after shifting). The lm_head runs in chunks of
    `chunk_size` sequence positions (None: the whole sequence), fused (gradients computed with the loss) unless
    `fused` is False or `fused_loss_blocker` names a reason (module docstring); a model of an architecture hfdist
    does not know gets HF's own loss instead.

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
    causal_lm, name = found
    targets = batch["shift_labels"] if "shift_labels" in batch else shift_labels(labels)
    if num_items_in_batch is None:
        num_items_in_batch = (targets != IGNORE_INDEX).sum()
    loss_of = functools.partial(chunked_token_sum_cross_entropy, getattr(causal_lm, name),
                                shifted_labels=targets, chunk_size=chunk_size, fused=fused)
    with _head_replaced(causal_lm, name, _LossHead(loss_of)):
        summed = model(**inputs).logits  # what the head returned: the summed token loss
    return summed / num_items_in_batch
