"""Mixture-of-experts in one process: the registry's MoE facts against built models, checkpoints read through
transformers' own conversion (per-expert tensors stacked slice by slice, written back as save_pretrained writes
them), the dispatch's expert computation against transformers' experts, the router's aux loss against
transformers' load_balancing_loss_func, LoRA's targets, the planner's ep layouts (FLOPs from active parameters:
tests/unit/test_flops.py), and
every refusal before launch (experts ep does not divide, rungs that do not hold MoE models, --ep where it does not
apply, QLoRA, peft's expert adapters, a Llama 4 sequence past its attention chunk)."""

from __future__ import annotations

import json

import pytest
import torch

from hfdist.config.finetune import FinetuneConfig
from hfdist.config.ladder import LadderError, load_rung
from hfdist.job.world import Node, resolve_rung
from hfdist.models.build import build_model, lora_config, meta_model
from hfdist.models.moe import moe_layers, moe_lora_config
from hfdist.models.presets import load_config
from hfdist.parallel.expert_check import ExpertParallelError, check_moe

MOE = ["qwen3-moe-tiny", "mixtral-tiny", "llama4-tiny"]


# ------------------------------------------------------------------------------------------ facts


@pytest.mark.parametrize("preset", MOE)
def test_moe_facts_name_the_real_modules(preset):
    """Every MoE layer the facts name holds its router, stacked experts of the facts' shapes and (Llama 4) its
    shared expert; the other layers hold a dense MLP of the facts' width."""
    model = meta_model(preset)
    layers = moe_layers(model)
    facts = layers[0].facts
    config = model.config
    assert [layer.index for layer in layers] == facts.moe_layer_indices(config) and layers
    for layer in layers:
        assert layer.router.weight.shape == (facts.num_experts(config), config.hidden_size)
        for name, shape in facts.stacked_shapes(config).items():
            assert tuple(getattr(layer.experts, name).shape) == shape
        assert (facts.shared_expert is not None) == hasattr(layer.block, "shared_expert")
    dense = set(range(config.num_hidden_layers)) - set(facts.moe_layer_indices(config))
    for i in dense:
        assert model.model.layers[i].get_submodule(facts.block).gate_proj.out_features == facts.dense_width(config)
    assert dense == {"qwen3-moe-tiny": {3}, "mixtral-tiny": set(), "llama4-tiny": {0, 2}}[preset]


# ------------------------------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{preset: (the seeded model, its folder as transformers' save_pretrained writes it)}."""
    root = tmp_path_factory.mktemp("moe_checkpoints")
    out = {}
    for preset in ("qwen3-moe-tiny", "mixtral-tiny"):
        model = build_model(preset, seed=0)
        model.save_pretrained(root / preset)
        out[preset] = (model, root / preset)
    return out


def _keys(folder) -> list[str]:
    from hfdist.models.checkpoint_check import checkpoint_headers

    return sorted(checkpoint_headers(folder))


def test_a_per_expert_checkpoint_is_whole_and_loads_stacked(saved):
    """transformers writes experts one by one (Mixtral's under block_sparse_moe.experts.<e>.w1/w2/w3); the check
    accepts the folder, and hfdist's loader stacks them back into the weights save_pretrained was given."""
    from hfdist.models.build import check_checkpoint_weights

    for preset, (model, folder) in saved.items():
        keys = _keys(folder)
        assert any(".experts.0." in k for k in keys) and not any(k.endswith("experts.gate_up_proj") for k in keys)
        check_checkpoint_weights(str(folder), model.config)
        loaded = build_model(str(folder))
        for (name, want), got in zip(model.state_dict().items(), loaded.state_dict().values()):
            assert torch.equal(want, got), name


def test_the_loader_reads_a_ranks_slice_of_a_stacked_tensor(saved):
    """A rank holding experts 2..5 and rows 10..40 of their gate_up reads exactly that box, from per-expert files."""
    from hfdist.models.load import checkpoint_files, read_box, weight_plan

    model, folder = saved["qwen3-moe-tiny"]
    plan = weight_plan(meta_model(str(folder)), folder, seed=0)
    source = plan.tensors["model.layers.1.mlp.experts.gate_up_proj"]
    assert source.stacked is not None and source.widths == (32, 32)
    box = read_box(source, checkpoint_files(plan), (2, 10, 0), (4, 30, 64), torch.empty(4, 30, 64))
    assert torch.equal(box, model.model.layers[1].mlp.experts.gate_up_proj.detach()[2:6, 10:40])


