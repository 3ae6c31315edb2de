"""Bad input over the job's whole surface, refused by the checks that run before any process starts (the parser,
hfdist.job.preflight, and the data the launching process prepares): one paragraph naming the thing and the fix,
nothing created. In-process, as `hfdist finetune` runs them before it hands over; tests/e2e/test_cli_errors.py runs
the same checks through the command line (exit code 2, no process started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hfdist.config.finetune import parse_args
from hfdist.errors import HfdistError

TINY = ["--model", "llama-tiny", "--seq-len", "64", "--global-batch-size", "8", "--max-steps", "2"]
GOOD = [{"role": "user", "content": "Add 1 and 2."}, {"role": "assistant", "content": "3"}]


def refused(tmp_path: Path, *args: str) -> str:
    """The paragraph the checks before any process refuse `args` with; asserts nothing was created."""
    from hfdist.config.dims import batch_layout
    from hfdist.job.preflight import preflight
    from hfdist.job.world import Node, resolve_rung

    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    cfg = parse_args([*TINY, "--output-dir", str(tmp_path / "o"), *args])
    with pytest.raises(HfdistError) as err:
        rung = resolve_rung(cfg, Node())
        preflight(cfg, rung, batch_layout(cfg.global_batch_size, cfg.micro_batch_size, rung.dims.dp)[0])
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing created or removed
    said = str(err.value)
    assert "\n" not in said.strip(), said  # one paragraph
    return said


def _rows(tmp_path: Path, rows, name: str = "data.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def checkpoint(tmp_path):
    """A tiny Llama checkpoint as HF ships one: config, bf16 safetensors in two shards with an index, tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hfdist.data import load_tokenizer

    folder = tmp_path / "ckpt"
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1024)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder, max_shard_size="200KB")
    load_tokenizer(None, is_preset=True).save_pretrained(folder)
    assert len(list(folder.glob("*.safetensors"))) > 1
    return folder


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


# -- the output path -------------------------------------------------------------------------------------------------

def test_an_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "o").write_text("a file")
    assert refused(tmp_path).startswith(f"--output-dir {tmp_path / 'o'} is a file, not a folder")
    assert (tmp_path / "o").read_text() == "a file"


def test_an_output_dir_inside_a_file(tmp_path):
    (tmp_path / "f").write_text("a file")
    said = refused(tmp_path, "--output-dir", str(tmp_path / "f" / "run"))
    assert f"lies inside {tmp_path / 'f'}, which is a file" in said


# -- the model folder ------------------------------------------------------------------------------------------------

def test_a_safetensors_shard_cut_short(tmp_path, checkpoint):
    shard = _shards(checkpoint)[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    said = refused(tmp_path, "--model", str(checkpoint), "--config", "fsdp_full_shard")
    assert f"{shard} is cut short: it holds" in said and "Copy or download the file again" in said


def test_a_file_that_is_not_safetensors(tmp_path, checkpoint):
    _shards(checkpoint)[0].write_bytes(b"<html>rate limited</html>")
    assert "is not a readable safetensors file" in refused(tmp_path, "--model", str(checkpoint))


def test_an_index_naming_a_missing_shard(tmp_path, checkpoint):
    _shards(checkpoint)[0].unlink()
    assert "names 1 file(s) the folder does not hold" in refused(tmp_path, "--model", str(checkpoint))


def test_weights_of_another_shape_than_the_config(tmp_path, checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    said = refused(tmp_path, "--model", str(checkpoint))
    assert "holds weights of other shapes than its config.json" in said and "mlp.up_proj.weight is [128, 64]" in said


def test_weights_missing_from_the_checkpoint(tmp_path, checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    assert "lacks 9 of the model's weights (e.g. ['model.layers.2." in refused(tmp_path, "--model", str(checkpoint))


def test_a_config_json_that_is_not_a_config(tmp_path, checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    assert "its config.json is not a model config transformers can read" in refused(tmp_path, "--model",
                                                                                     str(checkpoint))


def test_a_model_folder_without_its_tokenizer(tmp_path, checkpoint):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (checkpoint / name).unlink()
    said = refused(tmp_path, "--model", str(checkpoint))
    assert said.startswith(f"Cannot load the tokenizer of --model {checkpoint}") and "tokenizer files" in said


# -- the data --------------------------------------------------------------------------------------------------------

def test_a_malformed_json_line_is_named_by_its_line_number(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": GOOD}) + "\n" + '{"messages": [\n' + json.dumps({"messages": GOOD}))
    assert "line 2 is not a JSON object (Expecting value, column 15)" in refused(tmp_path, "--dataset", str(path))


@pytest.mark.parametrize("bad, words", [
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}], ["Row 2", "role 'bot'"]),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "assistant", "content": "c"}],
     ["Row 2", "do not alternate", "['user', 'assistant', 'assistant']"]),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], ["Row 2", "no assistant turn"]),
])
def test_a_malformed_row_is_named(tmp_path, bad, words):
    data = _rows(tmp_path, [{"messages": GOOD}] * 2 + [{"messages": bad}] + [{"messages": GOOD}] * 20)
    said = refused(tmp_path, "--dataset", data)
    assert all(w in said for w in words), said


def test_columns_no_format_has(tmp_path):
    data = _rows(tmp_path, [{"question_text": "q", "label": 1}] * 8)
    assert "The dataset has columns ['label', 'question_text']" in refused(tmp_path, "--dataset", data)


