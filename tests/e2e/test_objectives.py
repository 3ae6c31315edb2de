"""`hfdist finetune --objective grpo` end to end on the embedded task (the arithmetic prompts and their rewards): one
process, 40 steps on the tiny Llama, as a user runs it; the mean reward rises, each step reports its reward and its
rollouts (seconds, completion tokens per second), and the rank record totals them. On fsdp_full_shard, generating
on the model gathered once per rollout (--rollout-gather once) samples the same completions as gathering each layer
per token. A pipeline rung is refused before any process starts, in one paragraph.

That DPO and GRPO are the same math on every rung that takes them is tests/e2e/test_cells.py's (the dpo and grpo
cells, GRPO on fixed completions); the refusals' reasons are tests/unit/test_objective_checks.py's.
"""

from __future__ import annotations

import sys

import pytest

from helpers import FINETUNE, finetune, finetune_all, run_cmd

pytestmark = pytest.mark.multiproc

# A randomly initialised model learns the format reward (digits only) within tens of steps at this rate; the
# job's default 1e-3 takes longer (docs/objectives.md has both curves).
GRPO_ARGS = ("--objective", "grpo", "--max-steps", "40", "--global-batch-size", "16", "--learning-rate", "1e-2",
             "--save-steps", "0", "--no-wandb")


@pytest.fixture(scope="module")
def grpo(tmp_path_factory) -> dict:
    return finetune(tmp_path_factory.mktemp("grpo") / "out", *GRPO_ARGS)


def test_the_mean_reward_rises(grpo):
    rewards = grpo["objective"]["series"]["reward"]
    assert grpo["objective"]["name"] == "grpo" and len(rewards) == 40
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.2, rewards


def test_every_step_reports_its_rollouts(grpo):
    series = grpo["objective"]["series"]
    assert all(s > 0 for s in series["rollout_seconds"]) and all(t > 0 for t in series["rollout_tokens_per_s"])
    assert all(0 < n <= 16 for n in series["completions/mean_length"])  # --max-completion-length's default
    (rank,) = grpo["ranks"]
    assert rank["rollouts"] == 40 and rank["rollout_tokens"] > 0
    assert rank["rollout_seconds"] == pytest.approx(sum(series["rollout_seconds"]), rel=1e-6)


@pytest.fixture(scope="module")
def gathers(tmp_path_factory) -> dict[str, dict]:
    """GRPO on fsdp_full_shard (2 ranks, 4 steps, sampling): generation with each layer gathered per token, and with
    the model gathered once per rollout."""
    root = tmp_path_factory.mktemp("gathers")
    return finetune_all({g: (root / g, (*GRPO_ARGS, "--config", "fsdp_full_shard", "--max-steps", "4",
                                        "--global-batch-size", "8", "--rollout-gather", g), {})
                         for g in ("layer", "once")})


def test_gathering_the_model_once_per_rollout_samples_the_same_completions(gathers):
    """The same logits, so the same sampled completions (each rank's random stream is the same in both runs): equal
    losses, gradient norms and rewards, whichever way the rollout gathered the weights."""
    layer, once = gathers["layer"], gathers["once"]
    assert layer["objective"]["rollout_gather"] == "layer" and once["objective"]["rollout_gather"] == "once"
    assert once["losses"] == pytest.approx(layer["losses"], rel=1e-6, abs=1e-9)
    assert once["grad_norms"] == pytest.approx(layer["grad_norms"], rel=1e-6)
    assert once["objective"]["series"]["reward"] == layer["objective"]["series"]["reward"]


def test_a_pipeline_rung_is_refused_before_any_process_starts(tmp_path):
    proc = run_cmd([sys.executable, str(FINETUNE), "--objective", "dpo", "--config", "pp", "--model", "llama-tiny",
                    "--output-dir", str(tmp_path / "out")])
    assert proc.returncode == 2 and "--objective dpo does not run on pp: the objective compares whole" in proc.stderr
    assert not (tmp_path / "out").exists()
