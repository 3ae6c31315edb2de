"""The fused lm_head + cross-entropy (hfdist.models.fused_loss) on plain tensors: the unfused loss's numbers up to
fp32 rounding, nothing of the logits kept, no matmul in backward, no weight gradient computed for a frozen lm_head,
an fp32 loss and autograd's precision under bf16; and what torch's own fused op still costs that hfdist's avoids."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hfdist.metrics.memory import LiveTensorBytes
from hfdist.models.fused_loss import FusedLossTargetError, fused_linear_cross_entropy

from tolerances import U_BF16, order_rtol

N, H, V = 96, 32, 1000
# Every value compared below is a sum of at most V fp32 terms taken in another order than the unfused loss takes
# them (a row's sum of exponentials, a hidden-state gradient's row): order_rtol(V) = 1.1e-5 (tests/tolerances.py).
# Measured: at most 4.9e-7 (the hidden states' gradient, chunks of 7 rows), so the bound is 22 x that.
RTOL = order_rtol(V)
# bf16: the gradient's operands are rounded to bf16 (unit roundoff 3.9e-3) from fp32 values that the two paths
# compute in another order, so a term may land one bf16 rounding apart: about U_BF16 relative in norm. Measured
# 2.7e-3 (fp32 weights under autocast) and 3.6e-3 (bf16 weights); 5 x U_BF16 = 2e-2 is 5.4 x the larger.
BF16_RTOL = 5 * U_BF16


def _inputs(bias: bool = False, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g, dtype=dtype)
    weight = (torch.randn(V, H, generator=g) * 0.2).to(dtype)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype) if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    targets[:7] = -100
    targets[40:60] = -100  # a whole chunk of 16 (rows 42..57) scores nothing
    return hidden, weight, b, targets


def _loss_and_grads(fn, hidden, weight, bias, targets, scale=0.01):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    loss = fn(*leaves, targets)
    (loss * scale).backward()
    return loss.detach(), [t.grad if t is not None else None for t in leaves]


class MatmulFlops(TorchDispatchMode):
    """FLOPs of the matmuls run while on, in-place accumulating ones (addmm_) included, which torch's
    FlopCounterMode does not count."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            a, b = args[-2], args[-1]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return out


def _unfused(hidden, weight, bias, targets):
    return F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, ignore_index=-100, reduction="sum")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("chunk_rows", [None, 16, 7])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_equals_unfused_loss_and_gradients(chunk_rows, bias):
    """Loss and the gradients of hidden, weight and bias within RTOL of the unfused fp32 loss's (backward from
    loss x 0.01) and of the fp64 result: fp32 rounding of the same sums is all that separates them."""
    inputs = _inputs(bias)
    ref_loss, ref_grads = _loss_and_grads(_unfused, *inputs)
    truth_loss, truth_grads = _loss_and_grads(_unfused, *(t.double() if t is not None and t.is_floating_point()
                                                          else t for t in inputs))
    loss, grads = _loss_and_grads(lambda h, w, b, t: fused_linear_cross_entropy(h, w, b, t, chunk_rows), *inputs)
    assert loss.dtype == torch.float32
    assert _rel(loss, ref_loss) <= RTOL and _rel(loss, truth_loss) <= RTOL
    for got, ref, truth in zip(grads, ref_grads, truth_grads):
        if ref is None:
            assert got is None
            continue
        assert got.dtype == ref.dtype
        assert _rel(got, ref) <= RTOL and _rel(got, truth) <= RTOL


def test_backward_only_scales_the_stored_gradients():
    """The backward runs no matmul (the unfused loss's runs two) and allocates nothing, the gradients follow the
    incoming one, and nothing of the logits outlives the forward: what it leaves are the gradients (hidden and
    weight sized)."""
    hidden, weight, _, targets = _inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    live = LiveTensorBytes()
    with live:
        loss = fused_linear_cross_entropy(h, w, None, targets, chunk_rows=16)
        left = live.live
    grads_bytes = (N * H + V * H) * 4
    assert left <= grads_bytes + 1024
    assert live.peak < grads_bytes + 2 * 16 * V * 4  # one chunk's logits (and a few vectors) at a time
    live = LiveTensorBytes()
    with MatmulFlops() as counter, live:
        (loss * 2.5).backward()
    assert counter.flops == 0
    assert live.peak < 1024  # scaled in place and adopted as .grad: no weight- or hidden-sized copy
    _, ref_grads = _loss_and_grads(_unfused, hidden, weight, None, targets, scale=2.5)
    assert _rel(h.grad, ref_grads[0]) <= RTOL and _rel(w.grad, ref_grads[1]) <= RTOL
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = _unfused(h2, w2, None, targets)
    with MatmulFlops() as counter:
        loss.backward()
    assert counter.flops == 2 * (2 * N * H * V)  # the check above can fail


