"""WandbLogsCallback: hfdist's W&B sink as one more consumer of the Trainer's logs."""

from __future__ import annotations

from transformers import TrainerCallback

from hfdist.callbacks.wandb_sink import WandbSink

__all__ = ["WandbLogsCallback"]


class WandbLogsCallback(TrainerCallback):
    """Logs every `on_log` dict (loss, learning rate, DistributedMetricsCallback's per-rank figures, evaluation
    metrics) to `sink` at the Trainer's global step.

    When the Trainer reports to W&B itself (`report_to` includes "wandb"), the sink borrows that run instead of
    opening a second one, and the Trainer's own W&B callback does the per-step logging.
    """

    def __init__(self, sink: WandbSink) -> None:
        self.sink = sink

    def on_train_begin(self, args, state, control, **kwargs):
        if "wandb" in args.report_to:
            self.sink.borrow_current_run()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.sink.log(logs, step=state.global_step)
