"""hfdist's document attention (hfdist.models.document_attention): packed documents' logits AND gradients equal each
document run alone (fp32, rel 1e-5) for Llama, Mistral (a sliding window shorter than the documents) and Qwen3;
softcapping, the mask function's two cases, boundaries that do not fit the batch refused, and no S x S tensor in a
training step (the largest allocation, measured)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hfdist.data.collation import block_causal_mask, collate, varlen_kwargs
from hfdist.metrics.memory import LiveTensorBytes
from hfdist.models.attention import DOCUMENT_ATTENTION
from hfdist.models.build import build_model
from hfdist.models.document_attention import (
    DocumentAttentionError,
    document_attention,
    document_mask,
    register_document_attention,
)

RTOL = ATOL = 1e-5
VOCAB = 512
WINDOW = 24  # Mistral's sliding window here: shorter than most documents below
# Two packed rows of 128 tokens: documents of 2-61 tokens, packing's padding (one-token segments) inside and at the end.
ROWS = [[40, 1, 1, 30, 56], [61, 45, 3, 2, 1, 1, 1, 14]]


def _packed_rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for lengths in ROWS:
        ids = torch.randint(0, VOCAB, (sum(lengths),), generator=g)
        positions = torch.cat([torch.arange(n) for n in lengths])
        labels = ids.clone()
        labels[positions == 0] = -100  # each document's first token predicts nothing (as packing's labels)
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "position_ids": positions.tolist()})
    return rows


def _model(preset: str, attention: str):
    model = build_model(preset, vocab_size=VOCAB, seed=0, attn_implementation=attention)
    if preset == "mistral-tiny":
        model.config.sliding_window = WINDOW
    return model


def _documents():
    """(row, start, end) of every segment longer than one token."""
    out = []
    for r, lengths in enumerate(ROWS):
        start = 0
        for n in lengths:
            if n > 1:
                out.append((r, start, start + n))
            start += n
    return out


def _token_loss_sum(logits, labels):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("preset", ["llama-tiny", "mistral-tiny", "qwen3-tiny"])
def test_packed_logits_and_gradients_equal_each_document_alone(preset):
    packed = _model(preset, DOCUMENT_ATTENTION)
    assert packed.config._attn_implementation == DOCUMENT_ATTENTION  # what the build set is what runs
    batch = collate(_packed_rows(), attn_implementation=DOCUMENT_ATTENTION)
    assert "attention_mask" not in batch and batch["cu_seq_lens_q"].dtype == torch.int32
    labels = batch.pop("labels")
    logits = packed(**batch).logits
    _token_loss_sum(logits, labels).backward()

    alone = _model(preset, "eager")  # transformers' own attention, one document at a time, same weights
    with torch.no_grad():
        for r, a, b in _documents():
            torch.testing.assert_close(logits[r, a:b], alone(input_ids=batch["input_ids"][r:r + 1, a:b]).logits[0],
                                       rtol=RTOL, atol=ATOL)
    for r, a, b in _documents():  # the packed loss is the documents' losses summed: so are the gradients
        _token_loss_sum(alone(input_ids=batch["input_ids"][r:r + 1, a:b]).logits, labels[r:r + 1, a:b]).backward()
    want, got = _grads(alone), _grads(packed)
    for name in want:
        # A gradient sums over every token, in another order packed than alone; its rounding scales with the
        # gradient's largest entries (the embedding's reach ~10 here), so the absolute tolerance does too: measured
        # up to 5e-6 apart at entries of 0.7, which a fixed 1e-5 + 1e-5 x |entry| failed about one run in ten (the
        # sums' order varies with the buffers' alignment, from one process to the next).
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL * max(1.0, want[name].abs().max().item()),
                                   msg=name)
    if preset == "mistral-tiny":  # the window mattered: without it the documents' logits differ
        with torch.no_grad():
            alone.config.sliding_window = None
            r, a, b = max(_documents(), key=lambda d: d[2] - d[1])
            wide = alone(input_ids=batch["input_ids"][r:r + 1, a:b]).logits[0]
        assert (wide - logits[r, a:b]).abs().max() > 1e-3


def test_softcap_and_scaling_as_eager_computes_them():
    """A model passing softcap (sdpa has no argument for it) and its own scaling: each document as eager attention
    with the same tanh cap over a block-causal mask of the whole row."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 4, 20, 8, generator=g), torch.randn(1, 2, 20, 8, generator=g), torch.randn(1, 2, 20, 8,
                                                                                                        generator=g)
    positions = torch.cat([torch.arange(7), torch.arange(13)])[None]
    module = torch.nn.Module()
    out, _ = document_attention(module, q, k, v, None, scaling=0.3, softcap=2.0, **varlen_kwargs(positions))
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.tanh(q @ kr.transpose(-1, -2) * 0.3 / 2.0) * 2.0
    scores = scores.masked_fill(~block_causal_mask(positions), torch.finfo(torch.float32).min)
    want = (scores.softmax(-1) @ vr).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)