def test_a_dataset_that_does_not_exist(tmp_path):
    assert "Cannot load dataset" in refused(tmp_path, "--dataset", str(tmp_path / "missing.jsonl"))


def test_nothing_left_to_train_on_and_too_few_blocks(tmp_path):
    empty = _rows(tmp_path, [{"instruction": "q", "output": ""}, {"instruction": " ", "output": "a"}])
    assert "Nothing to train on" in refused(tmp_path, "--dataset", empty)
    few = _rows(tmp_path, [{"messages": GOOD}] * 10, "few.jsonl")
    assert "fewer than the --global-batch-size of 16" in refused(tmp_path, "--dataset", few,
                                                               "--global-batch-size", "16")


def test_a_long_document_under_long_documents_error(tmp_path):
    long = [{"role": "user", "content": " ".join(["apple"] * 80)}, {"role": "assistant", "content": "ok"}]
    data = _rows(tmp_path, [{"messages": GOOD}] * 20 + [{"messages": long}])
    assert "Row 20 of the dataset is" in refused(tmp_path, "--dataset", data, "--long-documents", "error")


def test_a_held_out_fraction_that_leaves_no_training_document(tmp_path):
    data = _rows(tmp_path, [{"messages": GOOD}] * 30)
    said = refused(tmp_path, "--dataset", data, "--eval-fraction", "0.99")
    assert "--eval-fraction 0.99 of the dataset's 30 rows leaves no document on the train side" in said


def test_a_mixture_whose_sources_do_not_go_together(tmp_path, capsys):
    said = refused(tmp_path, "--dataset", "a.jsonl,weight=0.5", "--dataset", "b.jsonl")
    assert said.startswith("Sources a have a weight and b do not. Weights are shares of the mixture's label tokens")
    with pytest.raises(SystemExit) as exit_info:  # a bad setting in a spec: argparse's one line, exit 2
        parse_args(["--dataset", "a.jsonl,weight=half"])
    assert exit_info.value.code == 2 and "weight='half' is not a number" in capsys.readouterr().err


def test_eval_prompts_need_held_out_data_a_file_and_a_schedule_that_generates(tmp_path):
    assert "--eval-prompts 4 evaluates on held-out data, and the job has none" in refused(tmp_path, "--eval-prompts",
                                                                                          "4")
    assert "--eval-prompts " in refused(tmp_path, "--eval-fraction", "0.1", "--eval-prompts",
                                        str(tmp_path / "missing.jsonl"))
    said = refused(tmp_path, "--config", "pp", "--pp-schedule", "ZBVZeroBubble", "--eval-fraction", "0.1",
                   "--eval-prompts", "2")
    assert "forward-only schedule, which torch 2.13 cannot run for ZBVZeroBubble" in said


def test_prepared_data_of_another_job(tmp_path):
    from hfdist.data import load_tokenizer
    from hfdist.job.data import job_data

    prepared = tmp_path / "prepared"
    job_data(parse_args([*TINY, "--prepared-data", str(prepared)]), load_tokenizer(None, is_preset=True))
    said = refused(tmp_path, "--prepared-data", str(prepared), "--seq-len", "32", "--eval-fraction", "0.1")
    assert "was made for another job (--eval-fraction: prepared with None, this job has 0.1; --seq-len: prepared " \
           "with 64, this job has 32)" in said and "Run `hfdist prepare` again" in said


def test_prepared_data_that_is_not_a_prepared_folder(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "x.txt").write_text("mine")
    assert "holds no prepared data" in refused(tmp_path, "--prepared-data", str(tmp_path / "notes"))


# -- the settings ----------------------------------------------------------------------------------------------------

def test_lora_dropout_on_a_tensor_parallel_rung(tmp_path):
    said = refused(tmp_path, "--config", "fsdp_tp", "--lora", "--lora-dropout", "0.1")
    assert said.startswith("--lora-dropout 0.1 on fsdp_tp, which splits the projections over tp=2 ranks")


def test_lora_target_modules_the_model_lacks(tmp_path):
    said = refused(tmp_path, "--lora", "--lora-target-modules", "q_proj,qkv_proj")
    assert said.startswith("--lora-target-modules names qkv_proj, which is not a decoder projection")


def test_evaluation_settings_without_held_out_data(tmp_path):
    assert refused(tmp_path, "--eval-steps", "10").startswith("--eval-steps evaluates on held-out data, and the job "
                                                             "has none")
    said = refused(tmp_path, "--eval-fraction", "0.1", "--load-best", "--save-steps", "0")
    assert said.startswith("--load-best saves the best checkpoint as the model, and --save-steps 0 writes no")


def test_a_stale_deepspeed_build_lock_is_refused_and_left(tmp_path, monkeypatch):
    """A lock file in a torch extension build folder older than any build (a process killed while DeepSpeed loaded
    its op) would keep every rank of a DeepSpeed rung waiting forever: refused, naming the file, which is left as it
    is; a recent one (a build under way) and a rung without DeepSpeed go on."""
    import os
    import time

    from hfdist.config.ladder import load_rung
    from hfdist.job.op_builds import STALE_BUILD_LOCK_SECONDS, check_deepspeed_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    check_deepspeed_build_locks(load_rung("zero3"))  # a build may be running
    old = time.time() - STALE_BUILD_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with pytest.raises(HfdistError) as err:
        check_deepspeed_build_locks(load_rung("zero3"))
    assert str(lock) in str(err.value) and "remove the file" in str(err.value)
    assert lock.is_file()
    check_deepspeed_build_locks(load_rung("fsdp_full_shard"))
