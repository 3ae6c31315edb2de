"""Hang diagnostics without a hang: the timeout flag's bounds, what counts as a collective timeout, the report's
reading of heartbeats and flight-recorder records, and the straggler line of the closing table."""

from __future__ import annotations

import contextlib
import json
import time

import pytest

from hfdist.callbacks.rank_metrics import straggler_line
from hfdist.config.finetune import parse_args
from hfdist.train import hang_report, watchdog


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


# As gloo leaves it after rank 0 timed out in all_reduce #5 of group 0: the timed-out work retired, the group's last
# completed one behind.
_GLOO_RECORD = {"entries": [{"profiling_name": "gloo:broadcast", "collective_seq_id": 4, "retired": True,
                             "is_p2p": False, "process_group": ["0", "default_pg"], "time_created_ns": 1},
                            {"profiling_name": "gloo:all_reduce", "collective_seq_id": 5, "retired": True,
                             "is_p2p": False, "process_group": ["0", "default_pg"], "time_created_ns": 2}],
                "pg_status": {"0": {"last_enqueued_collective": "5", "last_completed_collective": "4"}}}


def _beats(now: float) -> dict[int, dict]:
    """Rank 1's last heartbeat (30 s old, on another host) had enqueued #4 only; rank 2 is alive and had #5; rank 3
    never published."""
    return {0: {"rank": 0, "time": now, "phase": "training", "step": 7, "last_enqueued": {"0": "5"}, "stack": []},
            1: {"rank": 1, "host": "elsewhere", "pid": 99, "time": now - 30, "phase": "training", "step": 7,
                "last_enqueued": {"0": "4"}, "stack": ['  File "trainer.py", line 1, in training_step']},
            2: {"rank": 2, "time": now - 1, "phase": "training", "step": 7, "last_enqueued": {"0": "5"},
                "stack": ['  File "fsdp.py", line 2, in all_reduce']}}


def test_diagnosis_names_the_ranks_behind_the_timed_out_collective():
    """The pure diagnosis: the collective from the flight recorder, rank 1 behind it and silent, rank 3 unknown,
    rank 2 alive and caught up; a silent rank on another host is not this host's to end."""
    now = 1000.0
    d = hang_report.diagnose(_GLOO_RECORD, _beats(now), rank=0, world=4, now=now, where="step 7",
                             limit="--collective-timeout 20 s")
    assert d.collective == "gloo:all_reduce #5 of process group 0 (default_pg)" and d.group == "0"
    assert d.waited == "waited more than --collective-timeout 20 s"
    assert (d.missing, d.silent, d.unknown, d.culprits) == ([1], [1], [3], [1, 3])
    assert d.silent_on("elsewhere") == [(1, 99)] and d.silent_on("here") == []
    stalled = hang_report.diagnose({**_GLOO_RECORD, "entries": [{**_GLOO_RECORD["entries"][1],
                                                                 "time_created_ns": int((now - 17) * 1e9)}]},
                                   _beats(now), rank=0, world=3, now=now, where="step 7",
                                   limit="--collective-timeout 20 s", stall_fraction=0.8)
    assert stalled.waited.startswith("has waited 17 s, over 80% of --collective-timeout 20 s")
    unrecorded = hang_report.diagnose({"entries": [], "pg_status": {}}, _beats(now), rank=0, world=3, now=now,
                                      where="step 7", limit="x", unrecorded="torch.distributed all_gather",
                                      timeout_message="Timed out waiting 20000ms")
    assert unrecorded.group is None and unrecorded.missing == [] and unrecorded.culprits == [1]
    assert unrecorded.collective == ("torch.distributed all_gather (from this rank's stack: the flight recorder holds "
                                     "no unfinished entry; gloo: Timed out waiting 20000ms)")


