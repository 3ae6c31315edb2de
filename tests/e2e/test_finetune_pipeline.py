"""End-to-end pipeline parallelism: the pp and 3d rungs through scripts/finetune.py on CPU/gloo.

Same workload as tests/e2e/test_finetune_ladder.py (llama-tiny, 4 steps, global batch 8 x 64, fp32) and the same
tolerance against the single-process run. pp = 2 stages on 2 processes with each torch schedule; 3d = FSDP2 (dp 2)
x PP (2) x TP (2) on 8 processes. Also: gradient accumulation with activation checkpointing, per-rank bytes, and the
consolidated checkpoint reloaded in a fresh process. (LoRA on pp: tests/e2e/test_lora_checkpoints.py and
test_cells.py.)
"""

from __future__ import annotations

import pytest
import torch

from hfdist.config.ladder import load_rung

from helpers import SHARED_RUNS, check_batch, table_rungs

pytestmark = pytest.mark.multiproc

LOSS_RTOL = 1e-5  # as in test_finetune_ladder.py
SCHEDULES = ["GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]  # pp.yaml itself runs 1F1B
RUNGS = table_rungs("pipeline")  # the rung table's pipeline rungs (pp, 3d), each on its YAML's process count
ACCUM_AC_SCHEDULE = "GPipe"
ACCUM_AC = ("--micro-batch-size", "4", "--pp-microbatches", "2", "--activation-checkpointing")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, references, shared_runs):
    """{name: summary} of every pipeline run, plus the single-process references. pp (`accelerate launch
    --config_file pp.yaml`: hfdist finds the pipeline YAML through the launcher) and 3d (the README's form, which hands
    over to accelerate itself) are the session's shared runs (helpers.SHARED_RUNS), which test_resume and
    test_checkpoint_export also read; so is pp_Interleaved1F1B, whose loss in sequence chunks test_chunked_loss_job
    also checks."""
    root = tmp_path_factory.mktemp("pipeline")
    shared = [n for n in RUNGS + [f"pp_{s}" for s in SCHEDULES] if n in SHARED_RUNS]
    jobs = {name: (root / name, ("--config", name), {}) for name in RUNGS if name not in SHARED_RUNS}
    for schedule in SCHEDULES:
        if f"pp_{schedule}" in SHARED_RUNS:
            continue
        # GPipe also runs 2 accumulation steps of 4 sequences, each split into 2 pipeline micro-batches, with layers
        # recomputed: one launch answers the schedule's tests and accumulation's.
        extra = ACCUM_AC if schedule == ACCUM_AC_SCHEDULE else ()
        jobs[f"pp_{schedule}"] = (root / f"pp_{schedule}", ("--config", "pp", "--pp-schedule", schedule, *extra),
                                  {})
    out = shared_runs.launch(shared, also=jobs)
    out.update({name: shared_runs[name] for name in shared})
    return {**references, **out}


NAMES = RUNGS + [f"pp_{s}" for s in SCHEDULES]


@pytest.mark.parametrize("name", NAMES)
def test_losses_match_single_process(runs, name):
    ref = runs["single"]["losses"]
    got = runs[name]["losses"]
    assert len(got) == len(ref) == 4
    assert got == pytest.approx(ref, rel=LOSS_RTOL), f"{name}: {got} vs single {ref}"
    assert got[-1] < got[0]


@pytest.mark.parametrize("name", NAMES)
def test_pipeline_recorded_as_asked(runs, name):
    s = runs[name]["strategy"]
    assert s["world_size"] == load_rung(name if name in RUNGS else "pp").num_processes == len(runs[name]["ranks"])
    assert s["pp"] == 2 and s["dp_replicate"] * s["dp_shard"] * s["pp"] * s["tp"] == s["world_size"]
    want = name.split("_", 1)[1] if name.startswith("pp_") else "1F1B"
    assert s["pp_schedule"] == want
    assert s["attn_implementation"] == "hfdist_documents"  # each stage rebuilds its micro-batch's boundaries
    if name == f"pp_{ACCUM_AC_SCHEDULE}":
        assert (s["grad_accum"], s["micro_batch"], s["pp_microbatches"]) == (2, 4, 2)
        assert runs[name]["config"]["activation_checkpointing"] is True


def test_stages_split_the_model_states(runs):
    """pp: each of the 2 ranks holds about half of every state (the split balances embedding and lm_head as extra
    layers); 3d: dp 2 x pp 2 x tp 2 leave 1/8 per rank of params and optimizer state. Gradients under 3d: torch's
    schedules keep a stage's FSDP gradients unsharded over dp until the step's last micro-batch, so during backward
    a rank holds between its 1/8 shard and the dp (2) times larger unsharded stage gradient."""
    single = runs["single"]["ranks"][0]
    for name, share in (("pp", 2), ("3d", 8)):
        for r in runs[name]["ranks"]:
            for key in ("param_bytes", "optimizer_bytes") + (("grad_bytes",) if name == "pp" else ()):
                assert r[key] == pytest.approx(single[key] / share, rel=0.02), (name, key, r[key], single[key])
    for r in runs["3d"]["ranks"]:
        assert 0.98 * single["grad_bytes"] / 8 <= r["grad_bytes"] <= 1.02 * single["grad_bytes"] / 4, r
        # Every rank of a replica sees the replica's tokens: dp replicas split the 4 x 8 x 64 tokens.
        dp = runs[name]["strategy"]["dp_shard"]
        assert all(r["tokens"] == 4 * 8 * 64 // dp and r["tokens_per_second"] > 0 for r in runs[name]["ranks"])


@pytest.mark.parametrize("name", RUNGS + ["pp_ZBVZeroBubble"])
def test_consolidated_checkpoint_reloads_with_trained_loss(runs, name):
    """Every stage (and every FSDP/TP shard) gathered into one HF checkpoint: from_pretrained reproduces the
    loss the distributed model scored after training."""
    from transformers import AutoModelForCausalLM

    summary = runs[name]
    model = AutoModelForCausalLM.from_pretrained(summary["_dir"]).eval()
    with torch.no_grad():
        loss = model(**check_batch(summary)).loss.item()
    assert loss == pytest.approx(summary["check_batch_loss"], rel=LOSS_RTOL)
    assert loss < summary["losses"][0]


@pytest.mark.parametrize("name", RUNGS)
def test_planner_predicts_the_measured_bytes(runs, name):
    """hfdist plan's per-rank param/grad/optimizer bytes (an average over ranks) against the measured mean (2%)."""
    from hfdist.models.presets import load_config
    from hfdist.plan import predict_state_bytes

    summary = runs[name]
    want = predict_state_bytes(load_config("llama-tiny", 1024), load_rung(name),
                               world=summary["strategy"]["world_size"], dtype="fp32")
    ranks = summary["ranks"]
    assert sum(r["param_bytes"] for r in ranks) / len(ranks) == pytest.approx(want.param_bytes, rel=0.02)
    # The gradient shards at the optimizer step; under 3d more exists during backward (see above).
    grads = sum(r["grad_bytes"] for r in ranks) / len(ranks)
    dp = summary["strategy"]["dp_shard"]
    assert 0.98 * want.grad_bytes <= grads <= 1.02 * dp * want.grad_bytes
    measured = sum(r["optimizer_bytes"] + r["master_bytes"] for r in ranks) / len(ranks)
    assert measured == pytest.approx(want.optimizer_bytes, rel=0.02)
