"""The package stays a house a newcomer can live in: no import cycles between modules, modules of a readable
size, and comments that cite only what the repository holds."""

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


def _imports(path: Path) -> set[str]:
    """hfdist modules `path` imports at module level (imports inside functions are deferred, so they cannot cycle
    at import time; TYPE_CHECKING blocks never run)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else ():
            if isinstance(sub, ast.ImportFrom) and sub.module and sub.module.startswith("hfdist"):
                found.add(sub.module)
            elif isinstance(sub, ast.Import):
                found.update(a.name for a in sub.names if a.name.startswith("hfdist"))
    return found


def test_no_import_cycles():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: {m for m in _imports(path) if m in modules} for name, path in modules.items()}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


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
