"""`hfdist compare`: run rungs of the ladder on the same workload and write the comparison matrix."""

from __future__ import annotations

import argparse
import shlex

__all__ = ["VERB"]


def add_args(p: argparse.ArgumentParser) -> None:
    from hfdist.report.compare import add_arguments

    add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from hfdist.report.compare import run_comparison

    return run_comparison(args, "hfdist compare " + shlex.join(args.verb_argv))


_COMPARE_HELP = """\
Run rungs of the ladder one after another on the same model, data, sequence length and global batch (each as its
own world and W&B run, through `hfdist finetune`), then write the strategy matrix: results/<hardware>/matrix.md,
matrix.csv, memory.png (per-rank peak memory and model states) and throughput.png (tokens/s per device and MFU),
plus the matrix as a W&B table. Paths count from the working directory.
"""

VERB = ("compare", "run rungs side by side and write the per-rank memory/throughput matrix", _COMPARE_HELP,
        add_args, run)
