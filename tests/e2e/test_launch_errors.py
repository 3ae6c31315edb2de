"""Errors through hfdist's own launch: bad degrees are one paragraph before any process starts, and a failure in the
ranks ends the screen with hfdist's paragraph, not with the launch stack's tracebacks."""

from __future__ import annotations

import sys

import pytest

from helpers import REPO, TINY_ARGS, run_cmd

HFDIST = [sys.executable, "-m", "hfdist.cli"]


@pytest.mark.parametrize("args, said", [
    (("--config", "fsdp_tp", "--tp", "3"), "tp x pp = 3 x 1 = 3 must divide the processes"),
    # tp=4 divides the 4 processes but not llama-tiny's 2 key/value heads
    (("--config", "fsdp_tp", "--tp", "4"), "does not divide num_key_value_heads=2"),
    (("--config", "ddp", "--tp", "2"), "replicates the whole model on every rank"),
])
def test_bad_degrees_are_refused_before_any_process(tmp_path, args, said):
    proc = run_cmd([*HFDIST, "finetune", *TINY_ARGS, *args, "--output-dir", str(tmp_path / "o")], timeout=300)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "starting" not in proc.stdout  # no process was started
    assert not (tmp_path / "o").exists()


@pytest.mark.multiproc
def test_a_failure_in_the_ranks_ends_with_the_hfdist_paragraph(tmp_path):
    """Both ranks of a handed-over world stop on an hfdist error (bad input the job itself refuses before any
    process: tests/unit/test_bad_input.py): the screen ends with one paragraph naming the ranks, no tracebacks."""
    proc = run_cmd([sys.executable, str(REPO / "tests" / "e2e" / "rank_error_worker.py"), str(tmp_path / "o")],
                   timeout=600)
    assert proc.returncode == 2, proc.stderr
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last == ("hfdist: error (ranks 0-1): The shard of this rank holds no rows (a problem only the ranks can "
                    "see). Fix the data.")
    screen = proc.stdout + proc.stderr
    for noise in ("Traceback", "ChildFailedError", "CalledProcessError", "torch.distributed.elastic"):
        assert noise not in screen, noise
    assert screen.count("holds no rows") == 1  # once, not once per rank
    assert "hfdist: starting 2 processes for fsdp_full_shard" in proc.stdout
