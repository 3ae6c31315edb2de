"""LossRecorder: the global mean loss of every optimizer step, as the Trainer logs it (logging_steps=1)."""

from __future__ import annotations

from transformers import TrainerCallback

__all__ = ["LossRecorder"]


class LossRecorder(TrainerCallback):
    """Keeps `logs["loss"]` per step: Trainer gathers it over all ranks before logging, so it is the global mean.

    A resumed run starts from the checkpoint's log history, so `steps` covers the whole run: each optimizer step
    once, whatever was interrupted and retrained in between.
    """

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.steps: list[int] = []

    def on_train_begin(self, args, state, control, **kwargs):
        if args.logging_steps != 1:
            raise ValueError("LossRecorder needs logging_steps=1 to see the loss of every optimizer step; "
                             f"got logging_steps={args.logging_steps}.")
        earlier = [h for h in state.log_history if "loss" in h]  # restored from a checkpoint on resume
        self.losses = [float(h["loss"]) for h in earlier]
        self.steps = [int(h["step"]) for h in earlier]

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            self.steps.append(state.global_step)
