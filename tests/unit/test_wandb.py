"""WandbSink with the real wandb package (offline; no server here) and the offline-run reader.

What the sink logs is read back from the `.wandb` file; W&B failures (unreachable server, a raising log) must
warn once and never raise into training.
"""

from __future__ import annotations

import shutil
import time

import pytest

from hfdist.callbacks.rank_metrics import aggregate_ranks
from hfdist.callbacks.wandb_sink import WandbSink, resolve_wandb_mode, sync_instructions
from hfdist.report.wandb_offline import WandbFileError, find_offline_runs, read_offline_run, read_records

from helpers import finished_offline_run

STRATEGY = {"name": "fsdp2", "world_size": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1}


@pytest.fixture(autouse=True)
def quiet_offline_wandb(monkeypatch, tmp_path):
    """No credentials, no console capture, every wandb file under tmp_path."""
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_MODE",
                "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for var, sub in (("WANDB_DIR", "wandb-dir"), ("WANDB_CONFIG_DIR", "wandb-config"),
                     ("WANDB_CACHE_DIR", "wandb-cache"), ("WANDB_DATA_DIR", "wandb-data")):
        monkeypatch.setenv(var, str(tmp_path / sub))


def _records(step: int) -> list[dict]:
    """What the lead's callback gathers from two ranks at one logging step (out of rank order on purpose)."""
    return [{"rank": 1, "tokens_per_second": 90.0 + step, "tokens": 256, "peak_memory_bytes": 2_000 + step,
             "device": "cpu"},
            {"rank": 0, "tokens_per_second": 100.0 + step, "tokens": 256, "peak_memory_bytes": 1_000}]


def test_aggregate_ranks():
    out = aggregate_ranks(_records(0))
    assert out["rank0/tokens_per_second"] == 100.0 and out["rank1/tokens_per_second"] == 90.0
    assert out["tokens_per_second/min"] == 90.0 and out["tokens_per_second/max"] == 100.0
    assert out["tokens_per_second/mean"] == 95.0 and out["tokens_per_second/sum"] == 190.0
    assert out["tokens/sum"] == 512 and "peak_memory_bytes/sum" not in out
    assert out["peak_memory_bytes/max"] == 2_000
    assert not any(k.startswith("rank/") or "device" in k for k in out)  # the rank id and strings are no series
    assert aggregate_ranks([{"x": 1.0}, {"x": 3.0}]) == {"rank0/x": 1.0, "rank1/x": 3.0, "x/min": 1.0,
                                                         "x/max": 3.0, "x/mean": 2.0}


