"""A run's configuration, torch-free: what the job reads and every library package may import (never hfdist.job).

    finetune.py   FinetuneConfig (every setting), its command-line parser and ConfigError
    ladder.py     the config ladder: a YAML (+ DeepSpeed JSON) -> a typed Rung (StrategyKind, dims, settings)
    rungs.py      the rung table: what each rung is for, the planner's order, the options it takes, its tests
    features.py   --compile / --qlora / --fp8 refused before launch on the rungs the table says do not take them
    translate.py  other projects' configs: FSDP1 keys -> FSDP2, DeepSpeed JSON values, refusals by name
    dims.py       ParallelDims: a rung's degrees (dp_replicate, dp_shard, cp, pp, tp) and their DeviceMesh
    precision.py  the precision rules: the precision a run trains in, a CPU run's changes, accelerate's part
"""
