"""One source for the job's options (hfdist.config.options): every FinetuneConfig field is a flag, a job-file key
and a row of docs/options.md, generated from the field; the generator itself on a small dataclass."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import pytest
import yaml

from hfdist.config.finetune import FinetuneConfig, build_parser, parse_args
from hfdist.config.job_file import JobFileError, parse_with_job_file
from hfdist.config.options import (
    OptionGroup,
    add_options,
    dataclass_from_namespace,
    flag_of,
    option,
    options_markdown,
    options_of,
)

from helpers import REPO

OPTIONS_PAGE = REPO / "docs" / "options.md"
GENERATED_FROM = "<!-- generated from"


def test_every_field_is_an_option():
    fields = {f.name for f in dataclasses.fields(FinetuneConfig)}
    assert fields == {f.name for f, _ in options_of(FinetuneConfig)}, "a FinetuneConfig field without option()"


def test_every_field_is_on_the_command_line_in_job_files_and_in_the_docs(tmp_path):
    parser = build_parser()
    flags = {flag for action in parser._actions for flag in action.option_strings}
    page = OPTIONS_PAGE.read_text()
    for f in dataclasses.fields(FinetuneConfig):
        assert flag_of(f.name) in flags, f"{f.name} has no {flag_of(f.name)}"
        assert f"| `{f.name}` |" in page, f"docs/options.md has no row for {f.name}"
    # A job file may set every field: one file holding every default parses to the default config.
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({f.name: list(f.default) if isinstance(f.default, tuple) else f.default
                                   for f in dataclasses.fields(FinetuneConfig)}))
    assert parse_args([str(job)]) == FinetuneConfig()


def test_the_docs_table_is_the_generated_one():
    page = OPTIONS_PAGE.read_text()
    assert GENERATED_FROM in page
    generated = page[page.index(GENERATED_FROM):]
    assert generated == options_markdown(FinetuneConfig), (
        "docs/options.md is out of date with FinetuneConfig: replace everything from its '<!-- generated from' line "
        "with the output of `python -c 'from hfdist.config.finetune import FinetuneConfig; from "
        "hfdist.config.options import options_markdown; print(options_markdown(FinetuneConfig), end=\"\")'`")


GROUP = OptionGroup("Things", "What the things are.")


@dataclass(frozen=True)
class _Settings:
    size: int = option(3, "How big (default {default}; 100% of it).", group=GROUP, type=int)
    shiny: bool = option(False, "Make it shiny.", group=GROUP)
    steps: int = option(10, "Steps (default {default}).", group=GROUP, type=int, exclusive="length")
    epochs: float | None = option(None, "Epochs instead.", group=GROUP, type=float, exclusive="length")
    rate: float = option(0.5, "Rate.", group=GROUP, type=float, aliases=("--r",), choices=(0.5, 1.0))
    not_an_option: str = "x"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_options(p, _Settings)
    return p


def test_the_generator_turns_fields_into_flags_with_defaults_written_once():
    p = _parser()
    assert dataclass_from_namespace(_Settings, p.parse_args([])) == _Settings()
    got = dataclass_from_namespace(_Settings, p.parse_args(["--size", "7", "--shiny", "--epochs", "1.5", "--r", "1"]))
    assert got == _Settings(size=7, shiny=True, epochs=1.5, rate=1.0)
    assert dataclass_from_namespace(_Settings, p.parse_args(["--shiny", "--no-shiny"])).shiny is False
    assert "How big (default 3; 100% of it)." in p.format_help()
    assert "--not-an-option" not in p.format_help()
    with pytest.raises(argparse.ArgumentError, match="not allowed with"):  # exit 2 on a real command line
        p.parse_args(["--steps", "2", "--epochs", "1"])
    with pytest.raises(argparse.ArgumentError):
        p.parse_args(["--rate", "0.7"])


def test_a_job_file_refuses_both_members_of_an_exclusive_group(tmp_path):
    p = _parser()
    p.add_argument("job", nargs="?")
    job = tmp_path / "job.yaml"
    job.write_text("steps: 2\nepochs: 1.0\n")
    keys = {f.name for f, _ in options_of(_Settings)}
    with pytest.raises(JobFileError, match="exclude each other"):
        parse_with_job_file(p, [str(job)], keys)


def test_the_generated_table_names_flags_keys_defaults_and_choices():
    table = options_markdown(_Settings)
    assert "### Things" in table and "What the things are." in table
    assert "| `--size` | `size` | `3` | How big (default 3; 100% of it). |" in table
    assert "| `--shiny / --no-shiny` | `shiny` | `False` | Make it shiny. |" in table
    assert "| `--rate`, `--r` | `rate` | `0.5` | Rate. Choices: 0.5, 1.0. |" in table
    assert "not_an_option" not in table
