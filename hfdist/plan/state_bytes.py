"""Model-state bytes one rank holds at the optimizer step (parameters, gradients, optimizer state), as hfdist's
runs allocate them: what `hfdist simulate` and the end-to-end tests compare a run's measurements with. The planner's
own accounting (hfdist.plan.bytes) counts what a GPU run holds, buffers and activations included.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfdist.config.dims import ParallelDims
from hfdist.config.ladder import Rung
from hfdist.models.registry import LORA_TARGETS
from hfdist.models.shape import ModelShape
from hfdist.plan.bytes import DTYPES, PlanError, stage_layers

__all__ = ["StateBytes", "predict_state_bytes"]


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes one rank holds at the optimizer step, as hfdist's runs allocate them.

    Comparable with hfdist_summary.json ranks[i]: param_bytes, grad_bytes, optimizer_bytes (= Adam moments + any
    master copy the optimizer keeps; `master_bytes` is that copy alone).
    """

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    master_bytes: int = 0


def _mesh_rank_params(shape: ModelShape, dims: ParallelDims, stage: int) -> float:
    """Parameters one rank of pipeline `stage` holds on a mesh rung before FSDP2 splits them over dp_shard: its
    stage's layers, the embedding on the first stage, final norm + lm_head on the last, the projections, the
    embedding and lm_head divided by tp (the norms are replicated over tp)."""
    layers = stage_layers(shape, dims.pp)[stage]
    first, last = stage == 0, stage == dims.pp - 1
    head_own = shape.embed_params if (shape.tied and dims.pp > 1) else shape.head_params
    return (layers * (shape.layer_linear_params / dims.tp + shape.layer_params - shape.layer_linear_params)
            + (shape.embed_params / dims.tp if first else 0) + ((head_own / dims.tp + shape.hidden) if last else 0))


def predict_state_bytes(config, rung: Rung, world: int | None = None, dtype: str = "fp32", lora: bool = False,
                        lora_r: int = 16, lora_targets: tuple[str, ...] = LORA_TARGETS,
                        stage: int | None = None, qlora: bool = False) -> StateBytes:
    """Per-rank param/grad/optimizer bytes predicted for a run of `rung` on `world` processes (one node).

    Unlike the planner's accounting this follows what hfdist's code allocates: the model is built in fp32, so DDP
    and FSDP2 keep fp32 params and grads (bf16 is only the compute dtype) and Adam's fp32 moments, with no master
    copy; DeepSpeed casts the model to bf16 under bf16 and keeps an fp32 master partition (in fp32 too: a clone),
    plus an fp32 grad partition under bf16. Averages over ranks: FSDP2 splits each tensor's dim 0 and
    DeepSpeed pads partitions, so single ranks differ by up to a row per tensor / an alignment pad; Adam's step
    counters (a few bytes per tensor) are left out.

    `stage` (mesh rungs, full fine-tunes): the bytes of one rank of that pipeline stage (0 without pp) rather than
    the average: the first stage also holds the embedding and the last lm_head, which at pp = 4 puts stage 0 of
    Llama-3.1-8B 13% above the average (what `hfdist simulate` compares with).

    `qlora`: LoRA on a 4-bit base: the projections' weights at half a byte per value, sharded like any weight, and
    their quantisation states (hfdist.models.shape.quant_state_nbytes) whole on every rank of the stage that holds
    their layers.
    """
    lora = lora or qlora
    if dtype not in DTYPES:
        raise PlanError(f"dtype must be one of {DTYPES} (the run's mixed precision), got {dtype!r}.")
    dims = (rung.with_num_processes(world) if world else rung).dims  # the layout scripts/finetune.py runs
    shape = ModelShape.from_config(config)
    params = shape.total_params
    # hfdist's TP (fsdp rungs) splits every weight over tp but the norms (a few hundred bytes per layer); its
    # pipeline stages split the layers over pp (a tied embedding, held by the first and the last stage, twice).
    n = dims.dp_shard * (dims.tp * dims.pp * dims.cp if rung.owns_sharding else 1)
    tp = dims.tp if rung.owns_sharding else 1
    # A tp rank's adapters (one matrix of each pair whole, ModelShape.lora_layer_params) counted tp times: dividing
    # by n below leaves each rank its share, as for the split weights.
    trainable = shape.layers * shape.lora_layer_params(lora_r, tuple(lora_targets), tp) * tp if lora else params
    total = params + (trainable if lora else 0)
    ds = rung.uses_deepspeed
    zero = rung.zero_stage if ds else 0
    if stage is not None:
        if not rung.owns_sharding or lora or not 0 <= stage < dims.pp:
            raise PlanError(f"a per-stage prediction needs a mesh rung, a full fine-tune and a stage in [0, "
                            f"{dims.pp}); got {rung.name}, lora={lora}, stage={stage}.")
        total = trainable = _mesh_rank_params(shape, dims, stage)
        n = dims.dp_shard * dims.cp  # FSDP2 shards a stage's tp-split parameters over dp_shard x cp
    weight = 2 if (ds and dtype == "bf16") else 4
    fp32_grad = 4 if (ds and dtype == "bf16") else 0
    shard_opt = n if (rung.owns_sharding or zero >= 1) else 1
    # Bytes of the parameters held in the weights' dtype (or 4 bits) and of what stays whole on every rank.
    stored = total * weight
    whole = 0
    if qlora:
        stored += shape.layers * (shape.layer_packed_bytes - shape.layer_matmul_params * weight)
        whole = shape.layers * shape.layer_quant_state_bytes / (dims.pp if rung.owns_sharding else 1)  # a stage's
    if rung.owns_sharding or zero >= 3:
        param_bytes = stored / n + whole
        grads = trainable * (fp32_grad or weight) / n
    else:
        param_bytes = stored + whole
        grads = trainable * (weight + fp32_grad) / n if zero >= 2 else trainable * weight + trainable * fp32_grad / n
    # DeepSpeed clones its fp32 partition even of fp32 weights: ZeRO-1/2 always (stage_1_and_2.py), ZeRO-3 because
    # its "no other copy" test compares a torch.device with the accelerator's device name, a str, and fails.
    master = trainable * 4 / shard_opt if ds else 0
    moments = trainable * 8 / shard_opt
    return StateBytes(int(param_bytes), int(grads), int(moments + master), int(master))
