"""How evaluation spreads the held-out blocks over the ranks (hfdist.train.evaluation.EvalBatches) and when the job
evaluates (evaluation_arguments, EvaluationSchedule): every block once, on ranks that run as many batches of one
shape."""

from __future__ import annotations

import pytest

from hfdist.config.finetune import evaluation_arguments, parse_args
from hfdist.train.evaluation import EvalBatches, EvaluationSchedule


def _rows(n: int) -> list[dict]:
    return [{"input_ids": [i, i], "labels": [-100, i], "position_ids": [0, 1]} for i in range(n)]


@pytest.mark.parametrize("n, dp, batch", [(10, 3, 4), (7, 2, 2), (3, 4, 2), (16, 2, 8)])
def test_every_block_once_and_as_many_batches_on_every_rank(n, dp, batch):
    ranks = [list(EvalBatches(_rows(n), r, dp, batch, list)) for r in range(dp)]
    assert len({len(batches) for batches in ranks}) == 1  # the collectives inside the forward meet
    assert all(len(b) == batch for batches in ranks for b in batches)  # one shape
    scored = [row["labels"][1] for batches in ranks for b in batches for row in b if row["labels"][1] != -100]
    assert sorted(scored) == list(range(n))
    assert len(EvalBatches(_rows(n), 0, dp, batch, list)) == len(ranks[0])


def test_when_the_job_evaluates():
    assert evaluation_arguments(parse_args([]), 4) == {"eval_strategy": "no"}
    every = evaluation_arguments(parse_args(["--eval-fraction", "0.1", "--eval-steps", "50", "--load-best"]), 4)
    assert every == {"eval_strategy": "steps", "eval_steps": 50, "per_device_eval_batch_size": 4,
                     "prediction_loss_only": True, "metric_for_best_model": "eval_loss", "greater_is_better": False}
    assert evaluation_arguments(parse_args(["--eval-dataset", "x.jsonl"]), 2)["eval_strategy"] == "no"  # end only


def test_the_schedule_adds_the_last_step_and_every_checkpoint_under_load_best():
    from types import SimpleNamespace

    from transformers import TrainerControl

    def decide(step: int, saving: bool, at_saves: bool) -> bool:
        control = TrainerControl(should_save=saving)
        EvaluationSchedule(at_saves).on_step_end(None, SimpleNamespace(global_step=step, max_steps=10), control)
        return control.should_evaluate

    assert decide(10, False, False) and not decide(4, True, False)
    assert decide(4, True, True) and not decide(3, False, True)
