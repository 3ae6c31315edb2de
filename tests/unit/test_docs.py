"""The docs check: every command, link, path and module name in README.md and docs/*.md is true of this tree.

Commands come from the fenced `bash` / `console` blocks (a `console` block's `$ ` lines, the lines after each being
its expected output) and from inline code that starts like a command (`hfdist finetune --config fsdp_tp --tp 8`).
Each is one of two kinds, decided here, by the command, not by the page:

- CHEAP, executed: `hfdist configs`, `hfdist plan`, `hfdist simulate` and any `--help` (seconds each; a `console`
  block's printed output must equal what the command prints now, timings aside). Inline ones are checked
  statically only (the blocks carry the examples that run).
- EXPENSIVE, checked statically: training launches (`hfdist finetune`, `accelerate launch`, `torchrun`, `sbatch`,
  `hfdist compare`, `hfdist checkpoint export`, benchmarks, the test suite). Their arguments are parsed by the real
  parsers (hfdist's, accelerate's launch parser, torch.distributed.run's; a benchmark's flags against its own
  `--help`), so every flag must be one the command accepts; the scripts, configs and YAMLs they name must exist.
  The launches themselves run in the suite: tests/e2e (test_finetune_ladder.py, test_faults.py, test_install.py,
  ...) start them as the docs write them.

A command of another kind fails the check until it is classified here. Links between pages (and their #anchors)
and to repository files must resolve; inline `hfdist/...`-style paths must exist and `hfdist.x.y` names must be
defined where they say. The whole check takes seconds (most of it the executed commands).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import functools
import glob
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
PYTHON = {"python", "python3", ".venv/bin/python", "/work/main/.venv/bin/python"}
EXTERNAL = {"wandb"}  # other tools' own commands


# ---------------------------------------------------------------------------------------------------------- parsing
def _blocks(page: Path) -> list[tuple[str, int, str]]:
    """(language, first line number, body) of every fenced block of `page`."""
    out, lang, start, body = [], None, 0, []
    for i, line in enumerate(page.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```(\S*)", line)
        if fence and lang is None:
            lang, start, body = fence.group(1) or "text", i + 1, []
        elif fence:
            out.append((lang, start, "\n".join(body)))
            lang = None
        elif lang is not None:
            body.append(line)
    return out


def _commands_of_block(lang: str, start: int, body: str) -> list[tuple[int, str, list[str] | None]]:
    """(line, command, expected output lines or None) of a shell block: `bash` lines are commands (`\\` continues
    one, `#` starts a comment); a `console` block's commands start with `$ ` and the lines up to the next are
    what it prints."""
    out: list[tuple[int, str, list[str] | None]] = []
    lines, i = body.splitlines(), 0
    while i < len(lines):
        line, n = lines[i], start + i
        i += 1
        if lang == "console":
            if not line.startswith("$ "):
                continue
            cmd, printed = line[2:], []
            while i < len(lines) and not lines[i].startswith("$ "):
                printed.append(lines[i])
                i += 1
            out.append((n, cmd, printed if any(p.strip() for p in printed) else None))
            continue
        cmd = line.split(" #")[0].rstrip() if not line.lstrip().startswith("#") else ""
        while cmd.endswith("\\") and i < len(lines):
            cmd = cmd[:-1] + " " + lines[i].split(" #")[0].strip()
            i += 1
        if cmd.strip():
            out.append((n, cmd.strip(), None))
    return out


_COMMAND_START = re.compile(r"^(hfdist |\.venv/bin/hfdist |accelerate launch |torchrun |python (-m |scripts/|bench)"
                            r"|sbatch |bash scripts/)")
_PLACEHOLDER = re.compile(r"\[|\.\.\.|<|\||\bVERB\b")


def _prose(page: Path) -> str:
    """The page with its fenced blocks blanked out (line numbers kept)."""
    return re.sub(r"^\s*```.*?^\s*```", lambda m: "\n" * m.group(0).count("\n"), page.read_text(),
                  flags=re.S | re.M)


def _spans(page: Path) -> list[tuple[int, str]]:
    """(line, text) of the inline code spans outside fenced blocks (a span may wrap onto the next line)."""
    text = _prose(page)
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
            for m in re.finditer(r"`([^`]+)`", text)]


def _inline_commands(page: Path) -> list[tuple[int, str]]:
    """Inline code spans that start like a command and hold no placeholders."""
    return [(n, s) for n, s in _spans(page) if _COMMAND_START.match(s) and not _PLACEHOLDER.search(s)]


def _all_commands() -> list:
    cases = []
    for page in PAGES:
        rel = page.relative_to(REPO)
        for lang, start, body in _blocks(page):
            if lang in SHELL_LANGS:
                cases += [pytest.param(page, cmd, printed, True, id=f"{rel}:{n}")
                          for n, cmd, printed in _commands_of_block(lang, start, body)]
        cases += [pytest.param(page, cmd, None, False, id=f"{rel}:{n}:inline") for n, cmd in _inline_commands(page)]
    return cases


def _argv(cmd: str) -> list[list[str]]:
    """The commands of one line (`&&` chains), environment assignments dropped."""
    words, argvs, cur = shlex.split(cmd), [], []
    for w in words + ["&&"]:
        if w == "&&":
            argvs.append(cur)
            cur = []
        elif not cur and re.match(r"^[A-Z_][A-Z0-9_]*=", w):
            continue
        else:
            cur.append(w)
    return [a for a in argvs if a]


# ------------------------------------------------------------------------------------------------- static checking
def _lenient(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser` with nothing required: an inline span names only the flags it is about."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _lenient(sub)
        elif action.option_strings:
            action.required = False
        elif action.nargs is None:
            action.nargs = "?"
    return parser


def _parse(parser: argparse.ArgumentParser, args: list[str], what: str, lenient: bool) -> argparse.Namespace | None:
    """`args` parsed by `parser` (None for a --help, which the executed commands run); fails the test when the
    parser refuses them (`lenient`: also when given every required argument)."""
    if "--help" in args or "-h" in args:
        return None
    for strict in (True, False) if lenient else (True,):
        attempt, err = parser if strict else _lenient(parser), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                return attempt.parse_args(args)
            except SystemExit:
                pass
    raise AssertionError(f"{what} {shlex.join(args)}: its parser refuses it: {err.getvalue().strip()}")


def _hfdist_parser() -> argparse.ArgumentParser:
    from hfdist.cli import build_parser

    return build_parser()


def _check_config_file(path: str) -> None:
    """A config file a command names: one of the repository's must exist; a user's own (`my.yaml`, outside the
    repository's folders) must at least be a YAML or JSON."""
    if Path(path).parts[0] in {p.name for p in REPO.iterdir()}:
        assert (REPO / path).is_file(), f"{path} does not exist"
    else:
        assert path.endswith((".yaml", ".yml", ".json")), f"{path}: not a config file name"


def _check_finetune_values(ns: argparse.Namespace) -> None:
    config = getattr(ns, "config", None)
    if config and config != "single":
        shipped = {p.stem for p in (REPO / "hfdist/configs/accelerate_configs").glob("*.yaml")}
        if config.removesuffix(".yaml") not in shipped:
            _check_config_file(config)
    model = getattr(ns, "model", None)
    if model and model.startswith("llama-"):
        from hfdist.models.presets import PRESETS

        assert model in PRESETS, f"--model {model}: no such preset ({sorted(PRESETS)})"


@functools.cache
def _tracked_top_level() -> frozenset[str]:
    """The repository's own top-level files and folders (git's), not what runs left beside them (outputs/, logs/)."""
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return frozenset(line.split("/", 1)[0] for line in listed.splitlines())


def _check_job_file(ns: argparse.Namespace) -> None:
    """A job file of the repository's that a command names must exist and be a valid job (its keys and values).
    A path under a folder that runs write (the quick start's outputs/) is a run's file, not the repository's."""
    path = getattr(ns, "job", None) or getattr(ns, "job_file", None)
    if path and Path(path).parts[0] in _tracked_top_level():
        from hfdist.config.finetune import parse_args

        assert (REPO / path).is_file(), f"{path} does not exist"
        parse_args([str(REPO / path)])


def _check_hfdist(args: list[str], lenient: bool) -> None:
    ns = _parse(_hfdist_parser(), args, "hfdist", lenient)
    if ns is not None and ns.verb in ("finetune", "prepare", "plan", "simulate"):
        _check_finetune_values(ns)
        _check_job_file(ns)


def _doc_scripts() -> set[str]:
    """Scripts the pages themselves define: a python block that opens with `# NAME.py:` (run as written by
    tests/integration/test_user_trainer.py)."""
    return {m.group(1) for page in PAGES for lang, _, body in _blocks(page) if lang == "python"
            for m in [re.match(r"# ([\w.-]+\.py):", body)] if m}


def _check_finetune_script(script: str, args: list[str], lenient: bool) -> None:
    """A script path with its arguments, as a launcher or python runs it."""
    if script in _doc_scripts():
        return
    assert (REPO / script).is_file(), f"{script} does not exist"
    if script == "scripts/finetune.py" or script.endswith("slurm_finetune.sbatch"):
        _check_hfdist(["finetune", *args], lenient)
    elif script == "scripts/compare.py":
        from hfdist.report.compare import build_parser

        _parse(build_parser(), args, script, lenient)
    elif args:  # any other script (benchmarks): each flag must appear in its own --help
        flags = [a.split("=")[0] for a in args if a.startswith("--")]
        helped = subprocess.run([sys.executable, script, "--help"], cwd=REPO, env=_env(), capture_output=True,
                                text=True, timeout=120)
        assert helped.returncode == 0, f"{script} --help failed: {helped.stderr[-2000:]}"
        missing = [f for f in flags if f not in helped.stdout]
        assert not missing, f"{script} does not accept {missing}"


def _check_launcher(argv: list[str], lenient: bool) -> None:
    """`accelerate launch` / `torchrun` / `python -m torch.distributed.run`: the launcher's own parser, then what
    it starts."""
    if argv[0] == "accelerate":
        from accelerate.commands.launch import launch_command_parser

        ns = _parse(launch_command_parser(), argv[2:], "accelerate launch", lenient)
        if ns.config_file:
            _check_config_file(ns.config_file)
        script, rest, module = ns.training_script, ns.training_script_args, ns.module
    else:
        from torch.distributed.run import get_args_parser

        ns = _parse(get_args_parser(), argv[1:], "torchrun", lenient)
        script, rest, module = ns.training_script, ns.training_script_args, ns.module
    if module:
        assert script == "hfdist.cli", f"launches module {script}, which the docs check does not know"
        _check_hfdist(rest, lenient)
    elif script:
        _check_finetune_script(script, rest, lenient)


def _check_pip(args: list[str]) -> None:
    """A pip line installs: the clone (`.`, `-e .`, with extras pyproject.toml declares), a wheel this repository
    builds (dist/), or a package by name (whose index the docs do not check). The wheel's install itself runs in
    tests/e2e/test_install.py."""
    import tomllib

    assert args and args[0] in ("install", "wheel"), f"pip {' '.join(args)}: not an install"
    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]
                   ["optional-dependencies"])
    for arg in args[1:]:
        local = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", arg)
        if local and local.group(1):
            unknown = set(local.group(1).split(",")) - declared
            assert not unknown, f"pip install {arg}: pyproject.toml declares no extra {sorted(unknown)}"
        elif "/" in arg and not arg.startswith("-"):
            assert arg.startswith("dist/") or glob.glob(str(REPO / arg)), f"{arg} does not exist"


