"""TrackerLogsCallback: the run's trackers (W&B, MLflow, TensorBoard, Trackio) as one more consumer of the Trainer's
logs."""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from transformers import TrainerCallback

__all__ = ["TrackerLogsCallback", "LogSink"]


class LogSink(Protocol):
    """What the callback feeds: hfdist.callbacks.trackers.Trackers, or one tracker's sink."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one step's figures."""


class TrackerLogsCallback(TrainerCallback):
    """Logs every `on_log` dict (loss, learning rate, DistributedMetricsCallback's per-rank figures, evaluation
    metrics) to `sink` at the Trainer's global step.

    When the Trainer reports to W&B itself (`report_to` includes "wandb"), the W&B sink borrows that run instead of
    opening a second one, and the Trainer's own W&B callback does its per-step logging.
    """

    def __init__(self, sink: LogSink) -> None:
        self.sink = sink

    def on_train_begin(self, args, state, control, **kwargs):
        wandb = getattr(self.sink, "wandb", self.sink)  # Trackers' W&B sink, or a W&B sink itself
        if "wandb" in args.report_to and hasattr(wandb, "borrow_current_run"):
            wandb.borrow_current_run()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.sink.log(logs, step=state.global_step)
