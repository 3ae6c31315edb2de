"""examples/sft_trl.py and examples/dpo_trl.py, run as a user runs them (torchrun), against their one-process runs;
examples/ray_train.py (the same SFT in a Ray Train loop, on a local Ray cluster it starts) too.

TRL's SFTTrainer on the mesh rungs (fsdp_tp, pp, fsdp_cp) gives the one-process losses (fp32: rel 1e-5) with
the strategy verified before step 1 and every rank's figures in log_history; TRL's DPOTrainer on fsdp_full_shard,
fsdp_tp and fsdp_cp gives its losses, rewards and accuracies (rel 1e-4), the reference model sharded like the policy; DPO on a pipeline rung is refused before any model is
built, in one paragraph naming the fix. One module fixture launches all of them side by side (3 steps each).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import REPO, run_cmd, side_by_side

pytestmark = pytest.mark.multiproc

STEPS = 3
# (example, config) -> processes; config "single" runs without a launcher. Two processes each: the mesh rungs' own
# axis alone (tp 2, pp 2, cp 2), which is what TRL's trainers meet through hfdist.api; the same API composed with
# data parallelism (dp x tp, dp x pp, dp_shard x cp on 4 processes, 3d on 8) trains through the job in
# tests/e2e/test_cells.py, and each rank here imports TRL (about 10 s of a core).
# Ray's first: its launch (a local cluster started, then its workers) takes the longest (40 s against 18-33 measured
# for the others, 2 at once), and the launches run LAUNCHES_AT_ONCE at a time in this order: started last, it ran
# its last 30 s alone.
LAUNCHES = {("ray", "fsdp_full_shard"): 2,
            ("sft", "single"): 1, ("sft", "fsdp_tp"): 2, ("sft", "pp"): 2, ("sft", "fsdp_cp"): 2,
            ("dpo", "single"): 1, ("dpo", "fsdp_full_shard"): 2, ("dpo", "fsdp_tp"): 2, ("dpo", "fsdp_cp"): 2,
            ("dpo", "pp"): 2}
SFT_RUNGS = ("fsdp_tp", "pp", "fsdp_cp")
DPO_RUNGS = ("fsdp_full_shard", "fsdp_tp", "fsdp_cp")
DPO_FIGURES = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")


def _datasets(root: Path) -> dict[str, Path]:
    """A messages JSONL (hfdist's embedded conversations) and a prompt / chosen / rejected JSONL made from their
    exchanges (the rejected answer is another question's)."""
    from hfdist.data import load_raw_dataset
    from hfdist.objectives.data import preference_pairs

    rows = load_raw_dataset(None).select(range(200))
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    lines = preference_pairs(rows, limit=96)  # the pairs `hfdist finetune --objective dpo` trains on by default
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in lines))
    return {"sft": root / "chats.jsonl", "dpo": root / "pairs.jsonl"}


def _launch(example: str, config: str, procs: int, data: Path, out: Path) -> tuple[int, dict | None, str, Path]:
    args = ["--config", config, "--model", "llama-tiny", "--dataset", str(data), "--max-steps", str(STEPS),
            "--output-dir", str(out), "--global-batch-size", "8"]
    launcher = [sys.executable] if procs == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node", str(procs)]
    env = None
    if example == "ray":  # Ray Train starts the workers; Ray's own files in a short folder (socket path limits)
        script, launcher, args = REPO / "examples" / "ray_train.py", [sys.executable], [*args, "--num-workers", str(procs)]
        env = {"RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp")}
    else:
        script, args = REPO / "examples" / f"{example}_trl.py", [*args, "--seed", "0"]
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # run_cmd copies the environment; 8 ranks on a few cores
    try:
        proc: subprocess.CompletedProcess = run_cmd([*launcher, str(script), *args], env=env)
    finally:
        os.environ.pop("OMP_NUM_THREADS") if old is None else os.environ.update(OMP_NUM_THREADS=old)
        if env is not None:
            shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    state = out / "trainer_state.json"
    return proc.returncode, json.loads(state.read_text()) if state.is_file() else None, proc.stdout + proc.stderr, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str], tuple[int, dict | None, str, Path]]:
    """{(example, config): (exit code, trainer_state.json or None, console, output folder)}."""
    root = tmp_path_factory.mktemp("examples")
    data = _datasets(root)
    return side_by_side({key: (lambda key=key, n=n: _launch(*key, n, data["dpo" if key[0] == "dpo" else "sft"],
                                                            root / "-".join(key)))
                         for key, n in LAUNCHES.items()})


def _steps(state: dict) -> list[dict]:
    return [h for h in state["log_history"] if "loss" in h]


def _trained(runs, key) -> dict:
    code, state, output, _ = runs[key]
    assert code == 0 and state is not None, f"{key} failed:\n{output[-6000:]}"
    return state


