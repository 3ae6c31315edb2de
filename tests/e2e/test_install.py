"""hfdist installed the way users install it: a wheel built from the repository, installed (not editable) into a
fresh venv, runs `hfdist configs`, `hfdist plan` and `hfdist finetune` from a directory outside the repository.

The fresh venv gets the dependencies this environment already has through a .pth file holding this environment's
site-packages path: installing torch, transformers and DeepSpeed again would download gigabytes (and CI has no
internet), while what is under test (hfdist, its package data and its console script) comes only from the wheel.
A path line in a .pth puts the folder on sys.path without running that folder's own .pth files, so an editable
hfdist installed there stays out of sight; the test checks that `import hfdist` resolves inside the fresh venv.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hfdist.config.ladder import known_rung_names

from helpers import REPO

pytestmark = pytest.mark.multiproc


def _run(cmd: list, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HFDIST_HANDED_OVER")}
    env.update(WANDB_MODE="offline", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("install")
    src = root / "src"  # the files a wheel is built from (a copy: the build writes build/ and *.egg-info)
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "hfdist", src / "hfdist", ignore=shutil.ignore_patterns("__pycache__"))
    proc = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                 root / "dist", src], cwd=root)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (root / "dist").glob("hfdist-*.whl")
    venv = root / "venv"
    proc = _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
    assert proc.returncode == 0, proc.stderr
    (target,) = (venv / "lib").glob("python3*/site-packages")
    (target / "hfdist_test_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # --ignore-installed: never touch the hfdist this environment may hold (pip finds it through the .pth)
    proc = _run([venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
                 "-q", wheel], cwd=root)
    assert proc.returncode == 0, proc.stderr
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    return {"wheel": wheel, "venv": venv, "cwd": elsewhere}


def test_the_wheel_holds_the_ladder_data_and_tokenizer(installed):
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    shipped = [p.relative_to(REPO).as_posix() for sub in ("hfdist/configs", "hfdist/assets")
               for p in (REPO / sub).rglob("*") if p.is_file()]
    yamls = sorted(Path(n).stem for n in shipped if n.endswith(".yaml") and "/accelerate_configs/" in n)
    assert any(n.startswith("hfdist/configs/jobs/") for n in shipped)  # the example job files ship too
    assert yamls == sorted(known_rung_names()) and len([n for n in shipped if n.endswith(".json")]) >= 6
    assert sorted(set(shipped) - names) == []
    assert "hfdist/cli/__main__.py" in names
    assert "hfdist/requirements/base.txt" in names  # the floors `import hfdist` checks


def test_installed_hfdist_runs_from_any_directory(installed):
    venv, cwd = installed["venv"], installed["cwd"]
    where = _run([venv / "bin" / "python", "-c", "import hfdist; print(hfdist.__file__)"], cwd)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout  # the wheel's copy, not the repository's

    configs = _run([venv / "bin" / "hfdist", "configs"], cwd)
    assert configs.returncode == 0, configs.stderr
    for name in known_rung_names():
        assert f"hfdist finetune --config {name}" in configs.stdout
    assert str(venv) in configs.stdout  # the files it lists are the installed ones

    plan = _run([venv / "bin" / "hfdist", "plan", "--model", "llama-3.1-8b", "--gpus-per-node", "8"], cwd)
    assert plan.returncode == 0 and "Recommended: " in plan.stdout, plan.stderr

    run = _run([venv / "bin" / "hfdist", "finetune", "--config", "fsdp_full_shard", "--max-steps", "2"], cwd)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    summary = json.loads((cwd / "outputs" / "finetune" / "hfdist_summary.json").read_text())
    assert summary["strategy"]["name"] == "fsdp_full_shard" and summary["strategy"]["world_size"] == 2
    assert len(summary["losses"]) == 2 and "Traceback" not in run.stderr
    assert (cwd / "outputs" / "finetune" / "logs" / "rank-1.log").is_file()


def test_installed_hfdist_compares_rungs(installed):
    venv, cwd = installed["venv"], installed["cwd"]
    proc = _run([venv / "bin" / "hfdist", "compare", "--configs", "ddp", "fsdp_full_shard", "--model", "llama-tiny",
                 "--max-steps", "2", "--global-batch-size", "8", "--seq-len", "64", "--out", "matrix",
                 "--runs-dir", "runs"], cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "[1/2] ddp: ok" in proc.stdout and "[2/2] fsdp_full_shard: ok" in proc.stdout
    matrix = (cwd / "matrix" / "matrix.md").read_text()
    assert "| ddp |" in matrix and "| fsdp_full_shard |" in matrix and "Measured by `hfdist compare --configs" in matrix
