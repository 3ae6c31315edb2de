"""Which documents each side trains or evaluates on: held-out rows per source, then the training mixture drawn from
the rest, by weight or by epochs, deterministically from the seed. Pure numpy on the documents' metadata.

- held out: `eval_fraction` of a source's rows (whole rows, so a conversation split into several documents stays on
  one side), drawn by the seed (`held_out_rows`; source i > 0 draws with (seed, i)); an eval-only source (the job's
  --eval-dataset) is held out whole.
- weights (every source has one): the source's share of the training label tokens. The mixture is as large as the
  sources allow without repeating a row: with A_s label tokens available and w_s the normalised weight, it holds
  T = min_s A_s / w_s tokens, and source s contributes the shortest prefix of a seeded permutation of its rows that
  reaches w_s T (the source that sets T gives every row). Shares then miss the weights by at most one row's tokens.
- epochs (the default, 1): a source's rows taken floor(e) times over, plus a seeded (e - floor(e)) share of them.
The training documents come out source by source, copy by copy, each copy's rows in their order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["SourceDraw", "Drawn", "held_out_rows", "draw"]


@dataclass(frozen=True)
class SourceDraw:
    """How one source is drawn: `weight` (a share of the training label tokens) or `epochs` (default 1; None
    when a weight is given), `eval_fraction` of its rows held out, `eval_only` (every row held out)."""

    weight: float | None = None
    epochs: float | None = None
    eval_fraction: float | None = None
    eval_only: bool = False


@dataclass(frozen=True)
class Drawn:
    """The documents of each side, as indices into the documents (with repeats under epochs > 1), and the rows
    each source gives each side (counting repeats)."""

    train: np.ndarray
    eval: np.ndarray
    train_rows: list[int]
    eval_rows: list[int]


def held_out_rows(rows: int, fraction: float, seed: int | Sequence[int]) -> np.ndarray:
    """Which of `rows` rows are held out for evaluation: round(fraction x rows) of them (at least one), drawn by
    `seed` (the same rows on every rank and in every run with the same seed)."""
    chosen = np.random.default_rng(seed).permutation(rows)[:max(1, round(fraction * rows))]
    held = np.zeros(rows, dtype=bool)
    held[chosen] = True
    return held


def _seed(seed: int, index: int, *tag: int) -> int | list[int]:
    """Source 0 draws its held-out rows with the seed itself (as a job of one source always has)."""
    return seed if index == 0 and not tag else [seed, index, *tag]


def _weighted_rows(candidates: np.ndarray, tokens: np.ndarray, target: float, rng) -> np.ndarray:
    """The rows of the shortest prefix of a seeded permutation of `candidates` (a mask over rows) whose label tokens
    reach `target` (all of them when the target is their total), as a mask."""
    order = rng.permutation(np.flatnonzero(candidates))
    reached = np.cumsum(tokens[order])
    chosen = np.zeros(len(candidates), bool)
    chosen[order[:min(int(np.searchsorted(reached, target - 0.5)) + 1, len(order))]] = True
    return chosen


def _part(candidates: np.ndarray, share: float, rng) -> np.ndarray:
    """A seeded `share` of the rows `candidates` (a mask) holds, as a mask."""
    rows = np.flatnonzero(candidates)
    chosen = np.zeros(len(candidates), bool)
    chosen[rng.permutation(rows)[:round(share * len(rows))]] = True
    return chosen


def draw(doc_rows: Sequence[np.ndarray], doc_labels: Sequence[np.ndarray], rows: Sequence[int],
         specs: Sequence[SourceDraw], seed: int) -> Drawn:
    """The documents of each side (module docstring).

    Args:
        doc_rows, doc_labels: per source, each document's row and label tokens (documents in row order).
        rows: per source, its row count.
        specs: per source, how it is drawn.
        seed: the job's seed.
    """
    first = np.cumsum([0] + [len(r) for r in doc_rows])
    index = np.int32 if first[-1] < 2 ** 31 else np.int64  # 4 bytes a document where they suffice
    held = [np.ones(n, bool) if spec.eval_only else held_out_rows(n, spec.eval_fraction, _seed(seed, s))
            if spec.eval_fraction and n else np.zeros(n, bool) for s, (spec, n) in enumerate(zip(specs, rows))]
    trained = [s for s, spec in enumerate(specs) if not spec.eval_only]
    weights = {s: specs[s].weight for s in trained if specs[s].weight is not None}
    tokens = {s: np.bincount(doc_rows[s], weights=doc_labels[s], minlength=rows[s]) for s in weights}
    if weights:
        share = {s: w / sum(weights.values()) for s, w in weights.items()}
        total = min(tokens[s][~held[s]].sum() / share[s] for s in trained)
    train_parts, eval_parts, train_rows, eval_rows = [], [], [], []
    for s, spec in enumerate(specs):
        docs = np.arange(first[s], first[s + 1], dtype=index)
        eval_parts.append(docs[held[s][doc_rows[s]]])
        eval_rows.append(int(held[s].sum()))
        if spec.eval_only:
            train_rows.append(0)
            continue
        candidates = ~held[s]
        if weights:
            copies = [_weighted_rows(candidates, tokens[s], share[s] * total, np.random.default_rng(_seed(seed, s, 1)))]
        else:
            epochs = spec.epochs or 1.0
            copies = [candidates] * int(epochs)
            if epochs % 1:
                copies.append(_part(candidates, epochs % 1, np.random.default_rng(_seed(seed, s, 2))))
        train_parts += [docs[chosen[doc_rows[s]]] for chosen in copies]
        train_rows.append(sum(int(c.sum()) for c in copies))
    return Drawn(train=np.concatenate(train_parts) if train_parts else np.zeros(0, index),
                 eval=np.concatenate(eval_parts) if eval_parts else np.zeros(0, index),
                 train_rows=train_rows, eval_rows=eval_rows)