def test_render_says_who_where_and_what_was_done():
    now = 1000.0
    d = hang_report.diagnose(_GLOO_RECORD, _beats(now), rank=0, world=3, now=now, where="step 7",
                             limit="--collective-timeout 20 s")
    text = hang_report.render(d, killed=[1], removed=["checkpoint-4"], exit_code=3)
    assert text.startswith("hfdist: collective timeout on rank 0 at step 7: gloo:all_reduce #5 of process group 0 "
                           "(default_pg) waited more than --collective-timeout 20 s.")
    assert "hfdist: never joined: rank 1\n" in text
    assert "rank 1: step 7, heartbeat silent for 30 s" in text and "its last collective in that group #4" in text
    assert 'hfdist:      File "trainer.py", line 1, in training_step' in text  # rank 1's last stack
    assert "hfdist: -- rank 2: step 7, heartbeat alive" in text
    assert "removed the unfinished save checkpoint-4" in text and "rank 1 on this host, silent, killed" in text
    assert "(exit code 3)" in text
    assert all(line.startswith("hfdist:") for line in text.splitlines())  # the console keeps it on the screen


def test_watch_gathers_the_diagnosis_from_the_store_and_its_stack(monkeypatch, tmp_path):
    """What the watch hands diagnose: every rank's heartbeat from the store, its own stack where the timeout
    struck; and act() ends no rank of another host (nothing is removed from an output folder without saves)."""
    import torch.distributed as dist

    store = dist.HashStore()
    for rank, beat in _beats(time.time()).items():
        if rank:
            store.set(f"hfdist/heartbeat/{rank}", json.dumps(beat))
    monkeypatch.setattr(watchdog, "_flight_record", lambda collectives, nccl=False, only_active=False: _GLOO_RECORD)
    watch = watchdog.CollectiveWatch(tmp_path, 20)
    watch._store, watch._rank, watch._world = store, 0, 3
    watch.where("training", 7)
    try:
        raise RuntimeError("Timed out waiting 20000ms for recv operation to complete")
    except RuntimeError as exc:
        d = watch.diagnose(exc)
    assert d.where == "step 7" and d.culprits == [1] and set(d.beats) == {0, 1, 2}
    assert any("test_watchdog.py" in frame for frame in d.beats[0]["stack"])
    assert watch.act(d) == ([], [])


def _nccl_record(age_s: float) -> dict:
    """NCCL's flight recorder as a rank stuck in all_reduce #5 of the default group sees it, `age_s` after
    enqueueing it (#4 completed)."""
    now = time.time_ns()
    return {"entries": [{"profiling_name": "nccl:all_reduce", "collective_seq_id": 5, "retired": False,
                         "state": "scheduled", "is_p2p": False, "process_group": ["0", "default_pg"],
                         "time_created_ns": now - int(age_s * 1e9)}],
            "pg_status": {"0": {"last_enqueued_collective": "5", "last_completed_collective": "4"}}}


@pytest.fixture
def nccl_recorder(monkeypatch):
    """torch's NCCL flight-recorder dump (absent from a CPU build) returning what `state["record"]` holds; gloo's
    returns nothing, so a report that names the collective read NCCL's."""
    import torch._C._distributed_c10d as c10d

    state = {"record": {}, "calls": 0}

    def dump(include_collectives=None, only_active=None) -> bytes:
        state["calls"] += 1
        return json.dumps(state["record"]).encode()

    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", dump, raising=False)
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", lambda *args: b'{"entries": [], "pg_status": {}}')
    return state


def _nccl_watch(tmp_path, timeout: float):
    """Rank 0 of 2 under NCCL (as start() would set it up), rank 1's last heartbeat 30 s old, before #5."""
    import torch.distributed as dist

    store = dist.HashStore()
    store.set("hfdist/heartbeat/1", json.dumps({"rank": 1, "time": time.time() - 30, "phase": "training", "step": 7,
                                                 "last_enqueued": {"0": "4"}, "stack": []}))
    watch = watchdog.CollectiveWatch(tmp_path, timeout)
    watch._store, watch._rank, watch._world, watch._nccl = store, 0, 2, True
    return watch


