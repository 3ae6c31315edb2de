"""End-to-end evaluation on the shared runs (helpers.SHARED_RUNS, each evaluated on the same held-out conversations at
steps 2 and 4: helpers.eval_args): the eval loss is the same on every rung, equals a one-process evaluation of the
saved model, and reaches the summary, the trackers and the progress line. (fsdp_cp: test_context_parallel_job.py.)
"""

from __future__ import annotations

import math

import pytest

from helpers import evaluate_saved, finished_offline_run, mlflow_series, tensorboard_series

pytestmark = pytest.mark.multiproc

# fp32: the ranks add their token-loss sums in another order than one process does (observed ~1e-7).
EVAL_RTOL = 1e-5
RUNGS = ["ddp", "fsdp_full_shard", "zero3", "fsdp_tp", "pp", "3d"]


@pytest.fixture(scope="module")
def runs(shared_runs):
    names = ["single", "lora_single", "lora_fsdp_full_shard", "fsdp_hybrid", *RUNGS]
    shared_runs.launch(names)
    return {name: shared_runs[name] for name in names}


@pytest.mark.parametrize("name", RUNGS + ["lora_fsdp_full_shard"])
def test_eval_loss_equals_the_single_process_runs_at_the_same_steps(runs, name):
    ref = runs["lora_single" if name.startswith("lora") else "single"]["eval"]
    got = runs[name]["eval"]
    assert got["steps"] == ref["steps"] == [2, 4]
    assert got["losses"] == pytest.approx(ref["losses"], rel=EVAL_RTOL)
    assert got["tokens"] == ref["tokens"] > 0  # every held-out token once, on any layout
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]), rel=1e-12)
    assert got["losses"][-1] < got["losses"][0]  # it trained: the held-out loss fell


@pytest.mark.parametrize("name", ["single", "fsdp_tp", "pp", "3d"])
def test_eval_loss_equals_a_one_process_evaluation_of_the_saved_model(runs, name):
    summary = runs[name]
    assert evaluate_saved(summary) == pytest.approx(summary["eval"]["loss"], rel=EVAL_RTOL)


def test_lora_eval_loss_equals_the_saved_adapter_evaluated_in_one_process(runs):
    from peft import PeftModel

    from hfdist.models.build import build_model

    summary = runs["lora_fsdp_full_shard"]
    base = build_model("llama-tiny", vocab_size=1024, seed=summary["config"]["seed"])
    model = PeftModel.from_pretrained(base, summary["_dir"])
    assert evaluate_saved(summary, model) == pytest.approx(summary["eval"]["loss"], rel=EVAL_RTOL)


def test_eval_reaches_every_tracker_and_the_progress_line(runs):
    """fsdp_hybrid reports to W&B, MLflow and TensorBoard: each holds the eval loss at steps 2 and 4, once."""
    from hfdist.report.wandb_offline import find_offline_runs

    summary = runs["fsdp_hybrid"]
    want = list(zip(summary["eval"]["steps"], summary["eval"]["losses"]))
    (_, series), = mlflow_series((summary["_dir"] / "mlruns").as_uri())
    scalars = tensorboard_series(summary["_dir"] / "tensorboard")
    for got in (series["eval_loss"], scalars["eval_loss"], scalars["eval_perplexity"]):
        assert [s for s, _ in got] == [2, 4]
    assert series["eval_loss"] == pytest.approx(want, rel=1e-7)
    (run_file,) = find_offline_runs(summary["_dir"])
    history = [row for row in finished_offline_run(run_file).history if "eval_loss" in row]
    assert [row["eval_loss"] for row in history] == pytest.approx(summary["eval"]["losses"], rel=1e-7)
    assert f"eval={summary['eval']['losses'][0]:.4f}" in summary["_stderr"]  # the bar's postfix
    assert f"hfdist: eval loss {summary['eval']['loss']:.4f}" in summary["_stdout"]
