"""Tensor parallelism for HF Llama: validation and the plan as pure data, the loss against HF's own in one process,
apply_tp's layouts and refusals under a fake process group, and one 4-rank gloo launch (tests/_tp_worker.py) that
trains TP=2 (with and without sequence parallel), TP=2 + LoRA and FSDP2 x TP = 2 x 2 against the single-process
reference, counts collectives and round-trips checkpoints.

Tolerances (fp32): losses and pre-clip gradient norms within a relative 1e-5 of one process (observed <= 3e-7);
first-step gradients within 1e-5 relative to each tensor's largest entry (observed <= 2e-6). Parameters after the
3 AdamW steps within 1e-4 absolute (= 0.1 lr; observed 7e-6): Adam divides each entry by its own gradient scale,
so the 1e-6 rounding differences of near-zero gradient entries become update differences far above 1e-6.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from hfdist.models import build_model, load_config
from hfdist.parallel.tensor import (
    LLAMA_COLWISE,
    LLAMA_ROWWISE,
    ReplicateParallel,
    TPError,
    apply_tp,
    count_loss_tokens,
    llama_tp_plan,
    tp_causal_lm_loss,
    valid_tp_degrees,
    validate_tp,
)

from conftest import torchrun_json

ROOT = Path(__file__).resolve().parents[1]
RTOL, PARAM_ATOL = 1e-5, 1e-4
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---------------------------------------------------------------- pure: validation and the plan


@pytest.mark.parametrize("preset,tps", [("llama-tiny", [1, 2]), ("llama-small", [1, 2, 4]),
                                        ("llama-3.1-8b", [1, 2, 4, 8]), ("llama-3.1-70b", [8])])
def test_validate_tp_accepts_presets(preset, tps):
    config = load_config(preset, vocab_size=1024)
    for tp in tps:
        validate_tp(config, tp)
        assert tp in valid_tp_degrees(config)


def test_validate_tp_names_sizes_and_working_degrees():
    config = load_config("llama-tiny", vocab_size=1024)  # heads 4, kv heads 2, intermediate 256, hidden 64
    with pytest.raises(TPError) as err:
        validate_tp(config, 4 * 2)
    msg = str(err.value)
    assert "tp=8" in msg and "num_attention_heads=4" in msg and "num_key_value_heads=2" in msg
    assert "intermediate_size=256" in msg and "vocab_size=1024" in msg  # every size is listed ...
    assert "does not divide num_attention_heads=4, num_key_value_heads=2." in msg  # ... the failing ones named
    assert "would work: [1, 2]" in msg
    assert "pad_to_multiple_of" not in msg  # the vocabulary is fine here

    config.num_key_value_heads = 1  # multi-query attention: kv heads cannot be split at all
    with pytest.raises(TPError, match=r"does not divide num_key_value_heads=1\. .*would work: \[1\]"):
        validate_tp(config, 2)


def test_validate_tp_vocab_hint_and_bad_degree():
    config = load_config("llama-tiny", vocab_size=1001)
    with pytest.raises(TPError, match=r"vocab_size=1001.*pad_to_multiple_of=2"):
        validate_tp(config, 2)
    assert valid_tp_degrees(config) == [1]
    with pytest.raises(TPError, match="positive integer"):
        validate_tp(config, 0)


def test_plan_is_data_with_megatron_layout():
    plan = llama_tp_plan()
    layer = "model.layers.*"
    for name in LLAMA_COLWISE:
        assert type(plan[f"{layer}.{name}"]) is ColwiseParallel
    for name in LLAMA_ROWWISE:
        style = plan[f"{layer}.{name}"]
        assert type(style) is RowwiseParallel and style.output_layouts == (Shard(1),)  # reduce-scatter under SP
    for norm in (f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm", "model.norm"):
        assert type(plan[norm]) is SequenceParallel
    assert plan["lm_head"].output_layouts == (Shard(-1),) and not plan["lm_head"].use_local_output
    assert type(plan["model.embed_tokens"]) is ColwiseParallel  # untied: hidden-split, gradient stays sharded

    plain = llama_tp_plan(sequence_parallel=False, loss_parallel=False, tied_embeddings=True)
    assert plain[f"{layer}.self_attn.o_proj"].output_layouts == (Replicate(),)  # all-reduce without SP
    assert type(plain["model.norm"]) is ReplicateParallel
    assert plain["lm_head"].output_layouts == (Replicate(),) and plain["lm_head"].use_local_output
    assert type(plain["model.embed_tokens"]) is RowwiseParallel  # tied: shares lm_head's vocab split


def test_plan_splits_lora_adapters_like_their_base():
    plan = llama_tp_plan(lora_targets=frozenset({"q_proj", "o_proj"}))
    q, o = "model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.o_proj"
    assert q not in plan and o not in plan
    assert type(plan[f"{q}.base_layer"]) is ColwiseParallel
    assert type(plan[f"{q}.lora_A.*"]) is ReplicateParallel and type(plan[f"{q}.lora_B.*"]) is ColwiseParallel
    assert type(plan[f"{o}.base_layer"]) is RowwiseParallel
    assert type(plan[f"{o}.lora_A.*"]) is RowwiseParallel and type(plan[f"{o}.lora_B.*"]) is ReplicateParallel
    assert type(plan["model.layers.*.self_attn.k_proj"]) is ColwiseParallel  # not a LoRA target: unchanged


# ---------------------------------------------------------------- one process: the loss is HF's loss


def _batch(vocab: int = 1024) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :5] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_loss_equals_hf_loss_and_global_normaliser():
    """Same shift, -100 handling and reduction as LlamaForCausalLM's own loss, also with num_items_in_batch."""
    model = build_model("llama-tiny", vocab_size=1024, seed=0)
    batch = _batch()
    n = count_loss_tokens(batch["labels"])
    assert n == int((batch["labels"][:, 1:] != -100).sum()) == 3 * 11 - 4 - 4
    with torch.no_grad():
        assert tp_causal_lm_loss(model, batch).item() == pytest.approx(model(**batch).loss.item(), rel=1e-6)
        ours = tp_causal_lm_loss(model, batch, num_items_in_batch=2 * n).item()
        assert ours == pytest.approx(model(**batch, num_items_in_batch=2 * n).loss.item(), rel=1e-6)
        assert ours == pytest.approx(tp_causal_lm_loss(model, batch).item() / 2, rel=1e-6)


