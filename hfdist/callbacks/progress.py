"""A quiet progress bar: the loss in the bar's postfix instead of one printed dict per logging step."""

from __future__ import annotations

from transformers.trainer_callback import ProgressCallback

__all__ = ["QuietProgressCallback"]


class QuietProgressCallback(ProgressCallback):
    """ProgressCallback that shows the latest loss and learning rate in the bar rather than printing them."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs and "loss" in logs:
            self.training_bar.set_postfix(loss=f"{logs['loss']:.4f}", lr=f"{logs.get('learning_rate', 0):.2e}")
