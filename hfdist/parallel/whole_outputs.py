"""The model's outputs whole on every rank, for a loss that is not hfdist's own.

hfdist's own loss runs sharded: vocab-parallel logits under TP, each cp rank's chunk of the sequence under CP (the
Trainer cuts the batch, hfdist.train.context_trainer). A Trainer's own loss (TRL's DPO, TRL's SFT with its token
metrics, a custom compute_loss) reads the model's outputs as one process computes them: the logits, or the decoder's
last hidden states, which TRL's fused head projects itself. `whole_outputs(model)` makes every rank of a tp / cp group
produce exactly those:

- TP: the decoder's last hidden states (a sequence-sharded DTensor under sequence parallelism) become a plain tensor
  of the whole sequence, and lm_head takes such a tensor as replicated and returns full logits (a plain tensor). The
  gradients go back through the DTensor conversions as replicated ones (each rank keeps its part, nothing summed):
  every tp rank computes the same loss, which is what tensor parallelism's own rule expects.
- CP: the decoder takes the whole rows and cuts them itself. The attention inputs are built for the whole rows first
  (hfdist.data.collation.attention_inputs from the position ids: a row is one causal sequence unless its position
  ids restart, as in packed rows; a 2-D padding mask must be right-padding, whose pads no real token attends to
  under causal attention), the rows are padded to what the cp plan cuts evenly, and each cp rank runs its tokens
  through the decoder layers (attention over the whole sequence by the plan's method, hfdist.parallel.context). The
  decoder's output is gathered back to the whole sequence on every cp rank; the gather's backward adds the cp ranks'
  gradients of each token, because every rank computed the same loss from it and FSDP2 averages the gradients over dp_shard x cp.
  Under this rule the ranks of a cp group count as one batch's tensor-parallel ranks do (hfdist.api's trainers).

The cost: lm_head and the loss run on the whole sequence on every rank of the group (the decoder layers, where the
memory of long sequences is, stay sharded).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from hfdist.parallel.context import ContextParallelError

__all__ = ["whole_outputs"]

_BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _plain(x: torch.Tensor) -> torch.Tensor:
    """A DTensor as the plain tensor of its whole value (replicated); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(x, DTensor):
        return x
    return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim).to_local()


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 1 over a group, each rank's part put back at its positions `order` (every rank's token
    index, concatenated in rank order); the backward sums every rank's gradient and keeps this rank's positions."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, order: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.mine = group, mine
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        gathered = torch.cat(parts, dim=1)
        return torch.empty_like(gathered).index_copy_(1, order, gathered)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.index_select(1, ctx.mine), None, None, None


def _right_padded(mask: torch.Tensor) -> bool:
    """Whether every row of a 2-D attention mask is ones followed by zeros."""
    kept = mask.bool()
    return bool((kept.int().diff(dim=-1) <= 0).all())


