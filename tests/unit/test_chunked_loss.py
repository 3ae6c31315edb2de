"""Chunked causal-LM loss (hfdist.models.chunked_loss), fused (the default) and recomputing: the same loss and
gradients as HF's unchunked one, with a 32K vocabulary, for full fine-tuning, LoRA and bf16; the head swap leaves
the model as it was; where the fused loss cannot read lm_head's weight it says why and recomputes instead."""

from __future__ import annotations

import pytest
import torch

from hfdist.metrics.memory import LiveTensorBytes
from hfdist.models.build import build_model
from hfdist.models.chunked_loss import causal_lm_loss, chunked_token_sum_cross_entropy, fused_loss_blocker

from tolerances import U_BF16, order_rtol

VOCAB = 32768
# The fused and the chunked loss sum what HF's loss sums, in another order: each logit row's exponentials and each
# hidden-state gradient row are sums of VOCAB fp32 terms: order_rtol(VOCAB) = 6.1e-5 (tests/tolerances.py) bounds the
# loss and every gradient (the layers below lm_head reorder nothing). Measured: at most 8.9e-7 (a norm weight's
# gradient, fused), so the bound is 69 x that.
RTOL = order_rtol(VOCAB)
# bf16 autocast, fused against recomputing: the two fp32 paths round the logits' gradient to bf16 (unit roundoff
# 3.9e-3) from values computed in another order, and each bf16 matmul the gradient then crosses on its way to a weight
# (lm_head's, then 3 to 4 per decoder layer for layer 0's) may round them one bf16 ulp apart again: 13 roundings,
# 13 x U_BF16 = 5.1e-2 if all added up. Measured: at most 9.1e-3; the bound is 5.6 x that.
BF16_RTOL = 13 * U_BF16


def _batch(seq: int = 40) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :5] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference in norm: elementwise ratios mean nothing where fp32 sums cancel to near zero."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize(("chunk_size", "fused"), [(7, True), (16, True), (64, True), (None, True), (7, False),
                                                   (64, False)])
def test_chunked_loss_and_gradients_equal_hf_loss(chunk_size, fused):
    """Loss and every gradient within RTOL of HF's own loss (num_items_in_batch: a global token count, here
    twice this batch's), chunks not dividing the sequence included (7)."""
    model = build_model("llama-tiny", vocab_size=VOCAB, seed=0)
    batch = _batch()
    n = int((batch["labels"][:, 1:] != -100).sum())
    reference = model(**batch, num_items_in_batch=2 * n).loss
    reference.backward()
    expected = _grads(model)
    ours = causal_lm_loss(model, batch, num_items_in_batch=2 * n, chunk_size=chunk_size, fused=fused)
    ours.backward()
    got = _grads(model)
    assert ours.dtype == torch.float32
    assert ours.item() == pytest.approx(reference.item(), rel=RTOL)
    assert got.keys() == expected.keys() and "lm_head.weight" in got
    for name, grad in expected.items():
        assert _rel(got[name], grad) <= RTOL, name
    # The head is restored: the model computes logits again, and its parameter names are unchanged.
    assert type(model.lm_head) is torch.nn.Linear
    assert model(input_ids=batch["input_ids"][:, :3]).logits.shape == (2, 3, VOCAB)


def test_unchunked_switch_and_plain_mean():
    """chunk_size=None is one chunk; num_items_in_batch=None is this batch's own token mean, as HF's default."""
    model = build_model("llama-tiny", vocab_size=VOCAB, seed=0)
    batch = _batch()
    with torch.no_grad():
        reference = model(**batch).loss.item()
        assert causal_lm_loss(model, batch, chunk_size=None).item() == pytest.approx(reference, rel=RTOL)
        assert causal_lm_loss(model, batch, chunk_size=8).item() == pytest.approx(reference, rel=RTOL)
        assert causal_lm_loss(model, batch, chunk_size=8, fused=False).item() == pytest.approx(reference, rel=RTOL)


