"""Configs users already have, through scripts/finetune.py on CPU: accelerate's FSDP1 template, an FSDP1
HYBRID_SHARD YAML, and DeepSpeed JSONs with explicit bf16/fp16 (axolotl's zero3_bf16.json verbatim, accelerate's
zero_stage3 template's fp16 shape) give the single-process losses and say in one line what was translated; the
fsdp rungs run on one process; the console keeps library chatter in the log."""

from __future__ import annotations

import json

import pytest
import yaml

from helpers import ACCELERATE_FSDP1_TEMPLATE, AXOLOTL_ZERO3_BF16, finetune_all

pytestmark = pytest.mark.multiproc

# accelerate's examples/deepspeed_config_templates/zero_stage3_config.json without its optimizer and scheduler
# sections: DeepSpeed's own AdamW would JIT-compile its CPU op (minutes, once per machine) and its WarmupDecayLR
# schedule differs from the single-process run's cosine, so the losses could not be compared.
ACCELERATE_ZERO3_FP16 = {
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "sub_group_size": 1e9,
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": "auto"},
    "gradient_accumulation_steps": 1, "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def _deepspeed_yaml(json_name: str) -> dict:
    # A relative path, resolved from the working directory as accelerate resolves it.
    return {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_machines": 1,
            "num_processes": 2, "use_cpu": False,
            "deepspeed_config": {"deepspeed_config_file": json_name, "zero3_init_flag": False}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("byo")
    hybrid = {**ACCELERATE_FSDP1_TEMPLATE, "num_processes": 4,
              "fsdp_config": {**ACCELERATE_FSDP1_TEMPLATE["fsdp_config"], "fsdp_sharding_strategy": "HYBRID_SHARD"}}
    files = {"fsdp1.yaml": ACCELERATE_FSDP1_TEMPLATE, "hybrid1.yaml": hybrid,
             "zero3_bf16.yaml": _deepspeed_yaml("zero3_bf16.json"),
             "zero3_fp16.yaml": _deepspeed_yaml("zero3_fp16.json")}
    for name, cfg in files.items():
        (root / name).write_text(yaml.safe_dump(cfg))
    (root / "zero3_bf16.json").write_text(json.dumps(AXOLOTL_ZERO3_BF16, indent=2))
    (root / "zero3_fp16.json").write_text(json.dumps(ACCELERATE_ZERO3_FP16, indent=2))
    launches = {"fsdp1": ("--config", "fsdp1.yaml"),
                # one machine is one node: --dp-replicate makes it 2 "nodes" of 2, as fsdp_hybrid is tested
                "hybrid1": ("--config", "hybrid1.yaml", "--dp-replicate", "2"),
                "zero3_bf16": ("--config", "zero3_bf16.yaml"),
                "zero3_fp16": ("--config", "zero3_fp16.yaml"),
                "fsdp_one_process": ("--config", "fsdp_full_shard", "--num-processes", "1")}
    out = finetune_all({name: (root / f"out_{name}", args, {"cwd": root})
                        for name, args in launches.items()})
    for name in out:
        out[name]["_dir"] = root / f"out_{name}"
    return out


@pytest.mark.parametrize("name", ["fsdp1", "hybrid1", "zero3_bf16", "zero3_fp16", "fsdp_one_process"])
def test_single_process_losses(runs, references, name):
    got, want = runs[name]["losses"], references["single"]["losses"]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (name, got, want)
    assert runs[name]["strategy"]["mixed_precision"] == "no"


def test_translation_lines(runs):
    fsdp1 = runs["fsdp1"]
    assert "hfdist: fsdp1.yaml has FSDP1 keys, run as FSDP2: FULL_SHARD -> fully_shard over all ranks" in \
        fsdp1["_stdout"]
    assert (fsdp1["strategy"]["dp_shard"], fsdp1["strategy"]["dp_replicate"]) == (2, 1)
    hybrid = runs["hybrid1"]
    assert "HYBRID_SHARD -> HSDP: fully_shard inside a node, replicated across nodes" in hybrid["_stdout"]
    assert (hybrid["strategy"]["dp_replicate"], hybrid["strategy"]["dp_shard"]) == (2, 2)
    bf16 = runs["zero3_bf16"]
    assert "hfdist: zero3_bf16.json translated for this run (fp32): " in bf16["_stdout"]
    assert "bf16.enabled true -> false" in bf16["_stdout"] and bf16["strategy"]["zero_stage"] == 3
    assert "fp16.enabled true -> false" in runs["zero3_fp16"]["_stdout"]
    for run in runs.values():  # one line each, printed once (rank 0)
        assert sum("translated for this run" in line or "has FSDP1 keys" in line
                   for line in run["_stdout"].splitlines()) <= 1


def test_fsdp_really_shards_on_one_process_and_two(runs):
    one, two = runs["fsdp_one_process"], runs["fsdp1"]
    assert one["strategy"]["world_size"] == 1 and one["strategy"]["dp_shard"] == 1
    # every parameter is an FSDP2 shard (hfdist.verify checked); over two ranks each holds about half
    assert abs(two["ranks"][0]["param_bytes"] / one["ranks"][0]["param_bytes"] - 0.5) < 0.02


def test_library_chatter_goes_to_the_log(runs):
    run = runs["fsdp1"]
    screen = run["_stdout"] + run["_stderr"]
    for chatter in ("values were not passed", "Setting accelerator to CPU", "PAD/BOS/EOS", "wandb: Run history",
                    "Running in WANDB offline mode"):
        assert chatter not in screen, chatter
    log = (run["_dir"] / "logs" / "rank-0.log").read_text()
    assert "Setting accelerator to CPU" in log and "PAD/BOS/EOS" in log
    assert (run["_dir"] / "logs" / "rank-1.log").is_file() and (run["_dir"] / "logs" / "launcher.log").is_file()
    assert "hfdist: fsdp1 done" in run["_stdout"]
