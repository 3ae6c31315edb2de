"""RankMetricsCallback: every rank's memory and throughput reach the logging rank, and W&B, each logging step.

One all_gather of a fixed-length float64 vector per logging step (no pickling, one collective) carries each rank's
window figures; the logging rank turns them into `rank{r}/...` series plus min/max/mean and logs them with the loss.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hfdist.callbacks.memory import MemoryCallback
from hfdist.callbacks.throughput import ThroughputCallback
from hfdist.callbacks.wandb_sink import WandbSink, aggregate_ranks
from hfdist.metrics.flops import mfu, tflops_per_device

__all__ = ["RankMetricsCallback", "METRIC_KEYS"]

METRIC_KEYS = ("step_seconds", "tokens", "tokens_per_second", "samples_per_second", "tflops_per_device", "mfu", "peak_memory_bytes",
               "param_bytes", "grad_bytes", "optimizer_bytes", "master_bytes", "peak_allocated_bytes",
               "peak_reserved_bytes", "peak_active_bytes", "alloc_retries", "ooms")


def _gather_vectors(values: list[float], device: torch.device) -> list[list[float]]:
    if not (dist.is_available() and dist.is_initialized()):
        return [values]
    vec = torch.tensor(values, dtype=torch.float64, device=device)
    out = torch.empty(dist.get_world_size() * len(values), dtype=torch.float64, device=device)  # gloo wants 1-D
    dist.all_gather_into_tensor(out, vec)
    return out.view(dist.get_world_size(), len(values)).cpu().tolist()


class RankMetricsCallback(TrainerCallback):
    """Per-rank memory + throughput to the logging rank and W&B, once per logging step.

    Args:
        memory, throughput: the callbacks that measure (registered with the same Trainer).
        sink: where the logging rank writes (a WandbSink; inactive on other ranks).
        flops_per_token: training FLOPs per token of the model (hfdist.metrics.flops).
        peak_flops: the device's peak FLOP/s for MFU, or None to leave MFU out.
        logging_rank: the rank that logs (a rank of the last stage under PP).
        ranks_per_replica: tp x pp: the ranks that process the same tokens together, so a rank's share of the
            work is its token rate over this number.
    """

    def __init__(self, memory: MemoryCallback, throughput: ThroughputCallback, sink: WandbSink,
                 flops_per_token: float, peak_flops: float | None, logging_rank: int = 0,
                 ranks_per_replica: int = 1) -> None:
        self.memory, self.throughput, self.sink = memory, throughput, sink
        self.flops_per_token, self.peak_flops, self.logging_rank = flops_per_token, peak_flops, logging_rank
        self.ranks_per_replica = ranks_per_replica

    def rates(self, tokens_per_second: float) -> dict[str, float]:
        """TFLOP/s per device and MFU (when a peak is known) from the token rate a rank saw."""
        per_device = tokens_per_second / self.ranks_per_replica
        out = {"tflops_per_device": tflops_per_device(per_device, self.flops_per_token)}
        if self.peak_flops:
            out["mfu"] = mfu(per_device, self.flops_per_token, self.peak_flops)
        return out

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:
            return
        window = self.throughput.take_window()
        record = {**self.memory.take_window(), **window, **self.rates(window["tokens_per_second"])}
        device = args.device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")
        rows = _gather_vectors([float(record.get(k, math.nan)) for k in METRIC_KEYS], device)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank != self.logging_rank:
            return
        records = [{"rank": r, **{k: v for k, v in zip(METRIC_KEYS, row) if not math.isnan(v)}}
                   for r, row in enumerate(rows)]
        metrics = {**aggregate_ranks(records), "loss": logs["loss"]}
        if "learning_rate" in logs:
            metrics["learning_rate"] = logs["learning_rate"]
        self.sink.log(metrics, step=state.global_step)
