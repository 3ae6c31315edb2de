"""End-to-end: every shipped rung through scripts/finetune.py on CPU/gloo, against the single-process run.

Each run trains llama-tiny for 4 steps on the same global batch (8 sequences) and seed, attending with the CPU
default, hfdist's document attention (packed documents kept apart by their boundaries). What must hold:
- losses equal the single-process losses within LOSS_RTOL (fp32; only the order of reductions differs), and so do
  the gradient norms (helpers.assert_same_grad_norms);
- per-rank bytes show the sharding the rung promises;
- the saved model (or LoRA adapter) loads in a fresh process and reproduces the trained model's loss on a batch.
"""

from __future__ import annotations

import pytest
import torch

from hfdist.config.ladder import load_rung

from helpers import (
    REPO,
    SHARED_RUNS,
    assert_same_grad_norms,
    check_batch,
    eval_args,
    finished_offline_run,
    mlflow_series,
    table_rungs,
    tensorboard_series,
)

pytestmark = pytest.mark.multiproc

# fp32 on CPU: sums over ranks/buckets happen in another order than in one process; 1e-5 relative covers that
# (observed differences are ~1e-7) and no real bug (a wrong normaliser, a lost shard) stays under it.
LOSS_RTOL = 1e-5
# The rung table's ladder rungs (pipeline and context-parallel rungs have their own modules), each on its YAML's
# process count; with LoRA, the session's shared run (helpers.SHARED_RUNS). LoRA on every rung that takes it trains in
# tests/e2e/test_lora_checkpoints.py (adapters, checkpoints, resume, planner) and tests/e2e/test_cells.py (same math).
FULL = table_rungs("ladder")
LORA = ["fsdp_full_shard"]
# Every rung holding 1/dp_shard of params, grads and optimizer state: ZeRO-3 and FSDP2 without tp.
FULL_SHARDING = [n for n in FULL if (r := load_rung(n)).zero_stage == 3 or (r.uses_fsdp and not r.uses_tp)]
# Half the rungs go through hfdist's hand-over (`python scripts/finetune.py --config`, or the README's `accelerate
# launch scripts/finetune.py --config` for the shared runs helpers.SHARED_RUNS marks), half through `accelerate launch
# --config_file`, so every entry path is exercised on every kind of strategy.
VIA_CONFIG_FILE = {"fsdp_hybrid", "zero1", "zero2_tp", "zero3_offload_cpu"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, references, shared_runs):
    """All runs once: {name: summary}; "single" and "lora_single" are the references. Rungs other modules also read
    come from the session's shared runs (helpers.SHARED_RUNS: the same launch, plus checkpoints at steps 2 and 4)."""
    root = tmp_path_factory.mktemp("ladder")
    names = FULL + [f"lora_{n}" for n in LORA]
    held_out = eval_args(shared_runs.root)  # the shared runs' evaluation: every rung's eval loss compares
    jobs = {}
    for name in names:
        if name in SHARED_RUNS:
            continue
        if name.startswith("lora_"):
            jobs[name] = (root / name, ("--config", name.removeprefix("lora_"), "--lora", *held_out), {})
        elif name in VIA_CONFIG_FILE:
            jobs[name] = (root / name, held_out, {"config_file": str(REPO / "accelerate_configs" / f"{name}.yaml")})
        else:
            jobs[name] = (root / name, ("--config", f"{name}.yaml", "--nvme-path", str(root / "nvme"), *held_out), {})
    own = shared_runs.launch([n for n in names if n in SHARED_RUNS], also=jobs)
    return {**references, **{name: own[name] if name in own else shared_runs[name] for name in names}}


def _bytes(summary: dict, key: str) -> list[int]:
    return [r[key] for r in summary["ranks"]]


