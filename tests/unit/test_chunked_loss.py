"""Chunked causal-LM loss (hfdist.models.chunked_loss): the same loss and gradients as HF's unchunked one, with a
32K vocabulary, for full fine-tuning, LoRA and bf16; the head swap leaves the model as it was."""

from __future__ import annotations

import pytest
import torch

from hfdist.models.build import build_model
from hfdist.models.chunked_loss import causal_lm_loss, chunked_token_sum_cross_entropy

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


@pytest.mark.parametrize("chunk_size", [7, 16, 64])
def test_chunked_loss_and_gradients_equal_hf_loss(chunk_size):
    """Loss (rel 1e-6) and every gradient equal HF's own loss, chunks not dividing the sequence included (7)."""
    model = build_model("llama-tiny", vocab_size=VOCAB, seed=0)
    batch = _batch()
    n = int((batch["labels"][:, 1:] != -100).sum())
    reference = model(**batch, num_items_in_batch=2 * n).loss
    reference.backward()
    expected = _grads(model)
    ours = causal_lm_loss(model, batch, num_items_in_batch=2 * n, chunk_size=chunk_size)
    ours.backward()
    got = _grads(model)
    assert ours.dtype == torch.float32
    assert ours.item() == pytest.approx(reference.item(), rel=1e-6)
    assert got.keys() == expected.keys() and "lm_head.weight" in got
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)
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


def test_lora_and_bf16_keep_an_fp32_loss():
    """Through a peft LoRA model (only adapters train) and under bf16 autocast the loss is fp32 and equals HF's."""
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
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        bf16_reference = model(**batch).loss
        bf16_ours = causal_lm_loss(model, batch, chunk_size=8)
    assert bf16_ours.dtype == torch.float32
    # HF casts the bf16 logits to fp32 before its cross-entropy, as each chunk does: the same numbers.
    assert bf16_ours.item() == pytest.approx(bf16_reference.item(), rel=1e-6)


def test_only_one_chunk_of_logits_is_saved_for_backward():
    """The autograd graph keeps no tensor with the whole batch's logits: nothing saved for backward has B x S x V
    elements, and the largest saved tensor is below one chunk's logits."""
    model = build_model("llama-tiny", vocab_size=VOCAB, seed=0)
    batch = _batch(seq=64)
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_token_sum_cross_entropy(model.lm_head, model.model(batch["input_ids"]).last_hidden_state,
                                        batch["labels"], chunk_size=16)
    assert max(sizes) < 2 * 16 * VOCAB
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_token_sum_cross_entropy(model.lm_head, model.model(batch["input_ids"]).last_hidden_state,
                                        batch["labels"], chunk_size=None)
    assert max(sizes) >= 2 * 64 * VOCAB  # the unchunked loss does keep them: the check above can fail