# ---------------------------------------------------------------- apply_tp under a fake process group


@contextmanager
def _fake_tp_mesh(tp: int):
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this test process")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2 * tp)
    try:
        yield init_device_mesh("cpu", (2, tp), mesh_dim_names=("dp_shard", "tp"))
    finally:
        dist.destroy_process_group()


def test_apply_tp_shards_heads_and_refuses_misuse():
    from peft import LoraConfig, get_peft_model

    with _fake_tp_mesh(2) as mesh:
        model = apply_tp(build_model("llama-tiny", vocab_size=1024), mesh["tp"])
        attn = model.model.layers[0].self_attn
        # heads/tp query heads and kv_heads/tp kv heads per rank (head_dim 16): 4/2 * 16 and 2/2 * 16 rows.
        assert attn.q_proj.weight.to_local().shape == (32, 64) and attn.k_proj.weight.to_local().shape == (16, 64)
        assert attn.o_proj.weight.to_local().shape == (64, 32)
        with pytest.raises(TPError, match="must run once"):
            apply_tp(model, mesh["tp"])
        with pytest.raises(TPError, match="1-D tensor-parallel sub-mesh"):
            apply_tp(build_model("llama-tiny", vocab_size=1024), mesh)
        with pytest.raises(TPError, match="tp=2 cannot split"):
            apply_tp(build_model("llama-tiny", vocab_size=1001), mesh["tp"])

        base = build_model("llama-tiny", vocab_size=1024)
        with pytest.raises(TPError, match="LoRA on lm_head"):
            apply_tp(get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "lm_head"])), mesh["tp"])
        base = build_model("llama-tiny", vocab_size=1024)
        with pytest.raises(TPError, match="other than plain LoRA"):
            apply_tp(get_peft_model(base, LoraConfig(r=2, target_modules=["v_proj"], use_dora=True)), mesh["tp"])
        base = build_model("llama-tiny", vocab_size=1024)
        lora = get_peft_model(base, LoraConfig(r=2, target_modules=LORA_TARGETS, layers_to_transform=[0, 1]))
        with pytest.raises(TPError, match="differ between decoder layers"):
            apply_tp(lora, mesh["tp"])