@pytest.mark.parametrize("name", FULL + [f"lora_{n}" for n in LORA])
def test_losses_match_single_process(runs, name):
    reference = runs["lora_single" if name.startswith("lora_") else "single"]
    ref, got = reference["losses"], runs[name]["losses"]
    assert len(got) == len(ref) == 4
    assert got == pytest.approx(ref, rel=LOSS_RTOL), f"{name}: {got} vs single {ref}"
    assert got[-1] < got[0], f"{name}: the loss did not fall: {got}"
    assert_same_grad_norms(runs[name], reference, what=name)
    # The same held-out conversations, evaluated at steps 2 and 4 (tests/e2e/test_evaluation.py says more).
    assert runs[name]["eval"]["steps"] == reference["eval"]["steps"] == [2, 4]
    assert runs[name]["eval"]["losses"] == pytest.approx(reference["eval"]["losses"], rel=LOSS_RTOL)


@pytest.mark.parametrize("name", FULL)
def test_strategy_and_world_recorded(runs, name):
    s = runs[name]["strategy"]
    rung = load_rung(name)
    assert s["name"] == name and s["world_size"] == rung.num_processes == len(runs[name]["ranks"])
    assert s["dp_replicate"] * s["dp_shard"] * s["pp"] * s["tp"] == rung.num_processes
    assert s["zero_stage"] == rung.zero_stage
    assert s["mixed_precision"] == "no"  # the YAMLs say bf16: translated on CPU
    assert s["attn_implementation"] == "hfdist_documents"  # the CPU default: documents apart, no S x S mask


def test_cpu_translation_is_announced(runs):
    assert "mixed_precision bf16 -> fp32" in runs["ddp"]["_stdout"]


def test_ddp_replicates_everything(runs):
    single = runs["single"]["ranks"][0]
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert _bytes(runs["ddp"], key) == [single[key]] * 2


@pytest.mark.parametrize("name", FULL_SHARDING)
def test_full_sharding_holds_half_of_everything(runs, name):
    """FSDP full shard and ZeRO-3 hold ~1/dp_shard of params, grads and optimizer state (dp_shard = 2 here)."""
    ddp, shards = runs["ddp"]["ranks"][0], load_rung(name).dims.dp_shard
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        for got in _bytes(runs[name], key):
            # Flat buffers round each rank's share up to an alignment; 2% covers that on this tiny model.
            assert got == pytest.approx(ddp[key] / shards, rel=0.02), f"{name} {key}: {got} vs ddp {ddp[key]}"


def test_zero1_shards_optimizer_state_only(runs):
    ddp = runs["ddp"]["ranks"][0]
    for r in runs["zero1"]["ranks"]:
        assert r["param_bytes"] == ddp["param_bytes"]
        assert r["grad_bytes"] >= ddp["grad_bytes"]  # full gradients exist at the end of backward
        assert r["optimizer_bytes"] == pytest.approx(ddp["optimizer_bytes"] / 2, rel=0.02)


def test_zero2_shards_optimizer_state_and_grads(runs):
    ddp = runs["ddp"]["ranks"][0]
    for r in runs["zero2"]["ranks"]:
        assert r["param_bytes"] == ddp["param_bytes"]
        assert r["optimizer_bytes"] == pytest.approx(ddp["optimizer_bytes"] / 2, rel=0.02)
        # Half the gradients plus DeepSpeed's reduce bucket (reduce_bucket_size "auto" = hidden^2 elements).
        assert r["grad_bytes"] < 0.75 * ddp["grad_bytes"], r


def test_runs_measure_throughput_and_peak_memory(runs):
    for name in FULL:
        for r in runs[name]["ranks"]:
            assert r["tokens_per_second"] > 0 and r["peak_memory_bytes"] > r["param_bytes"]
            # Real tokens of this rank's batches; the ranks of a tp group share theirs.
            assert r["tokens"] == 4 * 8 * 64 * runs[name]["strategy"]["tp"] // len(runs[name]["ranks"])


def test_fsdp_tp_splits_every_matrix_over_tp_and_shards_over_dp(runs):
    """2 x 2: each rank holds 1/4 of the params, grads and optimizer state (1/2 by TP, 1/2 of that by FSDP)."""
    ddp = runs["ddp"]["ranks"][0]
    for r in runs["fsdp_tp"]["ranks"]:
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert r[key] == pytest.approx(ddp[key] / 4, rel=0.02), (key, r[key], ddp[key])


