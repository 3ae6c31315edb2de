"""What checkpoints cost, in one process: synchronous by default where no accelerator trains (background on a GPU
host), and every checkpoint's held and write seconds kept, logged (the trackers' channel) and marked in its folder;
the end of training waits for the last background write and counts that wait as held."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainerCallback

from hfdist.api import prepare_model, resolve_strategy, strategy_trainer
from hfdist.checkpoint.background import background_by_default
from hfdist.config.finetune import parse_args

SEQ, ROWS, STEPS = 32, 8, 2


def test_background_saves_are_the_default_on_accelerators_only():
    assert not background_by_default("cpu") and not background_by_default(torch.device("cpu"))
    assert background_by_default("cuda") and background_by_default(torch.device("cuda", 1))
    assert [parse_args(a).save_async for a in ([], ["--save-async"], ["--no-save-async"])] == [None, True, False]


class _Logs(TrainerCallback):
    """What the Trainer's logs carry to every tracker (hfdist.callbacks.tracker_logs feeds them on_log)."""

    def __init__(self) -> None:
        self.logged: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append(dict(logs))


@pytest.mark.parametrize("save_async", [None, True])  # None: this CPU host's default, synchronous
def test_every_checkpoint_reports_what_it_held_and_wrote(tmp_path, save_async):
    strategy = resolve_strategy("single")
    args = strategy.training_arguments(output_dir=str(tmp_path), global_batch_size=2, max_steps=STEPS,
                                       save_steps=1, save_strategy="steps", report_to="none")
    ids = torch.randint(0, 1024, (ROWS, SEQ), generator=torch.Generator().manual_seed(0)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids, "attention_mask": [[1] * SEQ] * ROWS})
    logs = _Logs()
    trainer = strategy_trainer(Trainer, strategy)(model=prepare_model(strategy, "llama-tiny"), args=args,
                                                  train_dataset=data, callbacks=[logs], save_async=save_async)
    trainer.train()
    background = bool(save_async)  # None on this CPU host: synchronous
    costs = trainer.checkpoint_costs
    assert [c["step"] for c in costs] == [1, 2] and all(c["background"] is background for c in costs)
    # Every write took time, and a synchronous save holds the loop at least as long as its own write takes.
    assert all(c["write_s"] > 0 and c["held_s"] > 0 for c in costs)
    if not background:
        assert all(c["held_s"] >= c["write_s"] for c in costs)
    logged = [entry for entry in logs.logged if "checkpoint/held_s" in entry]
    assert [entry["checkpoint/step"] for entry in logged] == [1.0, 2.0]
    assert logged[-1]["checkpoint/write_s"] == pytest.approx(costs[-1]["write_s"])
    marker = json.loads((tmp_path / "checkpoint-2" / "hfdist_checkpoint.json").read_text())
    assert marker["async_save"] is background