class _SequenceCut:
    """The context-parallel half of `whole_outputs`: a pre-hook that cuts the decoder's whole rows into this rank's
    tokens (with attention inputs for the whole rows), a post-hook that gathers its output back."""

    def __init__(self, spec, config) -> None:
        self.group, self.plan, self.attention = spec.group, spec.plan, spec.base  # apply_cp's CpSpec
        self.rank = dist.get_rank(self.group)
        self.config = config
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # per call in flight: length, order, mine

    def _attention_inputs(self, position_ids: torch.Tensor) -> dict[str, Any]:
        from hfdist.data.collation import attention_inputs, sliding_window_for

        window = sliding_window_for(self.config, position_ids.shape[1]) if self.attention in ("sdpa", "eager") \
            else None
        return attention_inputs(position_ids, self.attention, window)

    def cut(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        from hfdist.parallel.context import token_index

        if args:  # the decoder's first positional argument is input_ids
            kwargs, args = {"input_ids": args[0], **kwargs}, ()
        key = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
        rows = kwargs[key]
        batch, seq = rows.shape[:2]
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(seq, device=rows.device).expand(batch, seq)
        mask = kwargs.pop("attention_mask", None)
        if mask is not None and (mask.dim() != 2 or not _right_padded(mask)):
            raise ContextParallelError(
                f"Under context parallelism hfdist cuts each row of a batch across the cp ranks and rebuilds its "
                f"attention from the position ids, so a batch may carry a right-padding 2-D attention mask at most; "
                f"this one is {mask.dim()}-D{' with left padding or holes' if mask.dim() == 2 else ''}. Pad on the "
                "right (tokenizer.padding_side = 'right'), or mark packed documents with restarting position_ids.")
        pad = (-seq) % self.plan.seq_multiple
        if pad:  # a document of its own at the end of each row, cut away again after the gather
            rows = nn.functional.pad(rows, (0, 0, 0, pad) if rows.dim() == 3 else (0, pad))
            tail = torch.arange(pad, device=positions.device).expand(batch, pad)
            positions = torch.cat([positions, tail], dim=1)
        for stale in _BOUNDARY_KEYS:
            kwargs.pop(stale, None)
        kwargs.update(self._attention_inputs(positions))
        ranks = [token_index(rows.shape[1], self.plan, r, rows.device) for r in range(self.plan.cp)]
        kwargs[key] = rows.index_select(1, ranks[self.rank])
        kwargs["position_ids"] = positions.index_select(1, ranks[self.rank])
        kwargs["use_cache"] = False
        self.pending.append((seq, torch.cat(ranks), ranks[self.rank]))
        return args, kwargs

    def join(self, hidden: torch.Tensor) -> torch.Tensor:
        seq, order, mine = self.pending.pop()
        return _GatherSequence.apply(hidden, self.group, order, mine)[:, :seq]


def _replicated_input(mesh, module: nn.Module, args: tuple) -> tuple:
    """lm_head's input: a plain tensor is the whole sequence, replicated on every tp rank (the style then keeps it)."""
    from torch.distributed.tensor import DTensor, Replicate

    x = args[0]
    if isinstance(x, DTensor):
        return args
    return (DTensor.from_local(x, mesh, [Replicate()], run_check=False), *args[1:])


def _full_logits(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return _plain(output)


def _decoder_output(cut: _SequenceCut | None, module: nn.Module, args: tuple, kwargs: dict, output):
    hidden = _plain(output.last_hidden_state)
    output.last_hidden_state = cut.join(hidden) if cut is not None else hidden
    return output


def _tp_mesh(lm_head: nn.Module):
    """The tensor-parallel mesh lm_head is split on, or None without TP."""
    from torch.distributed.tensor import DTensor

    weight = lm_head.weight
    if not isinstance(weight, DTensor) or "tp" not in (weight.device_mesh.mesh_dim_names or ()):
        return None
    mesh = weight.device_mesh
    return mesh["tp"] if mesh.ndim > 1 else mesh


def whole_outputs(model: nn.Module) -> list[RemovableHandle]:
    """Make `model` (a causal LM of a registered architecture, possibly inside peft, after hfdist's TP / CP / FSDP2)
    return on every rank the outputs one process computes; see the module docstring. Nothing changes without TP or
    CP. Returns the hooks' handles (`.remove()` undoes it)."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = causal_lm.get_decoder()
    handles: list[RemovableHandle] = []
    from hfdist.parallel.context import cp_spec_of

    cut = None
    spec = cp_spec_of(causal_lm)
    if spec is not None:
        cut = _SequenceCut(spec, causal_lm.config)
        handles.append(decoder.register_forward_pre_hook(cut.cut, with_kwargs=True))
    head = causal_lm.get_output_embeddings()
    mesh = _tp_mesh(head)
    if mesh is not None:
        handles.append(head.register_forward_pre_hook(partial(_replicated_input, mesh), prepend=True))
        handles.append(head.register_forward_hook(_full_logits))
    if cut is not None or mesh is not None:
        handles.append(decoder.register_forward_hook(partial(_decoder_output, cut), with_kwargs=True))
    return handles
