"""The torch internals hfdist relies on, all of them in this one module, each with the reason no public API serves.

`tests/unit/test_torch_private.py` holds the contract: it checks against the installed torch that each internal
still behaves as used here, so a torch release that changes one fails there, by name, rather than somewhere inside
a training step. Everything else in hfdist reaches torch through public APIs.

- `call_with_parameters`: a module's own forward run with other tensors standing in for its parameters, through
  `module._parameters`. Tensor parallelism computes each norm (`LocalNorm`) on local tensors with a local view of
  its replicated DTensor weight, whose gradient placement it declares. The public ways do not fit: torch's
  `functional_call` calls the module (its hooks run again, and it would recurse into the style's own forward),
  `parametrize` renames the parameter (`parametrizations.weight.original`: state dicts, FSDP2 and checkpoints see
  another name), and torch's SequenceParallel style runs the norm through DTensor's per-op dispatch and reduces each
  norm's weight gradient in a collective of its own (docs/tensor-parallel.md has the figures). The linears need no
  such call: their forward is `F.linear` of the local views (hfdist.parallel.tensor_styles.LocalLinear).
- `queue_after_backward`: a callback that the autograd engine runs once the current backward has finished, after
  every gradient has been accumulated (`Variable._execution_engine.queue_callback`, which FSDP2 uses for its own
  post-backward reduction). Tensor parallelism sums the tp-partial gradients of replicated weights there, all in one
  all-reduce (hfdist.parallel.tensor_styles.PartialGradReducer). Public hooks fire per tensor
  (`register_post_accumulate_grad_hook`) or before accumulation (`register_multi_grad_hook`), and none at the end of
  a backward whose inputs need no gradient (a model's input ids).
- `pipeline_receive_buffers`: the buffers a `torch.distributed.pipelining` stage receives into, one per micro-batch
  for the activations it gets and one for the gradients it gets back, allocated at its first step and kept for the
  run (the stage's `args_recv_info` / `grad_recv_info`). torch keeps no public count of them; hfdist's memory meter
  counts them with the rest of a rank's training state (hfdist.metrics.memory.held_outside_bytes), as the planner
  does (hfdist.plan.bytes). Its contract needs a pipeline on several ranks, so it is checked in
  tests/integration/test_pipeline.py (the bytes after each step, against torch's 1F1B and Interleaved1F1B stages).
- `fsdp_unsharded_storages`: the storages FSDP2 keeps for a module's unsharded parameters (each FSDP parameter's
  all-gather outputs, read through the module's FSDP state), which FSDP2 frees and refills by resizing them in place
  rather than by any op that makes a tensor. hfdist's CPU memory count (hfdist.metrics.memory.LiveTensorBytes) reads
  their size where a step's tensors may peak; FSDP2's public FSDPModule methods (unshard, reshard) say nothing of
  the memory they hold.
- `loss_parallel_active`: whether `torch.distributed.tensor.parallel.loss_parallel()` is in effect, read from the
  DTensor handlers it installs (torch keeps no public flag). The recomputing chunked loss refuses vocab-sharded
  logits outside it rather than let DTensor gather every chunk's whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["call_with_parameters", "queue_after_backward", "pipeline_receive_buffers", "fsdp_unsharded_storages",
           "loss_parallel_active"]


def call_with_parameters(module: nn.Module, forward: Callable[..., Any],
                         params: Mapping[str, torch.Tensor | None], *args: Any) -> Any:
    """`forward(*args)` with `module`'s parameters named in `params` replaced by those tensors (None: hidden) for the
    call, and restored after it (errors included). `forward` is the module's own (bound) forward."""
    saved = {name: module._parameters[name] for name in params}
    try:
        module._parameters.update(params)
        return forward(*args)
    finally:
        module._parameters.update(saved)


def queue_after_backward(callback: Callable[[], None]) -> None:
    """Run `callback` once the backward now running has finished (call it from inside a backward hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def pipeline_receive_buffers(stage: Any) -> list[torch.Tensor]:
    """The receive buffers torch.distributed.pipelining's `stage` (a PipelineStage) holds: none before its first
    step; DTensor activations as their local tensors."""
    from torch.distributed.tensor import DTensor

    out = []
    for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
        for info in infos:
            buffer = getattr(info, "buffer", None)  # a root argument's placeholder has none
            if isinstance(buffer, torch.Tensor):
                out.append(buffer.to_local() if isinstance(buffer, DTensor) else buffer)
    return out


def fsdp_unsharded_storages(model: nn.Module) -> list[torch.UntypedStorage]:
    """The storages of the unsharded parameters of every FSDP2 unit in `model` (none before a unit's first
    all-gather): full size while the unit is unsharded, 0 bytes once FSDP2 resharded it."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group is not None else ():
                out += [t.untyped_storage() for t in param.all_gather_outputs]
    return out


def loss_parallel_active() -> bool:
    """Whether `torch.distributed.tensor.parallel.loss_parallel()` is in effect: it installs DTensor handlers for
    the log-softmax ops while active."""
    from torch.distributed.tensor import DTensor

    return torch.ops.aten._log_softmax.default in DTensor._op_dispatcher._custom_op_handlers
