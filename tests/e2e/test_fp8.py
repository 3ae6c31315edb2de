"""End-to-end: `--fp8` in composition with the options around it, as a user launches it, with torchao's float8
matmuls verified in effect on every rank, on llama-tiny (all 28 decoder projections convert; lm_head does not). Every
rung that takes --fp8 (3d and fsdp_hybrid too) is also trained alone against the single-process --fp8 run, its
float8 all-gather checked, in tests/e2e/test_cells.py.

What must hold:
- fsdp_full_shard and fsdp_tp with --fp8 (fp32 elsewhere) give the single-process --fp8 run's losses within 1e-3
  relative. Float8's activation scales are per matmul, so the reference computes each sequence in a matmul of its
  own, as these runs do (--micro-batch-size 1).
- fsdp_full_shard with --fp8 gives the same rung's bf16 run's losses within 5e-2 (the bf16 runs are the session's
  shared ones that tests/e2e/test_bf16.py checks); ddp with --fp8 rowwise over bf16 the single bf16 run's.
- Compositions: fsdp_full_shard also compiles its layers and recomputes them (--compile --activation-checkpointing),
  pp runs over bf16 with activation checkpointing, ddp runs rowwise over accelerate's bf16 autocast.
- Every rank's record: its float8 linears, the recipe, and FSDP2 gathering them in float8 exactly where it shards
  (tensorwise: fsdp_full_shard, fsdp_tp; not ddp, pp, single).
- The saved model is an ordinary fp32 HF checkpoint.
- --fp8 with --lora, or on a DeepSpeed rung, is refused in one paragraph (exit 2) before any process starts.
"""

from __future__ import annotations

import json
import sys

import pytest

from hfdist.config.ladder import load_rung

from helpers import FINETUNE, run_cmd, table_rungs

pytestmark = pytest.mark.multiproc

SAME_RUN_RTOL = 1e-3  # against the single-process float8 run, matmuls of the same sequences
BF16_RTOL = 5e-2  # against the same rung in bf16
RUNGS = [n for n in table_rungs(option="fp8") if n != "single"]  # the rung table: ddp, fsdp_full_shard, pp, fsdp_tp
ONE_SEQUENCE = ("--micro-batch-size", "1")
# Each rung's options besides --fp8.
OPTIONS = {
    "ddp": ("--fp8", "rowwise", "--mixed-precision", "bf16"),
    "fsdp_full_shard": ("--fp8", *ONE_SEQUENCE, "--compile", "--activation-checkpointing"),
    "pp": ("--fp8", "--mixed-precision", "bf16", "--activation-checkpointing"),
    "fsdp_tp": ("--fp8", *ONE_SEQUENCE),
}
SAME_RUN = ["fsdp_full_shard", "fsdp_tp"]  # fp32 + float8, as the single-process reference
BF16_OF = {"fsdp_full_shard": "bf16_fsdp_full_shard", "ddp": "bf16_single"}
GATHERED_IN_FLOAT8 = {"fsdp_full_shard", "fsdp_tp"}


@pytest.fixture(scope="module")
def runs(shared_runs, tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("fp8")
    jobs = {"single": (root / "single", ("--fp8", *ONE_SEQUENCE, "--no-wandb"), {})}
    jobs.update({name: (root / name, ("--config", name, *OPTIONS[name], "--no-wandb"), {})
                 for name in RUNGS})
    fp8 = shared_runs.launch(list(BF16_OF.values()), also=jobs)
    return {**fp8, **{key: shared_runs[key] for key in BF16_OF.values()}}


def test_the_suite_trains_every_rung_that_takes_fp8():
    assert set(RUNGS) == set(OPTIONS) == {"ddp", "fsdp_full_shard", "pp", "fsdp_tp"}


@pytest.mark.parametrize("name", SAME_RUN)
def test_losses_match_the_single_process_fp8_run(runs, name):
    ref, got = runs["single"]["losses"], runs[name]["losses"]
    assert len(got) == len(ref) == 4
    assert got == pytest.approx(ref, rel=SAME_RUN_RTOL)
    assert got[-1] < got[0]


@pytest.mark.parametrize("name", list(BF16_OF))
def test_losses_match_the_same_run_in_bf16(runs, name):
    ref, got = runs[BF16_OF[name]]["losses"], runs[name]["losses"]
    assert runs[BF16_OF[name]]["strategy"]["fp8"] is None
    assert got == pytest.approx(ref, rel=BF16_RTOL)
    assert got != ref  # float8 matmuls really ran: not the bf16 numbers


@pytest.mark.parametrize("name", ["single", *RUNGS])
def test_every_rank_computed_in_float8(runs, name):
    summary = runs[name]
    recipe = "rowwise" if name == "ddp" else "tensorwise"
    assert summary["strategy"]["fp8"] == recipe
    assert f"hfdist: fp8 ({recipe}): 28 of the 28 decoder projections compute in float8" in summary["_stdout"]
    pp = summary["strategy"]["pp"]
    gathered = "float8_e4m3fn" if name in GATHERED_IN_FLOAT8 else None
    records = [r["fp8"] for r in summary["ranks"]]
    assert len(records) == summary["strategy"]["world_size"]
    assert all(r == {"fp8_layers": 28 // pp, "fp8_recipe": recipe, "fp8_all_gather_dtype": gathered}
               for r in records), records
    expected_mixed = "bf16" if "bf16" in OPTIONS.get(name, ()) else "no"
    assert summary["strategy"]["mixed_precision"] == expected_mixed


def test_compiled_and_recomputed_layers_run_in_float8(runs):
    summary = runs["fsdp_full_shard"]
    assert summary["strategy"]["compile"] is True
    assert all(r["compile"]["compiled_layers"] == 4 for r in summary["ranks"])
    assert summary["config"]["activation_checkpointing"] is True


@pytest.mark.parametrize("name", ["single", "fsdp_tp"])
def test_the_saved_model_is_a_plain_fp32_checkpoint(runs, name):
    from safetensors import safe_open

    folder = runs[name]["_dir"]
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"} and len(list(f.keys())) == 39


@pytest.mark.parametrize("args, message", [
    (("--fp8", "--lora"), "--fp8 does not run with --lora"),
    (("--config", "zero3", "--fp8"), "--fp8 does not run on zero3: DeepSpeed's engine"),
])
def test_refused_before_any_process(tmp_path, args, message):
    assert load_rung("zero3").uses_deepspeed
    out = tmp_path / "o"
    proc = run_cmd([sys.executable, str(FINETUNE), "--model", "llama-tiny", *args, "--output-dir", str(out)],
                   timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    paragraph = proc.stderr.strip().splitlines()[-1]
    assert message in paragraph and "Drop --" in paragraph and "\n" not in paragraph
    assert "Traceback" not in proc.stderr and not out.exists()
