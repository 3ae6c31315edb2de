"""`hfdist finetune`: the fine-tuning job, exactly as `accelerate launch scripts/finetune.py ...` runs it.

hfdist starts the rung's processes itself (through `accelerate launch --config_file <rung yaml>`), so this works
from any directory once hfdist is installed; the ranks it starts run `python -m hfdist.cli finetune ...`.
"""

from __future__ import annotations

import argparse
import os

from hfdist.config.finetune import MODULE_ENTRY, USAGE, add_finetune_arguments

__all__ = ["VERB", "run_finetune"]


def run_finetune(argv: list[str], entry: list[str]) -> int:
    """Parse the fine-tune options in `argv` (and the job file they name) and run the job, or print the resolved
    job (--print-job); `entry` is what a hand-over starts in each rank."""
    from hfdist.config.finetune import job_text, parse_command
    from hfdist.errors import run_with_clear_errors

    def job() -> int:
        from hfdist.job.collector import pause_collector

        pause_collector()  # until the imports are done (hfdist.job.collector)
        cfg, print_only = parse_command(argv, prog="hfdist finetune" if entry == MODULE_ENTRY else None)
        if print_only:
            print(job_text(cfg), end="")
            return 0
        from hfdist.job.launch import HANDED_OVER_ENV

        if cfg.launcher == "ray" and not os.environ.get(HANDED_OVER_ENV):  # this process is Ray's driver
            from hfdist.job.collector import resume_collector
            from hfdist.job.ray_launch import ray_launch

            resume_collector()  # the driver waits for Ray's workers as long as they train
            return ray_launch(cfg)
        from hfdist.job.run import finetune

        return finetune(cfg, entry, argv)

    return run_with_clear_errors(job)


def run(args: argparse.Namespace) -> int:
    return run_finetune(args.verb_argv, MODULE_ENTRY)


VERB = ("finetune", "fine-tune a model with a rung of the ladder (the job scripts/finetune.py runs)", USAGE,
        add_finetune_arguments, run)
