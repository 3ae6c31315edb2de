"""Bad input to scripts/finetune.py: one paragraph naming problem and fix, exit 2, nothing overwritten."""

from __future__ import annotations

import sys

import pytest

from helpers import FINETUNE, REPO, accelerate, run_cmd


def _finetune(*args):
    return run_cmd([sys.executable, str(FINETUNE), *args], timeout=300)


def test_unknown_config_lists_known_ones(tmp_path):
    proc = _finetune("--config", "fsdp_hybird.yaml", "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert "Unknown config 'fsdp_hybird.yaml'" in proc.stderr and "fsdp_hybrid" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_non_empty_output_dir_is_left_alone(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    proc = _finetune("--output-dir", str(out), "--max-steps", "1")
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"


def test_batch_not_divisible_by_ranks(tmp_path):
    proc = _finetune("--config", "fsdp_hybrid", "--global-batch-size", "6", "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2 and "not divisible by the 4 data-parallel ranks" in proc.stderr


def test_sequence_longer_than_positions(tmp_path):
    proc = _finetune("--model", "llama-tiny", "--seq-len", "1024", "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2 and "max_position_embeddings 512" in proc.stderr


def test_tp_not_dividing_the_heads(tmp_path):
    from transformers import LlamaConfig

    model = tmp_path / "three_heads"
    LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3,
                num_key_value_heads=3, vocab_size=1024).save_pretrained(model)
    proc = _finetune("--config", "fsdp_tp", "--model", str(model), "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "3" in proc.stderr and "tp" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_planner_refuses_a_rung_that_cannot_fit(tmp_path):
    proc = _finetune("--config", "ddp", "--model", "llama-3.1-8b", "--gpu-mem-gb", "80",
                     "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert "ddp is predicted to need" in proc.stderr and "fastest predicted layout that fits" in proc.stderr
    assert "--config fsdp_tp.yaml" in proc.stderr  # the command that would fit
    assert "fsdp_full_shard" in proc.stderr  # the planner's table is shown


def test_world_of_the_wrong_size_is_refused(tmp_path):
    """A 2-process world (the ddp YAML) asked to run the 4-process fsdp_hybrid rung: refused, naming both."""
    proc = run_cmd(accelerate("--config_file", str(REPO / "accelerate_configs" / "ddp.yaml"), str(FINETUNE),
                              "--config", "fsdp_hybrid", "--model", "llama-tiny", "--output-dir", str(tmp_path / "o")),
                   timeout=300)
    assert proc.returncode != 0
    assert "needs 4 processes" in proc.stderr and "this world has 2" in proc.stderr
    assert "--num-processes 2" in proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("config, surgery", [("fsdp_tp", "hfdist's tensor-parallel plan"),
                                             ("pp", "hfdist's pipeline stages")])
def test_surgery_on_an_unregistered_architecture_is_refused(tmp_path, config, surgery):
    from transformers import GPT2Config

    model = tmp_path / "gpt2"
    GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1024).save_pretrained(model)
    proc = _finetune("--config", config, "--model", str(model), "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2 and surgery in proc.stderr and "'gpt2'" in proc.stderr
    assert "llama, mistral, qwen2, qwen3" in proc.stderr  # the architectures that would work


def test_pipeline_with_more_stages_than_layers(tmp_path):
    """An 8-stage pipeline YAML for the 4-layer llama-tiny: refused before any process starts."""
    yaml_text = (REPO / "accelerate_configs" / "pp.yaml").read_text()
    deep = tmp_path / "pp8.yaml"
    deep.write_text(yaml_text.replace("num_processes: 2", "num_processes: 8")
                    .replace("parallelism_config_pp_size: 2", "parallelism_config_pp_size: 8"))
    proc = _finetune("--config", str(deep), "--model", "llama-tiny", "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "8 pipeline stages" in proc.stderr and "only 4 decoder layers" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_fewer_microbatches_than_stages(tmp_path):
    proc = _finetune("--config", "pp", "--pp-microbatches", "1", "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "1F1B needs at least as many micro-batches as pipeline stages" in proc.stderr
    assert "--pp-microbatches" in proc.stderr


def test_microbatches_not_dividing_the_rank_batch(tmp_path):
    proc = _finetune("--config", "pp", "--pp-microbatches", "3", "--global-batch-size", "8",
                     "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2 and "gets 8 sequences per step" in proc.stderr and "dividing 8" in proc.stderr


def test_pipeline_options_on_a_rung_without_stages(tmp_path):
    proc = _finetune("--config", "ddp", "--pp-schedule", "GPipe", "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2 and "pipeline rungs only" in proc.stderr and "pp.yaml" in proc.stderr


def test_deepspeed_json_contradicting_the_command_line(tmp_path):
    """A user's ZeRO-2 JSON that fixes the micro-batch and LR the command line sets differently: refused at once."""
    import json

    ds = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    ds["train_micro_batch_size_per_gpu"] = 2
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
    (tmp_path / "mine.json").write_text(json.dumps(ds))
    yaml_text = (REPO / "accelerate_configs" / "zero2.yaml").read_text()
    (tmp_path / "mine.yaml").write_text(yaml_text.replace("ds_configs/zero2.json", str(tmp_path / "mine.json")))
    proc = _finetune("--config", str(tmp_path / "mine.yaml"), "--global-batch-size", "16", "--learning-rate", "1e-3",
                     "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "train_micro_batch_size_per_gpu is 2 but --micro-batch-size makes it 8" in proc.stderr
    assert "optimizer.params.lr is 0.0001 but --learning-rate makes it 0.001" in proc.stderr
    assert '"auto"' in proc.stderr and not (tmp_path / "o").exists()


def test_bad_input_of_every_kind_is_refused_before_the_hand_over(tmp_path):
    """The command line's own refusals (tests/unit/test_bad_input.py checks each kind in-process): a job file's
    unknown key, a flag's bad value, a safetensors shard cut short and a malformed JSON line each end in one
    paragraph and exit code 2 before any process starts (no "starting N processes"), nothing created."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    model = tmp_path / "ckpt"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=1024)).save_pretrained(model)
    shard = model / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "a b c"}) + "\n" + '{"text": "unclosed\n')
    job = tmp_path / "job.yaml"
    job.write_text("config: fsdp_full_shard\nsequence_length: 64\n")
    cases = {"key": ([str(job)], "the key 'sequence_length', which is no setting of this command"),
             "value": (["--config", "fsdp_full_shard", "--seq-len", "0"], "argument --seq-len: must be 1 or more"),
             "shard": (["--config", "fsdp_full_shard", "--model", str(model)], f"{shard} is cut short"),
             "line": (["--config", "fsdp_full_shard", "--dataset", str(data)], "line 2 is not a JSON object")}
    for name, (args, said) in cases.items():
        proc = _finetune(*args, "--output-dir", str(tmp_path / "o"))
        assert proc.returncode == 2 and said in proc.stderr, (name, proc.stderr[-2000:])
        errors = [line for line in proc.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, (name, proc.stderr[-2000:])
        assert "starting" not in proc.stdout and not (tmp_path / "o").exists(), name


@pytest.mark.parametrize("attention, said", [
    ("flash_attention_2", "needs the 'flash_attn' package, which is not installed here"),
    ("flex_attention", "has no CPU backward"),
    ("kernels-community/paged-attention", "cannot give document boundaries to"),
])
def test_attention_that_cannot_run_here_is_refused_before_any_process(tmp_path, attention, said):
    proc = _finetune("--config", "ddp", "--model", "llama-tiny", "--attn-implementation", attention,
                     "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2 and said in proc.stderr and "--attn-implementation auto" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "starting" not in proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1  # one paragraph
    assert not (tmp_path / "o").exists()
