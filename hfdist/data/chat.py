"""Chat templates: the tokenizer's own, or hfdist's default, and where in a rendered conversation the assistant
turns lie, for any template (no `{% generation %}` markers needed).

A conversation is rendered once whole and, for each trained assistant turn, twice more as a prefix: up to the turn
with the generation prompt (where the answer starts) and through the turn (where it ends). The answer is the text
between the two, without the whitespace the template puts after its end-of-turn marker; it is what the model
generates at inference after the same generation prompt. The text is then cut into segments at those points and
each segment tokenized on its own, so no token straddles a prompt/answer boundary (as at inference, where the
prompt is tokenized alone). A template that renders a conversation's prefix differently from the conversation
itself (some drop earlier turns' reasoning) cannot be split this way and is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from hfdist.data.formats import Conversation, PromptCompletion, Sample, Text
from hfdist.errors import DataError

__all__ = ["DEFAULT_CHAT_TEMPLATE", "DEFAULT_TEMPLATE_NOTE", "ensure_chat_template", "segments"]

# For tokenizers without a chat template (base models, hfdist's embedded tokenizer): plain-text role headers, the
# tokenizer's BOS first and its EOS closing every assistant turn, so a model trained on it learns to stop.
DEFAULT_CHAT_TEMPLATE = (
    "{%- if bos_token %}{{ bos_token }}{% endif %}"
    "{%- for message in messages %}"
    "{{- '### ' ~ (message['role'] | capitalize) ~ ':\\n' ~ message['content'] }}"
    "{%- if message['role'] == 'assistant' and eos_token %}{{ eos_token }}{% endif %}"
    "{{- '\\n\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '### Assistant:\\n' }}{% endif %}"
)
DEFAULT_TEMPLATE_NOTE = ("the tokenizer has no chat template, so conversations use hfdist's default: '### System:', "
                         "'### User:', '### Assistant:' headers, EOS after each answer (docs/data.md)")

Segment = tuple[str, bool]  # (text, whether its tokens carry the loss)


def ensure_chat_template(tokenizer) -> bool:
    """Give `tokenizer` hfdist's default chat template if it has none (saved with it, so the trained model
    carries the template it was trained with). Returns whether the default was set."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return True


def _render(tokenizer, messages: Sequence[dict[str, str]], generation_prompt: bool, row: int) -> str:
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja raises its own types (and templates raise on purpose) for what they refuse
        raise DataError(f"Row {row} of the dataset: the chat template refused the conversation "
                        f"({type(exc).__name__}: {str(exc)[:200]}).") from exc


def _cut(full: str, prefix: str, row: int, what: str) -> int:
    if not full.startswith(prefix):
        raise DataError(
            f"Row {row} of the dataset: the chat template renders the conversation {what} differently from the "
            "whole conversation, so hfdist cannot tell where the assistant turns are (templates that drop earlier "
            "turns' reasoning do this). Set tokenizer.chat_template to a template that renders every turn the same "
            "way wherever it stands, or train on single-exchange conversations.")
    return len(prefix)


def conversation_segments(tokenizer, conversation: Conversation, row: int) -> list[Segment]:
    """The rendered conversation cut into (text, trained) segments; trained ones are the assistant turns at or
    after `conversation.trained_from`, each with the template's end-of-turn marker."""
    messages = conversation.messages
    full = _render(tokenizer, messages, False, row)
    out: list[Segment] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < conversation.trained_from:
            continue
        start = _cut(full, _render(tokenizer, messages[:i], True, row), row, f"up to turn {i}")
        through = full if i + 1 == len(messages) else _render(tokenizer, messages[:i + 1], False, row)
        end = _cut(full, through, row, f"through turn {i}")
        end = start + len(full[start:end].rstrip())  # the template's separator after the turn is prompt again
        if start < cursor or end <= start:
            raise DataError(f"Row {row} of the dataset: the chat template puts assistant turn {i} where hfdist "
                            "cannot isolate it (an empty or overlapping answer span).")
        out += [(full[cursor:start], False), (full[start:end], True)]
        cursor = end
    out.append((full[cursor:], False))
    return [s for s in out if s[0]]


def segments(tokenizer, sample: Sample, row: int) -> list[Segment]:
    """A sample as (text, trained) segments: conversations through the chat template; raw prompt/completion and
    text framed by the tokenizer's BOS and EOS."""
    if isinstance(sample, Conversation):
        return conversation_segments(tokenizer, sample, row)
    bos, eos = tokenizer.bos_token or "", tokenizer.eos_token or ""
    if isinstance(sample, PromptCompletion):
        return [(bos + sample.prompt, False), (sample.completion + eos, True)]
    assert isinstance(sample, Text)
    return [(bos + sample.text + eos, True)]