def test_lora_and_bf16_keep_an_fp32_loss():
    """Through a peft LoRA model (only adapters train: lm_head gets no gradient) and under bf16 autocast the loss is
    fp32 and equals HF's; under autocast the fused loss's gradients are those of the recomputing one (the same bf16
    products, taken into fp32 as autograd's casts do)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_model("llama-tiny", vocab_size=VOCAB, seed=0),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    batch = _batch()
    reference = model(**batch).loss
    reference.backward()
    expected = _grads(model)
    ours = causal_lm_loss(model, batch, chunk_size=8)
    ours.backward()
    got = _grads(model)
    assert ours.item() == pytest.approx(reference.item(), rel=RTOL)
    assert got.keys() == expected.keys() and all("lora_" in name for name in got)
    for name, grad in expected.items():
        assert _rel(got[name], grad) <= RTOL, name
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        bf16_reference = model(**batch).loss
        bf16_ours = causal_lm_loss(model, batch, chunk_size=8)
    assert bf16_ours.dtype == torch.float32
    # HF casts the bf16 logits to fp32 before its cross-entropy, as each chunk does: the same numbers.
    assert bf16_ours.item() == pytest.approx(bf16_reference.item(), rel=RTOL)
    base = build_model("llama-tiny", vocab_size=VOCAB, seed=0)
    runs = {}
    for fused in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = causal_lm_loss(base, batch, chunk_size=8, fused=fused)
        loss.backward()
        runs[fused] = (loss.item(), _grads(base))
    assert runs[True][0] == pytest.approx(runs[False][0], rel=RTOL)
    assert runs[True][1].keys() == runs[False][1].keys()
    for name, grad in runs[True][1].items():
        assert grad.dtype == torch.float32 and _rel(grad, runs[False][1][name]) <= BF16_RTOL, name


def test_nothing_of_the_logits_outlives_the_forward():
    """What the fused loss's forward leaves for backward is the gradients it computed (shaped like the hidden states
    and lm_head's weight); the recomputing loss keeps less than one chunk's logits; the unchunked one does keep them
    (the checks can fail)."""
    model = build_model("llama-tiny", vocab_size=VOCAB, seed=0)
    batch = _batch(seq=64)
    hidden = model.model(batch["input_ids"]).last_hidden_state.detach().requires_grad_()

    def kept(chunk_size, fused) -> int:
        live = LiveTensorBytes()
        with live:
            loss = chunked_token_sum_cross_entropy(model.lm_head, hidden, batch["labels"], chunk_size, fused)
            left = live.live  # bytes created in the forward and still held (by `loss`'s graph)
        del loss
        return left

    gradients = (2 * 64 * 64 + VOCAB * 64) * 4
    for chunk_size in (16, None):
        assert gradients <= kept(chunk_size, True) <= gradients + 1024
    assert kept(16, False) < 2 * 16 * VOCAB * 4
    assert kept(None, False) >= 2 * 64 * VOCAB * 4


def test_a_head_the_fused_loss_cannot_read_recomputes_and_says_why():
    """LoRA on lm_head (a peft layer computes its output) and a forward hook on it (as DeepSpeed ZeRO-3 gathers its
    weight in one) take the recomputing path, with a warning naming the reason; the loss is still HF's."""
    from peft import LoraConfig, get_peft_model

    model = build_model("llama-tiny", vocab_size=VOCAB, seed=0)
    assert fused_loss_blocker(model.lm_head) is None
    handle = model.lm_head.register_forward_pre_hook(lambda module, args: None)
    assert "forward hooks" in fused_loss_blocker(model.lm_head)
    handle.remove()
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]))
    batch = _batch()
    with torch.no_grad():
        reference = model(**batch).loss.item()
        with pytest.warns(UserWarning, match="fused loss does not apply here .lm_head is a Linear, not a plain"):
            ours = causal_lm_loss(model, batch, chunk_size=8).item()
    assert ours == pytest.approx(reference, rel=RTOL)
