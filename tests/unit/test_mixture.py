"""Mixtures of datasets (hfdist.data.sources, hfdist.data.mixture): the --dataset spec and the job file's datasets:
list, the draw by weight (shares of the label tokens) or epochs from the seed, and a mixture of three formats
prepared end to end in one process."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hfdist.config.sources import parse_source
from hfdist.data.mixture import SourceDraw, draw
from hfdist.data.sources import check_sources
from hfdist.errors import DataError


def test_a_spec_is_a_path_then_settings_and_reads_back():
    plain = parse_source("data/rows.jsonl")
    assert (plain.path, plain.name, plain.weight, plain.spec()) == ("data/rows.jsonl", "rows", None, "data/rows.jsonl")
    full = parse_source("org/qa,weight=0.3,format=alpaca,split=test,eval_fraction=0.02,column.output=answer,name=qa")
    assert (full.path, full.name, full.weight, full.format, full.split, full.eval_fraction, full.columns) == (
        "org/qa", "qa", 0.3, "instruction/input/output", "test", 0.02, (("output", "answer"),))
    assert parse_source(full.spec()) == full
    assert parse_source("a,b.csv,epochs=2").path == "a,b.csv"  # commas of a path stay in it
    assert parse_source("default").path is None  # the embedded data


def test_the_job_file_takes_a_datasets_list_and_the_command_line_repeats_dataset(tmp_path):
    from hfdist.config.finetune import job_text, parse_args

    job = tmp_path / "job.yaml"
    job.write_text("datasets:\n  - {path: a.jsonl, weight: 0.5}\n  - {path: b.parquet, weight: 0.5, format: sharegpt,"
                   " columns: {conversations: turns}}\n")
    cfg = parse_args([str(job)])
    assert cfg.dataset == ("a.jsonl,weight=0.5", "b.parquet,weight=0.5,format=conversations,column.conversations=turns")
    again = tmp_path / "again.yaml"
    again.write_text(job_text(cfg))
    assert parse_args([str(again)]).dataset == cfg.dataset  # the printed job reads back
    assert parse_args(["--dataset", "a.jsonl", "--datasets", "c.csv,epochs=2"]).dataset == ("a.jsonl", "c.csv,epochs=2")
    assert parse_args(["--dataset", "rows.jsonl"]).dataset == ("rows.jsonl",)  # one source: today's syntax


@pytest.mark.parametrize("specs, said", [
    (["a.jsonl,weight=0.5", "b.jsonl"], "Sources a have a weight and b do not"),
    (["x/a.jsonl", "y/a.jsonl"], "Two sources are named a"),
    (["a.jsonl,weight=0"], "weight='0' must be positive"),
    (["a.jsonl,weight=1,epochs=2"], "weight and epochs together"),
    (["a.jsonl,format=chatml"], "format='chatml' is not a format hfdist reads"),
    (["a.jsonl,format=alpaca,column.messages=m"], "columns maps messages, which format instruction/input/output does "
                                                  "not read"),
    (["a.jsonl,eval_fraction=1.5"], "eval_fraction='1.5' must be strictly between 0 and 1"),
])
def test_bad_sources_are_refused_in_one_paragraph(specs, said):
    with pytest.raises(DataError) as err:
        check_sources([parse_source(s) for s in specs])
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)


def _synthetic(rows: list[int], seed: int = 0):
    """Per source: each row one document of 5..40 label tokens (a quarter of the rows two documents)."""
    rng = np.random.default_rng(seed)
    doc_rows, doc_labels = [], []
    for n in rows:
        r = np.sort(np.r_[np.arange(n), rng.choice(n, n // 4, replace=False)]).astype(np.int32)
        doc_rows.append(r)
        doc_labels.append(rng.integers(5, 40, len(r)).astype(np.int32))
    return doc_rows, doc_labels


def test_weights_are_shares_of_the_label_tokens_drawn_by_the_seed():
    doc_rows, doc_labels = _synthetic([3000, 5000, 900])
    specs = [SourceDraw(weight=w, eval_fraction=0.05) for w in (0.5, 0.3, 0.2)]
    drawn = draw(doc_rows, doc_labels, [3000, 5000, 900], specs, seed=7)
    labels = np.concatenate(doc_labels)
    first = np.cumsum([0, 3000 + 750, 5000 + 1250])
    shares = np.array([labels[drawn.train[(drawn.train >= a) & (drawn.train < b)]].sum()
                       for a, b in zip(first, [*first[1:], len(labels)])]) / labels[drawn.train].sum()
    assert shares == pytest.approx([0.5, 0.3, 0.2], abs=0.005)  # one row's tokens off at most
    assert drawn.eval_rows == [150, 250, 45] and not set(drawn.train) & set(drawn.eval)
    assert drawn.train_rows[2] == 900 - 45  # the smallest source for its weight gives every row it has
    again = draw(doc_rows, doc_labels, [3000, 5000, 900], specs, seed=7)
    other = draw(doc_rows, doc_labels, [3000, 5000, 900], specs, seed=8)
    assert (again.train == drawn.train).all() and not np.array_equal(other.train, drawn.train)


def test_epochs_repeat_rows_and_one_source_without_settings_is_every_row_once():
    doc_rows, doc_labels = _synthetic([100, 80])
    drawn = draw(doc_rows, doc_labels, [100, 80], [SourceDraw(epochs=2), SourceDraw(epochs=0.5)], seed=0)
    assert drawn.train_rows == [200, 40]
    counts = np.bincount(drawn.train, minlength=len(doc_rows[0]) + len(doc_rows[1]))
    assert (counts[:len(doc_rows[0])] == 2).all() and set(counts[len(doc_rows[0]):]) == {0, 1}
    once = draw(doc_rows[:1], doc_labels[:1], [100], [SourceDraw()], seed=0)
    assert (once.train == np.arange(len(doc_rows[0]))).all() and len(once.eval) == 0


def test_three_formats_mix_by_weight_end_to_end(tmp_path):
    """messages JSON Lines, ShareGPT Parquet and Alpaca CSV at 0.5 / 0.3 / 0.2: the packed blocks' label tokens
    split within 2 points of the weights, each source read in its own format."""
    import datasets

    from hfdist.data import load_tokenizer
    from hfdist.data.default import generate_conversations, generate_examples
    from hfdist.data.preparation import build

    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in generate_conversations(900, seed=1)))
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    shared = [{"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in c["messages"]]}
              for c in generate_conversations(600, seed=2)]
    datasets.Dataset.from_list(shared).to_parquet(str(tmp_path / "share.parquet"))
    datasets.Dataset.from_list([{"instruction": e["instruction"], "input": "", "answer": e["response"]}
                                for e in generate_examples(400, seed=3)]).to_csv(str(tmp_path / "qa.csv"), index=False)
    sources = [parse_source(f"{tmp_path / 'chat.jsonl'},weight=0.5"),
               parse_source(f"{tmp_path / 'share.parquet'},weight=0.3"),
               parse_source(f"{tmp_path / 'qa.csv'},weight=0.2,format=alpaca,column.output=answer")]
    built = build(check_sources(sources), load_tokenizer(None, is_preset=True), 64, tmp_path / "out", seed=0)
    report = built.train_report
    assert [(s["name"], s["format"]) for s in report.sources] == [
        ("chat", "messages"), ("share", "conversations"), ("qa", "instruction/input/output")]
    shares = [s["label_tokens"] / report.label_tokens for s in report.sources]
    assert shares == pytest.approx([0.5, 0.3, 0.2], abs=0.02)
    assert report.label_tokens == int((np.asarray(built.train["labels"]) != -100).sum())  # what the blocks hold
    assert "chat (messages): " in report.line() and report.format == "messages+conversations+instruction/input/output"
