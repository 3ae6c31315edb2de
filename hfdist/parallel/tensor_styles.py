"""The parallel styles of hfdist's tensor-parallel plan (hfdist.parallel.tensor) that torch does not ship.

Inside a decoder layer the layout of every activation is known, so the layer computes on local tensors, as in
Megatron: the split linears, the residual stream, its adds and the RMSNorms never go through DTensor's per-op
dispatch (on a small model that dispatch costs more than the matmuls: docs/tensor-parallel.md has the figures).
DTensor stays where it earns its keep: every parameter is a DTensor on the tp mesh (a module computes with local
views of them, `DTensor.to_local(grad_placements=...)`, each view's gradient declared in the placement it really
has, so gradients arrive as DTensors for clipping, FSDP2 and checkpoints: what `local_map(..., in_grad_placements=)`
does, without wrapping the output in a DTensor again), and the residual stream stays a DTensor *between* layers,
because HF's model
reads the global sequence length from `inputs_embeds.shape[1]` (positions, causal mask) and a DTensor reports the
global shape while its local shard holds S/tp tokens under sequence parallelism. Pipeline stages pass the same
DTensor on.

The layer's collectives (an all-gather / reduce-scatter pair per block under sequence parallelism, an all-reduce
pair without) are torch's: under sequence parallelism with a sequence that tp divides, the functional collectives
with autograd (`all_gather_single` / `reduce_scatter_single`: what DTensor's redistribution calls underneath),
applied to the local tensors directly; otherwise (no sequence parallelism, or an uneven split, which DTensor pads)
a DTensor redistribution. The direct call does the same collective without the from_local / redistribute / to_local
round trip, whose Python cost slowed sequence parallelism on a small model (docs/tensor-parallel.md).

    layer input (DTensor, residual layout)  --LocalResidual: to_local, remember the global shape-->
        norm (LocalNorm)  --GatherSequence: all-gather (SP); backward: reduce-scatter / all-reduce-->
        q/k/v (LocalLinear, column-split)  attention on this rank's heads  o_proj (LocalLinear, row-split:
        reduce-scatter (SP) / all-reduce of the partial sums)  residual add, norm  --GatherSequence-->
        gate/up (column-split)  down (row-split, reduced)  residual add
    layer output  --LocalResidual: from_local with the remembered global shape-->  (DTensor, residual layout)

A column-split linear's input gradient on one rank is its share of the sum over ranks; GatherSequence declares its
output's gradient Partial, so q, k and v (or gate and up) add their shares locally and the block's input gradient is
reduced once, in GatherSequence's backward (Megatron's "f"): one collective per block, not one per linear.

Replicated weights whose gradient on one rank is a partial sum (norms under sequence parallelism, per-head norms,
LoRA's unsplit matrices, row-split biases under sequence parallelism) are summed over tp once per backward, together
(PartialGradReducer).

Two torch internals serve here, both in hfdist.torch_private with the reason no public API does: the norms run their
own forward with local views of their weights (`call_with_parameters`), and the partial gradients are summed when
the backward has finished (`queue_after_backward`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from hfdist.parallel.float8 import is_float8_linear
from hfdist.parallel.float8_tp import local_float8_linear
from hfdist.torch_private import call_with_parameters, queue_after_backward

__all__ = ["SequenceSpec", "LocalResidual", "GatherSequence", "PartialGradReducer", "LocalNorm", "LocalLinear",
           "ReduceOutput"]


class SequenceSpec:
    """The global shape and stride of the residual stream of the decoder layer now running.

    `LocalResidual` fills it from the layer's DTensor input; `GatherSequence` and the layer's output read it to
    rebuild DTensors from local shards. It cannot be inferred from a local shard: DTensor splits a sequence that tp
    does not divide unevenly (15 tokens on 2 ranks: 8 and 7). Layers run one at a time in a process (pipeline
    schedules interleave whole stage calls), and an activation-checkpointing recompute runs the layer's hooks again.
    """

    def __init__(self) -> None:
        self.shape: torch.Size | None = None
        self.stride: tuple[int, ...] | None = None

    def wrap(self, local: torch.Tensor, mesh: DeviceMesh, placement: Placement) -> DTensor:
        """`local` as the DTensor shard it is, with the remembered global shape (no communication)."""
        return DTensor.from_local(local, mesh, (placement,), run_check=False, shape=self.shape, stride=self.stride)


def _hidden_states(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | int, torch.Tensor]:
    """Where a module's hidden states come in, and their value: HF passes them positionally to decoder layers and
    MLPs and as `hidden_states=` to attention."""
    key: str | int = 0 if args and isinstance(args[0], torch.Tensor) else "hidden_states"
    return key, args[key] if isinstance(key, int) else kwargs[key]


def _replace(args: tuple[Any, ...], kwargs: dict[str, Any], key: str | int, value: torch.Tensor):
    if isinstance(key, int):
        return (value, *args[1:]), kwargs
    return args, {**kwargs, key: value}


class _ResidualStyle(ParallelStyle):
    """A style that moves the residual stream between its DTensor and local forms.

    Args:
        residual: the residual stream's placement (Shard(1) under sequence parallelism, else Replicate()).
        spec: shared by a plan's `LocalResidual` and `GatherSequence` styles.
    """

    def __init__(self, residual: Placement, spec: SequenceSpec):
        super().__init__()
        self.residual, self.spec = residual, spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.residual})"


class LocalResidual(_ResidualStyle):
    """A decoder layer that takes and returns its residual stream as a DTensor but computes on the local shard."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_local(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
            key, hidden = _hidden_states(args, kwargs)
            if not isinstance(hidden, DTensor):
                # A plain tensor here would mean a caller that lost the global shape: refuse rather than guess it.
                raise TypeError(f"{type(mod).__name__} under tensor parallelism expects its hidden states as a "
                                f"DTensor on the tp mesh, got {type(hidden).__name__}.")
            self.spec.shape, self.spec.stride = hidden.shape, hidden.stride()
            return _replace(args, kwargs, key, hidden.to_local())

        def to_dtensor(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
            if isinstance(output, tuple):  # layers of older transformers return (hidden_states, ...)
                return (self.spec.wrap(output[0], device_mesh, self.residual), *output[1:])
            return self.spec.wrap(output, device_mesh, self.residual)

        module.register_forward_pre_hook(to_local, with_kwargs=True)
        module.register_forward_hook(to_dtensor, with_kwargs=True)
        return module


class GatherSequence(_ResidualStyle):
    """The input of attention or the MLP: the local residual shard becomes the full local tensor (all-gather under
    sequence parallelism; nothing without it). Its gradient is declared Partial: the column-split linears that read
    it each return their rank's share of the input gradient, which autograd adds up locally and this style's
    backward sums over tp once per block (a reduce-scatter, or an all-reduce without sequence parallelism)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
            key, local = _hidden_states(args, kwargs)
            if self.residual.is_shard() and _splits_evenly(self.spec.shape[1], device_mesh):
                # Backward: the reduce-scatter of the summed gradient (the functional collective's autograd).
                full = funcol.all_gather_single(local, 1, device_mesh.get_group())
            else:
                dtensor = self.spec.wrap(local, device_mesh, self.residual).redistribute(placements=(Replicate(),))
                full = dtensor.to_local(grad_placements=(Partial(),))
            return _replace(args, kwargs, key, full)

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


def _splits_evenly(sequence_length: int, mesh: DeviceMesh) -> bool:
    """Whether every tp rank holds the same number of tokens of the sequence: the functional collectives' one
    requirement (module docstring); an uneven split goes through DTensor, which pads it."""
    return sequence_length % mesh.size() == 0


class PartialGradReducer:
    """Sums the tp-partial gradients of replicated weights (sequence-parallel and per-head norms) over tp once per
    backward, in one all-reduce queued to run when autograd finishes.

    Left Partial, every optimizer or clipping op that reads such a gradient would all-reduce it again (AdamW: three
    times per weight per step, one small collective each). Megatron likewise all-reduces its sequence-parallel norm
    gradients together after the backward. Under FSDP2 these hooks stay silent: FSDP2 replaces the parameters and
    itself redistributes a DTensor gradient to its parameter's placement before reduce-scattering.
    """

    def __init__(self) -> None:
        self._ready: list[nn.Parameter] = []

    def watch(self, param: nn.Parameter) -> None:
        """Reduce `param`'s gradient after each backward that accumulates into it."""
        param.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._ready:
            queue_after_backward(self._reduce)
        self._ready.append(param)

    @torch.no_grad()
    def _reduce(self) -> None:
        params = [p for p in self._ready if isinstance(p.grad, DTensor) and p.grad.placements[0].is_partial()]
        self._ready = []
        if not params:
            return
        mesh = params[0].grad.device_mesh
        flat = torch.cat([p.grad.to_local().reshape(-1) for p in params])
        summed = DTensor.from_local(flat, mesh, (Partial(),), run_check=False).redistribute(placements=(Replicate(),))
        for p, piece in zip(params, summed.to_local().split([p.grad.numel() for p in params])):
            p.grad = DTensor.from_local(piece.view_as(p.grad.to_local()), mesh, (Replicate(),), run_check=False)


def _local(param: nn.Parameter | None, grad: Placement | None) -> torch.Tensor | None:
    """A DTensor parameter's local view whose gradient comes back as a DTensor of placement `grad` (None: no view,
    the parameter is left out of the computation)."""
    return None if param is None or grad is None else param.to_local(grad_placements=(grad,))


def _watch_partial(module: nn.Module, grads: dict[str, Placement | None], reducer: PartialGradReducer | None) -> None:
    """Register with `reducer` every trainable parameter of `module` whose gradient `grads` declares Partial."""
    partial = [name for name, grad in grads.items() if grad is not None and grad.is_partial()]
    if partial and reducer is None:
        raise ValueError(f"{type(module).__name__}: parameters {partial} get tp-partial gradients and need a "
                         "PartialGradReducer")
    for name in partial:
        param = module.get_parameter(name)
        if param.requires_grad:  # a frozen weight (LoRA's base model) has no gradient to sum
            reducer.watch(param)


class LocalNorm(ParallelStyle):
    """A norm computed on local tensors with its weight replicated as a DTensor on the tp mesh.

    The module's own forward runs (whatever the architecture's norm computes), with a local view of each parameter
    standing in for it during the call (hfdist.torch_private.call_with_parameters says why). A DTensor input (the
    final norm's) comes back as a DTensor of the same layout; a local input (inside a layer) comes back local.

    Args:
        weight_grad: the placement of the weight's gradient on this rank: Partial() where the norm sees part of the
            tokens (sequence parallel) or of the heads (per-head norms), so it is summed over tp after backward;
            Replicate() where every rank sees the same full input and so computes the same gradient.
        reducer: sums Partial weight gradients after each backward (required with weight_grad=Partial()).
    """

    def __init__(self, *, weight_grad: Placement, reducer: PartialGradReducer | None = None):
        super().__init__()
        if weight_grad.is_partial() and reducer is None:
            raise ValueError("LocalNorm(weight_grad=Partial()) needs a PartialGradReducer")
        self.weight_grad, self.reducer = (weight_grad,), reducer

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh, None)  # replicate the parameters (the input stays as it comes)
        grads = {name: self.weight_grad[0] for name, _ in module.named_parameters(recurse=False)}
        _watch_partial(module, grads, self.reducer)
        forward = module.forward

        def local_forward(hidden_states: torch.Tensor) -> torch.Tensor:
            dtensor = hidden_states if isinstance(hidden_states, DTensor) else None
            x = dtensor.to_local() if dtensor is not None else hidden_states
            # Read at call time: FSDP2 swaps in its unsharded parameters just before a module's forward.
            views = {name: _local(module.get_parameter(name), grad) for name, grad in grads.items()}
            out = call_with_parameters(module, forward, views, x)
            if dtensor is None:
                return out
            return DTensor.from_local(out, dtensor.device_mesh, dtensor.placements, run_check=False,
                                      shape=dtensor.shape, stride=dtensor.stride())

        module.forward = local_forward
        return module

    def __repr__(self) -> str:
        return f"LocalNorm(weight_grad={self.weight_grad[0]})"


