"""Parallelism on a DeviceMesh: what hfdist applies itself, and the check that a strategy is in effect.

    parallelize.py   the one recipe: apply_tp -> apply_ac -> pipeline split -> apply_fsdp
    tensor.py        Megatron TP through DTensor (+ sequence parallel, vocab-parallel loss), plan from the registry
    tensor_check.py  tp divisibility checks without torch (planner, launcher)
    tensor_styles.py the plan's own styles: decoder layers computed on local tensors, DTensor between layers
    fsdp.py          FSDP2 fully_shard per decoder layer + root (FULL_SHARD / HSDP)
    pipeline/        pipeline stages and torch.distributed.pipelining schedules
    verify.py        the strategy asked for is the one in effect, else stop
"""
