"""Training: the HF Trainer taught about hfdist's strategies (its checkpoints are hfdist.checkpoint).

    trainer.py        HfdistTrainer: loss under TP/PP, verification before step 1, saving (hfdist.checkpoint)
    precision.py      mixed precision checked before step 1 and observed while training
    watchdog.py       collective timeout, heartbeats, the hang report
"""
