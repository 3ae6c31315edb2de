"""Mixture-of-experts checks that need no torch and no process group: does this rung hold this model's experts, does
ep divide them, is every option asked for built for an MoE model? Read by the launcher's pre-checks
(hfdist.parallel.fit) and the planner before anything starts; each failure one paragraph naming the fix.
"""

from __future__ import annotations

from typing import Any

from hfdist.errors import HfdistError
from hfdist.models.moe_facts import MoeFacts

__all__ = ["ExpertParallelError", "moe_facts", "moe_refusal", "check_ep_degree", "check_moe", "check_moe_compile",
           "valid_ep_degrees"]


class ExpertParallelError(HfdistError, ValueError):
    """A model, rung or degree that hfdist's expert parallelism cannot run."""


def moe_facts(config: Any) -> MoeFacts | None:
    """The MoE facts of a config's architecture (hfdist.models.registry), None for a dense or unknown one."""
    from hfdist.models.registry import REGISTRY

    facts = REGISTRY.get(getattr(config, "model_type", None))
    return facts.moe if facts is not None else None


def valid_ep_degrees(config: Any, dp_shard: int | None = None) -> list[int]:
    """The ep degrees that split the model's experts into whole experts per rank (and divide `dp_shard` when given:
    ep borrows its ranks from the ones FSDP2 shards over)."""
    facts = moe_facts(config)
    if facts is None:
        return [1]
    experts = facts.num_experts(config)
    return [d for d in range(1, experts + 1) if experts % d == 0 and (dp_shard is None or dp_shard % d == 0)]


def check_ep_degree(config: Any, facts: MoeFacts, ep: int) -> None:
    """Raise ExpertParallelError unless `ep` splits the experts into whole experts per rank."""
    experts = facts.num_experts(config)
    if ep < 1 or experts % ep:
        raise ExpertParallelError(
            f"Expert parallelism with ep={ep} cannot split this model's {experts} experts per MoE layer "
            f"({facts.experts_field}={experts}) into whole experts per rank: ep must divide {experts}. Degrees that "
            f"would work: {valid_ep_degrees(config)}.")


def moe_refusal(rung) -> str | None:
    """Why the rung table says `rung` does not train MoE models (the entry of its layout:
    hfdist.config.features.speaking_entry), or None where it does."""
    from hfdist.config.features import speaking_entry
    from hfdist.config.rungs import RUNG_INFO

    name = speaking_entry(rung)
    verdict = RUNG_INFO[name].moe if name is not None else False
    if verdict is True:
        return None
    return verdict or "hfdist has not built or verified mixture-of-experts training on its layout"


def _check_rung_holds_moe(config: Any, rung) -> None:
    """Refuse a rung the table says does not hold MoE models."""
    from hfdist.config.rungs import rungs_where

    why = moe_refusal(rung)
    if why is None:
        return
    raise ExpertParallelError(
        f"{rung.name} cannot train the mixture-of-experts model '{getattr(config, 'model_type', '?')}': {why}. Use a "
        f"rung that holds MoE models: {', '.join(rungs_where(moe=True))}.")


def check_moe(config: Any, rung, seq_len: int | None = None, *, qlora: bool = False,
              simulated_step: bool = False) -> None:
    """An MoE model against the rung and the options, and ep against a dense model, before any process starts.

    Raises:
        ExpertParallelError: ep on a dense model, or ep not dividing the experts or the FSDP ranks; a rung whose
        table entry does not hold MoE (hfdist.config.rungs: `moe`); --qlora on an MoE model; a Llama 4 sequence
        longer than its chunked attention's chunk; router jitter under hfdist's experts; a step `hfdist simulate`
        would run on fake tensors.
    """
    facts = moe_facts(config)
    ep = rung.dims.ep
    if facts is None:
        if ep > 1:
            raise ExpertParallelError(
                f"--ep {ep} asks for expert parallelism, but the model is a dense "
                f"'{getattr(config, 'model_type', '?')}' without experts. Drop --ep, or train a mixture-of-experts "
                "model (qwen3_moe, mixtral, llama4_text; e.g. --model qwen3-moe-tiny).")
        return
    _check_rung_holds_moe(config, rung)
    check_ep_degree(config, facts, ep)
    if simulated_step:
        raise ExpertParallelError(
            "hfdist simulate --step runs on fake tensors, which hold no values, and an MoE layer routes each token by "
            "its router's values (how many rows go to each expert). Leave out --step for mixture-of-experts models: "
            "their state bytes are simulated all the same, and `hfdist plan` counts their activations.")
    if ep > 1 and rung.dims.dp_shard % ep:
        raise ExpertParallelError(
            f"--ep {ep} borrows its ranks from the {rung.dims.dp_shard} ranks FSDP2 shards over (dp_shard), which "
            f"{ep} does not divide ({rung.dims.describe()}). Use an ep dividing both {rung.dims.dp_shard} and the "
            f"experts: {valid_ep_degrees(config, rung.dims.dp_shard)}.")
    if (ep > 1 or rung.dims.tp > 1) and rung.dims.dp_replicate > 1:
        raise ExpertParallelError(
            f"dp_replicate={rung.dims.dp_replicate} with hfdist's expert-parallel experts ({rung.dims.describe()}): "
            "their FSDP2 units shard over dp_shard / ep x tp and would not reduce their gradients across the "
            "replicas; not built. Drop --dp-replicate (shard over every data-parallel rank).")
    if qlora:
        raise ExpertParallelError(
            "--qlora on a mixture-of-experts model: hfdist's 4-bit base quantises the decoder's Linear projections, "
            "and the experts (most of an MoE model's weights) are stacked 3-D parameters bitsandbytes has no 4-bit "
            "layer for here, so the base would stay mostly full precision. Use --lora (adapters on the attention "
            "and dense projections, the experts frozen) instead.")
    chunk = getattr(config, "attention_chunk_size", None)
    if facts.layer_rule == "llama4" and chunk is not None and seq_len is not None and seq_len > chunk:
        raise ExpertParallelError(
            f"--seq-len {seq_len} is longer than Llama 4's attention chunk ({chunk} tokens): its chunked-attention "
            "layers would need a chunked document mask, which hfdist's packed batches do not build. Use --seq-len "
            f"<= {chunk}.")
    if float(getattr(config, "router_jitter_noise", 0) or 0) > 0 and (ep > 1 or rung.dims.tp > 1):
        raise ExpertParallelError(
            "router_jitter_noise > 0 draws random noise on each rank's tokens, which hfdist's expert and tensor "
            "parallelism cannot reproduce against one process. Set router_jitter_noise to 0 in the config.")


def check_moe_compile(config: Any, rung) -> None:
    """--compile on an MoE model, refused on every rung: the rung table's fsdp_ep refuses --compile for its experts'
    dispatch, and on the rungs that take --compile for dense models nothing has compared a compiled MoE model with
    its eager run.

    Raises:
        ExpertParallelError: naming the model, the layout and why.
    """
    if moe_facts(config) is None:
        return
    where = ("hfdist's experts compute each MoE layer, and their all-to-all takes split sizes read from the routing "
             "(a host sync) on which the compiler would break the graph" if rung.dims.ep > 1 or rung.dims.tp > 1 else
             "the model's own MoE blocks pick each expert's tokens by data-dependent indexing, on which the compiler "
             "breaks the graph")
    raise ExpertParallelError(
        f"--compile with the mixture-of-experts '{getattr(config, 'model_type', '?')}' on {rung.name} "
        f"({rung.dims.describe()}): {where}; hfdist has not verified a compiled MoE model against its eager run on "
        "any rung. Drop --compile.")