# ---------------------------------------------------------------- four ranks, gloo: one launch for every case


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory) -> dict:
    return torchrun_json(ROOT / "tests" / "_tp_worker.py", 4, tmp_path_factory.mktemp("tp") / "tp.json", timeout=400)


def _case(results: dict, name: str) -> dict:
    case = results[name]
    assert "error" not in case, f"{name}:\n{case['error']}"
    return case


def _assert_matches_reference(run: dict, max_norm: float) -> None:
    assert run["loss_rel_err"] < RTOL, (run["losses"], run["ref_losses"])
    assert run["norm_rel_err"] < RTOL
    assert run["grad_rel_err"][0] < RTOL, run["grad_rel_err"]  # [error, worst tensor]
    assert run["param_abs_err"] < PARAM_ATOL
    assert min(run["norms"]) > max_norm  # clipping really happened at every step
    assert run["losses"][-1] < run["losses"][0]  # and training moved the weights


@pytest.mark.multiproc
@pytest.mark.parametrize("sp", [True, False])
def test_tp2_matches_single_process(tp_results, sp):
    """TP=2, 3 AdamW steps with clipping (max_norm 0.5 < the gradient norm), 2 accumulated micro-batches each
    normalised by the global token count; batches with padding and -100 labels."""
    _assert_matches_reference(_case(tp_results, "tp")[f"sp={sp}"], tp_results["max_norm"])


@pytest.mark.multiproc
def test_fsdp_x_tp_matches_single_process_and_saves_hf_checkpoint(tp_results):
    """FSDP2 over dp_shard=2 x TP=2 on one 2-D mesh; each dp rank sees half the batch. The gathered full state
    dict equals the reference's parameters and save_pretrained -> from_pretrained reproduces the trained loss."""
    run = _case(tp_results, "fsdp_tp")
    _assert_matches_reference(run["base"], tp_results["max_norm"])
    assert run["placements"] == ["(Shard(dim=0), Replicate())", "(Shard(dim=0), Shard(dim=1))",
                                 "(_StridedShard(dim=0, sf=2), Shard(dim=0))"]  # every param on the 2-D mesh
    assert run["state_keys"] and run["state_abs_err"] < PARAM_ATOL
    assert run["reloaded_loss"] == pytest.approx(run["trained_loss_dp0"], rel=RTOL)


@pytest.mark.multiproc
def test_lora_tp_trains_saves_and_loads(tp_results):
    """LoRA (r=4, all seven linears, non-zero B) + TP=2, with and without sequence parallel, and under FSDP x TP,
    matches single-process LoRA; the base stays frozen; the gathered adapter saves as a normal peft adapter that
    loads both in one process and under TP."""
    run = _case(tp_results, "lora")
    for sp in (True, False):
        _assert_matches_reference(run[f"sp={sp}"], tp_results["max_norm"])
    _assert_matches_reference(_case(tp_results, "fsdp_tp")["lora"], tp_results["max_norm"])  # and under FSDP x TP
    assert run["sp=True"]["n_tensors"] == run["adapter_keys"] == 4 * 7 * 2  # only lora_A / lora_B train
    assert not run["frozen_have_grad"]
    assert run["loaded_single_loss"] == pytest.approx(run["trained_tp_loss"], rel=RTOL)
    assert run["loaded_tp_loss"] == pytest.approx(run["trained_tp_loss"], rel=RTOL)


