"""LossRecorder: the global mean loss and the gradient norm of every optimizer step, as the Trainer logs them
(logging_steps=1), and every evaluation's eval loss."""

from __future__ import annotations

from transformers import TrainerCallback

__all__ = ["LossRecorder"]


class LossRecorder(TrainerCallback):
    """Keeps `logs["loss"]` per step: Trainer gathers it over all ranks before logging, so it is the global mean; its
    `logs["grad_norm"]`, the norm of the whole model's gradient before clipping (global over every rank and mesh:
    hfdist.parallel.grad_norm on the rungs hfdist shards, DeepSpeed's or DDP's own elsewhere; None where a Trainer
    logs none); and each evaluation's `eval_loss` with its step (`evaluations`: step -> eval metrics).

    A resumed run starts from the checkpoint's log history, so `steps` covers the whole run: each optimizer step
    once, whatever was interrupted and retrained in between. `best_step` is set by the job under --load-best.

    Args:
        series: more figures to keep with each step's loss (a DPO run's rewards, a GRPO run's reward and rollout
            seconds: hfdist.objectives.trainer.SERIES), in `series[name]`; None where a step logged none.
    """

    def __init__(self, series: tuple[str, ...] = ()) -> None:
        self.series: dict[str, list[float | None]] = {name: [] for name in series}
        self.losses: list[float] = []
        self.grad_norms: list[float | None] = []
        self.steps: list[int] = []
        self.evaluations: dict[int, dict[str, float]] = {}
        self.best_step: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if args.logging_steps != 1:
            raise ValueError("LossRecorder needs logging_steps=1 to see the loss of every optimizer step; "
                             f"got logging_steps={args.logging_steps}.")
        earlier = [h for h in state.log_history if "loss" in h]  # restored from a checkpoint on resume
        self.losses = [float(h["loss"]) for h in earlier]
        self.grad_norms = [_float_or_none(h.get("grad_norm")) for h in earlier]
        self.steps = [int(h["step"]) for h in earlier]
        self.series = {name: [_float_or_none(h.get(name)) for h in earlier] for name in self.series}
        self.evaluations = {int(h["step"]): _eval_metrics(h) for h in state.log_history if "eval_loss" in h}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            self.grad_norms.append(_float_or_none(logs.get("grad_norm")))
            self.steps.append(state.global_step)
            for name, values in self.series.items():
                values.append(_float_or_none(logs.get(name)))
        if logs and "eval_loss" in logs:
            self.evaluations[state.global_step] = _eval_metrics(logs)


def _eval_metrics(logs) -> dict[str, float]:
    return {"loss": float(logs["eval_loss"]), "perplexity": float(logs["eval_perplexity"]),
            "tokens": int(logs["eval_tokens"])}


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)
