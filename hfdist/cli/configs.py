"""`hfdist configs`: the config ladder, each rung with its layout on this machine and its launch command."""

from __future__ import annotations

import argparse
import json

__all__ = ["VERB", "ladder_rows"]

_CONFIGS_HELP = """\
List the config ladder: one accelerate YAML (+ DeepSpeed JSON) per rung of the decision table, in table order,
with the processes and parallel layout each gets on this machine (one process per GPU on a GPU node; on CPU the
count the rung is tested with), what it shards, when to pick it, and the command that launches it.

The files ship inside the package; copy one to start your own config (`hfdist finetune --config my.yaml`).
"""


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Output")
    g.add_argument("--json", action="store_true", help="Print the ladder as JSON (a list of rungs).")
    g.add_argument("--num-processes", type=int, default=None,
                   help="Show each rung's layout on this many processes instead of this machine's default.")


def ladder_rows(num_processes: int | None = None) -> list[dict]:
    """Every shipped rung as a dict: name, files, processes and layout here, what it is for, launch command."""
    from hfdist.config.finetune import FinetuneConfig
    from hfdist.config.ladder import known_rung_names, load_rung
    from hfdist.errors import HfdistError
    from hfdist.job.world import Node, resolve_rung

    node = Node.detect()
    rows = []
    for name in known_rung_names():
        rung, layout = load_rung(name), None
        try:
            rung = resolve_rung(FinetuneConfig(config=name, num_processes=num_processes), node)
            layout = rung.dims.layout()
        except HfdistError as exc:  # a rung this machine cannot run: say why instead of its layout
            layout = f"not here: {str(exc).split('. ')[0]}"
        info = rung.info
        extra = f" {info.example_args}" if info and info.example_args else ""
        rows.append({"name": name, "yaml": str(rung.yaml_path),
                     "ds_config": str(rung.ds_config_path) if rung.ds_config_path else None,
                     "processes": rung.num_processes, "layout": layout,
                     "table_row": info.table_row if info else None, "scenario": info.scenario if info else "",
                     "sharded": info.sharded if info else "", "when": info.when if info else "",
                     "command": f"hfdist finetune --config {name}{extra}"})
    return rows


def run(args: argparse.Namespace) -> int:
    from hfdist.config.ladder import CONFIG_ROOT

    rows = ladder_rows(args.num_processes)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"hfdist configs: {len(rows)} rungs, decision-table order; files in {CONFIG_ROOT}\n")
    width = max(len(r["name"]) for r in rows)
    print(f"{'rung':<{width}}  row  procs  layout on this machine")
    for r in rows:
        print(f"{r['name']:<{width}}  {r['table_row'] or '-':>3}  {r['processes']:>5}  {r['layout']}")
        print(f"{'':<{width}}    for: {r['scenario']}; shards {r['sharded']}")
        print(f"{'':<{width}}    pick it when: {r['when']}")
        print(f"{'':<{width}}    launch: {r['command']}")
    print("\nThe same job through accelerate: accelerate launch --config_file <yaml above> -m hfdist.cli finetune "
          "[options]\n(from a clone of the repository: accelerate launch scripts/finetune.py --config <rung>). "
          "`hfdist finetune --help` lists the options; --num-processes, --tp, --pp and --dp-replicate change a "
          "rung's layout.")
    return 0


VERB = ("configs", "list the config ladder with each rung's layout and launch command", _CONFIGS_HELP, add_args, run)
