"""The global gradient norm of a model whose gradients live on several meshes, and clipping by it.

Why hfdist computes it, not DTensor: with expert parallelism the experts' gradients live on a mesh of their own
(`efsdp` x `ep`, carved out of the world mesh), and DTensor's norm of a gradient sharded over two of its dims reduces
over the two dims flattened into one group, which torch 2.13 can only build for dims in the root mesh's order:
transformers' Trainer, which norms each mesh's gradients that way (`_mixed_mesh_grad_norm`), raised at the first step
of fsdp_tp with --ep (`KeyError: Invalid mesh_dim_names ('efsdp', 'ep')`), with or without clipping. Here each
(mesh, placements) group's squared norm is summed locally and all-reduced over each dim it is sharded on, one dim at a
time: no flattened group, the same number on every rank, and the single process's norm up to reduction order.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["grad_norm", "clip_grad_norm"]


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """This rank's sum of the squares of `grads` (fp32), where every gradient shares one (mesh, placements); the sum
    over the ranks that hold the other shards of each gradient, so that every rank of the mesh holds the whole."""
    local = []
    mesh, placements = (grads[0].device_mesh, grads[0].placements) if isinstance(grads[0], DTensor) else (None, ())
    if any(p.is_partial() for p in placements):  # a pending sum: the values exist only once it is done
        grads = [g.redistribute(placements=[Replicate() if p.is_partial() else p for p in placements]) for g in grads]
        placements = grads[0].placements
    for g in grads:
        local.append((g.to_local() if mesh is not None else g).detach().float())
    squared = torch.stack([t.pow(2).sum() for t in local]).sum()  # on the gradients' device
    for dim, placement in enumerate(placements):
        # Sharded over this dim, plainly or strided (FSDP2 over TP's shards is a _StridedShard, which torch does not
        # count as is_shard()): each rank holds different values.
        if not placement.is_replicate():
            dist.all_reduce(squared, group=mesh.get_group(dim))
    return squared


def _groups(params: Iterable[torch.nn.Parameter]) -> dict[object, list[torch.nn.Parameter]]:
    """The parameters with gradients, by their gradients' (mesh, placements) (None: plain tensors)."""
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    return groups


def grad_norm(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None = None,
              device: torch.device | None = None) -> torch.Tensor:
    """The L2 norm of every gradient of `params` over every mesh (a plain-tensor gradient counts as this rank holds
    it: whole, or replicated over its data-parallel ranks), the same fp32 scalar on every rank.

    Args:
        group: ranks whose `params` are disjoint parts of one model (a pipeline's stages): their squared norms are
            summed too.
        device: where the scalar lives when there are no gradients (default: CPU).

    Collective on every mesh a gradient is sharded over, and on `group`.
    """
    groups = _groups(params)
    squared = [_squared_norm([p.grad for p in members]) for members in groups.values()]
    first = next(iter(groups.values()))[0].grad if groups else None
    where = first.device if first is not None else (device or torch.device("cpu"))
    total = torch.stack([s.to(where) for s in squared]).sum() if squared else torch.zeros((), device=where)
    if group is not None:
        dist.all_reduce(total, group=group)
    return total.sqrt()


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, group: dist.ProcessGroup | None = None,
                   device: torch.device | None = None,
                   counted: Iterable[torch.nn.Parameter] | None = None) -> torch.Tensor:
    """Scale every gradient of `params` so that their global norm (`grad_norm`) is at most `max_norm` (inf: leave
    them), and return the norm before clipping. Collective as `grad_norm`.

    Args:
        counted: the parameters whose gradients make up the norm (default: `params`; a pipeline's tied weight, held
            by two stages, counts once).
    """
    groups = _groups(params)
    total = grad_norm([p for members in groups.values() for p in members] if counted is None else counted, group,
                      device)
    if max_norm != float("inf"):
        for members in groups.values():  # each group's gradients share one mesh: foreach ops take them together
            torch.nn.utils.clip_grads_with_norm_(members, max_norm, total)
    return total
