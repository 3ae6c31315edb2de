"""One pipeline stage of a HF causal LM of a registered architecture (hfdist.models.registry) as a plain nn.Module.

A stage holds references to the original model's submodules (no copies), keyed so that its parameter names
map back to the original ones by a fixed prefix rule: `layers.7.mlp.up_proj.weight` is the stage's name for the
original `model.layers.7.mlp.up_proj.weight`. Because the stage is a plain module whose decoder layers sit in
`stage.layers`, FSDP2 `fully_shard` (on a dp mesh) and TP `parallelize_module` (on a tp mesh) can be applied to it
after splitting, exactly as to a whole model; that is the hook 3D parallelism builds on.
"""

from __future__ import annotations

import torch
from torch import nn

from hfdist.errors import HfdistError
from hfdist.models.chunked_loss import DEFAULT_LOSS_CHUNK_SIZE, chunked_token_sum_cross_entropy
from hfdist.models.registry import facts_for, is_supported

__all__ = ["PipelineModelError", "CausalLMStage", "find_causal_lm", "build_stage_module"]


class PipelineModelError(HfdistError, ValueError):
    """A model, or a stage request, that the stage split cannot handle."""


def find_causal_lm(model: nn.Module) -> tuple[str, nn.Module]:
    """The causal LM inside `model` and its name prefix there.

    `model` may be a causal LM (prefix "") or a wrapper that holds one, such as a peft PeftModel
    (prefix "base_model.model."), so LoRA adapters injected before the split stay in the stage modules.

    Raises:
        PipelineModelError: no submodule of a registered architecture with the `model.embed_tokens` /
            `model.layers` / `lm_head` layout.
    """
    for name, module in model.named_modules():
        # Registered children only: wrappers such as PeftModel forward attribute lookups to the model they hold,
        # which would make the wrapper itself look like the causal LM (with the wrong name prefix).
        inner = module._modules.get("model")
        if ("lm_head" in module._modules and inner is not None
                and all(a in inner._modules for a in ("embed_tokens", "layers", "norm", "rotary_emb"))):
            if not is_supported(module.config):
                facts_for(module.config, "The pipeline split")  # raises, naming the supported architectures
            return (name + "." if name else ""), module
    raise PipelineModelError(
        f"{type(model).__name__} is not a HF causal LM with model.embed_tokens, model.layers, model.norm, "
        "model.rotary_emb and lm_head: hfdist's pipeline split needs that layout (hfdist.models.registry)."
    )


