"""QLoRA's 4-bit base in one process (hfdist.models.quantize): rows quantise exactly as the whole tensor does, the meta
model carries bitsandbytes' 4-bit layers under peft's 4-bit LoRA layers, a loaded base is bitsandbytes' own
quantisation of the seeded weights, the preflight refusals, the merge, the planner's and simulator's bytes, and the
comparison's rows. Multi-rank loading, training, saving and resuming: tests/e2e/test_qlora.py."""

from __future__ import annotations

import pytest
import torch

import hfdist.models.quantize as quantize
from hfdist.config.finetune import ConfigError, FinetuneConfig, parse_args
from hfdist.config.ladder import load_rung
from hfdist.models.presets import load_config
from hfdist.models.shape import ModelShape


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (packed codes viewed as bf16 hold NaN patterns, which torch.equal calls different)."""
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _bnb_full(weight: torch.Tensor):
    """bitsandbytes' own quantisation of a whole weight: QLoRA's settings (what BitsAndBytesConfig asks for)."""
    import bitsandbytes.functional as bnbf

    return bnbf.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4",
                              quant_storage=torch.bfloat16)


@pytest.mark.parametrize("pieces", [1, 2, 4])
def test_rows_quantise_exactly_as_the_whole_tensor(pieces, monkeypatch):
    """Each rank quantises its rows; their codes and absmax, put together, are bitsandbytes' for the whole tensor (and
    a few rows at a time, as the loader chunks them, changes nothing)."""
    monkeypatch.setattr(quantize, "_CHUNK_VALUES", 1000)
    weight = (torch.randn(256, 192) * 0.02).to(torch.bfloat16)
    packed, state = _bnb_full(weight)
    parts = [quantize.quantize_rows(rows) for rows in weight.chunk(pieces)]
    assert _same(torch.cat([p for p, _ in parts]), packed)
    mine = quantize.double_quantize(torch.cat([a for _, a in parts]), tuple(weight.shape))
    assert torch.equal(mine.absmax, state.absmax) and torch.equal(mine.offset, state.offset)
    assert torch.equal(mine.state2.absmax, state.state2.absmax) and mine.shape == state.shape
    assert torch.equal(quantize.dequantized_weight(packed, mine), quantize.dequantized_weight(packed, state))


@pytest.fixture(scope="module")
def qlora_tiny():
    """llama-tiny on the meta device, 4-bit, LoRA r=8 injected after."""
    from hfdist.models.build import inject_lora, meta_model

    return inject_lora(quantize.quantize_meta(meta_model("llama-tiny", vocab_size=1024)), 8, 16)


def test_meta_model_has_4bit_projections_under_peft_4bit_lora(qlora_tiny):
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    from hfdist.models.load import weight_plan

    adapted = [m for m in qlora_tiny.modules() if isinstance(m, LoraLinear4bit)]
    assert len(adapted) == 7 * 4  # every projection of the 4 decoder layers
    for layer in adapted:
        base = layer.base_layer
        assert quantize.is_4bit(base) and base.weight.is_meta and base.weight.dtype == torch.bfloat16
        assert tuple(base.weight.shape) == (base.out_features * base.in_features // 4, 1)
    trainable = {n: p.dtype for n, p in qlora_tiny.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable) and set(trainable.values()) == {torch.float32}
    shape = ModelShape.from_config(qlora_tiny.config)
    held = sum(t.numel() * t.element_size() for t in quantize.quant_state_tensors(qlora_tiny))
    assert held == shape.layers * shape.layer_quant_state_bytes
    plan = weight_plan(qlora_tiny, None, seed=0)
    source = plan.tensors["base_model.model.model.layers.0.mlp.up_proj.base_layer.weight"]
    assert source.packed and source.key == "model.layers.0.mlp.up_proj.weight" and source.shape == (256, 64)


def test_loaded_base_is_bitsandbytes_quantisation_of_the_seeded_weights():
    from hfdist.models.build import inject_lora, materialize, meta_model
    from hfdist.models.init import initial_values
    from hfdist.models.load import load_weights, weight_plan

    model = inject_lora(quantize.quantize_meta(meta_model("llama-tiny", vocab_size=1024)), 8, 16)
    plan = weight_plan(model, None, seed=3)
    materialize(model, torch.device("cpu"))
    load_weights({**dict(model.named_parameters()), **dict(model.named_buffers())}, plan)
    quantize.load_quantized(model, plan)
    for name, module in quantize.four_bit_modules(model):
        source = plan.tensors[f"{name}.weight"]
        packed, state = _bnb_full(initial_values(source.key, source.shape, source.rule, 3).to(torch.bfloat16))
        assert _same(module.weight.data, packed) and torch.equal(module.quant_state.absmax, state.absmax)
    ids = torch.randint(0, 1024, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [n for n, p in model.named_parameters() if p.grad is not None]
    assert grads and all("lora_B" in n or "lora_A" in n for n in grads)


def test_projections_must_split_into_whole_blocks_and_rows():
    config = load_config("llama-tiny")
    quantize.check_quantizable(config, shard=4)
    with pytest.raises(quantize.QuantizeError, match=r"q_proj \(64 rows\) over 3 ranks"):
        quantize.check_quantizable(config, shard=3)
    config.hidden_size = 96  # in_features 96: a 64-value block would straddle rows
    with pytest.raises(quantize.QuantizeError, match="blocks of 64 values along each row"):
        quantize.check_quantizable(config)


def test_qlora_implies_lora_and_bf16_compute_unless_asked_otherwise():
    cfg = parse_args(["--qlora"])
    assert cfg.qlora and cfg.lora and cfg.mixed_precision == "bf16"
    assert parse_args(["--qlora", "--mixed-precision", "no"]).mixed_precision == "no"
    assert FinetuneConfig().mixed_precision == "auto" and not FinetuneConfig().lora


@pytest.mark.parametrize("name, reason", [("fsdp_tp", "tensor parallelism splits every projection"),
                                          ("zero2", "ZeRO-1/2 shard optimizer state and gradients"),
                                          ("zero3_offload_cpu", "DeepSpeed's offload")])
def test_rungs_without_qlora_refuse_it_before_launch(name, reason):
    from hfdist.job.preflight import check_qlora

    with pytest.raises(ConfigError, match=f"--qlora does not run on {name}: {reason}"):
        check_qlora(FinetuneConfig(qlora=True), load_rung(name), load_config("llama-tiny"))


def test_compile_and_unsplittable_models_refused_before_launch():
    from hfdist.job.preflight import check_qlora

    with pytest.raises(ConfigError, match="--qlora does not run with --compile"):
        check_qlora(FinetuneConfig(qlora=True, compile=True), load_rung("ddp"), load_config("llama-tiny"))
    config = load_config("llama-tiny")
    config.intermediate_size = 200
    with pytest.raises(quantize.QuantizeError):
        check_qlora(FinetuneConfig(qlora=True), load_rung("fsdp_full_shard"), config)
    check_qlora(FinetuneConfig(qlora=True), load_rung("fsdp_hybrid"), load_config("llama-tiny"))


def test_refusal_is_one_paragraph_exit_2_and_nothing_written(tmp_path, capsys):
    from hfdist.cli import main

    out = tmp_path / "run"
    assert main(["finetune", "--config", "3d", "--qlora", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hfdist: error: --qlora does not run on 3d: tensor parallelism") and err.count("\n") == 1
    assert not out.exists()


def test_merge_adds_the_adapter_to_the_base_the_run_trained_against():
    """QLoRA: W_merged = dequantise(quantise(W)) + alpha / r * B A for adapted projections; other tensors are the
    base's own."""
    from hfdist.checkpoint.hf_export import checkpoint_entries
    from hfdist.checkpoint.merge import merged_weights
    from hfdist.models.build import meta_model
    from hfdist.models.init import initial_values
    from hfdist.models.load import weight_plan

    base = meta_model("llama-tiny", vocab_size=1024)
    record = {"model": "llama-tiny", "seed": 5, "lora": True, "qlora": True, "lora_r": 8, "lora_alpha": 16}
    generator = torch.Generator().manual_seed(0)
    adapters: dict[str, torch.Tensor] = {}

    def adapter(name: str) -> torch.Tensor:  # q_proj's (64 x 64): A is r x in, B out x r
        return adapters.setdefault(name, torch.randn((8, 64) if "lora_A" in name else (64, 8), generator=generator))

    merged = merged_weights(record, base, adapter)
    entries = {e.name: e for e in checkpoint_entries(base, adapter_only=False)}
    plan = weight_plan(base, None, seed=5)
    source = plan.tensors["model.layers.1.self_attn.q_proj.weight"]
    weight = initial_values(source.key, source.shape, source.rule, 5).to(torch.bfloat16)
    packed, state = _bnb_full(weight)
    got = merged(entries["model.layers.1.self_attn.q_proj.weight"])
    a = adapters["base_model.model.model.layers.1.self_attn.q_proj.lora_A.default.weight"]
    b = adapters["base_model.model.model.layers.1.self_attn.q_proj.lora_B.default.weight"]
    assert torch.allclose(got, quantize.dequantized_weight(packed, state).float() + 2.0 * (b @ a))
    embed = plan.tensors["model.embed_tokens.weight"]
    assert torch.equal(merged(entries["model.embed_tokens.weight"]),
                       initial_values(embed.key, embed.shape, embed.rule, 5))


