"""A model's config against a rung, before any process starts or anything is built: the architecture hfdist's TP and
PP know, tp dividing the sizes it splits, the FSDP layer class a YAML names, cp against the heads, the sequence and
the other axes, an MoE model's experts against the rung and ep (hfdist.parallel.expert_check). Read by the
launcher's pre-checks (hfdist.job.preflight) and by hfdist.api.prepare_model; each failure one paragraph naming the
fix.
"""

from __future__ import annotations

import torch

from hfdist.config.finetune import ConfigError
from hfdist.config.ladder import Rung

__all__ = ["check_model_fits", "check_model_fits_rung", "check_context_parallel"]


def check_model_fits(config, rung: Rung, seq_len: int | None = None) -> None:
    """Every check of this module (`seq_len`: the rows' length when known).

    Raises:
        ConfigError / TPError / ContextParallelError: naming the sizes, the architecture or the axis, and what would
        work.
    """
    check_model_fits_rung(config, rung)
    check_context_parallel(config, rung, seq_len)
    from hfdist.parallel.expert_check import check_moe

    check_moe(config, rung, seq_len)


def check_model_fits_rung(config, rung: Rung) -> None:
    """Model-specific checks of a rung, before any process or surgery: a registered architecture for hfdist's TP
    and PP (hfdist.models.registry), tp dividing its sizes, the FSDP layer class a config names.

    Raises:
        ConfigError / TPError: naming the architecture or the sizes, and what would work.
    """
    from hfdist.models.registry import is_supported, supported_types

    surgery = [what for what, used in (("pipeline stages", rung.uses_pipeline),
                                       ("tensor-parallel plan", rung.owns_sharding and rung.uses_tp)) if used]
    if surgery and not is_supported(config):
        raise ConfigError(f"{rung.name} applies hfdist's {' and '.join(surgery)}, which know the architectures "
                          f"{', '.join(supported_types())}, but the model is a '{getattr(config, 'model_type', '?')}'. "
                          "Use a model of one of those architectures, or a rung without TP/PP (fsdp_full_shard, "
                          "zero3).")
    if rung.owns_sharding and rung.uses_tp:
        from hfdist.parallel.tensor_check import validate_tp

        validate_tp(config, rung.dims.tp)
    if rung.fsdp is not None and rung.fsdp.layer_cls_to_wrap:
        _check_layer_class(config, rung.fsdp.layer_cls_to_wrap)


def check_context_parallel(config, rung: Rung, seq_len: int | None = None) -> None:
    """A context-parallel rung against the model, the sequence length and the other axes, before any process.

    Raises:
        ConfigError / ContextParallelError: naming the sizes or the axis, and what would work.
    """
    cp = rung.dims.cp
    if cp == 1:
        return
    if rung.uses_pipeline:
        raise ConfigError(f"{rung.name} asks for context parallelism (cp={cp}) together with pipeline stages "
                          f"(pp={rung.dims.pp}, schedule {rung.pipeline.schedule if rung.pipeline else '?'}); hfdist "
                          "supports no pipeline schedule with cp yet (its stages pass whole sequences between "
                          "ranks). Set parallelism_config_pp_size: 1 (cp composes with FSDP2 and TP: dp_shard x cp "
                          "x tp), or parallelism_config_cp_size: 1 with pp.")
    from hfdist.parallel.context_check import check_cp

    check_cp(config, cp, seq_len, tp=rung.dims.tp)


def _check_layer_class(config, name: str) -> None:
    """A config's fsdp_transformer_layer_cls_to_wrap must name a module class of the model: checked on a skeleton
    built on the meta device (no memory), so a wrong name fails here rather than in every rank."""
    from transformers import AutoModelForCausalLM

    from hfdist.parallel.fsdp import find_layers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    find_layers(model, name)
