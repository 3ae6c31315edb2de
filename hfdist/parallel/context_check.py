"""Context-parallel choices and checks that need no process group and no torch: which method splits this model's
attention over cp ranks (`plan_cp`, `--cp-method`), and whether it can cut the sequence.

The methods (hfdist.parallel.context applies them):

    ulysses  all-to-all over heads: each rank attends whole documents of the whole sequence for heads / cp of the
             heads. Exact one-process arithmetic per document; needs cp to divide the heads per tp rank.
    ring     each rank holds a load-balanced share of every row (chunks c and 2 cp - 1 - c of 2 cp); keys and values
             travel around the cp ring and each block pair attends within documents by global positions, merged
             by log-sum-exp (hfdist.parallel.ring_attention). Any head count; the sequence must cut into 2 cp chunks.
    hybrid   Ulysses over `ulysses` ranks inside each group (heads), ring over cp / ulysses groups: for cp past what
             the heads allow while keeping the ring short.

`auto` picks Ulysses where cp divides the heads per tp rank (one attention call per document, nothing merged), else
hybrid with the largest Ulysses degree that divides both the heads and cp and cuts the sequence, else ring; the plan
says why. Kept apart from hfdist.parallel.context (torch.distributed) so the planner and preflight can choose and
refuse before anything heavy is imported or started.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hfdist.config.finetune import CP_METHODS
from hfdist.errors import HfdistError

__all__ = ["ContextParallelError", "CP_METHODS", "CpPlan", "plan_cp", "check_cp", "check_cp_attention", "kv_repeats",
           "seq_multiple"]

class ContextParallelError(HfdistError, ValueError):
    """Context-parallel degree or method that does not fit the model, the sequence or the other axes."""


@dataclass(frozen=True)
class CpPlan:
    """How cp ranks split attention: Ulysses over `ulysses` ranks (heads), a ring over cp / ulysses groups.

    Attributes:
        method: "ulysses" (ulysses == cp), "ring" (ulysses == 1) or "hybrid" (both above 1).
        cp: the context-parallel degree.
        ulysses: ranks of one all-to-all group (consecutive cp ranks); cp / ulysses groups form the ring.
        reason: why this method (auto) or that it was asked for, for the run's summary.
    """

    method: str
    cp: int
    ulysses: int
    reason: str = ""

    @property
    def ring(self) -> int:
        """Ring members: the groups keys and values travel between (1: Ulysses alone)."""
        return self.cp // self.ulysses

    @property
    def seq_multiple(self) -> int:
        """What every row's length must be a multiple of: cp chunks (Ulysses); 2 x ring chunks for the ring's
        head-tail balance, each cut into ulysses equal parts (ring, hybrid)."""
        return seq_multiple(self.cp, self.ulysses)


def seq_multiple(cp: int, ulysses: int) -> int:
    """The row length a (cp, ulysses) layout cuts evenly: cp without a ring, lcm(2 x ring, cp) with one."""
    ring = cp // ulysses
    return cp if ring == 1 else math.lcm(2 * ring, cp)


def kv_repeats(kv_heads: int, cp: int) -> int:
    """How many times each kv head is repeated before a Ulysses exchange over `cp` ranks so that every rank gets
    whole kv heads that line up with its query heads: 1 when cp divides kv_heads, else cp / gcd(kv_heads, cp)."""
    return cp // math.gcd(kv_heads, cp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _hybrid_degrees(heads: int, cp: int) -> list[int]:
    """Ulysses degrees of a hybrid layout, largest first: dividing both the heads and cp, strictly between 1 and cp."""
    return [u for u in reversed(_divisors(math.gcd(heads, cp))) if 1 < u < cp]


def _fits(seq_len: int | None, cp: int, ulysses: int) -> bool:
    return seq_len is None or seq_len % seq_multiple(cp, ulysses) == 0


def _seq_error(seq_len: int, cp: int, ulysses: int, method: str) -> ContextParallelError:
    m = seq_multiple(cp, ulysses)
    why = (f"cuts every row into cp={cp} equal chunks" if ulysses == cp else
           f"cuts every row into 2 x {cp // ulysses} chunks (each ring member holds a head and a tail chunk, so "
           f"causal work is even) and each chunk pair into {ulysses} part(s)")
    lower = seq_len - seq_len % m
    return ContextParallelError(
        f"Context parallelism ({method}, cp={cp}) {why}, so --seq-len must be a multiple of {m}, and {seq_len} is "
        f"not. Use --seq-len {lower or m}{f' or {lower + m}' if lower else ''}"
        f"{', or --cp-method ulysses (a multiple of cp)' if method != 'ulysses' and ulysses != cp else ''}.")


def _ulysses_refusal(heads: int, tp: int, cp: int) -> ContextParallelError:
    per = f"{heads} attention heads{f' per tp rank (the model has {heads * tp}, tp={tp})' if tp > 1 else ''}"
    fits = [c for c in _divisors(heads) if c > 1]
    hybrid = _hybrid_degrees(heads, cp)
    alternatives = [f"--cp-method ring (any head count; --seq-len a multiple of {seq_multiple(cp, 1)})"]
    if hybrid:
        alternatives.append(f"--cp-method hybrid (Ulysses over {hybrid[0]} ranks, a ring of {cp // hybrid[0]})")
    return ContextParallelError(
        f"Context parallelism by Ulysses splits the attention heads over the cp ranks, but the model's {per} do not "
        f"divide by cp={cp}. Use {' or '.join(alternatives)}, --cp-method auto (which picks them), or a cp dividing "
        f"{heads} ({', '.join(map(str, fits)) or 'none above 1'}) with ulysses.")


def plan_cp(heads: int, kv_heads: int, tp: int, cp: int, seq_len: int | None = None, method: str = "auto") -> CpPlan:
    """The context-parallel plan for a model's `heads` / `kv_heads` under `tp`, at degree `cp`, for rows of
    `seq_len` tokens (None: not known yet, not checked), with `method` one of CP_METHODS (see the module docstring).

    Raises:
        ContextParallelError: a method that cannot split this model, or a sequence it cannot cut evenly; one
            paragraph naming what would work.
    """
    if method not in CP_METHODS:
        raise ContextParallelError(f"--cp-method {method!r} is not a context-parallel method; use one of "
                                   f"{', '.join(CP_METHODS)}.")
    h = heads // tp
    kv = max(kv_heads // tp, 1)
    if method == "ulysses" or (method == "auto" and h % cp == 0):
        if h % cp:
            raise _ulysses_refusal(h, tp, cp)
        if not _fits(seq_len, cp, cp):
            raise _seq_error(seq_len, cp, cp, "ulysses")
        repeat = (f"; the {kv} kv heads are repeated to {kv * kv_repeats(kv, cp)} so every rank gets whole ones"
                  if kv % cp else "")
        why = (f"auto: cp={cp} divides the {h} heads per {'tp ' if tp > 1 else ''}rank, so each rank attends whole "
               f"documents of the whole sequence for {h // cp} heads (one attention call per document, nothing "
               f"merged; two all-to-alls per layer){repeat}") if method == "auto" else "asked for (--cp-method ulysses)"
        return CpPlan("ulysses", cp, cp, why)
    if method in ("auto", "hybrid"):
        degrees = _hybrid_degrees(h, cp)
        usable = [u for u in degrees if _fits(seq_len, cp, u)]
        if usable:
            u = usable[0]
            why = (f"auto: cp={cp} does not divide the {h} heads per {'tp ' if tp > 1 else ''}rank, so Ulysses "
                   f"splits them over {u} ranks (the largest degree dividing both) and a ring of {cp // u} groups "
                   "passes keys and values" if method == "auto" else f"asked for (--cp-method hybrid): Ulysses over "
                   f"{u} ranks, a ring of {cp // u} groups")
            return CpPlan("hybrid", cp, u, why)
        if method == "hybrid":
            if degrees:
                raise _seq_error(seq_len, cp, degrees[-1], "hybrid")
            ring = "--cp-method ring" + ("" if h % cp else " or ulysses (cp divides the heads)")
            raise ContextParallelError(
                f"Context parallelism by hybrid needs a Ulysses degree between 1 and cp={cp} that divides both cp and "
                f"the {h} attention heads per {'tp ' if tp > 1 else ''}rank; gcd({h}, {cp}) = {math.gcd(h, cp)} "
                f"leaves none. Use {ring}, or --cp-method auto.")
    if not _fits(seq_len, cp, 1):
        raise _seq_error(seq_len, cp, 1, "ring")
    why = ("asked for (--cp-method ring)" if method == "ring" else
           f"auto: no Ulysses degree above 1 divides both cp={cp} and the {h} heads per "
           f"{'tp ' if tp > 1 else ''}rank{' for this --seq-len' if _hybrid_degrees(h, cp) else ''}, so every rank "
           "keeps all its heads and keys and values travel around the cp ring")
    return CpPlan("ring", cp, 1, why)


def check_cp(config: Any, cp: int, seq_len: int | None = None, tp: int = 1, method: str = "auto") -> CpPlan | None:
    """The plan of `method` for a HF model config (`plan_cp` on its heads), None at cp=1. A ring (ring, hybrid)
    attends whole document pieces, so a model whose layers slide a window shorter than the rows is refused there.

    Raises:
        ContextParallelError: naming the sizes and what would work.
    """
    if cp == 1:
        if method not in CP_METHODS:
            raise ContextParallelError(f"--cp-method {method!r} is not a context-parallel method; use one of "
                                       f"{', '.join(CP_METHODS)}.")
        return None
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    plan = plan_cp(heads, kv, tp, cp, seq_len, method)
    window = _sliding_window(config)
    if plan.ring > 1 and window is not None and (seq_len is None or window < seq_len):
        raise ContextParallelError(
            f"Context parallelism by {plan.method} attends whole document pieces around the ring, and this model's "
            f"layers slide a window of {window} tokens{f' (shorter than --seq-len {seq_len})' if seq_len else ''}, "
            "which the ring does not implement. Use --cp-method ulysses"
            f"{'' if (heads // tp) % cp == 0 else ' with a cp dividing the heads per tp rank'}"
            f"{f', or --seq-len <= {window}' if seq_len else ''}.")
    return plan


def _sliding_window(config: Any) -> int | None:
    """The window of the model's sliding layers (None when no layer slides), from the model-facts registry."""
    from hfdist.models.registry import facts_for, is_supported

    window = getattr(config, "sliding_window", None)
    if not window or not is_supported(config) or "sliding_attention" not in facts_for(config).mask_kinds(config):
        return None
    return int(window)


def check_cp_attention(plan: CpPlan | None, attention: str) -> None:
    """A ring (ring, hybrid) reads each batch's document boundaries, which only the implementations that take them
    get (hfdist.models.attention.takes_boundaries): the dense-mask choices are refused under it.

    Raises:
        ContextParallelError: naming the implementation and what would work.
    """
    from hfdist.models.attention import takes_boundaries

    if plan is not None and plan.ring > 1 and not takes_boundaries(attention):
        raise ContextParallelError(
            f"Context parallelism by {plan.method} attends each packed document from the whole rows' boundaries "
            f"(cu_seq_lens), which --attn-implementation {attention} does not give the batch (it takes "
            f"{'a dense S x S mask' if attention in ('sdpa', 'eager') else 'none'}). Use --attn-implementation auto "
            "(hfdist_documents on CPU, flash varlen on a GPU), or --cp-method ulysses.")
