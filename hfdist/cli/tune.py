"""`hfdist tune`: the fastest layout that fits this machine, found by short probes of the job itself."""

from __future__ import annotations

import argparse

__all__ = ["VERB"]

_TUNE_HELP = """\
Find the fastest way to run a job on this machine: every layout the planner finds that fits (rung, tp / pp / cp
degrees, micro-batch with gradient accumulation, recompute; compile and fp8 when asked), ranked by the cost model
on this machine's measured rates, probed for a few steps each in that order within --budget, each probe's losses
checked against the others' (the same math), the fastest measured chosen. It changes how the job trains, never what
it trains. Writes --out/tune.md, tune.json and tune.yaml (the winner's job file):

    hfdist tune job.yaml --budget 20
    hfdist tune --model llama-small --num-processes 4 --configs ddp,fsdp_full_shard,fsdp_tp --budget 5
    hfdist finetune outputs/tune/tune.yaml

A rerun with the same job and --out resumes: probes already in its log are not run again. Exit code 1 when no probe
both ran and agreed with the others.
"""


def add_args(p: argparse.ArgumentParser) -> None:
    from hfdist.config.finetune import add_finetune_arguments
    from hfdist.config.options import add_options
    from hfdist.tune.options import TuneOptions

    add_finetune_arguments(p)
    add_options(p, TuneOptions)


def run(args: argparse.Namespace) -> int:
    from hfdist.errors import run_with_clear_errors

    def job() -> int:
        import shlex

        from hfdist.config.finetune import FinetuneConfig, config_from_namespace
        from hfdist.config.job_file import CommandParser, parse_with_job_file
        from hfdist.config.options import dataclass_from_namespace
        from hfdist.tune.options import TuneOptions
        from hfdist.tune.run import tune

        parser = CommandParser(prog="hfdist tune", description=_TUNE_HELP,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        add_args(parser)
        parsed = parse_with_job_file(parser, args.verb_argv, FinetuneConfig.__dataclass_fields__)
        command = shlex.join(["hfdist", "tune", *args.verb_argv])
        return tune(config_from_namespace(parsed), dataclass_from_namespace(TuneOptions, parsed), command)

    return run_with_clear_errors(job)


VERB = ("tune", "find the fastest layout that fits this machine, by short probes of the job", _TUNE_HELP, add_args,
        run)