def test_mask_function_builds_nothing_in_training_and_the_sdpa_mask_for_a_cache():
    assert document_mask(2, 4096, 4096) is None
    assert document_mask(2, 4096, 4096, attention_mask=torch.ones(2, 4096, dtype=torch.bool)) is None
    padded = torch.ones(1, 9, dtype=torch.bool)
    padded[0, 0] = False  # a left-padded prompt, decoding its next token
    decode = document_mask(1, 1, 9, q_offset=8, attention_mask=padded)
    assert decode is not None and decode.shape[-2:] == (1, 9) and not decode[..., 0].any()


def test_generation_with_a_cache_matches_sdpa():
    """Generation (KV cache, one query against many keys) runs as sdpa with transformers' mask."""
    register_document_attention()
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    outputs = []
    for attention in (DOCUMENT_ATTENTION, "sdpa"):
        model = build_model("llama-tiny", vocab_size=VOCAB, seed=0, attn_implementation=attention).eval()
        outputs.append(model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0))
    assert torch.equal(*outputs)


def test_boundaries_of_another_batch_are_refused():
    q = k = v = torch.zeros(1, 2, 16, 8)
    with pytest.raises(DocumentAttentionError, match="another batch"):
        document_attention(torch.nn.Module(), q, k, v, None, **varlen_kwargs(torch.arange(32)[None]))
    with pytest.raises(DocumentAttentionError, match="context parallelism"):  # a cp chunk's position ids
        document_attention(torch.nn.Module(), q, k, v, None, position_ids=torch.arange(8)[None])
    with pytest.raises(DocumentAttentionError, match="crosses the end of a row"):
        document_attention(torch.nn.Module(), torch.zeros(2, 2, 16, 8), torch.zeros(2, 2, 16, 8),
                           torch.zeros(2, 2, 16, 8), None,
                           **varlen_kwargs(torch.cat([torch.arange(20), torch.arange(12)])[None]))


@pytest.mark.parametrize("attention", [DOCUMENT_ATTENTION, "sdpa"])
def test_no_s_by_s_tensor_in_a_training_step(attention):
    """The largest tensor a forward + backward creates at S = 4,096 (documents of up to 600 tokens) is smaller than
    S x S bytes under document attention; the dense mask's path does create one (the measurement can see it)."""
    seq = 4096
    lengths = [600, 500, 333, 400, 215] * 2
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(3))
    rows = [{"input_ids": ids[0].tolist(), "labels": ids[0].tolist(), "position_ids": positions[0].tolist()}]
    model = build_model("llama-tiny", vocab_size=VOCAB, seed=0, attn_implementation=attention)
    model.config.max_position_embeddings = seq
    with LiveTensorBytes() as created:
        batch = collate(rows, attn_implementation=attention)
        model(**batch).loss.backward()
    if attention == DOCUMENT_ATTENTION:
        assert created.largest < seq * seq, (created.largest, created.largest_op)
    else:
        assert created.largest >= seq * seq
