"""hfdist: pick, launch and compare parallelism strategies for Hugging Face Llama fine-tunes.

Library entry points (import the submodules; importing hfdist itself stays cheap):
    hfdist.ladder   the config ladder (rungs of the decision table)
    hfdist.run      the fine-tuning job behind scripts/finetune.py
    hfdist.plan     the memory planner (`hfdist plan`)
    hfdist.parallel fsdp.apply_fsdp, tensor.apply_tp, pipeline.PipelineRunner
    hfdist.callbacks HF Trainer callbacks: memory, throughput, W&B
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
