"""Preparing data ahead of the job (`hfdist prepare`, hfdist.data.prepared, hfdist.job.data): held-out rows drawn by
the seed as whole rows, packing a window of blocks at a time equal to packing at once, and a prepared folder the job
reads back as the very blocks it would have made."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from hfdist.config.finetune import parse_args
from hfdist.data import DataError, load_raw_dataset, load_tokenizer
from hfdist.data.cached import prepare_split, prepare_with_report
from hfdist.data.default import generate_conversations
from hfdist.data.preparation import held_out_rows


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


_KILLED = """
import datasets; datasets.disable_progress_bars()
from hfdist.data import load_tokenizer
from hfdist.data.preparation import build
from hfdist.config.sources import parse_source
build([parse_source({source!r})], load_tokenizer(None, is_preset=True), 64, {folder!r}, num_proc=2, shard_rows=256)
"""


def test_an_interrupted_preparation_resumes_to_the_same_bytes(tmp_path):
    """A preparation SIGKILLed half-way (workers and all) resumes from its last whole shard, in another number of
    processes, and writes byte for byte the blocks and documents of one never interrupted."""
    import hashlib
    import os
    import signal
    import subprocess
    import sys
    import time

    from hfdist.config.sources import parse_source
    from hfdist.data.preparation import DOCUMENTS_FOLDER, build

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in generate_conversations(12000, seed=5)))
    source = f"{data},eval_fraction=0.05"
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    code = _KILLED.format(source=source, folder=str(killed))
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    shards = killed / DOCUMENTS_FOLDER
    while len(list(shards.glob("*.docs.npy"))) < 3 and proc.poll() is None:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(list(shards.glob("*.docs.npy")))
    assert 3 <= done_before < 24 and not (killed / "train.arrow").exists()  # killed half-way indeed
    tok = load_tokenizer(None, is_preset=True)
    build([parse_source(source)], tok, 64, killed, num_proc=1, shard_rows=256)
    build([parse_source(source)], tok, 64, whole, num_proc=1, shard_rows=256)

    def digest(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()

    for name in ("train.arrow", "eval.arrow"):
        assert digest(killed / name) == digest(whole / name)
    made = sorted(p.name for p in (whole / DOCUMENTS_FOLDER).iterdir())
    assert made == sorted(p.name for p in (killed / DOCUMENTS_FOLDER).iterdir()) and len(made) == 2 * 24 + 2
    assert all(digest(whole / DOCUMENTS_FOLDER / n) == digest(killed / DOCUMENTS_FOLDER / n) for n in made)


def test_memory_is_bounded_by_construction(tmp_path, data, tok, monkeypatch):
    """What preparing holds does not grow with the data: at most IN_FLIGHT_PER_WORKER batches a worker are read ahead
    of the shards written; packing maps one shard file at a time and gathers one window of blocks at a time."""
    import weakref

    import hfdist.data.documents as documents
    import hfdist.data.packed_file as packed_file
    from hfdist.config.sources import parse_source
    from hfdist.data.preparation import build
    from hfdist.data.reading import SourceReader

    counts = {"read": 0, "ahead": 0, "mapped": 0, "most_mapped": 0, "window": 0}
    batches, add, memmap, gather = SourceReader.batches, documents._ShardWriter.add, np.memmap, \
        documents.Documents.gather

    def counted_batches(self, *args):
        for batch in batches(self, *args):
            counts["read"] += batch.rows
            yield batch

    def counted_add(self, words, records, rows):
        written = self.rows + rows
        counts["ahead"] = max(counts["ahead"], counts["read"] - written)
        add(self, words, records, rows)

    def counted_map(*args, **kwargs):
        mapped = memmap(*args, **kwargs)
        counts["mapped"] += 1
        counts["most_mapped"] = max(counts["most_mapped"], counts["mapped"])
        weakref.finalize(mapped, counts.__setitem__, "mapped", counts["mapped"] - 1)
        return mapped

    def counted_gather(self, docs):
        words, offsets = gather(self, docs)
        counts["window"] = max(counts["window"], len(words))
        return words, offsets

    monkeypatch.setattr(SourceReader, "batches", counted_batches)
    monkeypatch.setattr(documents._ShardWriter, "add", counted_add)
    monkeypatch.setattr(documents.np, "memmap", counted_map)
    monkeypatch.setattr(documents.Documents, "gather", counted_gather)
    monkeypatch.setattr(packed_file, "WINDOW_TOKENS", 64 * 16)
    build([parse_source(data)], tok, 64, tmp_path / "p", num_proc=2, shard_rows=256)
    assert 0 < counts["ahead"] <= documents.IN_FLIGHT_PER_WORKER * 2 * 256  # rows read, not yet written
    assert counts["most_mapped"] == 1 and counts["window"] <= 64 * 16


def test_a_prepared_folder_records_its_sources_and_refuses_them_changed(tmp_path, tok):
    """The manifest keeps every source's content hash; a job whose source has other contents now is refused, one
    whose file only has a new time (a copy) is not."""
    import os

    from hfdist.config.sources import parse_source
    from hfdist.data.prepared import MANIFEST
    from hfdist.data.reading import SourceReader
    from hfdist.job.data import job_data

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in generate_conversations(600, seed=8)))
    cfg = parse_args(["--dataset", str(path), "--seq-len", "64", "--global-batch-size", "8",
                      "--prepared-data", str(tmp_path / "prepared")])
    job_data(cfg, tok)
    manifest = json.loads((tmp_path / "prepared" / MANIFEST).read_text())
    assert manifest["fingerprints"] == {"chat": SourceReader(parse_source(str(path)), 0).fingerprint()}
    os.utime(path, ns=(1, 1))  # another time, the same bytes: read again
    assert len(job_data(cfg, tok).train) > 0
    path.write_text(path.read_text() + path.read_text().splitlines(keepends=True)[0])
    with pytest.raises(DataError, match=r"was prepared from other contents of chat \(.*content hash \w+ when "
                                        r"prepared, \w+ now\)"):
        job_data(cfg, tok)


def test_settings_tell_tokenizers_and_templates_apart_by_content(tmp_path):
    """The same tokenizer read from another folder is the same tokenizer; another vocabulary or another chat template
    is not: a prepared folder made with them is refused, each difference named."""
    from hfdist.config.sources import parse_source
    from hfdist.data.prepared import data_settings

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
