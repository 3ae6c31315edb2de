"""Every rank's figures on every rank in one collective, and the `rank{r}/...` + min/max/mean series made of them.

One `all_gather_single` of a fixed-length float64 vector per call (no pickling): the keys are fixed in advance,
so every rank sends the same layout; a figure a rank lacks (CUDA stats on CPU, MFU without a peak) travels as NaN
and is left out of that rank's record.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["TOKEN_KEYS", "gather_records", "aggregate_ranks", "slowest_rank", "straggler_line"]

# Counts that add up over ranks; under TP/PP every rank of a replica counts the same tokens (divide by tp·pp).
TOKEN_KEYS = frozenset({"tokens", "tokens_per_second", "samples_per_second"})


def _collective_device(device: torch.device) -> torch.device:
    """Where the vector goes: CPU for gloo (and any group with a gloo CPU backend), the rank's device otherwise
    (NCCL only moves device tensors)."""
    backend = str(dist.get_backend())
    return torch.device("cpu") if device.type == "cpu" or "gloo" in backend or backend == "fake" else device


def gather_records(record: Mapping[str, float], keys: Sequence[str], device: torch.device,
                   distributed: bool = True) -> list[dict[str, Any]]:
    """Every rank's `record` (restricted to `keys`), in rank order, each with its "rank"; collective.

    Without a process group, or with `distributed` False: [record] as rank 0's.
    """
    values = [float(record.get(k, math.nan)) for k in keys]
    if distributed and dist.is_available() and dist.is_initialized():
        where = _collective_device(device)
        mine = torch.tensor(values, dtype=torch.float64, device=where)
        everyone = torch.empty(dist.get_world_size() * len(values), dtype=torch.float64, device=where)
        dist.all_gather_single(everyone, mine)  # concatenated form: gloo takes 1-D output only
        rows = everyone.view(dist.get_world_size(), len(values)).cpu().tolist()
    else:
        rows = [values]
    return [{"rank": rank, **{k: _plain(v) for k, v in zip(keys, row) if not math.isnan(v)}}
            for rank, row in enumerate(rows)]


def _plain(value: float) -> float | int:
    """Counts (bytes, tokens, steps) back to ints after their trip as float64 (exact below 2**53)."""
    return int(value) if value.is_integer() and abs(value) < 2**53 else value


def aggregate_ranks(records: Sequence[Mapping[str, Any]], *, sum_keys: Iterable[str] = TOKEN_KEYS
                    ) -> dict[str, float]:
    """Per-rank records -> `rank{r}/key` series plus `key/min`, `key/max`, `key/mean` (and `key/sum` for sum_keys).

    Each record is one rank's dict; its "rank" entry names the rank, else its position does. Non-numeric values are
    left out; a key missing on some ranks (CUDA stats, stage-specific figures) is aggregated over the ranks that
    have it.
    """
    sum_keys = frozenset(sum_keys)
    indexed = sorted(enumerate(records), key=lambda item: item[1].get("rank", item[0]))
    out: dict[str, float] = {}
    series: dict[str, list[float]] = {}
    for position, record in indexed:
        rank = record.get("rank", position)
        for key, value in record.items():
            if key == "rank" or isinstance(value, bool) or not isinstance(value, Real):
                continue
            out[f"rank{rank}/{key}"] = value
            series.setdefault(key, []).append(value)
    for key, values in series.items():
        out[f"{key}/min"] = min(values)
        out[f"{key}/max"] = max(values)
        out[f"{key}/mean"] = sum(values) / len(values)
        if key in sum_keys:
            out[f"{key}/sum"] = sum(values)
    return out


def slowest_rank(records: Sequence[Mapping[str, Any]]) -> int | None:
    """The rank with the lowest tokens/s (the first such rank on a tie), or None when no record has a rate."""
    rated = [r for r in records if "tokens_per_second" in r]
    return min(rated, key=lambda r: (r["tokens_per_second"], r["rank"]))["rank"] if rated else None


def straggler_line(records: Sequence[Mapping[str, Any]]) -> str | None:
    """"slowest: rank r, X% below the fastest rank's tokens/s (step ... s vs ... s, data wait ... s vs ... s)", or
    None with fewer than two rated ranks."""
    rated = [r for r in records if r.get("tokens_per_second")]
    if len(rated) < 2:
        return None
    slow = next(r for r in rated if r["rank"] == slowest_rank(rated))
    fast = max(rated, key=lambda r: (r["tokens_per_second"], -r["rank"]))
    behind = 1 - slow["tokens_per_second"] / fast["tokens_per_second"]
    times = (f"step {slow.get('step_seconds', math.nan):.3g} s vs {fast.get('step_seconds', math.nan):.3g} s, data "
             f"wait {slow.get('data_wait_seconds', math.nan):.3g} s vs {fast.get('data_wait_seconds', math.nan):.3g} s")
    return (f"slowest: rank {slow['rank']}, {100 * behind:.1f}% below the fastest (rank {fast['rank']}) in tokens/s "
            f"({times}).")
