"""One `hfdist tune` session: measure the machine, list the candidates, probe them in order of predicted speed
within the budget, check that they are the same math, choose, report.

Order and stopping: the next probe is the remaining candidate with the highest calibrated prediction: its predicted
tokens/s times the median of measured / predicted over the probes of its rung so far (of all probes while its rung
has none). Probing stops when the budget cannot hold the next probe (its predicted steps plus the slowest start-up
seen so far), or, unless --exhaustive, when the best remaining calibrated prediction is below STOP_FRACTION of the
best measured probe whose losses agree with another's: the cost model rules it out (a fast probe that nothing
agrees with yet cannot end the search: it may be a bug). A probe that runs out of memory is followed by the same layout at
the next smaller micro-batch.

Resuming: every probe appends its result to OUT/probes.jsonl as it ends; a rerun with the same job and candidates
reads it back and probes only what is not there (a killed tune loses at most the probe that was running). The
machine's measurement is kept in OUT/hardware.json the same way.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hfdist.config.finetune import FinetuneConfig, job_text
from hfdist.plan.cost import Hardware
from hfdist.tune.agreement import AGREES, UNCHECKED, judge_agreement
from hfdist.tune.candidates import Candidate, Skipped
from hfdist.tune.options import TuneOptions
from hfdist.tune.probe import OK, OOM, ProbeResult, run_probe

__all__ = ["TuneResult", "STOP_FRACTION", "LOG_NAME", "run_session", "measure_hardware", "session_id"]

STOP_FRACTION = 0.85
LOG_NAME = "probes.jsonl"
_FIRST_START_SECONDS = 60.0  # a probe's start-up (imports, the world, the model) before any was measured


@dataclass
class TuneResult:
    """What a session found: every probe (this run's and the log's), the winner, what was left out."""

    probes: list[ProbeResult]
    winner: ProbeResult | None
    candidates: list[Candidate]
    skipped: list[Skipped]
    hardware: Hardware
    resumed: int  # probes read back from the log
    stopped: str  # why probing ended
    wall_seconds: float


def session_id(cfg: FinetuneConfig, candidates: list[Candidate]) -> str:
    """A short hash of the job and the candidate list: the probes' tracker group, and what a resumed log must match."""
    text = job_text(cfg) + "\n".join(c.key for c in candidates)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def measure_hardware(out: Path, world: int, hidden: int, intermediate: int, dtype: str) -> Hardware:
    """The machine's rates (hfdist.tune.hardware), measured once per output folder and world."""
    from hfdist.tune.hardware import hardware_from_json

    path = out / f"hardware-{world}.json"
    if not path.is_file():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               "-m", "hfdist.tune.hardware", str(path), "--hidden", str(hidden), "--intermediate", str(intermediate),
               "--dtype", dtype]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            from hfdist.errors import HfdistError

            last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
            raise HfdistError(f"hfdist tune could not measure this machine on {world} processes (exit "
                              f"{proc.returncode}: {last}). Check that `hfdist finetune --num-processes {world}` "
                              "runs here.")
    return hardware_from_json(path)


def _read_log(path: Path, session: str) -> dict[str, ProbeResult]:
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        data = json.loads(line)
        if data.pop("session", None) == session:
            result = ProbeResult.from_json(data)
            out[result.key] = result
    return out


def _calibrated(candidate: Candidate, done: list[ProbeResult]) -> float:
    """The candidate's predicted tokens/s scaled by how far measurement has fallen from prediction so far."""
    rung = candidate.layout.rung.name
    measured = [r for r in done if r.status == OK and r.predicted_tokens_per_second]
    same = [r for r in measured if r.options.get("config") == rung] or measured
    if not same:
        return candidate.predicted.tokens_per_second
    ratio = statistics.median(r.tokens_per_second / r.predicted_tokens_per_second for r in same)
    return candidate.predicted.tokens_per_second * ratio