@pytest.mark.multiproc
def test_sharded_weights_are_exactly_one_over_tp(tp_results):
    """Every rank holds exactly 1/tp of each split linear/embedding under TP, 1/(dp_shard*tp) under FSDP x TP."""
    for per_rank in tp_results["bytes_per_rank"]:
        tp_bytes = {n: b for n, b in per_rank["tp"].items() if "norm" not in n}  # norms are replicated under TP
        linears = [f"model.layers.{i}.{n}.weight" for i in range(4) for n in LLAMA_COLWISE + LLAMA_ROWWISE]
        assert set(tp_bytes) == set(linears) | {"model.embed_tokens.weight", "lm_head.weight"}
        assert all(local * 2 == full for local, full in tp_bytes.values())
        for name, (local, full) in per_rank["fsdp_tp"].items():
            assert local * (2 if "norm" in name else 4) == full, name  # norms: split by FSDP only


@pytest.mark.multiproc
@pytest.mark.parametrize("sp", [True, False])
def test_collectives_follow_megatron_pattern(tp_results, sp):
    """Per decoder layer, forward and backward alike: 2 all-reduces without sequence parallel (after o_proj and
    down_proj forward, before q/k/v and gate/up backward); with it each all-reduce becomes a reduce-scatter +
    all-gather pair. In the whole step, besides the layers: loss parallelism's 3 all-reduces (max, sum of exp,
    target logit), lm_head's input (all-gather under SP; its gradient all-reduced or reduce-scattered), the
    embedding output's one redistribution each way. No collective carries full logits: each rank's are 1/tp."""
    counts = _case(tp_results, "counts")
    n_layers, got = counts["layers"], counts[f"sp={sp}"]
    per_layer = ({"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2} if sp else {"all_reduce": 2})
    for i in range(n_layers):
        layer = got[f"LlamaForCausalLM.model.layers.{i}"]
        assert layer == {"forward": per_layer, "backward": per_layer}, (i, layer)

    embed = got["LlamaForCausalLM.model.embed_tokens"]
    # Shard(hidden) -> Shard(seq) is an all-to-all on NCCL; gloo has none and torch falls back to an all-gather.
    assert sum(embed["forward"].values()) == 1 and sum(embed["backward"].values()) == (1 if sp else 0)
    rest = {phase: dict(ops) for phase, ops in got["Global"].items()}
    for phase in rest:
        for op, n in embed[phase].items():
            rest[phase][op] -= n
        rest[phase] = {op: n for op, n in rest[phase].items() if n}
    L = n_layers
    if sp:
        assert rest["forward"] == {"all_gather_into_tensor": 2 * L + 1, "reduce_scatter_tensor": 2 * L, "all_reduce": 3}
        assert rest["backward"] == {"all_gather_into_tensor": 2 * L, "reduce_scatter_tensor": 2 * L + 1}
    else:
        assert rest["forward"] == {"all_reduce": 2 * L + 3}
        assert rest["backward"] == {"all_reduce": 2 * L + 1}
    assert got["local_logits_shape"] == [4, 16, 1024 // 2]


@pytest.mark.multiproc
def test_tied_gathered_and_odd_length_variants(tp_results):
    """Tied embeddings stay tied and match; loss_parallel=False (gathered logits) matches; a sequence length tp
    does not divide works under sequence parallel; vocab-sharded logits outside loss_parallel() are refused."""
    variants = _case(tp_results, "variants")
    for name in ("tied", "no_loss_parallel", "odd_seq_len"):
        assert variants[name]["loss_rel_err"] < RTOL and variants[name]["grad_rel_err"] < RTOL, name
    assert variants["tied"]["still_tied"]
    assert "inside torch.distributed.tensor.parallel.loss_parallel()" in variants["missing_loss_parallel"]
