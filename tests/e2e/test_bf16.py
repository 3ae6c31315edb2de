"""End-to-end: `--mixed-precision bf16` really runs bf16 on CPU, by one mechanism per rung, on llama-tiny.

ddp (accelerate's CPU autocast over fp32 weights), fsdp_full_shard / fsdp_tp / pp / 3d (FSDP2's MixedPrecisionPolicy: bf16
compute, fp32 parameters and gradient reduction; the pipeline on its 1-rank dp mesh too, so the stages hand each
other bf16 activations) and zero3 (DeepSpeed's bf16 section, gradients accumulated and reduced in fp32). What
must hold: losses within 2e-2 relative of the single-process bf16 run; the summary says bf16; the dtypes every rank
recorded while training (a decoder projection's output, the loss, the inter-stage activations, the gradient
reduction, the parameters); and the saved model in the one documented dtype, fp32.
"""

from __future__ import annotations

import json

import pytest

from hfdist.config.ladder import load_rung

from helpers import finetune_all, table_rungs

pytestmark = pytest.mark.multiproc

BF16_RTOL = 2e-2
RUNGS = [n for n in table_rungs(option="bf16") if n != "single"]  # the rung table: one rung per mechanism


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("bf16")
    bf16 = ("--mixed-precision", "bf16", "--no-wandb")
    out = finetune_all({name: (root / name, bf16 if name == "single" else ("--config", name, *bf16), {"via": "python"})
                        for name in ["single", *RUNGS]})
    for name, summary in out.items():
        summary["_dir"] = root / name
    return out


@pytest.mark.parametrize("name", RUNGS)
def test_losses_match_single_process_bf16(runs, name):
    ref, got = runs["single"]["losses"], runs[name]["losses"]
    assert len(got) == len(ref) == 4
    assert got == pytest.approx(ref, rel=BF16_RTOL)
    assert got[-1] < got[0]


@pytest.mark.parametrize("name", ["single", *RUNGS])
def test_bf16_is_what_ran(runs, name):
    summary = runs[name]
    assert summary["strategy"]["mixed_precision"] == "bf16"
    assert "-> fp32" not in summary["_stdout"]  # no CPU translation of the precision
    ranks = [r["precision"] for r in summary["ranks"]]
    assert all(p["compute_dtype"] == "bfloat16" for p in ranks), ranks
    losses = [p["loss_dtype"] for p in ranks if p["loss_dtype"] is not None]
    assert losses and set(losses) == {"float32"}, ranks  # the loss is computed from fp32 logits
    if name != "single":
        assert {p["reduce_dtype"] for p in ranks} == {"float32"}, ranks
    # DeepSpeed trains a bf16 model against fp32 master partitions; every other rung keeps fp32 weights.
    assert {p["param_dtype"] for p in ranks} == {"bfloat16" if load_rung(name).uses_deepspeed else "float32"}, ranks
    if summary["strategy"]["pp"] > 1:
        handed = [p["activation_dtype"] for p in ranks if p["activation_dtype"] is not None]
        assert handed and set(handed) == {"bfloat16"}, ranks


@pytest.mark.parametrize("name", ["single", *RUNGS])
def test_saved_weights_are_fp32_on_every_rung(runs, name):
    from safetensors import safe_open

    folder = runs[name]["_dir"]
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