def test_zero2_tp_splits_the_linears(runs):
    """AutoTP splits every Linear (embedding and norms stay whole); ZeRO-2 then halves grads and Adam state."""
    ddp = runs["ddp"]["ranks"][0]
    for r in runs["zero2_tp"]["ranks"]:
        assert 0.5 * ddp["param_bytes"] < r["param_bytes"] < 0.75 * ddp["param_bytes"]
        assert r["optimizer_bytes"] < 0.5 * ddp["optimizer_bytes"]


@pytest.mark.parametrize("name", ["single"] + FULL)
def test_saved_model_reloads_with_trained_loss(runs, name):
    from transformers import AutoModelForCausalLM

    summary = runs[name]
    model = AutoModelForCausalLM.from_pretrained(summary["_dir"]).eval()
    with torch.no_grad():
        loss = model(**check_batch(summary)).loss.item()
    assert loss == pytest.approx(summary["check_batch_loss"], rel=LOSS_RTOL)
    assert loss < summary["losses"][0]  # trained weights, not the initial ones


@pytest.mark.parametrize("name", ["single"] + LORA)
def test_saved_lora_adapter_reloads_with_trained_loss(runs, name):
    from peft import PeftModel
    from safetensors.torch import load_file

    from hfdist.models.build import build_model

    summary = runs[f"lora_{name}"]
    adapter = load_file(summary["_dir"] / "adapter_model.safetensors")
    assert adapter and all(t.numel() > 0 for t in adapter.values()), "empty adapter saved"
    assert any(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k), "lora_B never trained"
    base = build_model("llama-tiny", vocab_size=1024, seed=summary["config"]["seed"])
    model = PeftModel.from_pretrained(base, summary["_dir"]).eval()
    with torch.no_grad():
        loss = model(**check_batch(summary)).loss.item()
    assert loss == pytest.approx(summary["check_batch_loss"], rel=LOSS_RTOL)


# Left out: zero2_tp (DeepSpeed AutoTP keeps the embedding and norms whole; the planner splits all weights by tp)
# and lora_fsdp_tp (TP keeps half of each LoRA pair replicated; the planner splits adapters by tp).
@pytest.mark.parametrize("name", [n for n in FULL if n != "zero2_tp"] +
                         [f"lora_{n}" for n in LORA if n != "fsdp_tp"])
def test_planner_predicts_the_measured_bytes(runs, name):
    """hfdist plan's per-rank param/grad/optimizer bytes against what the run measured from its tensors.

    Tolerance 2%: FSDP2 pads each tensor's dim 0 to a multiple of dp_shard and DeepSpeed aligns its flat
    partitions; Adam's step counters (a few bytes per tensor) are not predicted. ZeRO-2's gradients also include
    DeepSpeed's reduce bucket, which the planner counts under buffers, so they may exceed the prediction by it.
    """
    from hfdist.models.presets import load_config
    from hfdist.plan import predict_state_bytes

    summary = runs[name]
    lora = name.startswith("lora_")
    rung = load_rung(summary["strategy"]["name"])
    want = predict_state_bytes(load_config("llama-tiny", 1024), rung, world=summary["strategy"]["world_size"],
                               dtype="fp32", lora=lora)
    for r in summary["ranks"]:
        assert r["param_bytes"] == pytest.approx(want.param_bytes, rel=0.02)
        assert r["optimizer_bytes"] + r["master_bytes"] == pytest.approx(want.optimizer_bytes, rel=0.02)
        if rung.zero_stage == 2:
            assert want.grad_bytes <= r["grad_bytes"] <= 1.5 * want.grad_bytes
        else:
            assert r["grad_bytes"] == pytest.approx(want.grad_bytes, rel=0.02)


