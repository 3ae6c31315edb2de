"""The embedded default data: synthetic conversations and a BPE tokenizer trained on their text.

Nothing can be downloaded at run time, so hfdist ships its own small chat dataset (hfdist/assets/) made by this
module: `messages` rows of an optional system turn and one to three user/assistant exchanges, the format most instruction
datasets and every chat template use, so a default run exercises the whole data path (chat template, loss on every
assistant turn, packing that keeps conversations apart). The tasks are deterministic functions of the question
(reverse, add, sort, capitals, ...), so a small Llama learns them quickly and the loss visibly falls. Regenerate
with `python scripts/make_default_assets.py`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from hfdist.models.presets import EMBEDDED_VOCAB_SIZE

__all__ = ["ASSETS_DIR", "DATA_FILE", "TOKENIZER_DIR", "SYSTEM_PROMPTS", "generate_examples", "generate_conversations",
           "train_tokenizer", "write_assets"]

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
DATA_FILE = ASSETS_DIR / "conversations.jsonl"
TOKENIZER_DIR = ASSETS_DIR / "tokenizer"

_WORDS = (
    "apple river stone cloud garden window yellow silver forest ocean mountain bridge candle pencil rabbit "
    "tiger summer winter autumn spring music letter orange purple basket butter castle dragon engine feather "
    "guitar harbor island jacket kettle ladder marble needle planet rocket saddle tunnel valley wagon zebra "
    "anchor bottle cotton desert falcon glacier hammer insect jungle lemon meadow nectar pepper quartz ribbon "
    "shadow thunder velvet walnut"
).split()

_CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Canada": "Ottawa", "Mexico": "Mexico City",
    "Brazil": "Brasilia", "Argentina": "Buenos Aires", "Egypt": "Cairo", "Kenya": "Nairobi", "Norway": "Oslo",
    "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw", "Greece": "Athens", "Turkey": "Ankara",
    "Russia": "Moscow", "Australia": "Canberra", "Chile": "Santiago", "Peru": "Lima", "Ireland": "Dublin",
    "Austria": "Vienna", "Hungary": "Budapest", "Denmark": "Copenhagen", "Belgium": "Brussels",
    "Netherlands": "Amsterdam", "Thailand": "Bangkok", "Vietnam": "Hanoi", "Indonesia": "Jakarta",
}


def _example(rng: random.Random) -> dict[str, str]:
    task = rng.randrange(6)
    words = rng.sample(_WORDS, rng.randint(3, 6))
    if task == 0:
        return {"instruction": f"Reverse the order of these words: {' '.join(words)}",
                "response": " ".join(reversed(words))}
    if task == 1:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return {"instruction": f"Add {a} and {b}.", "response": f"{a} + {b} = {a + b}"}
    if task == 2:
        nums = [rng.randint(0, 50) for _ in range(rng.randint(3, 7))]
        return {"instruction": f"Sort these numbers from smallest to largest: {' '.join(map(str, nums))}",
                "response": " ".join(map(str, sorted(nums)))}
    if task == 3:
        country = rng.choice(sorted(_CAPITALS))
        return {"instruction": f"What is the capital of {country}?",
                "response": f"The capital of {country} is {_CAPITALS[country]}."}
    if task == 4:
        word = words[0]
        return {"instruction": f"Spell the word {word} backwards.", "response": word[::-1]}
    return {"instruction": f"Write these words in upper case: {' '.join(words)}",
            "response": " ".join(w.upper() for w in words)}


def generate_examples(n: int = 4000, seed: int = 1234) -> list[dict[str, str]]:
    """`n` instruction/response pairs, identical for the same seed."""
    rng = random.Random(seed)
    return [_example(rng) for _ in range(n)]


SYSTEM_PROMPTS = ("You are a helpful assistant.", "Answer briefly and exactly.", "Follow each instruction precisely.")


def generate_conversations(n_examples: int = 4000, seed: int = 1234) -> list[dict[str, list[dict[str, str]]]]:
    """The `n_examples` instruction/response pairs of `generate_examples`, in order, grouped into conversations of
    one to three exchanges, half of them opened by a system turn; identical for the same seed."""
    examples = generate_examples(n_examples, seed)
    rng = random.Random(seed + 1)
    conversations, i = [], 0
    while i < len(examples):
        exchanges = examples[i:i + rng.randint(1, 3)]
        i += len(exchanges)
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.5 else None
        messages = [{"role": "system", "content": system}] if system else []
        for e in exchanges:
            messages += [{"role": "user", "content": e["instruction"]}, {"role": "assistant", "content": e["response"]}]
        conversations.append({"messages": messages})
    return conversations


def train_tokenizer(texts: list[str], vocab_size: int = EMBEDDED_VOCAB_SIZE):
    """A byte-level BPE tokenizer (HF fast tokenizer) trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def write_assets(directory: Path = ASSETS_DIR, n: int = 4000, seed: int = 1234,
                 vocab_size: int = EMBEDDED_VOCAB_SIZE) -> None:
    """(Re)write the shipped conversations (JSONL) and the tokenizer into `directory`.

    The tokenizer is trained on the conversations as hfdist's default chat template renders them (the template a
    tokenizer without one gets), so the role headers are a few tokens each; it ships without a template itself.
    """
    from hfdist.data.chat import DEFAULT_CHAT_TEMPLATE

    conversations = generate_conversations(n, seed)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / DATA_FILE.name, "w") as f:
        for conversation in conversations:
            f.write(json.dumps(conversation) + "\n")
    renderer = train_tokenizer([m["content"] for c in conversations for m in c["messages"]], vocab_size)
    renderer.chat_template = DEFAULT_CHAT_TEMPLATE
    rendered = [renderer.apply_chat_template(c["messages"], tokenize=False) for c in conversations]
    train_tokenizer(rendered, vocab_size).save_pretrained(directory / TOKENIZER_DIR.name)
