"""`hfdist tune` as a user runs it, on 4 gloo processes: two candidates (fsdp_full_shard and fsdp_tp on llama-tiny),
one of which is planted not to be the same math (a test-only hook scales one rank's gradients in fsdp_tp runs,
hfdist.train.injected_faults), so that neither is checked until a tie-breaking probe (the simplest layout: one
process on the same global batches) sides with the other; tune and its probe are killed once its first probe has
ended and run again, which resumes from its log; then `hfdist finetune tune.yaml` runs the winner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfdist.processes import descendants, signal_each

from helpers import REPO, run_cmd

pytestmark = pytest.mark.multiproc

TUNE_ARGS = ["--model", "llama-tiny", "--num-processes", "4", "--global-batch-size", "8", "--seq-len", "64",
             "--learning-rate", "3e-3", "--warmup-steps", "0", "--configs", "fsdp_full_shard,fsdp_tp",
             "--consider", "none", "--exhaustive", "--probe-steps", "3", "--budget", "20", "--report-to", "none"]
# Rank 1 of every fsdp_tp probe negates its gradients. (A positive factor would change nothing a probe sees: Adam's
# first update, m / sqrt(v), is the same for g and c g.)
FAULT = {"HFDIST_INJECT_GRAD_SCALE": "1:-1.0:fsdp_tp"}


def _env() -> dict[str, str]:
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1", **FAULT}
    env.pop("HFDIST_HANDED_OVER", None)
    return env


def _tune_cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "hfdist.cli", "tune", *TUNE_ARGS, "--out", str(out)]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> dict:
    """Tune killed after its first probe, then run again to the end: both runs' output and what they wrote."""
    out = tmp_path_factory.mktemp("tune")
    log = out / "probes.jsonl"
    first = subprocess.Popen(_tune_cmd(out), cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    deadline = time.monotonic() + 900
    while not (log.is_file() and log.read_text().strip()) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    # tune and the probe it started next, whose ranks run in sessions of their own
    signal_each([first.pid, *descendants(first.pid)], signal.SIGKILL)
    killed_output = first.communicate()[0]
    assert log.is_file(), f"tune wrote no probe before it was killed:\n{killed_output[-4000:]}"
    finished_before = [json.loads(line)["key"] for line in log.read_text().splitlines()]
    second = run_cmd(_tune_cmd(out), env=FAULT, timeout=1800)
    assert second.returncode == 0, f"{second.stdout[-4000:]}\n{second.stderr[-4000:]}"
    return {"out": out, "finished_before": finished_before, "rerun": second.stdout,
            "report": json.loads((out / "tune.json").read_text())}


def test_the_rerun_resumes_and_probes_only_what_is_not_in_the_log(tuned):
    assert len(tuned["finished_before"]) >= 1
    assert f"resuming: {len(tuned['finished_before'])} probe(s)" in tuned["rerun"]
    started = [line.split(": ", 2)[2] for line in tuned["rerun"].splitlines() if line.startswith("hfdist tune: probe ")]
    report = tuned["report"]
    by_key = {p["key"]: p for p in report["probes"]}
    again = [k for k in tuned["finished_before"] if any(by_key[k]["describe"] in s for s in started)]
    assert not again, f"probes run twice: {again}"
    assert report["resumed"] == len(tuned["finished_before"]) and len(report["probes"]) == 3


def test_the_tie_break_checks_the_sound_probe_and_the_planted_one_is_never_chosen(tuned):
    probes = {p["options"]["config"]: p for p in tuned["report"]["probes"]}
    assert set(probes) == {"fsdp_full_shard", "fsdp_tp", "single"}
    assert all(p["status"] == "ok" for p in probes.values()), probes
    assert [probes[name]["tiebreak"] for name in ("fsdp_full_shard", "fsdp_tp", "single")] == [False, False, True]
    assert probes["single"]["agreement"] == probes["fsdp_full_shard"]["agreement"] == "agrees"
    assert probes["fsdp_tp"]["agreement"] == "disagrees" and probes["fsdp_tp"]["difference"] > 1e-5
    assert tuned["report"]["winner"] == probes["fsdp_full_shard"]["key"]  # the tie-break is no candidate
    text = (tuned["out"] / "tune.md").read_text()
    assert "NOT THE SAME MATH" in text and f"{probes['fsdp_tp']['describe']} against " in text


def test_every_probe_reports_predicted_and_measured_speed_memory_losses_and_grad_norms(tuned):
    for p in tuned["report"]["probes"]:
        assert p["predicted_tokens_per_second"] > 0 and p["tokens_per_second"] > 0
        assert p["planned_bytes"] > 0 and p["peak_memory_bytes"] > 0
        assert len(p["losses"]) == len(p["grad_norms"]) == 2 and all(n > 0 for n in p["grad_norms"])
    assert "planned GB" in (tuned["out"] / "tune.md").read_text()


def test_the_winners_job_file_runs(tuned, tmp_path):
    job = tuned["out"] / "tune.yaml"
    summary = _run_job(job, tmp_path / "run")
    winner = next(p for p in tuned["report"]["probes"] if p["key"] == tuned["report"]["winner"])
    assert summary["strategy"]["name"] == winner["options"]["config"]
    assert summary["strategy"]["micro_batch"] == winner["options"]["micro_batch_size"]
    assert summary["strategy"]["world_size"] == 4


def _run_job(job: Path, out: Path) -> dict:
    proc = run_cmd([sys.executable, "-m", "hfdist.cli", "finetune", str(job), "--max-steps", "2", "--no-save-model",
                    "--output-dir", str(out)])
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads((out / "hfdist_summary.json").read_text())
