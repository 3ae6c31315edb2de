"""Pipeline planning as pure functions: which layers each stage owns, which stages each rank runs, which
micro-batch counts a schedule accepts, and a pipeline rung checked against the batch and the model before any process
starts (the launcher's pre-checks and `hfdist simulate`). Nothing here needs a process group, so all of it is
unit-tested directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hfdist.config.finetune import PP_SCHEDULES, ConfigError
from hfdist.config.ladder import Rung
from hfdist.errors import HfdistError

__all__ = [
    "PipelineConfigError",
    "SCHEDULES",
    "MULTI_STAGE_SCHEDULES",
    "split_stages",
    "stage_indices_for_rank",
    "default_stages_per_rank",
    "validate_microbatches",
    "ideal_bubble_fraction",
    "check_pipeline",
]


class PipelineConfigError(HfdistError, ValueError):
    """Pipeline settings (stages, layers, micro-batches, schedule) that cannot work together."""


# Public schedule names -> torch.distributed.pipelining class names. Names follow torch's, minus "Schedule".
SCHEDULES: dict[str, str] = {name: f"Schedule{name}" for name in PP_SCHEDULES}
# Schedules that take a list of local stages (torch's PipelineScheduleMulti); the others take exactly one.
MULTI_STAGE_SCHEDULES = frozenset({"Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"})


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise PipelineConfigError(f"Unknown pipeline schedule '{schedule}'. Choose one of: {', '.join(SCHEDULES)}.")


def split_stages(
    num_layers: int,
    num_stages: int,
    *,
    embed_weight: float = 1.0,
    head_weight: float = 1.0,
    layers_per_stage: Sequence[int] | None = None,
) -> list[range]:
    """Contiguous decoder-layer ranges, one per pipeline stage, balanced by effective cost.

    The first stage also runs the embedding and the last the final norm + lm_head; they count as `embed_weight`
    and `head_weight` extra decoder layers, so with the defaults 4 layers on 4 stages give 1 layer each but
    32 layers on 4 stages give 8, 8, 9, 7 (loads 9, 8, 9, 8). Every stage owns at least one layer.

    Args:
        num_layers: decoder layers in the model.
        num_stages: pipeline stages in total (pp x stages per rank).
        embed_weight: cost of the embedding, in decoder layers (>= 0).
        head_weight: cost of the final norm + lm_head, in decoder layers (>= 0); for large vocabularies the
            lm_head matmul costs about vocab / (6 x hidden) layers.
        layers_per_stage: explicit layer counts per stage; overrides the balancing.

    Raises:
        PipelineConfigError: more stages than layers, bad weights, or an override that does not fit.
    """
    if not isinstance(num_layers, int) or num_layers < 1:
        raise PipelineConfigError(f"num_layers must be a positive integer, got {num_layers!r}.")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise PipelineConfigError(f"num_stages must be a positive integer, got {num_stages!r}.")
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != num_stages or any(not isinstance(c, int) or c < 1 for c in counts) \
                or sum(counts) != num_layers:
            raise PipelineConfigError(
                f"layers_per_stage={counts} must list {num_stages} positive integers (one per stage) summing to "
                f"the model's {num_layers} layers (they sum to {sum(c for c in counts if isinstance(c, int))})."
            )
        starts = [sum(counts[:i]) for i in range(num_stages)]
        return [range(s, s + c) for s, c in zip(starts, counts)]
    if num_stages > num_layers:
        raise PipelineConfigError(
            f"{num_stages} pipeline stages need at least {num_stages} decoder layers (one per stage), but the model "
            f"has {num_layers}. Lower pp (or stages per rank) to at most {num_layers}."
        )
    for name, w in (("embed_weight", embed_weight), ("head_weight", head_weight)):
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
            raise PipelineConfigError(f"{name} must be a finite number >= 0, got {w!r}.")
    per_stage = (num_layers + embed_weight + head_weight) / num_stages
    # Cut k sits where k stages' worth of cost has been spent, counted from the start of the embedding; the clamp
    # keeps at least one layer on each side of every cut, and per_stage >= 1 keeps the cuts strictly increasing.
    cuts = [0]
    for k in range(1, num_stages):
        ideal = math.floor(k * per_stage - embed_weight + 0.5)
        cuts.append(min(max(ideal, k), num_layers - (num_stages - k)))
    cuts.append(num_layers)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def stage_indices_for_rank(pp_rank: int, pp: int, stages_per_rank: int, style: str = "loop") -> list[int]:
    """The global stage indices that pipeline rank `pp_rank` runs, in increasing order.

    "loop" (GPipe, 1F1B, Interleaved*): stage i runs on rank i % pp, so rank r holds r, r + pp, r + 2 pp, ...
    "v" (ZBVZeroBubble, two stages per rank): rank r holds r and 2 pp - 1 - r, so the first and the last stage
    share rank 0 (and a tied embedding stays on one rank).
    """
    if not 0 <= pp_rank < pp:
        raise PipelineConfigError(f"pp_rank {pp_rank} is outside the pipeline group of size {pp}.")
    if style == "loop":
        return [pp_rank + k * pp for k in range(stages_per_rank)]
    if style == "v":
        if stages_per_rank != 2:
            raise PipelineConfigError(f"The V stage layout needs exactly 2 stages per rank, got {stages_per_rank}.")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    raise PipelineConfigError(f"Unknown stage layout style '{style}' (use 'loop' or 'v').")


def default_stages_per_rank(schedule: str) -> int:
    """Stages per rank when the user gives none: 2 for the multi-stage schedules, else 1."""
    _check_schedule(schedule)
    return 2 if schedule in MULTI_STAGE_SCHEDULES else 1


def validate_microbatches(schedule: str, n_microbatches: int, pp: int, stages_per_rank: int) -> None:
    """Raise PipelineConfigError unless `schedule` accepts this many micro-batches on this pipeline.

    Mirrors torch 2.13's constructor rules (checked against them in tests) so the error comes before any
    process group or model exists, and says which values would work:
    GPipe: any n >= 1. 1F1B: n >= pp. Interleaved1F1B / InterleavedZeroBubble: with rounds = max(1, n // pp),
    n % rounds == 0 (so any n < 2 pp, or a multiple of n // pp). ZBVZeroBubble: any n >= 1, 2 stages per rank.
    """
    _check_schedule(schedule)
    if not isinstance(pp, int) or pp < 1:
        raise PipelineConfigError(f"pp must be a positive integer, got {pp!r}.")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise PipelineConfigError(f"n_microbatches must be a positive integer, got {n_microbatches!r}.")
    if schedule in MULTI_STAGE_SCHEDULES:
        if schedule == "ZBVZeroBubble" and stages_per_rank != 2:
            raise PipelineConfigError(f"ZBVZeroBubble needs exactly 2 stages per rank, got {stages_per_rank}.")
        if not isinstance(stages_per_rank, int) or stages_per_rank < 1:
            raise PipelineConfigError(f"stages_per_rank must be a positive integer, got {stages_per_rank!r}.")
    elif stages_per_rank != 1:
        raise PipelineConfigError(
            f"{schedule} runs one stage per rank, got stages_per_rank={stages_per_rank}. Use Interleaved1F1B "
            f"(or InterleavedZeroBubble / ZBVZeroBubble) for several stages per rank."
        )
    if schedule == "1F1B" and n_microbatches < pp:
        raise PipelineConfigError(
            f"1F1B needs at least as many micro-batches as pipeline stages: n_microbatches={n_microbatches} < "
            f"pp={pp}. Use n_microbatches >= {pp} (several times pp keeps the bubble (pp-1)/(m+pp-1) small)."
        )
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            near = [m for m in range(1, 4 * pp + 1) if m % max(1, m // pp) == 0 and abs(m - n_microbatches) <= pp]
            raise PipelineConfigError(
                f"{schedule} runs micro-batches in rounds of pp={pp}: n_microbatches={n_microbatches} gives "
                f"{rounds} rounds and must be a multiple of that. Use fewer than 2 x pp or a multiple of pp; "
                f"nearby valid values: {near}."
            )


def ideal_bubble_fraction(pp: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of a balanced 1F1B / GPipe step with free communication: (p-1) / (v m + p - 1).

    v = stages per rank (interleaving shrinks the bubble by v); 0 for a single stage.
    """
    if pp < 1 or n_microbatches < 1 or stages_per_rank < 1:
        raise PipelineConfigError(
            f"pp, n_microbatches and stages_per_rank must be >= 1, got {pp}, {n_microbatches}, {stages_per_rank}."
        )
    return (pp - 1) / (stages_per_rank * n_microbatches + pp - 1)


def check_pipeline(rung: Rung, micro: int, num_layers: int) -> None:
    """A pipeline rung's schedule, micro-batches and stages against the batch and the model, before any process.

    Raises:
        ConfigError: naming the value that does not work and the values that would.
    """
    if rung.pipeline is None:
        return
    p, pp = rung.pipeline, rung.dims.pp
    try:
        per_rank = default_stages_per_rank(p.schedule)
        if pp * per_rank > num_layers:
            raise ConfigError(f"{rung.name} cuts the model into {pp * per_rank} pipeline stages (pp={pp} x "
                              f"{per_rank} per rank for {p.schedule}), but the model has only {num_layers} decoder "
                              f"layers and every stage needs one. Use pp <= {num_layers // per_rank}, a one-stage "
                              "schedule (1F1B, GPipe), or a deeper model.")
        validate_microbatches(p.schedule, p.n_microbatches, pp, per_rank)
    except PipelineConfigError as exc:
        raise ConfigError(f"{rung.name}: {exc} Set it with --pp-schedule / --pp-microbatches or in "
                          "parallelism_config_pp_* of the YAML.") from exc
    if micro % p.n_microbatches:
        raise ConfigError(f"{rung.name}: each data-parallel rank gets {micro} sequences per step, which the "
                          f"{p.n_microbatches} pipeline micro-batches must divide evenly. Pick --pp-microbatches "
                          f"dividing {micro}, or a --global-batch-size / --micro-batch-size that it divides.")
