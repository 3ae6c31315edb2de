"""End-to-end: --qlora (LoRA on a 4-bit NF4 base) as a user launches it, on llama-tiny (its projections' packed 4-bit
rows hold several whole blocks of 64 weights per rank; the embedded default, llama-small, which no check here needs,
took 2.3 x as long a step on CPU), against the single-process QLoRA run. Every rung that takes --qlora trains it
against one process in QLoRA's default bf16 compute (losses and gradient norms, rel 2e-2) in tests/e2e/test_cells.py;
here, the rungs whose parameter bytes the planner predicts (ddp, fsdp_full_shard, fsdp_hybrid, zero3) in fp32 compute
(--mixed-precision no), and fsdp_offload in QLoRA's own default, bf16 compute. qwen2-tiny (projection biases) runs
from a bf16 checkpoint folder (as HF models ship) on fsdp_full_shard, checkpointed, with its own single-process run.
What must hold:
- every layout quantises the same rows into the same 4-bit base, so the losses equal the single process's to the fp32
  tolerance of the ladder (rel 1e-5: only reductions are ordered differently), the loss falls, and bf16 compute stays
  within test_bf16's tolerance of the fp32 losses;
- the summary records what ran: base nf4, adapters fp32, compute in the run's precision, parameter bytes that the
  planner's prediction (hfdist.plan.predict_state_bytes) gives exactly;
- the saved adapter, loaded by peft onto the same checkpoint quantised by transformers' BitsAndBytesConfig in this
  process, reproduces the trained loss; the merged export (`hfdist checkpoint export --merge`) loads with
  from_pretrained and gives it within bf16 rounding;
- the checkpoint holds the adapters only and resumes on another layout (fsdp_full_shard -> ddp) to the same losses.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from hfdist.config.ladder import load_rung

from helpers import (
    assert_same_grad_norms,
    check_batch,
    finetune,
    finetune_all,
    run_cmd,
    table_rungs,
)

pytestmark = pytest.mark.multiproc

LOSS_RTOL = 1e-5  # fp32 compute: as tests/e2e/test_finetune_ladder.py
BF16_RTOL = 2e-2  # bf16 compute against fp32: as tests/e2e/test_bf16.py
MERGED_RTOL = 1e-3  # the merged weights are rounded to bf16 once
# The planner's rungs and the bf16 one, each of which the rung table takes --qlora on.
RUNGS = [n for n in ("ddp", "fsdp_full_shard", "fsdp_hybrid", "zero3", "fsdp_offload") if n in table_rungs(option="qlora")]
BF16_RUNG = "fsdp_offload"
FP32 = ("--mixed-precision", "no")
QLORA = ("--qlora", "--no-wandb", "--save-steps", "0")
CHECKPOINTED = ("--qlora", "--no-wandb", "--save-steps", "2")
# The other architectures, from bf16 checkpoint folders: (preset, rung, seed of their weights).
ARCHITECTURES = {"qwen2": ("qwen2-tiny", "fsdp_full_shard", 11)}


def _bf16_folder(root, preset: str, seed: int):
    from hfdist.data.load import load_tokenizer
    from hfdist.models.build import build_model

    folder = root / f"{preset}-bf16"
    build_model(preset, vocab_size=1024, dtype=torch.bfloat16, seed=seed).save_pretrained(folder)
    load_tokenizer(None, is_preset=True).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("qlora")
    jobs = {"single": (root / "single", (*QLORA, *FP32), {})}  # TINY_ARGS' llama-tiny
    for name in RUNGS:
        precision = () if name == BF16_RUNG else FP32
        jobs[name] = (root / name, ("--config", name, *QLORA, *precision), {})
    for arch, (preset, rung, seed) in ARCHITECTURES.items():
        model = ("--model", str(_bf16_folder(root, preset, seed)))
        extra = CHECKPOINTED if arch == "qwen2" else QLORA
        jobs[f"{arch}_single"] = (root / f"{arch}_single", (*model, *QLORA, *FP32), {})
        jobs[f"{arch}_{rung}"] = (root / f"{arch}_{rung}", ("--config", rung, *model, *extra, *FP32), {})
    out = finetune_all(jobs)
    for name, (folder, _, _) in jobs.items():
        out[name]["_dir"] = folder
    return out


@pytest.mark.parametrize("name", RUNGS)
def test_losses_match_single_process(runs, name):
    ref, got = runs["single"]["losses"], runs[name]["losses"]
    assert len(got) == len(ref) == 4
    assert got == pytest.approx(ref, rel=BF16_RTOL if name == BF16_RUNG else LOSS_RTOL), f"{name}: {got} vs {ref}"
    assert got[-1] < got[0], f"{name}: the loss did not fall: {got}"
    if name != BF16_RUNG:  # bf16 compute against fp32: its gradients, against bf16 ones, in test_cells.py
        assert_same_grad_norms(runs[name], runs["single"], what=name)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_other_architectures_match_their_single_process(runs, arch):
    _, rung, _ = ARCHITECTURES[arch]
    ref, got = runs[f"{arch}_single"]["losses"], runs[f"{arch}_{rung}"]["losses"]
    assert got == pytest.approx(ref, rel=LOSS_RTOL) and got[-1] < got[0]


@pytest.mark.parametrize("name", ["single", *RUNGS])
def test_what_ran_is_recorded(runs, name):
    summary = runs[name]
    assert summary["strategy"]["qlora"] and summary["strategy"]["lora"]
    bf16 = name == BF16_RUNG
    assert summary["strategy"]["mixed_precision"] == ("bf16" if bf16 else "no")
    for rank in summary["ranks"]:
        precision = rank["precision"]
        assert precision["base_dtype"] == "nf4" and precision["param_dtype"] == "float32", precision
        assert precision["compute_dtype"] in ({"bfloat16"} if bf16 else {"float32", None}), precision


@pytest.mark.parametrize("name", ["single", "ddp", "fsdp_full_shard", "fsdp_hybrid", "zero3"])
def test_parameter_bytes_are_the_planners(runs, name):
    """4-bit projections (sharded where the rung shards), their quantisation states whole, the rest of the base and
    the adapters in fp32: what hfdist.plan.predict_state_bytes says, to the byte (averaged over ranks)."""
    from hfdist.models.presets import load_config
    from hfdist.plan import predict_state_bytes

    summary = runs[name]
    rung = load_rung("ddp" if name == "single" else name)
    predicted = predict_state_bytes(load_config("llama-tiny"), rung, summary["strategy"]["world_size"],
                                    dtype="fp32", qlora=True)
    got = [r["param_bytes"] for r in summary["ranks"]]
    assert sum(got) / len(got) == pytest.approx(predicted.param_bytes, rel=2e-3), (got, predicted)


def _fresh_4bit_base(folder):
    """The checkpoint quantised by transformers (bitsandbytes NF4, double quantisation, bf16 storage), its other
    weights in fp32 (peft's prepare_model_for_kbit_training), the 4-bit layers computing in fp32."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.bfloat16)
    base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=torch.bfloat16,
                                                device_map="cpu")
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    for module in base.modules():  # bitsandbytes' bf16 inference kernel on AVX512-BF16 CPUs: off, as hfdist has it
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return base


