"""The trackers of a run (`--report-to wandb,mlflow,tensorboard,trackio`): one run each per job, written by rank 0
with every rank's series (DistributedMetricsCallback puts them in the Trainer's logs; TrackerLogsCallback hands each
log to `Trackers.log`), none able to stop training (hfdist.callbacks.tracker).

    mlflow       a run in MLFLOW_TRACKING_URI when set, else in the file store OUTPUT_DIR/mlruns (MLflow's client
                 only: no server); params from the run's settings, one metric series per logged figure
    tensorboard  event files in OUTPUT_DIR/tensorboard (`tensorboard --logdir OUTPUT_DIR/tensorboard`)
    trackio      a run in TRACKIO_DIR when set, else OUTPUT_DIR/trackio (`TRACKIO_DIR=... trackio show`)
    wandb        hfdist.callbacks.wandb_sink.WandbSink

Their packages (besides wandb, a dependency) are optional: `pip install hfdist[trackers]`; the job refuses a tracker
whose package is missing before any process starts (`missing_trackers`).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from hfdist.callbacks.tracker import TrackerSink, numeric
from hfdist.callbacks.wandb_sink import WandbSink

__all__ = ["MlflowSink", "TensorBoardSink", "TrackioSink", "Trackers", "make_trackers", "missing_trackers",
           "TRACKER_PACKAGES"]

# tracker -> (module it imports, what pip installs); wandb is one of hfdist's dependencies.
TRACKER_PACKAGES = {"mlflow": ("mlflow", "mlflow-skinny"), "tensorboard": ("tensorboard", "tensorboard"),
                    "trackio": ("trackio", "trackio"), "wandb": ("wandb", "wandb")}
_MLFLOW_BATCH = 1000  # metrics per log_batch call: MLflow's limit


def missing_trackers(names: Sequence[str]) -> list[str]:
    """The trackers among `names` whose package is not installed."""
    return [n for n in names if importlib.util.find_spec(TRACKER_PACKAGES[n][0]) is None]


class MlflowSink(TrackerSink):
    """One MLflow run, through MlflowClient (no global active run: a user's own MLflow use is left alone)."""

    label = "MLflow"

    def __init__(self, *, output_dir: str | os.PathLike, active: bool, name: str, experiment: str,
                 params: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        super().__init__(active=active)
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or (Path(output_dir).resolve() / "mlruns").as_uri()
        self._name, self._experiment, self._params, self._tags = name, experiment, dict(params), dict(tags)

    def _open(self) -> Any:
        if self.uri.startswith("file:"):
            # MLflow 3 refuses its file store unless asked (it prefers a database); a local folder beside the run is
            # what a job without a tracking server needs.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        found = client.get_experiment_by_name(self._experiment)
        experiment = found.experiment_id if found is not None else client.create_experiment(self._experiment)
        run = client.create_run(experiment, run_name=self._name, tags=self._tags)
        params = [Param(k, str(v)[:6000]) for k, v in self._params.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(run.info.run_id, params=params[i:i + 100])
        return client, run.info.run_id

    @property
    def location(self) -> str | None:
        return f"{self.uri} (run {self._run[1]})" if self._run is not None else None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """One step's numeric figures, each its own metric series."""
        run = self._ensure_run()
        if run is None:
            return
        import time

        from mlflow.entities import Metric

        client, run_id = run
        stamp = int(time.time() * 1000)
        batch = [Metric(k, v, stamp, step) for k, v in numeric(metrics).items()]
        for i in range(0, len(batch), _MLFLOW_BATCH):
            self._call("log", client.log_batch, run_id, metrics=batch[i:i + _MLFLOW_BATCH])

    def set_summary(self, values: Mapping[str, Any]) -> None:
        """Run-level figures, as metrics without a step (MLflow's runs table shows their value)."""
        self.log(values, step=0)

    def finish(self, exit_code: int = 0) -> None:
        """Mark the run finished, killed (preempted: it checkpointed and stopped) or failed."""
        from hfdist.config.preemption import PREEMPTED_EXIT_CODE

        run, self._closed = self._run, True
        status = {0: "FINISHED", PREEMPTED_EXIT_CODE: "KILLED"}.get(exit_code, "FAILED")
        if run is not None:
            self._call("finish", run[0].set_terminated, run[1], status)


class TensorBoardSink(TrackerSink):
    """Event files of one run, through torch's SummaryWriter (which needs the tensorboard package)."""

    label = "TensorBoard"

    def __init__(self, *, output_dir: str | os.PathLike, active: bool, config: Mapping[str, Any]) -> None:
        super().__init__(active=active)
        self.log_dir = Path(output_dir) / "tensorboard"
        self._config = dict(config)
        self._last_step = 0

    def _open(self) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(self.log_dir))
        writer.add_text("config", "```\n" + json.dumps(self._config, indent=2, default=str) + "\n```")
        return writer

    @property
    def location(self) -> str | None:
        return str(self.log_dir) if self._run is not None else None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """One step's numeric figures as scalars at `step`."""
        writer = self._ensure_run()
        if writer is None:
            return
        self._last_step = step
        for key, value in numeric(metrics).items():
            self._call("log", writer.add_scalar, key, value, step)
            if self._closed:
                return

    def set_summary(self, values: Mapping[str, Any]) -> None:
        """Run-level figures, as scalars at the last step."""
        self.log(values, step=self._last_step)

    def finish(self, exit_code: int = 0) -> None:
        """Flush and close the event file."""
        writer, self._closed = self._run, True
        if writer is not None:
            self._call("finish", writer.close)


class TrackioSink(TrackerSink):
    """One Trackio run (a local SQLite store; trackio's own system metrics off: hfdist measures the run itself)."""

    label = "Trackio"

    def __init__(self, *, output_dir: str | os.PathLike, active: bool, name: str, group: str | None, project: str,
                 config: Mapping[str, Any]) -> None:
        super().__init__(active=active)
        self.store = Path(os.environ.get("TRACKIO_DIR") or Path(output_dir).resolve() / "trackio")
        self._kwargs = {"project": project, "name": name, "group": group, "config": dict(config)}
        self._last_step = 0

    def _open(self) -> Any:
        # Read when trackio is first imported: set before that, so the store is the one this run names.
        os.environ.setdefault("TRACKIO_DIR", str(self.store))
        import trackio

        return trackio.init(**self._kwargs, auto_log_cpu=False, auto_log_gpu=False)

    @property
    def location(self) -> str | None:
        return f"{self.store} (project {self._kwargs['project']})" if self._run is not None else None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """One step's numeric figures."""
        run = self._ensure_run()
        if run is not None:
            self._last_step = step
            self._call("log", run.log, numeric(metrics), step=step)

    def set_summary(self, values: Mapping[str, Any]) -> None:
        """Run-level figures, logged at the last step."""
        self.log(values, step=self._last_step)

    def finish(self, exit_code: int = 0) -> None:
        """Flush the run to its store."""
        run, self._closed = self._run, True
        if run is not None:
            self._call("finish", run.finish)


class Trackers:
    """Every tracker of a run behind one sink interface (log, set_summary, start, finish); `wandb` is the W&B sink
    when W&B is among them (the Trainer's own W&B integration may lend it its run)."""

    def __init__(self, sinks: Mapping[str, TrackerSink]) -> None:
        self.sinks = dict(sinks)
        self.wandb: WandbSink | None = self.sinks.get("wandb")  # type: ignore[assignment]

    def start(self) -> None:
        """Open every tracker's run (before training: their start-up stays out of step times)."""
        for sink in self.sinks.values():
            sink.start()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """One step's logs to every tracker."""
        for sink in self.sinks.values():
            sink.log(metrics, step)

    def set_summary(self, values: Mapping[str, Any]) -> None:
        """Run-level figures to every tracker."""
        for sink in self.sinks.values():
            sink.set_summary(values)

    def finish(self, exit_code: int = 0) -> dict[str, dict[str, Any]]:
        """Close every run; returns each tracker's record (where its run is, and any error), taken before closing
        (a W&B run's folder is no longer known once it is finished)."""
        records = {name: sink.record() for name, sink in self.sinks.items()}
        for sink in self.sinks.values():
            sink.finish(exit_code)
        return records


def make_trackers(names: Sequence[str], *, output_dir: str | os.PathLike, active: bool, name: str,
                  group: str | None, job_type: str, config: Mapping[str, Any], project: str | None) -> Trackers:
    """The trackers `names` asks for (--report-to), active on the logging rank only.

    Args:
        name: the run's name (the rung); group: the comparison it belongs to (--compare-id); job_type: the rung's
            kind; config: the run's settings (params / config of each run); project: W&B project, MLflow experiment
            and Trackio project (default WANDB_PROJECT or MLFLOW_EXPERIMENT_NAME, else "hfdist").
    """
    tags = {k: v for k, v in (("group", group), ("job_type", job_type)) if v}
    builders = {
        "wandb": lambda: WandbSink(output_dir=output_dir, active=active, project=project, name=name, group=group,
                                   job_type=job_type, config=config),
        "mlflow": lambda: MlflowSink(output_dir=output_dir, active=active, name=name, params=config, tags=tags,
                                     experiment=project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "hfdist"),
        "tensorboard": lambda: TensorBoardSink(output_dir=output_dir, active=active, config=config),
        "trackio": lambda: TrackioSink(output_dir=output_dir, active=active, name=name, group=group,
                                       project=project or "hfdist", config=config),
    }
    return Trackers({n: builders[n]() for n in names})
