"""What the job trains besides next-token SFT: preference optimisation (DPO) and online RL (GRPO), each on TRL's own
trainer through hfdist.api (strategy_trainer + prepare_model), so no loss is written twice.

- data: the rows each objective reads (prompt / chosen / rejected; prompt), the embedded defaults, their checks;
- arithmetic: the embedded GRPO task (sums to answer) and its verifiable rewards;
- rewards: reward functions named by import path (--reward-funcs);
- trainer: the TRL trainer and its config for an objective, with the rollout figures (seconds, tokens/s) per rank.
"""
