"""Float8 matmuls of hfdist's tensor-parallel linears (hfdist.parallel.tensor_styles.LocalLinear), which compute on
local tensors: every float8 scale taken from the whole logical tensor (or row) it scales, as one process would.

A float8 linear computes three matmuls, each operand cast to float8 with a scale from its absolute maximum (amax):

    forward       out    = x      @ W^T      contracted over K (in-features)
    grad input    grad_x = grad   @ W        contracted over N (out-features)
    grad weight   grad_W = grad^T @ x        contracted over M (tokens)

A tensorwise scale is the amax of the whole operand; a rowwise (axiswise) one the amax of each row or column along
the contracted dimension. Under tensor parallelism a rank holds a slice of some operands: a column-split linear
its share of W's out-features (and so of `out` and `grad`), a row-split one its share of W's in-features (and of
x, whose last dimension is the split one). x of a column-split linear and `grad` of a row-split one are whole on
every rank (sequence parallelism all-gathers the tokens before the block; the row-split output's gradient comes back
all-gathered), and the tokens M are never split inside a layer. The rule (`_amax_over_tp`): an operand's amax is
all-reduced (max) over the tp ranks exactly when the rank holds a slice of it and the scale spans the split
dimension: always for a tensorwise scale, and for a rowwise one when the contracted dimension is the split one.

    column-split (N split)   x: whole   W: N-slice   grad: N-slice
        forward x / W^T over K: -, tensorwise only      grad input grad / W over N: all-reduced
        grad weight grad over M: tensorwise only; x over M: -
    row-split (K split)      x: K-slice W: K-slice   grad: whole
        forward x / W^T over K: all-reduced             grad input grad over N: -; W over N: tensorwise only
        grad weight grad over M: -; x over M: tensorwise only

torchao's float8 tensor-parallel styles (Float8ColwiseParallel / Float8RowwiseParallel) reach the same scales
through DTensor: the amax of a DTensor operand is reduced over its sharded mesh dimension. hfdist's linears compute
on local tensors (tensor_styles says why), so the reduction is explicit here: an all-reduce of one scalar (tensorwise)
or one row of scales (rowwise) per cast that needs it. A weight FSDP2 gathered in float8 arrives already cast, with
the scale hfdist.parallel.float8.precompute_scales computed over the whole tensor (dp and tp), and is used as it is.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["local_float8_linear"]

# The dimensions of the three matmuls (module docstring): which one each cast contracts, and which one a rank's
# slice of an operand is cut along under a column split (0) or a row split (1).
_SPLIT_DIM = {0: {"x": None, "weight": "N", "grad": "N"}, 1: {"x": "K", "weight": "K", "grad": None}}


def _amax_over_tp(split: int, operand: str, contracted: str, tensorwise: bool) -> bool:
    """The rule of the module docstring: reduce the operand's amax over tp when the rank holds a slice of it and
    the scale spans the split dimension."""
    cut = _SPLIT_DIM[split][operand]
    return cut is not None and (tensorwise or cut == contracted)


def _cast(tensor: torch.Tensor, cast, role, axis: int, mm_config, power_of_2: bool, split: int, operand: str,
          contracted: str, mesh: DeviceMesh) -> torch.Tensor:
    """`tensor` as torchao's Float8TrainingTensor under the cast settings `cast` (a CastConfig of the module's
    config), its scale along `axis` for rowwise, reduced over tp where the rule says; a tensor already in float8
    (a weight FSDP2 gathered in float8) is returned as it is."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic

    if tensor_already_casted_to_fp8(tensor):
        return tensor
    tensorwise = cast.scaling_granularity is ScalingGranularity.TENSORWISE
    return hp_tensor_to_float8_dynamic(
        tensor, cast.target_dtype, mm_config, reduce_amax=_amax_over_tp(split, operand, contracted, tensorwise),
        device_mesh=mesh, gemm_input_role=role, scaling_granularity=cast.scaling_granularity,
        axiswise_dim=None if tensorwise else axis, round_scales_to_power_of_2=power_of_2)


@torch._dynamo.allow_in_graph
class _LocalFloat8Matmul(torch.autograd.Function):
    """x @ weight^T on local tensors in float8, the scales of every cast taken over tp as the rule says. Its
    gradients are the local ones (a column-split linear's input gradient is its share of the sum over tp, which the
    block's GatherSequence reduces; a row-split output is a partial sum the caller reduces)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, config, mm_config, split: int,
                mesh: DeviceMesh) -> torch.Tensor:
        from torchao.float8.float8_training_tensor import GemmInputRole

        ctx.save_for_backward(x, weight)
        ctx.config, ctx.mm_config, ctx.split, ctx.mesh = config, mm_config, split, mesh
        common = (mm_config, config.round_scales_to_power_of_2, split)
        x8 = _cast(x.reshape(-1, x.shape[-1]), config.cast_config_input, GemmInputRole.INPUT, -1, *common, "x", "K",
                   mesh)
        w8 = _cast(weight.t(), config.cast_config_weight, GemmInputRole.WEIGHT, 0, *common, "weight", "K", mesh)
        return torch.mm(x8, w8).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        from torchao.float8.float8_training_tensor import GemmInputRole

        x, weight = ctx.saved_tensors
        c, mesh = ctx.config, ctx.mesh
        common = (ctx.mm_config, c.round_scales_to_power_of_2, ctx.split)
        grad = grad_out.reshape(-1, grad_out.shape[-1])
        tokens = x.reshape(-1, x.shape[-1])
        # grad input = grad @ W, contracted over N
        g8 = _cast(grad, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1, *common, "grad", "N", mesh)
        w8 = _cast(weight.t(), c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1, *common, "weight", "N",
                   mesh)
        grad_x = torch.mm(g8, w8.t()).reshape(x.shape)
        # grad weight = grad^T @ x, contracted over M
        g8 = _cast(grad, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, 0, *common, "grad", "M",
                   mesh)
        x8 = _cast(tokens, c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0, *common, "x", "M", mesh)
        grad_weight = torch.mm(g8.t(), x8)
        return grad_x, grad_weight, None, None, None, None


def local_float8_linear(module: nn.Module, mesh: DeviceMesh,
                        split: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """`F.linear(x, weight, bias)` as torchao's Float8Linear `module` computes it (its config, its scaled matmul),
    for a column- (split 0) or row-split (1) linear on local tensors over the tp `mesh`: called with the local
    views of the module's weight and bias (LocalLinear's; a row-split linear's bias is None then, added after the
    reduction)."""
    if split not in _SPLIT_DIM:
        raise ValueError(f"a float8 linear under tensor parallelism is column- (0) or row-split (1), got {split}")

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = _LocalFloat8Matmul.apply(x, weight, module.config, module.linear_mm_config, split, mesh)
        return out if bias is None else out + bias.to(out.dtype)

    return linear