def test_nccl_stall_is_reported_by_the_heartbeat_before_torchs_watchdog(tmp_path, monkeypatch, nccl_recorder):
    """gpu-readiness A1: under NCCL nothing raises in Python (torch's watchdog aborts the process at the timeout),
    so the heartbeat thread reads NCCL's flight recorder and reports once the oldest unfinished collective has
    waited 80% of the timeout: the report, logs/hang-rank-0.txt and exit code 3, from the heartbeat thread."""
    import threading

    exits = []
    monkeypatch.setattr(watchdog.os, "_exit", lambda code: exits.append((code, threading.current_thread().name)))
    nccl_recorder["record"] = _nccl_record(17)
    watch = _nccl_watch(tmp_path, 20)
    watch.where("training", 7)
    thread = threading.Thread(target=watch._loop, name="hfdist-heartbeat", daemon=True)
    thread.start()
    thread.join(10)
    assert exits == [(watchdog.EXIT_CODE, "hfdist-heartbeat")]
    text = (tmp_path / "logs" / "hang-rank-0.txt").read_text()
    assert text.startswith("hfdist: collective timeout on rank 0 at step 7: nccl:all_reduce #5 of process group 0 "
                           "(default_pg) has waited 17 s, over 80% of --collective-timeout 20 s: reported now, "
                           "before NCCL's watchdog aborts the process.")
    assert "hfdist: never joined: rank 1\n" in text
    assert "test_watchdog.py" in text  # this rank's stack: its main thread's, where it waits
    mine = json.loads(watch._store.get("hfdist/heartbeat/0"))  # the heartbeat published NCCL's group status
    assert mine["last_enqueued"] == {"0": "5"}


@pytest.mark.parametrize("age, timeout, solo", [(10, 20, False), (17, 20, True)])
def test_nccl_collective_within_its_time_is_left_alone(tmp_path, monkeypatch, nccl_recorder, age, timeout, solo):
    """Half the timeout, or a phase where rank 0 works alone (its timeout widened): no report."""
    monkeypatch.setattr(watchdog.os, "_exit", lambda code: pytest.fail("reported a healthy collective"))
    nccl_recorder["record"] = _nccl_record(age)
    watch = _nccl_watch(tmp_path, timeout)
    with watch.alone("saving the model", "SAVE") if solo else contextlib.nullcontext():
        watch._report_stall()
    assert nccl_recorder["calls"] == 1 and not (tmp_path / "logs").exists()


def test_solo_phase_widens_every_group_then_restores_it(tmp_path, monkeypatch, capsys):
    """gpu-readiness A2: while rank 0 works alone (data preparation, the streamed save), every process group's
    timeout is widened, and restored after; the test hold keeps rank 0 there. A 1-rank gloo world in this process."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    watch = watchdog.CollectiveWatch(tmp_path, 2)
    try:
        watch.start()
        sub = dist.new_group([0])
        watch.cover_groups()

        def timeouts() -> set[float]:
            return {g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                    for g in (c10d.GroupMember.WORLD, sub)}

        assert timeouts() == {2}
        monkeypatch.setenv("HFDIST_TEST_HOLD_SAVE", "0.1")
        watch.where("training", 3)
        with watchdog.solo_phase("saving the model", "SAVE"):
            assert timeouts() == {watchdog.SOLO_PHASE_TIMEOUT_SECONDS} and watch.phase == "saving the model"
        assert timeouts() == {2} and (watch.phase, watch.step) == ("training", 3)
        assert "hfdist: test hold: rank 0 alone in saving the model for 0.1 s" in capsys.readouterr().err
    finally:
        watch.stop()
        dist.destroy_process_group()
    assert isinstance(watchdog.solo_phase("x", "SAVE"), contextlib.nullcontext)  # no started watch: nothing


def test_straggler_line_names_the_slowest_rank_and_by_how_much():
    records = [{"rank": 0, "tokens_per_second": 1000.0, "step_seconds": 0.5, "data_wait_seconds": 0.01},
               {"rank": 1, "tokens_per_second": 800.0, "step_seconds": 0.625, "data_wait_seconds": 0.1}]
    assert straggler_line(records) == ("slowest: rank 1, 20.0% below the fastest (rank 0) in tokens/s (step 0.625 s "
                                       "vs 0.5 s, data wait 0.1 s vs 0.01 s).")
    assert straggler_line(records[:1]) is None
