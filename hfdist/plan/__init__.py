"""The memory planner: per-rank GPU bytes of every rung for a model and a cluster, from the config alone.

    bytes.py    the accounting: bytes per parameter, sharding per rung, offload, activations, buffers
    context_bytes.py  what each context-parallel method (Ulysses, ring) adds to a rank's bytes and traffic
    expert_bytes.py   the same for mixture-of-experts layers: ep, experts held, the all-to-all
    pipeline_bytes.py what a pipeline stage keeps beside its layers: outputs, input gradients, receive buffers
    state_bytes.py  the model-state bytes a run allocates per rank (what simulate and the tests measure against)
    layouts.py  every valid layout of a rung: degrees, micro-batch, recompute (pins narrow the search)
    cost.py     predicted step time of a layout: FLOPs over the matmul rate, collectives over the bandwidth, bubble
    planner.py  walks the ladder, picks the fastest predicted layout that fits (a near tie goes to the simpler
                rung), says what to change when nothing fits
    render.py   the plan itself (Plan, RungPlan) and how it reads: a table or JSON
    simulate.py the real parallelize recipe on the meta device and a fake process group, at any scale

    plan = plan_rungs(load_config("llama-3.1-70b"), gpus_per_node=8, nodes=4, gpu_mem_bytes=80 * GB)
    print(plan.table()); plan.to_json(); plan.recommended.command
"""

from hfdist.plan.bytes import (
    ADAM_BYTES_CHOICES,
    DTYPES,
    GB,
    PlanError,
    RankBytes,
    Workload,
    rung_rank_bytes,
)
from hfdist.plan.planner import plan_order, plan_rungs
from hfdist.plan.render import Plan, RungPlan
from hfdist.plan.state_bytes import StateBytes, predict_state_bytes

__all__ = ["Plan", "RungPlan", "plan_rungs", "plan_order", "PlanError", "Workload", "RankBytes", "StateBytes",
           "ADAM_BYTES_CHOICES", "DTYPES", "GB", "rung_rank_bytes", "predict_state_bytes"]
