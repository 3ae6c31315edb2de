"""Checkpoints: saved while training so a run survives a crash, resumed (on another layout where the format allows),
and exported as a Hugging Face checkpoint.

    format.py         the checkpoint on disk: staging + rename, identity marker, DCP save / load of model + optimizer
    trainer_hooks.py  the Trainer's checkpoint hooks (a mixin of hfdist's trainers): atomic, sharded (DCP) for mesh rungs
    background.py     a DCP checkpoint written by a thread (async_save of a staged copy) while training goes on
    resume.py         the resume rules: which checkpoint a run resumes, and whether it may (what may change)
    hf_export.py      the trained model as a HF checkpoint or LoRA adapter, streamed one tensor at a time
    convert.py        any checkpoint -> a HF checkpoint (`hfdist checkpoint export`)
"""
