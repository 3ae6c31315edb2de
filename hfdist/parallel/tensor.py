"""Tensor parallelism (Megatron-style, through DTensor) for HF causal LMs of the registered architectures
(hfdist.models.registry: Llama, Mistral, Qwen2, Qwen3, SmolLM3), with or without LoRA.

The plan is data: `tp_plan` maps module globs of a causal LM to `torch.distributed.tensor.parallel` styles, built
from the registry's facts (which projections are column- or row-split and which norms work per head, as
transformers' `base_model_tp_plan` says; which norms sit on the residual stream); `apply_tp` validates the model, then hands the plan to `parallelize_module`. Nothing here re-implements a
collective: every all-reduce, all-gather and reduce-scatter is a DTensor redistribution or, inside a layer under
sequence parallelism, the torch functional collective that a redistribution runs (tensor_styles says why).

Layout (tp = mesh size, "residual" = Shard(1) on the sequence dim with sequence parallel, else Replicate):
- embed_tokens: ColwiseParallel (hidden dim split), output redistributed to the residual layout. With tied
  embeddings it is vocab-parallel instead (RowwiseParallel), because it then shares lm_head's vocab-split weight;
- q/k/v/gate/up: LocalLinear(split=0), column-split, so each rank holds heads/tp query heads and kv_heads/tp
  key/value heads. transformers 5.23's LlamaAttention reshapes with `view(*input_shape, -1, head_dim)` and
  `reshape(*input_shape, -1)` and only keeps the ratio `num_key_value_groups`, which tp leaves unchanged, so no
  head count on the module has to be patched;
- o/down: LocalLinear(split=1), row-split, its partial sums reduced into a local shard of the residual layout
  (all-reduce, or reduce-scatter under sequence parallel), bias added after the sum;
- decoder layers: LocalResidual, attention / mlp inputs: GatherSequence (all-gather under sequence parallel; in
  backward the one reduction of the block's input gradient);
- input_layernorm / post_attention_layernorm / norm: LocalNorm on the local shard (1/tp of the tokens under
  sequence parallel, all of them without), weight replicated;
- per-head norms (Qwen3's q_norm / k_norm): LocalNorm on the rank's heads; their replicated weight gets the sum of
  every rank's gradient;
- lm_head: ColwiseParallel on the vocab dim; with loss parallelism its output stays a vocab-sharded DTensor that
  `tp_causal_lm_loss` feeds to cross-entropy under `loss_parallel()`, so no rank materialises full logits.

Inside a decoder layer every activation is a local tensor and every module computes with local views of its
DTensor parameters (no per-op DTensor dispatch; hfdist.parallel.tensor_styles). Between layers the residual stream
is a DTensor because HF's LlamaModel derives position ids and the causal mask from `inputs_embeds.shape[1]`: a
DTensor reports the global sequence length even when its local shard holds 1/tp of it.

Every parameter ends up a DTensor on the tp mesh (Replicate where not sharded). That keeps
`torch.nn.utils.clip_grad_norm_` and FSDP2 on one mesh: a mix of DTensor and plain-tensor gradients is what breaks
clipping under TP. Replicated weights whose gradient on a rank is a partial sum (norms under sequence parallel,
per-head norms, LoRA's unsplit A or B, row-split biases under sequence parallel) are summed in one all-reduce when
each backward finishes (tensor_styles.PartialGradReducer; FSDP2 reduces them itself).

Order of steps in a training script (mesh = ParallelDims(...).build_mesh(device_type), axes ("dp_shard", "tp")):
    validate_tp(config, dims.tp)                 # before building anything big
    model = get_peft_model(model, lora_config)   # optional: LoRA before TP, so its A/B matrices get split too
    apply_tp(model, mesh["tp"])
    apply_fsdp(model, mesh["dp_shard"])          # fully_shard per decoder layer + root, same mesh
    optimizer = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)
    with loss_parallel():
        loss = tp_causal_lm_loss(model, batch, num_items_in_batch)
        (loss * dp).backward()                   # dp: undo FSDP's gradient averaging, as with a global token count
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm); optimizer.step()
    state = gather_full_state_dict(model)        # all ranks; then rank 0: model.save_pretrained(dir, state_dict=state)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from hfdist.models.chunked_loss import DEFAULT_LOSS_CHUNK_SIZE, VocabShardedLogitsError, causal_lm_loss
from hfdist.models.registry import ModelFacts, facts_for
from hfdist.parallel.expert import is_expert_param
from hfdist.parallel.tensor_check import TPError, valid_tp_degrees, validate_tp
from hfdist.parallel.tensor_styles import (
    GatherSequence,
    LocalLinear,
    LocalNorm,
    LocalResidual,
    PartialGradReducer,
    ReduceOutput,
    SequenceSpec,
)

__all__ = [
    "TPError",
    "valid_tp_degrees",
    "validate_tp",
    "tp_plan",
    "apply_tp",
    "tp_causal_lm_loss",
    "gather_full_state_dict",
    "count_tp_collectives",
]


def _lora_entries(path: str, colwise: bool, residual: Placement,
                  reducer: PartialGradReducer) -> dict[str, ParallelStyle]:
    """Styles for a LoRA-wrapped linear at `path`: base layer as without LoRA, A/B chosen so B(A(x)) matches it.

    Column-split base (y_local = x W_local^T): A stays replicated, B is split like the base's output dim.
    Row-split base (x is split on its last dim): A is split on its input dim, so A x is a partial sum, and B, being
    linear, maps it to a partial sum of the output; the wrapper sums base + adapter over tp once (ReduceOutput).
    """
    if colwise:
        return {f"{path}.base_layer": LocalLinear(split=0), f"{path}.lora_A.*": LocalLinear(split=None, reducer=reducer),
                f"{path}.lora_B.*": LocalLinear(split=0)}
    return {
        f"{path}.base_layer": LocalLinear(split=1),
        f"{path}.lora_A.*": LocalLinear(split=1),
        f"{path}.lora_B.*": LocalLinear(split=None, reducer=reducer),
        path: ReduceOutput(reduce_to=residual, reducer=reducer),
    }


def tp_plan(
    facts: ModelFacts,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    tied_embeddings: bool = False,
    lora_targets: frozenset[str] = frozenset(),
    config=None,
) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of an architecture: module glob (relative to the causal LM) -> parallel style.

    Args:
        sequence_parallel: shard the norms' activations on the sequence dim (all-gather + reduce-scatter per block
            instead of all-reduce). Any sequence length works; DTensor shards uneven lengths unevenly.
        loss_parallel: keep lm_head's output vocab-sharded for `tp_causal_lm_loss`; otherwise gather full logits.
        tied_embeddings: the input embedding shares lm_head's weight (config.tie_word_embeddings).
        lora_targets: short names of the projections wrapped by peft LoRA layers.
        config: the model's config; an MoE model's MLP side is planned per layer from it
            (hfdist.parallel.expert.moe_tp_plan).
    """
    residual = Shard(1) if sequence_parallel else Replicate()
    # A norm's weight gradient is a partial sum where the norm sees 1/tp of the tokens (sequence parallel); without
    # sequence parallel every rank sees all tokens and computes the same gradient.
    reducer = PartialGradReducer()
    norm = LocalNorm(weight_grad=Partial() if sequence_parallel else Replicate(), reducer=reducer)
    spec = SequenceSpec()  # the running layer's residual shape, shared by the styles below (see tensor_styles)
    layer = f"{facts.layers}.*"
    if tied_embeddings:
        # lm_head must split the vocab dim, so a weight shared with it is vocab-split too. torch 2.13's DTensor
        # has no vocab-sharded strategy for the embedding backward: this weight's gradient arrives unsharded.
        embed: ParallelStyle = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual,
                                               use_local_output=False)
    else:
        # Split on the hidden dim: the weight and its gradient are both 1/tp per rank, the backward needs no
        # collective of its own.
        embed = ColwiseParallel(input_layouts=Replicate(), output_layouts=residual, use_local_output=False)
    plan: dict[str, ParallelStyle] = {
        facts.embed: embed,
        # Between layers a DTensor (HF reads the global sequence length from it), inside a layer local tensors.
        layer: LocalResidual(residual, spec),
        **{f"{layer}.{norm_name}": norm for norm_name in facts.layer_norms},
        # Attention and the MLP compute on the full sequence.
        f"{layer}.self_attn": GatherSequence(residual, spec),
        **({f"{layer}.mlp": GatherSequence(residual, spec)} if facts.moe is None else {}),
        # (batch, seq, heads, head_dim) with this rank's heads: each rank's weight gradient covers its heads only.
        **{f"{layer}.{head_norm}": LocalNorm(weight_grad=Partial(), reducer=reducer) for head_norm in facts.head_norms},
        facts.final_norm: norm,
        facts.head: ColwiseParallel(input_layouts=residual,
                                    output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                    use_local_output=not loss_parallel),
    }
    def linear(path: str, colwise: bool) -> dict[str, ParallelStyle]:
        if path.split(".")[-1] in lora_targets:
            return _lora_entries(path, colwise, residual, reducer)
        if colwise:
            return {path: LocalLinear(split=0)}
        return {path: LocalLinear(split=1, reduce_to=residual, reducer=reducer)}  # partial sums -> residual shard

    for name in facts.linears:
        plan.update(linear(f"{layer}.{name}", name in facts.colwise))
    if facts.moe is not None:  # an MoE block routes the rank's own tokens (no gather); dense MLPs as usual
        from hfdist.parallel.expert import moe_tp_plan

        plan.update(moe_tp_plan(config, facts, {"gather": GatherSequence(residual, spec), "linear": linear,
                                                "router": LocalNorm(weight_grad=Partial(), reducer=reducer)}))
    return plan


