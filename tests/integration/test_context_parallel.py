"""Context parallelism on 4 gloo ranks: one launch (cp_worker.py) trains fsdp_cp (dp_shard=2 x cp=2), cp=4 with
fewer kv heads than cp (GQA, eager attention), LoRA on dp_shard=2 x cp=2, cp=2 x tp=2 and HSDP dp_replicate=2 x
cp=2 (sdpa), on packed rows of 512 tokens holding several documents, against the single-process run; and checks
each document's logits under cp against the document run alone. Without a named attention the cases run hfdist's
document attention (the CPU default), whose batches carry the documents' boundaries and no mask. And cp=4 trains
one packed row of 32,768 tokens with no rank creating anything S x S.

Tolerances (fp32): losses within a relative 1e-5 of one process (observed <= 1e-7); logits within 1e-5 absolute
(observed 3e-7): the all-to-all moves values without arithmetic, so only the order of sums differs.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multiproc
RTOL, LOGIT_ATOL = 1e-5, 1e-5
CASES = ["fsdp_cp", "cp4_gqa_eager", "lora_fsdp_cp", "tp_cp", "hsdp_cp"]


@pytest.fixture(scope="module")
def cp_results(worker_results) -> dict:
    return worker_results["cp"]  # cp_worker.py on 4 ranks (tests/integration/conftest.py)


def _case(results: dict, name: str) -> dict:
    case = results[name]
    assert "error" not in case, f"{name}:\n{case['error']}"
    return case


@pytest.mark.parametrize("name", CASES)
def test_losses_match_single_process(cp_results, name):
    """3 AdamW steps: the loss (ranks' partial sums over the global label count) equals one process's."""
    case = _case(cp_results, name)
    assert case["attn"] == "hfdist_ulysses"  # the cp attention really ran
    assert case["losses"] == pytest.approx(case["ref_losses"], rel=RTOL)
    assert case["losses"][-1] < case["losses"][0]


@pytest.mark.parametrize("name", CASES)
def test_documents_kept_apart(cp_results, name):
    """Every packed document's logits, gathered from the cp chunks, equal the document run alone."""
    assert _case(cp_results, name)["doc_logit_err"] < LOGIT_ATOL


def test_lora_trains_adapters_only(cp_results):
    assert _case(cp_results, "lora_fsdp_cp")["trainable"] < _case(cp_results, "fsdp_cp")["trainable"] / 10


@pytest.mark.parametrize("name", CASES)
def test_only_the_dense_choices_carry_a_mask(cp_results, name):
    assert _case(cp_results, name)["mask_in_batch"] == (name in ("cp4_gqa_eager", "hsdp_cp"))


def test_a_32k_packed_row_trains_under_cp_with_nothing_s_by_s(cp_results):
    """fsdp_cp's long-context case: one row of 32,768 tokens (chat-sized documents and a few of 4,000), cp=4:
    losses equal one process's, and the largest tensor any rank creates in its training steps is far below one
    S x S byte mask (1 GiB): the batch carries the documents' boundaries, each rank attends them for its heads."""
    case = _case(cp_results, "long_cp4")
    seq = case["seq"]
    assert seq == 32768 and case["documents"] > 40 and "attention_mask" not in case["batch_keys"]
    assert case["attn"] == "hfdist_ulysses"
    assert case["losses"] == pytest.approx(case["ref_losses"], rel=RTOL)
    for largest, op in case["largest"]:
        assert largest < seq * seq // 16, (largest, op)


def test_verify_checks_the_cp_layout(cp_results):
    """hfdist.parallel.verify passes every case above (FSDP2 over dp_shard x cp, the cp attention in every layer)
    and refuses the fsdp_cp model once it attends without the cp exchange."""
    refused = _case(cp_results, "fsdp_cp")["refused_without_cp"]
    assert refused and "context parallelism (cp=2) is not in effect" in refused
