"""Which HfdistTrainer class trains a rung: the strategies that change the training step have their own."""

from __future__ import annotations

from hfdist.config.ladder import Rung
from hfdist.train.context_trainer import ContextParallelTrainer
from hfdist.train.pipeline_trainer import PipelineTrainer
from hfdist.train.trainer import HfdistTrainer

__all__ = ["trainer_class"]


def trainer_class(rung: Rung) -> type[HfdistTrainer]:
    """PipelineTrainer for pipeline stages (pp > 1), ContextParallelTrainer for context parallelism (cp > 1; the two
    do not compose: hfdist.job.preflight refuses it), else HfdistTrainer."""
    if rung.uses_pipeline:
        return PipelineTrainer
    if rung.dims.cp > 1:
        return ContextParallelTrainer
    return HfdistTrainer
