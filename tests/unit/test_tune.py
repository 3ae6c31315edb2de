"""`hfdist tune`'s logic in one process: candidates from the planner, the agreement of losses and gradient norms,
the order and stopping of probes and the tie-breaks (with a stand-in for the probe launch), resuming from the log,
the report and the winner's job file, the refusals before any process, and a timed-out probe's end (a real process
tree). tests/e2e/test_tune_job.py runs it for real."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

import hfdist.tune.session as session_module
from hfdist.cli import main
from hfdist.config.finetune import FinetuneConfig, parse_args
from hfdist.models.presets import load_config
from hfdist.plan.cost import NOMINAL_HARDWARE
from hfdist.plan.layouts import Cluster
from hfdist.processes import run_logged
from hfdist.tune.agreement import AGREES, DISAGREES, UNCHECKED, judge_agreement
from hfdist.tune.candidates import tiebreak_candidates, tune_candidates
from hfdist.tune.options import TuneOptions
from hfdist.tune.probe import OK, OOM, ProbeResult
from hfdist.tune.report import probe_table, winner_job, write_report
from hfdist.tune.session import LOG_NAME, TuneResult, run_session

CPU_HARDWARE = replace(NOMINAL_HARDWARE, workspace_bytes=0)
JOB = FinetuneConfig(model="llama-tiny", global_batch_size=8, seq_len=64, num_processes=4)


def _candidates(job=JOB, **opts):
    return tune_candidates(job, TuneOptions(**opts), load_config("llama-tiny"), Cluster(4), memory_bytes=4 * 10**9,
                           hardware=CPU_HARDWARE, on_gpu=False)


def test_candidates_are_the_planners_layouts_that_fit_fastest_first():
    found, skipped = _candidates(configs=("ddp", "fsdp_full_shard", "fsdp_tp"))
    rungs = {c.layout.rung.name for c in found}
    assert rungs == {"ddp", "fsdp_full_shard", "fsdp_tp"}
    speeds = [c.predicted.tokens_per_second for c in found]
    assert speeds == sorted(speeds, reverse=True)
    # The job's global batch is every candidate's: micro-batch x data-parallel ranks x accumulation.
    for c in found:
        lay = c.layout
        assert lay.global_batch == 8 and lay.micro_batch * lay.dims.dp * lay.accumulation == 8
        assert lay.dims.world_size == 4
    # micro-batch and recompute are searched by default; llama-tiny's 2 kv heads allow tp=2 only
    assert {c.layout.activation_checkpointing for c in found} == {False, True}
    assert {c.layout.dims.tp for c in found if c.layout.rung.name == "fsdp_tp"} == {2}
    assert len({c.key for c in found}) == len(found)
    # every candidate is a job `hfdist finetune` parses back to the same settings
    for c in found:
        assert parse_args(["--model", "llama-tiny"] + c.layout.flags()).micro_batch_size == c.layout.micro_batch


def test_what_tune_does_not_consider_stays_the_jobs():
    found, _ = _candidates(configs=("ddp", "fsdp_tp"), consider=())
    assert {c.layout.activation_checkpointing for c in found} == {False}
    assert all(c.layout.micro_batch == 8 // c.layout.dims.dp for c in found)  # no accumulation, as the job
    pinned, skipped = _candidates(replace(JOB, tp=2), configs=("ddp", "fsdp_tp"))
    assert {c.layout.rung.name for c in pinned} == {"fsdp_tp"}
    assert any(s.what == "ddp" and "has no tp axis" in s.reason for s in skipped)


def test_candidates_that_do_not_fit_with_the_margin_are_left_out_with_the_reason():
    found, skipped = tune_candidates(JOB, TuneOptions(configs=("ddp",)), load_config("llama-tiny"), Cluster(4),
                                     memory_bytes=10**6, hardware=CPU_HARDWARE, on_gpu=False)
    assert not found and all("more than" in s.reason for s in skipped)


def _probe(key, losses, tokens=100.0, config="ddp.yaml", status=OK, numerics="fp32", grad_norms=(), peak=10**8):
    return ProbeResult(key, key, {"config": config}, status, losses=losses, tokens_per_second=tokens,
                       numerics=numerics, peak_memory_bytes=peak, planned_bytes=10**8, predicted_tokens_per_second=1.0,
                       grad_norms=list(grad_norms))


def test_a_probe_whose_losses_disagree_is_flagged_and_the_majority_is_the_reference():
    probes = [_probe("a", [7.0, 6.5]), _probe("b", [7.0, 6.5 * (1 + 5e-6)]), _probe("c", [7.0, 6.6]),
              _probe("d", [7.1, 6.0], numerics="bf16"), _probe("e", [7.1, 6.06], numerics="bf16"),
              _probe("f", [5.0, 4.0], numerics="fp8-tensorwise")]
    judge_agreement(probes)
    assert [p.agreement for p in probes] == [AGREES, AGREES, DISAGREES, AGREES, AGREES, UNCHECKED]
    assert probes[2].reference == "a" and probes[2].difference == pytest.approx(0.1 / 6.6)
    assert probes[5].reference == "" and probes[5].difference is None


def test_two_probes_that_disagree_are_unchecked_until_a_tie_break_decides():
    ddp, tp = _probe("ddp", [7.0, 6.5], tokens=100.0), _probe("tp", [7.0, 6.7], tokens=200.0, config="fsdp_tp.yaml")
    judge_agreement([tp, ddp])
    assert (ddp.agreement, tp.agreement) == (UNCHECKED, UNCHECKED)  # neither is checked, the faster no more
    single = _probe("single", [7.0, 6.7], config="single.yaml")  # the tie-break sides with tp
    judge_agreement([tp, ddp, single])
    assert (tp.agreement, single.agreement, ddp.agreement) == (AGREES, AGREES, DISAGREES)
    assert ddp.reference == "single" and ddp.difference == pytest.approx(0.2 / 6.7)
    fsdp, pp = _probe("fsdp", [7.0, 6.5], config="fsdp_full_shard.yaml"), _probe("pp", [7.0, 6.7], config="pp.yaml")
    judge_agreement([tp, ddp, pp, fsdp])  # 2 against 2: the pair holding the simplest rung (ddp) is the reference
    assert [p.agreement for p in (ddp, fsdp, tp, pp)] == [AGREES, AGREES, DISAGREES, DISAGREES]


def test_equal_losses_with_gradient_norms_off_by_twice_disagree():
    a, b = _probe("a", [7.0, 6.5], grad_norms=[3.0, 2.0]), _probe("b", [7.0, 6.5], grad_norms=[6.0, 2.0])
    c = _probe("c", [7.0, 6.5], grad_norms=[3.0, 2.0 * (1 + 5e-6)])
    judge_agreement([a, b, c])
    assert (a.agreement, b.agreement, c.agreement) == (AGREES, DISAGREES, AGREES)
    assert b.difference == pytest.approx(0.5)
    # a summary without gradient norms (an older run) is compared on its losses; a step without one is skipped
    old, partial = _probe("old", [7.0, 6.5]), _probe("partial", [7.0, 6.5], grad_norms=[None, 2.0])
    judge_agreement([a, old, partial])
    assert (a.agreement, old.agreement, partial.agreement) == (AGREES, AGREES, AGREES)


def _fake_probes(monkeypatch, measured: dict[str, float], calls: list[str], oom: set[str] = frozenset(),
                 bad: set[str] = frozenset(), wall: float = 10.0):
    """run_probe replaced: each key's tokens/s from `measured` (100 for others), its losses equal unless in `bad`,
    its gradient norms equal; each says it took `wall` seconds, 1 a step (no time passes)."""
    def fake(cfg, key, describe, options, folder, *, steps, group, timeout, on_gpu, numerics, predicted, planned):
        calls.append(key)
        if key in oom:
            return ProbeResult(key, describe, options, OOM, "out of memory", 1.0, numerics=numerics,
                               predicted_tokens_per_second=predicted, planned_bytes=planned)
        return ProbeResult(key, describe, options, OK, "", wall, 1.0, measured.get(key, 100.0), 10**8,
                           [7.0, 6.9 if key in bad else 6.5], numerics, predicted, planned, grad_norms=[3.0, 2.0])
    monkeypatch.setattr(session_module, "run_probe", fake)


def test_probes_in_predicted_order_stop_when_the_rest_cannot_win_and_never_choose_a_wrong_probe(monkeypatch, tmp_path):
    found, skipped = _candidates(configs=("ddp", "fsdp_full_shard"), consider=("micro-batch",))
    keys = [c.key for c in found]
    # measured = predicted x 0.5, but the fastest predicted computes other losses (a planted bug)
    measured = {c.key: 0.5 * c.predicted.tokens_per_second for c in found}
    calls: list[str] = []
    _fake_probes(monkeypatch, measured, calls, bad={keys[0]})
    opts = TuneOptions(out=str(tmp_path))
    tiebreaks = tiebreak_candidates(JOB, opts, load_config("llama-tiny"), Cluster(4), found, memory_bytes=4 * 10**9,
                                    single_memory_bytes=4 * 10**9, hardware=CPU_HARDWARE, on_gpu=False)
    result = run_session(JOB, opts, found, skipped, CPU_HARDWARE, on_gpu=False, tiebreaks=tiebreaks,
                         say=lambda line: None)
    assert calls[0] == keys[0]
    assert result.winner is not None and result.winner.key != keys[0]
    assert not any(p.tiebreak for p in result.probes)  # the search's own next probe settled the tie
    assert next(p for p in result.probes if p.key == keys[0]).agreement == DISAGREES
    # stopped early: the rest predicted (calibrated) below 85% of the best measured
    slowest = min(c.predicted.tokens_per_second for c in found)
    if slowest < 0.85 * max(measured[k] for k in calls if k != keys[0]) / 0.5:
        assert len(calls) < len(found) and "below 85%" in result.stopped
    # the log holds every probe; a rerun reads them back and probes nothing again
    assert len((tmp_path / LOG_NAME).read_text().splitlines()) == len(calls)
    again: list[str] = []
    _fake_probes(monkeypatch, measured, again, bad={keys[0]})
    rerun = run_session(JOB, TuneOptions(out=str(tmp_path)), found, skipped, CPU_HARDWARE, on_gpu=False,
                        say=lambda line: None)
    assert rerun.resumed == len(calls) and not set(again) & set(calls)
    assert rerun.winner.key == result.winner.key


def test_an_out_of_memory_probe_is_followed_by_the_next_smaller_micro_batch(monkeypatch, tmp_path):
    job = replace(JOB, global_batch_size=16)  # 4 sequences per rank: micro-batches 1, 2 and 4
    found, skipped = _candidates(job, configs=("ddp",), consider=("micro-batch",))
    by_micro = {c.layout.micro_batch: c for c in found}
    assert sorted(by_micro) == [1, 2, 4]
    calls: list[str] = []
    _fake_probes(monkeypatch, {c.key: c.predicted.tokens_per_second for c in found}, calls,
                 oom={by_micro[4].key, by_micro[2].key})
    run_session(job, TuneOptions(out=str(tmp_path), exhaustive=True), found, skipped, CPU_HARDWARE, on_gpu=False,
                say=lambda line: None)
    for big, small in ((4, 2), (2, 1)):
        at = calls.index(by_micro[big].key)
        assert by_micro[small].key in calls[:at] or calls[at + 1] == by_micro[small].key


def test_the_report_and_the_winners_job_file(monkeypatch, tmp_path):
    found, skipped = _candidates(configs=("ddp", "fsdp_tp"), consider=())
    calls: list[str] = []
    _fake_probes(monkeypatch, {c.key: c.predicted.tokens_per_second for c in found}, calls)
    result = run_session(JOB, TuneOptions(out=str(tmp_path), exhaustive=True), found, skipped, CPU_HARDWARE,
                         on_gpu=False, say=lambda line: None)
    written = write_report(JOB, result, tmp_path, "hfdist tune ...")
    job = parse_args([str(tmp_path / "tune.yaml")])
    assert job == winner_job(JOB, result)
    assert (job.model, job.global_batch_size, job.seq_len, job.learning_rate) == ("llama-tiny", 8, 64, 1e-3)
    assert job.config == f"{result.winner.options['config']}" and job.micro_batch_size == result.winner.options[
        "micro_batch_size"]
    data = json.loads((tmp_path / "tune.json").read_text())
    assert data["winner"] == result.winner.key and len(data["probes"]) == len(calls)
    assert "predicted tok/s" in (tmp_path / "tune.md").read_text() and len(written) == 3


def test_two_probes_that_disagree_choose_nothing_until_a_tie_break_decides(monkeypatch, tmp_path):
    found, skipped = _candidates(configs=("fsdp_full_shard", "fsdp_tp"), consider=())
    fsdp, tp = sorted(found, key=lambda c: c.layout.rung.name)
    assert (fsdp.layout.rung.name, tp.layout.rung.name) == ("fsdp_full_shard", "fsdp_tp")
    calls: list[str] = []
    # the faster probe is the planted bug; each probe says it took 100 s
    _fake_probes(monkeypatch, {fsdp.key: 100.0, tp.key: 200.0}, calls, bad={tp.key}, wall=100.0)
    opts = TuneOptions(out=str(tmp_path))
    alone = run_session(JOB, opts, found, skipped, CPU_HARDWARE, on_gpu=False, say=lambda line: None)
    assert sorted(calls) == sorted([fsdp.key, tp.key]) and {p.agreement for p in alone.probes} == {UNCHECKED}
    assert alone.winner is None and "no tie-breaking layout is left" in alone.unsettled

    tiebreaks = tiebreak_candidates(JOB, opts, load_config("llama-tiny"), Cluster(4), found, memory_bytes=4 * 10**9,
                                    single_memory_bytes=4 * 10**9, hardware=CPU_HARDWARE, on_gpu=False)
    assert [c.layout.rung.name for c in tiebreaks[:3]] == ["single", "ddp", "zero1"]  # the simplest first
    # Half a minute cannot hold the tie-break (a probe's start-up alone took 95 s): still nothing is chosen.
    short = run_session(JOB, replace(opts, budget=0.5), found, skipped, CPU_HARDWARE, on_gpu=False,
                        tiebreaks=tiebreaks, say=lambda line: None)
    assert len(calls) == 2 and short.winner is None
    assert "the budget cannot hold a tie-breaking probe" in short.unsettled

    decided = run_session(JOB, opts, found, skipped, CPU_HARDWARE, on_gpu=False, tiebreaks=tiebreaks,
                          say=lambda line: None)
    referee = tiebreaks[0]
    assert calls[2:] == [referee.key]  # the two probes read back from the log, the tie-break run
    by_key = {p.key: p for p in decided.probes}
    assert by_key[referee.key].tiebreak and by_key[referee.key].agreement == AGREES
    assert (by_key[fsdp.key].agreement, by_key[tp.key].agreement) == (AGREES, DISAGREES)
    assert decided.winner.key == fsdp.key and not decided.unsettled  # the tie-break itself is no candidate
    write_report(JOB, decided, tmp_path, "hfdist tune ...")
    text = (tmp_path / "tune.md").read_text()
    assert f"{tp.describe()} against {referee.describe()}: up to {0.4 / 6.9:.1e} relative" in text
    assert f"{referee.describe()} (tie-break)" in text


def test_the_report_marks_every_probe_whose_peak_the_plan_misses_by_more_than_15_percent(tmp_path):
    probes = [_probe("close", [7.0, 6.5], peak=int(10**8 / 1.14)),  # the plan 14% above the measured peak
              _probe("above", [7.0, 6.5], peak=int(10**8 / 1.16)), _probe("below", [7.0, 6.5], peak=int(10**8 / 0.84))]
    judge_agreement(probes)
    result = TuneResult(probes, probes[0], [], [], CPU_HARDWARE, 0, "every candidate probed", 1.0)
    rows = probe_table(result).splitlines()[1:]
    marked = [name for name in ("close", "above", "below") if " !" in next(row for row in rows if f" {name} " in row)]
    assert marked == ["above", "below"]
    write_report(JOB, result, tmp_path, "hfdist tune ...")
    assert "the plan is more than 15% off the measured peak (either way) of: above (+16.0%); below (-16.0%)" in \
        (tmp_path / "tune.md").read_text()


@pytest.mark.parametrize("argv, words", [
    (["--budget", "0.5"], "cannot hold one probe"),
    (["--nodes", "2"], "probes on the node it runs on"),
    (["--resume"], "--resume belongs to the run tune chooses"),
    (["--configs", "ddp", "--gpu-mem-gb", "0.001"], "No layout of the rungs asked for fits"),
])
def test_refusals_before_any_process(argv, words, capsys, tmp_path):
    code = main(["tune", "--model", "llama-tiny", "--num-processes", "2", "--out", str(tmp_path), *argv])
    assert code == 2 and words in capsys.readouterr().err
    assert not list(tmp_path.glob("hardware-*.json"))  # nothing was launched


# A hand-over as torch elastic is one: it starts its rank in a session of its own (setsid), then waits.
HAND_OVER = """
import os, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
print(os.getpid(), rank.pid, os.getsid(0), os.getsid(rank.pid), flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="finds the processes in Linux's /proc")
def test_a_probe_past_its_timeout_is_ended_with_the_ranks_it_started(tmp_path):
    log = tmp_path / "probe.log"
    assert run_logged([sys.executable, "-c", HAND_OVER], log, timeout=5, grace=1) is None
    hand_over, rank, hand_over_session, rank_session = map(int, log.read_text().split())
    assert rank_session != hand_over_session  # out of reach of a signal to the hand-over's process group
    deadline = time.monotonic() + 10  # SIGKILL is delivered asynchronously: allow the kernel a moment
    while any(map(_alive, (hand_over, rank))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(hand_over) and not _alive(rank), log.read_text()


def test_the_hardware_timing_windows_hold_no_barrier():
    """hfdist.tune.hardware's timing (hfdist.metrics.timing) runs back-to-back calls between two reads of its clock,
    the ranks lined up before each window: a barrier (or a device drain) inside it would count its latency into a
    copy's bandwidth and a small all-gather's latency (issue: a 64 MiB copy read at half its rate on NCCL)."""
    from hfdist.metrics.timing import REPEATS, per_call

    events: list[str] = []

    def window(run) -> float:
        events.append("start")
        run()
        events.append("stop")
        return 1.0

    seconds = per_call(lambda: events.append("call"), lambda: events.append("line up"), window, calls=4)
    assert seconds == 1.0 / 4
    windows = "".join(events).split("line up")
    assert windows[0] == "call"  # the warm-up, before any window
    assert windows[1:] == ["start" + "call" * 4 + "stop"] * REPEATS
