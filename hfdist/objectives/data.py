"""The rows a DPO or GRPO job reads: the user's one --dataset (its columns checked before launch), or the embedded
default (preference pairs made from the embedded conversations; the arithmetic task's prompts). TRL's trainers
tokenize these rows themselves, so nothing is packed here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hfdist.errors import DataError

if TYPE_CHECKING:
    import datasets

    from hfdist.config.finetune import FinetuneConfig

__all__ = ["COLUMNS", "objective_dataset", "preference_pairs"]

# The columns each objective reads (TRL's standard, non-conversational form).
COLUMNS = {"dpo": ("prompt", "chosen", "rejected"), "grpo": ("prompt",)}
EMBEDDED_PROMPTS = 2048  # the arithmetic task's rows: more than a default run's prompts, so none repeats
EMBEDDED_PAIRS = 1024  # of the embedded conversations' ~4,000 exchanges: 64 steps of 16 pairs a pass, tokenized in ~1 s


def preference_pairs(conversations: datasets.Dataset, limit: int | None = None) -> list[dict[str, str]]:
    """prompt / chosen / rejected rows from `conversations` (a messages column): each user turn with its answer
    (chosen) and another exchange's answer, seven pairs on (rejected), so the preferred answer is always the one that
    answers the question."""
    exchanges = [(turns[i]["content"], turns[i + 1]["content"]) for row in conversations
                 for turns in [[t for t in row["messages"] if t["role"] != "system"]]
                 for i in range(0, len(turns) - 1, 2) if turns[i]["role"] == "user" and turns[i + 1]["role"] == "assistant"]
    exchanges = exchanges[:limit] if limit is not None else exchanges
    return [{"prompt": question + "\n", "chosen": answer, "rejected": exchanges[(i + 7) % len(exchanges)][1]}
            for i, (question, answer) in enumerate(exchanges)]


def objective_dataset(cfg: FinetuneConfig) -> datasets.Dataset:
    """The training rows of a DPO or GRPO job (`cfg.objective`).

    Raises:
        DataError: more than one --dataset, or rows without the objective's columns (named, with the fix).
    """
    import datasets

    from hfdist.config.sources import parse_source
    from hfdist.data.load import load_raw_dataset
    from hfdist.objectives.arithmetic import arithmetic_prompts

    needed = COLUMNS[cfg.objective]
    if not cfg.dataset:
        if cfg.objective == "dpo":
            return datasets.Dataset.from_list(preference_pairs(load_raw_dataset(None), limit=EMBEDDED_PAIRS))
        return datasets.Dataset.from_list(arithmetic_prompts(EMBEDDED_PROMPTS, seed=cfg.seed))
    if len(cfg.dataset) > 1:
        raise DataError(f"--objective {cfg.objective} trains on one --dataset; {len(cfg.dataset)} were given. Mixtures "
                        "are for SFT's packed blocks: concatenate the rows into one file for this objective.")
    source = parse_source(cfg.dataset[0])
    rows = load_raw_dataset(source.path, split=source.split)
    renames = {column: field for field, column in source.columns if column in rows.column_names and column != field}
    rows = rows.rename_columns(renames) if renames else rows
    missing = [c for c in needed if c not in rows.column_names]
    if missing:
        raise DataError(f"--objective {cfg.objective} reads the columns {', '.join(needed)}; {source.path} has "
                        f"{', '.join(rows.column_names)} (missing {', '.join(missing)}). Rename its columns, or "
                        f"map them with column.FIELD=NAME in the --dataset spec.")
    return rows
