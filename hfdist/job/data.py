"""The job's data: packed training blocks and, when the job evaluates, packed held-out blocks, from a prepared
folder (`hfdist prepare`, --prepared-data) or prepared now.

    --prepared-data DIR written       DIR's blocks, checked to be made with this job's settings (seconds)
    --prepared-data DIR not there     prepared now and written to DIR, for the next run
    otherwise                         prepared now (datasets' cache makes a second preparation a read)

Held-out data is --eval-fraction of the dataset's rows (hfdist.data.preparation.prepare_split) or --eval-dataset,
prepared like the training data. The job prepares its data before any rank starts where it hands over to its own
launch (hfdist.job.preflight), so bad data is refused before any process and the ranks read the cache.
"""

from __future__ import annotations

from pathlib import Path

from hfdist.config.finetune import FinetuneConfig
from hfdist.data.prepared import Prepared, data_settings, is_prepared, read_prepared, write_prepared

__all__ = ["job_data", "evaluates", "report_lines", "prepare_before_launch"]


def evaluates(cfg: FinetuneConfig) -> bool:
    """Whether the job has held-out data to evaluate on."""
    return bool(cfg.eval_fraction or cfg.eval_dataset)


def job_data(cfg: FinetuneConfig, tokenizer, *, write: bool = True, num_proc: int | None = None) -> Prepared:
    """This job's packed blocks (module docstring), refused when they cannot fill one optimizer step.

    Args:
        write: whether this process may write a missing --prepared-data folder (rank 0 / the launcher only).
        num_proc: tokenization processes (default: hfdist.data.preparation's choice by dataset size).

    Raises:
        DataError: data hfdist cannot train on (named), a prepared folder of another job's settings, or too few
            blocks for one global batch.
    """
    from hfdist.data import load_raw_dataset
    from hfdist.data.preparation import check_enough_blocks, prepare_split, prepare_with_report

    settings = data_settings(tokenizer, dataset=cfg.dataset, eval_dataset=cfg.eval_dataset,
                             eval_fraction=cfg.eval_fraction, seed=cfg.seed, seq_len=cfg.seq_len,
                             long_documents=cfg.long_documents)
    folder = Path(cfg.prepared_data) if cfg.prepared_data else None
    if folder is not None and (is_prepared(folder) or _holds_something(folder)):
        prepared = read_prepared(folder, settings)  # a folder that is not a prepared one is refused there
    else:
        options = {"long_documents": cfg.long_documents, "num_proc": num_proc}
        raw = load_raw_dataset(cfg.dataset)
        if cfg.eval_fraction:
            split = prepare_split(raw, tokenizer, cfg.seq_len, eval_fraction=cfg.eval_fraction, seed=cfg.seed,
                                  **options)
            prepared = Prepared(split.train, split.train_report, split.eval, split.eval_report)
        else:
            train, train_report = prepare_with_report(raw, tokenizer, cfg.seq_len, **options)
            held = (prepare_with_report(load_raw_dataset(cfg.eval_dataset), tokenizer, cfg.seq_len, **options)
                    if cfg.eval_dataset else (None, None))
            prepared = Prepared(train, train_report, *held)
        if folder is not None and write:
            write_prepared(folder, settings, prepared)
    check_enough_blocks(len(prepared.train), cfg.global_batch_size, cfg.seq_len)
    return prepared


def _holds_something(folder: Path) -> bool:
    return folder.exists() and (not folder.is_dir() or any(folder.iterdir()))


def report_lines(cfg: FinetuneConfig, prepared: Prepared, seconds: float) -> list[str]:
    """What the job prints of its data: one line per side, and where the blocks came from."""
    lines = [prepared.train_report.line("data")]
    if prepared.eval_report is not None:
        lines.append(prepared.eval_report.line("eval data").split("\n")[0])
    if cfg.prepared_data:
        lines.append(f"hfdist: data ready in {seconds:.1f} s, in {cfg.prepared_data} (the lines above report its "
                     "preparation)")
    return lines


def prepare_before_launch(cfg: FinetuneConfig) -> None:
    """The job's data, prepared (or its prepared folder checked) in the process that starts the ranks, before any
    starts: bad data is refused there, and the ranks read datasets' cache (or the folder) in seconds."""
    import time

    from hfdist.data import load_tokenizer
    from hfdist.models.presets import is_preset

    tokenizer = load_tokenizer(cfg.model, is_preset=is_preset(cfg.model))
    started = time.perf_counter()
    prepared = job_data(cfg, tokenizer)
    print("\n".join(report_lines(cfg, prepared, time.perf_counter() - started)), flush=True)
