"""FP8 training (`--fp8 tensorwise|rowwise`) through torchao's float8 linears: which layers compute in float8, the
recipes, FSDP2's float8 all-gather, and what a rank reports and checks of them.

Which layers convert is one rule (hfdist.parallel.float8_check.converts): a decoder layer's projection (the
registry's q/k/v/o/gate/up/down) whose in- and out-features, as a rank holds them under tensor parallelism, are both multiples of 16 (what the float8
matmul, `torch._scaled_mm`, requires). Never lm_head (the logits feed the fp32 loss and carry the largest values of
the network: torchtitan and torchao keep it in the training precision too), never the embedding (a lookup, not a
matmul), never LoRA's adapters (LoRA with FP8 is refused before launch). torchao's own filter also skips layers it
measured as too small to gain on an H100; hfdist converts every layer the rule allows, so a tiny model exercises the
same code as a large one (speed on small layers is the GPU benchmark's to show, not a correctness matter).

The recipes are torchao's: tensorwise (one dynamic scale per tensor; float8 e4m3 forward, e5m2 gradients) and
rowwise (a scale per row of each operand along the contracted dimension, e4m3 throughout, scales rounded down to
powers of two). Everything else (attention, norms, embedding, lm_head, the loss) runs in the run's precision: bf16
under --mixed-precision bf16, fp32 otherwise, and the master weights, gradients and optimizer stay fp32.

Where FSDP2 shards the weights (dp_shard x cp > 1) and the recipe is tensorwise, the weights are all-gathered in
float8 (torchao's WeightWithDynamicFloat8CastTensor: each rank casts its shard with the tensor's global scale and
FSDP2 gathers 1 byte per element instead of 2 or 4). The scales of all gathered weights are computed together once
per step after the optimizer step (and once before the first), in one all-reduce (`precompute_scales`), so every
rank, tp rank included, casts with the scale of the whole tensor. Rowwise scales need the whole row, so rowwise
gathers in the training precision and casts after the gather. Under tensor parallelism hfdist's local-tensor
linears compute in float8 with the same scales as one process would (hfdist.parallel.float8_tp).

Order in the recipe (hfdist.parallel.parallelize): convert on the meta model first, then TP, activation
checkpointing, compile, pipeline split and FSDP2 see float8 linears like any nn.Linear.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from hfdist.config.finetune import FP8_RECIPES
from hfdist.models.registry import facts_for, is_supported
from hfdist.parallel.float8_check import converts

__all__ = ["float8_projections", "convert_to_float8", "is_float8_linear", "precompute_scales", "float8_record",
           "float8_problems"]

def float8_projections(model: nn.Module, tp: int = 1) -> list[nn.Module]:
    """The linears of `model` that `converts` picks, in every decoder layer it holds (a whole causal LM, a pipeline
    stage, an FSDP2- or TP-wrapped one alike); none for an architecture outside the registry."""
    from hfdist.parallel.fsdp import is_instance_of_named

    if not is_supported(model):
        return []
    facts = facts_for(model)
    return [linear for layer in model.modules() if is_instance_of_named(layer, facts.decoder_layer)
            for name in facts.linears if isinstance(linear := layer.get_submodule(name), nn.Linear)
            and converts(name, linear.in_features, linear.out_features, facts, tp)]


def _config(recipe: str, all_gather: bool):
    """torchao's configuration of a recipe, with FSDP2's float8 all-gather on or off."""
    from dataclasses import replace

    from torchao.float8 import Float8LinearConfig

    return replace(Float8LinearConfig.from_recipe_name(recipe), enable_fsdp_float8_all_gather=all_gather)


def convert_to_float8(model: nn.Module, recipe: str, *, tp: int = 1, all_gather: bool = False) -> int:
    """Swap the linears `converts` picks for torchao's Float8Linear, in place (on the meta device too: the weights
    are the same Parameters, so loading and sharding work as before). Returns how many converted.

    Args:
        recipe: one of FP8_RECIPES.
        tp: the tensor-parallel degree the model will be split over (the rule checks the local dims).
        all_gather: wrap each converted weight for FSDP2's float8 all-gather (tensorwise only).
    """
    from torchao.float8 import convert_to_float8_training

    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8 recipe must be one of {FP8_RECIPES}, got {recipe!r}")
    picked = {id(m) for m in float8_projections(model, tp)}
    convert_to_float8_training(model, module_filter_fn=lambda module, name: id(module) in picked,
                               config=_config(recipe, all_gather))
    return len(picked)


def is_float8_linear(module: nn.Module) -> bool:
    """Whether `module` is torchao's Float8Linear (without importing torchao into runs that never use it)."""
    linear = sys.modules.get("torchao.float8.float8_linear")
    return linear is not None and isinstance(module, linear.Float8Linear)


def _gathered_in_float8(module: nn.Module) -> bool:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    weight = module.weight
    return isinstance(getattr(weight, "_local_tensor", weight), WeightWithDynamicFloat8CastTensor)


@torch.no_grad()
def precompute_scales(model: nn.Module) -> None:
    """The float8 scales of every FSDP2-gathered float8 weight of `model`, from the full tensors' amax, in one
    all-reduce over the weights' mesh (dp and tp): run after every optimizer step and once before the first, so each
    all-gather casts with the scale one process would compute. A no-op without float8 all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def float8_record(model: nn.Module) -> dict[str, Any]:
    """What one rank computes in float8, for hfdist_summary.json: {"fp8_layers": float8 linears held,
    "fp8_recipe": e.g. "tensorwise" (from their cast settings), "fp8_all_gather_dtype": the dtype FSDP2 gathers
    their weights in (None: not gathered)}."""
    layers = [m for m in model.modules() if is_float8_linear(m)]
    recipe = None
    if layers:
        from torchao.float8.config import ScalingGranularity

        granularity = layers[0].config.cast_config_weight.scaling_granularity
        recipe = "rowwise" if granularity is ScalingGranularity.AXISWISE else "tensorwise"
    gathered = None
    if layers and _gathered_in_float8(layers[0]):
        gathered = str(layers[0].config.cast_config_weight.target_dtype).removeprefix("torch.")
    return {"fp8_layers": len(layers), "fp8_recipe": recipe, "fp8_all_gather_dtype": gathered}


def float8_problems(model: nn.Module, recipe: str | None, tp: int, all_gather: bool) -> list[str]:
    """Why `model` (this rank's part of it) does not compute as `--fp8 recipe` asks (empty: it does): every
    projection the rule picks is a float8 linear of the recipe, its weight gathered in float8 exactly where FSDP2
    should (`all_gather`); without --fp8 (`recipe` None), no float8 linear at all."""
    record = float8_record(model)
    if recipe is None:
        return [f"{record['fp8_layers']} float8 linears although --fp8 was not given"] if record["fp8_layers"] else []
    picked = float8_projections(model, tp)
    plain = sum(not is_float8_linear(m) for m in picked)
    problems = []
    if plain or not picked or record["fp8_layers"] != len(picked):
        problems.append(f"{len(picked) - plain} of the {len(picked)} decoder projections the rule picks are float8 "
                        f"linears ({record['fp8_layers']} float8 linears in all)")
    elif record["fp8_recipe"] != recipe:
        problems.append(f"the float8 linears scale {record['fp8_recipe']}, not {recipe}")
    gathered = record["fp8_all_gather_dtype"]
    if all_gather and gathered is None:
        problems.append("FSDP2 gathers their weights in the training precision, not in float8")
    elif not all_gather and gathered is not None:
        problems.append(f"FSDP2 gathers their weights in {gathered} where it should not")
    return problems
