"""A user's own scripts with DistributedMetricsCallback: docs/library.md's plain-Trainer and TRL SFTTrainer examples,
run exactly as written there, on 2 gloo processes under torchrun, reporting to W&B offline.

What must hold: rank 0's `log_history` (trainer_state.json) holds every rank's figures and their min/max/mean in each
training log; the Trainer's one W&B run holds the same values; tokens are the real ones (TRL counts them too); the
console shows one closing table and no printed log dicts.
"""

from __future__ import annotations

import json
import os
import re
import sys
from functools import partial

import pytest

from helpers import REPO, finished_offline_run, run_tree, side_by_side

pytestmark = pytest.mark.multiproc

SCRIPTS = ("train_with_metrics.py", "sft_with_metrics.py")
RANKS, STEPS = 2, 4
FIGURES = ("tokens", "tokens_per_second", "samples_per_second", "step_seconds", "tflops_per_device", "mfu",
           "peak_memory_bytes", "param_bytes", "grad_bytes", "optimizer_bytes")


def docs_script(name: str) -> str:
    """docs/library.md's python block that opens with `# NAME:`."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "library.md").read_text(), re.S)
    (code,) = [b for b in blocks if b.startswith(f"# {name}:")]
    return code


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    """A local llama-tiny with its tokenizer (what `from_pretrained(MODEL)` loads) and a JSONL of 64 texts (the
    embedded conversations' turns joined)."""
    from hfdist.data.load import load_raw_dataset, load_tokenizer
    from hfdist.models.build import build_model

    root = tmp_path_factory.mktemp("user_model")
    tokenizer = load_tokenizer(None, is_preset=True)
    model = build_model("llama-tiny", vocab_size=len(tokenizer), seed=0)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    raw = load_raw_dataset(None).select(range(64))
    lines = (json.dumps({"text": "\n".join(turn["content"] for turn in r["messages"])}) for r in raw)
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    return root / "model", root / "data.jsonl"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_and_data):
    """Each docs script once, the two side by side (helpers.side_by_side: their own folders, W&B directories and
    torchrun ports): {script: (output_dir, W&B dir, trainer_state, console)}."""
    model, data = model_and_data
    works = {name: tmp_path_factory.mktemp(name.removesuffix(".py")) for name in SCRIPTS}
    return side_by_side({name: partial(_run_script, name, work, model, data) for name, work in works.items()})


def _run_script(name: str, work, model, data) -> tuple:
    """`torchrun --nproc-per-node RANKS NAME MODEL DATA OUT` in `work`, as docs/library.md says to run it."""
    (work / name).write_text(docs_script(name))
    # No W&B setting from this process: in particular not WANDB_SERVICE, which an earlier in-process W&B run
    # leaves behind and which would attach the scripts' runs to this process's W&B service.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "ACCELERATE_USE_CPU"}
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_DIR": str(work / "wandb_root"),
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    (work / "wandb_root").mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS), name,
           str(model), str(data), str(work / "out")]
    proc = run_tree(cmd, 600, cwd=work, env=env)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    state = json.loads((work / "out" / "trainer_state.json").read_text())
    return work / "out", work / "wandb_root", state, proc.stdout + proc.stderr


def _train_logs(state: dict) -> list[dict]:
    return [h for h in state["log_history"] if "loss" in h]


@pytest.mark.parametrize("name", SCRIPTS)
def test_rank0_log_history_holds_every_rank(runs, name):
    logs = _train_logs(runs[name][2])
    assert [h["step"] for h in logs] == list(range(1, STEPS + 1))
    for h in logs:
        for figure in FIGURES:
            values = [h[f"rank{r}/{figure}"] for r in range(RANKS)]
            assert (h[f"{figure}/min"], h[f"{figure}/max"]) == (min(values), max(values)), figure
            assert h[f"{figure}/mean"] == pytest.approx(sum(values) / RANKS), figure
        assert h["tokens/sum"] == sum(h[f"rank{r}/tokens"] for r in range(RANKS))
        assert all(h[f"rank{r}/tokens_per_second"] > 0 and h[f"rank{r}/peak_memory_bytes"] > 0 for r in range(RANKS))
        assert h["slowest_rank"] == min(range(RANKS), key=lambda r: h[f"rank{r}/tokens_per_second"])
        # Data-parallel: every rank holds the whole model, and its tokens are at most 4 rows of <= 128 tokens.
        assert h["rank0/param_bytes"] == h["rank1/param_bytes"] > 0
        assert all(0 < h[f"rank{r}/tokens"] <= 4 * 128 for r in range(RANKS))


def test_sft_tokens_are_the_ones_trl_counts(runs):
    """TRL logs the cumulative count of real tokens over all ranks (`num_tokens`); each window's tokens summed over
    the ranks must be its increment."""
    logs = _train_logs(runs["sft_with_metrics.py"][2])
    seen = [0] + [h["num_tokens"] for h in logs]
    assert [h["tokens/sum"] for h in logs] == [b - a for a, b in zip(seen, seen[1:])]
    assert all("mean_token_accuracy" in h for h in logs)  # SFTTrainer.log's own metrics, next to ours


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_trainers_one_wandb_run_holds_the_same_figures(runs, name):
    from hfdist.report.wandb_offline import find_offline_runs

    _, wandb_root, state, _ = runs[name]
    (run_file,) = find_offline_runs(wandb_root)  # one run: the Trainer's own
    run = finished_offline_run(run_file)
    rows = {row["train/global_step"]: row for row in run.history if "train/loss" in row}
    for h in _train_logs(state):
        row = rows[h["step"]]
        for figure in FIGURES:
            for key in [f"rank{r}/{figure}" for r in range(RANKS)] + [f"{figure}/min", f"{figure}/max"]:
                assert row[f"train/{key}"] == pytest.approx(h[key], rel=1e-12), key
        assert row["train/slowest_rank"] == h["slowest_rank"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_console_shows_one_table_and_no_log_dicts(runs, name):
    out_dir, _, _, console = runs[name]
    assert console.count("hfdist: per-rank figures over 4 steps") == 1
    table = console[console.index("hfdist: per-rank figures"):]
    assert re.search(r"^\s+0\s+\d", table, re.M) and re.search(r"^\s+1\s+\d", table, re.M)
    assert "<- slowest" in table and f"outputs: {out_dir}" in table
    assert "{'loss'" not in console and "'rank0/" not in console
