"""What a DPO or GRPO job refuses before any process starts, each with its reason and fix."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from hfdist.config.finetune import ConfigError, holds_out

if TYPE_CHECKING:
    from hfdist.config.finetune import FinetuneConfig
    from hfdist.config.ladder import Rung

__all__ = ["check_objective"]


def check_objective(cfg: FinetuneConfig, rung: Rung) -> None:
    """Refuse, naming why and the fix, an objective the rung or the other settings cannot train; resolve the reward
    functions and the rows (their columns) so a typo fails here, not in every rank.

    Raises:
        ConfigError: the combination; RewardError / DataError: a reward path or a dataset that cannot be used.
    """
    if cfg.rollout_gather == "once" and not (cfg.objective == "grpo" and rung.owns_sharding and rung.fsdp is not None):
        raise ConfigError(f"--rollout-gather once gathers an FSDP2-sharded model once per GRPO rollout; {rung.name} "
                          f"with --objective {cfg.objective} has no such rollout. Drop it, or use --objective grpo on "
                          "fsdp_full_shard or fsdp_hybrid.")
    if cfg.objective == "sft":
        if cfg.reward_funcs or cfg.beta is not None:
            raise ConfigError("--reward-funcs and --beta belong to --objective grpo / dpo; this job trains sft. Add "
                              "--objective grpo (or dpo), or drop them.")
        return
    what = f"--objective {cfg.objective}"
    if importlib.util.find_spec("trl") is None:
        raise ConfigError(f"{what} trains on TRL's trainer, and trl is not installed: pip install 'trl>=1.16,<1.17'.")
    from hfdist.config.features import refuse_unless

    refuse_unless(rung, cfg.objective)  # the rung table's verdict: pipeline and cp rungs, layouts not yet verified
    refused = {"--qlora": cfg.qlora, "--fp8": cfg.fp8 is not None, "--compile": cfg.compile,
               "held-out evaluation": holds_out(cfg) or cfg.eval_prompts is not None or cfg.load_best,
               "--prepared-data": cfg.prepared_data is not None}
    for name, asked in refused.items():
        if asked:
            raise ConfigError(f"{what} does not take {name} yet: hfdist has not run that combination, so it refuses it "
                              "rather than train something unchecked. Drop it, or train --objective sft.")
    if cfg.objective == "grpo":
        if cfg.global_batch_size % cfg.num_generations:
            raise ConfigError(f"--global-batch-size {cfg.global_batch_size} (completions per step) is not a multiple of "
                              f"--num-generations {cfg.num_generations}: each prompt's completions form one group. "
                              f"Use --global-batch-size {cfg.num_generations * max(1, cfg.global_batch_size // cfg.num_generations)}.")
        if cfg.beta:
            raise ConfigError(f"--objective grpo --beta {cfg.beta:g}: a KL term needs a frozen reference model, which TRL "
                              "builds unsharded from the hub id; hfdist does not shard GRPO's reference yet. Train "
                              "with --beta 0 (TRL's default), or use --objective dpo for a sharded reference.")
        from hfdist.config.finetune import ARITHMETIC_REWARDS
        from hfdist.objectives.rewards import load_reward_funcs

        load_reward_funcs(cfg.reward_funcs or ARITHMETIC_REWARDS)
    elif cfg.reward_funcs:
        raise ConfigError("--reward-funcs scores GRPO's completions; DPO learns from the chosen / rejected pairs. "
                          "Drop --reward-funcs, or use --objective grpo.")
    from hfdist.objectives.data import objective_dataset

    objective_dataset(cfg)
