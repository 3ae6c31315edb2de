"""The fine-tuning job: from a command line to a trained, saved and measured model.

    world.py           the run's world: process count (one per GPU by default), degree overrides, GPU checks
    launch.py          the hand-over to `accelerate launch`, the single rung on one GPU
    quiet_launch.py    `accelerate launch` without the launch stack's tracebacks
    preflight.py       checks that must fail before any process starts
    data.py            the job's packed data: a prepared folder, or prepared now (before any rank where it can)
    run.py             the job's phases: data -> model -> parallelize -> train -> save -> summary
    summary.py         hfdist_summary.json
    collector.py       Python's garbage collector paused while a job's process imports
"""
