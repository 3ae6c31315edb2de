"""HF Trainer callbacks that measure a run per rank, and the W&B sink.

    distributed_metrics.py  DistributedMetricsCallback: every rank's figures in the Trainer's logs (the one to use)
    memory.py               MemoryMeter: bytes of params / grads / optimizer state held, peak memory, per window
    throughput.py           ThroughputMeter: step times, real tokens and their sequences' lengths
    rank_metrics.py         one collective for every rank's figures; `rank{r}/...` + min/max/mean series
    placement.py            finding the Trainer's callback list, to run ahead of the report_to integrations
    progress.py             one progress bar (loss, tokens/s, memory) and the closing per-rank table
    tracker.py              what every tracker shares: rank 0 only, never stopping training
    wandb_sink.py           one W&B run per strategy run
    trackers.py             MLflow, TensorBoard and Trackio runs; every tracker of a run behind one interface
    tracker_logs.py         the trackers fed with the Trainer's logs
    losses.py               the loss of every optimizer step

`from hfdist.callbacks import DistributedMetricsCallback` imports transformers; the W&B sink alone does not.
"""

from __future__ import annotations

__all__ = ["DistributedMetricsCallback"]


def __getattr__(name: str):
    if name == "DistributedMetricsCallback":  # lazily: hfdist.callbacks.wandb_sink stays light to import
        from hfdist.callbacks.distributed_metrics import DistributedMetricsCallback

        return DistributedMetricsCallback
    raise AttributeError(f"module 'hfdist.callbacks' has no attribute {name!r}")
