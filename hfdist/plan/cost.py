"""The cost model beside the memory model: a layout's predicted step time from the model's FLOPs over a matmul rate,
the bytes its collectives move over a bandwidth, the optimizer's memory traffic and the pipeline bubble.

Per optimizer step and rank (a layout trains `global_batch` sequences of `seq` tokens on `world` ranks, each rank
running forward and backward on `micro_batch` sequences at a time, `accumulation` times):

    compute   = training FLOPs per token (hfdist.metrics.flops: 6 N per trained weight, 4 N frozen, attention) x
                the step's tokens / world, + the decoder layers' forward again under recompute, at the matmul rate
                for the rows one matmul sees (rate(M) = peak x M / (M + M_half): small matmuls run below peak)
    bubble    = compute x (pp - 1) / n under a pipeline of n micro-batches per schedule (1F1B's idle share)
    optimizer = the rank's trainable parameters x the bytes Adam reads and writes per parameter / memory bandwidth
                (host memory's, when the rung offloads the optimizer, plus the gradients down and the updated
                weights up over the host link; offloaded weights also come up the host link for every pass)
    comm      = for each collective, latency + (its algorithm's share of) its buffer / the group's bandwidth (inside
                a node or across nodes, from where the mesh puts the group: tp innermost, then pp, cp, dp_shard,
                dp_replicate, hfdist.config.dims). Data-parallel collectives (FSDP / ZeRO gathers and reductions,
                DDP's bucketed all-reduce) overlap the compute they prefetch for: only what exceeds the compute,
                plus one unit's worth at each end, is exposed. Tensor-, context- and pipeline-parallel collectives
                sit on the critical path.
    step      = compute + bubble + optimizer + exposed comm

`step_collectives` lists the collectives (kind, mesh axis, group size, buffer bytes, calls per step) that the time
is computed from; tests/unit/test_cost.py checks their bytes against what a simulated step really issues
(hfdist.plan.simulate under torch's CommDebugMode). A collective's buffer is its whole tensor: an all-gather's
output, a reduce-scatter's input, an all-reduce's tensor, an all-to-all's input, a point-to-point message; the ring
algorithms move (n - 1) / n of it per rank ((2 n - 2) / n for an all-reduce).

Not modelled: elementwise kernels, the loss's softmax, kernel launch overheads, DeepSpeed's and the Trainer's
host-side work, imbalance between pipeline stages. The model orders layouts; `hfdist tune` measures them, and
reports predicted against measured for each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hfdist.config.dims import ParallelDims
from hfdist.config.ladder import Rung, StrategyKind
from hfdist.models.shape import ModelShape
from hfdist.plan.bytes import WORKSPACE_BYTES, Workload
from hfdist.plan.expert_bytes import moe_step_terms

__all__ = ["Hardware", "Collective", "StepCost", "NOMINAL_HARDWARE", "step_collectives", "step_cost",
           "group_crosses_nodes", "ADAM_BYTES_PER_PARAM"]

# Adam's memory traffic per trainable parameter on the rank that steps it: read parameter, gradient and both
# moments, write parameter and both moments, in fp32 (the master copy under mixed precision).
ADAM_BYTES_PER_PARAM = 28
# DDP's gradient bucket (torch's bucket_cap_mb default, 25 MiB): one all-reduce call per bucket.
DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Hardware:
    """What the cost model needs of the devices and their links.

    Attributes:
        matmul_flops: FLOP/s one device reaches on large training matmuls (in the run's precision).
        half_rate_rows: the rows (tokens) at which a matmul runs at half that rate: rate(M) = peak M / (M + this).
        memory_bandwidth: bytes/s of one device's memory (the optimizer step's traffic).
        intra_node_bandwidth / inter_node_bandwidth: bytes/s per rank of a ring collective inside a node / across
            nodes (NCCL's "bus bandwidth"; gloo's over loopback on a CPU host).
        latency: seconds every collective call costs whatever its size.
        host_bandwidth: bytes/s between a device and host memory (PCIe): what offloading moves.
        host_memory_bandwidth: bytes/s of host memory per device: an offloaded optimizer's step runs there.
        workspace_bytes: what a rank holds for training besides the model's tensors (a GPU's context and library
            workspaces; a CPU process's kernels and scratch that a first training step touches).
        source: where the figures come from (a datasheet assumption, or `hfdist tune`'s probe of this machine).
    """

    matmul_flops: float
    half_rate_rows: float
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    latency: float
    host_bandwidth: float
    host_memory_bandwidth: float
    workspace_bytes: int
    source: str

    def matmul_rate(self, rows: float) -> float:
        """FLOP/s of a matmul over `rows` tokens."""
        return self.matmul_flops * rows / (rows + self.half_rate_rows)


# What `hfdist plan` assumes when it cannot measure: an 8 x H100 SXM node (bf16 dense peak 989 TFLOP/s, of which
# large training matmuls reach about 60%; 3.35 TB/s HBM3; NVLink 4 at 900 GB/s both ways, of which a ring collective
# sees about 360 GB/s of bus bandwidth; one 400 Gb/s InfiniBand NIC per GPU, about 40 GB/s of bus bandwidth), and
# matmuls at half rate below ~256 rows; PCIe 5.0 x16 at ~50 GB/s each way and ~40 GB/s of a host's DDR5 per GPU.
NOMINAL_HARDWARE = Hardware(matmul_flops=0.6 * 989e12, half_rate_rows=256.0, memory_bandwidth=3.35e12,
                            intra_node_bandwidth=360e9, inter_node_bandwidth=40e9, latency=20e-6,
                            host_bandwidth=50e9, host_memory_bandwidth=40e9, workspace_bytes=WORKSPACE_BYTES,
                            source="nominal H100 SXM node: 60% of the bf16 datasheet peak, NVLink ~360 GB/s and "
                                   "InfiniBand ~40 GB/s of bus bandwidth (not measured: `hfdist tune` measures)")


@dataclass(frozen=True)
class Collective:
    """One kind of collective a rank issues on one mesh axis in a step: `calls` of them, whose buffers (module
    docstring) hold `buffer_bytes` together."""

    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | send_recv
    axis: str  # the mesh group (group_crosses_nodes): dp_shard_cp (FSDP2), dp_shard (ZeRO), dp_replicate (DDP,
    # HSDP's replicas), tp, cp_ulysses (the Ulysses all-to-alls) / cp (the ring's messages), pp, ep (an MoE
    # model's experts)
    group: int  # ranks in the group
    buffer_bytes: float
    calls: float
    overlapped: bool  # data-parallel traffic that prefetching or bucketing hides behind compute

    @property
    def moved_bytes(self) -> float:
        """Bytes the rank sends for these calls under the ring algorithms (a point-to-point message: all of it)."""
        n = self.group
        share = {"all_reduce": 2 * (n - 1) / n, "send_recv": 1.0}.get(self.kind, (n - 1) / n)
        return share * self.buffer_bytes


@dataclass(frozen=True)
class StepCost:
    """A layout's predicted seconds per optimizer step, by part, and the tokens per second that gives."""

    compute: float
    bubble: float
    optimizer: float
    exposed_comm: float
    comm: float  # all communication, hidden or not
    tokens_per_step: int
    world: int
    collectives: tuple[Collective, ...] = field(default=(), compare=False)

    @property
    def seconds(self) -> float:
        """Predicted seconds per optimizer step."""
        return self.compute + self.bubble + self.optimizer + self.exposed_comm

    @property
    def tokens_per_second(self) -> float:
        """Predicted tokens per second of the whole job."""
        return self.tokens_per_step / self.seconds

    @property
    def tokens_per_second_per_device(self) -> float:
        """Predicted tokens per second per device (what hfdist's metrics report per rank)."""
        return self.tokens_per_second / self.world


def group_crosses_nodes(dims: ParallelDims, axis: str, gpus_per_node: int, group: int | None = None) -> bool:
    """Whether the ranks of one `axis` group span nodes. The mesh lays out dp_replicate x dp_shard x cp x pp x tp
    (tp innermost, hfdist.config.dims), so a group's ranks lie `stride` apart (the product of the axes inside it)
    and one group covers stride x size consecutive ranks. "dp_shard_cp" is FSDP2's flattened group (cp and dp_shard
    are neighbouring axes); "cp_ulysses" the `group` innermost ranks of the cp axis (hfdist.parallel.context: a
    hybrid's all-to-alls); a ring over the cp axis is "cp" (a message crosses nodes where the cp group does)."""
    stride, size = {"tp": (1, dims.tp), "pp": (dims.tp, dims.pp), "cp": (dims.tp * dims.pp, dims.cp),
                    "ep": (dims.tp * dims.pp * dims.cp, dims.ep),
                    "cp_ulysses": (dims.tp * dims.pp, group or dims.cp),
                    "dp_shard": (dims.tp * dims.pp * dims.cp, dims.dp_shard),
                    "dp_shard_cp": (dims.tp * dims.pp, dims.cp * dims.dp_shard),
                    "dp_replicate": (dims.tp * dims.pp * dims.cp * dims.dp_shard, dims.dp_replicate)}[axis]
    return stride * size > gpus_per_node


def _stage_params(shape: ModelShape, dims: ParallelDims) -> tuple[float, float, float]:
    """(parameters, of which in the root unit (embedding, final norm, lm_head), decoder layers) on one rank of the
    pipeline stage with the most parameters (hfdist.plan.bytes.stage_params)."""
    from hfdist.plan.bytes import stage_layers, stage_params

    stages = [(stage_params(shape, dims, s, n), n) for s, n in enumerate(stage_layers(shape, dims.pp))]
    (params, root), layers = max(stages, key=lambda x: x[0][0])
    return params, root, layers


def _trainable_fraction(shape: ModelShape, w: Workload) -> float:
    if not w.lora:
        return 1.0
    lora = shape.layers * shape.lora_layer_params(w.lora_r, w.lora_targets)
    return lora / max(shape.total_params, 1)


def step_collectives(shape: ModelShape, rung: Rung, dims: ParallelDims, w: Workload,
                     accumulation: int) -> list[Collective]:
    """The collectives one rank issues in one optimizer step of `rung` laid out as `dims` (see the module
    docstring), `accumulation` forward/backward passes of `w.micro_batch` sequences each."""
    elem = 2 if w.dtype == "bf16" else 4
    params, root, layers = _stage_params(shape, dims)
    recompute = 2 if w.activation_checkpointing else 1  # forward collectives run again in backward
    # An MoE model: its experts gathered E / ep at a time, its MoE layers without tp's pair, ep's all-to-alls.
    expert_delta, tp_free_layers, a2a_bytes, a2a_calls = moe_step_terms(
        shape.moe, shape.hidden, shape.layers, layers, dims, w.micro_batch * w.seq // dims.cp, elem,
        accumulation * recompute, accumulation)
    params += expert_delta
    trainable = params * _trainable_fraction(shape, w)
    out: list[Collective] = []
    if rung.owns_sharding:
        n = dims.dp_shard * dims.cp
        if n > 1:
            # FSDP2 gathers in the compute dtype, each decoder layer in forward and again in backward (the root unit
            # once: FSDP2 keeps the root gathered for backward; a pipeline stage keeps all its units gathered through
            # the step, hfdist.parallel.parallelize.reshard_after_forward), every micro-step; it reduce-scatters
            # the fp32 gradients at every micro-step too (hfdist.train.trainer: no unsharded gradient is kept
            # across micro-batches; a pipeline's schedule reduces once per step).
            resharded = rung.fsdp is not None and rung.fsdp.reshard_after_forward and dims.pp == 1
            passes = accumulation if resharded else 1
            gathered = (2 * (params - root) + root if resharded else params) * passes
            units = (2 * layers + 1 if resharded else layers + 1) * passes
            reductions = accumulation if dims.pp == 1 else 1
            out.append(Collective("all_gather", "dp_shard_cp", n, gathered * (2 if w.dtype == "bf16" else 4),
                                  units, True))
            out.append(Collective("reduce_scatter", "dp_shard_cp", n, trainable * 4 * reductions,
                                  (layers + 1) * reductions, True))
        if dims.dp_replicate > 1:  # HSDP: the shards' gradients all-reduced across the replicas
            out.append(Collective("all_reduce", "dp_replicate", dims.dp_replicate, trainable * 4 / n, layers + 1,
                                  True))
    elif rung.kind is StrategyKind.DDP and dims.dp_replicate > 1:
        # fp32 gradients (autocast keeps the weights fp32), bucketed, once per step (no_sync while accumulating)
        out.append(Collective("all_reduce", "dp_replicate", dims.dp_replicate, trainable * 4,
                              max(trainable * 4 / DDP_BUCKET_BYTES, 1), True))
    elif rung.uses_deepspeed and dims.dp_shard > 1:
        n, grad = dims.dp_shard, trainable * elem
        modules = (layers + 1) * accumulation
        if rung.zero_stage >= 3:
            out.append(Collective("all_gather", "dp_shard", n, 2 * params * elem * accumulation, 2 * modules, True))
            out.append(Collective("reduce_scatter", "dp_shard", n, grad * accumulation, modules, True))
        else:  # ZeRO-1/2 reduce into the partitions every micro-step, then gather the updated weights once
            out.append(Collective("reduce_scatter", "dp_shard", n, grad * accumulation, modules, True))
            out.append(Collective("all_gather", "dp_shard", n, trainable * elem, 1, True))
    tokens = w.micro_batch * w.seq // dims.cp  # this rank's tokens per forward
    passes = accumulation * (1 + recompute)  # forward (again under recompute) and backward
    if dims.tp > 1:
        # Megatron TP with sequence parallelism: per layer two all-gathers of the rank's whole-sequence activations
        # (into attention and the MLP) and two reduce-scatters (out of them) in forward, their mirror in backward
        calls = (2 * layers - tp_free_layers) * passes
        act = tokens * shape.hidden * elem
        out.append(Collective("all_gather", "tp", dims.tp, act * calls, calls, False))
        out.append(Collective("reduce_scatter", "tp", dims.tp, act * calls, calls, False))
    if dims.cp > 1:  # the cp method's exchanges per layer (hfdist.plan.context_bytes)
        from hfdist.parallel.context_check import plan_cp
        from hfdist.plan.context_bytes import cp_layer_costs

        plan = plan_cp(shape.heads, shape.kv_heads, dims.tp, dims.cp, w.seq, w.cp_method)
        costs = cp_layer_costs(shape, tokens, elem, dims.tp, plan)
        if plan.ulysses > 1:  # q, k, v and the attention output exchanged, in forward (again) and in backward
            calls = layers * passes
            out.append(Collective("all_to_all", "cp_ulysses", plan.ulysses, costs.exchanged * calls, 4 * calls,
                                  False))
        if plan.ring > 1:  # keys and values to the next member every ring step, their gradients too in backward
            forwards, backwards = accumulation * recompute, accumulation
            sent = layers * (forwards * costs.ring_forward + backwards * costs.ring_backward)
            steps = layers * (forwards * 2 * (plan.ring - 1) + backwards * (2 * (plan.ring - 1) + 2 * plan.ring))
            out.append(Collective("send_recv", "cp", plan.ring, sent, steps, False))
    if a2a_calls:
        out.append(Collective("all_to_all", "ep", dims.ep, a2a_bytes, a2a_calls, False))
    if dims.pp > 1:
        # each micro-batch's activations forward and their gradients back across every stage boundary a rank has
        n_micro = rung.pipeline.n_microbatches if rung.pipeline is not None else 1
        calls = 2 * n_micro * accumulation
        out.append(Collective("send_recv", "pp", 2, tokens / n_micro * shape.hidden * elem / dims.tp * calls, calls,
                              False))
    return out


def _optimizer_seconds(rung: Rung, trainable: float, params: float, w: Workload, accumulation: int,
                       hardware: Hardware) -> float:
    """The optimizer step, and the host-link traffic of a rung that offloads (hfdist.plan.bytes.offload_device)."""
    from hfdist.plan.bytes import offload_device

    if offload_device(rung) == "none":
        return trainable * ADAM_BYTES_PER_PARAM / hardware.memory_bandwidth
    elem = 2 if w.dtype == "bf16" else 4
    # fp32 gradients down and the updated weights up, the step in host memory
    seconds = trainable * (4 + elem) / hardware.host_bandwidth + \
        trainable * ADAM_BYTES_PER_PARAM / hardware.host_memory_bandwidth
    if rung.offload_param != "none" or (rung.fsdp is not None and rung.fsdp.offload_params):
        seconds += 2 * accumulation * params * elem / hardware.host_bandwidth  # the weights, for forward and backward
    return seconds


def step_cost(shape: ModelShape, rung: Rung, dims: ParallelDims, w: Workload, *, global_batch: int,
              hardware: Hardware, gpus_per_node: int, flops_per_token: float) -> StepCost:
    """Predicted time of one optimizer step of `rung` laid out as `dims` on `hardware` (module docstring).

    Args:
        global_batch: sequences per optimizer step over all ranks (w.micro_batch per rank per forward; the
            accumulation makes up the rest).
        flops_per_token: the model's training FLOPs per token (hfdist.metrics.flops.flops_per_token).
    """
    world = dims.world_size
    accumulation = max(global_batch // (w.micro_batch * dims.dp), 1)
    tokens = global_batch * w.seq
    compute_flops = flops_per_token * tokens / world
    if w.activation_checkpointing:  # the layers' forward again: 2 of a trained weight's 6 FLOPs (of a frozen one's 4)
        compute_flops *= 1 + (1 / 2 if w.lora else 1 / 3)
    rows = w.micro_batch * w.seq / dims.cp
    n_micro = rung.pipeline.n_microbatches if rung.pipeline is not None and dims.pp > 1 else 1
    compute = compute_flops / hardware.matmul_rate(rows / n_micro)
    bubble = compute * (dims.pp - 1) / n_micro if dims.pp > 1 else 0.0
    params, _, layers = _stage_params(shape, dims)
    shards = dims.dp_shard * dims.cp if rung.owns_sharding else (dims.dp_shard if rung.uses_deepspeed else 1)
    trainable = params * _trainable_fraction(shape, w) / shards
    optimizer = _optimizer_seconds(rung, trainable, params / shards, w, accumulation, hardware)
    collectives = step_collectives(shape, rung, dims, w, accumulation)
    hidden = critical = 0.0
    for c in collectives:
        bandwidth = (hardware.inter_node_bandwidth if group_crosses_nodes(dims, c.axis, gpus_per_node, c.group)
                     else hardware.intra_node_bandwidth)
        seconds = c.calls * hardware.latency + c.moved_bytes / bandwidth
        if c.overlapped:
            hidden += seconds
        else:
            critical += seconds
    # Prefetched data-parallel traffic hides behind the compute, except what exceeds it and the first gather /
    # last reduction (one decoder layer's share).
    exposed = critical + max(hidden - compute, 0.0) + hidden / max(layers, 1)
    return StepCost(compute, bubble, optimizer, exposed, hidden + critical, tokens, world, tuple(collectives))
