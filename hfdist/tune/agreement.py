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

The comparison and its tolerances are hfdist.report.same_math's, the one `hfdist compare`'s matrix makes too.
"""

from __future__ import annotations

from hfdist.report.same_math import RTOL, largest_difference, same_math
from hfdist.tune.candidates import simplicity
from hfdist.tune.probe import OK, ProbeResult

__all__ = ["AGREES", "DISAGREES", "UNCHECKED", "tolerance", "difference", "agree", "judge_agreement"]

AGREES, DISAGREES, UNCHECKED = "agrees", "disagrees", "unchecked"


def tolerance(numerics: str) -> float:
    """The relative tolerance of probes training in `numerics` (fp8 recipes: bf16's)."""
    return RTOL.get(numerics, RTOL["bf16"])


def difference(a: ProbeResult, b: ProbeResult) -> float:
    """The largest relative difference between the losses and gradient norms of `a` and `b` (infinite where one
    recorded a value the other did not)."""
    return largest_difference({"losses": a.losses, "grad_norms": a.grad_norms},
                              {"losses": b.losses, "grad_norms": b.grad_norms})


def agree(a: ProbeResult, b: ProbeResult) -> bool:
    """Whether `a` and `b` (of one precision) are the same math (hfdist.report.same_math)."""
    return same_math({"losses": a.losses, "grad_norms": a.grad_norms},
                     {"losses": b.losses, "grad_norms": b.grad_norms}, a.numerics)


def _simplicity(result: ProbeResult) -> int:
    return simplicity(str(result.options.get("config", "")).removesuffix(".yaml"))


def judge_agreement(results: list[ProbeResult]) -> None:
    """Set `agreement`, and `reference` and `difference` where a reference decides, on every measured probe (in
    place; module docstring)."""
    groups: dict[str, list[ProbeResult]] = {}
    for r in results:
        if r.status == OK:
            groups.setdefault(r.numerics, []).append(r)
    for members in groups.values():
        sizes = [sum(agree(m, seed) for m in members) for seed in members]
        size, _, seed = max(zip(sizes, (-_simplicity(s) for s in members), members), key=lambda t: t[:2])
        for m in members:
            if size < 2:
                m.agreement, m.reference, m.difference = UNCHECKED, "", None
            else:
                m.difference = difference(m, seed)
                m.agreement, m.reference = AGREES if agree(m, seed) else DISAGREES, seed.key