def _check_static(argv: list[str], lenient: bool = False) -> None:
    """Fails unless `argv` would start: its parsers accept it and what it names exists. `lenient`: an inline span,
    which may leave out required arguments (flags and values are still checked)."""
    head = argv[0]
    if head in ("hfdist", ".venv/bin/hfdist"):
        _check_hfdist(argv[1:], lenient)
    elif head in ("accelerate", "torchrun"):
        assert head == "torchrun" or argv[1] == "launch", f"unknown accelerate command {argv[1]}"
        _check_launcher(argv, lenient)
    elif head in PYTHON and argv[1:3] == ["-m", "hfdist.cli"]:
        _check_hfdist(argv[3:], lenient)
    elif head in PYTHON and argv[1:3] == ["-m", "torch.distributed.run"]:
        _check_launcher(["torchrun", *argv[3:]], lenient)
    elif head in PYTHON and argv[1:3] == ["-m", "pytest"]:
        paths = [a.split("::")[0] for a in argv[3:] if a.startswith("tests")]
        missing = [a for a in paths if not (REPO / a).exists()]
        assert not missing, f"pytest: no test file {missing}"
    elif head == "pip" or (head in PYTHON and argv[1:3] == ["-m", "pip"]):
        _check_pip(argv[argv.index("pip") + 1:] if head != "pip" else argv[1:])
    elif head in PYTHON and argv[1] == "-m":
        import importlib.util

        assert importlib.util.find_spec(argv[2]) is not None, f"no module {argv[2]}"
    elif head in PYTHON:
        _check_finetune_script(argv[1], argv[2:], lenient)
    elif head == "bash":
        assert (REPO / argv[1]).is_file(), f"{argv[1]} does not exist"
    elif head == "sbatch":
        script = next(a for a in argv[1:] if a.endswith(".sbatch"))
        _check_finetune_script(script, argv[argv.index(script) + 1:], lenient)
    elif head in EXTERNAL:
        for arg in argv[1:]:
            if "/" in arg and not arg.startswith("-") and not arg.startswith("<"):
                assert glob.glob(str(REPO / arg)) or arg.startswith(("dist/", "/")), f"{arg} does not exist"
    else:
        raise AssertionError(f"`{shlex.join(argv)}`: a command of a kind the docs check does not know; classify it "
                             "in tests/unit/test_docs.py (cheap: executed, expensive: checked statically)")


