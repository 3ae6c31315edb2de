"""Per-rank bytes of one rung for one model, cluster layout and workload: the memory planner's arithmetic.

hfdist.plan.planner walks the ladder with it; hfdist.plan.state_bytes says what a run should measure.

Model-state accounting (bytes per trainable parameter), switchable with `bytes_per_param_adam`:

- 16 (default): 2 bf16 weight + 2 bf16 grad + 4 fp32 master + 8 Adam moments (fp32 m and v). The ZeRO paper's
  2 + 2 + K (K = 12): a 10B model holds 20 + 20 + 40 + 80 GB (tests/unit/test_plan.py). Default because it is what the
  torch-native rungs hold in total: FSDP2 with bf16 compute keeps fp32 shards (4, they are the master) + fp32
  grads (4) + Adam (8) = 16 / N, and DDP keeps fp32 params + fp32 grads + Adam = 16.
- 20: DeepSpeed's accounting (its own estimators: "2 params_16bit + 2 grads_16bit + 4 grads_32bit + 4
  params_32bit + 8 optimizer_states_32bit"): the 16 above plus an fp32 gradient copy that lives with the
  optimizer partition: the often quoted "20 bytes per parameter". Conservative; exact for DeepSpeed's bf16
  optimizer.
- fp32 training (CPU): 4 weight + 4 grad + 8 Adam, no master, except DeepSpeed, whose ZeRO optimizers clone
  an fp32 partition even of fp32 weights (+4).

Sharding per rung (N = ranks a replica is sharded over):
  ddp: nothing sharded.  zero1: master + optimizer (+ fp32 grad copy) / N.  zero2: also grads / N.
  zero3, fsdp_full_shard: also weights / N, over all data-parallel ranks.  fsdp_hybrid: the same, but N = the
  data-parallel ranks of one node (replicated across nodes).  Once weights are sharded, working-precision
  grads are reduce-scattered layer by layer, so only the grad shard in the reduce/accumulation dtype persists
  (DeepSpeed's ZeRO-3 estimator: 18 P / N). Offload rungs count on the GPU only what stays there: optimizer
  offload moves master + optimizer + the grad partitions, param offload the weight shards; the bytes moved
  off the GPU are reported as `offloaded`. TP and PP rungs: a rank holds its pipeline stage's layers (the
  first stage also the embedding, the last the final norm and lm_head; stages split as
  hfdist.parallel.pipeline.plan.split_stages does) with the projections, embedding and lm_head divided by tp.

LoRA: the base weights are frozen (weights only) and held as hfdist holds them: fp32 (4 B) on DDP, FSDP2, TP and
PP, where bf16 is only the compute dtype (FSDP2 gathers bf16 copies per unit, counted under buffers), and bf16
(2 B) only under DeepSpeed's bf16, which casts the whole model; the adapters on the targeted linears (q, k, v, o,
gate, up, down; r = 16) are the trainables and carry the full accounting above.

Activations: hfdist.models.shape's per-layer formula (for DDP and the single process its autocast variant: hfdist
runs them in bf16 as autocast over fp32 weights, so the residual stream stays fp32; the mesh rungs, a pipeline with
one data-parallel rank included, compute in bf16 through FSDP2's policy); data parallelism does not split them; a
1F1B pipeline stage s holds pp - s micro-batches in flight (at least pp micro-batches assumed), so the first stage
holds a whole model's worth of layer activations for one micro-batch, and what torch's stages keep beside them:
outputs, input gradients, receive buffers and a backward's working set (hfdist.plan.pipeline_bytes). With
activation checkpointing a layer keeps its input only, and backward recomputes one layer at a time once the loss
head's tensors are freed: the larger of that layer and the head counts, not both. A cp rank holds 1/cp of every
sequence, and its method's own bytes on top (hfdist.plan.context_bytes: repeated kv heads, exchange buffers or the ring's key/value
blocks in flight). Attention as the default (`auto`: flash varlen, flex or hfdist's document attention) holds nothing
S x S; the explicit sdpa / eager choices add their dense mask and its per-layer copies
(hfdist.models.attention.dense_mask_bytes), on every tp and cp rank whole.

Buffers: 1 GiB of CUDA context + cuBLAS/NCCL workspace on every rung; DDP's gradient buckets (a second copy
of the trainable grads: gradient_as_bucket_view is off by default; two while DDP rebuilds them in the second step); DeepSpeed's reduce buckets
(reduce_bucket_size from the rung's JSON, "auto" = hidden^2 as the HF Trainer fills it; doubled by
overlap_comm in ZeRO-1/2); gathered parameters of sharded-weight rungs: FSDP2 as hfdist applies it keeps the
root unit (embedding, final norm, lm_head) unsharded for the whole step plus two decoder layers (current and
prefetched) and one layer's unsharded grads (a pipeline stage: all its units, for the whole step; a pipeline with
one data-parallel rank has FSDP2, and so gathered copies, only under bf16; under gradient accumulation hfdist
reduce-scatters every micro-batch, so no unsharded gradient outlives its layer's backward); ZeRO-3 gathers module
by module (largest module's params + grads, DeepSpeed's own 4 x largest-layer term, plus the prefetch bucket). Allocator
fragmentation is not modelled.

FP8 (--fp8, torchao's float8 linears in the decoder projections): the model states are unchanged (fp32 masters,
gradients and Adam state), and so are the activations (torchao's float8 linear saves its input in the training
precision, as a plain linear does); where FSDP2 gathers the weights in float8 (tensorwise, sharded weights) the
gathered copies of the float8 projections take 1 byte per element instead of the training precision's 2 or 4.

"Fits" means total <= the GPU memory given (1 GB = 1e9 bytes, so an "80 GB" H100 with 85.1e9 bytes is planned
conservatively).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hfdist.config.dims import ParallelDims
from hfdist.config.finetune import DEFAULT_LOSS_CHUNK_SIZE
from hfdist.config.ladder import Rung, StrategyKind
from hfdist.errors import HfdistError
from hfdist.models.attention import AUTO, CHOICES, dense_mask_bytes, is_hub_kernel
from hfdist.models.registry import LORA_TARGETS
from hfdist.models.shape import ModelShape
from hfdist.parallel.float8_check import gathers_in_float8
from hfdist.plan.expert_bytes import gathered_layer_params
from hfdist.plan.pipeline_bytes import pipeline_stage_bytes
from hfdist.plan.rollout_bytes import completion_logits_bytes, rollout_kv_bytes

__all__ = ["PlanError", "Workload", "RankBytes", "ADAM_BYTES_CHOICES", "DTYPES", "GB", "WORKSPACE_BYTES",
           "offload_device", "dims_on_cluster", "rung_rank_bytes", "stage_layers", "stage_params"]

GB = 10**9
ADAM_BYTES_CHOICES = (16, 20)
DTYPES = ("bf16", "fp32")
WORKSPACE_BYTES = 2**30


class PlanError(HfdistError, ValueError):
    """Planner inputs that describe no cluster or workload."""


@dataclass(frozen=True)
class Workload:
    """What is trained, and how: everything besides the model and the cluster that decides memory."""

    seq: int = 2048
    micro_batch: int = 1
    lora: bool = False
    lora_r: int = 16
    qlora: bool = False  # LoRA on a 4-bit base (implies lora)
    lora_targets: tuple[str, ...] = LORA_TARGETS
    activation_checkpointing: bool = False
    dtype: str = "bf16"
    bytes_per_param_adam: int = 16
    loss_chunk_size: int | None = DEFAULT_LOSS_CHUNK_SIZE  # sequence positions per loss chunk; None: unchunked
    attention: str = AUTO  # --attn-implementation: sdpa / eager add a dense mask (hfdist.models.attention)
    fp8: str | None = None  # --fp8's recipe (hfdist.parallel.float8): FSDP2 gathers float8 weights (tensorwise)
    # --objective: dpo adds a frozen reference copy, sharded like the policy (none under LoRA: the base, adapters off);
    # grpo the rollout's KV cache and the completion logits (hfdist.plan.rollout_bytes). rollout_batch: completions
    # per step over all ranks (None: a micro-batch per rank), `generations` a prompt, `completion_len` tokens each.
    objective: str = "sft"
    generations: int = 4
    completion_len: int = 0
    rollout_batch: int | None = None
    rollout_gather: str = "layer"  # "once": the whole model gathered for each rollout (--rollout-gather)
    cp_method: str = "auto"  # --cp-method: how cp ranks split attention (hfdist.plan.context_bytes: its costs)
    # What every rank holds besides the training state: a GPU's CUDA context and library workspaces (the 1 GiB
    # default); what hfdist tune measures a step to need beyond its tensors on this machine.
    workspace: int = WORKSPACE_BYTES

    @property
    def reference_model(self) -> bool:  # a frozen reference copy beside the policy (DPO)
        return self.objective == "dpo"

    def __post_init__(self) -> None:
        if self.attention not in CHOICES and not is_hub_kernel(self.attention):
            raise PlanError(f"attention must be one of {', '.join(CHOICES)} or a kernels-hub id, got "
                            f"{self.attention!r}.")
        if self.qlora:
            object.__setattr__(self, "lora", True)
        if self.dtype not in DTYPES:
            raise PlanError(f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
        if self.bytes_per_param_adam not in ADAM_BYTES_CHOICES:
            raise PlanError(f"bytes_per_param_adam must be one of {ADAM_BYTES_CHOICES}, got "
                            f"{self.bytes_per_param_adam!r}.")
        bad = {k: v for k, v in (("seq", self.seq), ("micro_batch", self.micro_batch), ("lora_r", self.lora_r))
               if not isinstance(v, int) or v < 1}
        if bad:
            raise PlanError(f"{bad} must be positive integers.")


@dataclass(frozen=True)
class RankBytes:
    """Predicted bytes on one GPU (the worst pipeline stage); `offloaded` is off the GPU and not in `total`."""

    weights: int
    grads: int
    master: int
    optimizer: int
    activations: int
    buffers: int
    offloaded: int = 0
    offloaded_weights: int = 0  # the part of `offloaded` that is the rank's parameters

    @property
    def params(self) -> int:
        """The rank's parameter bytes wherever they are (on the GPU, or offloaded): what `hfdist simulate` and a run
        measure as param_bytes."""
        return self.weights + self.offloaded_weights

    @property
    def total(self) -> int:
        """GPU bytes: every component but `offloaded`."""
        return self.weights + self.grads + self.master + self.optimizer + self.activations + self.buffers

    @property
    def model_states(self) -> int:
        """Weights + grads + master + optimizer on the GPU (what DeepSpeed's estimators count)."""
        return self.weights + self.grads + self.master + self.optimizer

    def to_json(self) -> dict[str, int]:
        """The `per_rank_bytes` object of the JSON output."""
        keys = ("weights", "grads", "master", "optimizer", "activations", "buffers", "offloaded", "offloaded_weights")
        return {**{k: getattr(self, k) for k in keys}, "params": self.params, "total": self.total}


def offload_device(rung: Rung) -> str:
    """Where a rung moves model states: 'cpu', 'nvme' or 'none'."""
    if rung.owns_sharding and rung.fsdp is not None and rung.fsdp.offload_params:
        return "cpu"
    devices = {rung.offload_param, rung.offload_optimizer} - {"none"}
    return "nvme" if "nvme" in devices else (devices.pop() if devices else "none")


def dims_on_cluster(rung: Rung, gpus_per_node: int, nodes: int) -> ParallelDims:
    """The rung's layout on `nodes` x `gpus_per_node` GPUs: tp and pp from its config, the data-parallel axes absorb
    the rest (hybrid FSDP shards over one node's GPUs).

    Raises:
        PlanError: the cluster cannot hold the rung's model-parallel group.
    """
    d = rung.dims
    world, mp = gpus_per_node * nodes, d.tp * d.pp * d.cp
    if rung.kind is StrategyKind.SINGLE:
        if world != 1:
            raise PlanError(f"runs one process, not {world}")
        return ParallelDims()
    if world % mp:
        raise PlanError(f"needs tp x pp{' x cp' if d.cp > 1 else ''} = {mp} to divide the {world} GPUs")
    dp = world // mp
    if rung.kind is StrategyKind.DDP or (rung.uses_deepspeed and rung.zero_stage == 0):
        return ParallelDims(dp_replicate=dp, pp=d.pp, tp=d.tp)
    if rung.owns_sharding and d.dp_replicate > 1:  # hybrid: shard inside a node, replicate across nodes
        if gpus_per_node % mp:
            raise PlanError(f"hybrid sharding needs tp x pp = {mp} to divide the {gpus_per_node} GPUs of a node")
        shard = gpus_per_node // mp
        return ParallelDims(dp_replicate=dp // shard, dp_shard=shard, pp=d.pp, tp=d.tp, cp=d.cp)
    return ParallelDims(dp_shard=dp, pp=d.pp, tp=d.tp, cp=d.cp)


@dataclass(frozen=True)
class _PerParam:
    """Bytes per parameter of each model-state component for one rung and workload."""

    weight: int
    grad: int  # working-precision grad (what backward produces)
    grad_fp32: int  # fp32 gradient copy kept with the optimizer partition (20 B accounting), 0 otherwise
    master: int
    optimizer: int


def _per_param(rung: Rung, w: Workload) -> _PerParam:
    if w.dtype == "fp32":
        return _PerParam(4, 4, 0, 4 if rung.uses_deepspeed else 0, 8)
    return _PerParam(2, 2, 4 if w.bytes_per_param_adam == 20 else 0, 4, 8)


def _ds_reduce_bucket_bytes(rung: Rung, shape: ModelShape, grad_bytes: int) -> int:
    """DeepSpeed's gradient reduction (ipg) buffers, read from the rung's JSON."""
    zero = json.loads(rung.ds_config_path.read_text()).get("zero_optimization", {}) if rung.ds_config_path else {}
    size = zero.get("reduce_bucket_size", 5e8)
    elems = shape.hidden**2 if size == "auto" else int(float(size))
    stage3 = rung.zero_stage >= 3
    double = bool(zero.get("overlap_comm", stage3)) and not stage3  # ZeRO-1/2 double-buffer under overlap_comm
    return int(elems * grad_bytes * (2 if double else 1))


def stage_layers(shape: ModelShape, pp: int) -> list[int]:
    if pp == 1:
        return [shape.layers]
    from hfdist.parallel.pipeline.plan import split_stages

    return [len(r) for r in split_stages(shape.layers, pp)]


def _layer_params(shape: ModelShape, tp: int) -> float:
    """One decoder layer's parameters on a tp rank (projections split, norms whole)."""
    return shape.layer_linear_params / tp + 2 * shape.hidden


def stage_params(shape: ModelShape, dims: ParallelDims, stage: int, layers: int) -> tuple[float, float]:
    """(parameters, of which outside the decoder layers) one rank of pipeline stage `stage` (holding `layers` decoder
    layers) holds, before data-parallel sharding: the first stage also the embedding, the last the final norm and
    lm_head, projections, embedding and lm_head divided by tp."""
    first, last = stage == 0, stage == dims.pp - 1
    embed = shape.embed_params / dims.tp if first else 0
    # A tied lm_head needs its own copy of the embedding on the last stage once they are on different ranks.
    head_own = shape.embed_params if (shape.tied and dims.pp > 1) else shape.head_params
    head = (head_own / dims.tp + shape.hidden) if last else 0
    return layers * _layer_params(shape, dims.tp) + embed + head, embed + head


def _stage_bytes(shape: ModelShape, rung: Rung, dims: ParallelDims, w: Workload, stage: int,
                 layers: int, float8_params: float) -> RankBytes:
    pp, tp = dims.pp, dims.tp
    last = stage == pp - 1
    layer = _layer_params(shape, tp)
    params, root = stage_params(shape, dims, stage, layers)
    trainable = layers * shape.lora_layer_params(w.lora_r, w.lora_targets, tp) if w.lora else params
    frozen = params if w.lora else 0
    pb = _per_param(rung, w)

    zero = rung.zero_stage if rung.uses_deepspeed else 0
    n = dims.dp_shard * dims.cp  # FSDP2 shards over dp_shard x cp (hfdist.config.dims.ParallelDims.fsdp_mesh)
    fsdp = rung.owns_sharding
    shard_opt = n if (fsdp or zero >= 1) else 1
    grads_sharded, weights_sharded = fsdp or zero >= 2, fsdp or zero >= 3

    # A LoRA run's frozen base is held in fp32 but under DeepSpeed's bf16, which casts the whole model; so is a
    # DPO reference model (hfdist.api.prepare_model(trainable=False): the policy's layout, no grads or optimizer).
    # QLoRA holds the decoder projections' weights in 4 bits instead (sharded like any weight) and their
    # quantisation states whole on every rank.
    frozen_weight = pb.weight if rung.uses_deepspeed else 4
    if w.reference_model and not w.lora:
        frozen += params
    packed = layers * shape.layer_packed_bytes / tp if w.qlora else 0
    quant_states = layers * shape.layer_quant_state_bytes / tp if w.qlora else 0
    frozen_bytes = (frozen - (layers * shape.layer_matmul_params / tp if w.qlora else 0)) * frozen_weight + packed
    weights = (trainable * pb.weight + frozen_bytes) / (n if weights_sharded else 1)
    if weights_sharded:  # grads reduce-scattered per layer: only the accumulation-dtype shard persists
        grads = trainable * (pb.grad_fp32 or pb.grad) / n
    elif grads_sharded:
        grads = trainable * (pb.grad + pb.grad_fp32) / n
    else:
        grads = trainable * pb.grad + trainable * pb.grad_fp32 / shard_opt
    master = trainable * pb.master / shard_opt
    optimizer = trainable * pb.optimizer / shard_opt

    offloaded = offloaded_weights = 0.0
    fsdp_offload = fsdp and rung.fsdp is not None and rung.fsdp.offload_params
    if fsdp_offload or rung.offload_optimizer != "none":
        # Optimizer offload streams each reduced grad partition to the CPU; ZeRO-1 still builds full grads here.
        moved_grads = grads if grads_sharded else trainable * pb.grad_fp32 / shard_opt
        offloaded += master + optimizer + moved_grads
        master = optimizer = 0.0
        grads -= moved_grads
    if fsdp_offload or rung.offload_param != "none":
        offloaded += weights
        offloaded_weights, weights = weights, 0.0
    weights += quant_states  # bitsandbytes dequantises on the device: the states stay there

    # Activations: stage s of a 1F1B pipeline holds pp - s micro-batches in flight. A cp rank holds 1/cp of every
    # sequence's tokens; its attention saves the full sequence for heads / cp (Ulysses), the same bytes.
    elem = 2 if w.dtype == "bf16" else 4
    tokens = w.seq * w.micro_batch // dims.cp
    lora_targets = len(w.lora_targets) if w.lora else 0
    autocast = rung.kind in (StrategyKind.DDP, StrategyKind.SINGLE) and w.dtype == "bf16"  # the Trainer's bf16: autocast, fp32 weights
    full_layer = shape.layer_activation_bytes(tokens, elem, tp, w.lora_r if w.lora else 0, lora_targets, autocast)
    residual_elem = 4 if autocast else elem  # autocast keeps the residual stream between layers in fp32
    kept = shape.checkpointed_layer_bytes(tokens, residual_elem, tp) if w.activation_checkpointing else full_layer
    activations = (pp - stage) * layers * kept
    activations += _dense_mask_bytes(shape, dims, w, stage, layers, elem)
    if dims.cp > 1:  # the cp method's own: repeated kv heads saved, exchange buffers / key-value blocks in flight
        activations += _context_bytes(shape, dims, w, tokens, elem, 1 if w.activation_checkpointing else
                                      (pp - stage) * layers)
    # hfdist's loss holds one chunk of every sequence's fp32 logits at a time (hfdist.models.chunked_loss).
    rows = w.seq // dims.cp
    head = shape.head_activation_bytes(tokens, elem, tp, w.micro_batch * min(w.loss_chunk_size or rows, rows)) \
        if last else 0
    # Without recompute (and outside a pipeline) the head's tensors come on top of every layer's at the end of the
    # forward. With it, the peak is the larger of that moment (the layers' inputs and the head's) and one layer
    # recomputed in backward, which runs once the head's backward has freed its tensors: they are never held
    # together (measured on CPU by `hfdist tune`'s probes, results/cpu-2core/tune.md: counting both over-planned
    # recompute by up to 25%). A pipeline stage without the head peaks in a backward instead
    # (hfdist.plan.pipeline_bytes).
    in_backward = full_layer if w.activation_checkpointing else 0
    receive_buffers = 0
    if pp > 1:
        assert rung.pipeline is not None
        held, working, receive_buffers = pipeline_stage_bytes(shape, dims.pp, stage, rung.pipeline.n_microbatches,
                                                              tokens, elem, pb.grad, dims.tp)
        activations += held
        in_backward += working
    activations += max(in_backward, head)
    if w.objective == "grpo":  # the rollout (states held, no activations) or the step, whichever holds more
        completions = -(-(w.rollout_batch or w.micro_batch * dims.dp) // dims.dp)  # a dp rank's share of the step
        whole = params * elem if w.rollout_gather == "once" and fsdp else 0  # beside the shard it gathered from
        activations = max(activations + (completion_logits_bytes(shape, dims, w, elem) if last else 0),
                          rollout_kv_bytes(shape, dims, w, elem, completions, layers) + whole)

    # A gathered layer's weights in their stored dtype under QLoRA: 4-bit projections, the rest in the compute dtype.
    layer_stored = ((layer - shape.layer_matmul_params / tp) * pb.weight + shape.layer_packed_bytes / tp
                    if w.qlora else None)
    # An MoE layer's experts are gathered E / ep at a time (hfdist.plan.expert_bytes).
    gathered = gathered_layer_params(shape.layer_linear_params, shape.moe, shape.hidden, shape.layers, tp, dims.ep)
    buffers = w.workspace + _gathered_bytes(shape, rung, dims, w, pb, layers, gathered, root,
                                            trainable / max(params, 1), float8_params, layer_stored)
    if w.qlora:  # one projection dequantised at a time, in bf16 (and cast to fp32 when that is what it meets)
        buffers += shape.largest_projection / tp * (2 if elem == 2 and not autocast else 6)
    if rung.kind is StrategyKind.DDP and dims.dp_replicate > 1:
        # The reducer's flat buckets, a second copy of the grads; in the second step torch's DDP rebuilds them in
        # the order the gradients arrived, the new ones allocated while the old still are: two copies at that peak
        # (measured: llama-small on 2 gloo ranks, the second step's live tensors peak 13.9 MB above the third's,
        # the buckets' size).
        buffers += 2 * trainable * pb.grad
    if rung.uses_deepspeed:
        buffers += _ds_reduce_bucket_bytes(rung, shape, pb.grad)
    buffers += receive_buffers
    return RankBytes(*(int(x) for x in (weights, grads, master, optimizer, activations, buffers, offloaded,
                                        offloaded_weights)))


def _context_bytes(shape: ModelShape, dims: ParallelDims, w: Workload, tokens: int, elem: int, full_layers: int) -> int:
    """A cp rank's attention beyond a plain layer's (hfdist.plan.context_bytes, for the plan --cp-method makes on
    this model and sequence): what `full_layers` layers save more, and one layer's buffers in flight."""
    from hfdist.parallel.context_check import plan_cp
    from hfdist.plan.context_bytes import cp_layer_costs

    plan = plan_cp(shape.heads, shape.kv_heads, dims.tp, dims.cp, w.seq, w.cp_method)
    costs = cp_layer_costs(shape, tokens, elem, dims.tp, plan)
    return full_layers * costs.saved + costs.in_flight


def _dense_mask_bytes(shape: ModelShape, dims: ParallelDims, w: Workload, stage: int, layers: int, elem: int) -> int:
    """What the explicit sdpa / eager choice adds (hfdist.models.attention.dense_mask_bytes): every rank holds the
    whole (micro_batch, 1, S, S) mask of each micro-batch in flight, tp and cp ranks alike (attention sees the full
    sequence), and the per-layer copies of every layer whose activations are kept (one layer's, recomputed, with
    activation checkpointing; under cp sdpa's bias is one copy shared by all layers)."""
    heads = max(shape.heads // (dims.tp * dims.cp), 1)
    mask, per_layer = dense_mask_bytes(w.attention, seq=w.seq, micro_batch=w.micro_batch, heads=heads, elem=elem)
    in_flight = dims.pp - stage
    if w.activation_checkpointing:
        kept = 1
    elif dims.cp > 1 and w.attention == "sdpa":
        kept = in_flight
    else:
        kept = in_flight * layers
    return in_flight * mask + kept * per_layer


def _gathered_bytes(shape: ModelShape, rung: Rung, dims: ParallelDims, w: Workload, pb: _PerParam, layers: int,
                    layer: float, root: float, trainable_share: float, float8_params: float,
                    layer_stored: float | None = None) -> float:
    """Unsharded parameters (and their grads) that exist while a sharded-weight rung computes. Under FSDP2's float8
    all-gather (--fp8 tensorwise where FSDP2 shards) a layer's float8 projections (`float8_params` elements per
    layer on this rank) are gathered at 1 byte per element; `layer_stored`: one gathered decoder layer's bytes
    where they are not its `layer` parameters in the compute dtype (QLoRA's 4-bit projections)."""
    unit_grad = pb.grad * trainable_share
    if rung.owns_sharding and dims.pp > 1 and dims.dp * dims.cp == 1 and w.dtype == "fp32":
        return 0.0  # a pipeline with one data-parallel rank gets FSDP2 only for bf16 (hfdist.parallel.parallelize)
    if rung.owns_sharding:
        float8 = float8_params if gathers_in_float8(w.fp8, dims.dp_shard * dims.cp) else 0.0
        # One gathered layer's weights, in bytes.
        layer_weights = layer_stored if layer_stored is not None else float8 + (layer - float8) * pb.weight
        # Under PP, torch's schedules keep a stage's FSDP units unsharded through all micro-batches and
        # reduce-scatter once at the end of the step (pipelining/stage.py), as without resharding after forward.
        if rung.fsdp is not None and not rung.fsdp.reshard_after_forward or dims.pp > 1:
            return layers * (layer_weights + layer * unit_grad) + root * (pb.weight + unit_grad)
        # Root unit unsharded all step, two layers gathered (current + prefetched), one layer's grads (under
        # gradient accumulation too: hfdist.train.trainer reduce-scatters them at every micro-batch's end).
        return root * (pb.weight + unit_grad) + 2 * layer_weights + layer * unit_grad
    if rung.uses_deepspeed and rung.zero_stage >= 3:
        projection = max(shape.hidden * shape.intermediate, shape.heads * shape.head_dim * shape.hidden)
        largest = max(shape.embed_params * pb.weight, projection * (0.5 if w.qlora else pb.weight)) / dims.tp
        prefetch = 0.9 * shape.hidden**2  # stage3_prefetch_bucket_size "auto"
        return largest + max(shape.embed_params, projection) / dims.tp * unit_grad + prefetch * pb.weight
    return 0.0


def rung_rank_bytes(shape: ModelShape, rung: Rung, dims: ParallelDims, workload: Workload,
                    float8_params: float = 0.0) -> RankBytes:
    """Per-GPU bytes of `rung` laid out as `dims`: the pipeline stage with the largest total. `float8_params`: the
    weight elements per decoder layer (on a rank, after tp) that compute in float8 under workload.fp8
    (hfdist.parallel.float8.float8_params_per_layer)."""
    stages = stage_layers(shape, dims.pp)
    per_stage = [_stage_bytes(shape, rung, dims, workload, s, n, float8_params) for s, n in enumerate(stages)]
    return max(per_stage, key=lambda b: b.total)
