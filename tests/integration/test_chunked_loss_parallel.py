"""The chunked loss, fused (the default) or recomputing, changes no number on the distributed paths: one 4-rank
launch (chunked_loss_worker.py) computes loss and gradients with lm_head + cross-entropy in sequence chunks of 7 and
the plain unchunked loss, on the same model and batch (32K vocabulary), under DDP, FSDP2, FSDP2 x TP (sequence and
loss parallel; the fused loss vocab-parallel) and a 2-stage pipeline; FSDP2 in bf16 and an uneven vocab split too."""

from __future__ import annotations

import pytest

CASES = ["ddp", "fsdp", "fsdp_tp", "pp"]


@pytest.fixture(scope="module")
def chunked_results(worker_results) -> dict:
    return worker_results["chunked_loss"]  # chunked_loss_worker.py on 4 ranks (tests/integration/conftest.py)


def _ok(run: dict, case: str) -> dict:
    assert "error" not in run, f"{case}: {run['error']}"
    assert run["grads"] > 0 and run["loss"] > 0
    return run


@pytest.mark.multiproc
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", ["fused", "recomputed"])
def test_chunked_loss_equals_unchunked(chunked_results, case, variant):
    """Loss and every rank's local gradients (each in norm) within rel 1e-6 of the unchunked loss's."""
    run = _ok(chunked_results[case], case)
    assert run[variant]["loss_rel_diff"] <= 1e-6
    assert run[variant]["grad_rel_diff"] <= 1e-6
    if case == "pp":  # also the pipeline's forward-only evaluation, fused chunks against the unchunked loss
        assert run["eval_rel_diff"] <= 1e-6


@pytest.mark.multiproc
def test_fused_loss_under_fsdp_bf16_mixed_precision(chunked_results):
    """FSDP2 computing in bf16 (gradients reduced in fp32): the fused loss is the recomputing one's up to the bf16
    rounding of the same products (the loss itself: the same bf16 logits, an fp32 softmax)."""
    run = _ok(chunked_results["fsdp_bf16"], "fsdp_bf16")
    assert run["fused"]["loss_rel_diff"] <= 1e-6
    assert run["fused"]["grad_rel_diff"] <= 2e-2


@pytest.mark.multiproc
def test_vocab_parallel_loss_on_an_uneven_split(chunked_results):
    """The vocab-parallel softmax (max and sums all-reduced, the target logit from its shard) on 1001 rows over 4
    ranks, with a bias and sequence-sharded hidden states: the whole weight's loss and gradients."""
    run = _ok(chunked_results["vocab_parallel_uneven"], "vocab_parallel_uneven")
    assert run["fused"]["loss_rel_diff"] <= 1e-6
    assert run["fused"]["grad_rel_diff"] <= 1e-6
