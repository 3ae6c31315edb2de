"""The dependency floors (hfdist/requirements/*.txt, hfdist.dependencies): this environment meets them (under CI at
exactly the floors), an older torch or a transformers past its bound fails `import hfdist` with one paragraph naming
the version found and needed (the version simulated, nothing installed), and CI's constraints are the floors."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest
from packaging.version import Version

from hfdist.dependencies import REQUIREMENTS, DependencyError, check, requirements, unmet

from helpers import REPO

# What the fresh process's `import hfdist` sees: torch's metadata saying 2.6.0, every other package its own.
OLD_TORCH = """
import importlib.metadata as m
real = m.version
m.version = lambda name: "2.6.0" if name == "torch" else real(name)
import hfdist
"""


def _floor(specifier: str) -> str:
    return next(part[2:] for part in specifier.split(",") if part.startswith(">="))


def test_this_environment_meets_the_floors():
    """Under CI (HFDIST_FLOORS=1: scripts/setup.sh installed every dependency at its floor) the installed releases
    are the floors themselves; elsewhere they satisfy them."""
    assert unmet() == []
    check()
    if os.environ.get("HFDIST_FLOORS") == "1":
        for req in requirements():
            installed = Version(metadata.version(req.name)).release
            assert installed[:len(Version(_floor(req.specifier)).release)] == Version(_floor(req.specifier)).release


def test_an_older_torch_fails_import_naming_both_versions():
    proc = subprocess.run([sys.executable, "-c", OLD_TORCH], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hfdist.dependencies.DependencyError: hfdist needs torch>=2.13 (DCP's DefaultStager")
    assert "this environment has torch 2.6.0" in last and "pip install 'torch>=2.13'" in last


def test_a_transformers_past_its_bound_and_a_missing_package_are_refused():
    versions = {"transformers": "5.24.0", "wandb": None}
    with pytest.raises(DependencyError) as err:
        check(lambda name: versions[name] if name in versions else metadata.version(name))
    message = str(err.value)
    assert "transformers<5.24,>=5.23 (hfdist's Trainer overrides private Trainer methods" in message
    assert "this environment has transformers 5.24.0" in message and "this environment has no wandb" in message
    assert "\n" not in message  # one paragraph


def test_ci_installs_exactly_the_floors():
    """scripts/floors.sh turns every floor of hfdist/requirements/*.txt into name==floor; scripts/setup.sh applies
    them under HFDIST_FLOORS=1, which .ci/run sets."""
    printed = subprocess.run(["bash", str(REPO / "scripts" / "floors.sh")], capture_output=True, text=True,
                             check=True).stdout.split()
    floors = [f"{req.name}=={_floor(req.specifier)}" for path in sorted(REQUIREMENTS.parent.glob("*.txt"))
              for req in requirements(path) if ">=" in req.specifier]
    assert sorted(printed) == sorted(floors) and "torch==2.13" in printed
    assert "export HFDIST_FLOORS=1" in (REPO / ".ci" / "run").read_text()
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "scripts/floors.sh > .venv/floors.txt" in setup and setup.count('"${CONSTRAINTS[@]}"') == 2
