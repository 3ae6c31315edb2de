"""Dataset formats, detected from the column names, and each row read into one of three sample kinds.

    messages                      [{"role": "system"|"user"|"assistant", "content": str}, ...]   -> Conversation
    conversations (ShareGPT)      [{"from": "system"|"human"|"gpt", "value": str}, ...]          -> Conversation
    prompt / completion           two strings -> PromptCompletion; two message lists -> Conversation (loss on the
                                  completion's assistant turns only, as the format means)
    instruction / input / output  (Alpaca) one exchange; a non-empty `input` follows the instruction after a blank line
    instruction / output, instruction / response, question / answer   one exchange -> Conversation
    text                          -> Text (loss on every token)

Pair formats take an optional `system` column as the system turn. Rows whose required fields are empty are skipped
(and counted); rows that are malformed (an unknown role, turns that do not alternate, no assistant turn) raise a
DataError naming the row, since training on them would silently teach the wrong thing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from hfdist.errors import DataError

__all__ = ["Conversation", "PromptCompletion", "Text", "Sample", "Format", "FORMATS", "detect_format",
           "read_conversation"]

# Role names as datasets spell them -> the chat-template role. ShareGPT's human/gpt are accepted in both formats.
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}


@dataclass(frozen=True)
class Conversation:
    """A validated conversation: an optional system turn, then user and assistant turns in turn, starting with
    user and ending with assistant. Assistant turns at index >= `trained_from` carry the loss."""

    messages: tuple[dict[str, str], ...]
    trained_from: int = 0

    @property
    def system(self) -> tuple[dict[str, str], ...]:
        """The system turn (empty tuple if none)."""
        return self.messages[:1] if self.messages[0]["role"] == "system" else ()

    def exchanges(self) -> list[tuple[dict[str, str], ...]]:
        """The (user, assistant) pairs after the system turn: the units a long conversation is split between.
        A conversation whose prompt is fixed context (prompt/completion) is one unit."""
        body = self.messages[len(self.system):]
        if self.trained_from > len(self.system):
            return [tuple(body)]
        return [tuple(body[i:i + 2]) for i in range(0, len(body), 2)]


@dataclass(frozen=True)
class PromptCompletion:
    """Raw text: the prompt (no loss) followed directly by the completion (loss), no chat template."""

    prompt: str
    completion: str


@dataclass(frozen=True)
class Text:
    """Plain text: loss on every token."""

    text: str


Sample = Union[Conversation, PromptCompletion, Text]


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip()) or (
        isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 0)


def _content(value: Any, row: int, index: int) -> str:
    """A message's content as text: a string, or a list of text parts (the multimodal layout, text only)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text") or "") for p in value)
    raise DataError(f"Row {row} of the dataset: message {index} has content of type {type(value).__name__}; "
                    "hfdist trains on text messages (a string, or a list of {'type': 'text', 'text': ...} parts). "
                    "Convert or drop such rows (datasets' map / filter) before training.")


def read_conversation(turns: Any, row: int, role_key: str = "role", content_key: str = "content",
                      trained_from: int = 0) -> Conversation:
    """Validate a list of turns into a Conversation; a trailing user turn without an answer is left out.

    Raises:
        DataError: an unknown role, a system turn after the first, turns that do not alternate user/assistant,
            or no assistant turn, naming `row` (the dataset row, counting from 0).
    """
    if not isinstance(turns, Sequence) or isinstance(turns, str):
        raise DataError(f"Row {row} of the dataset: expected a list of messages, got {type(turns).__name__}.")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or role_key not in turn:
            raise DataError(f"Row {row} of the dataset: message {i} is not a mapping with a '{role_key}' key "
                            f"({turn!r:.80}). Each message needs '{role_key}' and '{content_key}'.")
        role = ROLES.get(str(turn[role_key]).lower())
        if role is None:
            raise DataError(f"Row {row} of the dataset: message {i} has the role '{turn[role_key]}', which hfdist "
                            f"does not know (it trains on {', '.join(ROLES)} turns). Map that role to one of these "
                            "or drop such rows (datasets' map / filter) before training.")
        messages.append({"role": role, "content": _content(turn.get(content_key), row, i)})
    while messages and messages[-1]["role"] == "user":
        messages.pop()  # an unanswered question teaches nothing
    roles = [m["role"] for m in messages]
    start = 1 if roles[:1] == ["system"] else 0
    expected = ["user" if i % 2 == 0 else "assistant" for i in range(len(roles) - start)]
    if roles[start:] != expected:
        raise DataError(f"Row {row} of the dataset: the conversation's roles are {roles}, which do not alternate "
                        "user/assistant: hfdist needs an optional system turn, then user and assistant turns in "
                        "turn starting with user. Merge consecutive turns of one role, or drop the row.")
    if "assistant" not in roles[trained_from:]:
        where = "its completion has" if trained_from else "it has"
        raise DataError(f"Row {row} of the dataset: {where} no assistant turn, so nothing in it can be trained "
                        f"(roles {roles or [str(t.get(role_key)) for t in turns]}). Add the answer or drop the row.")
    return Conversation(tuple(messages), trained_from)


