"""Hang diagnostics without a hang: the timeout flag's bounds, what counts as a collective timeout, the report's
reading of heartbeats and flight-recorder records, and the straggler line of the closing table."""

from __future__ import annotations

import json
import time

import pytest

from hfdist.callbacks.rank_metrics import straggler_line
from hfdist.config.finetune import parse_args
from hfdist.train import watchdog


@pytest.mark.parametrize("value", ["0.5", "0", "-3", "nan"])
def test_timeout_below_one_second_is_refused(value, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--collective-timeout", value])
    assert exc.value.code == 2
    assert "below 1 s" in capsys.readouterr().err


def test_timeout_default_and_value():
    assert parse_args([]).collective_timeout == watchdog.DEFAULT_TIMEOUT_SECONDS == 300
    assert parse_args(["--collective-timeout", "20"]).collective_timeout == 20.0


def test_what_counts_as_a_collective_timeout():
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation")
    assert watchdog._is_timeout(gloo)
    try:
        try:
            raise gloo
        except RuntimeError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert watchdog._is_timeout(outer)
    assert not watchdog._is_timeout(RuntimeError("Connection reset by peer"))
    assert not watchdog._is_timeout(KeyError("x"))


def test_flight_recorder_env_points_the_dump_into_the_run_logs(tmp_path):
    env = watchdog.flight_recorder_env(tmp_path)
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "logs" / "flight_recorder" / "rank_")


def test_report_names_the_rank_behind_the_timed_out_collective(monkeypatch, tmp_path):
    """Rank 0 timed out in all_reduce #5 of group 0; rank 1's last heartbeat (30 s old) had enqueued #4 only;
    rank 2 is alive and had enqueued #5."""
    import torch.distributed as dist

    store = dist.HashStore()
    now = time.time()
    beats = {1: {"rank": 1, "time": now - 30, "phase": "training", "step": 7, "last_enqueued": {"0": "4"},
                 "stack": ['  File "trainer.py", line 1, in training_step']},
             2: {"rank": 2, "time": now - 1, "phase": "training", "step": 7, "last_enqueued": {"0": "5"},
                 "stack": ['  File "fsdp.py", line 2, in all_reduce']}}
    for rank, beat in beats.items():
        store.set(f"hfdist/heartbeat/{rank}", json.dumps(beat))
    # As gloo leaves it after the timeout: the timed-out work retired, the group's last completed one behind.
    record = {"entries": [{"profiling_name": "gloo:broadcast", "collective_seq_id": 4, "retired": True,
                           "is_p2p": False, "process_group": ["0", "default_pg"], "time_created_ns": 1},
                          {"profiling_name": "gloo:all_reduce", "collective_seq_id": 5, "retired": True,
                           "is_p2p": False, "process_group": ["0", "default_pg"], "time_created_ns": 2}],
              "pg_status": {"0": {"last_enqueued_collective": "5", "last_completed_collective": "4"}}}
    monkeypatch.setattr(watchdog, "_flight_record", lambda collectives: record)
    watch = watchdog.CollectiveWatch(tmp_path, 20)
    watch._store, watch._rank, watch._world = store, 0, 3
    watch.where("training", 7)
    try:
        raise RuntimeError("Timed out waiting 20000ms for recv operation to complete")
    except RuntimeError as exc:
        text = watch.report(exc)
    assert text.startswith("hfdist: collective timeout on rank 0 at step 7: gloo:all_reduce #5 of process group 0 "
                           "(default_pg) waited more than --collective-timeout 20 s.")
    assert "hfdist: never joined: rank 1\n" in text
    assert "rank 1: step 7, heartbeat silent for 30 s" in text and "its last collective in that group #4" in text
    assert 'hfdist:      File "trainer.py", line 1, in training_step' in text  # rank 1's last stack
    assert "hfdist: -- rank 2: step 7, heartbeat alive" in text
    assert all(line.startswith("hfdist:") for line in text.splitlines())  # the console keeps it on the screen


def test_straggler_line_names_the_slowest_rank_and_by_how_much():
    records = [{"rank": 0, "tokens_per_second": 1000.0, "step_seconds": 0.5, "data_wait_seconds": 0.01},
               {"rank": 1, "tokens_per_second": 800.0, "step_seconds": 0.625, "data_wait_seconds": 0.1}]
    assert straggler_line(records) == ("slowest: rank 1, 20.0% below the fastest (rank 0) in tokens/s (step 0.625 s "
                                       "vs 0.5 s, data wait 0.1 s vs 0.01 s).")
    assert straggler_line(records[:1]) is None
