"""Preparing data ahead of the job (`hfdist prepare`, hfdist.data.prepared, hfdist.job.data): held-out rows drawn by
the seed as whole rows, packing a window of blocks at a time equal to packing at once, and a prepared folder the job
reads back as the very blocks it would have made."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from hfdist.config.finetune import parse_args
from hfdist.data import load_raw_dataset, load_tokenizer
from hfdist.data.default import generate_conversations
from hfdist.data.preparation import held_out_rows, prepare_split, prepare_with_report


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None, is_preset=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in generate_conversations(1200, seed=11)))
    return str(path)


def _rows(dataset) -> list[tuple]:
    return [tuple(map(tuple, (r["input_ids"], r["labels"], r["position_ids"]))) for r in dataset]


def test_held_out_rows_are_drawn_by_the_seed():
    first, again, other = held_out_rows(1000, 0.05, 0), held_out_rows(1000, 0.05, 0), held_out_rows(1000, 0.05, 1)
    assert first.sum() == 50 and (first == again).all() and (first != other).any()
    assert held_out_rows(10, 0.01, 0).sum() == 1  # at least one row


def test_a_split_holds_out_whole_rows_and_loses_no_document(data, tok):
    whole, report = prepare_with_report(load_raw_dataset(data), tok, 64)
    split = prepare_split(load_raw_dataset(data), tok, 64, eval_fraction=0.1, seed=3)
    rows = report.rows
    assert split.eval_report.rows == round(0.1 * rows) and split.train_report.rows == rows - split.eval_report.rows
    # Every document lands on exactly one side, whole: the label tokens and documents add up.
    assert split.train_report.documents + split.eval_report.documents == report.documents
    assert split.train_report.label_tokens + split.eval_report.label_tokens == report.label_tokens
    # A conversation split into pieces keeps all of them on its row's side: pieces are counted by source row.
    assert split.train_report.split_rows + split.eval_report.split_rows == report.split_rows
    again = prepare_split(load_raw_dataset(data), tok, 64, eval_fraction=0.1, seed=3)
    assert _rows(again.eval) == _rows(split.eval)
    other = prepare_split(load_raw_dataset(data), tok, 64, eval_fraction=0.1, seed=4)
    assert _rows(other.eval) != _rows(split.eval)


def test_packing_a_window_at_a_time_equals_packing_at_once(data, tok, monkeypatch):
    import datasets

    import hfdist.data.packed_file as packed_file

    rows = load_raw_dataset(data).to_list()
    at_once, report = prepare_with_report(datasets.Dataset.from_list(rows), tok, 64)
    monkeypatch.setattr(packed_file, "WINDOW_TOKENS", 64 * 7)  # 7 blocks per window: many windows
    windowed, again = prepare_with_report(datasets.Dataset.from_list(rows), tok, 64)
    assert report.blocks > 7 * 10 and _rows(windowed) == _rows(at_once)
    assert (again.padding_tokens, again.label_tokens) == (report.padding_tokens, report.label_tokens)


def test_prepare_writes_what_the_job_reads_back(tmp_path, data, tok, capsys):
    """`hfdist prepare JOB.yaml` then the job's data phase: the same blocks as preparing in the job, read from the
    folder; keys of the job file that are not data settings are left aside by prepare."""
    from hfdist.cli import main
    from hfdist.job.data import job_data

    job = tmp_path / "job.yaml"
    job.write_text(f"config: fsdp_tp\ndataset: {data}\nseq_len: 64\neval_fraction: 0.1\nseed: 3\nglobal_batch_size: 8\n"
                   f"prepared_data: {tmp_path / 'prepared'}\nreport_to: [mlflow]\nlora: true\n")
    assert main(["prepare", str(job), "--num-proc", "2"]) == 0
    printed = capsys.readouterr().out
    assert "hfdist: data: " in printed and "hfdist: eval data: " in printed
    assert sorted(p.name for p in (tmp_path / "prepared").iterdir() if p.name != ".lock") == [
        "eval.arrow", "hfdist_prepared.json", "train.arrow"]  # the tokenised documents are gone
    cfg = parse_args([str(job)])
    read = job_data(cfg, load_tokenizer(None, is_preset=True))
    assert read.train.cache_files[0]["filename"] == str(tmp_path / "prepared" / "train.arrow")  # memory-mapped
    direct = prepare_split(load_raw_dataset(data), tok, 64, eval_fraction=0.1, seed=3)
    assert _rows(read.train) == _rows(direct.train) and _rows(read.eval) == _rows(direct.eval)
    # The same report but for its time, and the source's name (the job's from its file, the library's "dataset").
    assert replace(read.eval_report, seconds=0, sources=()) == replace(direct.eval_report, seconds=0, sources=())
    assert [s["name"] for s in read.eval_report.sources] == ["chat"]


def test_the_job_writes_a_missing_prepared_folder_for_the_next_run(tmp_path, data, tok):
    from hfdist.data.prepared import is_prepared
    from hfdist.job.data import job_data

    cfg = parse_args(["--dataset", data, "--seq-len", "64", "--global-batch-size", "8", "--eval-dataset", data,
                      "--prepared-data", str(tmp_path / "p")])
    first = job_data(cfg, tok)
    assert is_prepared(tmp_path / "p") and _rows(first.eval) == _rows(first.train)  # the same rows as eval data
    assert _rows(job_data(cfg, tok).train) == _rows(first.train)
    assert not is_prepared(tmp_path / "q") and not job_data(
        parse_args([*(a for a in ["--dataset", data, "--seq-len", "64", "--global-batch-size", "8"]),
                    "--prepared-data", str(tmp_path / "q")]), tok, write=False).eval
    assert not (tmp_path / "q").exists()  # ranks other than 0 never write it


def test_prepare_needs_a_folder_to_write(capsys):
    from hfdist.cli import main

    assert main(["prepare", "--model", "llama-tiny"]) == 2
    assert "hfdist prepare writes the prepared data to --prepared-data, which is not set" in capsys.readouterr().err


def test_the_windowed_packing_reads_lengths_without_reading_tokens():
    import pyarrow as pa

    from hfdist.data.packed_file import document_lengths

    column = pa.chunked_array([pa.array([[1, 2], [3]]), pa.array([[], [4, 5, 6]])])
    assert document_lengths(column).tolist() == [2, 1, 0, 3]
    assert document_lengths(pa.chunked_array([], type=pa.list_(pa.int32()))).dtype == np.int64


def test_settings_tell_tokenizers_and_templates_apart_by_content(tmp_path):
    """The same tokenizer read from another folder is the same tokenizer; another vocabulary or another chat template
    is not: a prepared folder made with them is refused, each difference named."""
    from hfdist.data.prepared import data_settings
    from hfdist.data.sources import parse_source

    def settings(tokenizer):
        return data_settings(tokenizer, sources=(parse_source("d.jsonl"),), eval_dataset=None, eval_fraction=None,
                             seed=0, seq_len=64, long_documents="split")

    base = load_tokenizer(None, is_preset=True)
    base.save_pretrained(tmp_path / "copy")
    assert settings(load_tokenizer(str(tmp_path / "copy"), is_preset=False)).differences(settings(base)) == []
    templated = load_tokenizer(None, is_preset=True)
    templated.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert settings(templated).differences(settings(base)) == [
        f"the tokenizer's chat template: prepared with {settings(base).chat_template!r}, this job has "
        f"{settings(templated).chat_template!r}"]
    grown = load_tokenizer(None, is_preset=True)
    grown.add_tokens(["<tool>"])
    (said,) = settings(grown).differences(settings(base))
    assert said.startswith(f"the tokenizer (--model): prepared with {base.name_or_path}'s (content hash ")