def test_a_checkpoint_of_other_experts_is_refused(saved, tmp_path):
    from hfdist.models.build import check_checkpoint_weights
    from hfdist.models.presets import ModelSpecError

    _, folder = saved["qwen3-moe-tiny"]
    config = json.loads((folder / "config.json").read_text())
    config["moe_intermediate_size"] = 16
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(config))
    (other / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(ModelSpecError, match=r"experts\.gate_up_proj stacks 16 tensors like .*experts\.0\.gate_proj"):
        check_checkpoint_weights(str(other), load_config(str(other)))


@pytest.mark.parametrize("preset", MOE)
def test_export_writes_what_save_pretrained_writes(preset, tmp_path):
    """hfdist's export keys and values are save_pretrained's: per expert (renamed back for Mixtral), so vLLM and
    from_pretrained read it as they read the original checkpoints."""
    from safetensors.torch import load_file

    from hfdist.checkpoint.hf_export import save_hf_checkpoint

    model = build_model(preset, seed=0)
    model.save_pretrained(tmp_path / "hf")
    save_hf_checkpoint(tmp_path / "hfdist", meta_model(preset), dict(model.named_parameters()))
    want, got = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hfdist" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k].float()) for k in want)


# ------------------------------------------------------------------------------------------ computation


@pytest.mark.parametrize("preset", MOE)
def test_routed_experts_equal_transformers_experts(preset):
    """hfdist's expert computation on one rank (sorted, grouped by expert, weighted, summed per token) gives the
    MoE block's output transformers computes, for fp32: rel 1e-6 (a few hundred products summed in another order:
    sqrt(n) x 6e-8 ~ 1e-6 at most, measured ~1e-7)."""
    from hfdist.parallel.expert import apply_ep

    torch.manual_seed(0)
    reference = build_model(preset, seed=0)
    ours = build_model(preset, seed=0)
    apply_ep(ours, None)
    hidden = torch.randn(2, 24, reference.config.hidden_size)
    for ref_layer, our_layer in zip(moe_layers(reference), moe_layers(ours)):
        want, got = ref_layer.block(hidden), our_layer.block(hidden)
        want, got = (want[0], got[0]) if isinstance(want, tuple) else (want, got)
        assert float((got - want).norm() / want.norm()) < 1e-6


def test_grouped_gemm_path_equals_the_loop():
    """The GPU path (torch's grouped GEMM through transformers' _grouped_linear) runs on CPU too: the same experts'
    outputs and gradients as the CPU loop, empty experts included (fp32, rel 1e-6)."""
    from torch import nn

    from hfdist.parallel.expert_dispatch import run_experts

    torch.manual_seed(0)
    rows = torch.randn(40, 16)
    sizes = [7, 0, 21, 12]
    for transposed in (False, True):
        gate_up = torch.randn(4, 16, 24) if transposed else torch.randn(4, 24, 16)
        down = torch.randn(4, 12, 16) if transposed else torch.randn(4, 16, 12)
        outs, grads = [], []
        for grouped in (True, False):
            w = [gate_up.clone().requires_grad_(), down.clone().requires_grad_()]
            out = run_experts(rows, sizes, *w, nn.SiLU(), transposed, grouped=grouped)
            (out * torch.arange(out.numel()).view_as(out)).sum().backward()
            outs.append(out.detach())
            grads.append([p.grad for p in w])
        assert float((outs[0] - outs[1]).norm() / outs[1].norm()) < 1e-6
        for a, b in zip(*grads):
            assert float((a - b).norm() / b.norm()) < 1e-6


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_aux_loss_is_transformers_load_balancing_loss(preset):
    """The recorder's aux term on one process is transformers' own load_balancing_loss_func over the same routers
    (coef x aux), value and gradient."""
    import importlib

    from hfdist.models.router_stats import RouterRecorder

    model = build_model(preset, seed=0)
    module = importlib.import_module(type(model).__module__)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    recorder = RouterRecorder(model, distributed=False)
    with recorder.recording():
        out = model(input_ids=ids, output_router_logits=True)
    ours = recorder.aux_term()
    theirs = model.config.router_aux_loss_coef * module.load_balancing_loss_func(
        out.router_logits, recorder.num_experts, recorder.top_k)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
    router = moe_layers(model)[0].router.weight
    (g_ours,) = torch.autograd.grad(ours, router, retain_graph=True)
    (g_theirs,) = torch.autograd.grad(theirs, router)
    assert float((g_ours - g_theirs).norm() / g_theirs.norm()) < 1e-5


def test_lora_leaves_the_routed_experts_frozen():
    """hfdist's LoRA targets on an MoE model adapt the Linear projections only: peft's conversion of gate/up/down
    into adapters on the stacked experts (Qwen3-MoE) is avoided; Llama 4's shared expert and dense MLPs are adapted."""
    from peft import get_peft_model

    for preset, adapted in (("qwen3-moe-tiny", {"q_proj", "k_proj", "v_proj", "o_proj"}),
                            ("llama4-tiny", {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"})):
        model = meta_model(preset)
        peft_model = get_peft_model(model, moe_lora_config(model, lora_config(4, 8)))
        trained = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in peft_model.named_parameters() if p.requires_grad}
        assert trained == adapted
        assert not any("experts" in n for n, p in peft_model.named_parameters() if p.requires_grad)


# ------------------------------------------------------------------------------------------ planner


def test_plan_recommends_an_ep_layout_for_qwen3_30b():
    """One node of 8 x 80 GB: a layout with experts over ep fits and is recommended (the command passes --ep);
    expert parallelism lowers what a rank gathers (experts E / ep at a time), not what it holds."""
    from hfdist.plan import GB, plan_rungs

    plan = plan_rungs(load_config("qwen3-30b-a3b"), gpus_per_node=8, gpu_mem_bytes=80 * GB, model="qwen3-30b-a3b")
    rec = plan.recommended
    assert rec is not None and rec.dims.ep > 1 and f"--ep {rec.dims.ep}" in rec.command
    rungs = {r.name: r for r in plan.rungs}
    ep, full = rungs["fsdp_ep"], rungs["fsdp_full_shard"]
    assert ep.dims.ep == 8 and ep.bytes.buffers < full.bytes.buffers
    assert ep.bytes.model_states == full.bytes.model_states
    assert rungs["zero3"].bytes is None and "does not hold MoE models" in rungs["zero3"].note
    assert "3.35B active" in plan.table() and plan.to_json()["model"]["active_params"] == 3353032704
    assert "all-to-all" in ep.note


def test_the_planned_ep_layout_simulates_at_64_ranks():
    """The layout the planner recommends for Qwen3-30B-A3B on one 8-GPU node, simulated at 64 ranks (the recipe on a
    meta model under a fake process group, verify included): every rank's param / grad / optimizer bytes within 2%
    of the planner's (measured 0.00%; under tp the routers, replicated, are counted as split: 0.04%)."""
    from hfdist.plan import GB, plan_rungs
    from hfdist.plan.simulate import simulate, simulation_rung

    config = load_config("qwen3-30b-a3b")
    rec = plan_rungs(config, gpus_per_node=8, gpu_mem_bytes=80 * GB).recommended
    rung = simulation_rung(rec.name, 64, tp=rec.dims.tp, ep=rec.dims.ep, model_config=config)
    sim = simulate("qwen3-30b-a3b", rung)
    assert sim.verified and rung.dims.ep == rec.dims.ep > 1, sim.failure
    assert all(r.relative_error() < 0.02 for r in sim.roles), sim.table()


def test_expert_bytes_functions():
    from hfdist.config.dims import ParallelDims
    from hfdist.models.shape import ModelShape
    from hfdist.plan.expert_bytes import all_to_all_bytes_per_step, choose_ep, expert_bytes_per_rank

    shape = ModelShape.from_config(load_config("qwen3-30b-a3b"))
    assert choose_ep(128, 8, 8) == 8 and choose_ep(16, 64, 8) == 8 and choose_ep(8, 6, 8) == 2
    dims = ParallelDims(dp_shard=8, ep=8)
    # 48 layers x 128 experts x 3 x 2048 x 768 weights over 8 ranks, 2 bytes each
    assert expert_bytes_per_rank(shape.moe, shape.hidden, dims, 2) == 48 * 128 * 3 * 2048 * 768 * 2 / 8
    # 2048 tokens x top-8 rows x 2048 x 2 bytes, there and back in forward and backward, 7 of 8 leaving the rank
    assert all_to_all_bytes_per_step(shape.moe, shape.hidden, dims, 2048, 2) == int(4 * 2048 * 8 * 2048 * 2 * 48 * 7 / 8)
    assert all_to_all_bytes_per_step(shape.moe, shape.hidden, ParallelDims(dp_shard=8), 2048, 2) == 0


# ------------------------------------------------------------------------------------------ refusals


def _rung(**cfg):
    return resolve_rung(FinetuneConfig(**cfg), Node())


def test_experts_not_divisible_by_ep_are_refused():
    rung = _rung(config="fsdp_ep", num_processes=6, ep=3)
    with pytest.raises(ExpertParallelError, match=r"ep=3 cannot split this model's 8 experts.*\[1, 2, 4, 8\]"):
        check_moe(load_config("mixtral-tiny"), rung)


def test_rungs_that_do_not_hold_moe_are_refused():
    for name, why in (("zero3", "DeepSpeed's engine"), ("pp", "pipeline stages"), ("fsdp_cp", "context parallel")):
        with pytest.raises(ExpertParallelError, match=rf"{name} cannot train the mixture-of-experts model "
                                                      rf"'qwen3_moe': .*{why}.*holds? MoE models: single, ddp"):
            check_moe(load_config("qwen3-moe-tiny"), load_rung(name))
    for name in ("single", "ddp", "fsdp_full_shard", "fsdp_ep", "fsdp_tp"):
        check_moe(load_config("qwen3-moe-tiny"), load_rung(name), 64)


def test_ep_where_it_does_not_apply_is_refused():
    with pytest.raises(LadderError, match="--ep 2 cannot apply to ddp"):
        _rung(config="ddp", ep=2)
    with pytest.raises(LadderError, match=r"--ep 4 borrows its ranks from fsdp_tp's 2 dp_shard ranks"):
        _rung(config="fsdp_tp", ep=4)
    assert _rung(config="fsdp_tp", ep=2).dims.ep == 2 and _rung(config="fsdp_ep").dims.ep == 2
    with pytest.raises(ExpertParallelError, match="dense 'llama' without experts"):
        check_moe(load_config("llama-tiny"), _rung(config="fsdp_ep"))


def test_compile_with_an_moe_model_is_refused_on_every_rung():
    """fsdp_ep refuses --compile by its table entry; the rungs that take it for dense models refuse it for an MoE
    model, whose compiled run nothing has compared with its eager one: hfdist's experts under tp or ep, the model's
    own blocks elsewhere."""
    from hfdist.parallel.parallelize import check_compile

    moe = load_config("qwen3-moe-tiny")
    for rung, why in ((load_rung("fsdp_tp"), "hfdist's experts"), (_rung(config="fsdp_tp", ep=2), "hfdist's experts"),
                      (load_rung("fsdp_full_shard"), "own MoE blocks"), (load_rung("ddp"), "own MoE blocks")):
        with pytest.raises(ExpertParallelError, match=rf"--compile with the mixture-of-experts 'qwen3_moe' on "
                                                      rf"{rung.name} .*{why}"):
            check_compile(rung, moe)
    check_compile(load_rung("fsdp_tp"), load_config("llama-tiny"))


def test_replicas_under_expert_parallelism_are_refused():
    with pytest.raises(ExpertParallelError, match="dp_replicate=2 with hfdist's expert-parallel experts"):
        check_moe(load_config("qwen3-moe-tiny"), _rung(config="fsdp_ep", num_processes=8, dp_replicate=2))


def test_moe_only_options_are_refused():
    with pytest.raises(ExpertParallelError, match="--qlora on a mixture-of-experts model"):
        check_moe(load_config("qwen3-moe-tiny"), load_rung("fsdp_full_shard"), qlora=True)
    with pytest.raises(ExpertParallelError, match="--seq-len 9000 is longer than Llama 4's attention chunk"):
        check_moe(load_config("llama4-tiny"), load_rung("fsdp_ep"), 9000)
    config = load_config("mixtral-tiny")
    config.router_jitter_noise = 0.1
    with pytest.raises(ExpertParallelError, match="router_jitter_noise"):
        check_moe(config, load_rung("fsdp_ep"))


def test_lora_on_the_experts_is_refused_before_launch():
    from hfdist.config.finetune import ConfigError
    from hfdist.job.preflight import check_lora

    cfg = FinetuneConfig(model="qwen3-moe-tiny", lora=True, lora_target_modules=("q_proj", "gate_proj"))
    with pytest.raises(ConfigError, match="--lora-target-modules gate_proj on this mixture-of-experts model"):
        check_lora(cfg, load_rung("fsdp_ep"), load_config("qwen3-moe-tiny"))


def test_scheduler_state_follows_the_param_groups_across_layouts():
    """transformers gives the experts of an ep layout param groups of their own (their own device mesh): a
    checkpoint of fsdp_ep (3 groups) resumed on fsdp_full_shard (2) keeps its schedule (resumed by hand on 4 -> 2
    ranks: steps 3 and 4 equal the uninterrupted run's to 7e-8); groups on different schedules are left to torch."""
    from hfdist.checkpoint.trainer_hooks import _regrouped

    saved = {"base_lrs": [3e-3] * 3, "_last_lr": [2e-3] * 3, "lr_lambdas": [None] * 3, "last_epoch": 2}
    assert _regrouped(saved, 2) == {"base_lrs": [3e-3] * 2, "_last_lr": [2e-3] * 2, "lr_lambdas": [None] * 2,
                                    "last_epoch": 2}
    mixed = {**saved, "base_lrs": [3e-3, 1e-3, 3e-3]}
    assert _regrouped(mixed, 2)["base_lrs"] == [3e-3, 1e-3, 3e-3]