def _reduce_partial(partial: torch.Tensor, mesh: DeviceMesh, layout: Placement,
                    bias: nn.Parameter | None) -> torch.Tensor:
    """Sum this rank's partial output over tp into the local tensor of `layout` (Shard(1): reduce-scatter on the
    sequence; Replicate(): all-reduce; backward: the matching all-gather, or nothing), then add `bias` (a row-split
    linear's replicated bias, which belongs to the sum, not to each rank's part)."""
    if layout.is_shard() and _splits_evenly(partial.shape[1], mesh):
        out = funcol.wait_tensor(funcol.reduce_scatter_single(partial, "sum", 1, mesh.get_group()))
    else:
        summed = DTensor.from_local(partial, mesh, (Partial(),), run_check=False).redistribute(placements=(layout,))
        out = summed.to_local()
    return out if bias is None else out + bias.to_local(grad_placements=(_bias_grad(layout),))


def _bias_grad(layout: Placement) -> Placement:
    """The gradient placement of a bias added after reduction to the residual layout: a partial sum over the
    sequence shards under sequence parallelism, the full sum on every rank otherwise."""
    return Partial() if layout.is_shard() else Replicate()


class LocalLinear(ParallelStyle):
    """A linear computed on local tensors: input, output and weight view all plain tensors; the weight a DTensor.
    Its forward is `F.linear` (or the float8 matmul of hfdist.parallel.float8_tp under --fp8) of the input and the
    parameters' local views, read when it is called (FSDP2 swaps in its unsharded parameters just before).

    Args:
        split: 0: column-split (output features; each rank computes its heads / its share of the MLP's width and
            returns its share of the input gradient); 1: row-split (input features; each rank's output is a partial
            sum); None: replicated (LoRA's unsplit A or B matrix next to a split one; its gradient on a rank is a
            partial sum, summed by `reducer`).
        reduce_to: a row-split linear's output is summed over tp into this residual layout here (Shard(1): reduce-
            scatter, Replicate(): all-reduce) and its bias added after the sum. None: the caller reduces (a LoRA
            wrapper sums base and adapter once: ReduceOutput), and the bias is left to it.
        reducer: sums the Partial gradients (replicated weights; row-split biases under sequence parallelism).
    """

    def __init__(self, *, split: int | None, reduce_to: Placement | None = None,
                 reducer: PartialGradReducer | None = None):
        super().__init__()
        if split not in (0, 1, None) or (reduce_to is not None and split != 1):
            raise ValueError(f"LocalLinear: split must be 0, 1 or None and only a row split (1) reduces; got "
                             f"split={split}, reduce_to={reduce_to}")
        self.split, self.reduce_to, self.reducer = split, reduce_to, reducer

    def _placements(self) -> tuple[Placement, Placement]:
        """(weight, bias) placements; nn.Linear's weight is (out_features, in_features)."""
        if self.split is None:
            return Replicate(), Replicate()
        return Shard(self.split), Shard(0) if self.split == 0 else Replicate()

    def _grads(self) -> dict[str, Placement | None]:
        """The gradient placement of each parameter's local view; None: the bias of a row-split linear, which belongs
        to the summed output and is added after the sum (here, or by the LoRA wrapper's ReduceOutput)."""
        weight_layout, bias_layout = self._placements()
        if self.split is None:
            return {"weight": Partial(), "bias": Partial()}
        return {"weight": weight_layout, "bias": bias_layout if self.split == 0 else None}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        weight_layout, bias_layout = self._placements()

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                layout = weight_layout if pname == "weight" else bias_layout
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [layout]), p.requires_grad))

        distribute_module(module, device_mesh, partition)
        grads = self._grads()
        has_bias = module.bias is not None
        reduce_to = self.reduce_to
        _watch_partial(module, grads if has_bias else {"weight": grads["weight"]}, self.reducer)
        if has_bias and reduce_to is not None:
            _watch_partial(module, {"bias": _bias_grad(reduce_to)}, self.reducer)
        # --fp8: the float8 matmul with every scale taken over the whole tensor
        linear: Callable[..., torch.Tensor] = (local_float8_linear(module, device_mesh, self.split)
                                               if is_float8_linear(module) else F.linear)

        def local_forward(x: torch.Tensor) -> torch.Tensor:
            out = linear(x, _local(module.weight, grads["weight"]), _local(module.bias, grads["bias"]))
            if reduce_to is None:
                return out
            return _reduce_partial(out, device_mesh, reduce_to, module.bias)

        module.forward = local_forward
        return module

    def __repr__(self) -> str:
        return f"LocalLinear(split={self.split}, reduce_to={self.reduce_to})"


class ReduceOutput(ParallelStyle):
    """A LoRA-wrapped row-split linear: base and adapter each return a partial sum; their sum is reduced over tp
    once, into the residual layout, and the base layer's bias added after (see LocalLinear's reduce_to)."""

    def __init__(self, *, reduce_to: Placement, reducer: PartialGradReducer):
        super().__init__()
        self.reduce_to, self.reducer = reduce_to, reducer

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        base = module.base_layer
        if base.bias is not None:
            _watch_partial(base, {"bias": _bias_grad(self.reduce_to)}, self.reducer)

        def reduce(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            return _reduce_partial(output, device_mesh, self.reduce_to, base.bias)

        module.register_forward_hook(reduce)
        return module

    def __repr__(self) -> str:
        return f"ReduceOutput({self.reduce_to})"