# ------------------------------------------------------------------------------------------------------- executing
def _is_cheap(argv: list[str]) -> bool:
    """Executed rather than checked: hfdist's read-only verbs and any --help (seconds each)."""
    verb_args = argv[1:] if argv[0] in ("hfdist", ".venv/bin/hfdist") else \
        argv[3:] if argv[0] in PYTHON and argv[1:3] == ["-m", "hfdist.cli"] else None
    if verb_args is None:
        return False
    return bool(verb_args) and (verb_args[0] in ("configs", "plan", "simulate") or "--help" in verb_args)


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("HFDIST_HANDED_OVER", None)
    return env


_TIMING = re.compile(r"\d+(\.\d+)? s\b")


def _run(argv: list[str], printed: list[str] | None) -> None:
    """Run an hfdist verb as `python -m hfdist.cli` runs it (its `main`), in this process: the imports are paid once
    for all the executed commands."""
    from hfdist.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv[1:] if "hfdist" in argv[0] else argv[3:])
        except SystemExit as exc:  # --help
            code = exc.code or 0
    assert code == 0, f"{shlex.join(argv)} exited {code}:\n{err.getvalue()[-3000:]}"
    if printed is not None:
        want = [_TIMING.sub("N s", line.rstrip()) for line in printed]
        got = [_TIMING.sub("N s", line.rstrip()) for line in out.getvalue().splitlines()]
        assert got == want, "the page shows another output than the command prints now:\n" + "\n".join(got)


