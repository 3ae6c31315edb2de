"""Chunked causal-LM loss (hfdist.models.chunked_loss), fused (the default) and recomputing: the same loss and
gradients as HF's unchunked one, with a 32K vocabulary, for full fine-tuning, LoRA and bf16; the head swap leaves
the model as it was; where the fused loss cannot read lm_head's weight it says why and recomputes instead."""

from __future__ import annotations

import math

import pytest
import torch

from hfdist.models.build import build_model
from hfdist.models.chunked_loss import causal_lm_loss, chunked_token_sum_cross_entropy, fused_loss_blocker

VOCAB = 32768


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
    """Loss and every gradient within rel 1e-6 of HF's own loss (num_items_in_batch: a global token count, here
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
    assert ours.item() == pytest.approx(reference.item(), rel=1e-6)
    assert got.keys() == expected.keys() and "lm_head.weight" in got
    for name, grad in expected.items():
        assert _rel(got[name], grad) <= 1e-6, name
    # The head is restored: the model computes logits again, and its parameter names are unchanged.
    assert type(model.lm_head) is torch.nn.Linear
    assert model(input_ids=batch["input_ids"][:, :3]).logits.shape == (2, 3, VOCAB)


def test_unchunked_switch_and_plain_mean():
    """chunk_size=None is one chunk; num_items_in_batch=None is this batch's own token mean, as HF's default."""
    model = build_model("llama-tiny", vocab_size=VOCAB, seed=0)
    batch = _batch()
    with torch.no_grad():
        reference = model(**batch).loss.item()
        assert causal_lm_loss(model, batch, chunk_size=None).item() == pytest.approx(reference, rel=1e-6)
        assert causal_lm_loss(model, batch, chunk_size=8).item() == pytest.approx(reference, rel=1e-6)
        assert causal_lm_loss(model, batch, chunk_size=8, fused=False).item() == pytest.approx(reference, rel=1e-6)


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
    assert ours.item() == pytest.approx(reference.item(), rel=1e-6)
    assert got.keys() == expected.keys() and all("lora_" in name for name in got)
    for name, grad in expected.items():
        assert _rel(got[name], grad) <= 1e-6, name
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        bf16_reference = model(**batch).loss
        bf16_ours = causal_lm_loss(model, batch, chunk_size=8)
    assert bf16_ours.dtype == torch.float32
    # HF casts the bf16 logits to fp32 before its cross-entropy, as each chunk does: the same numbers.
    assert bf16_ours.item() == pytest.approx(bf16_reference.item(), rel=1e-6)
    base = build_model("llama-tiny", vocab_size=VOCAB, seed=0)
    runs = {}
    for fused in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = causal_lm_loss(base, batch, chunk_size=8, fused=fused)
        loss.backward()
        runs[fused] = (loss.item(), _grads(base))
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-6)
    assert runs[True][1].keys() == runs[False][1].keys()
    for name, grad in runs[True][1].items():
        assert grad.dtype == torch.float32 and _rel(grad, runs[False][1][name]) <= 1e-2, name


def test_nothing_of_the_logits_is_saved_for_backward():
    """The autograd graph of the fused loss keeps only the gradients it computed (shaped like the hidden states
    and lm_head's weight); the recomputing loss keeps less than one chunk's logits; the unchunked one does keep
    them (the checks can fail)."""
    model = build_model("llama-tiny", vocab_size=VOCAB, seed=0)
    batch = _batch(seq=64)
    hidden = model.model(batch["input_ids"]).last_hidden_state.detach().requires_grad_()

    def saved(chunk_size, fused) -> list[tuple[int, ...]]:
        shapes = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            chunked_token_sum_cross_entropy(model.lm_head, hidden, batch["labels"], chunk_size, fused)
        return shapes

    gradients = sorted([(2 * 64, 64), (VOCAB, 64)])
    assert sorted(saved(16, True)) == sorted(saved(None, True)) == gradients
    assert max(math.prod(shape) for shape in saved(16, False)) < 2 * 16 * VOCAB
    assert max(math.prod(shape) for shape in saved(None, False)) >= 2 * 64 * VOCAB


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
    assert ours == pytest.approx(reference, rel=1e-6)
