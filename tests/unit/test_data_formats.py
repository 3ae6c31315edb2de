"""Every dataset format through `prepare`: the tokens with a label are exactly the assistant turns (+ the
template's end-of-turn token), prompts keep what they must (system turn, Alpaca's input), and malformed data is
refused with one paragraph naming the row."""

from __future__ import annotations

import json

import pytest

from hfdist.data import DataError, load_raw_dataset, load_tokenizer, prepare

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture()
def tok():
    return load_tokenizer(None, is_preset=True)  # fresh per test: prepare may set the default chat template


def _write(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _documents(packed):
    """[(input_ids, labels)] of every document in the packed rows (a document starts where its position is 0 and
    the next is 1; lone zeros are padding)."""
    docs = []
    for row in packed:
        pos, ids, labels = row["position_ids"], row["input_ids"], row["labels"]
        starts = [i for i in range(len(pos) - 1) if pos[i] == 0 and pos[i + 1] == 1]
        for a in starts:
            b = a + 1
            while b < len(pos) and pos[b] == pos[b - 1] + 1:
                b += 1
            docs.append((ids[a:b], labels[a:b]))
    return docs


def _trained_runs(tok, ids, labels):
    """The decoded runs of consecutive labelled tokens, and the decoded unlabelled text."""
    runs, run, prompt = [], [], []
    for t, label in zip(ids, labels):
        if label == -100:
            prompt.append(t)
            if run:
                runs.append(tok.decode(run))
                run = []
        else:
            assert label == t
            run.append(t)
    if run:
        runs.append(tok.decode(run))
    return runs, tok.decode(prompt)


def _one_document_per_row(tok, path, seq_len=512):
    docs = _documents(prepare(load_raw_dataset(path), tok, seq_len))
    return [_trained_runs(tok, ids, labels) for ids, labels in docs]


CONVERSATION = [("system", "Answer in one line."), ("user", "Add 2 and 3."), ("assistant", "2 + 3 = 5"),
                ("user", "And 4 and 4?"), ("assistant", "4 + 4 = 8")]


@pytest.mark.parametrize("layout", ["messages", "conversations"])
@pytest.mark.parametrize("template", ["default", "chatml"])
def test_labels_are_exactly_every_assistant_turn(tmp_path, tok, layout, template):
    if template == "chatml":
        tok.chat_template = CHATML
    sharegpt = {"system": "system", "user": "human", "assistant": "gpt"}
    turns = [{"role": r, "content": c} if layout == "messages" else {"from": sharegpt[r], "value": c}
             for r, c in CONVERSATION]
    end = tok.eos_token if template == "default" else "<|im_end|>"
    [(runs, prompt)] = _one_document_per_row(tok, _write(tmp_path, [{layout: turns}]))
    assert runs == [f"2 + 3 = 5{end}", f"4 + 4 = 8{end}"]
    assert "Answer in one line." in prompt and "Add 2 and 3." in prompt and "And 4 and 4?" in prompt


def test_alpaca_keeps_input_and_system_in_the_prompt(tmp_path, tok):
    rows = [{"instruction": "Translate to French.", "input": "good morning", "output": "bonjour",
             "system": "You translate."},
            {"instruction": "Say hi.", "input": "", "output": "hi", "system": ""}]
    (runs1, prompt1), (runs2, prompt2) = _one_document_per_row(tok, _write(tmp_path, rows))
    assert runs1 == ["bonjour</s>"] and runs2 == ["hi</s>"]
    assert "Translate to French.\n\ngood morning" in prompt1 and "You translate." in prompt1
    assert "System" not in prompt2 and prompt2.startswith("<s>### User:\nSay hi.\n\n### Assistant:\n")


@pytest.mark.parametrize("columns", [("instruction", "response"), ("instruction", "output"), ("question", "answer")])
def test_pair_formats_train_on_the_answer(tmp_path, tok, columns):
    [(runs, prompt)] = _one_document_per_row(tok, _write(tmp_path, [dict(zip(columns, ["Name a color.", "blue"]))]))
    assert runs == ["blue</s>"] and "Name a color." in prompt


def test_prompt_completion_plain_and_conversational(tmp_path, tok):
    [(runs, prompt)] = _one_document_per_row(tok, _write(tmp_path, [{"prompt": "2 + 2 =", "completion": " 4"}]))
    assert runs == [" 4</s>"] and prompt == "<s>2 + 2 ="  # raw text, no template
    conversational = {"prompt": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
                                 {"role": "user", "content": "Bye."}],
                      "completion": [{"role": "assistant", "content": "Goodbye."}]}
    [(runs, prompt)] = _one_document_per_row(tok, _write(tmp_path, [conversational], "c.jsonl"))
    assert runs == ["Goodbye.</s>"] and "Hello." in prompt  # the prompt's assistant turn is context only


def test_text_trains_on_every_token_but_the_first(tmp_path, tok):
    [(runs, prompt)] = _one_document_per_row(tok, _write(tmp_path, [{"text": "the quick brown fox"}]))
    assert runs == ["the quick brown fox</s>"] and prompt == "<s>"


def test_default_template_is_announced_and_saved_with_the_tokenizer(tmp_path, tok):
    from hfdist.data import prepare_with_report
    from hfdist.data.chat import DEFAULT_CHAT_TEMPLATE

    assert not tok.chat_template  # the embedded tokenizer ships without one
    _, report = prepare_with_report(load_raw_dataset(None), tok, 128)
    assert report.default_template and "no chat template" in report.line()
    tok.save_pretrained(tmp_path / "tok")
    assert load_tokenizer(str(tmp_path / "tok"), is_preset=False).chat_template == DEFAULT_CHAT_TEMPLATE
    own = load_tokenizer(None, is_preset=True)
    own.chat_template = CHATML
    assert not prepare_with_report(load_raw_dataset(None), own, 128)[1].default_template


@pytest.mark.parametrize("turns, match", [
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "Row 1 .*role 'tool'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
     "Row 1 .*do not alternate"),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "a"}], "Row 1 .*no assistant turn"),
    ([{"role": "assistant", "content": "a"}], "Row 1 .*do not alternate"),
])
def test_malformed_conversations_are_refused_naming_the_row(tmp_path, tok, turns, match):
    good = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(DataError, match=match):
        prepare(load_raw_dataset(_write(tmp_path, [{"messages": good}, {"messages": turns}])), tok, 64)


def test_empty_dataset_after_filtering(tmp_path, tok):
    path = _write(tmp_path, [{"instruction": "", "response": "x"}, {"instruction": "q", "response": " "}])
    with pytest.raises(DataError, match="Nothing to train on: of the dataset's 2 instruction/response rows, 2 have "
                                        "empty fields"):
        prepare(load_raw_dataset(path), tok, 64)


def test_unknown_columns_name_the_formats():
    from hfdist.data.formats import detect_format

    with pytest.raises(DataError, match="question_text.*messages, conversations, .*instruction/input/output"):
        detect_format(["question_text", "label"])
    assert detect_format(["instruction", "input", "output", "text"]).name == "instruction/input/output"


def test_template_that_renders_prefixes_differently_is_refused(tmp_path, tok):
    tok.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% if loop.last %}"
                         "{{ ' END' }}{% endif %}{{ '\\n' }}{% endfor %}")
    path = _write(tmp_path, [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                           {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}])
    with pytest.raises(DataError, match="Row 0 .*renders the conversation"):
        prepare(load_raw_dataset(path), tok, 64)
