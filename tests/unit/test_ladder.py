"""The config ladder: every shipped YAML/JSON parses into the rung it claims, matched and self-describing."""

from __future__ import annotations

import json

import pytest
import yaml

from hfdist.config.dims import DimsError, ParallelDims
from hfdist.config.ladder import CONFIG_ROOT, RUNG_INFO, LadderError, known_rung_names, load_rung
from hfdist.errors import HfdistError

SHIPPED = known_rung_names()
# Values TrainingArguments owns: "auto" in every JSON so the JSON and the command line can never contradict.
TRAINER_OWNED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                 "gradient_clipping")


def test_every_decision_table_rung_is_shipped():
    """The rung table's rows and the shipped YAMLs are the same rungs (the single-process reference has no YAML)."""
    assert sorted(SHIPPED) == sorted(n for n, info in RUNG_INFO.items() if info.table_row)
    assert RUNG_INFO["single"].table_row == 0


@pytest.mark.parametrize("name", SHIPPED)
def test_yaml_opens_with_its_scenario_and_loads(name):
    path = CONFIG_ROOT / "accelerate_configs" / f"{name}.yaml"
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and len(first) > 20, "each config opens with a comment on its scenario"
    yaml.safe_load(path.read_text())
    rung = load_rung(f"{name}.yaml")
    assert rung.name == name and rung.dims.world_size == rung.num_processes
    assert rung.info is RUNG_INFO.get(name)


@pytest.mark.parametrize("name", [n for n in SHIPPED if n.startswith("zero")])
def test_deepspeed_json_is_matched_and_auto(name):
    rung = load_rung(name)
    assert rung.uses_deepspeed and rung.ds_config_path.name == f"{name}.json"
    ds = json.loads(rung.ds_config_path.read_text())
    assert all(ds[k] == "auto" for k in TRAINER_OWNED)
    assert ds["bf16"]["enabled"] == "auto"
    assert rung.zero_stage == ds["zero_optimization"]["stage"] == int(name[4])


def test_rung_dims():
    assert load_rung("ddp").dims == ParallelDims(dp_replicate=2)
    assert load_rung("fsdp_full_shard").dims == ParallelDims(dp_shard=2)
    assert load_rung("fsdp_hybrid").dims == ParallelDims(dp_replicate=2, dp_shard=2)
    offload = load_rung("zero3_offload_cpu")
    assert (offload.offload_param, offload.offload_optimizer) == ("cpu", "cpu")
    assert load_rung("zero3_offload_nvme").offload_param == "nvme"


def test_rescaling_keeps_the_shard_axis_of_hybrid():
    assert load_rung("fsdp_hybrid").with_num_processes(8).dims == ParallelDims(dp_replicate=4, dp_shard=2)
    assert load_rung("fsdp_full_shard").with_num_processes(8).dims == ParallelDims(dp_shard=8)
    assert load_rung("ddp").with_num_processes(3).dims == ParallelDims(dp_replicate=3)
    with pytest.raises(LadderError, match="must be a multiple of 2"):
        load_rung("fsdp_hybrid").with_num_processes(5)


def test_unknown_config_lists_the_known_ones():
    with pytest.raises(LadderError) as err:
        load_rung("fsdp_hybird.yaml")
    for name in SHIPPED:
        assert name in str(err.value)


def test_bad_yaml_and_fsdp1_are_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_processes: 2\n")
    with pytest.raises(LadderError, match="not an Accelerate config"):
        load_rung(str(bad))
    v3 = tmp_path / "v3.yaml"
    v3.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 3\n")
    with pytest.raises(HfdistError, match="fsdp_version: 2"):
        load_rung(str(v3))
    mismatch = tmp_path / "mm.yaml"
    mismatch.write_text("distributed_type: FSDP\nnum_processes: 3\nfsdp_config: {fsdp_version: 2}\n"
                        "parallelism_config: {parallelism_config_dp_replicate_size: 2, "
                        "parallelism_config_dp_shard_size: 2}\n")
    with pytest.raises(LadderError, match="num_processes=3"):
        load_rung(str(mismatch))


def test_dims_errors_print_every_factor():
    with pytest.raises(DimsError, match="dp_replicate=2 x dp_shard=2 x cp=1 x pp=1 x tp=2 = 8 processes"):
        ParallelDims(dp_replicate=2, dp_shard=2, tp=2).check_world(4)
    with pytest.raises(DimsError):
        ParallelDims(tp=0)
    assert ParallelDims(dp_replicate=2, dp_shard=2, tp=2).mesh_shape() == (("dp_replicate", "dp_shard", "tp"),
                                                                          (2, 2, 2))
