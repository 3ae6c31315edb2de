"""Fused lm_head + cross-entropy: the summed token loss and its gradients in one pass over the logits, chunk by chunk.

`fused_linear_cross_entropy` is a custom autograd function. Its forward runs, for `chunk_rows` tokens at a time,
logits = hidden @ W^T (+ b) -> fp32 log-sum-exp -> the summed token loss, and straight away the gradient of that sum
with respect to the logits (softmax - one-hot) and through it the gradients of the hidden states, of the weight and
of the bias. Only those gradients outlive the chunk (saved for backward: a hidden-states-sized and a weight-sized
tensor, the latter handed to the weight as its .grad without a copy): no logits are kept and its backward
recomputes nothing, it only scales the stored gradients by the gradient the sum gets, in place, once; a second
backward with the same incoming gradient (the zero-bubble schedules' input pass, then weight pass) returns them
again. Against the plain loss (the whole batch's logits and log-softmax held until backward) it does the same three
matmuls and less elementwise work; against the chunked loss with activation checkpointing (hfdist.models.
chunked_loss's recomputing path) it saves one matmul and the log-softmax per chunk.

Why not torch 2.13's `F.linear_cross_entropy(..., options=LinearCrossEntropyOptions(batch_chunk_size=...))`, which
also computes the gradients in its forward and is about as fast (measured: docs/loss.md, "torch's fused op";
`tests/unit/test_fused_loss.py::test_torch_op_still_costs_what_hfdist_avoids` fails once torch changes this, the cue
to switch):
- its backward receives materialised zero gradients for the op's three extra outputs (its hidden-, weight- and
  bias-gradient buffers), so it holds a second gradient-sized buffer when backward starts, while every activation
  is still alive: the step's peak grows by lm_head's weight (and the hidden states) in the gradients' dtype;
- with bf16 / fp16 inputs (autocast, FSDP2's mixed precision) it sums the loss in bf16 (HF's loss is fp32);
- a second backward (zero-bubble schedules) needs allow_retain_graph=True: a gradient-sized copy per call;
- it has no vocab-parallel path (tensor parallelism: `vocab_parallel_cross_entropy` below).

Vocab-parallel (tensor parallelism): `vocab_parallel_cross_entropy` takes the lm_head weight as a DTensor sharded
on the vocabulary (Shard(0), the TP plan's ColwiseParallel) and computes on the local shard: each rank's row max
is all-reduced (max), the sum of exponentials and the target logit (from the rank whose shard holds the target,
zero elsewhere) are all-reduced (sum) together, so every rank returns the same loss. The hidden states' gradient is
a partial sum over the vocabulary shards; it leaves as a Partial DTensor gradient, so DTensor's redistribution
reduces it (reduce-scatter under sequence parallelism), the collectives the unfused loss runs too.

Precision: the matmuls run in the dtype F.linear would use (the autocast dtype under autocast, else the weight's:
bf16 under FSDP2's mixed precision), the softmax and the loss in fp32, and the gradients are accumulated in the
dtype of the tensor they belong to, as autograd does for the unfused loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from hfdist.errors import HfdistError
from hfdist.models.loss import IGNORE_INDEX

__all__ = ["FusedLossTargetError", "fused_linear_cross_entropy", "vocab_parallel_cross_entropy"]


class FusedLossTargetError(HfdistError, ValueError):
    """A label outside the vocabulary (and not IGNORE_INDEX)."""


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(hidden, weight) computes in: autocast's where it is on, else the operands' own."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and hidden.is_floating_point():
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _holds_no_data(t: torch.Tensor) -> bool:
    """A fake or meta tensor (the planner's simulated step): only shapes, so no check may read its values."""
    from torch._subclasses.fake_tensor import is_fake

    return t.is_meta or is_fake(t)


def _check_targets(targets: torch.Tensor, vocab: int) -> None:
    if _holds_no_data(targets):
        return
    bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        raise FusedLossTargetError(
            f"Labels hold {int(bad.sum())} value(s) outside the vocabulary [0, {vocab}) other than {IGNORE_INDEX}: "
            "the tokenizer and the model disagree on the vocabulary; resize the model's embeddings to the "
            "tokenizer or fix the labels.")


def _token_sum_and_grads(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, chunk_rows: int, vocab_start: int, group: dist.ProcessGroup | None,
                         needs: tuple[bool, bool, bool], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(summed fp32 loss, d loss / d hidden, ... / d weight, ... / d bias), the gradients None where not needed.
    `weight` (and `bias`) may be this rank's vocabulary rows [vocab_start, vocab_start + V_local) of a `group` that
    holds the rest; `hidden` and `targets` are then the same on every rank of the group."""
    need_hidden, need_weight, need_bias = needs
    w = weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = torch.zeros_like(weight) if need_weight else None
    grad_bias = torch.zeros_like(bias) if need_bias else None
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        # A call per chunk: its logits are freed on return, before the next chunk's exist.
        loss += _chunk(hidden[rows].to(dtype), w, b, targets[rows], vocab_start, group,
                       grad_hidden[rows] if need_hidden else None, grad_weight, grad_bias)
    return loss, grad_hidden, grad_weight, grad_bias


def _chunk(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, t: torch.Tensor, vocab_start: int,
           group: dist.ProcessGroup | None, grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None,
           grad_bias: torch.Tensor | None) -> torch.Tensor:
    """One chunk's summed fp32 loss; writes its rows of `grad_hidden` and adds to `grad_weight` / `grad_bias`."""
    local_vocab = w.shape[0]
    logits = F.linear(h, w, b).float()  # fresh (a copy when the matmul ran in bf16)
    local = t - vocab_start
    owned = (local >= 0) & (local < local_vocab)  # IGNORE_INDEX is negative: never owned
    index = local.clamp(0, local_vocab - 1).unsqueeze(1)
    row_max = logits.amax(dim=1)
    if group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    target_logit = logits.gather(1, index).squeeze(1).masked_fill_(~owned, 0.0)
    logits.sub_(row_max.unsqueeze(1)).exp_()
    sums = torch.stack([logits.sum(dim=1), target_logit])
    if group is not None:
        dist.all_reduce(sums, group=group)  # the sum of exponentials and the owning shard's target logit
    exp_sum, target_logit = sums
    valid = t != IGNORE_INDEX
    loss = (row_max + exp_sum.log() - target_logit).masked_fill_(~valid, 0.0).sum()
    if grad_hidden is None and grad_weight is None and grad_bias is None:
        return loss
    # d loss / d logits = softmax - one-hot on scored rows, zero on the others (a zero row scale, not a mask pass).
    grad_logits = logits.mul_((valid / exp_sum).unsqueeze(1))
    grad_logits.scatter_add_(1, index, (owned & valid).float().neg_().unsqueeze(1))
    g = grad_logits.to(w.dtype)
    # Each product in the matmul dtype, then taken into its gradient's dtype, as autograd's casts do.
    if grad_hidden is not None:
        if grad_hidden.dtype == g.dtype:
            torch.mm(g, w, out=grad_hidden)
        else:
            grad_hidden.copy_(g @ w)
    if grad_weight is not None:
        if grad_weight.dtype == g.dtype:
            grad_weight.addmm_(g.t(), h)
        else:
            grad_weight += (g.t() @ h).to(grad_weight.dtype)
    if grad_bias is not None:
        grad_bias += g.sum(dim=0).to(grad_bias.dtype)
    return loss


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """The loss with gradients computed in the forward; the backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_rows, vocab_start, group):
        needs = tuple(ctx.needs_input_grad[:3])
        dtype = _compute_dtype(hidden, weight)
        # The matmuls' dtype is chosen above and applied explicitly, so autocast must not re-cast them.
        with torch.autocast(hidden.device.type, enabled=False):
            loss, *grads = _token_sum_and_grads(hidden, weight, bias, targets, chunk_rows, vocab_start, group,
                                                needs, dtype)
        # Saved for backward (not kept on ctx), so that autograd releases them as soon as backward has run, and the
        # weight's gradient can become its .grad without a copy.
        ctx.save_for_backward(*grads)
        ctx.scaled_by = None
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grads = ctx.saved_tensors
        if ctx.scaled_by is None:
            # Scaled in place, once (no second weight-sized tensor); `.data`, so the saved tensors' version (checked
            # when a second backward unpacks them) stays that of the forward.
            for g in grads:
                if g is not None:
                    g.data.mul_(grad_loss.to(g.dtype))
            ctx.scaled_by = grad_loss
        elif not _holds_no_data(grad_loss) and not torch.equal(grad_loss, ctx.scaled_by):
            raise RuntimeError("The fused loss's backward ran again with another incoming gradient: its gradients "
                               "were computed once, in the forward, and already scaled; compute the loss again "
                               "instead of retaining its graph.")
        return (*grads, None, None, None, None)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               targets: torch.Tensor, chunk_rows: int | None = None, vocab_start: int = 0,
                               vocab_size: int | None = None,
                               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The summed fp32 cross-entropy of `hidden @ weight.T + bias` against `targets`,
    `chunk_rows` tokens at a time, the gradients computed in the forward (module docstring).

    Args:
        hidden: (N, H) plain tensor.
        weight: (V_local, H): the whole vocabulary, or rows [vocab_start, vocab_start + V_local) of it when `group`
            holds the others. `bias`: (V_local,) or None.
        targets: (N,) token ids, IGNORE_INDEX where no loss is taken.
        chunk_rows: tokens per chunk (None: all N at once).
        vocab_size: the whole vocabulary's size (default V_local), to check the targets against.
        group: the process group the vocabulary is sharded over (None: not sharded).

    Returns:
        A 0-dim fp32 tensor: the sum over every scored token (the same on every rank of `group`).
    """
    _check_targets(targets, vocab_size or weight.shape[0])
    rows = max(1, chunk_rows or hidden.shape[0])
    targets = targets.to(hidden.device)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        return _FusedLinearCrossEntropy.apply(hidden, weight, bias, targets, rows, vocab_start, group)
    with torch.autocast(hidden.device.type, enabled=False):  # evaluation: the loss only
        return _token_sum_and_grads(hidden, weight, bias, targets, rows, vocab_start, group, (False,) * 3,
                                    _compute_dtype(hidden, weight))[0]


def vocab_parallel_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 targets: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """`fused_linear_cross_entropy` with an lm_head weight that is a DTensor sharded on the vocabulary (Shard(0) on
    a 1-D mesh: tensor parallelism's ColwiseParallel) and hidden states (B, S, H) that are a DTensor on the same mesh
    (any placement: a sequence-sharded one is gathered once) or a plain tensor, the same on every rank.

    Returns:
        A plain 0-dim fp32 tensor, the same on every rank of the mesh.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = weight.device_mesh
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    # The local rows' gradient is this shard's share of the whole vocabulary's: a partial sum over the mesh.
    local_hidden = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    vocab = weight.shape[0]
    rows, vocab_start = Shard(0).local_shard_size_and_offset(vocab, mesh.size(), mesh.get_local_rank())
    local_weight = weight.to_local()
    assert local_weight.shape[0] == rows, "DTensor's Shard(0) rows differ from its own local_shard_size_and_offset"
    local_bias = bias.to_local() if isinstance(bias, DTensor) else bias
    return fused_linear_cross_entropy(local_hidden.flatten(0, -2), local_weight, local_bias, targets.flatten(),
                                      chunk_rows, vocab_start, vocab, mesh.get_group())
