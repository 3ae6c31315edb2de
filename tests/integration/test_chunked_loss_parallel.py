"""The chunked loss changes no number on the distributed paths: one 4-rank launch (chunked_loss_worker.py) computes
loss and gradients with lm_head + cross-entropy in sequence chunks of 7 and unchunked, on the same model and batch
(32K vocabulary), under DDP, FSDP2, FSDP2 x TP (sequence and loss parallel) and a 2-stage pipeline."""

from __future__ import annotations

import pytest

CASES = ["ddp", "fsdp", "fsdp_tp", "pp"]


@pytest.fixture(scope="module")
def chunked_results(worker_results) -> dict:
    return worker_results["chunked_loss"]  # chunked_loss_worker.py on 4 ranks (tests/integration/conftest.py)


@pytest.mark.multiproc
@pytest.mark.parametrize("case", CASES)
def test_chunked_loss_equals_unchunked(chunked_results, case):
    """Loss within rel 1e-6 and every rank's local gradients within rel 1e-5 of the unchunked loss's."""
    run = chunked_results[case]
    assert "error" not in run, f"{case}: {run['error']}"
    assert run["grads"] > 0 and run["loss"] > 0
    assert run["loss_rel_diff"] <= 1e-6
    assert run["grad_rel_diff"] <= 1e-5
    if case == "pp":  # also the pipeline's forward-only evaluation
        assert run["eval_rel_diff"] <= 1e-6