def test_plan_fits_70b_qlora_on_two_24gb_gpus_only_offloaded():
    """The issue's scenario: 70B QLoRA on 2 x 24 GB at seq 2048 fits only with FSDP2's CPU offload (the 4-bit base
    alone is 17 GB per rank); the recommended rung's parameter bytes are what a run (and `hfdist simulate --qlora`)
    holds, within the planner's bf16 accounting of the adapters (2 B in the plan, fp32 in the run)."""
    from hfdist.plan import GB, plan_rungs, predict_state_bytes

    config = load_config("llama-3.1-70b")
    plan = plan_rungs(config, gpus_per_node=2, gpu_mem_bytes=24 * GB, qlora=True, activation_checkpointing=True)
    rec = plan.recommended
    assert rec.name == "fsdp_offload" and rec.fits and "--qlora" in rec.command
    held = predict_state_bytes(config, load_rung("fsdp_offload"), 2, dtype="bf16", qlora=True).param_bytes
    assert rec.bytes.params == pytest.approx(held, rel=0.02)
    fsdp = next(r for r in plan.rungs if r.name == "fsdp_full_shard")
    assert not fsdp.fits and fsdp.bytes.weights > 17 * GB  # 4-bit projections: 68.4e9 x 0.5 B / 2 ranks
    assert next(r for r in plan.rungs if r.name == "fsdp_tp").bytes is None  # n/a: TP does not take --qlora