@pytest.mark.parametrize("page, cmd, printed, in_block", _all_commands())
def test_command(page, cmd, printed, in_block):
    for argv in _argv(cmd):
        if in_block and _is_cheap(argv):
            _run(argv, printed)
        else:
            assert printed is None, "a console block shows output only for commands the check runs"
            _check_static(argv, lenient=not in_block)


def _free_names(code: str) -> set[str]:
    """Names a snippet reads without defining or importing them."""
    tree, bound, read = ast.parse(code), set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, ast.Store) else read).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound


def _python_blocks() -> list:
    return [pytest.param(body, id=f"{page.relative_to(REPO)}:{start}") for page in PAGES
            for lang, start, body in _blocks(page) if lang == "python"]


@pytest.mark.parametrize("code", _python_blocks())
def test_python_block(code):
    """Every python block compiles; one that defines everything it uses runs (the `# NAME.py:` scripts, which read
    their arguments, run under torchrun in tests/integration/test_user_trainer.py)."""
    compile(code, "<docs>", "exec")
    if re.match(r"# [\w.-]+\.py:", code) or _free_names(code):
        return
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, "<docs>", "exec"), {"__name__": "__docs__"})


def test_readme_test_command_is_what_ci_runs():
    """.ci/run runs exactly the README's test command."""
    ci_cmd = (REPO / ".ci/run").read_text().strip().splitlines()[-1]
    readme = [cmd for lang, start, body in _blocks(REPO / "README.md") if lang in SHELL_LANGS
              for _, cmd, _ in _commands_of_block(lang, start, body)]
    assert ci_cmd in readme, f"README.md has no block with CI's command {ci_cmd!r}"


# ------------------------------------------------------------------------------------------------------ yaml blocks
def _yaml_blocks() -> list:
    return [pytest.param(body, id=f"{page.relative_to(REPO)}:{start}") for page in PAGES
            for lang, start, body in _blocks(page) if lang in ("yaml", "yml")]


def _flag(argv: list[str], flag: str) -> str | None:
    """The value of `flag` in `argv` (None when absent)."""
    return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else None


