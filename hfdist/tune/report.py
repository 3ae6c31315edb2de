"""What `hfdist tune` writes: the table of probes (layout, predicted against measured tokens/s, planned against
measured peak memory per rank, loss agreement, status), tune.md and tune.json with the command that made them, and
tune.yaml: the job file of the winner, which `hfdist finetune tune.yaml` runs."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from hfdist.config.finetune import FinetuneConfig, job_text
from hfdist.tune.agreement import DISAGREES, tolerance
from hfdist.tune.probe import OK, ProbeResult
from hfdist.tune.session import TuneResult

__all__ = ["MEMORY_TOLERANCE", "probe_table", "write_report", "winner_job"]

# The plan is held to every probe's measured peak within this share (issue 35); a miss is reported by name.
MEMORY_TOLERANCE = 0.15


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.3f}"


def _misses(result: TuneResult) -> list[ProbeResult]:
    """The probes whose measured peak memory the plan missed by more than MEMORY_TOLERANCE, either way."""
    return [r for r in result.probes if r.memory_error is not None and abs(r.memory_error) > MEMORY_TOLERANCE]


def _losses(r: ProbeResult) -> str:
    if r.agreement == DISAGREES:
        return f"disagrees by {r.difference:.1e}"
    return r.agreement or "-"


def probe_table(result: TuneResult) -> str:
    """One row per probe, fastest measured first, the winner marked (*), tie-breaks named, and the plan's error
    marked (!) where it misses the measured peak by more than MEMORY_TOLERANCE."""
    rows = [("", "layout", "predicted tok/s", "measured tok/s", "planned GB", "measured GB", "plan error",
             "losses", "status")]
    ordered = sorted(result.probes, key=lambda r: -(r.tokens_per_second or 0))
    missed = {r.key for r in _misses(result)}
    for r in ordered:
        error = r.memory_error
        rows.append(("*" if r is result.winner else "", r.describe + (" (tie-break)" if r.tiebreak else ""),
                     f"{r.predicted_tokens_per_second:,.0f}",
                     f"{r.tokens_per_second:,.0f}" if r.tokens_per_second else "-", _gb(r.planned_bytes),
                     _gb(r.peak_memory_bytes),
                     f"{error:+.1%}" + (" !" if r.key in missed else "") if error is not None else "-", _losses(r),
                     r.status if r.status == OK else f"{r.status}: {r.reason[:60]}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def winner_job(cfg: FinetuneConfig, result: TuneResult) -> FinetuneConfig | None:
    """The job with the winner's layout (None without a winner): everything else stays the job's."""
    if result.winner is None:
        return None
    return replace(cfg, **result.winner.options)


def _disagreement(r: ProbeResult, by_key: dict[str, ProbeResult]) -> str:
    reference = by_key[r.reference]
    norms = (f", grad norms {r.grad_norms} against {reference.grad_norms}"
             if any(x is not None for x in r.grad_norms) and any(x is not None for x in reference.grad_norms) else "")
    return (f"{r.describe} against {reference.describe}: up to {r.difference:.1e} relative (losses {r.losses} "
            f"against {reference.losses}{norms}; tolerance {tolerance(r.numerics):.0e})")


def _summary_lines(result: TuneResult) -> list[str]:
    lines = [f"{len(result.probes)} probe(s) of {len(result.candidates)} candidate(s) in {result.wall_seconds:.0f} s "
             f"({result.resumed} read back from the log); stopped: {result.stopped}."]
    by_key = {r.key: r for r in result.probes}
    breaks = [r for r in result.probes if r.tiebreak]
    if breaks:
        lines.append("Tie-breaks (probed because no two probes of a precision agreed; the simplest layout that fit): "
                     + "; ".join(f"{r.describe}: {r.status}" + (f", {r.agreement}" if r.agreement else "")
                                 for r in breaks) + ".")
    if result.unsettled:
        lines.append(f"UNCHECKED: {result.unsettled}. An unchecked layout is never chosen: "
                     + ("the chosen one is the fastest that another layout agrees with." if result.winner is not None
                        else "none could be checked, so nothing is chosen; a longer --budget runs the tie-break."))
    flagged = [r for r in result.probes if r.agreement == DISAGREES]
    if flagged:
        lines.append("NOT THE SAME MATH (the first steps' losses and gradient norms disagree with the reference's; "
                     "never chosen; please report): " + "; ".join(_disagreement(r, by_key) for r in flagged) + ".")
    misses = _misses(result)
    if misses:
        lines.append(f"! memory: the plan is more than {MEMORY_TOLERANCE:.0%} off the measured peak (either way) of: "
                     + "; ".join(f"{r.describe} ({r.memory_error:+.1%})" for r in misses)
                     + ". Its per-rank figure for these layouts cannot be trusted here; please report it.")
    return lines


def write_report(cfg: FinetuneConfig, result: TuneResult, out: Path, command: str) -> list[Path]:
    """tune.md, tune.json and (with a winner) tune.yaml into `out`; returns the paths written."""
    job = winner_job(cfg, result)
    written = []
    if job is not None:
        (out / "tune.yaml").write_text(job_text(job))
        written.append(out / "tune.yaml")
    lines = [f"# hfdist tune: {cfg.model or 'the embedded default'}", "",
             f"Measured by `{command}`; the cost model's rates: {result.hardware.source}.", "",
             *_summary_lines(result), "", "```text",
             probe_table(result), "```", ""]
    if result.winner is not None:
        lines += [f"Chosen: {result.winner.describe} ({result.winner.tokens_per_second:,.0f} tokens/s). Run it:", "",
                  "```bash", f"hfdist finetune {out / 'tune.yaml'}", "```", ""]
    else:
        lines += ["No probe both ran and was checked by another layout that agrees with it: nothing is chosen.", ""]
    if result.skipped:
        lines += ["Left out:", ""] + [f"- {s.what}: {s.reason}" for s in result.skipped] + [""]
    (out / "tune.md").write_text("\n".join(lines))
    data = {"command": command, "hardware": asdict(result.hardware), "stopped": result.stopped,
            "wall_seconds": result.wall_seconds, "resumed": result.resumed, "unsettled": result.unsettled,
            "winner": result.winner.key if result.winner else None,
            "probes": [r.to_json() for r in result.probes],
            "candidates": [{"key": c.key, "describe": c.describe(), "predicted_tokens_per_second":
                            c.predicted.tokens_per_second, "planned_bytes": c.planned.total}
                           for c in result.candidates],
            "skipped": [asdict(s) for s in result.skipped]}
    (out / "tune.json").write_text(json.dumps(data, indent=2))
    return [*written, out / "tune.md", out / "tune.json"]
