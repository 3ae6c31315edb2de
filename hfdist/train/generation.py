"""Sample generations beside the eval loss: a few prompts answered by the model under training at every evaluation,
greedily, up to a token cap, on every rung; rank 0 writes them to OUTPUT_DIR/generations/step-N.jsonl ({prompt,
completion} a line) and hands them to the trackers as a table.

Every rank runs the same steps: the prompts' batch (each row a prompt, then room for the answer) goes through the
strategy's forward, which returns the logits of each row's last token on the rank(s) that hold them (the whole model
on ddp and ZeRO; FSDP2 and ZeRO-3 gathering their shards as in training; outputs made whole over a tp / cp group;
the pipeline's forward-only schedule, the last stage holding them); the greedy choice is broadcast from one of those
ranks, so every rank extends its rows alike and all stop together (at EOS in every row, or the cap). No KV cache: each
step recomputes the rows, which costs little for a few prompts and runs every layout's forward as it trains.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hfdist.errors import HfdistError
from hfdist.models.registry import IGNORE_INDEX

__all__ = ["GenerationError", "Generation", "read_prompt_file", "prompts_from_file", "prompts_from_blocks",
           "job_generation", "greedy_generate", "write_generations"]


class GenerationError(HfdistError, ValueError):
    """An --eval-prompts file hfdist cannot read, or prompts that do not fit."""


@dataclass
class Generation:
    """What the trainer generates at each evaluation: the prompts (token ids, and as text), the token cap, where
    rank 0 writes, and what else gets each step's rows (the trackers' table)."""

    prompts: list[list[int]]
    texts: list[str]
    max_new_tokens: int
    output_dir: str
    record: Callable[[int, list[dict[str, str]]], None] = lambda step, rows: None


def _prompt_messages(row: Any, number: int, path: str) -> list[dict[str, str]]:
    if isinstance(row, str):
        return [{"role": "user", "content": row}]
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    if isinstance(row, dict) and isinstance(row.get("messages"), list):
        return list(row["messages"])
    raise GenerationError(f"--eval-prompts {path}: line {number} is neither a JSON string, an object with a "
                          "'prompt' string, nor one with 'messages' (a conversation ending in the user's turn). Write "
                          'one prompt a line, e.g. {"prompt": "What is the capital of France?"}.')


def read_prompt_file(path: str) -> list[list[dict[str, str]]]:
    """The prompts of a JSON Lines file, each as the conversation to answer: a line is a string or {"prompt": str}
    (one user turn) or {"messages": [...]} (a conversation ending in the user's turn).

    Raises:
        GenerationError: no such file, a line that is no prompt, or no prompt at all.
    """
    file = Path(path)
    if not file.is_file():
        raise GenerationError(f"--eval-prompts {path} is not a file. Pass a JSON Lines file of prompts (one "
                              '{"prompt": "..."} a line), or a number N to answer N held-out rows\' prompts.')
    prompts = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise GenerationError(f"--eval-prompts {path}: line {number} is not JSON ({exc.msg}). Write one prompt "
                                  'a line, e.g. {"prompt": "What is the capital of France?"}.') from None
        prompts.append(_prompt_messages(row, number, path))
    if not prompts:
        raise GenerationError(f"--eval-prompts {path} holds no prompt. Write one prompt a line.")
    return prompts


def prompts_from_file(path: str, tokenizer) -> tuple[list[list[int]], list[str]]:
    """The prompts of a JSON Lines file (`read_prompt_file`), rendered by the tokenizer's chat template with the
    generation prompt, as the model is trained to answer: (token ids, texts)."""
    from hfdist.data.chat import ensure_chat_template

    ensure_chat_template(tokenizer)
    ids = [list(tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)["input_ids"]) for messages in read_prompt_file(path)]
    return ids, [tokenizer.decode(p, skip_special_tokens=True) for p in ids]


def prompts_from_blocks(blocks: Sequence[dict[str, Any]], n: int, tokenizer) -> tuple[list[list[int]], list[str]]:
    """The prompts of the first `n` held-out documents (in block order): each document's tokens before its first
    label, i.e. the conversation up to the first answer, with the generation prompt.

    Raises:
        GenerationError: fewer than `n` documents with an answer.
    """
    ids: list[list[int]] = []
    for block in blocks:
        positions, labels, tokens = (np.asarray(block[k]) for k in ("position_ids", "labels", "input_ids"))
        starts = np.flatnonzero(positions == 0)
        for start, end in zip(starts, np.r_[starts[1:], len(positions)]):
            labelled = np.flatnonzero(labels[start:end] != IGNORE_INDEX)
            if len(labelled):
                ids.append(tokens[start:start + labelled[0]].tolist())
            if len(ids) == n:
                return ids, [tokenizer.decode(p, skip_special_tokens=True) for p in ids]
    raise GenerationError(f"--eval-prompts {n}: the held-out data has {len(ids)} documents with an answer. Ask for "
                          f"at most {len(ids)}, or pass a file of prompts.")


def job_generation(prompts: str, max_new_tokens: int, output_dir: str, tokenizer, eval_blocks,
                   log_table: Callable[[str, list[str], list[list[Any]], int], None]) -> Generation:
    """The job's Generation: --eval-prompts (a file, or N held-out documents' prompts), its token cap, and the
    trackers' table (`log_table`, hfdist.callbacks.trackers.Trackers.log_table) fed each evaluation's rows."""
    ids, texts = (prompts_from_blocks(eval_blocks, int(prompts), tokenizer) if prompts.isdigit()
                  else prompts_from_file(prompts, tokenizer))

    def record(step: int, rows: list[dict[str, str]]) -> None:
        log_table("generations", ["step", "prompt", "completion"],
                  [[step, r["prompt"], r["completion"]] for r in rows], step)

    return Generation(ids, texts, max_new_tokens, output_dir, record)


def _rows(prompts: list[list[int]], multiple: int, length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch every step extends: each prompt left-aligned in a row of `length` tokens (rows repeated up to a
    multiple of `multiple`), and its filled length."""
    rows = len(prompts) + (-len(prompts)) % multiple
    ids = torch.full((rows, length), pad_id, dtype=torch.long)
    filled = torch.zeros(rows, dtype=torch.long)
    for r in range(rows):
        prompt = prompts[r % len(prompts)]
        ids[r, :len(prompt)] = torch.tensor(prompt)
        filled[r] = len(prompt)
    return ids, filled