def _causal_lm(model: nn.Module) -> tuple[nn.Module, ModelFacts]:
    """The causal LM inside `model` (itself, or the base model of a peft wrapper) and its registry entry."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(inner, "lm_head"):
        raise TPError(f"hfdist's tensor-parallel plan splits a causal LM with an lm_head; got {type(inner).__name__}.")
    return inner, facts_for(inner, "Tensor parallelism")


def _lora_targets(causal_lm: nn.Module, facts: ModelFacts) -> frozenset[str]:
    """Names of the decoder linears wrapped by LoRA, checked to be the same in every layer and plan-compatible."""
    per_layer = []
    for layer in causal_lm.get_submodule(facts.layers):
        wrapped = set()
        for name in facts.linears:
            module = layer.get_submodule(name)
            if hasattr(module, "base_layer"):
                if not hasattr(module, "lora_A") or any(getattr(module, "lora_variant", {}).values()):
                    raise TPError(f"{name} carries a peft adapter other than plain LoRA ({type(module).__name__}); "
                                  "only plain LoRA (no DoRA, no other tuners) is split by the tensor-parallel plan.")
                if any(isinstance(drop, nn.Dropout) and drop.p > 0 for drop in module.lora_dropout.values()):
                    raise TPError(f"{name} has LoRA dropout > 0; under tensor parallelism each rank would drop "
                                  "different entries of the same replicated input, which is not the single-"
                                  "process computation. Set lora_dropout=0 (hfdist's own LoRA uses 0).")
                wrapped.add(name.split(".")[-1])
        per_layer.append(frozenset(wrapped))
    for extra in (facts.embed, facts.head):
        if hasattr(causal_lm.get_submodule(extra), "base_layer"):
            raise TPError(f"LoRA on {extra} is not supported with tensor parallelism; target only the decoder-layer "
                          "linears (q/k/v/o/gate/up/down_proj).")
    if len(set(per_layer)) > 1:
        raise TPError("LoRA targets differ between decoder layers (peft layers_to_transform?); the tensor-parallel "
                      "plan needs the same targets in every layer.")
    targets = per_layer[0] if per_layer else frozenset()
    if facts.moe is not None:  # an MoE model's dense MLPs and shared expert, wherever they are
        targets |= {path.split(".")[-1] for path, m in causal_lm.named_modules() if hasattr(m, "lora_A")
                    and path.split(".")[-1] in ("gate_proj", "up_proj", "down_proj")}
    return targets


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = True, loss_parallel: bool = True
) -> nn.Module:
    """Split a causal LM of a registered architecture (or a peft LoRA PeftModel around one) across `tp_mesh`, in
    place.

    Apply before FSDP (`fully_shard` on the dp_shard sub-mesh of the same mesh) and before building the optimizer.
    All ranks must hold identical weights (same seed or same checkpoint): sharded weights are scattered from the
    mesh's first rank, replicated norm weights are used as they are.

    Args:
        model: a causal LM, or a `PeftModel` with LoRA on any of q/k/v/o/gate/up/down_proj.
        tp_mesh: 1-D DeviceMesh of the tensor-parallel ranks (`mesh["tp"]` of a multi-axis mesh).
        sequence_parallel: see `tp_plan`.
        loss_parallel: see `tp_plan`; compute the loss with `tp_causal_lm_loss` under `loss_parallel()`.

    Returns:
        The same `model`, its parameters now DTensors on `tp_mesh`.
    """
    if tp_mesh.ndim != 1:
        raise TPError(f"apply_tp needs the 1-D tensor-parallel sub-mesh (mesh['tp']), got a {tp_mesh.ndim}-D mesh "
                      f"with axes {tp_mesh.mesh_dim_names}.")
    causal_lm, facts = _causal_lm(model)
    validate_tp(causal_lm.config, tp_mesh.size())
    if any(isinstance(p, DTensor) for p in causal_lm.parameters()):
        raise TPError("The model already holds DTensor parameters: apply_tp must run once, before FSDP.")
    tied = causal_lm.lm_head.weight is causal_lm.model.embed_tokens.weight
    if facts.moe is not None and not sequence_parallel:
        raise TPError("An MoE model's blocks route each tp rank's own sequence shard: tensor parallelism on it needs "
                      "sequence_parallel=True.")
    plan = tp_plan(facts, sequence_parallel, loss_parallel, tied, _lora_targets(causal_lm, facts), causal_lm.config)
    frozen = {name for name, p in causal_lm.named_parameters() if not p.requires_grad}
    parallelize_module(causal_lm, tp_mesh, plan)
    # SequenceParallel (torch 2.13) re-registers norm weights with requires_grad=True; frozen LoRA bases stay frozen.
    for name, p in causal_lm.named_parameters():
        p.requires_grad_(name not in frozen)
    if tied:
        # Each style registers its own Parameter; both shard the vocab dim (Shard(0)), so the tie can be restored.
        causal_lm.lm_head.weight = causal_lm.model.embed_tokens.weight
    # Routed experts are not split by tp: hfdist.parallel.expert places them (over ep, FSDP2 over dp x tp).
    plain = [name for name, p in causal_lm.named_parameters() if not isinstance(p, DTensor)
             and not is_expert_param(name)]
    if plain:
        raise TPError(f"The tensor-parallel plan left parameters unsplit and unreplicated: {plain[:5]}; this model "
                      f"has modules the {facts.model_type} plan does not know.")
    return model


def tp_causal_lm_loss(
    model: nn.Module, batch: Mapping[str, torch.Tensor], num_items_in_batch: int | torch.Tensor | None = None,
    chunk_size: int | None = DEFAULT_LOSS_CHUNK_SIZE, fused: bool = True,
) -> torch.Tensor:
    """Causal-LM loss of a tensor-parallel model: sum of token cross-entropies / `num_items_in_batch`.

    hfdist.models.chunked_loss.causal_lm_loss: the model's own forward (so FSDP2's root hooks run) with lm_head
    called per chunk of `chunk_size` sequence positions, never on the whole batch. Labels are shifted as HF does
    (pad with -100, drop the first position); -100 is ignored. With vocab-sharded logits
    (apply_tp(loss_parallel=True)) each chunk's logits stay vocab-sharded, and both this call and
    `loss.backward()` must run inside `torch.distributed.tensor.parallel.loss_parallel()`; also correct on a model
    without TP.

    Args:
        model: the model given to `apply_tp` (causal LM or PeftModel), possibly also FSDP-wrapped.
        batch: `input_ids`, optional `labels` (default: input_ids), and any other model inputs
            (`attention_mask`, `position_ids`, ...; hfdist.data.collate's output as it is). Every other key goes
            along: a packed batch's attention inputs keep its documents apart under TP as well.
        num_items_in_batch: global count of target tokens (hfdist.models.loss.count_loss_tokens summed over gradient-accumulation
            steps and data-parallel ranks). None: this batch's own count, i.e. a plain mean. When it is the
            global count and data-parallel gradients are averaged (FSDP2's default), scale the loss by the
            data-parallel degree before backward, as HF Trainer does.
        chunk_size: sequence positions per lm_head + cross-entropy chunk; None: the whole sequence at once.
        fused: the fused vocab-parallel loss (hfdist.models.fused_loss: its own two all-reduces per chunk, no
            `loss_parallel()` needed); False: lm_head's vocab-sharded logits per chunk under `loss_parallel()`, the
            path taken wherever the fused loss does not apply (an adapter on lm_head).

    Returns:
        A plain scalar tensor, identical on every tp rank.

    Raises:
        TPError: vocab-sharded logits outside `loss_parallel()` (fused=False, or a head the fused loss refuses).
    """
    try:
        return causal_lm_loss(model, batch, num_items_in_batch, chunk_size, fused)
    except VocabShardedLogitsError as exc:
        raise TPError(str(exc)) from exc


def gather_full_state_dict(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded state dict (CPU tensors) on rank 0, an empty dict elsewhere; every rank must call it.

    Works for TP, FSDP2 and FSDP2 x TP models. Pass the result to `save_pretrained(dir, state_dict=...)` on rank 0
    for a normal HF checkpoint (or, with `trainable_only=True` on a PeftModel, a normal LoRA adapter).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options)


def count_tp_collectives(model: nn.Module, batch: Mapping[str, torch.Tensor],
                         fused: bool = True) -> dict[str, dict[str, dict[str, int]]]:
    """Collectives issued by one forward + backward of `tp_causal_lm_loss(fused=fused)`, per module, via
    CommDebugMode (which names the fused loss's own process-group all-reduces `allreduce_`, DTensor's `all_reduce`).

    Returns {module fqn: {"forward": {collective: count}, "backward": {...}}}; fqns are those of CommDebugMode
    ("Global" for the whole step, then e.g. "LlamaForCausalLM.model.layers.0"). Runs under loss_parallel(), so it
    also works when lm_head's output is vocab-sharded. Gradients are accumulated into `.grad` as by a training step.
    """
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel

    comm_mode = CommDebugMode()
    with warnings.catch_warnings():
        # CommDebugMode hooks every module; HF modules returning ModelOutput make torch warn that backward hooks
        # cannot fire on them, which is irrelevant to counting.
        warnings.filterwarnings("ignore", message=".*backward hook", category=UserWarning)
        with comm_mode, loss_parallel():
            tp_causal_lm_loss(model, batch, fused=fused).backward()
    return {
        fqn: {phase: {str(op).split(".")[-1]: n for op, n in ops.items()} for phase, ops in counts.items()}
        for fqn, counts in comm_mode.comm_module_counts.items()
    }
