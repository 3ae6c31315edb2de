"""One `hfdist tune` session: measure the machine, list the candidates, probe them in order of predicted speed
within the budget, check that they are the same math, choose, report.

Order and stopping: the next probe is the remaining candidate with the highest calibrated prediction: its predicted
tokens/s times the median of measured / predicted over the probes of its rung so far (of all probes while its rung
has none). Probing stops when the budget cannot hold the next probe (its predicted steps plus the slowest start-up
seen so far), or, unless --exhaustive, when the best remaining calibrated prediction is below STOP_FRACTION of the
best measured probe whose losses agree with another's: the cost model rules it out (a fast probe that nothing
agrees with yet cannot end the search: it may be a bug). A probe that runs out of memory is followed by the same layout at
the next smaller micro-batch.

Tie-breaks: a probe is chosen only when a second layout agrees with it (hfdist.tune.agreement). While the fastest
probe that could win is unchecked (no two probes of its precision agree: it ran alone, or two probes differ), a
tie-breaking probe settles it: the simplest layout that fits, of a rung none of that precision's probes ran (the rung
table's plan order: the single process on the same global batches, then ddp, zero1, ...;
hfdist.tune.candidates.tiebreak_candidates). The probes that agree with it are checked, the others disagree. It runs
once the search cannot go on without its time: when no candidate is left to probe, the search stops, or the next
probe would leave too little of the budget for both; until then the search's next probe may settle the tie itself.
A tie-break that fails, or that agrees with none of them, is followed by the next simplest. Where none can run (none
is left, or the budget cannot hold one), no unchecked probe is chosen, and the session says why (`unsettled`).

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
    unsettled: str = ""  # why no tie-break could check the fastest probe, when none could (module docstring)


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


def _seconds(candidate: Candidate, done: list[ProbeResult], start_up: float | None, steps: int) -> float:
    """The time a probe of `candidate` is expected to take: the slowest start-up seen so far and its steps at the
    calibrated prediction."""
    step = candidate.predicted.seconds * candidate.predicted.tokens_per_second / max(_calibrated(candidate, done), 1e-9)
    return (start_up if start_up is not None else _FIRST_START_SECONDS) + step * steps


def _unchecked_winner(done: list[ProbeResult], eligible: set[str]) -> ProbeResult | None:
    """The probe that would win if an unchecked probe could: the fastest unchecked candidate, when it is faster than
    every checked one."""
    ok = [r for r in done if r.status == OK and r.key in eligible]
    checked = max((r.tokens_per_second for r in ok if r.agreement == AGREES), default=0.0)
    return max((r for r in ok if r.agreement == UNCHECKED and r.tokens_per_second > checked),
               key=lambda r: r.tokens_per_second, default=None)


def _tiebreak(pending: ProbeResult, done: list[ProbeResult], tiebreaks: list[Candidate]) -> Candidate | None:
    """The simplest layout that can check `pending`: of its precision, of a rung none of that precision's probes
    ran, not probed yet."""
    rungs = {r.options.get("config") for r in done if r.status == OK and r.numerics == pending.numerics}
    probed = {r.key for r in done}
    return next((c for c in tiebreaks if c.numerics == pending.numerics and c.layout.rung.name not in rungs
                 and c.key not in probed), None)


def _smaller(failed: Candidate, candidates: list[Candidate]) -> Candidate | None:
    """The same layout at the next smaller micro-batch, if it is a candidate."""
    same = [c for c in candidates if c.layout.rung.name == failed.layout.rung.name
            and c.layout.dims == failed.layout.dims and c.compile == failed.compile and c.fp8 == failed.fp8
            and c.layout.activation_checkpointing == failed.layout.activation_checkpointing
            and c.layout.micro_batch < failed.layout.micro_batch]
    return max(same, key=lambda c: c.layout.micro_batch, default=None)


class _Probes:
    """The probes of one session so far, and running the next one (its log line, the start-up it took)."""

    def __init__(self, cfg: FinetuneConfig, opts: TuneOptions, session: str, done: list[ProbeResult], *,
                 deadline: float, on_gpu: bool, say: Callable[[str], None]) -> None:
        self.cfg, self.opts, self.session, self.done = cfg, opts, session, done
        self.deadline, self.on_gpu, self.say = deadline, on_gpu, say
        self.out = Path(opts.out)
        self.start_up = max((r.wall_seconds - (r.step_seconds or 0) * opts.probe_steps for r in done), default=None)

    def left(self) -> float:
        """Seconds of the budget left."""
        return self.deadline - time.perf_counter()

    def seconds(self, candidate: Candidate) -> float:
        """The time a probe of `candidate` is expected to take."""
        return _seconds(candidate, self.done, self.start_up, self.opts.probe_steps)

    def run(self, c: Candidate, why: str = "") -> ProbeResult:
        """Probe `c` (`why`: the tie it breaks, for a tie-break), log it and return what it measured."""
        what = f"tie-break ({why})" if why else "probe"
        self.say(f"hfdist tune: {what} {len(self.done) + 1}: {c.describe()} (predicted "
                 f"{c.predicted.tokens_per_second:,.0f} tokens/s, planned {c.planned.total / 1e9:.2f} GB per rank)")
        result = run_probe(self.cfg, c.key, c.describe(), c.job_options(), self.out / "probes" / c.key,
                           steps=self.opts.probe_steps, group=f"tune-{self.session}", timeout=max(self.left(), 60.0),
                           on_gpu=self.on_gpu, numerics=c.numerics, predicted=c.predicted.tokens_per_second,
                           planned=c.planned.total)
        result.tiebreak = bool(why)
        with (self.out / LOG_NAME).open("a") as f:
            f.write(json.dumps({**result.to_json(), "session": self.session}) + "\n")
        self.done.append(result)
        self.say(f"hfdist tune:   {result.status}" + (f": {result.tokens_per_second:,.0f} tokens/s, peak "
                                                      f"{result.peak_memory_bytes / 1e9:.2f} GB" if result.status == OK
                                                      else f": {result.reason}"))
        if result.status == OK and result.step_seconds:
            overhead = result.wall_seconds - result.step_seconds * self.opts.probe_steps
            self.start_up = overhead if self.start_up is None else max(self.start_up, overhead)
        return result


def _next(queue: list[Candidate], remaining: list[Candidate], probes: _Probes,
          eligible: set[str]) -> tuple[Candidate | None, str]:
    """The search's next probe: an out-of-memory probe's smaller micro-batch first, else the remaining candidate with
    the highest calibrated prediction; or None and why the search stops (module docstring)."""
    done, opts = probes.done, probes.opts
    if not remaining:
        return None, "every candidate probed"
    nxt = queue[0] if queue else max(remaining, key=lambda c: _calibrated(c, done))
    # only a probe that another layout agrees with may end the search
    best = max((r.tokens_per_second for r in done if r.key in eligible and r.status == OK and r.agreement == AGREES),
               default=0.0)
    if not opts.exhaustive and best and _calibrated(nxt, done) < STOP_FRACTION * best:
        return None, (f"the other {len(remaining)} candidate(s) are predicted below {STOP_FRACTION:.0%} of the best "
                      "measured")
    if probes.seconds(nxt) > probes.left():
        return None, f"the budget ({opts.budget:g} min) cannot hold another probe ({probes.seconds(nxt):.0f} s expected)"
    return nxt, ""


def _tie(pending: ProbeResult, done: list[ProbeResult]) -> str:
    """In words, why `pending` is unchecked."""
    others = [r.describe for r in done if r.status == OK and r.numerics == pending.numerics and r is not pending]
    if not others:
        return f"{pending.describe} ran alone in {pending.numerics}"
    return f"{pending.describe} agrees with none of the other {pending.numerics} probes ({'; '.join(others)})"


def run_session(cfg: FinetuneConfig, opts: TuneOptions, candidates: list[Candidate], skipped: list[Skipped],
                hardware: Hardware, *, on_gpu: bool, tiebreaks: list[Candidate] | None = None,
                say: Callable[[str], None] = print) -> TuneResult:
    """Probe `candidates` (fastest predicted first) within the budget, with tie-breaks from `tiebreaks` (simplest
    first: hfdist.tune.candidates.tiebreak_candidates) where no two probes agree; see the module docstring."""
    started = time.perf_counter()
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    session = session_id(cfg, candidates)
    known = _read_log(Path(opts.out) / LOG_NAME, session)
    if known:
        say(f"hfdist tune: resuming: {len(known)} probe(s) of this job already in {Path(opts.out) / LOG_NAME}, not "
            "run again")
    probes = _Probes(cfg, opts, session, list(known.values()), deadline=started + opts.budget * 60, on_gpu=on_gpu,
                     say=say)
    done, tiebreaks = probes.done, tiebreaks or []
    eligible = {c.key for c in candidates}  # a tie-break outside them (another rung, one process) is never chosen
    remaining = [c for c in candidates if c.key not in known]
    queue: list[Candidate] = []  # smaller micro-batches after an out-of-memory probe, first
    while True:
        judge_agreement(done)
        nxt, stopped = _next(queue, remaining, probes, eligible)
        pending = _unchecked_winner(done, eligible)
        referee = _tiebreak(pending, done, tiebreaks) if pending is not None else None
        if referee is not None and probes.seconds(referee) <= probes.left() and (
                nxt is None or probes.seconds(nxt) + probes.seconds(referee) > probes.left()):
            queue = [c for c in queue if c.key != referee.key]
            remaining = [c for c in remaining if c.key != referee.key]
            probes.run(referee, why=_tie(pending, done))
            continue
        if nxt is None:
            break
        if queue:
            queue.pop(0)
        remaining.remove(nxt)
        if probes.run(nxt).status == OOM and (smaller := _smaller(nxt, remaining)) is not None:
            queue.insert(0, smaller)
    judge_agreement(done)
    pending = _unchecked_winner(done, eligible)
    unsettled = ""
    if pending is not None:
        referee = _tiebreak(pending, done, tiebreaks)
        unsettled = _tie(pending, done) + ", and " + (
            f"the budget cannot hold a tie-breaking probe ({referee.describe()}, {probes.seconds(referee):.0f} s "
            "expected)" if referee is not None else
            "no tie-breaking layout is left (none of another rung fits, or those that ran agreed with none)")
    # never an unchecked probe: a probe is chosen only when a second layout agrees with it
    winner = max((r for r in done if r.key in eligible and r.status == OK and r.agreement == AGREES),
                 key=lambda r: r.tokens_per_second, default=None)
    return TuneResult(done, winner, candidates, skipped, hardware, len(known), stopped,
                      time.perf_counter() - started, unsettled)
