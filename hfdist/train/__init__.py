"""Training: the HF Trainer taught about hfdist's strategies (its checkpoints are hfdist.checkpoint).

    trainer.py           StrategyMixin (any Trainer: data sharding, verification before step 1, saving,
                         checkpoints) and HfdistTrainer (with hfdist's loss, vocab-parallel under TP)
    pipeline_trainer.py  PipelineMixin: the schedule's step, clipping and names under PP
    context_trainer.py   ContextParallelMixin: batches cut along the sequence (cp)
    precision.py         mixed precision checked before step 1 and observed while training
    watchdog.py          collective timeout, heartbeats, the hang report
    preemption.py        a signal on any rank -> a checkpoint at the step's end and a stop (the exit code, the
                         signals, the environment's grace: hfdist.config.preemption, torch-free)
"""