@pytest.mark.parametrize("rung", SFT_RUNGS)
def test_sft_gives_the_single_process_losses(runs, rung):
    single, mine = _steps(_trained(runs, ("sft", "single"))), _steps(_trained(runs, ("sft", rung)))
    assert [h["step"] for h in mine] == list(range(1, STEPS + 1))
    assert [h["loss"] for h in mine] == pytest.approx([h["loss"] for h in single], rel=1e-5)
    assert mine[-1]["loss"] < mine[0]["loss"]  # it trains


@pytest.mark.parametrize("rung", SFT_RUNGS + DPO_RUNGS)
def test_the_strategy_is_verified_before_step_1_and_every_rank_reports(runs, rung):
    example = "sft" if rung in SFT_RUNGS else "dpo"
    state, output = _trained(runs, (example, rung)), runs[example, rung][2]
    assert f"hfdist: {rung} in effect (" in output and "verified before step 1" in output
    ranks = LAUNCHES[example, rung]
    for h in _steps(state):
        assert all(h[f"rank{r}/tokens_per_second"] > 0 and h[f"rank{r}/peak_memory_bytes"] > 0 for r in range(ranks))
        assert f"rank{ranks}/tokens_per_second" not in h


def test_sft_keeps_trl_metrics_where_trls_loss_runs(runs):
    """fsdp_tp and fsdp_cp run TRL's own compute_loss on whole outputs: its token accuracy and token count are the
    one-process ones too (pipeline stages compute hfdist's staged loss, without TRL's metrics)."""
    single = _steps(_trained(runs, ("sft", "single")))
    for rung in ("fsdp_tp", "fsdp_cp"):
        mine = _steps(_trained(runs, ("sft", rung)))
        assert [h["mean_token_accuracy"] for h in mine] == pytest.approx([h["mean_token_accuracy"] for h in single],
                                                                        rel=1e-5)
        assert [h["num_tokens"] for h in mine] == [h["num_tokens"] for h in single]


@pytest.mark.parametrize("rung", DPO_RUNGS)
def test_dpo_gives_the_single_process_losses_rewards_and_accuracies(runs, rung):
    single, mine = _steps(_trained(runs, ("dpo", "single"))), _steps(_trained(runs, ("dpo", rung)))
    assert len(mine) == STEPS
    for figure in DPO_FIGURES:
        assert [h[figure] for h in mine] == pytest.approx([h[figure] for h in single], rel=1e-4, abs=1e-6), figure
    assert any(h["rewards/chosen"] != 0 for h in mine)  # the policy moved away from the reference


def test_sft_in_a_ray_train_loop_gives_the_single_process_losses(runs):
    """examples/ray_train.py: Ray's TorchTrainer made the 2 workers and their process group; resolve_strategy,
    prepare_model and strategy_trainer built fsdp_full_shard on it (verified before step 1)."""
    single, mine = _steps(_trained(runs, ("sft", "single"))), _steps(_trained(runs, ("ray", "fsdp_full_shard")))
    assert [h["step"] for h in mine] == list(range(1, STEPS + 1))
    assert [h["loss"] for h in mine] == pytest.approx([h["loss"] for h in single], rel=1e-5)  # as the other rungs
    assert "hfdist: fsdp_full_shard in effect (dp_shard=2" in runs["ray", "fsdp_full_shard"][2]
    assert all(h["rank1/tokens_per_second"] > 0 for h in mine)


def test_sft_on_tp_saves_a_model_that_scores_as_the_single_process_one(runs):
    """The streamed fp32 save of the tp-sharded model loads with from_pretrained and scores a batch as the
    one-process run's saved model does."""
    import torch
    from transformers import AutoModelForCausalLM

    from hfdist.api import load_tokenizer

    tokenizer = load_tokenizer("llama-tiny")
    batch = tokenizer(["What is the capital of Canada?\nThe capital of Canada is Ottawa."] * 2, return_tensors="pt")
    losses = []
    for rung in ("single", "fsdp_tp"):
        _trained(runs, ("sft", rung))
        model = AutoModelForCausalLM.from_pretrained(runs["sft", rung][3])
        with torch.no_grad():
            losses.append(float(model(**batch, labels=batch["input_ids"]).loss))
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


def test_dpo_on_a_pipeline_rung_is_refused_before_any_model_is_built(runs):
    code, state, output, _ = runs["dpo", "pp"]
    assert code != 0 and state is None
    assert "hfdist: error (rank 0): DPOTrainer trains with a loss of its own" in output
    assert "pipeline stages compute one loss only" in output and "fsdp_tp" in output  # the fix names the rungs
    assert "in effect" not in output  # refused before training: nothing was verified, nothing trained
