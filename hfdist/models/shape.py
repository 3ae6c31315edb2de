"""Model shapes for the memory planner: exact parameter counts and activation bytes, from the config alone.

Nothing here builds a model, so a 405B config is planned in microseconds; tests check the counts against
`sum(p.numel())` of meta-device models of every registered architecture (hfdist.models.registry) and of a PEFT
LoRA model. Projection shapes and biases come from the registry, so Mistral, Qwen2 (q/k/v biases) and Qwen3
(per-head q/k norms, head_dim apart from hidden / heads) are counted by the same code.

Activation bytes per decoder layer (HF transformers 5 `LlamaDecoderLayer`, attention without an S x S tensor:
flash varlen, flex or hfdist's document attention, hfdist's default; no dropout). The explicit sdpa / eager choices
add their dense document mask and its per-layer copies, counted apart (hfdist.models.attention.dense_mask_bytes). Counted tensor by tensor from what autograd saves for backward, per token, with e the
activation element size (2 for bf16, 4 for fp32):

    input_layernorm, post_attention_layernorm (each): the input upcast to fp32 (4 H), the fp32 rsqrt (4) and
        the normalised activation cast back (e H); HF's LlamaRMSNorm computes in fp32   -> 2 x (4 H + 4 + e H)
    q/k/v projections: their shared input (e H); gate/up: their shared input (e H)      -> 2 e H
    attention: q after RoPE (e H), k and v (2 e H_kv, GQA-sized), its output (e H; flash/SDPA kernels return
        it in the (B, S, heads, dim) layout, so o_proj's input is the same storage) and the fp32 log-sum-exp
        (4 n_heads)
    MLP: gate output (SiLU input), SiLU output, up output, down_proj input (4 e I)

    per layer bytes = S B [8 H + 8 + e (6 H + 2 H_kv + 4 I) + 4 n_heads]
                   ~= S B H (20 + 4 H_kv / H + 8 I / H)            for bf16

This is the Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer Models") count,
34 S B H per GPT layer without the 5 a S^2 B score term, redone for Llama: SwiGLU's three I-wide tensors instead
of GELU's 4 H, GQA's smaller k/v, RMSNorm's fp32 copies and no dropout masks. Llama-3 8B gives 49 S B H.
A test checks it byte for byte against the tensors autograd saves for one HF decoder layer (bf16 and fp32).
The rotary cos/sin tables are shared by all layers and left out. LoRA adds each adapter's r-wide intermediate
(e r per targeted linear); the base layers save the same tensors. Per-head norms (Qwen3's q_norm / k_norm) save,
like any RMSNorm, their input in fp32, the fp32 rsqrt per head and their output: (4 + e) (q + kv) + 4 (heads +
kv heads) more per token.

Under autocast over fp32 weights (how hfdist runs DDP in bf16) the residual stream stays fp32, so each norm
saves its normalised output in fp32 (4 H) and each projection saves its own bf16 cast of its input (5 e H for
q, k, v, gate, up instead of 2 e H): ~ S B H (30 + 4 H_kv / H + 8 I / H), also checked by a test.

With activation checkpointing (HF's per-decoder-layer checkpointing) a layer keeps only its input (e H per
token) and one layer's full activations exist at a time, while it is recomputed in backward.

With tensor parallelism (hfdist's Llama plan: sequence parallel + loss parallel) the norms' tensors are split
over the sequence and everything inside attention and the MLP over heads / intermediate, so they divide by tp;
the all-gathered inputs of the column-parallel projections (2 e H) are saved whole.

The head: the final norm (4 H + e H), lm_head's input (e H) and the logits, counted once as fp32 (x 4: the loss
upcasts them), divided by tp under loss parallel. hfdist's loss (hfdist.models.chunked_loss) holds the logits of
one chunk of the sequence at a time (B x chunk x V x 4), not the whole batch's (S B V x 4), plus, where lm_head
computes in bf16, the bf16 copy of their gradient that the fused loss (hfdist.models.fused_loss) multiplies with
(x 2). The fused loss also keeps the hidden states' gradient from its forward to backward (e H, whole under TP);
lm_head's weight gradient, computed there too, is the gradient counted with the model states.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hfdist.errors import HfdistError
from hfdist.models.moe import MoeShape
from hfdist.models.registry import UnsupportedModelError, facts_for

__all__ = ["ModelShape", "PlanModelError", "NF4_BLOCK_SIZE", "NF4_NESTED_BLOCK_SIZE", "packed_nbytes",
           "quant_state_nbytes"]

# QLoRA's 4-bit base (hfdist.models.quantize): values per absmax, and absmax values per second-level scale.
NF4_BLOCK_SIZE = 64
NF4_NESTED_BLOCK_SIZE = 256


def packed_nbytes(out_features: int, in_features: int) -> int:
    """Bytes of one weight's packed 4-bit codes (half a byte per value)."""
    return out_features * in_features // 2


