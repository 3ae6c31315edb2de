"""The contract with the torch internals hfdist relies on (hfdist.torch_private): each still behaves as hfdist uses it,
checked against the installed torch. A failure here names the internal a torch release changed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hfdist.torch_private import (
    call_with_parameters,
    fsdp_unsharded_storages,
    loss_parallel_active,
    queue_after_backward,
)

from helpers import fake_world


def test_call_with_parameters_runs_the_modules_forward_on_the_given_tensors():
    """nn.Module resolves `self.weight` through `_parameters`: the forward computes with the stand-ins (their
    gradients flow to them), a None hides a parameter, and afterwards (errors included) the module holds its own
    Parameters again, by the same names."""
    torch.manual_seed(0)
    linear = nn.Linear(4, 3)
    own = dict(linear.named_parameters())
    x = torch.randn(2, 4)
    stand_in = torch.randn(3, 4, requires_grad=True)
    out = call_with_parameters(linear, linear.forward, {"weight": stand_in, "bias": None}, x)
    torch.testing.assert_close(out, F.linear(x, stand_in), rtol=0, atol=0)  # the same op on the same operands
    out.sum().backward()
    assert stand_in.grad is not None and linear.weight.grad is None
    assert dict(linear.named_parameters()) == own

    def failing(_):
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        call_with_parameters(linear, failing, {"weight": stand_in}, x)
    assert dict(linear.named_parameters()) == own


def test_queue_after_backward_runs_once_every_gradient_is_accumulated():
    """Queued from the first post-accumulate-grad hook, the callback runs once, after the last parameter's gradient
    is in `.grad`, before backward() returns; the next backward starts with an empty queue."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    seen: list[tuple[bool, bool]] = []

    def on_grad(_: torch.Tensor) -> None:
        if not pending:
            pending.append(True)
            queue_after_backward(lambda: seen.append((a.grad is not None, b.grad is not None)))

    for p in (a, b):
        p.register_post_accumulate_grad_hook(on_grad)
    for step in range(2):
        pending: list[bool] = []
        (a * b).sum().backward()
        assert seen == [(True, True)] * (step + 1)


def test_loss_parallel_active_follows_torchs_context():
    from torch.distributed.tensor.parallel import loss_parallel

    assert not loss_parallel_active()
    with loss_parallel():
        assert loss_parallel_active()
    assert not loss_parallel_active()


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp_unsharded_storages_are_full_while_unsharded_and_empty_after(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with fake_world(world):
        model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))
        fully_shard(model[0], mesh=init_device_mesh("cpu", (world,)))
        assert fsdp_unsharded_storages(model) == []  # before the first all-gather
        model[0].unshard()
        storages = fsdp_unsharded_storages(model)
        assert sorted(s.nbytes() for s in storages) == [8 * 4, 16 * 8 * 4]  # bias, weight: whole, in fp32
        model[0].reshard()
        assert [s.nbytes() for s in storages] == [0, 0]
