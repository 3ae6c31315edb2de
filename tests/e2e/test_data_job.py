"""The data path through scripts/finetune.py: --num-epochs trains whole passes over the packed blocks. (Bad data is
refused before any process starts: tests/unit/test_bad_input.py.)"""

from __future__ import annotations

import json
import sys

from helpers import FINETUNE, run_cmd


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
