"""Tokens to their experts and back: the computation of one MoE layer's routed experts under expert parallelism.

Each of the `ep` ranks of an expert-parallel group holds E / ep whole experts (rank r: experts r*E/ep ..
(r+1)*E/ep - 1). A token routed to k experts is sent, once per expert, to the rank holding it; the expert's output
comes back the same way, and the token's output is the weighted sum of its k expert outputs, in the (token, slot)
order and with the weights transformers' own experts use, so the sums are the single process's up to the order of
fp32 additions:

    assignments (T*k) sorted by expert            stable sort: each expert's rows in token order
    counts per expert -> all_to_all (no grad)     every rank learns how many rows it receives for each local expert;
                                                  both count tables copied to the host once (the split sizes the
                                                  all-to-alls take: the one point a GPU's stream is waited on)
    rows -> all_to_all_single (autograd)          sent in the order of the destination's experts
    regroup by local expert, run the experts      grouped GEMM on GPU in bf16 (torch._grouped_mm), a loop over the
                                                  local experts on CPU (torch's CPU grouped GEMM is a reference
                                                  kernel, ~13x slower than the loop at these sizes)
    rows back -> all_to_all_single (autograd), unsort, weight, sum over the k slots

The all_to_all's backward is the reverse all_to_all, so gradients of the expert weights arrive on the rank that holds
them, and the inputs' on the rank that sent them. Nothing here knows about FSDP2 or tensor parallelism: the caller
passes the local expert weights (FSDP2 has gathered them for the experts module's forward) and the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

__all__ = ["Dispatch", "dispatch", "combine", "run_experts", "routed_experts"]


@dataclass
class Dispatch:
    """What `combine` needs to bring the expert outputs back: the sort of the assignments and the row counts each
    rank sent and received."""

    order: torch.Tensor  # (T*k,) assignment indices sorted by expert
    sent: list[int]  # rows sent to each ep rank
    received: list[int]  # rows received from each ep rank
    regroup: torch.Tensor | None  # received rows -> grouped by local expert (None: one rank, already grouped)
    sizes: list[int]  # rows per local expert, in the grouped order


def _exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """(ep, local experts) rows this rank receives from each rank for each of its experts."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received.view(ep, -1)


def dispatch(rows: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, group) -> tuple[torch.Tensor, Dispatch]:
    """Send each assignment's row to the rank holding its expert.

    Args:
        rows: (T*k, H) one row per (token, slot) assignment, in that order.
        expert_ids: (T*k,) the expert of each assignment.
        num_experts: E, over the whole group.
        group: the expert-parallel process group, or None (one rank holds every expert).

    Returns:
        (the rows this rank's experts compute, grouped by local expert; the record `combine` takes).
    """
    order = torch.argsort(expert_ids, stable=True)
    # scatter_add_, not bincount: bincount on a GPU reads the largest id back to the host to size its output
    counts = expert_ids.new_zeros(num_experts).scatter_add_(0, expert_ids, torch.ones_like(expert_ids))
    sorted_rows = rows[order]
    if group is None or dist.get_world_size(group) == 1:
        sizes = counts.tolist()
        return sorted_rows, Dispatch(order, [len(order)], [len(order)], None, sizes)
    ep = dist.get_world_size(group)
    received_counts = _exchange_counts(counts, group)  # (ep, E / ep)
    # The split sizes are host integers (all_to_all_single takes lists): one copy of both count tables to the host,
    # the only point where a GPU's stream waits in a dispatch, and everything below derived from it.
    host = torch.cat([counts.view(ep, -1), received_counts]).cpu()
    sent, received = host[:ep].sum(1).tolist(), host[ep:].sum(1).tolist()
    arrived = funcol.wait_tensor(funcol.all_to_all_single_autograd(sorted_rows, received, sent, group))
    # Arrived rows are ordered by sender, then local expert: regroup them by local expert (stable: sender order).
    local = torch.arange(received_counts.shape[1], device=rows.device).repeat(ep)
    regroup = torch.argsort(torch.repeat_interleave(local, received_counts.reshape(-1), output_size=sum(received)),
                            stable=True)
    return arrived[regroup], Dispatch(order, sent, received, regroup, host[ep:].sum(0).tolist())


