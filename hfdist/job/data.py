"""The job's data: packed training blocks and, when the job evaluates, packed held-out blocks, from a prepared
folder (`hfdist prepare`, --prepared-data) or prepared now.

    --prepared-data DIR written       DIR's blocks, checked to be made with this job's settings and sources (seconds)
    --prepared-data DIR not there     prepared now and written to DIR, for the next run (an interrupted one resumes)
    otherwise                         prepared now into datasets' cache, in a folder keyed by the settings and the
                                      sources' identities, which a second run reads

The data is one source or a mixture of several (hfdist.data.sources, hfdist.data.mixture); held-out data is each
source's eval share (--eval-fraction, or its own) or --eval-dataset, prepared like the training data. The job
prepares its data before any rank starts where it hands over to its own launch (hfdist.job.preflight), so bad data is
refused before any process and the ranks read the cache.
"""

from __future__ import annotations

from pathlib import Path

from hfdist.config.finetune import FinetuneConfig, holds_out
from hfdist.config.sources import DataSource, parse_source
from hfdist.data.prepared import (
    Prepared,
    data_settings,
    holds_other_files,
    is_prepared,
    read_folder,
    read_prepared,
    write_prepared,
)
from hfdist.data.sources import check_sources, with_eval_fraction

__all__ = ["job_data", "job_sources", "evaluates", "report_lines", "prepare_before_launch"]


def evaluates(cfg: FinetuneConfig) -> bool:
    """Whether the job has held-out data to evaluate on."""
    return holds_out(cfg)


def _given_sources(cfg: FinetuneConfig) -> tuple[DataSource, ...]:
    """The sources as the job names them (--dataset, each a spec)."""
    return tuple(map(parse_source, cfg.dataset)) if cfg.dataset else (DataSource(path=None, name="default"),)


def job_sources(cfg: FinetuneConfig) -> tuple[DataSource, ...]:
    """The job's training sources (--dataset, each with --eval-fraction as its eval share unless it sets its own).

    Raises:
        DataError: a bad source spec, or sources that do not go together (hfdist.data.sources.check_sources).
    """
    return check_sources(with_eval_fraction(_given_sources(cfg), cfg.eval_fraction), cfg.eval_dataset)


def _eval_source(cfg: FinetuneConfig) -> DataSource | None:
    if not cfg.eval_dataset:
        return None
    source = parse_source(cfg.eval_dataset)
    return DataSource(**{**vars(source), "name": f"{source.name} (held out)"})


def _cache_folder(settings, sources: tuple[DataSource, ...]) -> Path:
    """Where a job without --prepared-data keeps its prepared blocks: in datasets' cache, under a key of the
    settings and the sources' identities (path, size, modification time)."""
    import hashlib
    import json
    from dataclasses import asdict

    import datasets

    from hfdist.data.reading import identity

    key = hashlib.sha256(json.dumps([asdict(settings), [identity(s) for s in sources]]).encode()).hexdigest()[:24]
    return Path(datasets.config.HF_DATASETS_CACHE) / "hfdist-prepared" / key


def job_data(cfg: FinetuneConfig, tokenizer, *, write: bool = True, num_proc: int | None = None) -> Prepared:
    """This job's packed blocks (module docstring), refused when they cannot fill one optimizer step.

    Args:
        write: whether this process may write a missing --prepared-data folder (rank 0 / the launcher only);
            the others prepare into datasets' cache instead.
        num_proc: tokenization processes (default: hfdist.data.preparation's choice by dataset size).

    Raises:
        DataError: data hfdist cannot train on (named), a prepared folder of another job's settings or sources, or
            too few blocks for one global batch.
    """
    from filelock import FileLock

    from hfdist.data.preparation import build, check_enough_blocks
    from hfdist.data.reading import identity

    sources, held_out = job_sources(cfg), _eval_source(cfg)
    settings = data_settings(tokenizer, sources=_given_sources(cfg), eval_dataset=cfg.eval_dataset,
                             eval_fraction=cfg.eval_fraction, seed=cfg.seed, seq_len=cfg.seq_len,
                             long_documents=cfg.long_documents)
    folder = Path(cfg.prepared_data) if cfg.prepared_data else None
    if folder is not None and (is_prepared(folder) or holds_other_files(folder)):
        prepared = read_prepared(folder, settings, sources)  # a folder that is not a prepared one is refused there
    else:
        target = folder if folder is not None and write else _cache_folder(settings, sources)
        target.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target / ".lock")):  # one process prepares; the others then read what it wrote
            if is_prepared(target):
                prepared = read_folder(target)
            else:
                every = sources + ((held_out,) if held_out is not None else ())
                prepared = build(sources, tokenizer, cfg.seq_len, target, eval_source=held_out, seed=cfg.seed,
                                 long_documents=cfg.long_documents, num_proc=num_proc)
                write_prepared(target, settings, prepared, {s.name: identity(s) for s in every})
    check_enough_blocks(prepared.train_report.blocks, cfg.global_batch_size, cfg.seq_len)
    return prepared


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
    from hfdist.job.collector import resume_collector
    from hfdist.models.presets import is_preset

    resume_collector()  # the imports are done; tokenizing makes garbage of its own
    tokenizer = load_tokenizer(cfg.model, is_preset=is_preset(cfg.model))
    started = time.perf_counter()
    prepared = job_data(cfg, tokenizer)
    print("\n".join(report_lines(cfg, prepared, time.perf_counter() - started)), flush=True)
