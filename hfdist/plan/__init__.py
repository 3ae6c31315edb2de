"""The memory planner: per-rank GPU bytes of every rung for a model and a cluster, from the config alone.

    bytes.py    the accounting: bytes per parameter, sharding per rung, offload, activations, buffers
    state_bytes.py  the model-state bytes a run allocates per rank (what simulate and the tests measure against)
    planner.py  walks the ladder in decision-table order, picks the simplest rung that fits, says what to change

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
from hfdist.plan.planner import Plan, RungPlan, plan_order, plan_rungs
from hfdist.plan.state_bytes import StateBytes, predict_state_bytes

__all__ = ["Plan", "RungPlan", "plan_rungs", "plan_order", "PlanError", "Workload", "RankBytes", "StateBytes",
           "ADAM_BYTES_CHOICES", "DTYPES", "GB", "rung_rank_bytes", "predict_state_bytes"]
