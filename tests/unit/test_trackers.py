"""The trackers of `--report-to` (hfdist.callbacks.trackers): each writes one run that its own reader gets back
(MLflow's client, TensorBoard's event reader, Trackio's store), a failing one warns once and the others go on, and a
tracker whose package is missing is refused before any process starts."""

from __future__ import annotations

import importlib.util

import pytest

from hfdist.callbacks.trackers import MlflowSink, TensorBoardSink, Trackers, TrackioSink, make_trackers

from helpers import mlflow_series, tensorboard_series

STEPS = [{"loss": 2.0, "rank0/tokens": 512, "rank1/tokens": 512, "tokens/sum": 1024, "slowest_rank": 1},
         {"loss": 1.5, "rank0/tokens": 512, "rank1/tokens": 256, "tokens/sum": 768, "slowest_rank": 1,
          "note": "not a number"}]


def _log(trackers: Trackers) -> dict:
    trackers.start()
    for step, logs in enumerate(STEPS, 1):
        trackers.log(logs, step)
    trackers.set_summary({"peak/peak_memory_bytes": 123})
    return trackers.finish()


def test_mlflow_tensorboard_and_trackio_each_hold_one_run_with_every_series(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    records = _log(make_trackers(["mlflow", "tensorboard", "trackio"], output_dir=tmp_path, active=True, name="ddp",
                                 group="cmp", job_type="ddp", config={"seq_len": 64}, project="hfdist-test"))
    assert all(r["error"] is None for r in records.values()), records

    (run,) = mlflow_series((tmp_path / "mlruns").as_uri())
    assert run[0] == "ddp"
    assert run[1]["rank1/tokens"] == [(1, 512.0), (2, 256.0)] and run[1]["loss"] == [(1, 2.0), (2, 1.5)]
    assert "note" not in run[1] and run[1]["peak/peak_memory_bytes"] == [(0, 123.0)]

    scalars = tensorboard_series(tmp_path / "tensorboard")
    assert scalars["rank1/tokens"] == [(1, 512.0), (2, 256.0)] and scalars["tokens/sum"] == [(1, 1024.0), (2, 768.0)]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1  # one run

    import trackio.sqlite_storage as storage

    assert storage.SQLiteStorage.get_runs("hfdist-test") == ["ddp"]
    logs = storage.SQLiteStorage.get_logs("hfdist-test", "ddp")
    assert [(r["step"], r["rank1/tokens"]) for r in logs if "rank1/tokens" in r] == [(1, 512), (2, 256)]


def test_inactive_ranks_write_nothing(tmp_path):
    _log(make_trackers(["mlflow", "tensorboard", "trackio", "wandb"], output_dir=tmp_path, active=False, name="ddp",
                       group=None, job_type="ddp", config={}, project=None))
    assert not any(tmp_path.iterdir())


def test_a_failing_tracker_warns_once_and_the_others_go_on(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    class FullDisk(TensorBoardSink):
        def _open(self):
            writer = super()._open()

            def add_scalar(*args, **kwargs):
                raise OSError("No space left on device")

            writer.add_scalar = add_scalar
            return writer

    broken = FullDisk(output_dir=tmp_path, active=True, config={})
    mlflow = MlflowSink(output_dir=tmp_path, active=True, name="ddp", experiment="hfdist", params={}, tags={})
    records = _log(Trackers({"tensorboard": broken, "mlflow": mlflow}))
    assert records["tensorboard"]["error"] == "TensorBoard log failed: OSError: No space left on device"
    assert capsys.readouterr().err.count("hfdist: warning: TensorBoard") == 1
    assert records["mlflow"]["error"] is None
    assert mlflow_series((tmp_path / "mlruns").as_uri())[0][1]["loss"] == [(1, 2.0), (2, 1.5)]


def test_an_unreachable_tracking_server_does_not_stop_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    sink = MlflowSink(output_dir=tmp_path, active=True, name="ddp", experiment="hfdist", params={}, tags={})
    records = _log(Trackers({"mlflow": sink}))
    assert records["mlflow"]["error"].startswith("MLflow init failed")
    assert "Training goes on without MLflow" in capsys.readouterr().err


def test_trackio_keeps_its_store_where_trackio_dir_says(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "elsewhere"))
    sink = TrackioSink(output_dir=tmp_path / "out", active=True, name="x", group=None, project="p", config={})
    assert sink.store == tmp_path / "elsewhere"


def test_a_tracker_without_its_package_is_refused_before_any_process(monkeypatch):
    from hfdist.config.finetune import ConfigError, parse_args
    from hfdist.job.preflight import check_trackers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        check_trackers(parse_args(["--report-to", "wandb,mlflow,tensorboard"]))
    said = str(err.value)
    assert said.startswith("--report-to mlflow: this tracker needs a package that is not installed (mlflow-skinny)")
    assert "pip install 'hfdist[trackers]'" in said
    check_trackers(parse_args(["--report-to", "mlflow", "--no-metrics"]))  # no trackers without the callbacks
