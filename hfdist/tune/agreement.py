"""The same math, checked for free: every probe starts from the same weights on the same global batches, so the
first two steps' losses and gradient norms (before clipping, global over all ranks) of probes that train in the same
precision must agree: the first loss checks the forward, the first norm the backward, the second loss and norm the
optimizer step. A probe that disagrees with the others is a bug, flagged and never chosen.

Probes are grouped by the precision they train in (fp32, bf16, fp8 recipes: `ProbeResult.numerics`). Inside a group
each probe seeds a cluster: the probes within tolerance of it. The largest cluster is the reference (of equals, the
one whose seed is the simplest rung, the rung table's plan order: the most tested), its seed the probe every other is
measured against; every probe outside it disagrees. Only a reference of two or more probes decides: while no two
probes of a group agree (one probe, or two that differ), its probes are unchecked, and hfdist tune runs a
tie-breaking probe (hfdist.tune.session) rather than choose one of them.

Gradient norms are compared where both probes have them (a summary before they were recorded has none).

Tolerances: the layouts sum the same products in other orders (sharded, reduced over ranks, accumulated over
micro-batches, split over tensor-parallel ranks), which the end-to-end suite measures well below 1e-5 relative in
fp32 after a step (tests/e2e: every rung against one process); bf16 rounds every product to 8 bits, 2e-2 after a step.
"""

from __future__ import annotations

from hfdist.tune.candidates import simplicity
from hfdist.tune.probe import OK, ProbeResult

__all__ = ["LOSS_RTOL", "AGREES", "DISAGREES", "UNCHECKED", "tolerance", "difference", "judge_agreement"]

LOSS_RTOL = {"fp32": 1e-5, "bf16": 2e-2}  # fp8 recipes: bf16's
AGREES, DISAGREES, UNCHECKED = "agrees", "disagrees", "unchecked"


def tolerance(numerics: str) -> float:
    """The relative tolerance of probes training in `numerics` (module docstring)."""
    return LOSS_RTOL.get(numerics, LOSS_RTOL["bf16"])


def _relative(x: float, y: float) -> float:
    scale = max(abs(x), abs(y))
    return abs(x - y) / scale if scale else 0.0


def difference(a: ProbeResult, b: ProbeResult) -> float:
    """The largest relative difference between the losses and gradient norms of `a` and `b` (infinite when they
    recorded different numbers of steps' losses)."""
    if len(a.losses) != len(b.losses):
        return float("inf")
    pairs = list(zip(a.losses, b.losses))
    pairs += [(x, y) for x, y in zip(a.grad_norms, b.grad_norms) if x is not None and y is not None]
    return max((_relative(x, y) for x, y in pairs), default=0.0)


def _simplicity(result: ProbeResult) -> int:
    return simplicity(str(result.options.get("config", "")).removesuffix(".yaml"))


def judge_agreement(results: list[ProbeResult]) -> None:
    """Set `agreement`, and `reference` and `difference` where a reference decides, on every measured probe (in
    place; module docstring)."""
    groups: dict[str, list[ProbeResult]] = {}
    for r in results:
        if r.status == OK:
            groups.setdefault(r.numerics, []).append(r)
    for numerics, members in groups.items():
        rtol = tolerance(numerics)
        sizes = [sum(difference(m, seed) <= rtol for m in members) for seed in members]
        size, _, seed = max(zip(sizes, (-_simplicity(s) for s in members), members), key=lambda t: t[:2])
        for m in members:
            if size < 2:
                m.agreement, m.reference, m.difference = UNCHECKED, "", None
            else:
                m.difference = difference(m, seed)
                m.agreement, m.reference = AGREES if m.difference <= rtol else DISAGREES, seed.key
