"""One probe: the job itself (`hfdist finetune`), laid out as a candidate, for a few steps, and what it measured.

A probe is the user's job file with the candidate's layout options, `--max-steps` the probe's length, no
checkpoints, no final save (`--no-save-model`), its own output folder and the tune's W&B group, run as `python -m
hfdist.cli finetune PROBE/job.yaml` (so it starts its world as the job does). From its hfdist_summary.json it takes:
the job's tokens per second (global batch x sequence length over the slowest rank's seconds per step, the first
step left out as the metrics callback leaves it out), each rank's training peak memory (hfdist.callbacks.memory:
the figure the planner predicts), and the first two steps' losses and gradient norms (the same math check,
hfdist.tune.agreement; the norms where the summary has them). A failed probe is recorded with its reason: out of
memory (the allocator's error, or the kernel's OOM killer) or the error it printed. A probe still running at its
timeout is ended with every process it started (its ranks run in sessions of their own), and recorded as timed out.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hfdist.config.finetune import FinetuneConfig, job_text, parse_args
from hfdist.errors import HfdistError
from hfdist.processes import run_logged

__all__ = ["ProbeResult", "probe_config", "run_probe", "OK", "OOM", "FAILED", "TIMEOUT", "CHECKED_STEPS"]

OK, OOM, FAILED, TIMEOUT = "ok", "oom", "failed", "timeout"
CHECKED_STEPS = 2  # the first steps whose losses and gradient norms a probe keeps (hfdist.tune.agreement)
# A timed-out probe's ranks get this long to leave after the hand-over relays SIGTERM (nothing of it is kept).
_END_GRACE_SECONDS = 10.0
_OOM_PATTERNS = re.compile(r"out of memory|OutOfMemoryError|Cannot allocate memory|std::bad_alloc|MemoryError",
                           re.IGNORECASE)


@dataclass
class ProbeResult:
    """What one probe measured (or why it has no measurement)."""

    key: str
    describe: str
    options: dict[str, Any]
    status: str
    reason: str = ""
    wall_seconds: float = 0.0
    step_seconds: float | None = None
    tokens_per_second: float | None = None
    peak_memory_bytes: int | None = None  # the largest rank's (module docstring)
    losses: list[float] = field(default_factory=list)  # the first CHECKED_STEPS steps'
    numerics: str = ""  # probes compare losses within one class: the precision they train in
    predicted_tokens_per_second: float = 0.0
    planned_bytes: int = 0
    agreement: str = ""  # hfdist.tune.agreement: agrees / disagrees / unchecked; "" until judged
    grad_norms: list[float | None] = field(default_factory=list)  # the first steps', where the summary has them
    reference: str = ""  # the key of the probe the agreement measured this one against ("" while unchecked)
    difference: float | None = None  # the largest relative difference of its losses and grad norms from it
    tiebreak: bool = False  # run to break a tie between probes that disagree (hfdist.tune.session)

    def to_json(self) -> dict[str, Any]:
        """The probe log's line."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ProbeResult":
        """A probe log's line back."""
        return cls(**data)

    @property
    def memory_error(self) -> float | None:
        """(planned - measured) / measured peak memory, or None without a measurement."""
        if not self.peak_memory_bytes:
            return None
        return (self.planned_bytes - self.peak_memory_bytes) / self.peak_memory_bytes


def probe_config(cfg: FinetuneConfig, options: dict[str, Any], folder: Path, steps: int, group: str) -> FinetuneConfig:
    """The job as one probe runs it: the candidate's layout, `steps` optimizer steps, nothing saved, its own folder,
    the tune's tracker group. What is trained stays the job's."""
    return replace(cfg, **options, max_steps=steps, num_epochs=None, save_steps=0, save_model=False,
                   load_best=False, eval_steps=0, resume=False, overwrite=True, output_dir=str(folder),
                   compare_id=group, verbose=False)


def _reason(returncode: int, text: str) -> tuple[str, str]:
    """(status, one line) of a failed probe, from its exit code and what it printed."""
    if returncode in (-signal.SIGKILL, 137) or _OOM_PATTERNS.search(text):
        line = next((ln for ln in reversed(text.splitlines()) if _OOM_PATTERNS.search(ln)), "")
        return OOM, line.strip()[-300:] or f"killed (exit {returncode}): out of memory"
    said = [ln for ln in text.splitlines() if ln.startswith("hfdist: error:") or "Error" in ln]
    return FAILED, (said[-1].strip()[-300:] if said else f"exit {returncode}")


def _measurements(summary: dict[str, Any], cfg: FinetuneConfig, on_gpu: bool) -> dict[str, Any]:
    ranks = summary["ranks"]
    step = max(r["step_seconds"] for r in ranks if r.get("step_seconds"))
    peak = max(r["training_peak_bytes"] for r in ranks)
    return {"step_seconds": step, "tokens_per_second": cfg.global_batch_size * cfg.seq_len / step,
            "peak_memory_bytes": int(peak), "losses": summary["losses"][:CHECKED_STEPS],
            "grad_norms": summary.get("grad_norms", [])[:CHECKED_STEPS]}


def run_probe(cfg: FinetuneConfig, key: str, describe: str, options: dict[str, Any], folder: Path, *, steps: int,
              group: str, timeout: float, on_gpu: bool, numerics: str, predicted: float,
              planned: int) -> ProbeResult:
    """Run one probe (module docstring) and return what it measured; it never raises for the probe's own failure."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = probe_config(cfg, options, folder, steps, group)
    job = folder / "job.yaml"
    job.write_text(job_text(probe))
    if parse_args([str(job)]) != probe:  # the probe must run the job tune means, option for option
        raise HfdistError(f"hfdist tune wrote {job}, which reads back as another job than the probe's: a bug in the "
                          "job file's round trip; please report it with that file.")
    result = ProbeResult(key, describe, options, FAILED, numerics=numerics, predicted_tokens_per_second=predicted,
                         planned_bytes=planned)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HFDIST_HANDED_OVER", None)
    log = folder / "probe.log"
    code = run_logged([sys.executable, "-m", "hfdist.cli", "finetune", str(job)], log, timeout=timeout,
                      grace=_END_GRACE_SECONDS, env=env)
    result.wall_seconds = time.perf_counter() - start
    if code is None:
        result.status, result.reason = TIMEOUT, f"did not finish within {timeout:.0f} s"
        return result
    summary_path = folder / "hfdist_summary.json"
    if code != 0 or not summary_path.is_file():
        result.status, result.reason = _reason(code, log.read_text(errors="replace"))
        return result
    result.status = OK
    for name, value in _measurements(json.loads(summary_path.read_text()), probe, on_gpu).items():
        setattr(result, name, value)
    return result