def test_a_retained_graph_gives_its_gradients_again():
    """A second backward through a retained graph with the same incoming gradient (a zero-bubble pipeline schedule
    computes input and weight gradients in two passes) gives the same gradients again; with another gradient (they
    were scaled in place by the first) it refuses."""
    hidden, weight, _, targets = _inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, None, targets, chunk_rows=16) * 0.5
    (dh,) = torch.autograd.grad(loss, [h], retain_graph=True)
    (dw,) = torch.autograd.grad(loss, [w], retain_graph=True)
    _, (ref_h, ref_w, _) = _loss_and_grads(_unfused, hidden, weight, None, targets, scale=0.5)
    assert _rel(dh, ref_h) <= RTOL and _rel(dw, ref_w) <= RTOL
    with pytest.raises(RuntimeError, match="ran again with another incoming gradient"):
        torch.autograd.grad(loss * 3, [w])


@pytest.mark.parametrize("trainable", [(True, True), (True, False), (False, False)])
def test_only_the_needed_gradients_are_computed(trainable):
    """A frozen lm_head (LoRA) costs no weight-gradient matmul; a forward without gradients (evaluation) only the
    logits' matmul. Counted in FLOPs: 2 N H V per matmul."""
    hidden, weight, _, targets = _inputs()
    h = hidden.clone().requires_grad_(trainable[0])
    w = weight.clone().requires_grad_(trainable[1])
    with MatmulFlops() as counter:
        loss = fused_linear_cross_entropy(h, w, None, targets, chunk_rows=16)
    assert counter.flops == (1 + sum(trainable)) * 2 * N * H * V
    if any(trainable):
        loss.backward()
    assert (h.grad is not None, w.grad is not None) == trainable
    assert _rel(loss.detach(), _unfused(hidden, weight, None, targets)) <= RTOL


def test_bf16_computes_as_autograd_does():
    """Under bf16 autocast over fp32 weights (the single / DDP rungs) and with bf16 weights (FSDP2's mixed precision,
    DeepSpeed's bf16): an fp32 loss, gradients in each tensor's own dtype, equal to the unfused loss's up to bf16
    rounding of the same products."""
    hidden, weight, _, targets = _inputs()
    fused = lambda h, w, b, t: fused_linear_cross_entropy(h, w, b, t, chunk_rows=16)  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_grads = _loss_and_grads(_unfused, hidden, weight, None, targets)
        loss, grads = _loss_and_grads(fused, hidden, weight, None, targets)
    assert loss.dtype == torch.float32 and [g.dtype for g in grads[:2]] == [torch.float32] * 2
    assert _rel(loss, ref_loss) <= RTOL  # the same bf16 logits, the same fp32 softmax
    for got, ref in zip(grads[:2], ref_grads[:2]):
        assert _rel(got, ref) <= BF16_RTOL
    bf16 = [t.bfloat16() if t.is_floating_point() else t for t in (hidden, weight)]
    ref_loss, ref_grads = _loss_and_grads(_unfused, *bf16, None, targets)
    loss, grads = _loss_and_grads(fused, *bf16, None, targets)
    assert loss.dtype == torch.float32 and [g.dtype for g in grads[:2]] == [torch.bfloat16] * 2
    assert _rel(loss, ref_loss) <= RTOL
    for got, ref in zip(grads[:2], ref_grads[:2]):
        assert _rel(got, ref) <= BF16_RTOL


def test_labels_outside_the_vocabulary_are_refused():
    hidden, weight, _, targets = _inputs()
    targets[3] = V
    with pytest.raises(FusedLossTargetError, match=r"outside the vocabulary \[0, 1000\)"):
        fused_linear_cross_entropy(hidden, weight, None, targets)


def test_torch_op_still_costs_what_hfdist_avoids():
    """Why the fused loss is not torch 2.13's F.linear_cross_entropy (hfdist.models.fused_loss's docstring): its
    backward receives materialised zero gradients as large as the hidden states' and the weight's gradients, it
    sums a bf16 input's loss in bf16, and it refuses a second backward. When this fails, torch has changed: measure
    its op again (benchmarks/bench_chunked_loss.py) and use it where it is as lean."""
    hidden, weight, _, targets = _inputs()
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=16)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = F.linear_cross_entropy(h, w, targets, reduction="sum", options=options)
    live = LiveTensorBytes()
    with live:
        loss.backward(retain_graph=True)
    assert live.peak >= (N * H + V * H) * 4  # hfdist's: < 1024 (test_backward_only_scales_the_stored_gradients)
    with pytest.raises(RuntimeError, match="called twice"):
        loss.backward()
    bf16 = F.linear_cross_entropy(hidden.bfloat16(), weight.bfloat16(), targets, reduction="sum", options=options)
    assert bf16.dtype == torch.bfloat16
