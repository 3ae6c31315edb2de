"""Context-parallel checks that need no process group and no torch: can Ulysses split this model and sequence?

Kept apart from hfdist.parallel.context (torch.distributed) so the memory planner and the launcher can refuse a bad
cp degree before anything heavy is imported or started.
"""

from __future__ import annotations

import math
from typing import Any

from hfdist.errors import HfdistError

__all__ = ["ContextParallelError", "check_cp", "kv_repeats"]


class ContextParallelError(HfdistError, ValueError):
    """Context-parallel degree that does not fit the model, the sequence or the other axes."""


def check_cp(config: Any, cp: int, seq_len: int | None = None, tp: int = 1) -> None:
    """Refuse a cp degree Ulysses cannot run: heads (per tp rank) or the sequence not divisible by it.

    Raises:
        ContextParallelError: naming the sizes and what would work.
    """
    if cp == 1:
        return
    heads = int(config.num_attention_heads)
    if heads % (cp * tp):
        fits = [c for c in range(2, heads // tp + 1) if (heads // tp) % c == 0] if heads % tp == 0 else []
        raise ContextParallelError(
            f"Context parallelism (Ulysses) splits the attention heads over the cp ranks, but the model's "
            f"{heads} attention heads{f' / tp={tp}' if tp > 1 else ''} do not divide by cp={cp}. Set "
            f"parallelism_config_cp_size to a divisor of {heads // tp if heads % tp == 0 else heads} "
            f"({', '.join(map(str, fits)) or 'none above 1'}).")
    if seq_len is not None and seq_len % cp:
        raise ContextParallelError(
            f"Context parallelism cuts every sequence into cp={cp} equal chunks, but --seq-len {seq_len} does not "
            f"divide by {cp}. Use a --seq-len that is a multiple of {cp} (e.g. {seq_len - seq_len % cp or cp}).")


def kv_repeats(kv_heads: int, cp: int) -> int:
    """How many times each kv head is repeated before the exchange so that the cp ranks get whole kv heads that
    line up with their query heads: 1 when cp divides kv_heads, else cp / gcd(kv_heads, cp)."""
    return cp // math.gcd(kv_heads, cp)
