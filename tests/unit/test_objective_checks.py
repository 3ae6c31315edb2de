"""--objective dpo / grpo before any process starts: the refusals (hfdist.objectives.checks), the reward functions
by import path, the embedded task's rewards and rows. The objectives train against one process in
tests/e2e/test_cells.py (the dpo and grpo cells) and end to end in tests/e2e/test_objectives.py."""

from __future__ import annotations

import json

import pytest

from hfdist.config.finetune import ARITHMETIC_REWARDS, ConfigError, FinetuneConfig
from hfdist.config.ladder import load_rung
from hfdist.errors import DataError
from hfdist.objectives.arithmetic import arithmetic_prompts, correct_sum, digits_only
from hfdist.objectives.checks import check_objective
from hfdist.objectives.data import objective_dataset, preference_pairs
from hfdist.objectives.rewards import RewardError, load_reward_funcs


def _check(rung: str = "single", **settings) -> None:
    check_objective(FinetuneConfig(**settings), load_rung(rung))


def test_the_embedded_task_rewards_digits_and_the_right_sum():
    rows = arithmetic_prompts(3, seed=1)
    assert all(r["prompt"].endswith("=") and str(eval(r["prompt"][:-1])) == r["answer"] for r in rows)
    assert digits_only(["12", "1a", "", " 7 "]) == [1.0, 0.5, 0.0, 1.0]
    assert correct_sum(["19 and more", "191", "x19"], answer=["19", "19", "19"]) == [1.0, 0.0, 0.0]


def test_reward_functions_resolve_by_import_path_or_name_the_fix():
    assert load_reward_funcs(ARITHMETIC_REWARDS) == [digits_only, correct_sum]
    for bad, says in (("hfdist.objectives.arithmetic", "not an import path"),
                      ("no_such_module_xyz:f", "does not import"),
                      ("hfdist.objectives.arithmetic:nothing", "has no callable 'nothing'")):
        with pytest.raises(RewardError, match=says):
            load_reward_funcs((bad,))


@pytest.mark.parametrize("rung", ["pp", "3d", "fsdp_cp"])
def test_layouts_that_cannot_hold_the_objective_are_refused_with_why(rung):
    for objective in ("dpo", "grpo"):
        with pytest.raises(ConfigError, match=rf"--objective {objective} does not run on {rung}: (the objective "
                                              r"compares whole|context parallelism splits)"):
            _check(rung, objective=objective)


def test_a_layout_not_yet_verified_or_not_the_same_math_is_refused():
    with pytest.raises(ConfigError, match="--objective dpo does not run on zero1: hfdist has not trained"):
        _check("zero1", objective="dpo")
    with pytest.raises(ConfigError, match="--objective grpo does not run on fsdp_ep: TRL's loss adds the router's"):
        _check("fsdp_ep", objective="grpo", model="qwen3-moe-tiny")


@pytest.mark.parametrize("settings, says", [
    ({"objective": "dpo", "qlora": True}, "does not take --qlora"),
    ({"objective": "grpo", "fp8": "tensorwise"}, "does not take --fp8"),
    ({"objective": "dpo", "eval_fraction": 0.1}, "does not take held-out evaluation"),
    ({"objective": "grpo", "global_batch_size": 10}, "not a multiple of --num-generations 4"),
    ({"objective": "grpo", "beta": 0.04}, "a KL term needs a frozen reference model"),
    ({"objective": "dpo", "reward_funcs": ("m:f",)}, "--reward-funcs scores GRPO's completions"),
    ({"reward_funcs": ("m:f",)}, "belong to --objective grpo / dpo"),
    ({"objective": "dpo", "rollout_gather": "once"}, "--rollout-gather once gathers an FSDP2-sharded model"),
])
def test_combinations_not_run_are_refused(settings, says):
    with pytest.raises(ConfigError, match=says):
        _check(**settings)


def test_whole_model_rollouts_need_grpo_on_a_rung_fsdp2_shards():
    _check("fsdp_full_shard", objective="grpo", rollout_gather="once")
    with pytest.raises(ConfigError, match="zero3 with --objective grpo has no such rollout"):
        _check("zero3", objective="grpo", rollout_gather="once")


def test_the_embedded_defaults_and_a_users_rows(tmp_path):
    grpo = objective_dataset(FinetuneConfig(objective="grpo"))
    assert {"prompt", "answer"} <= set(grpo.column_names) and len(grpo) >= 1024
    dpo = objective_dataset(FinetuneConfig(objective="dpo"))
    assert set(dpo.column_names) == {"prompt", "chosen", "rejected"}
    assert all(r["chosen"] != r["rejected"] for r in dpo.select(range(50)))
    rows = tmp_path / "pairs.jsonl"
    rows.write_text("".join(json.dumps({"question": "q", "good": "a", "bad": "b"}) + "\n" for _ in range(4)))
    with pytest.raises(DataError, match="reads the columns prompt, chosen, rejected.*missing prompt, chosen, rejected"):
        objective_dataset(FinetuneConfig(objective="dpo", dataset=(str(rows),)))
    mapped = objective_dataset(FinetuneConfig(
        objective="dpo", dataset=(f"{rows},column.prompt=question,column.chosen=good,column.rejected=bad",)))
    assert mapped[0] == {"prompt": "q", "chosen": "a", "rejected": "b"}


def test_pairs_prefer_the_answer_to_the_question():
    conversations = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
                     for i in range(10)]
    pairs = preference_pairs(conversations)
    assert pairs[0] == {"prompt": "q0\n", "chosen": "a0", "rejected": "a7"}
