"""Sample generations (hfdist.train.generation) in one process: the greedy loop over packed rows gives transformers'
own `generate` on prompts of several lengths, stopping per row at EOS; prompts from a file and from held-out blocks.
(Every rung's generations against the saved model's: tests/e2e/test_mixture_generation.py.)"""

from __future__ import annotations

import pytest
import torch

from hfdist.data import collate, load_tokenizer
from hfdist.train.generation import GenerationError, greedy_generate, prompts_from_blocks, prompts_from_file


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None, is_preset=True)


def test_the_greedy_loop_is_generate_row_by_row(tok, tmp_path):
    """A model near its initialisation (varied tokens) answers three prompts of different lengths, batched as packed
    rows with room to grow (the last rows repeated to a multiple of 4, the length rounded to 8), as generate answers
    each alone; the row that meets EOS stops there and the others go on."""
    from hfdist.models.build import build_model

    model = build_model("llama-tiny", vocab_size=len(tok), seed=3).eval()
    path = tmp_path / "prompts.jsonl"
    path.write_text('"Add 3 and 4."\n{"prompt": "Reverse the word: apple"}\n\n'
                    '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]}\n')
    prompts, texts = prompts_from_file(str(path), tok)
    assert len(prompts) == 3 and texts[2].startswith("### System:\nBe brief.") and texts[0].endswith("Assistant:\n")

    def last_logits(batch, positions):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return model(**inputs).logits[torch.arange(len(positions)), positions]

    def generate(prompt, eos):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=eos,
                             pad_token_id=0)
        return out[0, len(prompt):].tolist()

    with torch.no_grad():
        free = [generate(p, None) for p in prompts]  # no stop: each answer's 10 tokens
        # A token an answer makes first after its first place: EOS for the next run, so that row stops there.
        row, at, eos = next((r, i, t) for r, f in enumerate(free) for i, t in enumerate(f) if i and t not in f[:i])
        expected = [generate(p, eos) for p in prompts]
        got = greedy_generate(last_logits, collate, prompts, max_new_tokens=10, eos_ids={eos}, pad_id=0, multiple=4,
                              round_to=8)
    assert got == expected and len(got[row]) == at + 1 and got[row][-1] == eos
    assert len({tuple(f) for f in free}) == 3 and all(len(set(f)) > 1 for f in free)  # varied answers


def test_held_out_prompts_are_the_documents_up_to_their_first_answer(tok):
    from hfdist.data import load_raw_dataset, prepare

    blocks = prepare(load_raw_dataset(None), tok, 128)
    prompts, texts = prompts_from_blocks(blocks, 5, tok)
    assert len(prompts) == 5 and all(t.rstrip().endswith("### Assistant:") for t in texts)
    assert all(p[0] == tok.bos_token_id for p in prompts)  # each a whole document's beginning
    with pytest.raises(GenerationError, match="--eval-prompts 5: the held-out data has 4 documents"):
        prompts_from_blocks(blocks.select(range(4)), 5, tok)  # best-fit: one long document a block first


@pytest.mark.parametrize("text, said", [
    ("", "holds no prompt"),
    ('{"question": "x"}\n', "line 1 is neither a JSON string"),
    ('{"prompt": "x"}\nnot json\n', "line 2 is not JSON"),
])
def test_bad_prompt_files_are_refused_by_line(tmp_path, tok, text, said):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(GenerationError) as err:
        prompts_from_file(str(path), tok)
    assert said in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(GenerationError, match="is not a file"):
        prompts_from_file(str(tmp_path / "missing.jsonl"), tok)
