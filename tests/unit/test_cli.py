"""The `hfdist` command: every verb registered with accelerate-style grouped help, and `hfdist configs`."""

from __future__ import annotations

import json

from hfdist.cli import build_parser, main
from hfdist.config.ladder import known_rung_names


def _help(verb: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "verb")  # argparse keeps sub-parsers on this action
    return sub.choices[verb].format_help()


def test_every_verb_has_grouped_help():
    finetune = _help("finetune")
    assert finetune.startswith("usage: hfdist finetune")
    for group in ("Strategy:", "Model and data:", "Training:", "Output and checkpoints:", "Metrics and console:"):
        assert group in finetune
    for flag in ("--tp", "--pp", "--dp-replicate", "--num-processes", "--verbose"):
        assert flag in finetune
    assert "Rungs and workload:" in _help("compare") and "Output:" in _help("configs")
    assert "--gpus-per-node" in _help("plan")


def test_configs_lists_the_ladder_with_commands(capsys):
    assert main(["configs", "--json", "--num-processes", "8"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows) == known_rung_names()
    assert rows["ddp"]["command"] == "hfdist finetune --config ddp --lora"
    assert rows["zero3_offload_nvme"]["command"].endswith("--nvme-path /local_nvme")
    assert rows["fsdp_hybrid"]["layout"] == "dp_replicate=4 x dp_shard=2"  # CPU: the YAML's 2-device "node"
    assert rows["3d"]["layout"] == "dp_shard=2 x pp=2 x tp=2" and rows["fsdp_tp"]["processes"] == 8
    assert rows["zero3"]["ds_config"].endswith("ds_configs/zero3.json")
    assert main(["configs", "--num-processes", "3"]) == 0
    table = capsys.readouterr().out
    assert "fsdp_tp" in table and "not here: fsdp_tp cannot run on 3 processes" in table  # why, not a traceback
    assert "launch: hfdist finetune --config fsdp_full_shard" in table
