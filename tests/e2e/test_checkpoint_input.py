"""Bad model input to scripts/finetune.py: a checkpoint folder without safetensors is refused in one paragraph,
exit 2, before any process starts (every rank reads its slices of the weights from safetensors)."""

from __future__ import annotations

import sys

from helpers import FINETUNE, run_cmd


def test_checkpoint_folder_without_safetensors(tmp_path):
    """A checkpoint as older tools wrote it: config.json + pytorch_model.bin."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tmp_path / "pickled"
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1024)
    LlamaForCausalLM(config).save_pretrained(model)
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    assert (model / "pytorch_model.bin").is_file() and not list(model.glob("*.safetensors"))
    proc = run_cmd([sys.executable, str(FINETUNE), "--config", "fsdp_full_shard", "--model", str(model),
                    "--output-dir", str(tmp_path / "o")], timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "without safetensors weights (it holds pytorch_model.bin)" in proc.stderr
    assert "save_pretrained" in proc.stderr  # the one-time conversion
    assert "starting" not in proc.stdout and not (tmp_path / "o").exists()  # no process was started
