"""The fine-tuning job: from a command line to a trained, saved and measured model.

    config.py          FinetuneConfig (every setting) and its command-line parser
    ladder.py          the config ladder: a YAML (+ DeepSpeed JSON) -> a typed Rung (StrategyKind, dims, settings)
    decision_table.py  what each shipped rung is for (scenario, what it shards, when to pick it)
    translate.py       other projects' configs: FSDP1 keys -> FSDP2, DeepSpeed JSON values, refusals by name
    world.py           the run's world: process count (one per GPU by default), degree overrides, GPU checks
    launch.py          the hand-over to `accelerate launch`, the single rung on one GPU, CPU translation
    quiet_launch.py    `accelerate launch` without the launch stack's tracebacks
    console.py         hfdist's lines on the screen, library chatter in OUTPUT_DIR/logs
    preflight.py       checks that must fail before any process starts
    run.py             the job's phases: data -> model -> parallelize -> train -> save -> summary
    summary.py         hfdist_summary.json
"""
