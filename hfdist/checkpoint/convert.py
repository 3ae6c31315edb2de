"""Any training checkpoint as a Hugging Face model or LoRA adapter (or, merged, a bf16 model: hfdist.checkpoint.merge),
read and written one tensor at a time.

A checkpoint's identity record (hfdist.checkpoint.format) names the model and LoRA settings, from which the full
model's structure is rebuilt on the meta device (no weights); each tensor it lists is then read alone and handed to
the streaming saver (hfdist.checkpoint.hf_export.stream_hf_checkpoint):
- DCP checkpoints (every rung but DeepSpeed, any layout): keyed by the full model's names, so one tensor is one
  `dcp.load` of that key, in one process (DCP reads the byte ranges of each saved slice from the rank files);
- DeepSpeed ZeRO checkpoints: DeepSpeed's own converter (`get_fp32_state_dict_from_zero_checkpoint`, lazy mode:
  a tensor is assembled from the ranks' fp32 partitions when it is asked for);
- DeepSpeed AutoTP checkpoints (zero2_tp): the converter cannot merge partitions of tp-split layers (it expects one
  optimizer-state file per data-parallel rank), so the model files hfdist's streamed save wrote into the checkpoint
  (hfdist.checkpoint.hf_export: the same fp32 masters, assembled over tp and dp) are read, one tensor at a time.
Either way the written weights are the fp32 master weights the optimizer held.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from hfdist.checkpoint.format import SHARDED_DIR, CheckpointError, latest_checkpoint, read_marker

__all__ = ["export_checkpoint", "resolve_checkpoint"]


def resolve_checkpoint(path: Path) -> Path:
    """`path` itself when it is a complete checkpoint, else the latest complete one inside it (an output folder)."""
    if (path / "hfdist_checkpoint.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path} is neither a complete hfdist checkpoint (no hfdist_checkpoint.json) nor a "
                              "run's output folder holding one. Pass a checkpoint-N folder, or the --output-dir of a "
                              "run that saved checkpoints (--save-steps).")
    return latest


def _skeleton(record: dict[str, Any], adapters: bool = True):
    """The trained model's structure on the meta device (a PeftModel for a LoRA run, unless not `adapters`) and its
    tokenizer."""
    from hfdist.data import load_tokenizer
    from hfdist.models.build import inject_lora, meta_model
    from hfdist.models.presets import is_preset

    tokenizer = load_tokenizer(record["model"], is_preset=is_preset(record["model"]))
    model = meta_model(record["model"], vocab_size=len(tokenizer), dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    if record.get("lora") and adapters:
        model = inject_lora(model, record["lora_r"], record["lora_alpha"])
    return model, tokenizer


def _dcp_reader(checkpoint: Path) -> Callable[[str], torch.Tensor]:
    """name -> the full fp32 tensor saved under model.<name> in the checkpoint's DCP folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    folder = str(checkpoint / SHARDED_DIR)
    sizes = {k: v.size for k, v in FileSystemReader(folder).read_metadata().state_dict_metadata.items()
             if hasattr(v, "size")}

    def read(name: str) -> torch.Tensor:
        key = f"model.{name}"
        if key not in sizes:
            raise CheckpointError(f"{checkpoint / SHARDED_DIR} holds no tensor {name!r}: it was not written by "
                                  "this model (its identity record and its shards disagree).")
        tensor = torch.empty(sizes[key], dtype=torch.float32)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": {name: tensor}}, checkpoint_id=folder, no_dist=True)
        return tensor

    return read


def _zero_reader(checkpoint: Path) -> Callable[[str], torch.Tensor]:
    """name -> the full fp32 tensor from DeepSpeed's ZeRO partitions (DeepSpeed's converter, lazy)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), lazy_mode=True)
    return lambda name: state[name].contiguous()


def _saved_model_reader(checkpoint: Path, adapter: bool) -> Callable[[str], torch.Tensor]:
    """key -> the tensor saved under that key in the checkpoint's own HF model (or LoRA adapter) files, which must
    hold fp32 (what hfdist's streamed save writes; a 16-bit copy would not be the trained weights)."""
    from safetensors import safe_open

    single = checkpoint / ("adapter_model.safetensors" if adapter else "model.safetensors")
    index = checkpoint / "model.safetensors.index.json"
    files = {} if single.is_file() or not index.is_file() else \
        {k: checkpoint / f for k, f in json.loads(index.read_text())["weight_map"].items()}

    def read(key: str) -> torch.Tensor:
        with safe_open(str(files.get(key, single)), framework="pt") as f:
            dtype = f.get_slice(key).get_dtype()
            if dtype != "F32":
                raise CheckpointError(f"{checkpoint} holds its model in {dtype}, not the fp32 master weights (a "
                                      "zero2_tp checkpoint written before hfdist saved AutoTP's fp32 masters). "
                                      "Resume it with --resume and save again, or train it again.")
            return f.get_tensor(key)

    return read


def _reader(checkpoint: Path, record: dict[str, Any], skeleton) -> Callable[[str], torch.Tensor]:
    """A tensor's name in the trained model -> its fp32 values in the checkpoint, whatever wrote it: DCP shards,
    DeepSpeed's ZeRO partitions, or (zero2_tp) the checkpoint's own fp32 model files, keyed as they are written."""
    if record.get("format") == "deepspeed" and (record.get("dims") or {}).get("tp", 1) > 1:
        from hfdist.checkpoint.hf_export import checkpoint_entries

        adapter = bool(record.get("lora"))
        by_key = _saved_model_reader(checkpoint, adapter)
        key_of = {e.name: e.key for e in checkpoint_entries(skeleton, adapter_only=adapter)}
        return lambda name: by_key(key_of[name])
    return _zero_reader(checkpoint) if record.get("format") == "deepspeed" else _dcp_reader(checkpoint)


def export_checkpoint(path: Path, out: Path, merge: bool = False) -> Path:
    """Write the checkpoint at `path` (a checkpoint-N folder, or an output folder: its latest) as a HF model, or a
    LoRA adapter for a LoRA / QLoRA run, plus the tokenizer, into `out` (new or empty). With `merge`, an adapter run
    is written as one bf16 model, its adapter merged into its base (hfdist.checkpoint.merge). Returns the checkpoint
    read.

    Raises:
        CheckpointError: `out` not empty, no checkpoint at `path`, or `merge` for a full fine-tune.
    """
    from hfdist.checkpoint.hf_export import stream_hf_checkpoint

    checkpoint = resolve_checkpoint(path)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} is not empty: the export writes a whole model there and overwrites nothing. "
                              "Pass a new or empty folder.")
    record = read_marker(checkpoint)
    if merge and not record.get("lora"):
        raise CheckpointError(f"--merge merges a LoRA or QLoRA adapter into its base, and {checkpoint} is of a full "
                              "fine-tune: its weights are the whole model already. Drop --merge.")
    skeleton, tokenizer = _skeleton(record)
    reader = _reader(checkpoint, record, skeleton)
    if merge:
        from hfdist.checkpoint.merge import MERGED_DTYPE, merged_weights

        base, _ = _skeleton(record, adapters=False)
        stream_hf_checkpoint(out, base, merged_weights(record, base, reader), dtype=MERGED_DTYPE)
    else:
        stream_hf_checkpoint(out, skeleton, lambda entry: reader(entry.name), adapter_only=bool(record.get("lora")))
    tokenizer.save_pretrained(str(out))
    return checkpoint