def _on_a_volume(argv: list[str], mounts: set[str], where: str) -> None:
    """A launch's --output-dir must lie on a mounted volume (checkpoints outlive the pod; every node reads them)."""
    out = _flag(argv, "--output-dir")
    assert out and any(Path(out).is_relative_to(m) for m in mounts), \
        f"{where}: --output-dir {out} is not on a mounted volume ({sorted(mounts)})"


def _check_pod(spec: dict, where: str, job: dict | None) -> None:
    """A pod's containers launch commands the docs check accepts, onto a mounted volume, within the pod's grace; a
    Job whose first process is `hfdist finetune` does not count its preemptions (exit 75) as failures."""
    from hfdist.config.preemption import PREEMPTED_EXIT_CODE

    grace = spec.get("terminationGracePeriodSeconds", 30)
    for container in spec["containers"]:
        argv = [str(a) for a in container.get("command", []) + container.get("args", [])]
        _check_static(argv)
        _on_a_volume(argv, {m["mountPath"] for m in container.get("volumeMounts", [])}, where)
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if "HFDIST_PREEMPT_GRACE" in env:
            assert float(env["HFDIST_PREEMPT_GRACE"]) <= grace, f"{where}: HFDIST_PREEMPT_GRACE beyond the pod's grace"
        shutdown = _flag(argv, "--shutdown-timeout")
        assert shutdown is None or int(shutdown) < grace, f"{where}: torchrun waits longer than the pod's grace"
        if job is not None and argv[:2] == ["hfdist", "finetune"]:
            rules = job.get("podFailurePolicy", {}).get("rules", [])
            assert any(PREEMPTED_EXIT_CODE in r.get("onExitCodes", {}).get("values", []) for r in rules), \
                f"{where}: no podFailurePolicy rule for hfdist's preempted exit code {PREEMPTED_EXIT_CODE}"
    if job is not None and job.get("podFailurePolicy"):
        assert spec.get("restartPolicy") == "Never", f"{where}: podFailurePolicy needs restartPolicy: Never"


def _check_rayjob(doc: dict, where: str) -> None:
    """A KubeRay RayJob: its entrypoint is `hfdist finetune --launcher ray ...` as the docs check accepts it, writing
    onto a volume every node of the cluster (head and workers) mounts."""
    argv = shlex.split(doc["spec"]["entrypoint"])
    _check_static(argv)
    assert _flag(argv, "--launcher") == "ray", f"{where}: the entrypoint does not launch through Ray"
    cluster = doc["spec"]["rayClusterSpec"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        mounts = {m["mountPath"] for c in group["template"]["spec"]["containers"] for m in c.get("volumeMounts", [])}
        _on_a_volume(argv, mounts, f"{where} ({group.get('groupName', 'head')})")


@pytest.mark.parametrize("body", _yaml_blocks())
def test_yaml_block(body, tmp_path):
    """Every yaml block parses; a Kubernetes Job or Pod and a KubeRay RayJob hold launches the job accepts
    (_check_pod, _check_rayjob); a job file (`# job.yaml`) is one the job reads."""
    import yaml

    docs = [d for d in yaml.safe_load_all(body) if d is not None]
    assert docs, "an empty yaml block"
    for doc in docs:
        kind, where = doc.get("kind"), f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}"
        if kind == "Job":
            _check_pod(doc["spec"]["template"]["spec"], where, doc["spec"])
        elif kind == "Pod":
            _check_pod(doc["spec"], where, None)
        elif kind == "RayJob":
            _check_rayjob(doc, where)
        elif body.startswith("# job.yaml"):
            from hfdist.config.finetune import parse_args

            (tmp_path / "job.yaml").write_text(body)
            parse_args([str(tmp_path / "job.yaml")])  # the job's own reader: every key a setting, every value valid


# ------------------------------------------------------------------------------------------- links, paths and names
def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    fenced, heads = False, set()
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#+\s+(.*)", line)):
            heads.add(_slug(m.group(1)))
    return heads


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: links that do not resolve: {broken}"


_REPO_PATH = re.compile(r"^(hfdist|tests|scripts|benchmarks|results|docs|accelerate_configs|ds_configs|\.ci)/[\w./*-]*$")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_paths_exist(page):
    spans = re.findall(r"`([^`\n]+)`", _prose(page))
    missing = [s for s in spans if _REPO_PATH.match(s) and not glob.glob(str(REPO / s.rstrip(".,")))]
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


