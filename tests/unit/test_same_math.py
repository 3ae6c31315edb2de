"""The same-math comparison `hfdist compare`'s matrix and `hfdist tune` make (hfdist.report.same_math): losses and
gradient norms, so a gradient off by a constant factor, which Adam hides from the losses, is caught."""

from __future__ import annotations

import json
import math

from hfdist.report.same_math import largest_difference, numerics, same_math

LOSSES = [6.95, 6.84, 6.66]
NORMS = [2.44, 1.97, 1.59]


def test_equal_runs_agree_and_a_scaled_gradient_does_not():
    run = {"losses": LOSSES, "grad_norms": NORMS}
    rounded = {"losses": [x * (1 + 3e-7) for x in LOSSES], "grad_norms": [x * (1 - 2e-7) for x in NORMS]}
    assert same_math(run, rounded, "fp32")
    doubled = {"losses": LOSSES, "grad_norms": [2 * x for x in NORMS]}  # the same losses: Adam divides the 2 out
    assert not same_math(run, doubled, "fp32") and largest_difference(run, doubled) == 0.5
    assert same_math(run, {"losses": [x * 1.01 for x in LOSSES], "grad_norms": NORMS}, "bf16")


def test_missing_steps_and_non_finite_values_never_agree_and_older_summaries_compare_losses():
    run = {"losses": LOSSES, "grad_norms": NORMS}
    assert largest_difference(run, {"losses": LOSSES[:2], "grad_norms": NORMS[:2]}) == math.inf
    assert largest_difference(run, {"losses": LOSSES[:2], "grad_norms": NORMS[:2]}, steps=2) == 0.0
    assert largest_difference({"losses": [float("nan")]}, {"losses": [6.9]}) == math.inf
    assert largest_difference({"losses": [float("nan")]}, {"losses": [float("nan")]}) == math.inf
    assert largest_difference(run, {"losses": LOSSES}) == 0.0  # a summary without norms: its losses alone
    assert largest_difference(run, {"losses": LOSSES, "grad_norms": [None, 2 * NORMS[1], NORMS[2]]}) == 0.5


def test_numerics_reads_the_strategy():
    assert numerics({"mixed_precision": "no", "fp8": None}) == "fp32"
    assert numerics({"mixed_precision": "bf16", "fp8": None}) == "bf16"
    assert numerics({"mixed_precision": "bf16", "fp8": "rowwise"}) == "fp8-rowwise"


def _summary(name: str, norms: list[float]) -> dict:
    strategy = {"name": name, "world_size": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1, "zero_stage": None,
                "lora": False, "qlora": False, "micro_batch": 4, "global_batch": 8, "seq_len": 64,
                "mixed_precision": "no", "fp8": None}
    rank = {"tokens_per_second": 100.0, "tflops_per_device": 0.01, "mfu": 0.01, "peak_memory_bytes": 10**8,
            "param_bytes": 10**6, "grad_bytes": 10**6, "optimizer_bytes": 2 * 10**6, "master_bytes": 0}
    return {"strategy": strategy, "config": {"model": "llama-tiny"}, "ranks": [rank, rank], "losses": LOSSES,
            "grad_norms": norms, "eval": None}


def test_the_matrix_marks_each_run_against_the_simplest_rung(tmp_path):
    from hfdist.report.matrix import load_rows

    paths = []
    for name, norms in (("fsdp_tp", NORMS), ("ddp", NORMS), ("zero3", [2 * x for x in NORMS])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(_summary(name, norms)))
        paths.append(path)
    rows = {r["strategy"]: r for r in load_rows(paths)}
    assert rows["ddp"]["same_math"] == "reference"  # the lowest plan order of the three
    assert rows["fsdp_tp"]["same_math"] == "yes" and rows["fsdp_tp"]["final_grad_norm"] == NORMS[-1]
    assert rows["zero3"]["same_math"].startswith("NO (5.0e-01 vs ddp)")


def test_later_gradient_norms_get_adams_rounding_room_and_no_more():
    """After the first step an fp32 gradient norm may differ by AdamW's rounding of near-zero entries (5e-5), the
    first step's and every loss by reduction order only (1e-5); a planted factor is far outside both."""
    run = {"losses": LOSSES, "grad_norms": NORMS}
    later = {"losses": LOSSES, "grad_norms": [NORMS[0], NORMS[1] * (1 + 3e-5), NORMS[2]]}
    assert same_math(run, later, "fp32")
    first = {"losses": LOSSES, "grad_norms": [NORMS[0] * (1 + 3e-5), *NORMS[1:]]}
    assert not same_math(run, first, "fp32")
    assert not same_math(run, {"losses": [LOSSES[0], LOSSES[1] * (1 + 3e-5), LOSSES[2]], "grad_norms": NORMS}, "fp32")
    assert not same_math(run, {"losses": LOSSES, "grad_norms": [NORMS[0], NORMS[1] * (1 + 2e-4), NORMS[2]]}, "fp32")


def test_an_objectives_rows_are_named_and_noted_with_its_figures(tmp_path):
    """`hfdist compare --objective grpo`: each row's strategy says the objective, and the matrix's note gives each
    run's reward and rollout rate over its last quarter of steps."""
    from hfdist.report.matrix import load_rows, objective_note

    paths = []
    for name, reward in (("ddp", 0.5), ("zero3", 0.25)):
        summary = _summary(name, NORMS)
        summary["objective"] = {"name": "grpo", "series": {"reward": [0.0, 0.0, 0.0, reward],
                                                           "rollout_seconds": [1.0] * 4,
                                                           "rollout_tokens_per_s": [100.0] * 4}}
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(summary))
    rows = load_rows(paths)
    assert [r["strategy"] for r in rows] == ["ddp+grpo", "zero3+grpo"]
    note = objective_note("grpo", rows, paths)
    assert "ddp+grpo: reward 0.500, rollout 1.00 s at 100 completion tokens/s" in note
    assert "zero3+grpo: reward 0.250" in note