def _exchange(system: Any, user: str, assistant: Any, row: int) -> Conversation:
    messages = ([{"role": "system", "content": str(system)}] if not _blank(system) else []) + [
        {"role": "user", "content": user}, {"role": "assistant", "content": str(assistant)}]
    return read_conversation(messages, row)


def _prompt_completion(r: Mapping[str, Any], row: int) -> Sample | None:
    prompt, completion = r["prompt"], r["completion"]
    if _blank(prompt) or _blank(completion):
        return None
    if isinstance(prompt, str) and isinstance(completion, str):
        return PromptCompletion(prompt, completion)
    if isinstance(prompt, str) or isinstance(completion, str):
        raise DataError(f"Row {row} of the dataset: prompt and completion must both be strings or both be message "
                        f"lists, got {type(prompt).__name__} and {type(completion).__name__}.")
    prompt_turns = list(prompt)
    return read_conversation(prompt_turns + list(completion), row, trained_from=len(prompt_turns))


def _alpaca(r: Mapping[str, Any], row: int) -> Sample | None:
    if _blank(r["instruction"]) or _blank(r["output"]):
        return None
    extra = r.get("input")
    user = str(r["instruction"]) if _blank(extra) else f"{r['instruction']}\n\n{extra}"
    return _exchange(r.get("system"), user, r["output"], row)


def _pair(question: str, answer: str) -> Callable[[Mapping[str, Any], int], Sample | None]:
    def read(r: Mapping[str, Any], row: int) -> Sample | None:
        if _blank(r[question]) or _blank(r[answer]):
            return None
        return _exchange(r.get("system"), str(r[question]), r[answer], row)
    return read


def _turns(role_key: str, content_key: str, column: str) -> Callable[[Mapping[str, Any], int], Sample | None]:
    def read(r: Mapping[str, Any], row: int) -> Sample | None:
        return None if _blank(r[column]) else read_conversation(r[column], row, role_key, content_key)
    return read


@dataclass(frozen=True)
class Format:
    """A dataset format: the columns that identify it and how one row becomes a sample (None: an empty row)."""

    name: str
    columns: tuple[str, ...]
    read: Callable[[Mapping[str, Any], int], Sample | None]
    optional: tuple[str, ...] = ()


# In order of precedence: the first whose columns are all present wins.
FORMATS: tuple[Format, ...] = (
    Format("messages", ("messages",), _turns("role", "content", "messages")),
    Format("conversations", ("conversations",), _turns("from", "value", "conversations")),
    Format("prompt/completion", ("prompt", "completion"), _prompt_completion),
    Format("instruction/input/output", ("instruction", "input", "output"), _alpaca, ("system",)),
    Format("instruction/output", ("instruction", "output"), _alpaca, ("system",)),
    Format("instruction/response", ("instruction", "response"), _pair("instruction", "response"), ("system",)),
    Format("question/answer", ("question", "answer"), _pair("question", "answer"), ("system",)),
    Format("text", ("text",), lambda r, row: None if _blank(r["text"]) else Text(str(r["text"]))),
)


def detect_format(column_names: Sequence[str]) -> Format:
    """The format of a dataset with these columns.

    Raises:
        DataError: no supported column set, naming the columns found and the ones hfdist reads.
    """
    for fmt in FORMATS:
        if all(c in column_names for c in fmt.columns):
            return fmt
    raise DataError(
        f"The dataset has columns {sorted(column_names)}, but hfdist reads one of these column sets: "
        f"{', '.join(f.name for f in FORMATS)} (the first match wins; a 'system' column adds a system turn to the "
        "pair formats). Rename the columns (datasets' rename_column) or pass another dataset."
    )
