"""Seeded initial weights for a model built from its config (a preset, LoRA adapters), the same whatever the layout.

Every tensor's full values come from a generator of its own, seeded by (seed, the tensor's name), one tensor at a
time; a rank keeps only the slice it holds. So one process, DDP, FSDP, TP, PP and 3D at any world size start from
identical weights, and no rank ever holds more than one full tensor it does not keep. `SeededInitReader` serves
these values to `torch.distributed.checkpoint.load` as if they were a checkpoint on disk, so the slices of FSDP2 /
TP / pipeline shards are cut by the same planner that reads a real checkpoint's (hfdist.models.load).

Distributions as transformers and peft initialise (PreTrainedModel._init_weights, LoraLayer.reset_lora_parameters):
Linear and Embedding weights N(0, initializer_range) (an embedding's padding row 0), biases 0, norm weights 1, LoRA
A kaiming-uniform(a=sqrt(5)), LoRA B 0; an MoE layer's stacked experts and its router's weight N(0,
initializer_range), as the MoE models' own _init_weights draw them.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.futures import Future

__all__ = ["InitRule", "init_rule", "initial_values", "SeededInitReader"]


@dataclass(frozen=True)
class InitRule:
    """How one tensor starts: kind "normal" (mean 0, `std`), "zeros", "ones" or "kaiming_uniform" (peft's LoRA A).

    `zero_row`: a row set to 0 after drawing (an embedding's padding_idx, as transformers does).
    """

    kind: str
    std: float = 0.0
    zero_row: int | None = None


def _is_norm(module: nn.Module) -> bool:
    # transformers' own test: norms are custom classes per architecture (LlamaRMSNorm, ...), matched by name.
    name = type(module).__name__
    return isinstance(module, nn.LayerNorm) or "RMSNorm" in name or "LayerNorm" in name


def init_rule(module_path: str, module: nn.Module, tensor_name: str, std: float) -> InitRule | None:
    """The rule for `module`'s parameter `tensor_name` ("weight" / "bias"), or None when transformers and peft have
    none (the caller refuses such a model rather than guess).

    Args:
        module_path: the module's name in the model (peft's adapters are recognised by it: `lora_A` / `lora_B`).
        std: the config's initializer_range.
    """
    if ".lora_A." in f".{module_path}.":
        return InitRule("kaiming_uniform")
    if ".lora_B." in f".{module_path}.":
        return InitRule("zeros")
    if tensor_name == "bias":
        return InitRule("zeros")
    if isinstance(module, nn.Linear):
        return InitRule("normal", std)
    if isinstance(module, nn.Embedding):
        return InitRule("normal", std, zero_row=module.padding_idx)
    if _is_norm(module):
        return InitRule("ones")
    kind = type(module).__name__
    if ("Experts" in kind and tensor_name in ("gate_up_proj", "down_proj")) or ("Router" in kind and
                                                                            tensor_name == "weight"):
        return InitRule("normal", std)
    return None


def _generator_seed(seed: int, key: str) -> int:
    """A 63-bit seed from (run seed, tensor name); stable across processes and Python runs (no hash())."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def initial_values(key: str, shape: tuple[int, ...], rule: InitRule, seed: int) -> torch.Tensor:
    """The full fp32 values (on CPU) of tensor `key` under `rule`: the same on every rank and in every layout."""
    out = torch.empty(shape, dtype=torch.float32)
    if rule.kind == "zeros":
        return out.zero_()
    if rule.kind == "ones":
        return out.fill_(1.0)
    generator = torch.Generator().manual_seed(_generator_seed(seed, key))
    if rule.kind == "normal":
        out.normal_(0.0, rule.std, generator=generator)
    elif rule.kind == "kaiming_uniform":
        nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=generator)
    else:
        raise ValueError(f"unknown init kind {rule.kind!r}")
    if rule.zero_row is not None:
        out[rule.zero_row].zero_()
    return out


class SeededInitReader(StorageReader):
    """A `torch.distributed.checkpoint` storage whose tensors are `initial_values`: loading from it gives each rank
    the slices of its (DTensor or plain) tensors, generating one full tensor at a time.

    Args:
        specs: key -> (full shape, rule) of every tensor this storage offers.
        seed: the run's seed.
    """

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], InitRule]], seed: int) -> None:
        super().__init__()
        self.specs = specs
        self.seed = seed

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        tensors = {
            key: TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape),
                                       [ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))])
            for key, (shape, _) in self.specs.items()
        }
        return Metadata(state_dict_metadata=tensors, storage_meta=StorageMeta())

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> Future:
        by_key: dict[str, list] = {}
        for item in plan.items:
            by_key.setdefault(item.storage_index.fqn, []).append(item)
        for key, items in by_key.items():
            shape, rule = self.specs[key]
            full = initial_values(key, shape, rule, self.seed)
            for item in items:
                piece = full[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))]
                target = planner.resolve_tensor(item).detach()
                target.copy_(piece)
                planner.commit_tensor(item, target)
            del full
        done: Future = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False
