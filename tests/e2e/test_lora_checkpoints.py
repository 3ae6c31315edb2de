"""End-to-end: a LoRA run's checkpoints hold what trains (the adapters, their optimizer state, the scheduler, RNG and
data position, and a fingerprint of the frozen base), on every kind of rung, and resume on the same or another
layout to the uninterrupted run's numbers; a checkpoint resumed onto another base is refused before launch.

The model is a small Llama the other tests do not train, saved as a local checkpoint (2 layers of width 1024: its
adapters of rank 16 on every projection are 2.4% of its 25 M weights, in tensors of 25-90 KB). Every run trains through the job's own
path (tests/e2e/cells_worker.py, the runs of one world size in one launch): 4 steps with a checkpoint at steps 2
and 4 on every rung the table trains with LoRA (single, ddp, fsdp_full_shard, zero2, zero3, pp, fsdp_tp); then fsdp_full_shard, zero3 and pp resume their
checkpoint-2 on their own layout, and fsdp_tp resumes fsdp_full_shard's.

What must hold:
- each checkpoint's bytes on disk (every file, as the summary reports them) at most 1.15 x the state the summary
  counts (the trainable parameters and AdamW's two moments, fp32; on zero2 also ZeRO's module copy of the
  trainables): no base weight in it (DCP: only adapter keys; DeepSpeed: no model files, its ZeRO files without
  frozen parameters);
- the resumed runs' losses and gradient norms equal the uninterrupted run's (fp32, rel 1e-6);
- the base's weights replaced under the same path: `--resume` refuses before launch, naming both fingerprints;
- the saved adapter reloads onto the base with the trained loss; the planner predicts each rank's bytes; a merged
  export loads with the trained loss.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from hfdist.config.ladder import load_rung

from helpers import FINETUNE, REPO, run_cases, run_cmd, side_by_side, table_rungs

pytestmark = pytest.mark.multiproc

SIZE_LIMIT = 1.15  # checkpoint bytes / counted state bytes: the files around the state (metadata, RNG, scheduler)
RESUME_RTOL = 1e-6
# The rung table's rungs the suite trains with LoRA, each on its YAML's process count.
RUNGS = {name: load_rung(name).num_processes for name in table_rungs(option="lora")}
# resumed run -> (the rung it resumes on, the run whose checkpoint-2 it resumes)
RESUMED = {"fsdp_full_shard": ("fsdp_full_shard", "fsdp_full_shard"), "zero3": ("zero3", "zero3"),
           "pp": ("pp", "pp"), "fsdp_full_shard_on_fsdp_tp": ("fsdp_tp", "fsdp_full_shard")}


def _args(model: Path) -> list[str]:
    return ["--model", str(model), "--lora", "--max-steps", "4", "--save-steps", "2", "--save-total-limit", "3",
            "--global-batch-size", "8", "--seq-len", "64", "--learning-rate", "3e-3", "--warmup-steps", "0",
            "--no-wandb", "--collective-timeout", "120"]


def _layout(rung: str) -> list[str]:
    return [] if rung == "single" else ["--config", rung]


def _save_llama(folder: Path, vocab_size: int, seed: int) -> None:
    """The module's small Llama with weights drawn from `seed`, as safetensors + config in `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=16,
                         num_key_value_heads=8, vocab_size=vocab_size, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The small Llama as a local checkpoint with its tokenizer (the embedded one)."""
    from hfdist.data.load import load_tokenizer

    folder = tmp_path_factory.mktemp("lora_base") / "small-llama"
    tokenizer = load_tokenizer(None, is_preset=True)
    _save_llama(folder, len(tokenizer), seed=11)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory) -> dict[str, dict]:
    """{name: result} of the uninterrupted runs (by rung) and the resumed ones ("resumed/<name>"), each {"error",
    "summary"} with its output folder under "dir"."""
    root = tmp_path_factory.mktemp("lora_checkpoints")
    first: dict[int, list[dict]] = {}
    for rung, world in RUNGS.items():
        first.setdefault(world, []).append({"id": rung, "output_dir": str(root / rung),
                                            "args": [*_args(base), *_layout(rung)]})
    results = {}
    for found in side_by_side({w: (lambda w=w: run_cases(first[w], w, root, "-first")) for w in first}).values():
        results.update(found)
    then: dict[int, list[dict]] = {}
    for name, (rung, source) in RESUMED.items():
        out = root / f"resumed-{name}"
        if (root / source / "checkpoint-2").is_dir():  # else the source's failure is reported by its own test
            shutil.copytree(root / source / "checkpoint-2", out / "checkpoint-2")
        then.setdefault(RUNGS[rung], []).append({"id": f"resumed/{name}", "output_dir": str(out),
                                                 "args": [*_args(base), *_layout(rung), "--resume"]})
    for found in side_by_side({w: (lambda w=w: run_cases(then[w], w, root, "-resumed")) for w in then}).values():
        results.update(found)
    for cases in [*first.values(), *then.values()]:
        for case in cases:
            results[case["id"]]["dir"] = Path(case["output_dir"])
    return results


def _summary(runs: dict, name: str) -> dict:
    assert runs[name]["error"] is None, f"{name} failed:\n{runs[name]['error']}"
    return runs[name]["summary"]


def _trainable_parameters(base: Path) -> int:
    """The adapters' parameters, counted on the model's structure (peft's injection on the meta device)."""
    from hfdist.models.build import inject_lora, meta_model

    model = inject_lora(meta_model(str(base)), 16, 32)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("rung", RUNGS)
def test_checkpoints_hold_the_adapters_and_their_state(runs, base, rung):
    summary = _summary(runs, rung)
    contents = summary["checkpoint_contents"]
    assert contents["holds"] == "adapters" and "AdamW's two moments" in contents["counted"]
    # fp32 value + two moments; ZeRO-1/2 write the module's copy beside their fp32 master partitions (fp32 here).
    zero12 = load_rung(rung).uses_deepspeed and load_rung(rung).zero_stage < 3
    assert contents["counted_bytes"] == (16 if zero12 else 12) * _trainable_parameters(base)
    checkpoints = summary["checkpoints"]
    assert [c["step"] for c in checkpoints] == [2, 4]
    for record in checkpoints:
        folder = runs[rung]["dir"] / f"checkpoint-{record['step']}"
        on_disk = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        assert record["bytes"] == on_disk
        assert on_disk <= SIZE_LIMIT * contents["counted_bytes"], (rung, on_disk, contents["counted_bytes"])
        assert record["held_s"] > 0
    last = runs[rung]["dir"] / "checkpoint-4"
    assert not list(last.glob("*.safetensors")), "a second copy of the adapters (or the base) in the checkpoint"
    if (last / "sharded").is_dir():
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(str(last / "sharded")).read_metadata().state_dict_metadata
        weights = [k for k in keys if k.startswith("model.")]
        assert weights and all(".lora_" in k for k in weights), [k for k in weights if ".lora_" not in k][:3]
    record = json.loads((last / "hfdist_checkpoint.json").read_text())
    assert record["adapters_only"] and record["base"]["model"] == str(base) and record["base"]["weights"]


@pytest.mark.parametrize("name", RESUMED)
def test_resumed_run_continues_the_uninterrupted_one(runs, name):
    rung, source = RESUMED[name]
    resumed, uninterrupted = _summary(runs, f"resumed/{name}"), _summary(runs, source)
    assert resumed["resumed_from"].endswith("checkpoint-2") and resumed["strategy"]["name"] == rung
    # The resumed run records steps 3 and 4 (its log history carries steps 1 and 2 from the checkpoint).
    assert resumed["losses"][-2:] == pytest.approx(uninterrupted["losses"][2:], rel=RESUME_RTOL)
    assert resumed["grad_norms"][-2:] == pytest.approx(uninterrupted["grad_norms"][2:], rel=RESUME_RTOL)


def test_another_base_under_the_same_path_is_refused_before_launch(runs, base, tmp_path):
    """The base folder's weights replaced by another seed's (same config): the fsdp_full_shard run's checkpoint does
    not resume onto it, and nothing starts."""
    _summary(runs, "fsdp_full_shard")
    out = tmp_path / "resume"
    shutil.copytree(runs["fsdp_full_shard"]["dir"] / "checkpoint-2", out / "checkpoint-2")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    weights = base / "model.safetensors"
    kept = tmp_path / "kept.safetensors"
    shutil.copy2(weights, kept)
    try:
        _save_llama(base, json.loads((base / "config.json").read_text())["vocab_size"], seed=12)
        proc = run_cmd([sys.executable, str(FINETUNE), *_args(base), "--config", "fsdp_full_shard", "--resume",
                        "--output-dir", str(out)])
    finally:
        shutil.copy2(kept, weights)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    saved = json.loads((out / "checkpoint-2" / "hfdist_checkpoint.json").read_text())["base"]
    assert "trained on another base" in proc.stderr and f"weights {saved['weights']} vs " in proc.stderr
    assert "accelerate" not in proc.stdout and sorted(p.relative_to(out) for p in out.rglob("*")) == before


@pytest.mark.parametrize("rung", RUNGS)
def test_saved_adapter_reloads_with_the_trained_loss(runs, base, rung):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from helpers import check_batch

    summary = _summary(runs, rung)
    adapter = load_file(runs[rung]["dir"] / "adapter_model.safetensors")
    assert {int(k.split("layers.")[1].split(".")[0]) for k in adapter} == {0, 1}  # every layer's (every stage's)
    assert all(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k), "an adapter never trained"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), runs[rung]["dir"]).eval()
    with torch.no_grad():
        loss = model(**check_batch(summary)).loss.item()
    assert loss == pytest.approx(summary["check_batch_loss"], rel=1e-5)


