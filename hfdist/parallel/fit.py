"""A model's config against a rung, before any process starts or anything is built: the architecture hfdist's TP and
PP know, tp dividing the sizes it splits, the FSDP layer class a YAML names, cp against the heads, the sequence and
its --cp-method, an MoE model's experts against the rung and ep (hfdist.parallel.expert_check). Read by the
launcher's pre-checks (hfdist.job.preflight) and by hfdist.api.prepare_model; each failure one paragraph naming the
fix.
"""

from __future__ import annotations

import torch

from hfdist.config.finetune import ConfigError
from hfdist.config.ladder import Rung

__all__ = ["check_model_fits", "check_model_fits_rung", "check_context_parallel", "plan_context"]


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


def check_context_parallel(config, rung: Rung, seq_len: int | None = None):
    """A context-parallel rung against the model and the sequence length, before any process: the plan of its
    --cp-method (hfdist.parallel.context_check.check_cp), or the one already planned (`plan_context`).

    Returns:
        The CpPlan, or None without cp.

    Raises:
        ContextParallelError: naming the sizes or the method, and what would work.
    """
    from hfdist.parallel.context_check import CpPlan, check_cp

    cp, context = rung.dims.cp, rung.context
    if cp == 1:
        return None
    if context.ulysses is not None:  # planned already (for this model and --seq-len): the same plan, re-checked
        plan = CpPlan(context.method, cp, context.ulysses, context.reason)
        check_cp(config, cp, seq_len, tp=rung.dims.tp, method=context.method)
        if seq_len is not None and seq_len % plan.seq_multiple:
            raise ConfigError(f"The {plan.method} plan of {rung.name} cuts rows into multiples of "
                              f"{plan.seq_multiple} tokens, not --seq-len {seq_len}.")
        return plan
    return check_cp(config, cp, seq_len, tp=rung.dims.tp, method=context.method)


def plan_context(config, rung: Rung, seq_len: int | None = None) -> Rung:
    """The rung with its context parallelism planned for this model and sequence length (the method --cp-method
    asked for or auto chose, its Ulysses degree, why), so every rank applies the plan the launcher checked.

    Raises:
        ContextParallelError: a method that cannot split the model or cut the sequence, naming what would work.
    """
    from dataclasses import replace

    from hfdist.config.ladder import ContextSettings

    plan = check_context_parallel(config, rung, seq_len)
    if plan is None:
        return rung
    return replace(rung, context=ContextSettings(plan.method, plan.ulysses, plan.reason))


def _check_layer_class(config, name: str) -> None:
    """A config's fsdp_transformer_layer_cls_to_wrap must name a module class of the model: checked on a skeleton
    built on the meta device (no memory), so a wrong name fails here rather than in every rank."""
    from transformers import AutoModelForCausalLM

    from hfdist.parallel.fsdp import find_layers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    find_layers(model, name)
