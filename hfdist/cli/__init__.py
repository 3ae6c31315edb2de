"""The `hfdist` command: a small argparse dispatcher, one sub-command (verb) per module of this package.

    hfdist finetune --config fsdp_hybrid.yaml
    hfdist prepare job.yaml
    hfdist configs
    hfdist plan --model llama-3.1-70b --gpus-per-node 8 --nodes 4 --gpu-mem-gb 80
    hfdist tune job.yaml --budget 20
    hfdist compare --configs ddp fsdp_full_shard zero3
    hfdist simulate --model llama-3.1-405b --config 3d --num-processes 512 --tp 8 --pp 4
    hfdist checkpoint export outputs/finetune/checkpoint-100 --to hf exported/
    python -m hfdist.cli VERB ...

A verb module defines VERB = (name, help line, description, add-arguments, run); run returns the process exit code
(the raw arguments after the verb are in `args.verb_argv`). Verb modules import only what parsing needs at the top,
so `hfdist plan` on a preset never imports torch. Errors hfdist raises for bad input print as one paragraph and
exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from hfdist.errors import HfdistError

__all__ = ["main", "entry", "build_parser", "VERB_MODULES"]

VERB_MODULES = ("finetune", "prepare", "configs", "plan", "tune", "compare", "simulate", "checkpoint")


def _verbs():
    return [importlib.import_module(f"hfdist.cli.{name}").VERB for name in VERB_MODULES]


def build_parser() -> argparse.ArgumentParser:
    """The `hfdist` parser with one sub-parser per verb module."""
    from hfdist.config.job_file import CommandParser

    parser = CommandParser(prog="hfdist", usage="hfdist <command> [<args>]",
                                     description="Pick, launch and compare parallelism strategies for Hugging Face "
                                                 "fine-tunes.")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="<command>", title="commands")
    for name, help_line, description, add_args, run in _verbs():
        p = sub.add_parser(name, prog=f"hfdist {name}", help=help_line, description=description,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_args(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (the command line's by default) and run its verb; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.verb_argv = argv[argv.index(args.verb) + 1:]
    try:
        return args.run(args)
    except HfdistError as exc:
        print(f"hfdist: error: {exc}", file=sys.stderr)
        return 2


def entry() -> NoReturn:
    """The `hfdist` console script and `python -m hfdist.cli`: main(), then leave the process without the
    interpreter's teardown (hfdist.console.leave says why). main() itself returns, for callers in a process of their
    own making."""
    from hfdist.console import leave

    leave(main())
