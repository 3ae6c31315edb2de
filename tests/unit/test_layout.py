"""The package stays a house a newcomer can live in: no import cycles between modules (counting imports inside
functions), packages that depend one way (LAYERS), modules of a readable size, and comments that cite only what the
repository holds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "hfdist"
MAX_LINES = 450  # "under ~400": a little slack, never a 700-line module


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(source: str, modules: set[str], *, type_checking: bool = False) -> set[str]:
    """The hfdist modules (of `modules`) that `source` imports anywhere: at module level or inside a function (a
    deferred import runs when the function does, so it can close a cycle all the same). Imports under `if
    TYPE_CHECKING:` never run; they count only when `type_checking` (for the package order: annotations are a
    dependency too)."""
    tree = ast.parse(source)
    never_run: set[int] = set()
    if not type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                never_run.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in never_run:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hfdist"):
            assert node.level == 0, "hfdist imports its own modules by absolute name"
            # `from hfdist import console` imports the module hfdist.console; `from hfdist.x import name` hfdist.x.
            found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("hfdist"))
    return found & modules


def _graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    """Every hfdist module -> the hfdist modules it imports (itself left out)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path.read_text(), set(modules), type_checking=type_checking) - {name}
            for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, stack + [nxt])) is not None:
                return found
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name, [name])) is not None:
            return found
    return None


def test_no_import_cycles():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_counts_imports_inside_functions_not_type_checking_blocks():
    modules = {"hfdist.a", "hfdist.b", "hfdist.c"}
    lazy = "def f():\n    from hfdist.b import g\n"
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hfdist.c import C\n"
    assert _imports(lazy, modules) == {"hfdist.b"}
    assert _imports(typing_only, modules) == set()
    assert _imports(typing_only, modules, type_checking=True) == {"hfdist.c"}
    assert _imports("from hfdist import b\n", modules) == {"hfdist.b"}
    assert _cycle({"hfdist.a": {"hfdist.b"}, "hfdist.b": {"hfdist.c"}, "hfdist.c": {"hfdist.a"}}) == \
        ["hfdist.a", "hfdist.b", "hfdist.c", "hfdist.a"]
    assert _cycle({"hfdist.a": {"hfdist.b"}, "hfdist.b": set()}) is None


# hfdist's packages (and top-level modules) from the bottom up: each imports only packages of the layers below it,
# never one of its own layer or above. config/ is torch-free settings every library package may read; job/ only
# orchestrates (config -> launch -> run) and only cli/ sits above it.
LAYERS = (
    {"errors", "console", "torch_private", "processes"},  # the one-paragraph errors; the screen and OUTPUT_DIR/logs;
    # torch internals; a launch's processes found and ended
    {"dependencies"},  # the dependency floors, checked at `import hfdist` (its errors are HfdistErrors)
    {"config"},  # FinetuneConfig, the ladder of rungs, degrees, precision rules
    {"models"},  # model facts, building, weights into local shards
    {"data"},  # datasets, chat templates, packing (they read model facts: ignore index, masks)
    {"parallel"},  # the strategies applied to a model (TP, CP, FSDP2, pipeline) and their verification
    {"metrics", "plan", "checkpoint"},  # measuring, planning and saving what parallel/ builds
    {"callbacks"},  # Trainer callbacks (any HF Trainer): per-rank metrics, progress, W&B
    {"train", "report"},  # hfdist's Trainer; comparison reports (they read the W&B sink)
    {"api"},  # the strategies in a user's own script: strategy, prepared model, strategy-aware Trainer
    {"objectives"},  # DPO and GRPO: TRL's trainers through the api, their data, rewards and refusals
    {"job", "tune"},  # a run: launch, preflight, phases, summary (the api's thinnest user); hfdist tune: probes of runs
    {"cli"},  # the `hfdist` command
)


def _package(module: str) -> str | None:
    """The package (or top-level module) of a hfdist module: hfdist.parallel.pipeline.plan -> parallel."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of `graph` from a package to another of its own layer or above."""
    layer = {pkg: i for i, pkgs in enumerate(LAYERS) for pkg in pkgs}
    return [f"{src} -> {dst}" for src, dsts in sorted(graph.items()) for dst in sorted(dsts)
            if (a := _package(src)) and (b := _package(dst)) and a != b and layer[b] >= layer[a]]


def test_every_package_has_a_layer():
    packages = {_package(_module_name(p)) for p in PACKAGE.rglob("*.py")} - {None}
    assert packages == set().union(*LAYERS), "place each hfdist package in LAYERS (tests/unit/test_layout.py)"


def test_packages_import_only_the_layers_below():
    upward = _upward_imports(_graph(type_checking=True))
    assert not upward, f"imports against the package order (LAYERS): {upward}"


def test_an_upward_import_breaks_the_order():
    assert _upward_imports({"hfdist.models.build": {"hfdist.job.run", "hfdist.models.registry"},
                            "hfdist.plan.bytes": {"hfdist.checkpoint.format", "hfdist.config.ladder"}}) == \
        ["hfdist.models.build -> hfdist.job.run", "hfdist.plan.bytes -> hfdist.checkpoint.format"]


def test_modules_stay_readable():
    long = {str(p.relative_to(REPO)): n for p in [*PACKAGE.rglob("*.py"), *(REPO / "scripts").glob("*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_comments_cite_only_what_the_repository_holds():
    outside = re.compile(r"design\.md|\.\./shared|seeds?/|seed 00\d|gpu-readiness")
    cited = [f"{p.relative_to(REPO)}:{i}" for p in [*PACKAGE.rglob("*.py"), *(REPO / "scripts").glob("*.py"),
                                                   *(REPO / "benchmarks").glob("*.py")]
             for i, line in enumerate(p.read_text().splitlines(), 1) if outside.search(line)]
    assert not cited, f"comments pointing outside the repository: {cited}"
    for path in re.findall(r"(?:hfdist|tests|scripts|benchmarks)/[\w/]+\.py",
                           "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))):
        assert (REPO / path).is_file(), f"a comment cites {path}, which does not exist"


def test_test_modules_have_distinct_basenames():
    """The test folders are not packages, so pytest imports each test module by its basename: two of one name in
    tests/unit, tests/integration and tests/e2e stop the whole run at collection."""
    names = [p.name for p in (REPO / "tests").glob("*/test_*.py")]
    assert not {n for n in names if names.count(n) > 1}
