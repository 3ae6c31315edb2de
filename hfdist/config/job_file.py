"""Job files: every setting of a command as one YAML file, read with the command line's own parser.

    hfdist finetune job.yaml                       # or --job job.yaml
    hfdist finetune job.yaml --max-steps 10        # a flag given on the command line wins over the file
    hfdist finetune job.yaml --print-job           # the resolved job, as a job file

A key is an option's name with underscores (`seq_len`, `lora_target_modules`; an alias's too: `lr`); a value is what
the option takes, checked by the option's own type and choices, so a job file and the command line refuse the same
values. Lists may be YAML lists or comma-separated strings; on/off settings are YAML booleans; null leaves a setting at
its default; an option given several times on the command line (--dataset) takes a YAML list, whose entries its type
reads (a string, or a mapping where the type takes one).
Relative paths in the file count from the working directory, as on the command line. Precedence: the command line,
then the job file, then the defaults.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from hfdist.errors import HfdistError

__all__ = ["JobFileError", "CommandParser", "JOB_FILE_NAME", "read_job_file", "parse_with_job_file", "job_yaml"]

JOB_FILE_NAME = "hfdist_job.yaml"  # the resolved job, saved in the run's output folder
_ON_OFF = (argparse.BooleanOptionalAction, argparse._StoreTrueAction, argparse._StoreFalseAction)


class JobFileError(HfdistError, ValueError):
    """A job file that cannot be read, or holds an unknown key or a value its option refuses."""


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, refusing a command line in one paragraph: the problem and where the options are listed
    (argparse's own refusal prints the whole usage first, some twenty lines for `hfdist finetune`). Exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}. `{self.prog} --help` lists the options.\n")


def read_job_file(path: str) -> dict[str, Any]:
    """The settings a job file holds, keys normalised to underscores.

    Raises:
        JobFileError: no such file, not YAML, or not a mapping of settings.
    """
    import yaml

    file = Path(path)
    if not file.is_file():
        what = "is a folder" if file.is_dir() else "does not exist"
        raise JobFileError(f"The job file {path} {what}. Pass a YAML file of settings (`hfdist finetune "
                           "--print-job > job.yaml` writes one with every setting to start from).")
    try:
        data = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise JobFileError(f"The job file {path} is not valid YAML{line} ({getattr(exc, 'problem', None) or exc}). "
                           "Fix the file: one `key: value` per line, keys as the flags' names with underscores.") \
            from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise JobFileError(f"The job file {path} holds a {type(data).__name__}, not a mapping of settings. Write one "
                           "`key: value` per line (e.g. `model: llama-tiny`), keys as the flags' names with "
                           "underscores.")
    return {str(key).lstrip("-").replace("-", "_"): value for key, value in data.items()}


def _given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations the command line sets itself (parsed once more with every default suppressed)."""
    saved = [(action, action.default) for action in parser._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for action, default in saved:
            action.default = default


def _refuse_key(path: str, key: str, keys: Collection[str]) -> JobFileError:
    close = difflib.get_close_matches(key, keys, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return JobFileError(f"The job file {path} has the key '{key}', which is no setting of this command{hint}. Keys "
                        "are the flags' names with underscores; `--print-job` writes every one with its value. "
                        "Rename or remove the key.")


def _value(path: str, key: str, action: argparse.Action, value: Any) -> Any:
    """A job file's value, through its option's own type and choices."""
    flag = f"--{key.replace('_', '-')}"
    if value is None:
        return None
    if isinstance(action, _ON_OFF):
        if not isinstance(value, bool):
            raise JobFileError(f"The job file {path} sets {key} to {value!r}; it is an on/off setting ({flag}): "
                               "write true or false.")
        return value
    if isinstance(action, argparse._AppendAction):  # every entry through the type, as each flag's value would be
        entries = value if isinstance(value, (list, tuple)) else [value]
        return [_value(path, key, argparse.Action([], action.dest, type=action.type, choices=action.choices), v)
                for v in entries]
    if isinstance(value, (list, tuple)) and not value and isinstance(action.default, tuple):
        return ()  # an empty list where the setting is a list: none of them (--report-to none prints as [])
    if isinstance(value, dict) and action.type is not None:  # a mapping, for a type that reads one
        text: Any = value
    else:
        text = ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)
    try:
        result = action.type(text) if action.type is not None else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        reason = str(exc) if isinstance(exc, argparse.ArgumentTypeError) else "not a value it takes"
        raise JobFileError(f"The job file {path} sets {key} to {value!r}, which {flag} refuses: {reason}. Fix the "
                           f"value (`hfdist finetune --help` says what {flag} takes).") from exc
    if action.choices is not None and result not in action.choices:
        raise JobFileError(f"The job file {path} sets {key} to {value!r}; {flag} takes one of "
                           f"{', '.join(map(str, action.choices))}. Pick one of these.")
    return result


def _by_destination(path: str, values: dict[str, Any], actions: dict[str, argparse.Action]) -> dict[str, Any]:
    """A job file's values keyed by their options' destinations (a key may be an alias's name: `lr`, `datasets`).

    Raises:
        JobFileError: an unknown key, or two keys of one setting.
    """
    negative = {flag for a in actions.values() if isinstance(a, argparse.BooleanOptionalAction)
                for flag in a.option_strings if flag.startswith("--no-")}
    names = {flag[2:].replace("-", "_"): dest for dest, a in actions.items() for flag in a.option_strings
             if flag.startswith("--") and flag not in negative}
    names.update({dest: dest for dest in actions})
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in names:
            raise _refuse_key(path, key, names)
        dest = names[key]
        if dest in out:
            raise JobFileError(f"The job file {path} sets {dest} twice (as {dest} and as {key}). Keep one key.")
        out[dest] = value
    return out


def parse_with_job_file(parser: argparse.ArgumentParser, argv: list[str], keys: Collection[str]) -> argparse.Namespace:
    """`argv` parsed by `parser`, over the values of the job file it names (the positional `job`, or `--job`).

    Args:
        keys: the destinations a job file may set (the command's settings; not `job` or `print_job` themselves).

    Raises:
        JobFileError: two job files, or a file that cannot be read or holds an unknown key or a refused value.
    """
    args = parser.parse_args(argv)
    files = [f for f in (getattr(args, "job", None), getattr(args, "job_file", None)) if f]
    if len(files) > 1:
        raise JobFileError(f"Two job files were given ({files[0]} and --job {files[1]}). Pass one.")
    if not files:
        return args
    path = files[0]
    actions = {a.dest: a for a in parser._actions if a.dest in keys}
    values = _by_destination(path, read_job_file(path), actions)
    given = _given(parser, argv)
    for group in parser._mutually_exclusive_groups:
        members = [a.dest for a in group._group_actions]
        in_file = [m for m in members if values.get(m) is not None]
        if len(in_file) > 1:
            raise JobFileError(f"The job file {path} sets both {' and '.join(in_file)}, which exclude each other. "
                               "Keep one (or set the other to null).")
        if any(m in given for m in members):  # the command line's choice replaces the file's
            values = {k: v for k, v in values.items() if k not in members}
    for key, value in values.items():
        if key not in given:
            setattr(args, key, _value(path, key, actions[key], value))
    return args


def job_yaml(values: Mapping[str, Any], parser: argparse.ArgumentParser, command: str) -> str:
    """`values` (every setting) as a job file for `command`, grouped and ordered as its `--help` lists them."""
    import yaml

    lines = [f"# A job file of `{command}`: `{command} THIS.yaml` runs it; flags given on the command line win "
             "over these values."]
    for group in parser._action_groups:
        keys = [a.dest for a in group._group_actions if a.dest in values]
        if not keys:
            continue
        lines.append(f"\n# {group.title}")
        for key in keys:
            value = values[key]
            value = list(value) if isinstance(value, tuple) else value
            lines.append(yaml.safe_dump({key: value}, default_flow_style=True, sort_keys=False, width=1000)
                         .strip().removeprefix("{").removesuffix("}"))
    return "\n".join(lines) + "\n"
