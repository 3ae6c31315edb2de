"""End-to-end: context parallelism through scripts/finetune.py as a user launches it, on packed blocks of 512 tokens
(several documents each), against the single-process run: fsdp_cp (dp_shard=2 x cp=2, 4 processes; auto plans
Ulysses) and cp on pipeline stages (the pp rung with --cp 2 --cp-method ring, 4 processes); and bad cp settings
refused before any process starts. Every cp rung with each method, LoRA, QLoRA, bf16 and each architecture trains
against one process in tests/e2e/test_cells.py; this module adds what only a launch of its own shows.

What must hold: losses, the post-training batch loss and the eval loss on held-out data equal one process's (fp32,
rel 1e-5), and the eval loss a one-process evaluation of the saved model's; the summary records cp, the method and
why; each token is counted once across the cp group (tokens summed over ranks = the single run's); the saved model
reloads.
"""

from __future__ import annotations

import sys

import pytest
import yaml

from helpers import REPO, assert_same_grad_norms, eval_args, evaluate_saved, finetune_all, run_cmd

LOSS_RTOL = 1e-5
CP_ARGS = ["--seq-len", "512", "--global-batch-size", "4", "--max-steps", "3", "--no-wandb"]
HFDIST = [sys.executable, "-m", "hfdist.cli"]


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory, shared_runs):
    root = tmp_path_factory.mktemp("cp_job")
    jobs = {"single": (), "fsdp_cp": ("--config", "fsdp_cp"),
            # cp on pipeline stages (the Trainer's batch cut before stage 0, the schedule's loss and scoring)
            "pp_cp": ("--config", "pp", "--num-processes", "4", "--cp", "2", "--cp-method", "ring")}
    held_out = eval_args(shared_runs.root)  # the other rungs' held-out conversations, evaluated at step 2 and 3
    runs = finetune_all({name: (root / name, (*CP_ARGS, *extra, *held_out), {})
                         for name, extra in jobs.items()})
    for name, summary in runs.items():
        summary["_dir"] = root / name
    return runs


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["fsdp_cp", "pp_cp"])
def test_cp_losses_match_single_process(cp_runs, name):
    ref = cp_runs["single"]
    got = cp_runs[name]
    assert got["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL)
    assert_same_grad_norms(got, ref, what=name)
    assert got["check_batch_loss"] == pytest.approx(ref["check_batch_loss"], rel=LOSS_RTOL)
    assert got["losses"][-1] < got["losses"][0]
    assert got["eval"]["steps"] == ref["eval"]["steps"] == [2, 3] and got["eval"]["tokens"] == ref["eval"]["tokens"]
    assert got["eval"]["losses"] == pytest.approx(ref["eval"]["losses"], rel=LOSS_RTOL)


@pytest.mark.multiproc
def test_cp_eval_loss_equals_a_one_process_evaluation_of_the_saved_model(cp_runs):
    summary = cp_runs["fsdp_cp"]
    assert evaluate_saved(summary) == pytest.approx(summary["eval"]["loss"], rel=LOSS_RTOL)


@pytest.mark.multiproc
@pytest.mark.parametrize("name, degrees, method", [("fsdp_cp", (2, 2, 1, 1), "ulysses"), ("pp_cp", (1, 2, 1, 2), "ring")])
def test_cp_recorded_with_its_method_and_tokens_counted_once(cp_runs, name, degrees, method):
    """The summary records the degrees, the method and why (auto's reasoning, or that it was asked for)."""
    s = cp_runs[name]["strategy"]
    assert (s["dp_shard"], s["cp"], s["tp"], s["pp"], s["world_size"]) == (*degrees, 4)
    assert s["cp_method"] == method and s["cp_method_reason"].startswith("auto:" if name == "fsdp_cp" else "asked")
    ranks = cp_runs[name]["ranks"]
    assert sum(r["tokens"] for r in ranks) == cp_runs["single"]["ranks"][0]["tokens"] * s["tp"] * s["pp"]


@pytest.mark.multiproc
def test_cp_saved_model_reloads(cp_runs):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(cp_runs["single"]["_dir"])
    got = AutoModelForCausalLM.from_pretrained(cp_runs["fsdp_cp"]["_dir"])
    for (name, a), (_, b) in zip(got.named_parameters(), ref.named_parameters()):
        assert (a - b).abs().max() < 1e-4, name  # 3 AdamW steps: see tests/integration/test_tensor_parallel.py


def _yaml(tmp_path, cp: int, processes: int, **extra) -> str:
    cfg = yaml.safe_load((REPO / "accelerate_configs" / "fsdp_cp.yaml").read_text())
    cfg["num_processes"] = processes
    cfg["parallelism_config"].update(parallelism_config_cp_size=cp, parallelism_config_dp_shard_size=1, **extra)
    path = tmp_path / "cp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.parametrize("case, said", [
    ("seq", "--seq-len must be a multiple of 2, and 511 is not"),
    ("heads", "4 attention heads do not divide by cp=3. Use --cp-method ring"),
    ("mask", "--attn-implementation sdpa does not give the batch"),
])
def test_bad_cp_is_refused_before_any_process(tmp_path, case, said):
    """A sequence the method cannot cut, a method that cannot split the model (llama-tiny's 4 heads, Ulysses over
    3 ranks), a ring without the batch's document boundaries: one paragraph naming what would work, exit 2."""
    if case == "seq":
        args = ["--config", "fsdp_cp", "--seq-len", "511"]
    elif case == "heads":
        args = ["--config", _yaml(tmp_path, 3, 3), "--cp-method", "ulysses"]
    else:
        args = ["--config", "fsdp_tp_cp", "--cp-method", "ring", "--attn-implementation", "sdpa"]
    proc = run_cmd([*HFDIST, "finetune", "--model", "llama-tiny", "--seq-len", "64", *args,
                    "--output-dir", str(tmp_path / "o")], timeout=300)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "starting" not in proc.stdout  # no process was started
    assert not (tmp_path / "o").exists()