class CausalLMStage(nn.Module):
    """Stage `stage_index` of `num_stages`: [embed] + decoder layers in `layer_range` + [norm + lm_head].

    forward(x, attention_mask=None, position_ids=None, loss_target=None): x is input_ids (B, S) on the first stage
    and hidden states (B, S, H) elsewhere; the output is hidden states, or on the last stage the summed fp32 token
    cross-entropy against `loss_target` (shifted labels, B x S), computed `loss_chunk_size` sequence positions at a
    time and fused unless `fused_loss` is False (hfdist.models.chunked_loss: the micro-batch's whole logits never
    exist; the fused loss computes lm_head's gradients in the forward), or logits (B, S, V) when no target is
    given. Other stages ignore `loss_target`.
    Every stage rebuilds the attention masks (full or sliding per layer, as the registry says) from the 2-D
    attention_mask, or takes a 4-D one (packed documents, hfdist.data.collate) as given, and the rotary
    embeddings from the position ids (arange(S) by default, as the HF model does), so only the hidden states cross
    stage boundaries. Under an implementation that takes document boundaries (hfdist_documents, flash varlen) the
    packed documents' varlen arguments are rebuilt from the micro-batch's position ids (the batch's own describe all
    micro-batches and cannot be split with them; under context parallelism from the whole rows' position ids the
    runner passes beside the rank's part of them); under flex_attention the BlockMask is built from them too.

    Attributes:
        layers: ModuleDict of this stage's decoder layers keyed by their global index (as strings).
        embed_tokens, norm, lm_head: the original modules, or None when another stage owns them.
        name_prefix: where the causal LM sits in the model the stage was cut from ("" or "base_model.model.").
        loss_chunk_size: sequence positions per lm_head + cross-entropy chunk on the last stage (None: the whole
            sequence).
        fused_loss: whether the last stage's loss computes its gradients in the forward (the default) or
            recomputes each chunk's logits in backward.
    """

    def __init__(self, lm: nn.Module, stage_index: int, num_stages: int, layer_range: range, name_prefix: str = ""):
        super().__init__()
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.layer_range = layer_range
        self.name_prefix = name_prefix
        self.config = lm.config
        self.embed_tokens = lm.model.embed_tokens if self.is_first else None
        self.layers = nn.ModuleDict({str(i): lm.model.layers[i] for i in layer_range})
        self.norm = lm.model.norm if self.is_last else None
        self.lm_head = lm.lm_head if self.is_last else None
        # Parameter-free (its inv_freq buffer is non-persistent), so every stage can share the one module.
        self.rotary_emb = lm.model.rotary_emb
        self.mask_kinds = facts_for(lm.config).mask_kinds(lm.config)
        self.loss_chunk_size: int | None = DEFAULT_LOSS_CHUNK_SIZE
        self.fused_loss = True

    @property
    def is_first(self) -> bool:
        """Whether this stage takes input_ids (and owns the embedding)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage produces logits (and owns the final norm and lm_head)."""
        return self.stage_index == self.num_stages - 1

    @property
    def decoder_layers(self) -> list[nn.Module]:
        """This stage's decoder layers in order: the units for FSDP wrapping, TP plans and activation checkpointing."""
        return list(self.layers.values())

    def original_name(self, local_name: str) -> str:
        """The name a stage parameter or buffer has in the model the stage was cut from."""
        head = local_name.split(".", 1)[0]
        if head in ("embed_tokens", "layers", "norm"):
            return f"{self.name_prefix}model.{local_name}"
        if head == "lm_head":
            return f"{self.name_prefix}{local_name}"
        raise PipelineModelError(f"Stage entry '{local_name}' has no counterpart in the original model.")

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, loss_target: torch.Tensor | None = None,
                row_position_ids: torch.Tensor | None = None,
                logit_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage on one micro-batch (see the class docstring for shapes; `row_position_ids`: under context
        parallelism, the whole rows' position ids, whose document boundaries the attention reads; with
        `logit_positions`, (B,), the last stage returns the whole logits of those positions only, (B, V): what
        generation reads)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # The calls the HF model's forward makes, so padding masks and attention backends behave as in one process.
        kwargs = dict(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask, past_key_values=None,
                      position_ids=position_ids)
        builders = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        masks = {kind: builders[kind](**kwargs) for kind in {self.mask_kinds[i] for i in self.layer_range}}
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        documents = self._varlen_documents(attention_mask, position_ids if row_position_ids is None else
                                           row_position_ids, hidden.shape[0])
        for index, layer in self.layers.items():
            hidden = layer(hidden, attention_mask=masks[self.mask_kinds[int(index)]],
                           position_embeddings=position_embeddings, position_ids=position_ids, **documents)
        if self.lm_head is None:
            return hidden
        if logit_positions is not None:
            return self._logits_at(self.norm(hidden), logit_positions)
        if loss_target is None:
            return self.lm_head(self.norm(hidden))
        # Inside the stage's forward, so FSDP2's unsharded lm_head and TP's hooks on it serve every chunk.
        return chunked_token_sum_cross_entropy(self.lm_head, self.norm(hidden), loss_target, self.loss_chunk_size,
                                               self.fused_loss)


    def _logits_at(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """lm_head on row b's hidden state at positions[b], as a plain (B, V) tensor of the whole vocabulary; under
        tensor parallelism the picked states enter lm_head replicated and its vocab-sharded output is gathered."""
        from torch.distributed.tensor import DTensor, Replicate

        mesh = hidden.device_mesh if isinstance(hidden, DTensor) else None
        whole = hidden.full_tensor() if mesh is not None else hidden
        picked = whole[torch.arange(len(positions), device=whole.device), positions.to(whole.device)][:, None]
        weight = self.lm_head.weight
        if isinstance(weight, DTensor):
            picked = DTensor.from_local(picked, mesh or weight.device_mesh, [Replicate()], run_check=False)
        logits = self.lm_head(picked)
        return (logits.full_tensor() if isinstance(logits, DTensor) else logits)[:, 0]

    def _varlen_documents(self, attention_mask: torch.Tensor | None, position_ids: torch.Tensor, batch: int) -> dict:
        """The varlen arguments from the position ids (each row's documents; a row without packing is one document),
        or {} for mask-based attention (under cp: the attention the cp exchange computes with, or the ring)."""
        from hfdist.data.collation import varlen_kwargs
        from hfdist.models.attention import takes_boundaries
        from hfdist.parallel.context import CP_ATTENTIONS

        implementation = getattr(self.config, "_attn_implementation", None) or ""
        if attention_mask is not None or not (takes_boundaries(implementation) or
                                              implementation in CP_ATTENTIONS.values()):
            return {}
        return varlen_kwargs(position_ids.expand(batch, -1))


def build_stage_module(model: nn.Module, stage_index: int, num_stages: int, layer_range: range) -> CausalLMStage:
    """Cut stage `stage_index` of `num_stages` out of a HF causal LM (or a PeftModel around one).

    The first stage gets the embedding, the last the final norm and lm_head; every stage gets the decoder layers
    in `layer_range` (from `split_stages`). The stage shares the model's modules, so build all local stages
    first and drop the model afterwards to free the layers this rank does not run.

    Raises:
        PipelineModelError: not a Llama causal LM, a stage index outside [0, num_stages), or a layer range outside
            the model.
    """
    prefix, lm = find_causal_lm(model)
    n_layers = len(lm.model.layers)
    if not 0 <= stage_index < num_stages:
        raise PipelineModelError(f"stage_index {stage_index} is outside the {num_stages} pipeline stages.")
    if len(layer_range) == 0 or layer_range.step != 1 or layer_range.start < 0 or layer_range.stop > n_layers:
        raise PipelineModelError(
            f"Stage {stage_index} got layers {layer_range}: it needs a non-empty contiguous range inside the "
            f"model's {n_layers} decoder layers (use split_stages)."
        )
    return CausalLMStage(lm, stage_index, num_stages, layer_range, prefix)
