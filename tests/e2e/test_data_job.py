"""The data path through scripts/finetune.py: bad data gets one paragraph naming the problem (and the row), exit 2,
nothing written; --num-epochs trains whole passes over the packed blocks."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import FINETUNE, run_cmd

GOOD = [{"role": "user", "content": "Add 1 and 2."}, {"role": "assistant", "content": "3"}]


def _finetune_on(tmp_path, rows, *args):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o"
    proc = run_cmd([sys.executable, str(FINETUNE), "--model", "llama-tiny", "--seq-len", "64", "--dataset", str(data),
                    "--output-dir", str(out), *args], timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not out.exists()
    (paragraph,) = [line for line in proc.stderr.splitlines() if line.startswith("hfdist: error")]
    return paragraph


@pytest.mark.parametrize("bad, words", [
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}], ["Row 2", "role 'bot'"]),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "assistant", "content": "c"}],
     ["Row 2", "do not alternate", "['user', 'assistant', 'assistant']"]),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
     ["Row 2", "no assistant turn"]),
])
def test_malformed_conversation_names_the_row(tmp_path, bad, words):
    paragraph = _finetune_on(tmp_path, [{"messages": GOOD}] * 2 + [{"messages": bad}] + [{"messages": GOOD}] * 20)
    assert all(w in paragraph for w in words), paragraph


def test_dataset_empty_after_filtering(tmp_path):
    paragraph = _finetune_on(tmp_path, [{"instruction": "q", "output": ""}, {"instruction": " ", "output": "a"}])
    assert "Nothing to train on" in paragraph and "2 have empty fields" in paragraph


def test_document_longer_than_the_block_with_splitting_off(tmp_path):
    long = [{"role": "user", "content": " ".join(["apple"] * 80)}, {"role": "assistant", "content": "ok"}]
    paragraph = _finetune_on(tmp_path, [{"messages": GOOD}, {"messages": long}], "--long-documents", "error")
    assert "Row 1 of the dataset is" in paragraph and "more than --seq-len 64" in paragraph


def test_too_little_data_for_the_global_batch(tmp_path):
    paragraph = _finetune_on(tmp_path, [{"messages": GOOD}] * 10, "--global-batch-size", "16")
    assert "fewer than the --global-batch-size of 16" in paragraph


def test_num_epochs_trains_whole_passes_over_the_packed_blocks(tmp_path):
    from hfdist.data import load_raw_dataset, load_tokenizer, prepare
    from hfdist.data.default import generate_conversations

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in generate_conversations(200, seed=9)))
    blocks = len(prepare(load_raw_dataset(str(data)), load_tokenizer(None, is_preset=True), 64))
    out = tmp_path / "o"
    proc = run_cmd([sys.executable, str(FINETUNE), "--model", "llama-tiny", "--seq-len", "64", "--global-batch-size",
                    "8", "--dataset", str(data), "--num-epochs", "2", "--no-wandb", "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "hfdist_summary.json").read_text())
    assert summary["config"]["num_epochs"] == 2
    assert len(summary["losses"]) == 2 * (blocks // 8)  # global batch 8, the last partial batch dropped
