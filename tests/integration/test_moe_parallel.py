"""Mixture-of-experts training is the single process's on every layout hfdist runs it on: one 4-rank launch
(moe_worker.py) trains Qwen3-MoE, Mixtral (8 experts, top-2) and Llama 4's text model through hfdist's recipe on
ddp, fsdp_full_shard, fsdp_ep (ep 2 and 4, with activation checkpointing), fsdp_tp (tp 2 x ep 2) and with LoRA,
two AdamW steps each, against one process holding the whole global batch: the cross-entropy, the router's aux loss
over the global batch (with its coefficient raised to 1 on one case, so its gradient shows), the tokens routed to
each expert, the global gradient norm before each optimizer step, and the experts each rank holds.

Why the gradient norm: Adam's update is the same for g and c g (c > 0), so a wrong factor on some gradients leaves
the losses the single process's. A planted case shows it: Qwen3-MoE on fsdp_ep (ep 2) with rank 0's expert gradients
doubled after every backward (a quarter of the experts' elements) keeps the losses and counts (measured: CE rel
<= 5.3e-8, as the clean cases) while the norm moves by rel 4.3e-4 and 2.4e-4 (the experts hold ~1e-3 of the squared
norm: the embedding and output layer dominate it), 24x above its tolerance.

Tolerances. The cross-entropy sums ~250 fp32 token losses and its gradients reach every weight through sums over the
batch whose order the layout changes (all-to-all'd rows, FSDP2's reduce-scatter, tp's partial sums): fp32 unit
roundoff 6e-8 times sqrt(terms) puts single-step differences near 1e-6 and measured ones are <= 1.4e-7; 1e-5 (the
issue's bound) is 70x above. The aux loss is E * sum_e f_e P_e with P_e a sum of 768 (rows x MoE
layers) fp32 probabilities, added in another order across ranks: typical error sqrt(768) x 6e-8 ~ 2e-6 (measured:
equal to the last bit); 1e-5. Router counts are integers and compared exactly: a flip needs two experts' logits
within fp32 rounding (~1e-7) of each other at a top-k boundary, which these random weights do not have. The
gradient norm adds every gradient's squares in another order and, at the second step, the first update's roundoff:
measured <= 4.7e-7 relative; 1e-5.
"""

from __future__ import annotations

import pytest

RTOL = 1e-5  # the losses' and the gradient norm's (module docstring)
CASES = ["qwen3_moe/ddp", "qwen3_moe/fsdp", "qwen3_moe/ep2", "qwen3_moe/ep4", "qwen3_moe/tp2_ep2_aux1",
         "qwen3_moe/ep2_lora", "qwen3_moe/ep4_ac", "mixtral/ep2", "mixtral/ep4", "mixtral/tp2_ep2", "llama4/ep2",
         "llama4/tp2_ep2_lora"]


@pytest.fixture(scope="module")
def moe_results(worker_results) -> dict:
    return worker_results["moe"]  # moe_worker.py on 4 ranks (tests/integration/conftest.py)


def _ok(results: dict, case: str) -> dict:
    run = results[case]
    assert "error" not in run, f"{case}: {run['error']}"
    return run


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a)


def mismatches(run: dict) -> dict[str, list[int]]:
    """Where a run is not the single process's: {quantity: the steps where it differs}, for the cross-entropy, the aux
    loss and the gradient norm beyond RTOL and the tokens per expert at all (empty: the same math)."""
    assert len(run["steps"]) == len(run["reference"]) == 2
    found: dict[str, list[int]] = {}
    for step, (got, want) in enumerate(zip(run["steps"], run["reference"])):
        for key in ("ce", "aux", "grad_norm"):
            if _rel(got[key], want[key]) > RTOL:
                found.setdefault(key, []).append(step)
        if got["counts"] != want["counts"]:
            found.setdefault("counts", []).append(step)
    return found


@pytest.mark.multiproc
@pytest.mark.parametrize("case", CASES)
def test_losses_routing_and_grad_norms_equal_one_process(moe_results, case):
    """Every step's cross-entropy, aux loss and gradient norm (rel 1e-5, module docstring) and the tokens routed to
    each expert (exactly) are the single process's over the same global batch."""
    run = _ok(moe_results, case)
    assert mismatches(run) == {}, list(zip(run["steps"], run["reference"]))
    assert all(sum(step["counts"]) > 0 and step["grad_norm"] > 0.0 for step in run["reference"])
    if case.startswith("llama4"):  # Llama 4's causal LM adds no aux loss
        assert all(step["aux"] == 0.0 for step in run["reference"])
    else:
        assert all(step["aux"] > 0.0 for step in run["reference"])
    losses = [step["ce"] for step in run["reference"]]
    assert losses[0] != losses[-1]  # the steps train (a frozen model would pass trivially)


@pytest.mark.multiproc
@pytest.mark.parametrize("case", [c for c in CASES if "ep" in c.split("/")[1]])
def test_each_rank_holds_its_experts(moe_results, case):
    """Every rank holds exactly E / ep whole experts of each MoE layer (gathered over FSDP2's expert mesh), and they
    are its ep rank's slice of the reference's stacked experts."""
    run = _ok(moe_results, case)
    assert run["experts"]["held"] == [run["num_experts"] // run["ep"]]
    assert run["experts"]["max_abs_diff"] == 0.0
    assert f"ep={run['ep']}" in run["layout"]


@pytest.mark.multiproc
def test_planted_expert_gradient_factor_is_caught(moe_results):
    """Rank 0's expert gradients x 2 (fsdp_ep, ep 2): the comparison above fails on the gradient norm at every step,
    and on nothing else: the losses alone would have passed it (module docstring)."""
    run = _ok(moe_results, "planted/qwen3_moe/ep2_rank0_experts_x2")
    assert mismatches(run) == {"grad_norm": [0, 1]}
    assert all(got["grad_norm"] > want["grad_norm"] for got, want in zip(run["steps"], run["reference"]))


@pytest.mark.multiproc
def test_aux_loss_gradient_shows(moe_results):
    """With the aux coefficient at 1 the aux loss moves between steps (its gradient trains the routers), and still
    equals the single process's at every step (test above): its gradient is right under tp x ep."""
    run = _ok(moe_results, "qwen3_moe/tp2_ep2_aux1")
    auxes = [step["aux"] for step in run["reference"]]
    assert auxes[0] > 1.0 and auxes[0] != auxes[1]
