"""Options as data: every setting of a command is one dataclass field, and its command-line flag, job-file key and
row of the docs' option table are generated from that field.

    @dataclass(frozen=True)
    class Settings:
        seq_len: int = option(128, "Tokens per packed block (default {default}).", group=DATA, type=positive_int)

    add_options(parser, Settings)        # --seq-len, in its argparse group, with its type, choices and --no- form
    options_markdown(Settings)           # the docs' table (docs/options.md is this, checked by tests/unit/test_docs.py)

The field's name is the job file's key and (dashes for underscores) the flag; its default is the command line's and
the job file's default; `{default}` in the help is replaced by it, so a default is written once. An on/off field
(a bool, or `bool | None` whose None the program decides) gets argparse's `--x / --no-x` pair, so a flag can switch
off what a job file switched on. Fields sharing an
`exclusive` name exclude each other on the command line and in a job file; their parser default is None, and
`dataclass_from_namespace` leaves a None to the field's own default.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator

__all__ = ["OptionGroup", "Option", "option", "options_of", "add_options", "dataclass_from_namespace",
           "options_markdown", "flag_of"]

_SPEC = "hfdist_option"  # the metadata key that holds a field's Option


@dataclass(frozen=True)
class OptionGroup:
    """A section of `--help` (and of the docs' table): a title and what its options have in common."""

    title: str
    description: str | None = None


@dataclass(frozen=True)
class Option:
    """What the command line needs of one field beyond its name and default."""

    help: str
    group: OptionGroup
    type: Callable[[str], Any] | None = None  # argparse type (None: str; on/off fields take none)
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()  # more flags for the same setting, e.g. ("--lr",)
    nargs: str | None = None
    const: Any = None  # the value of a bare flag under nargs="?"
    exclusive: str | None = None  # fields with the same name exclude each other
    repeatable: bool = False  # the flag may be given several times; the field holds every value, in order


def option(default: Any, help: str, *, group: OptionGroup, type: Callable[[str], Any] | None = None,
           choices: tuple[Any, ...] | list[Any] | None = None, metavar: str | None = None,
           aliases: tuple[str, ...] = (), nargs: str | None = None, const: Any = None,
           exclusive: str | None = None, repeatable: bool = False) -> Any:
    """A dataclass field that is also a command-line option (see the module docstring); `help` may say
    `{default}`."""
    spec = Option(help, group, type, tuple(choices) if choices is not None else None, metavar, aliases, nargs, const,
                  exclusive, repeatable)
    return dataclasses.field(default=default, metadata={_SPEC: spec})


def options_of(cls: type) -> Iterator[tuple[dataclasses.Field, Option]]:
    """(field, its Option) for every option field of the dataclass `cls`, in declaration order."""
    for f in dataclasses.fields(cls):
        if _SPEC in f.metadata:
            yield f, f.metadata[_SPEC]


def flag_of(name: str) -> str:
    """The command-line flag of a field name: `seq_len` -> `--seq-len`."""
    return "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value)) or "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _on_off(f: dataclasses.Field) -> bool:
    """An on/off field: a bool, or `bool | None` (None: the program decides, e.g. by the hardware)."""
    return isinstance(f.default, bool) or f.type in (bool, "bool", "bool | None")


def _help(f: dataclasses.Field, spec: Option) -> str:
    return spec.help.replace("{default}", _shown(f.default))


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add every option field of `cls` to `parser`, in argparse groups in the order the fields first name them (a
    group already on the parser, by title, is reused)."""
    groups: dict[str, Any] = {g.title: g for g in parser._action_groups if g.title}
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for f, spec in options_of(cls):
        group = groups.get(spec.group.title)
        if group is None:
            group = groups[spec.group.title] = parser.add_argument_group(spec.group.title, spec.group.description)
        target = group
        if spec.exclusive is not None:
            target = exclusive.get(spec.exclusive) or exclusive.setdefault(spec.exclusive,
                                                                          group.add_mutually_exclusive_group())
        kwargs: dict[str, Any] = {"dest": f.name, "help": _help(f, spec).replace("%", "%%"),
                                  "default": None if spec.exclusive is not None else f.default}
        if _on_off(f):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=spec.type, choices=spec.choices, metavar=spec.metavar)
            if spec.nargs is not None:
                kwargs.update(nargs=spec.nargs, const=spec.const)
            if spec.repeatable:
                kwargs["action"] = "append"
        target.add_argument(flag_of(f.name), *spec.aliases, **kwargs)


def dataclass_from_namespace(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """An instance of `cls` from parsed options: the namespace's values for its fields (other attributes, such as a
    verb's own, left out; None leaves the field's default), then `overrides`."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    return cls(**{**values, **overrides})


def options_markdown(cls: type) -> str:
    """The options of `cls` as the docs' Markdown tables, one per group: flag, job-file key, default, help."""
    lines = [f"<!-- generated from {cls.__module__}.{cls.__qualname__} by hfdist.config.options.options_markdown; "
             f"tests/unit/test_options.py keeps it equal -->"]
    by_group: dict[str, list[tuple[dataclasses.Field, Option]]] = {}
    descriptions: dict[str, str | None] = {}
    for f, spec in options_of(cls):
        by_group.setdefault(spec.group.title, []).append((f, spec))
        descriptions.setdefault(spec.group.title, spec.group.description)
    for title, rows in by_group.items():
        lines += ["", f"### {title}", ""]
        if descriptions[title]:
            lines += [descriptions[title], ""]
        lines += ["| Option | Job-file key | Default | What it does |", "|---|---|---|---|"]
        for f, spec in rows:
            flags = [flag_of(f.name), *spec.aliases]
            if _on_off(f):
                flags = [f"{flag_of(f.name)} / --no-{f.name.replace('_', '-')}"]
            default = "" if f.default is None else _shown(f.default)
            text = _help(f, spec) + (f" Choices: {', '.join(map(str, spec.choices))}." if spec.choices else "")
            text = text.replace("|", "\\|")
            lines.append(f"| `{'`, `'.join(flags)}` | `{f.name}` | {f'`{default}`' if default else '-'} | {text} |")
    return "\n".join(lines) + "\n"
