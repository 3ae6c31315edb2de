"""The TRL trainer and its config for a DPO or GRPO job, and what each step of it reports.

The job builds every objective the same way (hfdist.job.run): `strategy_trainer(objective_trainer_class(...),
strategy)` on a model from prepare_model, so the strategy's sharding, verification, clipping, checkpoints and per-rank
metrics are the SFT job's; only the loss, the data and (GRPO) the rollouts are TRL's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hfdist.config.finetune import FinetuneConfig

__all__ = ["SERIES", "objective_trainer_class", "objective_arguments", "objective_inputs", "RolloutFiguresMixin",
           "FixedCompletionsMixin", "WholeModelRolloutMixin"]

# What the summary keeps per step of each objective, besides the loss and the gradient norm: TRL's own logs, and the
# rollout figures RolloutFiguresMixin adds.
SERIES: dict[str, tuple[str, ...]] = {
    "sft": (),
    "dpo": ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"),
    "grpo": ("reward", "reward_std", "kl", "completions/mean_length", "rollout_seconds", "rollout_tokens_per_s"),
}
DPO_BETA, GRPO_BETA = 0.1, 0.0  # TRL's defaults, written where --beta documents them


class RolloutFiguresMixin:
    """GRPO's rollouts timed on this rank: each generation-and-scoring of a batch of prompts (TRL's
    `_generate_and_score_completions`: sampling, the reward functions, the reference's log-probabilities), its
    completion tokens, and their rate, logged with the step's loss (rollout_seconds, rollout_tokens_per_s) and
    totalled for the summary's rank record."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rollout_totals = {"seconds": 0.0, "tokens": 0, "rollouts": 0}
        self._since_log = {"seconds": 0.0, "tokens": 0}

    def _generate_and_score_completions(self, inputs):
        start = time.perf_counter()
        output = super()._generate_and_score_completions(inputs)
        seconds, tokens = time.perf_counter() - start, int(output["completion_mask"].sum())
        for totals in (self.rollout_totals, self._since_log):
            totals["seconds"] += seconds
            totals["tokens"] += tokens
        self.rollout_totals["rollouts"] += 1
        return output

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self._since_log["seconds"] > 0:
            seconds = self._since_log["seconds"]
            logs = {**logs, "rollout_seconds": seconds, "rollout_tokens_per_s": self._since_log["tokens"] / seconds}
            self._since_log = {"seconds": 0.0, "tokens": 0}
        super().log(logs, *args, **kwargs)

    def rollout_record(self) -> dict[str, Any]:
        """This rank's rollouts over the run: their count, seconds, completion tokens and tokens per second."""
        t = self.rollout_totals
        return {"rollouts": t["rollouts"], "rollout_seconds": t["seconds"], "rollout_tokens": t["tokens"],
                "rollout_tokens_per_s": t["tokens"] / t["seconds"] if t["seconds"] else None}


def objective_trainer_class(objective: str, whole_model_rollouts: bool = False) -> type:
    """TRL's trainer for `objective` ("dpo", "grpo"), GRPO's with its rollouts timed (RolloutFiguresMixin) and, with
    `whole_model_rollouts`, generating on the model gathered once (WholeModelRolloutMixin)."""
    if objective == "dpo":
        from trl import DPOTrainer

        return DPOTrainer
    import os

    from trl import GRPOTrainer

    from hfdist.train.injected_faults import FIXED_COMPLETIONS_ENV

    fixed = (FixedCompletionsMixin,) if os.environ.get(FIXED_COMPLETIONS_ENV) else ()
    whole = (WholeModelRolloutMixin,) if whole_model_rollouts else ()
    return type("GRPOTrainer", (*fixed, *whole, RolloutFiguresMixin, GRPOTrainer),
                {"__module__": GRPOTrainer.__module__})


def objective_arguments(cfg: FinetuneConfig) -> tuple[type, dict[str, Any]]:
    """(TRL's config class, the keywords the objective adds to the job's training arguments)."""
    if cfg.objective == "dpo":
        from trl import DPOConfig

        return DPOConfig, {"beta": DPO_BETA if cfg.beta is None else cfg.beta, "max_length": cfg.seq_len}
    from trl import GRPOConfig

    return GRPOConfig, {"beta": GRPO_BETA if cfg.beta is None else cfg.beta, "num_generations": cfg.num_generations,
                        "max_completion_length": cfg.max_completion_length, "log_completions": False}


def objective_inputs(cfg: FinetuneConfig, strategy, tokenizer, attention: str) -> dict[str, Any]:
    """What the objective's trainer takes beyond the job's common arguments: GRPO's reward functions; DPO's frozen
    reference model, prepared like the policy (sharded the same way; under LoRA none: the reference adapter
    prepare_model added scores it)."""
    if cfg.objective == "grpo":
        from hfdist.config.finetune import ARITHMETIC_REWARDS
        from hfdist.objectives.rewards import load_reward_funcs

        return {"reward_funcs": load_reward_funcs(cfg.reward_funcs or ARITHMETIC_REWARDS)}
    if cfg.lora:
        return {}
    from hfdist.api import prepare_model

    return {"ref_model": prepare_model(strategy, cfg.model, tokenizer=tokenizer, seed=cfg.seed, trainable=False,
                                       attn_implementation=attention)}


class WholeModelRolloutMixin:
    """--rollout-gather once (hfdist.config.finetune): on a rung whose FSDP2 shards the model, each rollout's
    `generate` runs on the model all-gathered once (hfdist.parallel.fsdp.gathered_whole) instead of gathering every
    layer for every generated token; the whole model is held on each rank meanwhile."""

    def _generate_single_turn(self, *args, **kwargs):
        from hfdist.parallel.fsdp import gathered_whole

        with gathered_whole(self.model, self.rung.fsdp.reshard_after_forward):
            return super()._generate_single_turn(*args, **kwargs)


class FixedCompletionsMixin:
    """Tests only (HFDIST_INJECT_FIXED_COMPLETIONS, hfdist.train.injected_faults): rollouts return fixed completions
    in place of sampling. A row's place among its prompt's copies is global: TRL's sampler repeats each prompt
    num_generations times in a row, and each data-parallel rank reads a contiguous slice of the step's rows."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        from hfdist.train.injected_faults import fixed_completion

        dp_rank = self.args.process_index // self.rung.dims.ranks_per_batch
        first = dp_rank * len(prompt_ids)
        special = set(self.processing_class.all_special_ids)
        low = max(special) + 1 if special and max(special) < 1000 else 0  # ordinary tokens only
        vocab = range(low, len(self.processing_class))
        completions = [fixed_completion(ids, self.state.global_step, (first + i) % num_generations, vocab,
                                        self.max_completion_length) for i, ids in enumerate(prompt_ids)]
        return completions, None
