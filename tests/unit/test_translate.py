"""Bring-your-own configs: other projects' accelerate YAMLs and DeepSpeed JSONs are translated or refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hfdist.config.dims import ParallelDims
from hfdist.config.ladder import CONFIG_ROOT, LadderError, StrategyKind, load_rung, resolve_deepspeed_json
from hfdist.config.translate import deepspeed_config_for_run, read_fsdp_config, refuse_on_gpu
from hfdist.errors import HfdistError

from helpers import ACCELERATE_FSDP1_TEMPLATE, AXOLOTL_ZERO3_BF16

# LLaMA-Factory's examples/accelerate/fsdp_config.yaml: FSDP1 with fp16 and parameter offload.
LLAMA_FACTORY_FSDP = {
    "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "FSDP", "downcast_bf16": "no",
    "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_backward_prefetch": "BACKWARD_PRE",
                    "fsdp_cpu_ram_efficient_loading": True, "fsdp_forward_prefetch": False,
                    "fsdp_offload_params": True, "fsdp_sharding_strategy": "FULL_SHARD",
                    "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_sync_module_states": True,
                    "fsdp_use_orig_params": False},
    "machine_rank": 0, "main_training_function": "main", "mixed_precision": "fp16", "num_machines": 1,
    "num_processes": 2, "rdzv_backend": "static", "same_network": True, "tpu_env": [], "tpu_use_cluster": False,
    "tpu_use_sudo": False, "use_cpu": False,
}


def _yaml(tmp_path: Path, cfg: dict, name: str = "mine.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _with_fsdp(base: dict, **fsdp) -> dict:
    return {**base, "fsdp_config": {**base["fsdp_config"], **fsdp}}


def test_accelerate_fsdp1_template_is_fully_shard(tmp_path):
    rung = load_rung(_yaml(tmp_path, ACCELERATE_FSDP1_TEMPLATE))
    assert rung.kind is StrategyKind.MESH and rung.dims == ParallelDims(dp_shard=2)
    assert rung.fsdp.reshard_after_forward and not rung.fsdp.hybrid and rung.fsdp.layer_cls_to_wrap is None
    (note,) = rung.notes
    assert "FSDP1 keys, run as FSDP2: FULL_SHARD -> fully_shard over all ranks" in note
    for dropped in ("fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_use_orig_params",
                    "fsdp_sync_module_states"):
        assert dropped in note


@pytest.mark.parametrize("strategy, reshard, hybrid", [
    ("FULL_SHARD", True, False), ("SHARD_GRAD_OP", False, False), ("HYBRID_SHARD", True, True),
    ("HYBRID_SHARD_ZERO2", False, True), ("1", True, False), ("2", False, False), (4, True, True)])
def test_sharding_strategies_map_to_fsdp2(strategy, reshard, hybrid):
    fsdp = read_fsdp_config({"fsdp_sharding_strategy": strategy}, Path("x.yaml"))
    assert (fsdp.reshard_after_forward, fsdp.hybrid, fsdp.ddp) == (reshard, hybrid, False)


def test_no_shard_is_ddp_and_hybrid_shards_over_a_machine(tmp_path):
    ddp = load_rung(_yaml(tmp_path, _with_fsdp(ACCELERATE_FSDP1_TEMPLATE, fsdp_sharding_strategy="NO_SHARD")))
    assert ddp.kind is StrategyKind.DDP and ddp.dims == ParallelDims(dp_replicate=2)
    assert "NO_SHARD -> DDP" in ddp.notes[0]
    two_machines = {**_with_fsdp(ACCELERATE_FSDP1_TEMPLATE, fsdp_sharding_strategy="HYBRID_SHARD"),
                    "num_processes": 8, "num_machines": 2}
    hybrid = load_rung(_yaml(tmp_path, two_machines, "h.yaml"))
    assert hybrid.dims == ParallelDims(dp_replicate=2, dp_shard=4) and hybrid.fsdp.hybrid
    assert "HYBRID_SHARD -> HSDP" in hybrid.notes[0]


def test_fsdp2_configs_carry_no_translation_note():
    assert load_rung("fsdp_full_shard").notes == ()


def test_llama_factory_fsdp_config_loads(tmp_path):
    rung = load_rung(_yaml(tmp_path, LLAMA_FACTORY_FSDP))
    assert rung.kind is StrategyKind.MESH and rung.mixed_precision == "fp16" and rung.fsdp.offload_params
    with pytest.raises(HfdistError, match="mixed_precision: fp16 on a rung hfdist shards itself"):
        refuse_on_gpu(LLAMA_FACTORY_FSDP, rung.owns_sharding, Path("fsdp_config.yaml"))
    refuse_on_gpu({**LLAMA_FACTORY_FSDP, "mixed_precision": "bf16"}, True, Path("fsdp_config.yaml"))
    with pytest.raises(HfdistError, match="use_cpu: true"):
        refuse_on_gpu({"use_cpu": True}, False, Path("x.yaml"))


@pytest.mark.parametrize("fsdp, named", [
    ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 1000}, "SIZE_BASED_WRAP"),
    ({"fsdp_auto_wrap_policy": "NO_WRAP"}, "NO_WRAP"),
    ({"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer,LlamaMLP"}, "LlamaDecoderLayer, LlamaMLP"),
    ({"fsdp_activation_checkpointing_offload": True}, "fsdp_activation_checkpointing_offload"),
    ({"fsdp_made_up_option": 1}, "fsdp_made_up_option"),
])
def test_unimplemented_fsdp_settings_are_refused_by_name(tmp_path, fsdp, named):
    with pytest.raises(HfdistError) as err:
        load_rung(_yaml(tmp_path, _with_fsdp(ACCELERATE_FSDP1_TEMPLATE, **fsdp)))
    assert named in str(err.value) and "Traceback" not in str(err.value)


def test_a_named_layer_class_is_honoured_or_refused_before_any_process(tmp_path):
    from hfdist.models.presets import load_config
    from hfdist.parallel.fit import check_model_fits_rung

    rung = load_rung(_yaml(tmp_path, _with_fsdp(ACCELERATE_FSDP1_TEMPLATE,
                                                fsdp_transformer_layer_cls_to_wrap="LlamaDecoderLayer")))
    assert rung.fsdp.layer_cls_to_wrap == "LlamaDecoderLayer"
    check_model_fits_rung(load_config("llama-tiny"), rung)
    gpt2 = load_rung(_yaml(tmp_path, _with_fsdp(ACCELERATE_FSDP1_TEMPLATE,
                                                fsdp_transformer_layer_cls_to_wrap="GPT2Block"), "gpt2.yaml"))
    with pytest.raises(HfdistError, match="'GPT2Block', but the model has no module of that class") as err:
        check_model_fits_rung(load_config("llama-tiny"), gpt2)
    assert "LlamaDecoderLayer" in str(err.value)  # the classes that would work


@pytest.mark.parametrize("extra, named", [
    ({"parallelism_config": {"parallelism_config_sp_size": 2}}, "parallelism_config_sp_size"),
    ({"mixed_precision": "fp8", "fp8_config": {"backend": "TE"}}, "fp8_config.backend: TE (TransformerEngine)"),
    ({"mixed_precision": "fp8", "fp8_config": {"backend": "MSAMP", "opt_level": "O2"}}, "backend: MSAMP (MS-AMP)"),
    ({"mixed_precision": "fp8", "fp8_config": {"backend": "AO", "fp8_format": "HYBRID"}}, "fp8_config has fp8_format"),
    ({"fp8_config": {"backend": "AO"}}, "sets fp8_config but mixed_precision: bf16"),
    ({"dynamo_config": {"dynamo_backend": "INDUCTOR"}}, "dynamo_config.dynamo_backend: INDUCTOR"),
])
def test_unimplemented_keys_are_refused_by_name(tmp_path, extra, named):
    cfg = {**ACCELERATE_FSDP1_TEMPLATE, "fsdp_config": {"fsdp_version": 2}, "num_processes": 8, **extra}
    with pytest.raises(HfdistError) as err:
        load_rung(_yaml(tmp_path, cfg))
    assert named in str(err.value)


def test_accelerate_cp_example_runs_as_hfdist_context_parallelism(tmp_path):
    """accelerate's examples/torch_native_parallelism/configs/cp.yaml, as shipped: read as cp=8 on hfdist's mesh,
    then planned against the model before any process (llama-tiny's 4 heads cannot be split 8 ways by Ulysses alone:
    auto plans hybrid, and --cp-method ulysses is refused)."""
    from hfdist.models.presets import load_config
    from hfdist.parallel.fit import check_context_parallel

    cp = {"compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "FSDP", "downcast_bf16": "no",
          "enable_cpu_affinity": False, "fsdp_config": {
              "fsdp_activation_checkpointing": True, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
              "fsdp_cpu_ram_efficient_loading": False, "fsdp_offload_params": False,
              "fsdp_reshard_after_forward": True, "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_version": 2},
          "machine_rank": 0, "main_training_function": "main", "mixed_precision": "bf16", "num_machines": 1,
          "num_processes": 8, "parallelism_config": {"parallelism_config_cp_size": 8,
                                                     "parallelism_config_dp_replicate_size": 1,
                                                     "parallelism_config_dp_shard_size": 1,
                                                     "parallelism_config_tp_size": 1},
          "rdzv_backend": "static", "same_network": True, "use_cpu": False}
    rung = load_rung(_yaml(tmp_path, cp, "cp.yaml"))
    assert (rung.dims.cp, rung.dims.dp_shard, rung.num_processes) == (8, 1, 8)
    with pytest.raises(HfdistError, match="4 attention heads do not divide by cp=8"):
        check_context_parallel(load_config("llama-tiny"), rung.with_context("ulysses"), 512)
    plan = check_context_parallel(load_config("llama-tiny"), rung, 512)  # auto: Ulysses over 4 x a ring of 2
    assert (plan.method, plan.ulysses) == ("hybrid", 4)
    assert check_context_parallel(load_config("llama-medium"), rung, 512).method == "ulysses"  # 16 heads




def test_explicit_deepspeed_precision_follows_the_run(tmp_path):
    path = tmp_path / "zero3_bf16.json"
    path.write_text(json.dumps(AXOLOTL_ZERO3_BF16))
    ds, note = deepspeed_config_for_run(path, "no")
    assert ds["bf16"]["enabled"] is False and "bf16.enabled true -> false" in note and "(fp32)" in note
    # axolotl's unprefixed ZeRO-3 "auto" keys get the names accelerate fills
    zero = ds["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] == zero["stage3_param_persistence_threshold"] == "auto"
    assert "prefetch_bucket_size" not in zero and "param_persistence_threshold" not in zero
    gpu, gpu_note = deepspeed_config_for_run(path, "bf16")
    assert gpu["bf16"]["enabled"] is True and "bf16.enabled" not in gpu_note
    fp16 = tmp_path / "fp16.json"
    fp16.write_text(json.dumps({"fp16": {"enabled": True, "loss_scale": 0}, "bf16": {"enabled": "auto"}}))
    ds, note = deepspeed_config_for_run(fp16, "no")
    assert ds["fp16"] == {"enabled": False, "loss_scale": 0} and ds["bf16"]["enabled"] == "auto"
    assert deepspeed_config_for_run(fp16, "fp16") == (json.loads(fp16.read_text()), None)


def test_deepspeed_tp_and_nvme_overrides():
    shipped = CONFIG_ROOT / "ds_configs"
    ds, note = deepspeed_config_for_run(shipped / "zero2_tp.json", "bf16", tp=4)
    assert ds["tensor_parallel"]["autotp_size"] == 4 and "autotp_size 2 -> 4 (--tp)" in note
    ds, note = deepspeed_config_for_run(shipped / "zero3_offload_nvme.json", "bf16", nvme_path="/nvme")
    assert ds["zero_optimization"]["offload_param"]["nvme_path"] == "/nvme" and note is None


def test_relative_deepspeed_paths_resolve_from_the_working_directory(tmp_path, monkeypatch):
    """As accelerate resolves them: HfDeepSpeedConfig opens deepspeed_config_file as given, in every rank."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "ds.json").write_text(json.dumps(AXOLOTL_ZERO3_BF16))
    cfg = {"distributed_type": "DEEPSPEED", "num_processes": 2,
           "deepspeed_config": {"deepspeed_config_file": "configs/ds.json", "zero3_init_flag": False}}
    yaml_path = _yaml(tmp_path / "configs", cfg, "ds.yaml")
    monkeypatch.chdir(tmp_path)
    rung = load_rung(yaml_path)
    assert rung.ds_config_path == (tmp_path / "configs" / "ds.json").resolve() and rung.zero_stage == 3
    monkeypatch.chdir(tmp_path / "configs")  # from here, configs/ds.json does not exist; ds.json beside the YAML does
    beside = {**cfg, "deepspeed_config": {"deepspeed_config_file": "ds.json"}}
    assert load_rung(_yaml(tmp_path / "configs", beside, "beside.yaml")).ds_config_path.name == "ds.json"
    monkeypatch.chdir(tmp_path)  # from here ds.json is only next to the YAML: accelerate would not find it
    with pytest.raises(LadderError, match="accelerate resolves relative paths from the working directory"):
        load_rung(_yaml(tmp_path / "configs", beside, "beside.yaml"))
    with pytest.raises(LadderError, match="relative paths count from the working directory"):
        resolve_deepspeed_json("missing.json", None)
    # the shipped YAMLs resolve from the config root wherever hfdist runs
    assert load_rung("zero3").ds_config_path == (CONFIG_ROOT / "ds_configs" / "zero3.json").resolve()


@pytest.mark.parametrize("fp8_config", [None, {"backend": "AO"},
                                        {"backend": "AO", "enable_fsdp_float8_all_gather": True, "pad_inner_dim": True}])
def test_torchao_fp8_configs_run_as_hfdist_fp8(tmp_path, fp8_config):
    """accelerate's `mixed_precision: fp8` with torchao (`accelerate config`'s AO backend, or no fp8_config, where
    accelerate picks torchao first): hfdist's --fp8 tensorwise over bf16, said in one line."""
    cfg = {**ACCELERATE_FSDP1_TEMPLATE, "fsdp_config": {"fsdp_version": 2}, "mixed_precision": "fp8",
           **({"fp8_config": fp8_config} if fp8_config else {})}
    rung = load_rung(_yaml(tmp_path, cfg))
    assert (rung.fp8, rung.mixed_precision) == ("tensorwise", "bf16")
    note = next(n for n in rung.notes if "mixed_precision: fp8" in n)
    assert "runs as --fp8 tensorwise over bf16" in note
    assert ("follow hfdist's rule" in note) == bool(fp8_config and len(fp8_config) > 1)
