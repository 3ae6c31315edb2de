"""A LoRA or QLoRA run's adapter merged into its base: the weights of one bf16 Hugging Face model, one tensor at a
time (`hfdist checkpoint export ... --merge`).

Each adapted projection becomes W + (alpha / r) B A, where W is the base the run trained against: the model's own
weight for LoRA, and for QLoRA that weight quantised exactly as the run quantised it (hfdist.models.quantize: NF4,
double quantisation, from bf16) and dequantised, so the merged model computes what the trained one did, up to the
bf16 rounding of the sum. Every other tensor (embeddings, norms, lm_head; frozen in an adapter run) is the base's
own. The base comes from the run's --model again (its safetensors, or a preset's seeded init with the run's seed):
a checkpoint of an adapter run holds the adapters, not the base.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from hfdist.checkpoint.format import CheckpointError
from hfdist.checkpoint.hf_export import ExportEntry

__all__ = ["MERGED_DTYPE", "merged_weights"]

MERGED_DTYPE = torch.bfloat16  # what HF models ship in; the merged sum is rounded once, into it


def _adapted(name: str) -> str | None:
    """The module path of a decoder-layer projection weight LoRA adapts (`model.layers.3.mlp.up_proj`), or None."""
    from hfdist.models.registry import LORA_TARGETS

    path, _, leaf = name.rpartition(".")
    return path if leaf == "weight" and ".layers." in f".{path}" and path.rpartition(".")[2] in LORA_TARGETS else None


def _trained_base(values: torch.Tensor, quantized: bool) -> torch.Tensor:
    """The fp32 weight the run computed with: `values` themselves, or their NF4 round trip under QLoRA."""
    if not quantized:
        return values.float()
    from hfdist.models.quantize import dequantized_weight, double_quantize, quantize_rows

    packed, absmax = quantize_rows(values)
    return dequantized_weight(packed, double_quantize(absmax, tuple(values.shape))).float()


def merged_weights(record: dict[str, Any], model: nn.Module,
                   adapter: Callable[[str], torch.Tensor]) -> Callable[[ExportEntry], torch.Tensor]:
    """ExportEntry -> its merged fp32 tensor, for the checkpoint of an adapter run recorded as `record`.

    Args:
        model: the base model's structure on the meta device (no adapters): the merged model's names and shapes.
        adapter: an adapter tensor's name in the trained PeftModel -> its fp32 values (the checkpoint's reader).

    Raises:
        CheckpointError: a preset base whose seed the record lacks (it cannot be regenerated).
    """
    from hfdist.models.build import checkpoint_folder
    from hfdist.models.load import checkpoint_files, read_rows, weight_plan
    from hfdist.models.presets import is_preset

    if is_preset(record["model"]) and "seed" not in record:
        raise CheckpointError(f"The checkpoint's record names the preset {record['model']} but not the seed its "
                              "weights were drawn with (written by an older hfdist), so its base cannot be rebuilt "
                              "to merge into. Export the adapter without --merge and merge it with peft onto the "
                              "base you trained on.")
    plan = weight_plan(model, checkpoint_folder(record["model"]), record.get("seed", 0))
    files = checkpoint_files(plan)
    scaling = record["lora_alpha"] / record["lora_r"]
    quantized = bool(record.get("qlora"))

    def merged(entry: ExportEntry) -> torch.Tensor:
        source = plan.tensors[entry.name]
        values = read_rows(source, plan, files, slice(None))
        path = _adapted(entry.name)
        if path is None:
            return values
        a = adapter(f"base_model.model.{path}.lora_A.default.weight")
        b = adapter(f"base_model.model.{path}.lora_B.default.weight")
        return _trained_base(values, quantized) + scaling * (b @ a)

    return merged