def test_every_rank_reaches_wandb_offline(runs):
    """What reached W&B, read back from the offline run files (real wandb, no mock)."""
    from hfdist.report.wandb_offline import find_offline_runs

    summary = runs["fsdp_hybrid"]
    assert summary["wandb"]["mode"] == "offline" and summary["wandb"]["error"] is None
    (run_file,) = find_offline_runs(summary["_dir"])
    run = finished_offline_run(run_file)
    assert run.config["dp_replicate"] == 2 and run.config["dp_shard"] == 2 and run.name == "fsdp_hybrid"
    steps = [row for row in run.history if "loss" in row]
    assert [row["loss"] for row in steps] == pytest.approx(summary["losses"], rel=1e-6)
    last = steps[-1]
    for rank in range(4):
        for key in ("tokens_per_second", "param_bytes", "peak_memory_bytes", "mfu"):
            assert f"rank{rank}/{key}" in last
    # Totals agree: FSDP param shards summed over one replica = the model's bytes (DDP's per-rank figure).
    assert sum(last[f"rank{r}/param_bytes"] for r in range(2)) == runs["ddp"]["ranks"][0]["param_bytes"]
    assert last["param_bytes/min"] <= last["param_bytes/mean"] <= last["param_bytes/max"]
    assert run.summary["peak/peak_memory_bytes"] == max(r["peak_memory_bytes"] for r in summary["ranks"])


def test_every_rank_reaches_mlflow_and_tensorboard(runs):
    """The same run's series in MLflow's file store and TensorBoard's event files (--report-to, helpers.SHARED_RUNS),
    read back with their own readers: one run per job, every rank's figures at every step, nothing per rank twice."""
    summary = runs["fsdp_hybrid"]
    assert all(r["error"] is None for r in summary["trackers"].values()), summary["trackers"]
    (name, series), = mlflow_series((summary["_dir"] / "mlruns").as_uri())
    scalars = tensorboard_series(summary["_dir"] / "tensorboard")
    assert name == "fsdp_hybrid" and len(list((summary["_dir"] / "tensorboard").glob("events.out.*"))) == 1
    steps = list(range(1, len(summary["losses"]) + 1))
    for got in (series, scalars):
        assert [v for _, v in got["loss"]] == pytest.approx(summary["losses"], rel=1e-6)
        for rank in range(4):
            for key in ("tokens_per_second", "param_bytes", "peak_memory_bytes"):
                assert [s for s, _ in got[f"rank{rank}/{key}"]] == steps  # one point per step: no duplicates
        assert not any(key.startswith("rank4/") for key in got)
    assert series["rank1/param_bytes"] == scalars["rank1/param_bytes"]


def test_matrix_from_the_runs(runs, tmp_path):
    """The comparison matrix is built from the runs' own summaries: one row per run, every column filled."""
    import csv

    from matplotlib.image import imread

    from hfdist.report.matrix import COLUMNS, load_rows, write_matrix

    names = ["ddp", "fsdp_full_shard", "zero3", "lora_fsdp_full_shard"]
    rows = load_rows(runs[n]["_dir"] / "hfdist_summary.json" for n in names)
    written = write_matrix(rows, tmp_path, "test-cpu", ["note"])
    table = list(csv.DictReader(open(tmp_path / "matrix.csv")))
    assert [r["strategy"] for r in table] == ["ddp", "fsdp_full_shard", "zero3", "fsdp_full_shard+lora"]
    assert all(r[c] not in ("", None) for r in table for c in COLUMNS)
    assert {r["attn_implementation"] for r in table} == {"hfdist_documents"}  # what each run resolved auto to
    by_name = {r["strategy"]: r for r in table}
    assert float(by_name["zero3"]["param_mb_per_rank"]) < float(by_name["ddp"]["param_mb_per_rank"])
    assert float(by_name["ddp"]["final_loss"]) == pytest.approx(runs["ddp"]["losses"][-1], abs=1e-4)
    for png in [p for p in written if p.suffix == ".png"]:
        assert imread(png).shape[0] > 100  # a real image, not an empty file
