"""The fsdp_ep rung end to end, as a user launches it: `scripts/finetune.py --config fsdp_ep --ep 2 --model
qwen3-moe-tiny` on its YAML's 4 processes (each MoE layer's 8 experts split 4 + 4 over ep, FSDP2 over the other 2
ranks; one of its 4 layers dense), against the single-process run of the same global batch: the logged losses (the
router's aux loss over the global batch included), what each rank holds, the router load in the trackers, and the
saved model, which transformers' from_pretrained loads with the trained model's loss (so its logits).

The library-level exactness of every MoE layout (Mixtral, Llama 4, ep 4, tp x ep, LoRA) is checked in one gloo
launch (tests/integration/test_moe_parallel.py); this module adds what only the job does: the hand-over to the
rung's world, the Trainer's loss scaling and logging, the callbacks and the save.

Tolerances as tests/e2e/test_finetune_ladder.py: fp32, 4 steps, rel 1e-5 (reduction order only; the library
runs measure <= 1.4e-7 per step).
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_same_grad_norms, check_batch, finetune_all, tensorboard_series

pytestmark = pytest.mark.multiproc

LOSS_RTOL = 1e-5
MODEL = ("--model", "qwen3-moe-tiny")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """{"single" | "fsdp_ep": summary (+ "_dir")}, launched side by side."""
    root = tmp_path_factory.mktemp("moe_job")
    jobs = {"single": (root / "single", (*MODEL, "--report-to", "none"), {}),
            "fsdp_ep": (root / "fsdp_ep", (*MODEL, "--config", "fsdp_ep", "--ep", "2", "--report-to", "tensorboard"),
                        {})}
    summaries = finetune_all(jobs)
    for name, summary in summaries.items():
        summary["_dir"] = jobs[name][0]
    return summaries


def test_losses_equal_the_single_process(runs):
    """Each step's loss (cross-entropy + router_aux_loss_coef x the aux loss over the global batch) is the single
    process's."""
    ref, got = runs["single"]["losses"], runs["fsdp_ep"]["losses"]
    assert len(got) == len(ref) == 4
    assert got == pytest.approx(ref, rel=LOSS_RTOL), f"fsdp_ep {got} vs single {ref}"
    assert got[-1] < got[0]
    assert_same_grad_norms(runs["fsdp_ep"], runs["single"], what="fsdp_ep")


def test_the_layout_ran_and_each_rank_holds_a_quarter(runs):
    """dp_shard 4 with experts over ep 2: the summary records the degrees; every rank holds a quarter of the model's
    parameters (experts 4 of 8 per ep rank, halved again by FSDP2; the rest FSDP2 over 4), as the planner predicts."""
    from hfdist.config.ladder import load_rung
    from hfdist.models.presets import load_config
    from hfdist.plan import predict_state_bytes

    summary = runs["fsdp_ep"]
    assert (summary["strategy"]["dp_shard"], summary["strategy"]["ep"], summary["strategy"]["world_size"]) == (4, 2, 4)
    assert "fsdp_ep in effect" in summary["_stdout"]
    want = predict_state_bytes(load_config("qwen3-moe-tiny"), load_rung("fsdp_ep"), world=4, dtype="fp32")
    ranks = summary["ranks"]
    assert sum(r["param_bytes"] for r in ranks) / len(ranks) == pytest.approx(want.param_bytes, rel=0.02)
    single = runs["single"]["ranks"][0]["param_bytes"]
    assert all(r["param_bytes"] == pytest.approx(single / 4, rel=0.05) for r in ranks)


def test_router_load_reaches_the_trackers(runs):
    """Every step logs the router's load: per rank (its own tokens) and over the global batch (moe/...), the least
    and the most loaded expert, tokens per MoE layer per step; the global batch routes 8 x 64 tokens x top-2."""
    scalars = tensorboard_series(runs["fsdp_ep"]["_dir"] / "tensorboard")
    for key in ("moe/expert_tokens_min", "moe/expert_tokens_max", "moe/expert_load_imbalance",
                "rank0/expert_tokens_max", "rank3/expert_tokens_min", "expert_tokens_max/max"):
        assert key in scalars and len(scalars[key]) == 4, key
    for (_, low), (_, high) in zip(scalars["moe/expert_tokens_min"], scalars["moe/expert_tokens_max"]):
        assert 0 <= low <= 8 * 64 * 2 / 8 <= high <= 8 * 64 * 2


def test_saved_model_loads_in_transformers_with_the_trained_loss(runs):
    """The export is transformers' format (experts one by one) and from_pretrained's model scores the check batch as
    the trained, still distributed model did (its logits, to rel 1e-5)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    summary = runs["fsdp_ep"]
    with safe_open(str(summary["_dir"] / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys and "model.layers.3.mlp.gate_proj.weight" in keys
    model = AutoModelForCausalLM.from_pretrained(summary["_dir"]).eval()
    with torch.no_grad():
        loss = model(**check_batch(summary)).loss.item()
    assert loss == pytest.approx(summary["check_batch_loss"], rel=LOSS_RTOL)
    assert loss < summary["losses"][0]
