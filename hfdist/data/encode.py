"""Rows -> documents: each sample tokenized with its labels, and a document longer than the block split, truncated
or refused. This is the function `prepare` maps over the dataset (batched, in parallel, cached by `datasets`).

A document is one conversation (or a piece of one), one prompt/completion or one text, never more. Its labels are
IGNORE_INDEX outside the trained segments and on its first token (nothing inside the document predicts that
token, so a packed block's loss is exactly the sum of its documents' losses).

Longer than --seq-len ("split", the default):
- a conversation is split between exchanges: every piece restates the system turn and starts at a user turn, so
  no answer is trained without its question (earlier exchanges are not repeated);
- one exchange (or a conversational prompt/completion, or a raw prompt/completion) that alone exceeds the block
  keeps its prompt whole and has its answer truncated; if the prompt alone fills the block it is dropped;
- a text is cut into consecutive blocks of --seq-len tokens, each its own document.
With "error", the first such row is refused with its length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hfdist.data.chat import segments
from hfdist.data.formats import FORMATS, Conversation, Sample, Text
from hfdist.errors import DataError
from hfdist.models.registry import IGNORE_INDEX

__all__ = ["LONG_DOCUMENT_POLICIES", "Note", "encode_rows"]

LONG_DOCUMENT_POLICIES = ("split", "error")


class Note:
    """What became of a row, one value per emitted document (rows that yield none emit one empty document)."""

    WHOLE, PIECE, TRUNCATED, EMPTY, DROPPED = range(5)


Doc = tuple[list[int], list[int], int]  # (input_ids, labels, note)


def _has_target(labels: Sequence[int]) -> bool:
    return any(label != IGNORE_INDEX for label in labels[1:])


def _doc(ids: list[int], labels: list[int], note: int) -> Doc:
    return ids, [IGNORE_INDEX] + labels[1:], note


class _Encoder:
    """Tokenizes segments (batched for the common case, one by one for the pieces of long documents)."""

    def __init__(self, tokenizer, seq_len: int, long_documents: str):
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.long_documents = long_documents

    def tokenize(self, segment_lists: list[list[tuple[str, bool]]]) -> list[tuple[list[int], list[int]]]:
        texts = [text for segs in segment_lists for text, _ in segs]
        ids = iter(self.tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
        out = []
        for segs in segment_lists:
            doc_ids: list[int] = []
            labels: list[int] = []
            for _, trained in segs:
                part = list(next(ids))
                doc_ids += part
                labels += part if trained else [IGNORE_INDEX] * len(part)
            out.append((doc_ids, labels))
        return out

    def one(self, sample: Sample, row: int) -> tuple[list[int], list[int]]:
        return self.tokenize([segments(self.tokenizer, sample, row)])[0]

    def truncated(self, ids: list[int], labels: list[int]) -> Doc:
        ids, labels = ids[:self.seq_len], labels[:self.seq_len]
        return _doc(ids, labels, Note.TRUNCATED if _has_target(labels) else Note.DROPPED)

    def split(self, sample: Sample, ids: list[int], labels: list[int], row: int) -> list[Doc]:
        """The documents of a sample longer than the block (see the module docstring)."""
        if self.long_documents == "error":
            raise DataError(f"Row {row} of the dataset is {len(ids)} tokens long, more than --seq-len "
                            f"{self.seq_len}, and --long-documents error forbids splitting it. Raise --seq-len, drop "
                            "the long rows (datasets' filter), or use --long-documents split (the default).")
        if isinstance(sample, Text):
            return [_doc(ids[i:i + self.seq_len], labels[i:i + self.seq_len], Note.PIECE)
                    for i in range(0, len(ids), self.seq_len)]
        if not isinstance(sample, Conversation):
            return [self.truncated(ids, labels)]
        return self._split_conversation(sample, row)

    def _split_conversation(self, conversation: Conversation, row: int) -> list[Doc]:
        def encode(units: list[tuple[dict[str, str], ...]]) -> tuple[list[int], list[int]]:
            messages = conversation.system + tuple(m for unit in units for m in unit)
            return self.one(Conversation(messages, conversation.trained_from), row)

        docs: list[Doc] = []
        piece: list[tuple[dict[str, str], ...]] = []
        encoded: tuple[list[int], list[int]] | None = None
        for unit in conversation.exchanges():
            candidate = encode(piece + [unit])
            if len(candidate[0]) <= self.seq_len:
                piece, encoded = piece + [unit], candidate
                continue
            if encoded is not None:
                docs.append(_doc(*encoded, Note.PIECE))
            alone = encode([unit]) if piece else candidate
            if len(alone[0]) <= self.seq_len:
                piece, encoded = [unit], alone
            else:
                docs.append(self.truncated(*alone))
                piece, encoded = [], None
        if encoded is not None:
            docs.append(_doc(*encoded, Note.PIECE))
        return docs


def encode_rows(batch: dict[str, list[Any]], indices: list[int], *, format_name: str, tokenizer, seq_len: int,
                long_documents: str) -> dict[str, list]:
    """A batch of raw rows -> documents: input_ids, labels, row (the source row) and note (Note.*).

    Raises:
        DataError: a malformed row, or a row longer than `seq_len` under long_documents="error".
    """
    fmt = next(f for f in FORMATS if f.name == format_name)
    columns = [c for c in fmt.columns + fmt.optional if c in batch]
    samples = [fmt.read({c: batch[c][k] for c in columns}, row) for k, row in enumerate(indices)]
    encoder = _Encoder(tokenizer, seq_len, long_documents)
    present = [(row, s) for row, s in zip(indices, samples) if s is not None]
    encoded = iter(encoder.tokenize([segments(tokenizer, s, row) for row, s in present]))
    out: dict[str, list] = {"input_ids": [], "labels": [], "row": [], "note": []}

    def emit(row: int, docs: list[Doc], empty_note: int) -> None:
        docs = [d for d in docs if _has_target(d[1])]
        for ids, labels, note in docs or [([], [], empty_note)]:
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["row"].append(row)
            out["note"].append(note)

    for row, sample in zip(indices, samples):
        if sample is None:
            emit(row, [], Note.EMPTY)
            continue
        ids, labels = next(encoded)
        docs = [_doc(ids, labels, Note.WHOLE)] if len(ids) <= seq_len else encoder.split(sample, ids, labels, row)
        emit(row, docs, Note.DROPPED)
    return out
