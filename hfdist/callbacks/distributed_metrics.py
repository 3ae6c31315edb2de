"""DistributedMetricsCallback: every rank's memory and throughput in the Trainer's own logs, for any Trainer.

    trainer = Trainer(..., callbacks=[DistributedMetricsCallback()])   # or TRL's SFTTrainer, under any launcher

Each logging step the callback measures its rank's window (steps since the previous log), gathers every rank's
figures in one collective (an MoE model's router load among them: hfdist.models.router_stats), and adds `rank{r}/<figure>`, `<figure>/min|max|mean` (`/sum` for token counts) and
`slowest_rank` to the logs before any `report_to` integration sees them (hfdist.callbacks.placement), and to the
log's entry in `state.log_history`. When training ends it gathers each rank's figures for the whole run
(`.ranks`) and prints them as a table.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from transformers import Trainer
from transformers.trainer_callback import CallbackHandler, ProgressCallback, TrainerCallback

from hfdist.callbacks.memory import COUNT_KEYS, PEAK_KEYS, MemoryMeter
from hfdist.callbacks.placement import find_caller, move_ahead_of_integrations, replace_callback
from hfdist.callbacks.progress import MetricsProgressCallback, rank_table
from hfdist.callbacks.rank_metrics import aggregate_ranks, gather_records, slowest_rank, straggler_line
from hfdist.callbacks.throughput import ThroughputMeter
from hfdist.metrics.flops import TokenFlops, mfu, model_token_flops, tflops_per_device
from hfdist.metrics.memory import held_outside_bytes
from hfdist.metrics.peaks import PeakFlops, device_peak_flops
from hfdist.models.registry import UnsupportedModelError

__all__ = ["DistributedMetricsCallback", "WINDOW_KEYS", "RUN_KEYS"]

_STATE_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes", "master_bytes")
_RATE_KEYS = ("step_seconds", "data_wait_seconds", "tokens", "tokens_per_second", "samples_per_second", "tflops_per_device", "mfu")
# An MoE model's router load (hfdist.models.router_stats): tokens of this rank's batch routed per expert per MoE layer
# per step, the least and the most loaded expert.
_ROUTER_KEYS = ("expert_tokens_min", "expert_tokens_max")
# What one logging window reports per rank, in the order the gathered vector carries them.
WINDOW_KEYS = (*_RATE_KEYS, *PEAK_KEYS, *_STATE_KEYS, *COUNT_KEYS, *_ROUTER_KEYS)
# What the whole run reports per rank (`.ranks`, hfdist_summary.json).
RUN_KEYS = (*WINDOW_KEYS, "steps", "setup_peak_memory_bytes", "training_peak_bytes", "training_resident_bytes")
_LOW_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _compute_dtype(args, model: torch.nn.Module | None) -> str:
    """The dtype the matmuls run in, for the peak to divide by: the Trainer's mixed precision, else the weights'."""
    if args.bf16 or args.fp16:
        return "bf16" if args.bf16 else "fp16"
    if model is not None:  # hfdist's mesh rungs cast through FSDP2's policy, not the Trainer's autocast
        from hfdist.parallel.fsdp import fsdp_compute_dtype

        if (policy := fsdp_compute_dtype(model)) in _LOW_PRECISION:
            return _LOW_PRECISION[policy]
    first = next((p for p in model.parameters() if p.is_floating_point()), None) if model is not None else None
    if first is not None and first.dtype in _LOW_PRECISION:
        return _LOW_PRECISION[first.dtype]
    return "tf32" if args.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32 else "fp32"


def _warn(state, message: str) -> None:
    if state.is_world_process_zero:
        print(f"hfdist: warning: {message}", file=sys.stderr, flush=True)


class DistributedMetricsCallback(TrainerCallback):
    """Per-rank tokens/s, TFLOP/s, MFU, step time, peak memory and model-state bytes in the Trainer's logs.

    Needs no arguments: the model, its FLOPs per token (hfdist.metrics.flops, from the real batches' sequence
    lengths), the device's peak FLOP/s (hfdist.metrics.peaks), the world and the ranks that share a batch
    (`Trainer.get_tp_size()`) are found when training starts. Figures per rank and logging step (WINDOW_KEYS):
    tokens and samples per second, mean step seconds and the part of them spent waiting for data (from the end of
    the previous step's logging and saving to the step's begin), TFLOP/s per device, MFU, peak memory (CUDA: max allocated,
    plus reserved/active peaks, allocation retries and OOMs in the window; CPU: the process's peak RSS) and the
    bytes of params, gradients (their peak), optimizer state and master weights this rank holds.

    Args:
        ranks_per_replica: ranks that process the same tokens together (tp x pp); default: the Trainer's
            get_tp_size().
        progress_bar: replace the Trainer's progress bar (a dict printed per log, unreadable with these figures)
            by one bar showing loss, tokens/s and memory.
        print_table: print every rank's figures for the run when training ends (rank 0).

    After training, `ranks` holds each rank's figures for the whole run (RUN_KEYS; rates leave out the first
    step), on every rank, and `slowest_rank` the rank with the lowest tokens/s.
    """

    def __init__(self, *, ranks_per_replica: int | None = None, progress_bar: bool = True,
                 print_table: bool = True) -> None:
        self.ranks_per_replica = ranks_per_replica or 1
        self._fixed_replica = ranks_per_replica is not None
        self.progress_bar, self.print_table = progress_bar, print_table
        self.flops: TokenFlops | None = None
        self.peak: PeakFlops | None = None
        self.notes: list[str] = []
        self.ranks: list[dict[str, Any]] = []
        self.slowest_rank: int | None = None
        self._memory, self._throughput = MemoryMeter(), ThroughputMeter()
        self._device = torch.device("cpu")
        self._distributed = self._running = False
        self._handler: CallbackHandler | None = None
        self._model: torch.nn.Module | None = None
        self._bar: MetricsProgressCallback | None = None

    # -- set-up: found on the first event that shows them (on_init_end is outside the Trainer's timed loop) ---------

    def _settle(self, args, state, model: torch.nn.Module | None) -> None:
        """Take the place ahead of the integrations in the calling Trainer's list, and count the model's FLOPs and
        look up the device's peak; again for another Trainer or model (the callback may serve several)."""
        handler = find_caller(CallbackHandler)
        if handler is not None and any(cb is self for cb in handler.callbacks):
            if handler is not self._handler:
                self._handler, self._bar = handler, None
                move_ahead_of_integrations(handler, self)
                if self.progress_bar:
                    self._take_over_progress_bar(handler)
        elif self._handler is None:
            _warn(state, "DistributedMetricsCallback was not called by a Trainer's CallbackHandler; report_to "
                  "integrations listed before it will log without the per-rank figures.")
        if model is not None and model is not self._model:
            self._model, self.notes = model, []
            try:
                self.flops = model_token_flops(model)
            except UnsupportedModelError as exc:
                self.flops = None
                self.notes.append("TFLOP/s and MFU left out: no FLOPs count for this architecture.")
                _warn(state, f"{exc} DistributedMetricsCallback reports no TFLOP/s or MFU for it.")
            self.peak = device_peak_flops(args.device, _compute_dtype(args, model))

    def _take_over_progress_bar(self, handler: CallbackHandler) -> None:
        bar = next((cb for cb in handler.callbacks if isinstance(cb, MetricsProgressCallback)), None)
        if bar is None:
            theirs = next((cb for cb in handler.callbacks if type(cb) is ProgressCallback), None)
            if theirs is None:  # no tqdm bar (disable_tqdm, a notebook's): leave the Trainer's console alone
                return
            bar = MetricsProgressCallback()
            bar.adopt(theirs)
            replace_callback(handler, theirs, bar)
        bar.metrics, self._bar = self, bar

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._settle(args, state, model)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._settle(args, state, model)
        trainer = find_caller(Trainer)
        if not self._fixed_replica:
            self.ranks_per_replica = trainer.get_tp_size() if trainer is not None else 1
        self._device = args.device
        self._distributed = args.world_size > 1
        if not self._distributed and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            _warn(state, f"a process group of {dist.get_world_size()} ranks exists, but the Trainer trains in one "
                  "process (each rank alone, on its own data). On a machine without GPUs, pass use_cpu=True to "
                  "TrainingArguments or set ACCELERATE_USE_CPU=1 for data-parallel training over CPU processes.")
        self._memory, self._throughput = MemoryMeter(), ThroughputMeter()  # a new run per train() call
        self._memory.start(model, optimizer, args.device,
                           held_outside=(lambda: held_outside_bytes(trainer.model_wrapped)) if trainer is not None
                           else (lambda: 0))
        self._throughput.start(model, args.device)
        self._throughput.idle()
        self._running = True

    def on_step_begin(self, args, state, control, **kwargs):
        if self._running:
            self._throughput.step_begin()

    def on_step_end(self, args, state, control, **kwargs):
        if self._running:
            self._throughput.step_end()
            self._memory.step_end()

    # -- figures ------------------------------------------------------------------------------------------------

    def _rates(self, totals: Mapping[str, float]) -> dict[str, float]:
        seconds, tokens = totals["seconds"], totals["tokens"]
        out = {"step_seconds": seconds / max(totals["steps"], 1), "tokens": tokens,
               "data_wait_seconds": totals["data_wait"] / max(totals["steps"], 1),
               "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
               "samples_per_second": totals["samples"] / seconds if seconds > 0 else 0.0}
        if self.flops is not None and tokens > 0 and seconds > 0:
            # Under TP / PP the ranks of a replica share each token's FLOPs: a device's share is 1 / (tp x pp).
            per_device = out["tokens_per_second"] / self.ranks_per_replica
            per_token = self.flops.of_batch(tokens, totals["squared_lengths"]) / tokens
            out["tflops_per_device"] = tflops_per_device(per_device, per_token)
            if self.peak is not None:
                out["mfu"] = mfu(per_device, per_token, self.peak.flops)
        return out

    def _gather(self, record: Mapping[str, float], keys: tuple[str, ...]) -> list[dict[str, Any]]:
        """Every rank's record, with MFU against one peak for all: the highest any rank has. Each rank measures a CPU's
        peak itself and a busy machine only ever lowers it; GPUs of one model look up the same figure."""
        own = {"peak_flops": self.peak.flops} if self.peak is not None else {}
        records = gather_records({**record, **own}, (*keys, "peak_flops"), self._device, self._distributed)
        top = max((r["peak_flops"] for r in records if "peak_flops" in r), default=None)
        for r in records:
            peak = r.pop("peak_flops", None)
            if "mfu" in r:
                r["mfu"] *= peak / top
        if top is not None and self.peak is not None and top != self.peak.flops:
            self.peak = PeakFlops(top, f"{self.peak.source}, the highest of the ranks'")
        return records

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._running or not logs or "loss" not in logs:  # training logs only: the same on every rank
            return
        totals = self._throughput.take_window()
        # The router load over the window's steps: this rank's tokens per expert, and the global batch's (the same
        # on every rank: logged once, as moe/...).
        mine, everyone = _router_load(self._model, totals["steps"])
        window = {**self._memory.take_window(), **self._rates(totals), **mine}
        records = self._gather(window, WINDOW_KEYS)
        figures = {**aggregate_ranks(records), **{f"moe/{k}": v for k, v in everyone.items()}}
        slowest = slowest_rank(records)
        if slowest is not None:
            figures["slowest_rank"] = slowest
        logs.update(figures)
        # Trainer.log appended its copy of these logs just before calling the callbacks.
        entry = state.log_history[-1] if state.log_history else {}
        if entry.get("step") == state.global_step and entry.get("loss") == logs["loss"]:
            entry.update(figures)
        self._throughput.idle()  # the gather above is this rank's work, not a wait for data

    def on_save(self, args, state, control, **kwargs):
        if self._running:
            self._throughput.idle()

    def on_evaluate(self, args, state, control, **kwargs):
        if self._running:  # evaluation is the run's work, not a wait for the next step's data
            self._throughput.idle()

    def on_train_end(self, args, state, control, **kwargs):
        if not self._running:
            return
        self._running = False
        run = self._throughput.finish()
        record = {**self._memory.finish(), **self._rates(run["rated"]),
                  "tokens": run["all"]["tokens"], "steps": run["all"]["steps"]}
        self.ranks = self._gather(record, RUN_KEYS)
        self.slowest_rank = slowest_rank(self.ranks)
        if self._bar is None:  # else the bar prints it once it has closed
            self.print_closing_table(args, state)

    def print_closing_table(self, args, state) -> None:
        """Print closing_table on the world's rank 0, if `print_table`."""
        if self.print_table and state.is_world_process_zero:
            print(self.closing_table(_outputs(args)), flush=True)

    def closing_table(self, outputs: Mapping[str, str] = ()) -> str:
        """Every rank's figures for the run (after training) as a table, with what they are measured against and
        where the outputs are (only the outputs before training has ended)."""
        if not self.ranks:
            return "\n".join(f"{what}: {where}" for what, where in dict(outputs).items())
        steps = self.ranks[0].get("steps", 0)
        title = f"hfdist: per-rank figures over {steps} steps" + (" (rates leave out the first)" if steps > 1 else "")
        notes = list(self.notes)
        if (straggler := straggler_line(self.ranks)) is not None:
            notes.append(straggler)
        if self.peak is not None and any("mfu" in r for r in self.ranks):
            notes.append(f"MFU against {self.peak.flops / 1e12:.4g} TFLOP/s ({self.peak.source}).")
        return rank_table(self.ranks, title=title, notes=notes, outputs=outputs)


def _router_load(model: torch.nn.Module | None, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """(this rank's, the global batch's) tokens per expert of an MoE model over the last `steps` steps
    (hfdist.models.router_stats.RouterRecorder.take_window), or two empty dicts (a dense model)."""
    recorder = getattr(model, "hfdist_router", None) if model is not None else None
    return recorder.take_window(steps) if recorder else ({}, {})


def _outputs(args) -> dict[str, str]:
    """Where a Trainer run's outputs are: its output_dir, and the W&B / TensorBoard runs it reports to."""
    out = {"outputs": str(Path(args.output_dir).resolve())}
    wandb = sys.modules.get("wandb")
    if "wandb" in args.report_to and wandb is not None and getattr(wandb, "run", None) is not None:
        out["W&B run"] = str(wandb.run.settings.sync_dir)
    if "tensorboard" in args.report_to:
        out["TensorBoard"] = str(args.logging_dir)
    return out
