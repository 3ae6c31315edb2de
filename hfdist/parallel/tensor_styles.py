"""The parallel styles of hfdist's tensor-parallel plan (hfdist.parallel.tensor) that torch does not ship.

Inside a decoder layer the layout of every activation is known, so the layer computes on local tensors, as in
Megatron: the residual stream, its adds and the RMSNorms never go through DTensor's per-op dispatch (on a small
model that dispatch cost more than the matmuls). DTensor stays where it earns its keep: the split linears (their
weights are DTensors, and torch's Colwise/RowwiseParallel place the collectives), the redistributions at the
attention / MLP inputs, and the residual stream *between* layers, because HF's model reads the global sequence
length from `inputs_embeds.shape[1]` (positions, causal mask) and a DTensor reports the global shape while its
local shard holds S/tp tokens under sequence parallelism. Pipeline stages pass the same DTensor on.

    layer input (DTensor, residual layout)  --LocalResidual: to_local, remember the global shape-->
        norm (LocalNorm, local)  --GatherSequence: all-gather (SP)-->  attention  --o_proj: reduce-scatter (SP)-->
        residual add (local), norm (local)  --GatherSequence-->  MLP  --down_proj-->  residual add (local)
    layer output  --LocalResidual: from_local with the remembered global shape-->  (DTensor, residual layout)

Every parameter stays a DTensor on the tp mesh (clipping and FSDP2 need one mesh); a norm computes with a local
view of its replicated weight whose gradient is declared Partial where the norm saw only part of the tokens or
heads, exactly the gradient DTensor itself would have produced.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["ReplicateParallel", "SequenceSpec", "LocalResidual", "GatherSequence", "PartialGradReducer", "LocalNorm"]


class ReplicateParallel(ParallelStyle):
    """Replicate a module's parameters as DTensors on the tp mesh; plain-tensor inputs are taken as replicated.

    Used where a module must compute on the full tensor (LoRA's small A/B matrices) but its parameters should still
    be DTensors, so their gradients are reduced correctly and every parameter lives on one mesh.

    Args:
        use_local_output: return the local tensor; the next style's `from_local` then all-reduces the partial
            gradient coming back, at that point (Megatron's "f" operator) rather than lazily further up.
    """

    def __init__(self, *, use_local_output: bool = False):
        super().__init__()
        self.use_local_output = use_local_output

    @staticmethod
    def _as_replicated(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        return tuple(
            DTensor.from_local(t, mesh, (Replicate(),), run_check=False)
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t
            for t in inputs
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # partition_fn=None: distribute_module replicates (broadcasts from rank 0) every parameter.
        output_fn = (lambda mod, out, mesh: out.to_local()) if self.use_local_output else None
        return distribute_module(module, device_mesh, None, input_fn=self._as_replicated, output_fn=output_fn)

    def __repr__(self) -> str:
        return f"ReplicateParallel(use_local_output={self.use_local_output})"


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
    """The input of attention or the MLP: the local residual shard becomes a replicated DTensor (all-gather under
    sequence parallelism; nothing without it). Its backward is the matching reduce-scatter (or all-reduce) of the
    split linears' partial input gradients, once per block (Megatron's pattern)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
            key, local = _hidden_states(args, kwargs)
            full = self.spec.wrap(local, device_mesh, self.residual).redistribute(placements=(Replicate(),))
            return _replace(args, kwargs, key, full)

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


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
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)
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


class LocalNorm(ParallelStyle):
    """A norm computed on local tensors with its weight replicated as a DTensor on the tp mesh.

    The module's own forward runs (whatever the architecture's norm computes), with a local view of each parameter
    standing in for it during the call. A DTensor input (the final norm's) comes back as a DTensor of the same
    layout; a local input (inside a layer) comes back local.

    Args:
        weight_grad: the placement of the weight's gradient on this rank: Partial() where the norm sees part of the
            tokens (sequence parallel) or of the heads (per-head norms), so DTensor sums it over tp before use;
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
        if self.weight_grad[0].is_partial():
            for p in module.parameters(recurse=False):
                if p.requires_grad:  # a frozen norm (LoRA's base model) has no gradient to sum
                    self.reducer.watch(p)
        forward = module.forward
        names = [name for name, _ in module.named_parameters(recurse=False)]

        def local_forward(hidden_states: torch.Tensor) -> torch.Tensor:
            dtensor = hidden_states if isinstance(hidden_states, DTensor) else None
            x = dtensor.to_local() if dtensor is not None else hidden_states
            # Read at call time: FSDP2 swaps in its unsharded parameters before the forward.
            params = {name: module._parameters[name] for name in names}
            try:
                for name, p in params.items():
                    module._parameters[name] = p.to_local(grad_placements=self.weight_grad)
                out = forward(x)
            finally:
                module._parameters.update(params)
            if dtensor is None:
                return out
            return DTensor.from_local(out, dtensor.device_mesh, dtensor.placements, run_check=False,
                                      shape=dtensor.shape, stride=dtensor.stride())

        module.forward = local_forward
        return module

    def __repr__(self) -> str:
        return f"LocalNorm(weight_grad={self.weight_grad[0]})"
