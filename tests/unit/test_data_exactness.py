"""Packed blocks keep documents apart exactly: the logits at every document's positions in a packed block equal
that document run alone (fp32, rel 1e-5), for hfdist's document attention (the CPU default), sdpa and eager, for
flash-attention's varlen arguments (through transformers' own flash path with a CPU stand-in for the kernel), for
flex attention's forward (the BlockMask transformers builds from the position ids: the GPU contract, forward only on
CPU), and through pipeline stages.
Also the fact that makes the mask necessary: position ids alone do not isolate documents in a plain forward."""

from __future__ import annotations

import functools
import json
import sys

import pytest
import torch
import torch.nn.functional as F

from hfdist.data import collate, load_raw_dataset, load_tokenizer, prepare
from hfdist.data.collation import document_ids
from hfdist.models.attention import DOCUMENT_ATTENTION
from hfdist.models.build import build_model
from hfdist.models.document_attention import register_document_attention

RTOL = ATOL = 1e-5
FLASH = "flash_attention_3"


def _cpu_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                                causal=False):
    """flash_attn_varlen_func's contract on CPU: q (total, heads, dim), k/v (total, kv_heads, dim); causal
    attention inside each [cu[i], cu[i+1]) segment only."""
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and causal
    assert int(cu_seqlens_q.diff().max()) == max_seqlen_q == max_seqlen_k
    groups = q.shape[1] // k.shape[1]
    q, k, v = q.transpose(0, 1), k.repeat_interleave(groups, 1).transpose(0, 1), v.repeat_interleave(groups, 1).transpose(0, 1)
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        out[:, a:b] = F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True,
                                                     scale=softmax_scale)
    return out.transpose(0, 1)


def _flash_without_varlen(*args, **kwargs):
    raise AssertionError("flash attention's non-varlen path ran: the packed documents would attend to each other")


@pytest.fixture(scope="module")
def cpu_flash():
    """transformers' own flash-attention path (integrations.flash_attention -> _flash_attention_forward) with a CPU
    stand-in for the flash_attn_interface package (FA3's import, which transformers 5.23 makes unchecked), so the
    varlen arguments hfdist builds go exactly where they go on a GPU. Module-scoped: transformers keeps the kernel
    it loaded first. Yields the list of kernel calls (one entry per call)."""
    import types

    fake = types.ModuleType("flash_attn_interface")
    calls = []

    @functools.wraps(_cpu_flash_attn_varlen_func)  # transformers passes what the kernel's signature names
    def counted(*args, **kwargs):
        calls.append(1)
        return _cpu_flash_attn_varlen_func(*args, **kwargs)

    fake.flash_attn_varlen_func = counted
    fake.flash_attn_func = _flash_without_varlen
    fake.flash_attn_with_kvcache = None
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "flash_attn_interface", fake)
        yield calls


def _use(model, attention: str) -> None:
    # set_attn_implementation checks that the flash package is installed; the config is what every layer reads.
    model.config._attn_implementation = attention


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None, is_preset=True)


@pytest.fixture(scope="module")
def model():
    register_document_attention()
    return build_model("llama-tiny", vocab_size=1024, seed=0).eval()


@pytest.fixture(scope="module")
def packed_sets(tok, tmp_path_factory):
    """Packed rows with several documents each: the embedded default (messages) and a ShareGPT file."""
    from hfdist.data.default import generate_examples

    path = tmp_path_factory.mktemp("sharegpt") / "chat.jsonl"
    pairs = generate_examples(300, seed=7)
    with open(path, "w") as f:
        for i in range(0, 300, 2):
            turns = [{"from": "system", "value": "Be exact."}]
            for e in pairs[i:i + 2]:
                turns += [{"from": "human", "value": e["instruction"]}, {"from": "gpt", "value": e["response"]}]
            f.write(json.dumps({"conversations": turns}) + "\n")
    return {"default": prepare(load_raw_dataset(None), tok, 128), "sharegpt": prepare(load_raw_dataset(str(path)), tok, 192)}


