"""The console of a training run: one progress bar (loss, tokens/s, memory) instead of the Trainer's printed dict
per logging step, and a closing table of every rank's figures."""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

from transformers.trainer_callback import ProgressCallback

from hfdist.callbacks.rank_metrics import slowest_rank

__all__ = ["MetricsProgressCallback", "RunFigures", "format_bytes", "rank_table"]


class RunFigures(Protocol):
    """What the bar reads from the callback that measures the run (hfdist's DistributedMetricsCallback)."""

    ranks_per_replica: int  # ranks that process the same tokens together (tp x pp)

    def print_closing_table(self, args, state) -> None:
        """Print every rank's figures for the run (rank 0)."""


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1 (e.g. "1.50 GiB")."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


class MetricsProgressCallback(ProgressCallback):
    """The Trainer's tqdm bar with the latest loss, tokens/s and peak memory in its postfix; prints no dicts.

    The latest eval loss joins the postfix (`eval=`); other logs without a training loss are still written above the
    bar, as the Trainer does; the Trainer's closing summary dict is not (the closing table says more). With the run's figures attached (`metrics`,
    a DistributedMetricsCallback), tokens/s is the global rate (summed over ranks, over tp x pp) and memory the
    largest rank's peak, and the metrics' closing table is printed once the bar is closed.
    """

    def __init__(self, metrics: RunFigures | None = None) -> None:
        super().__init__()
        self.metrics = metrics
        self.eval_loss: float | None = None  # the latest evaluation's, shown with every later step
        self._last: dict[str, str] = {}  # the latest training step's postfix

    def adopt(self, bar: ProgressCallback) -> None:
        """Take over a ProgressCallback's state (its bar, if it already opened one)."""
        vars(self).update({k: v for k, v in vars(bar).items() if k != "metrics"})

    def postfix(self, logs: Mapping[str, Any]) -> dict[str, str]:
        """What the bar shows for one training log."""
        out = {"loss": f"{logs['loss']:.4f}"}
        if "tokens_per_second/sum" in logs:
            replica = self.metrics.ranks_per_replica if self.metrics is not None else 1
            out["tok/s"] = f"{logs['tokens_per_second/sum'] / replica:,.0f}"
        if "peak_memory_bytes/max" in logs:
            out["mem"] = format_bytes(logs["peak_memory_bytes/max"])
        if self.eval_loss is not None:
            out["eval"] = f"{self.eval_loss:.4f}"
        return out

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        if "loss" in logs:
            self._last = self.postfix(logs)
            self.training_bar.set_postfix(self._last)
        elif "eval_loss" in logs:  # the bar carries it from now on: no dict above the bar
            self.eval_loss = logs["eval_loss"]
            self.training_bar.set_postfix({**self._last, "eval": f"{self.eval_loss:.4f}"})
        elif "train_runtime" not in logs and not any(k.startswith("checkpoint/") for k in logs):
            super().on_log(args, state, control, logs=logs, **kwargs)  # checkpoints' costs: trackers and summary

    def on_train_end(self, args, state, control, **kwargs):
        super().on_train_end(args, state, control, **kwargs)
        if self.metrics is not None:
            self.metrics.print_closing_table(args, state)


_COLUMNS = (("peak memory", "peak_memory_bytes", format_bytes), ("tokens/s", "tokens_per_second", "{:,.1f}".format),
            ("TFLOP/s", "tflops_per_device", "{:.4g}".format), ("MFU", "mfu", "{:.1%}".format))


def rank_table(ranks: Sequence[Mapping[str, Any]], *, title: str = "", outputs: Mapping[str, str] = (),
               notes: Sequence[str] = ()) -> str:
    """`title`, then every rank's peak memory, tokens/s, TFLOP/s and MFU as an aligned table with the slowest rank
    marked, then `notes` and where the run's outputs are (`outputs`: what -> path)."""
    columns = [(name, key, fmt) for name, key, fmt in _COLUMNS if any(key in r for r in ranks)]
    slowest = slowest_rank(ranks) if len(ranks) > 1 else None
    rows = [["rank", *(name for name, _, _ in columns)]]
    rows += [[str(r["rank"]), *(fmt(r[key]) if key in r else "-" for _, key, fmt in columns)] for r in ranks]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [title] if title else []
    for row, record in zip(rows, [None, *ranks]):
        mark = "  <- slowest" if record is not None and record["rank"] == slowest else ""
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) + mark)
    lines += list(notes)
    lines += [f"{what}: {where}" for what, where in dict(outputs).items()]
    return "\n".join(lines)
