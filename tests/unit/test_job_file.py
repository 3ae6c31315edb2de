"""Job files (hfdist.config.job_file): every flag in one YAML file, flags overriding it, bad keys and values refused
by name, the resolved job printed and read back; the optimisation flags' values reach the Trainer as its own."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hfdist.config.finetune import LR_SCHEDULERS, FinetuneConfig, job_text, optimisation_arguments, parse_args
from hfdist.config.job_file import JobFileError

REPO = Path(__file__).resolve().parents[2]
JOBS = sorted((REPO / "hfdist" / "configs" / "jobs").glob("*.yaml"))


def _job(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


def test_a_job_file_sets_every_kind_of_setting(tmp_path):
    job = _job(tmp_path, "model: llama-tiny\nseq-len: 64\nlora: true\nlora_target_modules: [q_proj, v_proj]\n"
                         "report_to: mlflow,tensorboard\nlearning_rate: 2e-4\nnum_epochs: 2\nconfig: null\n")
    for argv in ([job], ["--job", job]):
        cfg = parse_args(argv)
        assert (cfg.model, cfg.seq_len, cfg.lora, cfg.learning_rate, cfg.num_epochs) == ("llama-tiny", 64, True,
                                                                                         2e-4, 2.0)
        assert cfg.lora_target_modules == ("q_proj", "v_proj") and cfg.report_to == ("mlflow", "tensorboard")
        assert cfg.config is None and cfg.max_steps == FinetuneConfig.max_steps


def test_the_command_line_wins_over_the_file(tmp_path):
    job = _job(tmp_path, "seq_len: 64\nlora: true\nnum_epochs: 2\nreport_to: [mlflow]\n")
    cfg = parse_args([job, "--seq-len", "32", "--no-lora", "--max-steps", "5", "--no-wandb"])
    assert (cfg.seq_len, cfg.lora, cfg.max_steps, cfg.num_epochs) == (32, False, 5, None)
    assert cfg.report_to == ("mlflow",)  # --no-wandb removes wandb only
    assert parse_args([job, "--report-to", "none"]).report_to == ()


@pytest.mark.parametrize("text, said", [
    ("lerning_rate: 1e-3\n", "the key 'lerning_rate', which is no setting of this command (did you mean "
                             "learning_rate?)"),
    ("seq_len: 0\n", "sets seq_len to 0, which --seq-len refuses: must be 1 or more"),
    ("seq_len: many\n", "sets seq_len to 'many', which --seq-len refuses"),
    ("lora: yes please\n", "sets lora to 'yes please'; it is an on/off setting (--lora): write true or false"),
    ("lr_scheduler: cosin\n", "lr_scheduler to 'cosin'; --lr-scheduler takes one of cosine, linear"),
    ("report_to: [wandb, comet]\n", "unknown tracker comet"),
    ("max_steps: 5\nnum_epochs: 1\n", "sets both max_steps and num_epochs, which exclude each other"),
    ("- model\n- llama-tiny\n", "holds a list, not a mapping of settings"),
    ("model: [unclosed\n", "is not valid YAML at line 2"),
    ("print_job: true\n", "the key 'print_job', which is no setting"),
])
def test_bad_job_files_are_refused_by_name(tmp_path, text, said):
    with pytest.raises(JobFileError, match=None) as err:
        parse_args([_job(tmp_path, text)])
    assert said in str(err.value), str(err.value)
    assert "\n" not in str(err.value)  # one paragraph


def test_a_missing_job_file_and_two_job_files(tmp_path):
    with pytest.raises(JobFileError, match="does not exist"):
        parse_args([str(tmp_path / "nope.yaml")])
    job = _job(tmp_path, "seed: 1\n")
    with pytest.raises(JobFileError, match="Two job files"):
        parse_args([job, "--job", job])


def test_the_printed_job_reads_back_as_the_same_job(tmp_path):
    cfg = parse_args(["--model", "llama-tiny", "--num-epochs", "1.5", "--lora", "--lora-target-modules", "q_proj",
                      "--report-to", "mlflow,tensorboard", "--weight-decay", "0.1", "--lr-scheduler", "linear"])
    text = job_text(cfg)
    assert text.startswith("# A job file of `hfdist finetune`") and "\n# Strategy\n" in text
    assert "max_steps: null" in text  # --num-epochs decides the length
    assert parse_args([_job(tmp_path, text)]) == cfg
    assert parse_args([_job(tmp_path, job_text(FinetuneConfig()))]) == FinetuneConfig()


def test_every_setting_is_a_job_file_key():
    """A field of FinetuneConfig without an option could never be set from a file (or the command line)."""
    from hfdist.config.finetune import build_parser

    dests = {a.dest for a in build_parser()._actions}
    assert set(FinetuneConfig.__dataclass_fields__) <= dests


def test_the_optimisation_flags_reach_the_trainer_as_its_own_settings():
    cfg = parse_args(["--lr-scheduler", "linear", "--weight-decay", "0.1", "--max-grad-norm", "0", "--max-steps",
                      "50", "--warmup-steps", "20"])
    assert optimisation_arguments(cfg) == {"max_steps": 50, "num_train_epochs": 1.0, "learning_rate": 1e-3,
                                           "lr_scheduler_type": "linear", "warmup_steps": 5, "weight_decay": 0.1,
                                           "max_grad_norm": 0.0}
    epochs = optimisation_arguments(replace(cfg, num_epochs=2.0))
    assert epochs["max_steps"] == -1 and epochs["num_train_epochs"] == 2.0 and epochs["warmup_steps"] == 20


def test_every_offered_scheduler_builds_with_the_trainers_settings_alone():
    import torch
    from transformers import get_scheduler
    from transformers.trainer_utils import SchedulerType

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    for name in LR_SCHEDULERS:
        assert name in {s.value for s in SchedulerType}
        scheduler = get_scheduler(name, optimizer, num_warmup_steps=2, num_training_steps=10)
        for _ in range(10):
            optimizer.step()
            scheduler.step()


# The shipped jobs name the hub's models; the suite runs offline, on the presets of the same configs.
_PRESETS = {"meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b", "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b"}


def test_the_examples_are_shipped():
    assert [p.name for p in JOBS] == ["llama-3.1-70b-full.yaml", "llama-3.1-8b-lora.yaml"]


@pytest.mark.parametrize("job", JOBS, ids=[p.stem for p in JOBS])
def test_shipped_job_files_are_complete_jobs_that_fit(job):
    """Each example parses, holds out data and evaluates, and its rung fits 80 GB GPUs in the memory planner."""
    from hfdist.config.dims import batch_layout
    from hfdist.job.preflight import check_lora, plan_check
    from hfdist.job.world import Node, resolve_rung
    from hfdist.models.presets import load_config
    from hfdist.parallel.fit import check_model_fits

    cfg = parse_args([str(job)])
    assert cfg.dataset and cfg.prepared_data and cfg.eval_fraction and cfg.eval_steps and cfg.load_best
    cfg = replace(cfg, model=_PRESETS[cfg.model], num_processes=cfg.num_processes or 8, gpu_mem_gb=80)
    rung = resolve_rung(cfg, Node())
    micro, _ = batch_layout(cfg.global_batch_size, cfg.micro_batch_size, rung.dims.dp)
    config = load_config(cfg.model)
    check_model_fits(config, rung)
    check_lora(cfg, rung, config)
    plan_check(cfg, rung, micro)  # raises ConfigError when the planner predicts it cannot fit


def test_lr_schedulers_and_trackers_are_refused_on_the_command_line(capsys):
    from hfdist.config.finetune import build_parser

    for argv in (["--lr-scheduler", "cosine_with_min_lr"], ["--report-to", "none,wandb"], ["--max-grad-norm", "-1"],
                 ["--lora-dropout", "1"], ["--global-batch-size", "0"]):
        with pytest.raises(SystemExit) as stop:
            build_parser(prog="hfdist finetune").parse_args(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("hfdist finetune: error: argument") and err.count("\n") == 1, err
