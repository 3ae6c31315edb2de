"""Fixtures of the integration layer: the gloo workers' launches, two at a time."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from helpers import side_by_side, torchrun_json

# worker -> (its script beside this file, ranks, timeout in seconds, the test module that reads it)
WORKERS = {
    "chunked_loss": ("chunked_loss_worker.py", 4, 300, "test_chunked_loss_parallel.py"),
    "cp": ("cp_worker.py", 4, 600, "test_context_parallel.py"),
    "fp8": ("fp8_worker.py", 2, 600, "test_fp8_parallel.py"),
    "moe": ("moe_worker.py", 4, 900, "test_moe_parallel.py"),
    "pp": ("pp_worker.py", 2, 300, "test_pipeline.py"),
}


@pytest.fixture(scope="session")
def worker_results(request, tmp_path_factory) -> dict[str, dict]:
    """{worker: the JSON it wrote}, for the workers whose test modules this session runs: each launched once
    (torchrun, gloo ranks), side by side (helpers.side_by_side: separate worlds, the same results)."""
    modules = {Path(str(item.fspath)).name for item in request.session.items}
    root = tmp_path_factory.mktemp("workers")
    here = Path(__file__).parent
    return side_by_side({name: partial(torchrun_json, here / script, ranks, root / f"{name}.json", timeout=timeout)
                         for name, (script, ranks, timeout, module) in WORKERS.items() if module in modules})
