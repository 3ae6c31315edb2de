"""The fsdp_ep rung end to end, as a user launches it: `scripts/finetune.py --config fsdp_ep --ep 2 --model
qwen3-moe-tiny` on its YAML's 4 processes (each MoE layer's 8 experts split 4 + 4 over ep, FSDP2 over the other 2
ranks; one of its 4 layers dense): what each rank holds, the router load in the trackers, and the saved model, which
transformers' from_pretrained loads with the trained model's loss (so its logits).

The same layout's losses (the router's aux loss over the global batch included), gradient norms and eval loss against
the single-process run of the same global batch, through the job's own path at the same tolerances (fp32: rel 1e-5;
the later steps' gradient norms 5e-5), are the cell `fsdp_ep/plain/qwen3-moe-tiny` of tests/e2e/test_cells.py (its
`fsdp_ep/ep/...` and `fsdp_ep/moe/...` cells: ep 4, Mixtral, Llama 4), so this module launches no single-process run of
its own. The library-level exactness of every MoE layout (cross-entropy and aux loss apart, tokens per expert, the
experts each rank holds) is checked in one gloo launch (tests/integration/test_moe_parallel.py); this module adds what
only a launch of the job shows: the hand-over to the rung's world, the callbacks, the trackers and the save.
"""

from __future__ import annotations

import pytest
import torch

from helpers import check_batch, finetune, tensorboard_series

pytestmark = pytest.mark.multiproc

LOSS_RTOL = 1e-5  # the saved model's check-batch loss against the trained one's (as tests/e2e/test_finetune_ladder.py)
MODEL = ("--model", "qwen3-moe-tiny")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """{"fsdp_ep": summary (+ "_dir")}."""
    out = tmp_path_factory.mktemp("moe_job") / "fsdp_ep"
    summary = finetune(out, *MODEL, "--config", "fsdp_ep", "--ep", "2", "--report-to", "tensorboard")
    summary["_dir"] = out
    return {"fsdp_ep": summary}


def test_it_trains(runs):
    """Every step logged (the losses against one process: the cell fsdp_ep/plain/qwen3-moe-tiny), the loss falling."""
    got, norms = runs["fsdp_ep"]["losses"], runs["fsdp_ep"]["grad_norms"]
    assert len(got) == len(norms) == 4 and got[-1] < got[0], got
    assert all(n is not None and n > 0 for n in norms), norms


def test_the_layout_ran_and_each_rank_holds_a_quarter(runs):
    """dp_shard 4 with experts over ep 2: the summary records the degrees; every rank holds a quarter of the model's
    parameters (experts 4 of 8 per ep rank, halved again by FSDP2; the rest FSDP2 over 4), as the planner predicts."""
    from hfdist.config.ladder import load_rung
    from hfdist.models.build import meta_model
    from hfdist.models.presets import load_config
    from hfdist.plan import predict_state_bytes

    summary = runs["fsdp_ep"]
    assert (summary["strategy"]["dp_shard"], summary["strategy"]["ep"], summary["strategy"]["world_size"]) == (4, 2, 4)
    assert "fsdp_ep in effect" in summary["_stdout"]
    want = predict_state_bytes(load_config("qwen3-moe-tiny"), load_rung("fsdp_ep"), world=4, dtype="fp32")
    ranks = summary["ranks"]
    assert sum(r["param_bytes"] for r in ranks) / len(ranks) == pytest.approx(want.param_bytes, rel=0.02)
    # The whole model's fp32 bytes: what one process holds (its summary's param_bytes, measured equal).
    whole = 4 * sum(p.numel() for p in meta_model("qwen3-moe-tiny").parameters())
    assert all(r["param_bytes"] == pytest.approx(whole / 4, rel=0.05) for r in ranks)


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
