"""The chunked loss, fused (the default) or recomputing, changes no number on the distributed paths: one 4-rank
launch (chunked_loss_worker.py) computes loss and gradients with lm_head + cross-entropy in sequence chunks of 7 and
the plain unchunked loss, on the same model and batch (32K vocabulary), under DDP, FSDP2, FSDP2 x TP (sequence and
loss parallel; the fused loss vocab-parallel) and a 2-stage pipeline; FSDP2 in bf16 and an uneven vocab split too."""

from __future__ import annotations

import pytest

from tolerances import U_BF16, order_rtol

CASES = ["ddp", "fsdp", "fsdp_tp", "pp"]
VOCAB = 32768  # chunked_loss_worker.py's vocabulary


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
    """Loss and every rank's local gradients (each in norm) within what reordered fp32 sums explain of the unchunked
    loss's. Chunks change the shapes of lm_head's matmuls, and so the blocking of their longest reduction, the
    softmax over the vocabulary (32,768 terms): order_rtol(32768) = 6.1e-5 (tests/tolerances.py). Measured: losses
    1.8e-7, gradients 1.26e-6 under FSDP (whose reduce-scatter adds its own order; the 1e-6 bound this replaces
    failed there), 9.3e-7 under DDP, 5e-7 or less under TP and PP; a lost chunk or a wrong scale moves them by 1e-2
    or more."""
    run = _ok(chunked_results[case], case)
    bound = order_rtol(VOCAB)
    assert run[variant]["loss_rel_diff"] <= bound
    assert run[variant]["grad_rel_diff"] <= bound
    if case == "pp":  # also the pipeline's forward-only evaluation, fused chunks against the unchunked loss
        assert run["eval_rel_diff"] <= bound


@pytest.mark.multiproc
def test_fused_loss_under_fsdp_bf16_mixed_precision(chunked_results):
    """FSDP2 computing in bf16 (gradients reduced in fp32): the fused loss is the recomputing one's up to the bf16
    rounding of the same products (the loss itself: the same bf16 logits, an fp32 softmax)."""
    run = _ok(chunked_results["fsdp_bf16"], "fsdp_bf16")
    assert run["fused"]["loss_rel_diff"] <= order_rtol(VOCAB)  # the same bf16 logits: only the fp32 softmax's order
    # The two paths differ by one bf16 rounding of the logits' gradient (the recomputed path multiplies a bf16
    # gradient, the fused one casts its fp32 gradient once): in norm at most bf16's unit roundoff (3.9e-3) of it,
    # carried by lm_head's backward into the layers below, a few times more: 2e-2 (U_BF16 x 5). Measured 1.2e-3.
    assert run["fused"]["grad_rel_diff"] <= 5 * U_BF16


@pytest.mark.multiproc
def test_vocab_parallel_loss_on_an_uneven_split(chunked_results):
    """The vocab-parallel softmax (max and sums all-reduced, the target logit from its shard) on 1001 rows over 4
    ranks, with a bias and sequence-sharded hidden states: the whole weight's loss and gradients."""
    run = _ok(chunked_results["vocab_parallel_uneven"], "vocab_parallel_uneven")
    # The softmax's sums split over 4 ranks and all-reduced: 1001 terms reordered (1.1e-5; measured 4.5e-7).
    assert run["fused"]["loss_rel_diff"] <= order_rtol(1001)
    assert run["fused"]["grad_rel_diff"] <= order_rtol(1001)