def quant_state_nbytes(out_features: int, in_features: int) -> int:
    """Bytes of one 4-bit weight's quantisation state as bitsandbytes keeps it under double quantisation: one uint8
    absmax per block, one fp32 scale per 256 blocks, the two fp32 code books (16 and 256 values) and the fp32
    offset."""
    blocks = -(-out_features * in_features // NF4_BLOCK_SIZE)
    return blocks + 4 * -(-blocks // NF4_NESTED_BLOCK_SIZE) + 4 * (16 + 256) + 4


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


class PlanModelError(HfdistError, ValueError):
    """A LoRA target or setting the planner cannot count."""


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a config that decide its memory."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = False
    # (in_features, out_features, has_bias) per decoder-layer projection, from the registry (an MoE model: a dense
    # layer's; its MoE layers' blocks are `moe`'s).
    linears: dict[str, tuple[int, int, bool]] = field(default_factory=dict, compare=False)
    # the projections tensor parallelism splits on their input dim (the others: on their output dim)
    rowwise: frozenset[str] = field(default_factory=frozenset, compare=False)
    head_norm_params: int = 0  # per layer (Qwen3's q_norm + k_norm)
    moe: MoeShape | None = None  # a mixture-of-experts model's MoE layers

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        """Read a HF config (or a preset's plain fields) of a registered architecture.

        Raises:
            UnsupportedModelError: the architecture has no registry entry.
        """
        facts = facts_for(config, "The memory planner")
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        return cls(
            vocab=int(config.vocab_size),
            hidden=hidden,
            intermediate=int(config.intermediate_size),
            layers=int(config.num_hidden_layers),
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=facts.head_dim(config),
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            linears=facts.linear_shapes(config),
            rowwise=frozenset(path.rsplit(".", 1)[-1] for path in facts.rowwise),
            head_norm_params=facts.head_norm_params(config),
            moe=MoeShape.from_config(config, facts.moe) if facts.moe is not None else None,
        )

    def _mlp_mean(self, dense: float, moe_block: float) -> float:
        """A per-layer figure averaged over the layers: `dense` for a dense layer's MLP, `moe_block` for an MoE
        layer's block."""
        m = self.moe.layers
        return ((self.layers - m) * dense + m * moe_block) / self.layers

    def _projections(self, names: tuple[str, ...], bias: bool = True) -> int:
        return sum(n_in * n_out + (n_out if b and bias else 0) for name, (n_in, n_out, b) in self.linears.items()
                   if name in names)

    def _per_layer(self, moe_block: int, bias: bool) -> float:
        """Projection parameters of a layer (biases when `bias`), an MoE model's MLPs averaged with `moe_block`."""
        attention = self._projections(_ATTENTION, bias)
        dense = self._projections(_MLP, bias)
        return attention + (dense if self.moe is None else self._mlp_mean(dense, moe_block))

    @property
    def layer_linear_params(self) -> float:
        """Parameters of one decoder layer's projections (what tensor parallelism splits; an MoE model's experts are
        split over the tp ranks too, by FSDP2: hfdist.parallel.expert); an MoE model's: the mean over its layers."""
        return self._per_layer(self.moe.block_params(self.hidden) if self.moe else 0, bias=True)

    @property
    def layer_matmul_params(self) -> float:
        """Weights of one decoder layer's projections, biases left out (what the matmuls multiply by); an MoE
        model's: the mean over its layers, every expert counted (active_layer_matmul_params: what a token uses)."""
        return self._per_layer(self.moe.block_params(self.hidden) if self.moe else 0, bias=False)

    @property
    def active_layer_matmul_params(self) -> float:
        """The weights one token's matmuls use in a decoder layer (mean over layers): an MoE layer's top-k experts,
        router and shared expert; a dense model's every projection."""
        return self._per_layer(self.moe.active_params(self.hidden) if self.moe else 0, bias=False)

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: projections, its two RMSNorm weights and any per-head norms."""
        return self.layer_linear_params + 2 * self.hidden + self.head_norm_params

    @property
    def embed_params(self) -> int:
        """Parameters of the token embedding."""
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """Parameters of lm_head: none of its own when tied to the embedding."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        """Every parameter, counted once (a tied lm_head shares the embedding's)."""
        return round(self.embed_params + self.layers * self.layer_params + self.hidden + self.head_params)

    @property
    def active_params(self) -> int:
        """The parameters one token uses: an MoE model's total less its unchosen experts (total_params for a dense
        model)."""
        if self.moe is None:
            return self.total_params
        unused = (self.moe.experts - self.moe.top_k) * 3 * self.hidden * self.moe.expert_width
        return self.total_params - self.moe.layers * unused

    @property
    def layer_packed_bytes(self) -> int:
        """Bytes of one decoder layer's projection weights held in 4 bits (QLoRA's base; biases stay apart)."""
        return sum(packed_nbytes(n_out, n_in) for n_in, n_out, _ in self.linears.values())

    @property
    def layer_quant_state_bytes(self) -> int:
        """Bytes of the quantisation states of one decoder layer's 4-bit projections."""
        return sum(quant_state_nbytes(n_out, n_in) for n_in, n_out, _ in self.linears.values())

    @property
    def matmul_params(self) -> int:
        """Weights that take part in a token's matmuls: every layer's projections (an MoE layer's: its top-k experts,
        router and shared expert, the active parameters) plus lm_head (the embedding is a lookup; a tied lm_head
        still does its matmul, counted once)."""
        return round(self.layers * self.active_layer_matmul_params) + self.hidden * self.vocab

    def training_flops_per_token(self, seq_len: int, *, lora_params: int = 0, trainable_fraction: float = 1.0) -> float:
        """Training FLOPs (forward + backward) per token of sequences `seq_len` long (hfdist.metrics.flops states the
        conventions): (4 + 2 x trainable fraction) x matmul params + 6 x LoRA params + 12 L H Q T attention (full,
        not causal-halved; seq_len 0 leaves it out)."""
        if not 0.0 <= trainable_fraction <= 1.0:
            raise ValueError(f"trainable_fraction must lie in [0, 1], got {trainable_fraction}.")
        # forward 2N + input gradient 2N for every weight; the weight gradient (2N) only for trained ones
        attention = 12.0 * self.layers * self.heads * self.head_dim * seq_len
        return (4.0 + 2.0 * trainable_fraction) * self.matmul_params + 6.0 * lora_params + attention

    @property
    def largest_projection(self) -> int:
        """Values of the largest decoder-layer projection weight (the one dequantised at a time under QLoRA)."""
        return max(n_in * n_out for n_in, n_out, _ in self.linears.values())

    def lora_layer_params(self, r: int, targets: tuple[str, ...] | None = None, tp: int = 1) -> float:
        """LoRA parameters added to one decoder layer, on one of `tp` tensor-parallel ranks: r x (in + out) per
        targeted projection (A and B, no bias) at tp 1.

        hfdist's TP splits one matrix of each pair like its projection and keeps the other whole on every tp rank
        (hfdist.parallel.tensor._lora_entries): B on its output dim under a column-split projection (A whole), A on
        its input dim under a row-split one (B whole).

        Args:
            targets: short projection names; default every projection (what `--lora` adapts).
            tp: tensor-parallel degree.
        """
        targets = tuple(self.linears) if targets is None else tuple(targets)
        unknown = sorted(set(targets) - set(self.linears))
        if unknown:
            raise PlanModelError(f"Unknown LoRA target(s) {unknown}; the decoder layers have "
                                 f"{', '.join(self.linears)}.")
        return sum(r * (n_in / tp + n_out if t in self.rowwise else n_in + n_out / tp)
                   for t in targets for n_in, n_out, _ in (self.linears[t],))

    def layer_activation_bytes(self, tokens: int, elem: int, tp: int = 1, lora_r: int = 0,
                               lora_targets: int = 0, autocast: bool = False) -> int:
        """Bytes one decoder layer saves for backward (module docstring), on one tensor-parallel rank.

        Args:
            tokens: sequence length x micro-batch.
            elem: bytes per activation element (2 bf16, 4 fp32).
            tp: tensor-parallel degree.
            lora_r, lora_targets: LoRA rank and the number of adapted projections in the layer (0 without LoRA).
            autocast: bf16 autocast over fp32 weights (module docstring).
        """
        h, i = self.hidden, self.intermediate
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        norms = 2 * (4 * h + 4 + (4 if autocast else elem) * h)
        gathered_inputs = (5 if autocast else 2) * elem * h
        # q and the attention output (q-wide), k and v (kv-wide), log-sum-exp, the MLP's four I-wide tensors
        inner = elem * (2 * q + 2 * kv + 4 * i) + 4 * self.heads
        if self.head_norm_params:
            inner += (4 + elem) * (q + kv) + 4 * (self.heads + self.kv_heads)
        lora = elem * lora_r * lora_targets
        per_token = norms / tp + gathered_inputs + inner / tp + lora
        if self.moe is not None:  # an MoE layer saves its block's tensors instead of a dense MLP's (tp-local tokens)
            compute, fp32 = self.moe.activation_elements(h)
            dense_mlp = (elem * 4 * i) / tp + (5 if autocast else 2) * elem * h / 2  # gate/up input: half of gathered
            per_token += self._mlp_mean(0, (elem * compute + 4 * fp32) / tp - dense_mlp)
        return int(tokens * per_token)

    def head_activation_bytes(self, tokens: int, elem: int, tp: int = 1, logit_tokens: int | None = None) -> int:
        """Bytes saved by the final norm, lm_head input, the fused loss's hidden-state gradient and the fp32 logits
        (module docstring).

        Args:
            logit_tokens: tokens whose logits exist at once (a chunked loss's chunk); default all `tokens`.
        """
        logit_tokens = tokens if logit_tokens is None else logit_tokens
        logit_bytes = 4 + (elem if elem < 4 else 0)
        return int(tokens * ((4 * self.hidden + elem * self.hidden) / tp + 2 * elem * self.hidden)
                   + logit_tokens * logit_bytes * self.vocab / tp)

    def checkpointed_layer_bytes(self, tokens: int, elem: int, tp: int = 1) -> int:
        """Bytes one checkpointed layer keeps between forward and backward: its input hidden states.

        Under tensor parallelism the residual stream is split over the sequence (sequence parallel).
        """
        return int(tokens * elem * self.hidden / tp)


__all__ += ["UnsupportedModelError"]
