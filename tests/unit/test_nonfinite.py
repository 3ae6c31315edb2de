"""The non-finite guard's checks in one process (hfdist.train.nonfinite; tests/e2e/test_divergence.py runs a
diverging job end to end)."""

from __future__ import annotations

import math

import pytest
import torch

from hfdist.errors import DIVERGED_EXIT_CODE
from hfdist.train.nonfinite import NonFiniteGuard, TrainingDiverged


def test_exit_code_is_its_own():
    from hfdist.config.preemption import PREEMPTED_EXIT_CODE
    from hfdist.train.watchdog import EXIT_CODE as HANG

    assert DIVERGED_EXIT_CODE not in (0, 1, 2, HANG, PREEMPTED_EXIT_CODE) and DIVERGED_EXIT_CODE < 128


def test_a_finite_step_passes_and_the_losses_start_over():
    guard = NonFiniteGuard()
    guard.note_loss(torch.tensor(2.5))
    guard.note_loss(torch.tensor(1.5))
    guard.check_step(1, torch.tensor(0.7))
    guard.note_loss(torch.tensor(float("nan")))
    with pytest.raises(TrainingDiverged):
        guard.check_step(2, 0.7)
    guard.note_loss(torch.tensor(1.0))  # the NaN of step 2 is not carried into step 3
    guard.check_step(3, 0.7)


@pytest.mark.parametrize("value, kind", [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf")])
def test_a_non_finite_loss_stops_the_step_and_names_it(value, kind):
    guard = NonFiniteGuard()
    guard.note_loss(torch.tensor(3.0))
    guard.note_loss(torch.tensor(value))  # the second micro-batch's
    with pytest.raises(TrainingDiverged) as err:
        guard.check_step(7, torch.tensor(1.0))
    d = err.value.diverged
    assert (d.step, d.what, d.value, d.rank) == (7, "loss", kind, 0) and not math.isfinite(d.loss)
    text = str(err.value)
    assert text.startswith(f"training diverged at step 7: the loss was {kind} on rank 0")
    assert "--learning-rate" in text and "--resume" in text


def test_a_non_finite_gradient_norm_stops_the_step():
    guard = NonFiniteGuard()
    guard.note_loss(torch.tensor(6.9))
    with pytest.raises(TrainingDiverged) as err:
        guard.check_step(2, torch.tensor(float("inf")))
    d = err.value.diverged
    assert (d.what, d.value, d.loss, d.grad_norm) == ("grad_norm", "inf", pytest.approx(6.9), float("inf"))
    assert "the gradient norm before clipping was inf" in str(err.value)


def test_weights_are_checked_shard_by_shard():
    guard = NonFiniteGuard()
    finite = [torch.ones(3), torch.zeros(2, 2), torch.arange(4)]  # an integer buffer is not checked
    guard.check_weights(5, finite)
    with pytest.raises(TrainingDiverged) as err:
        guard.check_weights(5, [*finite, torch.tensor([1.0, float("nan")])])
    assert (err.value.diverged.what, err.value.diverged.value) == ("weights", "nan")
    assert "the update made rank 0's weights nan" in str(err.value)