def _positions(filled: torch.Tensor, length: int) -> torch.Tensor:
    """Position ids of the packed layout: 0.. over each row's tokens, then 0 on every padding token (a one-token
    document of its own, so no filled token attends to it)."""
    span = torch.arange(length).expand(len(filled), length)
    return torch.where(span < filled[:, None], span, 0)


@torch.no_grad()
def greedy_generate(last_logits: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor | None],
                    collate: Callable[[list[dict[str, Any]]], dict[str, Any]], prompts: list[list[int]], *,
                    max_new_tokens: int, eos_ids: set[int], pad_id: int, multiple: int = 1, round_to: int = 1,
                    source_rank: int = 0, device: torch.device | str = "cpu") -> list[list[int]]:
    """Each prompt's greedy continuation (EOS included when reached), at most `max_new_tokens` tokens.

    Args:
        last_logits: the strategy's forward: (batch, each row's last filled position) -> (rows, vocab) logits on
            the ranks that hold them, None elsewhere.
        collate: the run's collator (packed rows -> model inputs).
        multiple: the batch's rows are a multiple of this (a pipeline's micro-batches).
        round_to: the rows' length is a multiple of this (the tp x cp degrees that cut the sequence).
        source_rank: the global rank whose choice every rank follows (one holding the logits).
        device: where the process group's backend takes tensors (a rank's GPU under NCCL): the choice is broadcast
            there.
    Collective: every rank calls it alike.
    """
    length = max(map(len, prompts)) + max_new_tokens
    length += (-length) % round_to
    ids, filled = _rows(prompts, multiple, length, pad_id)
    done = torch.zeros(len(ids), dtype=torch.bool)
    stops = torch.tensor(sorted(eos_ids), dtype=torch.long)
    for _ in range(max_new_tokens):
        rows = [{"input_ids": r, "labels": [IGNORE_INDEX] * length, "position_ids": p}
                for r, p in zip(ids.tolist(), _positions(filled, length).tolist())]
        logits = last_logits(collate(rows), filled - 1)
        chosen = logits.float().argmax(-1) if logits is not None else torch.zeros(len(ids), dtype=torch.long)
        if dist.is_available() and dist.is_initialized():
            chosen = chosen.to(device)
            dist.broadcast(chosen, src=source_rank)
        chosen = chosen.cpu()
        live = (~done).nonzero().flatten()
        ids[live, filled[live]] = chosen[live]
        filled[live] += 1
        done[live] = torch.isin(chosen[live], stops)
        if bool(done.all()):
            break
    return [ids[r, len(p):int(filled[r])].tolist() for r, p in enumerate(prompts)]


def write_generations(generation: Generation, step: int, completions: list[list[int]], tokenizer) -> None:
    """Rank 0: OUTPUT_DIR/generations/step-N.jsonl, and the rows to `generation.record`."""
    rows = [{"prompt": text, "completion": tokenizer.decode(c, skip_special_tokens=True)}
            for text, c in zip(generation.texts, completions)]
    folder = Path(generation.output_dir) / "generations"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"step-{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    generation.record(step, rows)
