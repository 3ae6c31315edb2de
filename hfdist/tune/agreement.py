"""The same math, checked for free: every probe starts from the same weights on the same global batches, so the
first two steps' losses of probes that train in the same precision must agree (the first checks the forward, the
second the gradients and the optimizer step). A probe that disagrees with the others is a bug, flagged and never
chosen.

Probes are grouped by the precision they train in (fp32, bf16, fp8 recipes: `ProbeResult.numerics`). Inside a group
the probes are clustered by their losses; the largest cluster is the reference (of equals, the one holding the
simplest rung, the rung table's plan order: the most tested), and every probe outside it disagrees. Only a
reference of two or more probes decides: while no two probes of a group agree (one probe, or two that differ),
its probes are unchecked.

Tolerances: the layouts sum the same products in other orders (sharded, reduced over ranks, accumulated over
micro-batches, split over tensor-parallel ranks), which the end-to-end suite measures well below 1e-5 relative in
fp32 after a step (tests/e2e: every rung against one process); bf16 rounds every product to 8 bits, 2e-2 after a step.
"""

from __future__ import annotations

from hfdist.config.rungs import RUNG_INFO
from hfdist.tune.probe import OK, ProbeResult

__all__ = ["LOSS_RTOL", "AGREES", "DISAGREES", "UNCHECKED", "judge_agreement"]

LOSS_RTOL = {"fp32": 1e-5, "bf16": 2e-2}  # fp8 recipes: bf16's
AGREES, DISAGREES, UNCHECKED = "agrees", "disagrees", "unchecked"


def _close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * max(abs(x), abs(y)) for x, y in zip(a, b))


def _simplicity(result: ProbeResult) -> int:
    info = RUNG_INFO.get(str(result.options.get("config", "")).removesuffix(".yaml"))
    return info.plan_order if info is not None else 10**6


def judge_agreement(results: list[ProbeResult]) -> None:
    """Set `agreement` on every measured probe (in place; module docstring)."""
    groups: dict[str, list[ProbeResult]] = {}
    for r in results:
        if r.status == OK:
            groups.setdefault(r.numerics, []).append(r)
    for numerics, members in groups.items():
        rtol = LOSS_RTOL.get(numerics, LOSS_RTOL["bf16"])
        clusters = [[m for m in members if _close(m.losses, seed.losses, rtol)] for seed in members]
        reference = max(clusters, key=lambda c: (len(c), -min(map(_simplicity, c))))
        for m in members:
            if len(reference) < 2:
                m.agreement = UNCHECKED
            else:
                m.agreement = AGREES if any(m is x for x in reference) else DISAGREES
