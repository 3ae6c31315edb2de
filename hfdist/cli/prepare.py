"""`hfdist prepare`: a job's data tokenised, held out, packed and written to its --prepared-data folder, on any
machine, before any GPU is allocated; the job then loads the folder in seconds (hfdist.job.data)."""

from __future__ import annotations

import argparse

__all__ = ["VERB"]

_DESCRIPTION = """\
Prepare a fine-tune's data ahead of the job: tokenise (in parallel processes), hold out the evaluation rows, pack
into blocks and write them to --prepared-data, with a progress bar. It takes the job's own flags or job file, so the
same file serves both:

    hfdist prepare job.yaml                     # any machine, e.g. a CPU box with the raw data
    hfdist finetune job.yaml                    # the GPU job: loads the prepared folder in seconds

The data settings decide the blocks: --model (its tokenizer and chat template), --dataset (one source or a
mixture), --seq-len, --long-documents, --eval-dataset / --eval-fraction and --seed; the job refuses a folder
prepared with other ones, or from a source that has changed since. The other flags are accepted and left aside.
Preparation streams: rows are read a batch at a time, tokenised by the workers into shards on disk, and packed a
window of blocks at a time, so a dataset larger than memory prepares in bounded memory; run again after an
interruption, it resumes from the last whole shard and writes the same bytes.
"""


def add_args(p: argparse.ArgumentParser) -> None:
    from hfdist.config.finetune import add_finetune_arguments

    g = p.add_argument_group("Preparation")
    g.add_argument("--num-proc", type=int, default=None, metavar="N",
                   help="Tokenisation processes, forked (default: one below 20,000 rows, else the available cores up to "
                        "16).")
    add_finetune_arguments(p)


def _parser() -> argparse.ArgumentParser:
    from hfdist.config.job_file import CommandParser

    p = CommandParser(prog="hfdist prepare", description=_DESCRIPTION,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    from hfdist.errors import run_with_clear_errors

    def job() -> int:
        import time

        from hfdist.config.finetune import ConfigError, FinetuneConfig, config_from_namespace
        from hfdist.config.job_file import parse_with_job_file
        from hfdist.data import load_tokenizer
        from hfdist.job.data import job_data, report_lines
        from hfdist.models.presets import is_preset

        parsed = parse_with_job_file(_parser(), args.verb_argv, FinetuneConfig.__dataclass_fields__)
        cfg = config_from_namespace(parsed)
        if not cfg.prepared_data:
            raise ConfigError("hfdist prepare writes the prepared data to --prepared-data, which is not set. Pass "
                              "--prepared-data DIR (or set prepared_data in the job file): the job reads it there.")
        tokenizer = load_tokenizer(cfg.model, is_preset=is_preset(cfg.model))
        started = time.perf_counter()
        prepared = job_data(cfg, tokenizer, num_proc=parsed.num_proc)
        print("\n".join(report_lines(cfg, prepared, time.perf_counter() - started)), flush=True)
        return 0

    return run_with_clear_errors(job)


VERB = ("prepare", "tokenise, hold out, pack and cache a job's data before the GPUs start", _DESCRIPTION, add_args,
        run)