def _starts(positions) -> int:
    """Documents in a packed row: positions 0 followed by 1 (padding tokens are lone zeros)."""
    return sum(p == 0 and q == 1 for p, q in zip(positions, positions[1:]))


def _rows_with_several_documents(packed, n=4):
    rows = [packed[i] for i in range(len(packed)) if _starts(packed[i]["position_ids"]) >= 2]
    assert len(rows) >= n
    return rows[:n]


def _documents(batch):
    """(row, start, end) of every real document in a collated batch (padding: one-token segments, skipped)."""
    docs = []
    for r, ids in enumerate(document_ids(batch["position_ids"])):
        for d in ids.unique().tolist():
            where = (ids == d).nonzero().flatten()
            if len(where) > 1:
                docs.append((r, int(where[0]), int(where[-1]) + 1))
    return docs


def _assert_documents_alone(model, batch, logits):
    docs = _documents(batch)
    assert len(docs) >= 2 * len(batch["input_ids"])
    with torch.no_grad():
        for r, a, b in docs:
            alone = model(input_ids=batch["input_ids"][r:r + 1, a:b]).logits[0]
            torch.testing.assert_close(logits[r, a:b], alone, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("data", ["default", "sharegpt"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logits_equal_each_document_alone(model, packed_sets, data, attention):
    _use(model, attention)
    try:
        batch = collate(_rows_with_several_documents(packed_sets[data]), attn_implementation=attention)
        assert batch["attention_mask"].shape[1:] == (1, batch["input_ids"].shape[1], batch["input_ids"].shape[1])
        with torch.no_grad():
            logits = model(**batch).logits
        _assert_documents_alone(model, batch, logits)
    finally:
        _use(model, "sdpa")


@pytest.mark.parametrize("data", ["default", "sharegpt"])
def test_document_attention_keeps_documents_apart(model, packed_sets, data):
    """No S x S mask in the batch: the documents' boundaries only."""
    batch = collate(_rows_with_several_documents(packed_sets[data]), attn_implementation=DOCUMENT_ATTENTION)
    assert "attention_mask" not in batch
    _use(model, DOCUMENT_ATTENTION)
    try:
        with torch.no_grad():
            logits = model(**batch).logits
    finally:
        _use(model, "sdpa")
    _assert_documents_alone(model, batch, logits)


@pytest.mark.parametrize("window", [None, 16])
def test_flex_gets_a_block_mask_of_the_documents_from_the_position_ids(packed_sets, window):
    """flex_attention's batch carries no mask: transformers builds the BlockMask from the packed position ids, on
    the device, and it allows exactly the pairs of the dense block-causal mask (sliding window too). Without
    use_cache=False a forward's KV cache turns that detection off. The mask's pairs are read from its mask_mod;
    torch compiles BlockMask construction and the flex kernel on CPU for minutes, so construction runs uncompiled
    here and the kernel is left to the GPU."""
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers import masking_utils
    from transformers.cache_utils import DynamicCache

    from hfdist.data.collation import block_causal_mask
    from hfdist.models.presets import load_config

    batch = collate(_rows_with_several_documents(packed_sets["default"]), attn_implementation="flex_attention")
    assert batch.keys() == {"input_ids", "labels", "position_ids", "use_cache"} and batch["use_cache"] is False
    config = load_config("mistral-tiny", 1024)
    config._attn_implementation, config.sliding_window = "flex_attention", window
    build = masking_utils.create_sliding_window_causal_mask if window else masking_utils.create_causal_mask
    positions = batch["position_ids"]
    rows, seq = positions.shape
    grid = torch.meshgrid(torch.arange(rows), torch.arange(1), torch.arange(seq), torch.arange(seq), indexing="ij")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(masking_utils, "create_block_mask",
                      lambda *args, **kwargs: create_block_mask(*args, **{**kwargs, "_compile": False}))
        masks = [build(config=config, inputs_embeds=torch.zeros(rows, seq, 8), attention_mask=None,
                       past_key_values=cache, position_ids=positions) for cache in (None, DynamicCache(config=config))]
    assert torch.equal(masks[0].mask_mod(*grid), block_causal_mask(positions, window))
    assert not torch.equal(masks[1].mask_mod(*grid), block_causal_mask(positions, window))


@pytest.mark.parametrize("data", ["default", "sharegpt"])
def test_flash_varlen_arguments_keep_documents_apart(model, packed_sets, cpu_flash, data):
    batch = collate(_rows_with_several_documents(packed_sets[data]), attn_implementation=FLASH)
    assert "attention_mask" not in batch and batch["cu_seq_lens_q"].dtype == torch.int32
    before = len(cpu_flash)
    _use(model, FLASH)
    try:
        with torch.no_grad():
            logits = model(**batch).logits
    finally:
        _use(model, "sdpa")
    assert len(cpu_flash) - before == model.config.num_hidden_layers  # every layer ran the varlen kernel
    _assert_documents_alone(model, batch, logits)


def test_packed_loss_is_the_documents_loss(model, packed_sets):
    """Summed token loss of a packed batch = the sum of its documents' own summed losses (no label crosses a
    document boundary: each document's first token has no label)."""
    batch = collate(_rows_with_several_documents(packed_sets["default"]))
    with torch.no_grad():
        total = model(**batch).loss * (batch["labels"][:, 1:] != -100).sum()
        parts = []
        for r, a, b in _documents(batch):
            labels = batch["labels"][r:r + 1, a:b]
            parts.append(model(input_ids=batch["input_ids"][r:r + 1, a:b], labels=labels).loss
                         * (labels[:, 1:] != -100).sum())
    torch.testing.assert_close(total, torch.stack(parts).sum(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("attention", ["sdpa", FLASH, DOCUMENT_ATTENTION])
def test_pipeline_stages_keep_documents_apart(model, packed_sets, cpu_flash, attention):
    """The stage modules of pp/3d (hfdist.parallel.pipeline.stage), run in sequence, give the same logits: the 4-D
    mask is used as given, and the varlen arguments (flash, hfdist_documents) are rebuilt from the micro-batch's
    position ids."""
    from hfdist.parallel.pipeline.stage import build_stage_module

    batch = collate(_rows_with_several_documents(packed_sets["default"]), attn_implementation=attention)
    before = len(cpu_flash)
    _use(model, attention)
    try:
        stages = [build_stage_module(model, i, 2, r) for i, r in enumerate((range(0, 2), range(2, 4)))]
        with torch.no_grad():
            hidden = batch["input_ids"]
            for stage in stages:  # what the schedule passes a stage: the mask (if any) and position ids
                hidden = stage(hidden, attention_mask=batch.get("attention_mask"),
                               position_ids=batch["position_ids"])
    finally:
        _use(model, "sdpa")
    assert len(cpu_flash) - before == (model.config.num_hidden_layers if attention == FLASH else 0)
    _assert_documents_alone(model, batch, hidden)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_position_ids_alone_mix_documents_in_a_plain_forward(model, packed_sets, attention):
    """Why collate builds a mask: transformers 5.23 infers packed documents from position ids only without a KV
    cache, and a plain forward builds one (use_cache defaults on), so the second document sees the first."""
    _use(model, attention)
    try:
        batch = collate(_rows_with_several_documents(packed_sets["default"], 1))
        r, a, b = _documents(batch)[1]
        with torch.no_grad():
            mixed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[r, a:b]
            alone = model(input_ids=batch["input_ids"][r:r + 1, a:b]).logits[0]
        assert (mixed - alone).abs().max() > 1e-2
    finally:
        _use(model, "sdpa")
