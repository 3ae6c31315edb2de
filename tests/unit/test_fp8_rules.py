"""--fp8 in one process: the rule of which layers convert, the conversion and its checks, the refusals before any
process, the precision rules, the planner's count and the reports. (Several ranks: tests/integration/
test_fp8_parallel.py; the launched runs: tests/e2e/test_fp8.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from hfdist.config.finetune import ConfigError, parse_args
from hfdist.config.ladder import load_rung, single_process_rung
from hfdist.models.build import meta_model
from hfdist.models.presets import load_config
from hfdist.parallel.float8_check import check_fp8, converts, count_float8_projections, gathers_in_float8
from hfdist.plan import GB, plan_rungs


def _llama(**fields):
    base = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1024, max_position_embeddings=128)
    return AutoConfig.for_model("llama", **{**base, **fields})


def test_the_flag_takes_a_recipe_and_defaults_to_tensorwise():
    assert parse_args([]).fp8 is None
    assert parse_args(["--fp8"]).fp8 == "tensorwise"
    assert parse_args(["--fp8", "rowwise", "--config", "ddp"]).fp8 == "rowwise"
    with pytest.raises(SystemExit):
        parse_args(["--fp8", "blockwise"])


@pytest.mark.parametrize("fields, tp, picked", [
    ({}, 1, 2 * 7),  # llama-tiny's shape: every projection
    ({"intermediate_size": 200}, 1, 2 * 4),  # 200 is no multiple of 16: gate, up (out) and down (in) stay
    ({"intermediate_size": 96}, 2, 2 * 7),  # 96 / 2 = 48 per rank
    ({"intermediate_size": 96, "num_key_value_heads": 4}, 4, 2 * 4),  # 96 / 4 = 24 per rank: the MLP stays
    ({}, 4, 2 * 5),  # k and v: 2 kv heads x 16 / 4 = 8 per rank
    ({"hidden_size": 72, "num_attention_heads": 4, "num_key_value_heads": 4}, 1, 0),  # 72 everywhere
])
def test_the_rule_picks_decoder_projections_with_dims_of_multiples_of_16_after_tp(fields, tp, picked):
    assert count_float8_projections(_llama(**fields), tp) == (picked, 2 * 7)


def test_the_rule_never_picks_other_linears():
    from hfdist.models.registry import facts_for

    facts = facts_for(_llama())
    assert converts("mlp.down_proj", 256, 64, facts) and not converts("lm_head", 64, 1024, facts)
    assert not converts("self_attn.q_proj.lora_A.default", 64, 16, facts)


def test_conversion_swaps_exactly_what_the_rule_picks_and_the_checks_see_it():
    from torchao.float8.float8_linear import Float8Linear

    from hfdist.parallel.float8 import convert_to_float8, float8_problems, float8_projections, float8_record

    model = meta_model("llama-tiny")
    ids = {id(m) for m in float8_projections(model)}
    picked = {name for name, m in model.named_modules() if id(m) in ids}
    assert len(picked) == 28 and all(".layers." in name for name in picked)
    assert not float8_problems(model, None, 1, False)
    assert float8_problems(model, "tensorwise", 1, False) == [
        "0 of the 28 decoder projections the rule picks are float8 linears (0 float8 linears in all)"]
    assert convert_to_float8(model, "tensorwise") == 28
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == picked and type(model.lm_head) is torch.nn.Linear
    assert float8_record(model) == {"fp8_layers": 28, "fp8_recipe": "tensorwise", "fp8_all_gather_dtype": None}
    assert float8_problems(model, "tensorwise", 1, False) == []
    assert float8_problems(model, "rowwise", 1, False) == ["the float8 linears scale tensorwise, not rowwise"]
    assert float8_problems(model, "tensorwise", 1, True) == [
        "FSDP2 gathers their weights in the training precision, not in float8"]
    assert float8_problems(model, None, 1, False) == ["28 float8 linears although --fp8 was not given"]


def test_float8_all_gather_is_tensorwise_where_fsdp2_shards():
    from hfdist.parallel.float8 import convert_to_float8, float8_record

    assert gathers_in_float8("tensorwise", 2) and not gathers_in_float8("tensorwise", 1)
    assert not gathers_in_float8("rowwise", 8) and not gathers_in_float8(None, 8)
    model = meta_model("llama-tiny")
    convert_to_float8(model, "tensorwise", all_gather=True)
    assert float8_record(model)["fp8_all_gather_dtype"] == "float8_e4m3fn"


def test_a_float8_model_trains_in_one_process():
    """torchao's float8 matmuls forward and backward on CPU: the loss is the fp32 model's within float8's error."""
    from hfdist.models.build import build_model
    from hfdist.parallel.float8 import convert_to_float8
    from hfdist.parallel.tensor import tp_causal_lm_loss

    ids = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    model = build_model("llama-tiny")
    plain = tp_causal_lm_loss(model, batch).item()
    convert_to_float8(model, "rowwise")
    loss = tp_causal_lm_loss(model, batch)
    loss.backward()
    assert loss.item() == pytest.approx(plain, rel=1e-2) and loss.item() != plain
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("rung, extra, message", [
    ("ddp", {"lora": True}, "--fp8 does not run with --lora"),
    ("zero3", {}, "--fp8 does not run on zero3: DeepSpeed's engine"),
    ("zero2_tp", {}, "--fp8 does not run on zero2_tp: DeepSpeed's engine"),
    ("fsdp_cp", {}, "--fp8 does not run on fsdp_cp: context parallelism"),
    ("ddp", {"seq_len": 100}, "--fp8 needs --seq-len to be a multiple of 16"),
])
def test_what_fp8_refuses_before_any_process(rung, extra, message):
    kwargs = {"seq_len": 64, "lora": False, **extra}
    with pytest.raises(ConfigError) as err:
        check_fp8("tensorwise", load_rung(rung), load_config("llama-tiny"), **kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_compiled_float8_under_cpu_autocast_is_refused():
    """inductor's CPU kernels give NaN gradients for this one combination (measured); FSDP2's bf16 and GPUs pass."""
    config = load_config("llama-tiny")
    with pytest.raises(ConfigError, match="--fp8 with --compile does not run on ddp in bf16 on a CPU"):
        check_fp8("tensorwise", load_rung("ddp"), config, seq_len=64, lora=False, compile=True,
                  mixed_precision="bf16", on_gpu=False)
    for rung, mixed, on_gpu in (("ddp", "no", False), ("ddp", "bf16", True), ("fsdp_full_shard", "bf16", False)):
        check_fp8("tensorwise", load_rung(rung), config, seq_len=64, lora=False, compile=True, mixed_precision=mixed,
                  on_gpu=on_gpu)


def test_a_model_where_nothing_would_convert_is_refused():
    with pytest.raises(ConfigError, match="--fp8 would change nothing on this model: none of its 14 decoder"):
        check_fp8("tensorwise", single_process_rung(), _llama(hidden_size=72, num_key_value_heads=4), seq_len=64,
                  lora=False)


@pytest.mark.parametrize("rung", ["single", "ddp", "fsdp_full_shard", "fsdp_hybrid", "pp", "fsdp_tp", "3d"])
def test_the_rungs_fp8_runs_on(rung):
    line = check_fp8("rowwise", load_rung(rung), load_config("llama-tiny"), seq_len=64, lora=False)
    assert line.startswith("hfdist: fp8 (rowwise): 28 of the 28 decoder projections compute in float8")


def test_a_yaml_fp8_runs_on_gpu_and_is_translated_off_on_cpu():
    from dataclasses import replace

    from hfdist.config.precision import cpu_translation, effective_fp8

    rung = replace(load_rung("fsdp_full_shard"), fp8="tensorwise", mixed_precision="bf16")
    assert effective_fp8(rung, on_gpu=True) == "tensorwise"
    assert effective_fp8(rung, on_gpu=False) is None
    assert effective_fp8(rung, on_gpu=False, asked="rowwise") == "rowwise"
    assert "fp8 (tensorwise) -> off (--fp8 keeps float8 matmuls)" in cpu_translation(rung, False).line(rung)
    assert "fp8" not in cpu_translation(rung, False, fp8="tensorwise").line(rung)


def test_the_launch_never_hands_accelerate_its_own_fp8():
    """accelerate would convert the model with its own torchao recipe under `mixed_precision: fp8`: the hand-over
    tells it the precision of the rest (hfdist converts the model itself)."""
    from dataclasses import replace

    from hfdist.job.launch import accelerate_arguments

    rung = replace(load_rung("fsdp_full_shard"), fp8="tensorwise", mixed_precision="bf16")
    cmd = accelerate_arguments(rung, ["scripts/finetune.py"], [], on_gpu=True)
    assert cmd[cmd.index("--mixed_precision") + 1] == "bf16"


def _plan(fp8: str | None, dtype: str = "bf16"):
    return plan_rungs(load_config("llama-3.1-8b"), gpus_per_node=8, gpu_mem_bytes=80 * GB, dtype=dtype, fp8=fp8,
                      model="llama-3.1-8b")


def test_the_planner_counts_float8_gathered_layers():
    """fsdp_full_shard keeps two decoder layers gathered (current + prefetched): under --fp8 tensorwise their
    projections take 1 byte per element instead of bf16's 2; rowwise gathers bf16; the rest is unchanged."""
    from hfdist.parallel.float8_check import float8_params_per_layer

    plain, tensorwise, rowwise = ({r.name: r for r in _plan(f).rungs} for f in (None, "tensorwise", "rowwise"))
    f8 = float8_params_per_layer(load_config("llama-3.1-8b"))
    assert f8 == 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # 8B: q, o, k, v, gate, up, down
    drop = plain["fsdp_full_shard"].bytes.buffers - tensorwise["fsdp_full_shard"].bytes.buffers
    assert drop == pytest.approx(2 * f8 * (2 - 1), abs=2)
    assert rowwise["fsdp_full_shard"].bytes == plain["fsdp_full_shard"].bytes
    assert tensorwise["ddp"].bytes == plain["ddp"].bytes  # nothing gathered
    for name in ("zero1", "zero3", "fsdp_cp"):
        assert tensorwise[name].bytes is None and "--fp8 does not run on" in tensorwise[name].note
    assert tensorwise["fsdp_full_shard"].command.endswith("--fp8 tensorwise")


def test_the_matrix_names_the_float8_recipe():
    from hfdist.report.matrix import matrix_row

    rank = {"tokens_per_second": 1.0, "tflops_per_device": 1.0, "peak_memory_bytes": 1, "param_bytes": 1,
            "grad_bytes": 1, "optimizer_bytes": 1, "master_bytes": 0}
    strategy = {"name": "fsdp_tp", "world_size": 4, "dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1,
                "zero_stage": 0, "lora": False, "micro_batch": 1, "global_batch": 8, "seq_len": 64}
    names = [matrix_row({"strategy": {**strategy, "fp8": fp8}, "ranks": [rank], "losses": [1.0]})["strategy"]
             for fp8 in (None, "tensorwise", "rowwise")]
    assert names == ["fsdp_tp", "fsdp_tp+fp8", "fsdp_tp+fp8-rowwise"]


def test_memory_counts_the_storage_inside_float8_weights():
    from hfdist.metrics.memory import rank_state_bytes
    from hfdist.parallel.float8 import convert_to_float8

    linear = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    plain = rank_state_bytes(linear)["param_bytes"]
    convert_to_float8(torch.nn.Module(), "tensorwise")  # no decoder layers: nothing converts, nothing fails
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    assert rank_state_bytes(convert_to_float8_training(linear, config=config))["param_bytes"] == plain == 64 * 32 * 4