# fsdp_tp left out: TP keeps half of each LoRA pair replicated, and the planner splits adapters by tp (as
# test_finetune_ladder.py leaves it out).
@pytest.mark.parametrize("rung", [r for r in RUNGS if r != "fsdp_tp"])
def test_planner_predicts_each_ranks_bytes(runs, base, rung):
    from hfdist.config.ladder import load_rung
    from hfdist.models.presets import load_config
    from hfdist.plan import predict_state_bytes

    summary, config = _summary(runs, rung), load_config(str(base))
    want = predict_state_bytes(config, load_rung(rung), world=summary["strategy"]["world_size"], dtype="fp32",
                               lora=True)
    # DeepSpeed reduces the adapters' gradients through its reduce bucket ("auto": hidden^2 fp32 elements), which the
    # planner counts under buffers: the measured gradients may hold it (as test_finetune_ladder.py allows on zero2).
    bucket = 4 * config.hidden_size ** 2 if load_rung(rung).uses_deepspeed else 0
    for r in summary["ranks"]:
        assert r["param_bytes"] == pytest.approx(want.param_bytes, rel=0.02)
        assert r["optimizer_bytes"] + r["master_bytes"] == pytest.approx(want.optimizer_bytes, rel=0.02)
        assert 0.98 * want.grad_bytes <= r["grad_bytes"] <= 1.02 * want.grad_bytes + bucket, r


def test_merged_export_loads_with_the_trained_loss(runs, tmp_path):
    """`hfdist checkpoint export --merge` of zero3's adapter checkpoint: the base read again from the run's --model,
    the adapters from DeepSpeed's partitions, one bf16 model with the trained model's loss (bf16: 2e-2)."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers import check_batch

    summary = _summary(runs, "zero3")
    out = tmp_path / "merged"
    proc = run_cmd([sys.executable, "-m", "hfdist.cli", "checkpoint", "export", str(runs["zero3"]["dir"]), "--to", "hf",
                    str(out), "--merge"], cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        loss = model(**check_batch(summary)).loss.item()
    assert loss == pytest.approx(summary["check_batch_loss"], rel=2e-2)
