"""hfdist: pick, launch and compare parallelism strategies for Hugging Face causal-LM fine-tunes.

Sub-packages (import them; importing hfdist itself only checks the dependency floors, tens of milliseconds):
    hfdist.config     a run's configuration: FinetuneConfig, the ladder of rungs, degrees, precision rules
    hfdist.job        the fine-tuning job: launching, preflight checks, the run (config -> launch -> run)
    hfdist.parallel   DeviceMesh parallelism: the parallelize recipe, TP, FSDP2, pipeline stages, verification
    hfdist.models     the model-facts registry (Llama, Mistral, Qwen2, Qwen3, SmolLM3), shapes, presets, building
    hfdist.train      the Trainer taught about hfdist's strategies
    hfdist.checkpoint checkpoints on disk, the Trainer's hooks, resume rules, HF export and conversion
    hfdist.data       datasets and tokenizers, packing
    hfdist.plan       the memory planner (`hfdist plan`)
    hfdist.metrics    FLOPs, MFU, memory readers, pipeline bubble
    hfdist.callbacks  HF Trainer callbacks: memory, throughput, per-rank metrics, W&B
    hfdist.report     the comparison matrix and W&B reports
    hfdist.cli        the `hfdist` command
    hfdist.errors     HfdistError and the one-paragraph errors; hfdist.console: the screen and OUTPUT_DIR/logs
    hfdist.dependencies  the dependency floors (hfdist/requirements/), checked here at import
"""

__version__ = "0.1.0"
__all__ = ["__version__"]

from hfdist.dependencies import check as _check_dependencies  # noqa: E402 (the package's own names first)

# An environment outside the tested floors fails here, with one paragraph naming the versions (hfdist.dependencies).
_check_dependencies()
