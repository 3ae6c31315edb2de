"""Training: the HF Trainer taught about hfdist's strategies, and checkpoints that survive crashes.

    trainer.py        HfdistTrainer: loss under TP/PP, verification before step 1, saving (through export.py)
    checkpointing.py  the Trainer's checkpoint hooks: atomic, sharded (DCP) for the mesh rungs
    checkpoint.py     the on-disk checkpoint: staging + rename, identity marker, DCP save / load
    resume.py         which checkpoint a run resumes, and whether it may
    export.py         the trained model as a HF checkpoint or LoRA adapter, streamed one tensor at a time
    precision.py      mixed precision checked before step 1 and observed while training
"""
