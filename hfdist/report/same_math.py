"""Whether two runs of one job on different layouts are the same math: every step's loss and gradient norm (before
clipping) within what their precision allows. The one comparison `hfdist compare`'s matrix and `hfdist tune`'s
agreement make (the test suite states its own bounds: tests/tolerances.py).

Why the gradient norms too: under Adam a gradient off by a constant factor (a wrong average over ranks, one rank's
experts counted twice) moves no loss, since Adam's update divides the factor out; the norm shows it at once.

Tolerances: the layouts sum the same products in other orders (sharded, reduced over ranks, accumulated over
micro-batches, split over tensor-parallel ranks), which the end-to-end suite measures well below 1e-5 relative in
fp32 after a few steps (tests/e2e/test_cells.py: every rung against one process); bf16 rounds every product to 8 bits,
2e-2 after a step; float8 recipes are bf16's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["RTOL", "LATER_GRAD_NORM_RTOL", "numerics", "largest_difference", "same_math"]

RTOL = {"fp32": 1e-5, "bf16": 2e-2}
# The gradient norms after the first step, in fp32: AdamW divides each gradient entry by its own root mean square
# (+ eps 1e-8), so an entry that sums to rounding noise moves its weight by a different fraction of the learning rate
# in each layout, and the next gradient norm, unlike the loss, feels it (measured up to 1.9e-5 at step 3 on ring
# attention, 1.5e-5 on 3d: tests/e2e/test_cells.py, which allows the same). A planted factor moves a norm by 2e-4 or
# more.
LATER_GRAD_NORM_RTOL = {"fp32": 5e-5}


def numerics(strategy: Mapping[str, Any]) -> str:
    """The precision a run trained in, from its summary's strategy: "fp8" (its recipe), "bf16" or "fp32"."""
    if strategy.get("fp8"):
        return f"fp8-{strategy['fp8']}"
    return "bf16" if strategy.get("mixed_precision") == "bf16" else "fp32"


def _relative(x: float, y: float) -> float:
    if not (math.isfinite(x) and math.isfinite(y)):
        return 0.0 if x == y else math.inf  # nan never agrees, not even with nan
    return abs(x - y) / max(abs(x), abs(y), 1e-30)


def largest_difference(a: Mapping[str, Any], b: Mapping[str, Any], steps: int | None = None) -> float:
    """The largest relative difference between two runs' first `steps` (default: all) losses and gradient norms;
    `a` and `b` hold "losses" and "grad_norms". Infinite where their numbers of losses differ; the gradient norms are
    compared at the steps where both runs have one (a summary of an older hfdist has none: its losses alone)."""
    xs, ys = list(a.get("losses") or [])[:steps], list(b.get("losses") or [])[:steps]
    if len(xs) != len(ys):
        return math.inf
    pairs = list(zip(xs, ys))
    norms = zip(list(a.get("grad_norms") or [])[:steps], list(b.get("grad_norms") or [])[:steps])
    pairs += [(x, y) for x, y in norms if x is not None and y is not None]
    return max((_relative(x, y) for x, y in pairs), default=0.0)


def same_math(a: Mapping[str, Any], b: Mapping[str, Any], precision: str, steps: int | None = None) -> bool:
    """Whether `a` and `b` (as `largest_difference` takes them) agree within `precision`'s tolerance (fp8 recipes:
    bf16's): every loss and the first gradient norm within RTOL, the later gradient norms within
    LATER_GRAD_NORM_RTOL (RTOL where it has none)."""
    rtol = RTOL.get(precision, RTOL["bf16"])
    later = LATER_GRAD_NORM_RTOL.get(precision, rtol)
    xs, ys = list(a.get("losses") or [])[:steps], list(b.get("losses") or [])[:steps]
    if len(xs) != len(ys) or any(_relative(x, y) > rtol for x, y in zip(xs, ys)):
        return False
    norms = zip(list(a.get("grad_norms") or [])[:steps], list(b.get("grad_norms") or [])[:steps])
    return all(_relative(x, y) <= (rtol if step == 0 else later)
               for step, (x, y) in enumerate(norms) if x is not None and y is not None)