def _smaller(failed: Candidate, candidates: list[Candidate]) -> Candidate | None:
    """The same layout at the next smaller micro-batch, if it is a candidate."""
    same = [c for c in candidates if c.layout.rung.name == failed.layout.rung.name
            and c.layout.dims == failed.layout.dims and c.compile == failed.compile and c.fp8 == failed.fp8
            and c.layout.activation_checkpointing == failed.layout.activation_checkpointing
            and c.layout.micro_batch < failed.layout.micro_batch]
    return max(same, key=lambda c: c.layout.micro_batch, default=None)


def run_session(cfg: FinetuneConfig, opts: TuneOptions, candidates: list[Candidate], skipped: list[Skipped],
                hardware: Hardware, *, on_gpu: bool, say: Callable[[str], None] = print) -> TuneResult:
    """Probe `candidates` (fastest predicted first) within the budget; see the module docstring."""
    started = time.perf_counter()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    session = session_id(cfg, candidates)
    log = out / LOG_NAME
    known = _read_log(log, session)
    done = [known[c.key] for c in candidates if c.key in known]
    if done:
        say(f"hfdist tune: resuming: {len(done)} probe(s) of this job already in {log}, not run again")
    remaining = [c for c in candidates if c.key not in known]
    deadline = started + opts.budget * 60
    start_up = max((r.wall_seconds - (r.step_seconds or 0) * opts.probe_steps for r in done), default=None)
    stopped = "every candidate probed"
    queue: list[Candidate] = []  # smaller micro-batches after an out-of-memory probe, first
    while remaining:
        judge_agreement(done)
        # only a probe whose losses agree with another's may end the search
        verified = [r for r in done if r.status == OK and r.agreement == AGREES]
        nxt = queue.pop(0) if queue else max(remaining, key=lambda c: _calibrated(c, done))
        expected = _calibrated(nxt, done)
        best = max((r.tokens_per_second for r in verified), default=0.0)
        if not opts.exhaustive and best and expected < STOP_FRACTION * best:
            stopped = (f"the other {len(remaining)} candidate(s) are predicted below {STOP_FRACTION:.0%} of the best "
                       "measured")
            break
        step = nxt.predicted.seconds * nxt.predicted.tokens_per_second / max(expected, 1e-9)
        estimate = (start_up if start_up is not None else _FIRST_START_SECONDS) + step * opts.probe_steps
        left = deadline - time.perf_counter()
        if estimate > left:
            stopped = f"the budget ({opts.budget:g} min) cannot hold another probe ({estimate:.0f} s expected)"
            break
        remaining.remove(nxt)
        say(f"hfdist tune: probe {len(done) + 1}: {nxt.describe()} (predicted {nxt.predicted.tokens_per_second:,.0f} "
            f"tokens/s, planned {nxt.planned.total / 1e9:.2f} GB per rank)")
        result = run_probe(cfg, nxt.key, nxt.describe(), nxt.job_options(), out / "probes" / nxt.key,
                           steps=opts.probe_steps, group=f"tune-{session}", timeout=max(left, 60.0), on_gpu=on_gpu,
                           numerics=nxt.numerics,
                           predicted=nxt.predicted.tokens_per_second, planned=nxt.planned.total)
        with log.open("a") as f:
            f.write(json.dumps({**result.to_json(), "session": session}) + "\n")
        done.append(result)
        say(f"hfdist tune:   {result.status}" + (f": {result.tokens_per_second:,.0f} tokens/s, peak "
                                                 f"{result.peak_memory_bytes / 1e9:.2f} GB" if result.status == OK
                                                 else f": {result.reason}"))
        if result.status == OK and result.step_seconds:
            overhead = result.wall_seconds - result.step_seconds * opts.probe_steps
            start_up = overhead if start_up is None else max(start_up, overhead)
        if result.status == OOM:
            smaller = _smaller(nxt, remaining)
            if smaller is not None:
                queue.insert(0, smaller)
    judge_agreement(done)
    # a verified probe if there is one; else (no two probes agree: too few ran) an unchecked one, said in the report
    chosen = ([r for r in done if r.status == OK and r.agreement == AGREES]
              or [r for r in done if r.status == OK and r.agreement == UNCHECKED])
    winner = max(chosen, key=lambda r: r.tokens_per_second, default=None)
    return TuneResult(done, winner, candidates, skipped, hardware,
                      len(known), stopped, time.perf_counter() - started)