def test_saved_adapter_on_a_4bit_base_reproduces_the_trained_loss(runs):
    from peft import PeftModel

    from hfdist.models.chunked_loss import causal_lm_loss

    summary = runs["qwen2_fsdp_full_shard"]
    folder = summary["_dir"]
    assert sorted(p.name for p in folder.glob("adapter_*")) == ["adapter_config.json", "adapter_model.safetensors"]
    model = PeftModel.from_pretrained(_fresh_4bit_base(summary["config"]["model"]), folder).eval()
    with torch.no_grad():
        loss = causal_lm_loss(model, check_batch(summary), None, None).item()
    assert loss == pytest.approx(summary["check_batch_loss"], rel=LOSS_RTOL)
    assert loss < summary["losses"][0]


def test_merged_export_loads_with_the_trained_loss(runs, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from hfdist.models.chunked_loss import causal_lm_loss

    summary = runs["qwen2_fsdp_full_shard"]
    out = tmp_path / "merged"
    proc = run_cmd([sys.executable, "-m", "hfdist.cli", "checkpoint", "export", str(summary["_dir"]), "--to", "hf",
                    str(out), "--merge"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert not [k for k in f.keys() if "lora" in k]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        loss = causal_lm_loss(model, check_batch(summary), None, None).item()
    assert loss == pytest.approx(summary["check_batch_loss"], rel=MERGED_RTOL)


def test_checkpoint_holds_the_adapters_and_resumes_on_another_layout(runs, tmp_path):
    """fsdp_full_shard's step-2 checkpoint (adapters + optimizer state; the base is quantised anew) continues on
    ddp to the losses of the uninterrupted run."""
    from torch.distributed.checkpoint import FileSystemReader

    summary = runs["qwen2_fsdp_full_shard"]
    checkpoint = summary["_dir"] / "checkpoint-2"
    saved = FileSystemReader(str(checkpoint / "sharded")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(checkpoint, resumed_dir / "checkpoint-2")
    resumed = finetune(resumed_dir, "--config", "ddp", "--model", summary["config"]["model"], *CHECKPOINTED, *FP32,
                       "--resume")
    assert "resharding fsdp_full_shard on 2 ranks" in resumed["_stdout"]
    assert resumed["losses"][-2:] == pytest.approx(summary["losses"][2:], rel=LOSS_RTOL)