def _defined(path: Path) -> dict[str, ast.AST]:
    """Names a module defines or imports at top level (and its `__all__`)."""
    names: dict[str, ast.AST] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    names[t.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
    for name in names.get("__all__") and ast.literal_eval(names["__all__"].value) or ():
        names.setdefault(name, names["__all__"])
    return names


def _resolve_name(dotted: str) -> str | None:
    """None when `dotted` (hfdist.pkg.module.Name.attr) exists in the tree, else what is missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:cut])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file():
            break
    else:
        return dotted
    rest = parts[cut:]
    if not rest:
        return None
    names = _defined(module)
    if rest[0] not in names:
        return f"{rest[0]} in {module.relative_to(REPO)}"
    node = names[rest[0]]
    if len(rest) > 1 and isinstance(node, ast.ClassDef):
        if rest[1] not in {getattr(n, "name", None) for n in node.body}:
            return f"{rest[0]}.{rest[1]} in {module.relative_to(REPO)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_module_names_exist(page):
    names = re.findall(r"`(hfdist(?:\.\w+)+)", _prose(page))
    missing = [(n, why) for n in names if (why := _resolve_name(n))]
    assert not missing, f"{page.name} names what the code does not define: {missing}"


def test_readme_is_a_front_door():
    """At most 250 lines, and every docs page is linked from it."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "README.md grew past 250 lines: move the detail into a docs/ page"
    unlinked = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


@pytest.mark.parametrize("page", PAGES[1:], ids=lambda p: str(p.relative_to(REPO)))
def test_page_opens_with_a_summary_and_commands(page):
    """A title, then a one-line summary (one sentence, at most two lines of text), and at least one command."""
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# "), f"{page.name} does not open with a title"
    summary = []
    for line in lines[2:]:
        if not line.strip():
            break
        summary.append(line)
    assert lines[1] == "" and 0 < len(summary) <= 2, f"{page.name}: no one-line summary under the title"
    assert any(lang in SHELL_LANGS for lang, _, _ in _blocks(page)), f"{page.name} shows no command"


def test_layout_tree_names_every_module():
    """docs/architecture.md's layout tree names every module of the package, and only modules that exist."""
    tree = next(body for lang, _, body in _blocks(REPO / "docs" / "architecture.md") if lang == "text")
    named, folder = set(), ""
    for line in tree.splitlines():
        head = re.match(r"^( {0,2})(\S+)", line)
        if head and head.group(2).endswith("/"):  # a folder's line: `hfdist/`, `  job/`, `scripts/`
            folder = "hfdist/" + head.group(2) if head.group(1) else head.group(2)
        elif head and head.group(1) == "  ":  # a module of the package's root: `  errors.py`
            folder = "hfdist/"
        named |= {folder + name for name in re.findall(r"(?<![\w*/.])(\w+\.py)\b", line)}
    missing = sorted(p for p in named if not (REPO / p).is_file())
    modules = {str(p.relative_to(REPO)) for p in (REPO / "hfdist").rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    unnamed = sorted(modules - named)
    assert not missing and not unnamed, (f"docs/architecture.md's layout names modules that do not exist: {missing}; "
                                         f"leaves out: {unnamed}")


def test_every_page_states_the_meshs_own_order_for_where_each_axis_goes():
    """The rule for where each axis goes on a cluster is the mesh hfdist builds (ParallelDims.mesh_shape: the last axis
    varies fastest, so it fills a node first), stated in the same words on the README, the multi-node page and
    `hfdist plan`'s multi-node note (ParallelDims.placement_rule)."""
    from hfdist.config.dims import ParallelDims

    rule = ParallelDims.placement_rule()
    assert "dp_replicate x dp_shard x cp x pp x tp, tp varying fastest" in rule  # the mesh's order, read from it
    for page in (REPO / "README.md", REPO / "docs" / "multi-node.md"):
        assert rule in " ".join(page.read_text().split()), f"{page.name} does not state: {rule}"
    from hfdist.models.presets import load_config
    from hfdist.plan import GB, plan_rungs

    plan = plan_rungs(load_config("llama-3.1-8b"), ["fsdp_hybrid"], gpus_per_node=8, nodes=2, gpu_mem_bytes=80 * GB)
    assert rule in plan.rungs[0].note, plan.rungs[0].note


def test_readme_says_how_many_cells_the_suite_trains():
    """The README's "what has run where" row counts the cells tests/e2e/test_cells.py trains (the rung table's
    accepted cells): a table change that adds or drops cells changes the row."""
    from hfdist.config.cells import accepted_cells

    assert f"({len(accepted_cells())} cells:" in (REPO / "README.md").read_text()
