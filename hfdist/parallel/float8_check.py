"""FP8's rule and checks without torch or a process group (the launcher, the planner): which decoder projections
compute in float8, whether FSDP2 gathers them in float8, and what --fp8 refuses before any process starts.

Kept apart from hfdist.parallel.float8 (torch, torchao) as tensor_check.py is from tensor.py, so `hfdist plan` and
the launcher's checks import nothing heavy. The rule itself (`converts`) is documented in hfdist.parallel.float8.
"""

from __future__ import annotations

from hfdist.config.features import refuse_unless
from hfdist.config.finetune import ConfigError
from hfdist.config.ladder import Rung
from hfdist.models.registry import ModelFacts, facts_for, is_supported

__all__ = ["FP8_DIM_MULTIPLE", "converts", "count_float8_projections", "float8_params_per_layer",
           "gathers_in_float8", "check_fp8"]

# torch._scaled_mm contracts and writes dimensions that are multiples of 16 only: a layer's in- and out-features, and
# the tokens of a matmul (the weight gradient contracts over them: hfdist.job.preflight checks --seq-len).
FP8_DIM_MULTIPLE = 16



def converts(projection: str, in_features: int, out_features: int, facts: ModelFacts, tp: int = 1) -> bool:
    """The one rule for which linears compute in float8 (module docstring): a decoder layer's linear named
    `projection` ("self_attn.q_proj", ...) converts when it is one of the registry's projections of the architecture
    (`facts`) and its in/out features, split over `tp` as hfdist's tensor-parallel plan splits them (column-split:
    out / tp; row-split: in / tp), are multiples of 16."""
    if projection not in facts.linears:
        return False
    if projection in facts.colwise:
        out_features //= tp
    else:
        in_features //= tp
    return out_features % FP8_DIM_MULTIPLE == 0 and in_features % FP8_DIM_MULTIPLE == 0



def _picked_shapes(config, tp: int) -> list[tuple[int, int]]:
    """(in, out) features of the projections of one decoder layer of `config` that the rule converts."""
    facts = facts_for(config, "--fp8")
    shapes = facts.linear_shapes(config)
    return [shapes[name.split(".")[-1]][:2] for name in facts.linears
            if converts(name, *shapes[name.split(".")[-1]][:2], facts, tp)]


def count_float8_projections(config, tp: int = 1) -> tuple[int, int]:
    """(projections the rule converts, decoder projections in all) of a model config, without building it."""
    layers = int(config.num_hidden_layers)
    return len(_picked_shapes(config, tp)) * layers, len(facts_for(config, "--fp8").linears) * layers


def float8_params_per_layer(config, tp: int = 1) -> float:
    """Weight elements of one decoder layer that compute in float8, as a rank holds them under `tp` (the memory
    planner counts FSDP2's float8 all-gather with it)."""
    return sum(i * o for i, o in _picked_shapes(config, tp)) / tp



def gathers_in_float8(recipe: str | None, fsdp_shards: int) -> bool:
    """Whether FSDP2 all-gathers the float8 weights in float8: tensorwise, where FSDP2 shards over more than one
    rank (rowwise scales need whole rows, so rowwise gathers in the training precision)."""
    return recipe == "tensorwise" and fsdp_shards > 1



def check_fp8(recipe: str, rung: Rung, config, *, seq_len: int | None, lora: bool, compile: bool = False,
              mixed_precision: str = "no", on_gpu: bool = True) -> str:
    """Refuse, before any process starts, an FP8 run hfdist has not built: with LoRA, on a rung that does not take
    --fp8, a model of an architecture outside the registry or with no projection the rule converts, a sequence
    length the float8 matmuls cannot contract, or compiled under autocast on a CPU. Returns the one line the run
    prints about what converts. `seq_len`: None where the rows' length is not known yet (hfdist.api.prepare_model).

    Raises:
        ConfigError: one paragraph naming the problem and the fix.
    """
    if lora:
        raise ConfigError("--fp8 does not run with --lora: hfdist converts the decoder projections a full fine-tune "
                          "trains, and has not built or verified float8 matmuls inside peft's LoRA layers (a frozen "
                          "base beside bf16 adapters). Drop --lora to fine-tune every weight in FP8, or drop --fp8 "
                          "to train LoRA in bf16.")
    refuse_unless(rung, "fp8")  # the rung table says which rungs take --fp8
    if compile and mixed_precision == "bf16" and not rung.owns_sharding and not on_gpu:
        raise ConfigError(f"--fp8 with --compile does not run on {rung.name} in bf16 on a CPU: {rung.name} computes in "
                          "bf16 through autocast over fp32 weights, and inductor's CPU kernels for that graph give NaN "
                          "gradients in the float8 attention projections (measured with torch 2.13; eager, and "
                          "bf16 through FSDP2's policy, are fine). Drop --compile or --mixed-precision bf16, or use an "
                          "FSDP2 rung (fsdp_full_shard on one or more processes), or a GPU.")
    if not is_supported(config):
        facts_for(config, "--fp8 (which decoder projections compute in float8)")  # raises, naming the supported ones
    picked, total = count_float8_projections(config, rung.dims.tp)
    if not picked:
        raise ConfigError(f"--fp8 would change nothing on this model: none of its {total} decoder projections has in- "
                          f"and out-features that are multiples of {FP8_DIM_MULTIPLE} (after the tp = {rung.dims.tp} "
                          "split), which float8 matmuls need. Drop --fp8, or use a model (or --tp) where they are.")
    if seq_len is not None and seq_len % FP8_DIM_MULTIPLE:
        raise ConfigError(f"--fp8 needs --seq-len to be a multiple of {FP8_DIM_MULTIPLE}: the weight gradient's "
                          f"float8 matmul contracts over a micro-batch's tokens. Use --seq-len "
                          f"{-(-seq_len // FP8_DIM_MULTIPLE) * FP8_DIM_MULTIPLE}.")
    return (f"hfdist: fp8 ({recipe}): {picked} of the {total} decoder projections compute in float8 (lm_head, "
            "embedding, attention and norms in the training precision; docs/fp8.md)")
