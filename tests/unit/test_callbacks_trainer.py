"""DistributedMetricsCallback inside a real transformers Trainer (one process): the contract with the installed
transformers that hfdist.callbacks.placement relies on.

`Trainer.log` appends its copy of the logs to `state.log_history` before the callbacks run, and the report_to
integrations come before the user's callbacks. A stand-in integration listed before the callback (where report_to
puts W&B, TensorBoard, MLflow, trackio) must still receive the figures, and so must log_history; a real W&B
integration must end up with one run even when hfdist's sink is registered too.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator
from transformers.trainer_callback import DefaultFlowCallback, ProgressCallback

from hfdist.callbacks.distributed_metrics import DistributedMetricsCallback
from hfdist.callbacks.progress import MetricsProgressCallback
from hfdist.metrics.flops import flops_per_token
from hfdist.models.build import build_model
from hfdist.models.presets import load_config

from helpers import finished_offline_run

SEQ, ROWS, BATCH, STEPS = 32, 8, 2, 3


class StandInIntegration(TrainerCallback):
    """Records what an integration's on_log receives (a copy: what it would have sent to its tracker)."""

    def __init__(self) -> None:
        self.logged: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append(dict(logs))


def _dataset() -> Dataset:
    ids = torch.randint(0, 1024, (ROWS, SEQ), generator=torch.Generator().manual_seed(0)).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids, "attention_mask": [[1] * SEQ] * ROWS})


def _trainer(tmp_path, callbacks, **args) -> Trainer:
    return Trainer(model=build_model("llama-tiny", vocab_size=1024),
                   args=TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH,
                                          max_steps=STEPS, logging_steps=1, save_strategy="no", use_cpu=True,
                                          **{"report_to": "none", **args}),
                   train_dataset=_dataset(), data_collator=default_data_collator, callbacks=callbacks)


def test_figures_reach_integrations_listed_before_it_and_log_history(tmp_path, capsys):
    integration, metrics = StandInIntegration(), DistributedMetricsCallback()
    trainer = _trainer(tmp_path, [integration, metrics])
    assert trainer.callback_handler.callbacks[:2] == [trainer.callback_handler.callbacks[0], metrics]
    assert isinstance(trainer.callback_handler.callbacks[0], DefaultFlowCallback)
    trainer.train()

    logged = [logs for logs in integration.logged if "loss" in logs]
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == len(history) == STEPS
    per_token = flops_per_token(load_config("llama-tiny", 1024), SEQ)
    for logs, entry in zip(logged, history):
        assert {k: v for k, v in entry.items() if k != "step"} == logs  # the same figures in both
        assert logs["rank0/tokens"] == BATCH * SEQ and logs["slowest_rank"] == 0
        assert logs["rank0/tflops_per_device"] == pytest.approx(logs["rank0/tokens_per_second"] * per_token / 1e12)
        assert logs["tokens_per_second/min"] == logs["tokens_per_second/max"] == logs["rank0/tokens_per_second"]
    bars = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ProgressCallback)]
    assert len(bars) == 1 and isinstance(bars[0], MetricsProgressCallback) and bars[0].metrics is metrics
    (run,) = metrics.ranks
    assert run["steps"] == STEPS and run["tokens"] == STEPS * BATCH * SEQ and run["tokens_per_second"] > 0
    console = capsys.readouterr()
    assert console.out.count("hfdist: per-rank figures over 3 steps") == 1 and "outputs: " in console.out
    assert "{'loss'" not in console.out + console.err


def test_hfdist_sink_adds_to_the_trainers_wandb_run_instead_of_a_second(tmp_path, monkeypatch):
    import wandb

    from hfdist.callbacks.tracker_logs import TrackerLogsCallback
    from hfdist.callbacks.wandb_sink import WandbSink
    from hfdist.report.wandb_offline import find_offline_runs

    for var in ("WANDB_API_KEY", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_root"))
    (tmp_path / "wandb_root").mkdir()
    sink = WandbSink(output_dir=tmp_path / "sink", active=True, name="mine")
    trainer = _trainer(tmp_path, [DistributedMetricsCallback(print_table=False), TrackerLogsCallback(sink)],
                       report_to="wandb")
    trainer.train()
    sink.set_summary({"peak/peak_memory_bytes": 123})
    sink.finish()
    assert sink.borrowed and sink.error is None
    wandb.finish()  # the Trainer's run, which W&B would otherwise close at exit
    wandb.teardown()  # and its service, so that no later subprocess inherits it through WANDB_SERVICE

    assert not (tmp_path / "sink").exists()
    (run_file,) = find_offline_runs(tmp_path / "wandb_root")
    run = finished_offline_run(run_file)
    steps = [row for row in run.history if "train/loss" in row]
    assert len(steps) == STEPS and all(row["train/rank0/tokens"] == BATCH * SEQ for row in steps)
    assert run.summary["peak/peak_memory_bytes"] == 123
