"""The embedded GRPO task: a sum to answer ("23+48=") and two verifiable rewards, so `hfdist finetune --objective
grpo` runs on the embedded default as the SFT quick start does.

`digits_only` is a format reward (the share of the completion's characters that are digits) a randomly initialised
model learns within tens of steps; `correct_sum` (1 for the right answer first) is the task itself, which a model
that knows arithmetic scores on. Their sum is the reward TRL's GRPOTrainer maximises.
"""

from __future__ import annotations

import random

__all__ = ["arithmetic_prompts", "digits_only", "correct_sum"]


def arithmetic_prompts(n: int, seed: int = 0, largest: int = 99) -> list[dict[str, str]]:
    """`n` rows {"prompt": "a+b=", "answer": "a+b's value"}, the operands drawn by `seed` from 0..`largest`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, largest), rng.randint(0, largest)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def digits_only(completions: list[str], **_columns) -> list[float]:
    """The share of each completion's characters (spaces left out) that are digits; 0 for an empty completion."""
    rewards = []
    for text in completions:
        chars = "".join(text.split())
        rewards.append(sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0)
    return rewards


def correct_sum(completions: list[str], answer: list[str], **_columns) -> list[float]:
    """1.0 where a completion starts with its row's answer (the digits before anything else), else 0.0."""
    rewards = []
    for text, expected in zip(completions, answer):
        stripped = text.strip()
        digits = len(stripped) - len(stripped.lstrip("0123456789"))
        rewards.append(1.0 if stripped[:digits] == expected else 0.0)
    return rewards
