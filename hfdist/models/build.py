"""Building the model a run trains without ever materialising it whole where that is avoidable.

Every path starts from `meta_model`: the modules with their parameters on the meta device (no memory, any size)
and their buffers computed as usual (the rotary frequencies), LoRA injected there too. Then:
- hfdist's mesh rungs shard it first and materialise only the local shards (hfdist.parallel.parallelize);
- DDP, ZeRO-1/2 and the single process hold the full model by design: `materialize` + `load_weights`, once per
  rank, in its training dtype;
- ZeRO-3 builds under `deepspeed.zero.Init` (`zero3_model`), partitioned from the first parameter on.
Weights come from a checkpoint's safetensors or from the seeded init (hfdist.models.load, hfdist.models.init).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from hfdist.models.presets import PRESETS, load_config

__all__ = ["meta_model", "check_checkpoint_weights", "checkpoint_folder", "lora_config", "inject_lora", "materialize",
           "build_model", "zero3_model"]


def _implementation(attn_implementation: str | None) -> dict:
    """from_config's attention argument (hfdist's document attention is registered with transformers first) and,
    on CPU, its experts one: an MoE model's routed experts as transformers' loop over the experts, not its default
    grouped GEMM, whose CPU kernel (torch's reference one) is ~13x slower at the sizes a CPU trains (the same
    numbers; on GPU transformers' grouped_mm stays)."""
    kwargs = {} if torch.cuda.is_available() else {"experts_implementation": "eager"}
    if attn_implementation is None:
        return kwargs
    from hfdist.models.attention import DOCUMENT_ATTENTION

    if attn_implementation == DOCUMENT_ATTENTION:
        from hfdist.models.document_attention import register_document_attention

        register_document_attention()
    return {**kwargs, "attn_implementation": attn_implementation}


def meta_model(spec: str | None, vocab_size: int | None = None, dtype: torch.dtype = torch.float32,
               attn_implementation: str | None = None) -> nn.Module:
    """The model of `spec` (preset, local folder, HF id) with its parameters on the meta device and its buffers on
    the CPU: free to build at any size, and the structure every later step (LoRA, TP, stages, FSDP) works on.
    `attn_implementation`: a resolved hfdist.models.attention choice (None: transformers' default, sdpa)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = load_config(spec, vocab_size)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **_implementation(attn_implementation))
    model.tie_weights()  # post_init skips the tie while the parameters are being created on meta
    return model


def check_checkpoint_weights(spec: str | None, config=None) -> None:
    """A local checkpoint folder must hold its weights as safetensors (what every rank reads its slices from): with
    the model's `config`, whole files holding every weight at its shape (hfdist.models.checkpoint_check).

    Raises:
        ModelSpecError: a folder without *.safetensors, naming what it has and the one-time conversion; a file cut
            short, a broken index, a missing weight or one of another shape.
    """
    from hfdist.models.presets import ModelSpecError

    if spec is None or spec in PRESETS or not Path(spec).is_dir():
        return
    if any(Path(spec).glob("*.safetensors")):
        if config is not None:
            from hfdist.models.checkpoint_check import check_checkpoint_files

            check_checkpoint_files(Path(spec), config)
        return
    found = sorted(p.name for p in Path(spec).iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".h5"))
    raise ModelSpecError(
        f"--model {spec} is a checkpoint folder without safetensors weights ({'it holds ' + ', '.join(found) if found else 'no weight files at all'}). "
        "hfdist loads *.safetensors only: every rank reads just the slices of each tensor it keeps, which a pickled "
        "checkpoint cannot offer. Convert it once, e.g. python -c \"from transformers import AutoModelForCausalLM as "
        f"M; M.from_pretrained('{spec}').save_pretrained('{spec}-safetensors')\", and pass that folder; or pass a "
        "preset."
    )


def checkpoint_folder(spec: str | None) -> Path | None:
    """Where `spec`'s safetensors are: None for a preset, the folder for a local checkpoint, the local snapshot of
    a hub model (downloaded once, safetensors and configs only)."""
    if spec is None or spec in PRESETS:
        return None
    if Path(spec).is_dir():
        return Path(spec)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(spec, allow_patterns=["*.safetensors", "*.json"]))


def lora_config(r: int, alpha: int, dropout: float = 0.0, targets: tuple[str, ...] | None = None):
    """hfdist's peft LoraConfig: rank `r` adapters on the decoder-layer projections `targets` names (default: every
    one, hfdist.models.registry.LORA_TARGETS), `dropout` on their input (tensor-parallel rungs refuse any)."""
    from peft import LoraConfig

    from hfdist.models.registry import LORA_TARGETS

    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, task_type="CAUSAL_LM",
                      target_modules=list(targets or LORA_TARGETS))


def inject_lora(model: nn.Module, r: int, alpha: int, dropout: float = 0.0,
                targets: tuple[str, ...] | None = None) -> nn.Module:
    """`lora_config(r, alpha, dropout, targets)`'s adapters injected; on a meta model they are created on meta too and
    get their values with the other weights."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(r, alpha, dropout, targets))


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate `module`'s (local, possibly sharded) parameters on `device`, uninitialised, keeping the values its
    buffers were built with. FSDP2 and DTensor parameters allocate only their local shards."""
    built = {(id(m), name): b for m in module.modules() for name, b in m._buffers.items()
             if b is not None and not b.is_meta}
    # Swapping keeps each Parameter object (assigning new ones per module would untie a tied lm_head).
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    with torch.no_grad():
        for m in module.modules():
            for name, b in m._buffers.items():
                if (id(m), name) in built:
                    b.copy_(built[(id(m), name)])


def build_model(spec: str | None, vocab_size: int | None = None, seed: int = 0, dtype: torch.dtype | None = None,
                device: torch.device | str = "cpu", attn_implementation: str | None = None) -> nn.Module:
    """The whole model with its weights in this process (fp32 unless `dtype`): a checkpoint's, or a preset's seeded
    init, the same values every distributed layout starts from. Torch's global generator is seeded with `seed` too,
    so what a caller draws next (peft's own adapter init, say) is the same in every process. `attn_implementation`:
    as for `meta_model`."""
    from hfdist.models.load import load_weights, weight_plan

    torch.manual_seed(seed)
    model = meta_model(spec, vocab_size, dtype or torch.float32, attn_implementation)
    plan = weight_plan(model, checkpoint_folder(spec), seed)
    materialize(model, torch.device(device))
    load_weights({**dict(model.named_parameters()), **dict(model.named_buffers())}, plan)
    return model


def zero3_model(spec: str | None, vocab_size: int | None = None, dtype: torch.dtype = torch.float32,
                attn_implementation: str | None = None) -> nn.Module:
    """The model built under `deepspeed.zero.Init`: each parameter partitioned over the ranks as it is created.

    Needs the ZeRO-3 config in force (TrainingArguments with the DeepSpeed JSON, alive). The contexts are the ones
    transformers enters for a ZeRO-3 build, without its rank-0 random init: every weight is loaded next
    (hfdist.models.load.load_gathered).
    """
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.integrations.deepspeed import deepspeed_config, prevent_arange_dtype_change
    from transformers.modeling_utils import set_zero3_state

    if not deepspeed.comm.is_initialized():
        # accelerate starts deepspeed.comm on GPU only (on CPU the engine starts it later); zero.Init needs it now
        # to partition over the world, so it wraps the process group TrainingArguments made.
        deepspeed.init_distributed(dist_backend=dist.get_backend())
    config = load_config(spec, vocab_size)
    with no_init_weights(), prevent_arange_dtype_change(), \
            deepspeed.zero.Init(config_dict_or_path=deepspeed_config()), set_zero3_state():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **_implementation(attn_implementation))
    model.tie_weights()
    return model
