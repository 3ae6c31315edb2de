"""Bring-your-own configs: what hfdist makes of the keys other projects' accelerate YAMLs and DeepSpeed JSONs carry.

- FSDP1 keys (accelerate's own FSDP template, LLaMA-Factory's fsdp_config.yaml: `fsdp_sharding_strategy` and no
  `fsdp_version: 2`) are translated to FSDP2 the way `accelerate to-fsdp2` maps them (FULL_SHARD -> fully_shard,
  SHARD_GRAD_OP -> no reshard after forward, HYBRID_SHARD -> HSDP over the node, NO_SHARD -> DDP); FSDP1-only
  switches FSDP2 has no use for are dropped, and the run says so in one line.
- Keys hfdist does not implement are refused by name before any process starts (DeepSpeed's sequence parallelism,
  torch.compile through dynamo_config, size-based wrapping, FP8 through TransformerEngine or MS-AMP, ...): a run that
  silently ignored them would not be the run the config describes.
- `mixed_precision: fp8` with torchao (accelerate's `fp8_config.backend: AO`, or no fp8_config) runs as hfdist's own
  `--fp8 tensorwise` over bf16 (hfdist.parallel.float8), and the run says so in one line.
- A DeepSpeed JSON's explicit precision (`bf16.enabled: true`, as axolotl's and accelerate's templates ship) is made
  to agree with the precision the run trains in; transformers would otherwise stop every rank with a mismatch error
  after the process group formed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfdist.errors import HfdistError

__all__ = ["TranslationError", "FsdpConfig", "read_fsdp_config", "read_fp8", "refuse_unimplemented", "refuse_on_gpu",
           "deepspeed_config_for_run"]

# accelerate's FSDP_SHARDING_STRATEGY order: a YAML may give the strategy by name or by its 1-based index.
_SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
# FSDP1 switches FSDP2 needs no counterpart for (accelerate's to-fsdp2 drops them too): why, for the one line.
_DROPPED_IN_FSDP2 = {
    "fsdp_backward_prefetch": "FSDP2 prefetches itself",
    "fsdp_forward_prefetch": "FSDP2 prefetches itself",
    "fsdp_use_orig_params": "FSDP2 trains the original parameters",
    "fsdp_sync_module_states": "every rank builds the same weights",
}
# DeepSpeed accepts these ZeRO-3 keys without their stage3_ prefix (axolotl's JSONs use them), but accelerate fills
# "auto" only under the prefixed names and stops every rank on an unprefixed "auto".
_ZERO3_ALIASES = {"prefetch_bucket_size": "stage3_prefetch_bucket_size",
                  "param_persistence_threshold": "stage3_param_persistence_threshold"}
# Read and honoured (or harmless: hfdist decides how it loads and saves).
_HONOURED = ("fsdp_version", "fsdp_sharding_strategy", "fsdp_reshard_after_forward", "fsdp_auto_wrap_policy",
             "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params", "fsdp_offload_params",
             "fsdp_activation_checkpointing", "fsdp_activation_checkpointing_offload", "fsdp_state_dict_type",
             "fsdp_cpu_ram_efficient_loading")


class TranslationError(HfdistError, ValueError):
    """A config key hfdist does not implement, or a value it cannot translate; the message names key and fix."""


@dataclass(frozen=True)
class FsdpConfig:
    """A YAML's fsdp_config as hfdist runs it (FSDP1 keys already translated).

    Attributes:
        ddp: NO_SHARD: nothing is sharded, so the rung is plain DDP.
        hybrid: shard inside a node, replicate across nodes (HYBRID_SHARD / HYBRID_SHARD_ZERO2).
        note: the one line a translated FSDP1 config prints; None for an FSDP2 config.
    """

    layer_cls_to_wrap: str | None
    reshard_after_forward: bool
    offload_params: bool
    activation_checkpointing: bool
    ddp: bool = False
    hybrid: bool = False
    note: str | None = None


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes")


def _strategy_name(value: Any, path: Path) -> str:
    text = str(value).strip().upper()
    if text.isdigit() and 1 <= int(text) <= len(_SHARDING):
        return _SHARDING[int(text) - 1]
    if text not in _SHARDING:
        raise TranslationError(f"{path}: fsdp_sharding_strategy {value} is not one of {', '.join(_SHARDING)}. "
                               "Set one of these (FULL_SHARD shards everything).")
    return text


def _check_wrapping(fsdp: dict[str, Any], path: Path) -> str | None:
    policy = str(fsdp.get("fsdp_auto_wrap_policy") or "TRANSFORMER_BASED_WRAP").upper()
    if policy != "TRANSFORMER_BASED_WRAP":
        raise TranslationError(
            f"{path} sets fsdp_auto_wrap_policy: {policy}, which hfdist does not implement: it wraps one FSDP unit per "
            "transformer layer (TRANSFORMER_BASED_WRAP), the unit FSDP2 is designed around. Set fsdp_auto_wrap_policy: "
            "TRANSFORMER_BASED_WRAP (and fsdp_transformer_layer_cls_to_wrap to the layer class, or leave it out for "
            "the model's decoder layer).")
    names = [n.strip() for n in str(fsdp.get("fsdp_transformer_layer_cls_to_wrap") or "").split(",") if n.strip()]
    if len(names) > 1:
        raise TranslationError(
            f"{path} lists several classes in fsdp_transformer_layer_cls_to_wrap ({', '.join(names)}); hfdist wraps "
            "one layer class per model. Keep the model's decoder layer class (or remove the key: hfdist then uses "
            "the decoder layer of the model's architecture).")
    if _truthy(fsdp.get("fsdp_activation_checkpointing_offload", False)):
        raise TranslationError(f"{path} sets fsdp_activation_checkpointing_offload: true, which hfdist does not "
                               "implement. Remove it (fsdp_activation_checkpointing alone recomputes each layer).")
    return names[0] if names else None


def read_fsdp_config(fsdp: dict[str, Any] | None, path: Path) -> FsdpConfig:
    """A YAML's fsdp_config, FSDP1 keys translated to FSDP2 (see the module docstring).

    Raises:
        TranslationError: a key or value hfdist does not implement, named with the fix.
    """
    fsdp = dict(fsdp or {})
    unknown = sorted(k for k in fsdp if k not in _HONOURED and k not in _DROPPED_IN_FSDP2)
    if unknown:
        raise TranslationError(f"{path}: fsdp_config has {', '.join(unknown)}, which hfdist does not implement (it "
                               f"reads {', '.join(_HONOURED)}). Remove these keys.")
    layer_cls = _check_wrapping(fsdp, path)
    common = dict(layer_cls_to_wrap=layer_cls, offload_params=_truthy(fsdp.get("fsdp_offload_params", False)),
                  activation_checkpointing=_truthy(fsdp.get("fsdp_activation_checkpointing", False)))
    version = int(fsdp.get("fsdp_version", 1))
    if version not in (1, 2):
        raise TranslationError(f"{path} asks for fsdp_version {version}; FSDP has versions 1 and 2. Set "
                               "fsdp_version: 2.")
    reshard = fsdp.get("fsdp_reshard_after_forward", True)
    if version == 2:
        # accelerate also writes a sharding-strategy name here in configs it converted from FSDP1.
        if isinstance(reshard, str) and reshard.strip().upper() in _SHARDING:
            reshard = _strategy_name(reshard, path) in ("FULL_SHARD", "HYBRID_SHARD")
        return FsdpConfig(reshard_after_forward=_truthy(reshard), **common)
    strategy = _strategy_name(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD"), path)
    meaning = {"FULL_SHARD": "fully_shard over all ranks",
               "SHARD_GRAD_OP": "fully_shard without resharding after forward",
               "HYBRID_SHARD": "HSDP: fully_shard inside a node, replicated across nodes",
               "HYBRID_SHARD_ZERO2": "HSDP without resharding after forward",
               "NO_SHARD": "DDP (nothing sharded)"}[strategy]
    dropped = [k for k in _DROPPED_IN_FSDP2 if k in fsdp]
    note = f"hfdist: {path.name} has FSDP1 keys, run as FSDP2: {strategy} -> {meaning}"
    if dropped:
        note += "; dropped " + ", ".join(f"{k} ({_DROPPED_IN_FSDP2[k]})" for k in dropped)
    return FsdpConfig(reshard_after_forward=strategy in ("FULL_SHARD", "HYBRID_SHARD"), ddp=strategy == "NO_SHARD",
                      hybrid=strategy.startswith("HYBRID"), note=note, **common)


# accelerate's fp8_config keys for torchao (`accelerate config`, backend AO); hfdist's rule decides both instead.
_AO_KEYS = ("backend", "enable_fsdp_float8_all_gather", "pad_inner_dim")


def read_fp8(cfg: dict[str, Any], path: Path) -> tuple[str, str | None, str | None]:
    """A YAML's mixed precision as hfdist runs it: (mixed_precision, fp8 recipe or None, the one line a translated
    fp8 config prints or None). `mixed_precision: fp8` through torchao becomes hfdist's --fp8 tensorwise over bf16.

    Raises:
        TranslationError: an FP8 backend other than torchao, fp8_config keys hfdist does not read, or fp8_config
            without mixed_precision: fp8; the message names the key and the fix.
    """
    mixed = str(cfg.get("mixed_precision", "no"))
    fp8_config = cfg.get("fp8_config") or {}
    if mixed.lower() != "fp8":
        if fp8_config:
            raise TranslationError(f"{path} sets fp8_config but mixed_precision: {mixed}, so no FP8 would run (accelerate "
                                   "reads fp8_config only under mixed_precision: fp8). Set mixed_precision: fp8 to "
                                   "train in float8, or remove fp8_config.")
        return mixed, None, None
    backend = str(fp8_config.get("backend", "AO")).upper()
    if backend != "AO":
        what = {"TE": "TransformerEngine", "MSAMP": "MS-AMP"}.get(backend, backend)
        raise TranslationError(f"{path} sets mixed_precision: fp8 with fp8_config.backend: {backend} ({what}), which "
                               "hfdist does not implement: its FP8 is torchao's float8 training (hfdist finetune --fp8). "
                               "Set fp8_config.backend: AO (or remove fp8_config), or mixed_precision: bf16.")
    unknown = sorted(set(fp8_config) - set(_AO_KEYS))
    if unknown:
        raise TranslationError(f"{path}: fp8_config has {', '.join(unknown)}, which hfdist does not read for torchao "
                               f"FP8 (it reads {', '.join(_AO_KEYS)}). Remove these keys.")
    note = (f"hfdist: {path.name} asks for mixed_precision: fp8 (torchao): runs as --fp8 tensorwise over bf16 (the "
            "decoder layers' projections in float8, gathered in float8 where FSDP2 shards them)")
    decided = [k for k in _AO_KEYS[1:] if k in fp8_config]
    if decided:
        note += f"; fp8_config's {', '.join(decided)} follow hfdist's rule (docs/fp8.md)"
    return "bf16", "tensorwise", note


def refuse_unimplemented(cfg: dict[str, Any], path: Path) -> None:
    """Refuse, by name, the accelerate YAML keys hfdist does not implement (whatever the device).

    Raises:
        TranslationError: naming the key, what it asks for and the fix.
    """
    pc = cfg.get("parallelism_config") or {}
    key = "parallelism_config_sp_size"
    if int(pc.get(key, 1) or 1) > 1:
        raise TranslationError(f"{path} sets {key}: {pc[key]} (sequence parallelism through DeepSpeed Ulysses), which "
                               f"hfdist does not implement. Set {key}: 1 (or remove it) and use "
                               "parallelism_config_cp_size on an FSDP config instead (hfdist's context parallelism, "
                               "also Ulysses: the fsdp_cp rung).")
    backend = str((cfg.get("dynamo_config") or {}).get("dynamo_backend", "NO")).upper()
    if backend != "NO":
        raise TranslationError(f"{path} sets dynamo_config.dynamo_backend: {backend}; hfdist does not compile the "
                               "model (its strategy checks and pipeline stages run eager modules). Remove "
                               "dynamo_config or set dynamo_backend: NO.")


def refuse_on_gpu(yaml_cfg: dict[str, Any], owns_sharding: bool, path: Path) -> None:
    """Refuse YAML settings that only matter on a GPU and that hfdist does not implement there.

    On CPU both are moot (fp16 is translated to fp32, and CPU is where the run is anyway).

    Raises:
        TranslationError: naming the key and the fix.
    """
    if owns_sharding and str(yaml_cfg.get("mixed_precision", "no")).lower() == "fp16":
        raise TranslationError(f"{path} sets mixed_precision: fp16 on a rung hfdist shards itself (FSDP2/TP/PP), "
                               "where fp16 would need a sharded gradient scaler hfdist does not implement. Set "
                               "mixed_precision: bf16 (same memory, no loss scaling).")
    if _truthy(yaml_cfg.get("use_cpu", False)):
        raise TranslationError(f"{path} sets use_cpu: true on a machine with GPUs; hfdist places the run on the GPUs "
                               "it finds. Remove use_cpu, or hide the GPUs (CUDA_VISIBLE_DEVICES=\"\") to run on CPU.")


def deepspeed_config_for_run(json_path: Path, mixed_precision: str, *, tp: int = 1,
                             nvme_path: str | None = None) -> tuple[dict[str, Any], str | None]:
    """The DeepSpeed config this run hands to the Trainer, and the one line saying what was changed (or None).

    Explicit `bf16/fp16.enabled` values are set to the precision the run trains in (on CPU: fp32, as the run's
    translation line says); "auto" stays for the Trainer to fill, and unprefixed ZeRO-3 "auto" keys get the names
    accelerate fills. The AutoTP degree follows --tp; offloaded NVMe sections get --nvme-path.
    """
    ds = json.loads(json_path.read_text())
    changed = []
    zero = ds.get("zero_optimization") or {}
    renamed = [alias for alias, name in _ZERO3_ALIASES.items() if zero.get(alias) == "auto" and name not in zero]
    for alias in renamed:
        zero[_ZERO3_ALIASES[alias]] = zero.pop(alias)
    if renamed:
        changed.append(f"zero_optimization {', '.join(renamed)} -> stage3_ names (where accelerate fills \"auto\")")
    for name in ("bf16", "fp16"):
        section = ds.get(name)
        if isinstance(section, dict) and isinstance(section.get("enabled"), bool):
            want = mixed_precision == name
            if section["enabled"] != want:
                changed.append(f"{name}.enabled {str(section['enabled']).lower()} -> {str(want).lower()}")
                section["enabled"] = want
    autotp = int((ds.get("tensor_parallel") or {}).get("autotp_size", 1))
    if tp != autotp:
        ds.setdefault("tensor_parallel", {})["autotp_size"] = tp
        changed.append(f"tensor_parallel.autotp_size {autotp} -> {tp} (--tp)")
    if nvme_path:
        for key in ("offload_param", "offload_optimizer"):
            section = ds.get("zero_optimization", {}).get(key)
            if section and section.get("device") == "nvme":
                section["nvme_path"] = nvme_path
    precision = {"no": "fp32"}.get(mixed_precision, mixed_precision)
    note = (f"hfdist: {json_path.name} translated for this run ({precision}): {', '.join(changed)}"
            if changed else None)
    return ds, note