def combine(out: torch.Tensor, record: Dispatch, group) -> torch.Tensor:
    """The expert outputs of `dispatch`'s rows, back on their senders in (token, slot) order: (T*k, H)."""
    if record.regroup is not None:
        out = out[torch.argsort(record.regroup)]  # back to (sender, local expert) order
        out = funcol.wait_tensor(funcol.all_to_all_single_autograd(out, record.sent, record.received, group))
    return out[torch.argsort(record.order)]


def _grouped(rows: torch.Tensor, weight: torch.Tensor, sizes: list[int], transposed: bool) -> torch.Tensor:
    """rows @ each local expert's weight, the experts' rows consecutive (`sizes` each): one grouped GEMM."""
    from transformers.integrations.moe import _grouped_linear

    offsets = torch.tensor(sizes, device=rows.device).cumsum(0).to(torch.int32)
    return _grouped_linear(rows, weight, offsets, is_transposed=transposed)


def _looped(rows: torch.Tensor, weight: torch.Tensor, sizes: list[int], transposed: bool) -> torch.Tensor:
    """The same product, one matmul per local expert (the CPU path)."""
    parts = [chunk @ (weight[e] if transposed else weight[e].T) for e, chunk in enumerate(rows.split(sizes))]
    return torch.cat(parts) if parts else rows.new_zeros(0, weight.shape[-1] if transposed else weight.shape[-2])


def run_experts(rows: torch.Tensor, sizes: list[int], gate_up: torch.Tensor, down: torch.Tensor, act: nn.Module,
                transposed: bool, grouped: bool | None = None) -> torch.Tensor:
    """Each local expert's gated MLP on its rows: down(act(gate(x)) * up(x)), with gate and up the halves of
    gate_up's output (transformers' stacked layout: (E, 2I, H) and (E, H, I), or transposed (E, H, 2I), (E, I, H)).

    Args:
        grouped: use torch's grouped GEMM (default: on GPU in bf16, the dtype its CUDA kernels are built for; fp32
            on a GPU loops, correct but slower); False: a loop over the local experts.
    """
    if grouped is None:
        grouped = rows.is_cuda and gate_up.dtype == torch.bfloat16
    matmul = _grouped if grouped else _looped
    gate, up = matmul(rows, gate_up, sizes, transposed).chunk(2, dim=-1)
    return matmul(act(gate) * up, down, sizes, transposed)


def routed_experts(hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, act: nn.Module, *, num_experts: int, transposed: bool, weights_input: bool,
                   group) -> torch.Tensor:
    """One MoE layer's routed output for this rank's tokens: (T, H).

    Args:
        hidden: (T, H) tokens. expert_ids, weights: (T, k) each token's experts and their weights.
        gate_up, down: this rank's experts' stacked weights (E / ep of them).
        weights_input: the weight scales the expert's input (Llama 4) rather than its output.
        group: the expert-parallel group (None: every expert here).
    """
    tokens, k = expert_ids.shape
    rows = hidden.repeat_interleave(k, dim=0)  # (T*k, H): assignment (t, j) at row t*k + j
    flat_weights = weights.reshape(-1, 1).to(hidden.dtype)
    if weights_input:
        rows = rows * flat_weights
    grouped_rows, record = dispatch(rows, expert_ids.reshape(-1), num_experts, group)
    out = combine(run_experts(grouped_rows, record.sizes, gate_up, down, act, transposed), record, group)
    if not weights_input:
        out = out * flat_weights
    return out.view(tokens, k, -1).sum(dim=1)
