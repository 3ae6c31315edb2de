"""Tolerances derived from floating-point rounding, for comparing two computations of the same mathematics that
differ only in the order of their sums (chunked vs unchunked, sharded vs whole, reduced over ranks vs at once).

A sum of n terms rounded in floating point is off by at most gamma_n = n u of the sum of the terms' magnitudes
(Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 4.2), where u is the unit roundoff (half
the machine epsilon: 2**-24 for fp32, 2**-8 for bf16's 8-bit significand). The rounding errors of one order are
close to independent, so the error of a realistic order grows like sqrt(n) u, not n u (the probabilistic bound of
Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019: sqrt(n) u lambda with lambda ~ a few, with overwhelming
probability). Two orders differ by the difference of two such errors, sqrt(2 n) u. A gradient passes the error of
one reduction through the reductions of the layers below it, multiplying it by a few more: `depth`.

`order_rtol(n)` is that bound with a safety factor of 4 (lambda). Use n = the length of the longest reduction whose
order the two computations change (a matmul's inner dimension, the tokens a weight gradient sums over, a
vocabulary's softmax), and compare relative differences in norm (elementwise ratios mean nothing where sums cancel
to near zero). A real defect (a missing term, a wrong scale, a token counted twice) moves a loss or a gradient by
1/n of the total or more, orders of magnitude above these bounds at the sizes the tests use.
"""

from __future__ import annotations

import math

__all__ = ["U_FP32", "U_BF16", "order_rtol"]

U_FP32 = 2.0**-24  # unit roundoff of fp32 (24-bit significand)
U_BF16 = 2.0**-8  # unit roundoff of bf16 (8-bit significand)
_LAMBDA = 4.0  # the probabilistic bound's confidence factor: exceeded with probability below 1e-6 per reduction


def order_rtol(terms: int, unit: float = U_FP32, depth: int = 1) -> float:
    """Relative difference (in norm) that two summation orders of a `terms`-long reduction can produce in `unit`
    precision, carried through `depth` further layers of reductions (see the module docstring)."""
    return _LAMBDA * depth * math.sqrt(2 * terms) * unit
