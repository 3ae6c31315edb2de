"""Context parallelism on 4 gloo ranks: one launch (cp_worker.py) trains, on packed rows of 512 tokens holding several
documents, against the single-process run:
- Ulysses on llama-tiny (4 heads): fsdp_cp (dp_shard=2 x cp=2), cp=4 with fewer kv heads than cp (GQA, eager
  attention), LoRA on dp_shard=2 x cp=2, cp=2 x tp=2, HSDP dp_replicate=2 x cp=2 (sdpa);
- on llama-tiny-6h (6 heads, 2 kv), which Ulysses alone cannot split at these degrees: ring cp=4 (recomputing
  each layer in backward), hybrid cp=4 (Ulysses 2 x ring 2) with LoRA, fsdp_tp_cp's tp=2 x cp=2 (3 heads per tp
  rank: ring), and pp=2 x cp=2 (ring);
comparing per step the loss and the global gradient norm before the optimizer step (hfdist.parallel.grad_norm), and
checks each document's logits under cp with the document run alone, and the whole outputs a Trainer's own loss
reads (hfdist.parallel.whole_outputs) under each plan's layout. Without a named attention the cases run
hfdist's document attention (the CPU default), whose batches carry the documents' boundaries and no mask. And cp=4
trains one packed row of 32,768 tokens (Ulysses) with no rank creating anything S x S, and one of 65,536 tokens by
ring with no rank creating a tensor longer than S / cp along any dimension; and one of 8,192 tokens by ring in bf16
(the dtype the GPU's flash kernel takes), against one process's bf16 within bf16's tolerance.

A planted fault shows what the gradient norms add: Adam's update is the same for g and c g, so fsdp_cp with every
rank's gradients halved after each backward (the wrong dp x cp average) keeps one process's losses, which alone would
pass it (measured: rel 7.6e-8 and 2.3e-7 at its 2 steps, against 7.6e-8 and 0 unhalved; Adam's epsilon is all that
tells g from g / 2), while its gradient norms are half the single process's (rel 0.5).

Tolerances (fp32): losses and gradient norms within a relative 1e-5 of one process, logits within 1e-5 absolute.
The exchanges move values without arithmetic; what differs is the order of sums: the ring's log-sum-exp merge of a
document's key blocks (a few terms per query, each a rounding of 6e-8 relative), TP's and FSDP2's reductions, over 3
AdamW steps whose updates (lr 3e-3, normalised by Adam) carry a gradient's relative rounding into the weights.
Observed: losses <= 1e-6 relative (tp_cp_ring's third step), logits <= 6e-7: the bounds sit >= 10 x above. Gradient
norms are compared at the first two steps: <= 1.4e-7 at the first (the same weights), <= 1.6e-6 at the second
(ring_cp4). Later, Adam's epsilon compounds the roundoff: an element whose gradient cancels to its rounding noise
(~1e-9) moves by lr x g / (|g| + 1e-8), which that noise changes by up to 2e-4 (ring_cp4: 12 of 492k elements after
step 1); the next gradient reads those weights, the loss (first-order in them) hardly: the third step's norms measured
1.7e-5 (ring_cp4) and 1.9e-5 (tp_cp_ring) off one process's, their losses <= 4e-7.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multiproc
RTOL, LOGIT_ATOL = 1e-5, 1e-5
BF16_RTOL = 2e-2  # bf16's tolerance against one process (8-bit significands): tests/e2e/test_bf16.py, test_cells.py
# case -> (the method its plan runs, its Ulysses degree)
CASES = {"fsdp_cp": ("ulysses", 2), "cp4_gqa_eager": ("ulysses", 4), "lora_fsdp_cp": ("ulysses", 2),
         "tp_cp": ("ulysses", 2), "hsdp_cp": ("ulysses", 2), "ring_cp4": ("ring", 1),
         "hybrid_cp4_lora": ("hybrid", 2), "tp_cp_ring": ("ring", 1), "pp_cp_ring": ("ring", 1)}
UNPIPELINED = [name for name in CASES if not name.startswith("pp_")]
PLANTED = "planted_fsdp_cp_grads_x0.5"  # fsdp_cp, every rank's gradients x 0.5 (cp_worker.py)
NORM_STEPS = 2  # the steps whose gradient norms are compared (module docstring: Adam's epsilon, after that)


@pytest.fixture(scope="module")
def cp_results(worker_results) -> dict:
    return worker_results["cp"]  # cp_worker.py on 4 ranks (tests/integration/conftest.py)


def _case(results: dict, name: str) -> dict:
    case = results[name]
    assert "error" not in case, f"{name}:\n{case['error']}"
    return case


def mismatches(case: dict) -> dict[str, list[int]]:
    """Where a case is not the single process's: {"losses" / "grad_norms": the steps that differ by more than RTOL}
    (every step's loss, the first NORM_STEPS steps' gradient norms; empty: the same math)."""
    found: dict[str, list[int]] = {}
    for key, steps in (("losses", None), ("grad_norms", NORM_STEPS)):
        run, reference = case["run"][key], case["reference"][key]
        assert len(run) == len(reference) >= NORM_STEPS
        differ = [i for i, (got, want) in enumerate(zip(run[:steps], reference[:steps]))
                  if abs(got - want) > RTOL * abs(want)]
        if differ:
            found[key] = differ
    return found


@pytest.mark.parametrize("name", CASES)
def test_losses_and_grad_norms_match_single_process(cp_results, name):
    """3 AdamW steps: the loss (ranks' partial sums over the global label count) and the global gradient norm before
    the first two equal one process's, under the method each case's plan asked for or auto chose (the attention in
    effect is that method's)."""
    case = _case(cp_results, name)
    method, ulysses = CASES[name]
    assert (case["method"], case["ulysses"], case["attn"]) == (method, ulysses, f"hfdist_{method}")
    assert mismatches(case) == {}, case
    assert case["run"]["losses"][-1] < case["run"]["losses"][0]


def test_a_planted_gradient_scale_is_caught_by_the_norms_alone(cp_results):
    """fsdp_cp with every rank's gradients x 0.5 after each backward: the comparison above fails on the gradient
    norms at both steps, and the first is half the single process's (its weights are one process's; x 0.5 is exact
    in binary); the losses stay one process's (Adam's update is the same for g and g / 2, up to its epsilon), so a
    loss-only comparison would have passed it (module docstring)."""
    case = _case(cp_results, PLANTED)
    assert mismatches(case) == {"grad_norms": [0, 1]}
    assert case["run"]["grad_norms"][0] == pytest.approx(0.5 * case["reference"]["grad_norms"][0], rel=RTOL)


@pytest.mark.parametrize("name", UNPIPELINED)
def test_documents_kept_apart(cp_results, name):
    """Every packed document's logits, gathered from the cp ranks' tokens, equal the document run alone."""
    assert _case(cp_results, name)["doc_logit_err"] < LOGIT_ATOL


@pytest.mark.parametrize("name", UNPIPELINED)
def test_whole_outputs_follow_the_plans_layout(cp_results, name):
    """A Trainer's own loss reads whole outputs (hfdist.parallel.whole_outputs): the rows cut by the plan's layout
    (contiguous under Ulysses, head-tail under a ring) and gathered back give the one-process logits."""
    assert _case(cp_results, name)["whole_logit_err"] < LOGIT_ATOL


def test_lora_trains_adapters_only(cp_results):
    full = _case(cp_results, "fsdp_cp")["trainable"]
    assert _case(cp_results, "lora_fsdp_cp")["trainable"] < full / 10
    assert _case(cp_results, "hybrid_cp4_lora")["trainable"] < _case(cp_results, "ring_cp4")["trainable"] / 10


@pytest.mark.parametrize("name", CASES)
def test_only_the_dense_choices_carry_a_mask(cp_results, name):
    assert _case(cp_results, name)["mask_in_batch"] == (name in ("cp4_gqa_eager", "hsdp_cp"))


def test_a_32k_packed_row_trains_under_cp_with_nothing_s_by_s(cp_results):
    """fsdp_cp's long-context case: one row of 32,768 tokens (chat-sized documents and a few of 4,000), cp=4:
    losses and gradient norms equal one process's, and the largest tensor any rank creates in its training steps is
    far below one S x S byte mask (1 GiB): the batch carries the documents' boundaries, each rank attends them for
    its heads."""
    case = _case(cp_results, "long_cp4")
    seq = case["seq"]
    assert seq == 32768 and case["documents"] > 40 and "attention_mask" not in case["batch_keys"]
    assert (case["method"], case["attn"]) == ("ulysses", "hfdist_ulysses")
    assert mismatches(case) == {}, case
    for largest, op, _, _ in case["largest"]:
        assert largest < seq * seq // 16, (largest, op)


def test_a_64k_packed_row_trains_by_ring_with_nothing_longer_than_s_over_cp(cp_results):
    """Ring cp=4 on one row of 65,536 tokens: losses and gradient norms equal one process's; every rank's largest
    tensor is at most S / cp tokens x the widest per-token activation (intermediate, hidden or vocabulary) x 4 bytes,
    and no floating-point tensor any rank creates (activations, keys, values, their gradients, the ring's blocks in
    flight) is longer than S / cp along any dimension: no rank ever holds O(S) keys and values, nothing S x S or
    (S / cp)^2."""
    case = _case(cp_results, "long_ring")
    seq, cp = case["seq"], 4
    assert seq == 65536 and case["documents"] > 80 and (case["method"], case["attn"]) == ("ring", "hfdist_ring")
    assert mismatches(case) == {}, case
    for largest, op, longest, longest_op in case["largest"]:
        assert largest <= seq // cp * case["width"] * 4, (largest, op)
        assert longest <= seq // cp, longest_op


def test_verify_checks_the_cp_layout(cp_results):
    """hfdist.parallel.verify passes every case above (FSDP2 over dp_shard x cp, the cp attention of one plan in
    every layer, over groups of its sizes) and refuses the fsdp_cp model once it attends without the cp exchange."""
    refused = _case(cp_results, "fsdp_cp")["refused_without_cp"]
    assert refused and "context parallelism (cp=2) is not in effect" in refused


def test_a_bf16_ring_step_at_8k_is_one_bf16_process(cp_results):
    """cp=4 by ring on a packed row of 8,192 tokens computing in bf16 (FSDP2's bf16 compute; the block kernel handed
    bf16 pieces): both steps' losses and gradient norms within bf16's tolerance of one process under CPU autocast to
    bf16. Measured: losses 3e-7 and 1.9e-5, gradient norms 3e-4 and 5.5e-3 relative."""
    case = _case(cp_results, "ring_bf16_8k")
    assert case["method"] == "ring" and case["seq"] == 8192 and case["kernel_dtypes"] == ["torch.bfloat16"]
    run, ref = case["run"], case["reference"]
    assert run["losses"] == pytest.approx(ref["losses"], rel=BF16_RTOL)
    assert run["grad_norms"] == pytest.approx(ref["grad_norms"], rel=BF16_RTOL)
    assert run["losses"][-1] < run["losses"][0]