def test_mode_offline_unless_logged_in_or_explicit(tmp_path):
    env = {"NETRC": str(tmp_path / "no-netrc")}
    assert resolve_wandb_mode(env) == "offline"
    assert resolve_wandb_mode({**env, "WANDB_MODE": "disabled"}) == "disabled"
    assert resolve_wandb_mode({**env, "WANDB_API_KEY": "k" * 40}) == "online"
    assert resolve_wandb_mode({**env, "WANDB_API_KEY": "k" * 40, "WANDB_MODE": "offline"}) == "offline"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    assert resolve_wandb_mode({"NETRC": str(netrc)}) == "online"
    # logged in to the cloud, but pointed at another server: no key for that host
    assert resolve_wandb_mode({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.com"}) == "offline"


def test_sink_round_trip_through_the_offline_file(tmp_path):
    out = tmp_path / "run"
    big = "x" * 70_000  # a config entry over two 32 KiB blocks: the reader must join FIRST/MIDDLE/LAST chunks
    sink = WandbSink(output_dir=out, active=True, name="fsdp2", group="cmp-123", job_type="fsdp",
                     config={"strategy": STRATEGY, "seq_len": 64, "notes": big})
    assert sink.mode == "offline" and sink.run_dir is None  # nothing starts before the first call
    logged = []
    for step in range(1, 4):
        metrics = {**aggregate_ranks(_records(step)), "loss": 3.0 / step}
        sink.log(metrics, step=step)
        logged.append(metrics)
    sink.set_summary({"peak_memory_bytes/max": 2_003, "mfu/mean": 0.012})
    sink.log_table("matrix", ["strategy", "tokens_per_second"], [["fsdp2", 95.0], ["ddp", 120.0]], step=4)
    run_dir = sink.run_dir
    sink.finish()
    sink.log({"loss": 0.0}, step=9)  # after finish: ignored, no new run
    assert sink.error is None

    assert run_dir is not None and run_dir.parent == out / "wandb" and run_dir.name.startswith("offline-run-")
    run = finished_offline_run(out)
    assert find_offline_runs(out) == [next(run_dir.glob("run-*.wandb"))]
    assert (run.name, run.group, run.job_type, run.project) == ("fsdp2", "cmp-123", "fsdp", "hfdist")
    assert run.config == {"strategy": STRATEGY, "seq_len": 64, "notes": big}
    assert [row["_step"] for row in run.history] == [1, 2, 3, 4]
    for row, metrics in zip(run.history, logged):
        assert {k: row[k] for k in metrics} == metrics
    assert run.history[3]["matrix"]["_type"] == "table-file"
    assert run.summary["peak_memory_bytes/max"] == 2_003 and run.summary["mfu/mean"] == 0.012
    assert run.summary["loss"] == 1.0  # W&B keeps the last logged value of each key
    assert run.exit_code == 0


def test_reader_rejects_corrupt_files_and_tolerates_a_cut_tail(tmp_path):
    sink = WandbSink(output_dir=tmp_path / "run", active=True, name="ddp")
    for step in range(3):
        sink.log({"loss": float(step)}, step=step)
    sink.finish()
    finished_offline_run(tmp_path / "run")
    path = find_offline_runs(tmp_path / "run")[0]
    data = path.read_bytes()

    cut = tmp_path / "cut" / "run-cut.wandb"
    cut.parent.mkdir()
    cut.write_bytes(data[:-10])  # killed mid-record: everything before the last record still reads
    assert len(list(read_records(cut))) == len(list(read_records(path))) - 1

    flipped = bytearray(data)
    flipped[60] ^= 0xFF
    bad = tmp_path / "bad" / "run-bad.wandb"
    bad.parent.mkdir()
    bad.write_bytes(bytes(flipped))
    with pytest.raises(WandbFileError, match="CRC"):
        read_offline_run(bad)
    (tmp_path / "bad" / "run-bad.wandb").write_bytes(b"not a wandb file")
    with pytest.raises(WandbFileError, match="header"):
        read_offline_run(bad)
    shutil.copy(path, tmp_path / "bad" / "run-copy.wandb")
    with pytest.raises(WandbFileError, match="2 offline W&B runs"):
        read_offline_run(tmp_path / "bad")


def test_inactive_rank_does_nothing(tmp_path):
    sink = WandbSink(output_dir=tmp_path / "rank1", active=False, name="ddp")
    sink.log({"loss": 1.0}, step=1)
    sink.set_summary({"x": 1})
    sink.log_table("t", ["a"], [[1]])
    sink.finish()
    assert sink.run_dir is None and sink.error is None and not (tmp_path / "rank1").exists()


def test_unreachable_server_or_bad_key_logs_offline_and_training_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setenv("WANDB_API_KEY", "f" * 40)
    sink = WandbSink(output_dir=tmp_path / "run", active=True, name="ddp", init_timeout=2)
    start = time.perf_counter()
    for step in range(3):
        sink.log({"loss": 1.0 + step}, step=step)  # the first call pays the init timeout; the rest return at once
    sink.set_summary({"peak": 1})
    sink.finish()
    assert time.perf_counter() - start < 30
    assert sink.error is not None and sink.error.startswith("W&B online init failed")
    assert sink.mode == "offline"
    err = capsys.readouterr().err
    assert err.count("hfdist: warning: W&B") == 1 and "wandb sync" in err
    # Nothing was lost: the run went to disk, every step and the summary in it.
    run = finished_offline_run(tmp_path / "run")
    assert [row["loss"] for row in run.history] == [1.0, 2.0, 3.0] and run.summary["peak"] == 1


def test_failing_log_mid_run_warns_once_and_keeps_what_was_logged(tmp_path, monkeypatch, capsys):
    import wandb

    sink = WandbSink(output_dir=tmp_path / "run", active=True, name="zero3")
    sink.log({"loss": 2.0}, step=1)
    real_log = wandb.Run.log

    def broken_log(self, *args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(wandb.Run, "log", broken_log)
    sink.log({"loss": 1.5}, step=2)
    sink.log({"loss": 1.0}, step=3)
    sink.set_summary({"peak": 1})
    monkeypatch.setattr(wandb.Run, "log", real_log)
    sink.finish()  # the run is still closed properly
    assert sink.error == "W&B log failed: OSError: No space left on device"
    assert capsys.readouterr().err.count("hfdist: warning: W&B") == 1
    run = finished_offline_run(tmp_path / "run")
    assert [row["loss"] for row in run.history] == [2.0]
    assert "peak" not in run.summary


def test_sync_instructions_name_the_dirs():
    text = sync_instructions(["/o/ddp/wandb/offline-run-1", "/o/fsdp/wandb/offline-run-2"], project="p", group="g")
    assert "wandb sync --project p /o/ddp/wandb/offline-run-1 /o/fsdp/wandb/offline-run-2" in text
    assert "group 'g'" in text


def test_comparison_report_panels_cover_the_compared_figures():
    """The online report is built from the same keys the runs log (constructed here; saving needs a server)."""
    from hfdist.report.wandb_report import comparison_report

    report = comparison_report("me", "hfdist", "cmp-123")
    grid = report.blocks[-1]
    (runset,) = grid.runsets
    assert runset.filters == "Group == 'cmp-123'" and runset.project == "hfdist"
    keys = {y for panel in grid.panels for y in (getattr(panel, "y", None) or getattr(panel, "metrics", []))}
    assert {"tokens_per_second/mean", "mfu/mean", "peak_memory_bytes/max", "loss"} <= keys
