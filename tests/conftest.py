"""pytest fixtures shared by every layer (helpers without fixtures live in helpers.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

# The suite runs on a GPU host exactly as on a CPU one: GPUs are hidden from the tests and from every process they
# start, before anything imports torch (GPU code paths are tested through a mocked device API instead).
os.environ["CUDA_VISIBLE_DEVICES"] = ""

from helpers import SharedRuns


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> SharedRuns:
    """The checkpointed runs several modules read (helpers.SHARED_RUNS), each launched once per session."""
    return SharedRuns(tmp_path_factory.mktemp("shared_runs"))


@pytest.fixture(scope="session")
def references(shared_runs) -> dict[str, dict]:
    """The single-process runs every strategy is compared with: {"single": summary, "lora_single": summary}."""
    names = ["single", "lora_single"]
    shared_runs.launch(names)
    return {name: shared_runs[name] for name in names}


@pytest.fixture
def gpu_host(monkeypatch):
    """An 8 x H100 80GB node as torch.cuda describes it (the device API mocked; nothing runs on a GPU)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=80 * 10**9, name="NVIDIA H100 80GB HBM3"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The rung table's test plan, counted where the run shows it (tests/e2e/test_cells.py: one case per accepted
    cell, so a cell the table accepts shows up here, passed or failed)."""
    outcomes = {key: [r for r in terminalreporter.stats.get(key, [])
                      if "test_cells.py::test_cell_equals_one_process[" in getattr(r, "nodeid", "")]
                for key in ("passed", "failed", "error")}
    total = sum(map(len, outcomes.values()))
    if total:
        from hfdist.config.cells import accepted_cells

        terminalreporter.write_line(
            f"cells: {total} of the rung table's {len(accepted_cells())} accepted cells trained against one process "
            f"({len(outcomes['passed'])} passed, {len(outcomes['failed']) + len(outcomes['error'])} failed)")