def test_plan_hints_qlora_where_only_it_fits_without_offload():
    from hfdist.plan import GB, plan_rungs

    plan = plan_rungs(load_config("llama-3.1-70b"), gpus_per_node=2, gpu_mem_bytes=48 * GB, lora=True,
                      activation_checkpointing=True)
    assert plan.recommended.offload != "none"
    assert plan.hint.startswith("train QLoRA adapters on a 4-bit base (--qlora)") and "fsdp_full_shard fits" in \
        plan.hint


@pytest.mark.parametrize("config_name, world", [("fsdp_full_shard", 2), ("fsdp_hybrid", 4), ("fsdp_offload", 2)])
def test_simulated_qlora_rank_holds_the_predicted_bytes(config_name, world):
    from hfdist.plan.simulate import simulate, simulation_rung

    rung = simulation_rung(config_name, world, gpus_per_node=2)
    sim = simulate("llama-small", rung, qlora=True)
    assert sim.verified, sim.failure
    (role,) = sim.roles
    assert role.relative_error() == 0.0, role


def test_simulate_refuses_qlora_where_it_does_not_run():
    from hfdist.plan.simulate import SimulateError, simulate, simulation_rung

    with pytest.raises(SimulateError, match="--qlora does not run on fsdp_tp"):
        simulate("llama-tiny", simulation_rung("fsdp_tp", 4), qlora=True)
    with pytest.raises(SimulateError, match="without pipeline stages"):
        simulate("llama-tiny", simulation_rung("pp", 2), qlora=True)


def test_comparison_adds_a_qlora_row_where_the_rung_takes_it():
    from hfdist.report.compare import _runs
    from hfdist.report.matrix import matrix_row

    assert _runs(["ddp", "fsdp_tp"], qlora=True) == [("ddp", "ddp", []), ("ddp-qlora", "ddp", ["--qlora"]),
                                                      ("fsdp_tp", "fsdp_tp", [])]
    strategy = {"name": "ddp", "lora": True, "qlora": True, "world_size": 2, "dp_replicate": 2, "dp_shard": 1, "tp": 1,
                "pp": 1, "zero_stage": 0, "micro_batch": 4, "global_batch": 8, "seq_len": 64}
    rank = {"tokens_per_second": 10.0, "tflops_per_device": 0.1, "peak_memory_bytes": 1, "param_bytes": 1,
            "grad_bytes": 1, "optimizer_bytes": 1, "master_bytes": 0}
    row = matrix_row({"strategy": strategy, "ranks": [rank], "losses": [1.0]})
    assert row["strategy"] == "ddp+qlora" and row["qlora"] is True


def test_quantising_a_large_projection_holds_a_chunk_of_temporaries_not_the_whole():
    """The mechanism behind the loader's memory: bitsandbytes' CPU quantiser makes ~20 bytes of fp32 temporaries per
    value; in chunks of _CHUNK_VALUES the tensors alive at once are the output, its absmax and one chunk's (the
    measured load on the 153 M checkpoint: results/cpu-2core/qlora.md)."""
    from hfdist.metrics.memory import LiveTensorBytes

    weight = (torch.randn(2048, 1024) * 0.02).to(torch.bfloat16)
    with LiveTensorBytes() as created:
        quantize.quantize_rows(weight)
    kept = weight.numel() // 2 + weight.numel() // 64 * 4  # packed codes + fp32 absmax
    assert kept < created.peak <= kept + 24 * quantize._CHUNK_VALUES, created.peak
    assert created.peak < 4 * weight.numel()  # the whole tensor's temporaries would be ~20 bytes per value


def test_parameter_bytes_per_rank_under_a_third_of_loras_on_the_scale_checkpoint():
    """llama-medium (the 153 M checkpoint of tests/e2e/test_scale_memory.py) on fsdp_full_shard, 2 ranks: the 4-bit
    base sharded against LoRA's fp32 base sharded, as hfdist holds them (runs measure these bytes exactly:
    tests/e2e/test_qlora.py; the 153 M run itself: results/cpu-2core/qlora.md)."""
    from hfdist.plan import predict_state_bytes

    config, rung = load_config("llama-medium"), load_rung("fsdp_full_shard")
    qlora = predict_state_bytes(config, rung, 2, dtype="fp32", qlora=True).param_bytes
    lora = predict_state_bytes(config, rung, 2, dtype="fp32", lora=True).param_bytes
    assert qlora <= 0.3 * lora
