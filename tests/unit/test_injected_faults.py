"""The faults tests plant through the environment (hfdist.train.injected_faults): which rank, rung and parameters a
gradient scale reaches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hfdist.train.injected_faults import GRAD_SCALE_ENV, injected_faults


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Linear(2, 2)
        self.attention = nn.Linear(2, 2)


def _grads(spec: str, rank: int, rung: str, monkeypatch) -> dict[str, float]:
    monkeypatch.setenv(GRAD_SCALE_ENV, spec)
    model = _Model()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    for hook in injected_faults(rank, rung):
        hook(model)
    return {name: float(p.grad.flatten()[0]) for name, p in model.named_parameters()}


def test_nothing_runs_without_the_variable(monkeypatch):
    monkeypatch.delenv(GRAD_SCALE_ENV, raising=False)
    assert injected_faults(0, "ddp") == []


def test_one_rank_one_rung_some_parameters(monkeypatch):
    assert set(_grads("1:2.0:fsdp_ep:experts", 1, "fsdp_ep", monkeypatch).items()) == {
        ("experts.weight", 2.0), ("experts.bias", 2.0), ("attention.weight", 1.0), ("attention.bias", 1.0)}
    assert set(_grads("1:2.0:fsdp_ep:experts", 0, "fsdp_ep", monkeypatch).values()) == {1.0}  # another rank
    assert set(_grads("1:2.0:fsdp_ep", 1, "fsdp_tp", monkeypatch).values()) == {1.0}  # another rung


def test_every_rank(monkeypatch):
    assert set(_grads("*:0.5", 3, "fsdp_cp", monkeypatch).values()) == {0.5}
    assert set(_grads("*:0.5::attention", 0, "ddp", monkeypatch).values()) == {0.5, 1.0}


@pytest.mark.parametrize("spec", ["x:2.0", "1", "1:two", "1:2.0:a:b:c"])
def test_a_bad_variable_is_named(spec, monkeypatch):
    monkeypatch.setenv(GRAD_SCALE_ENV, spec)
    with pytest.raises(ValueError, match=GRAD_SCALE_ENV):
        injected_faults(0, "ddp")
