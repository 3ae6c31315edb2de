"""Ranks return freed tensors to the OS (hfdist.metrics.memory.return_freed_memory_to_os), so that the per-rank RSS
figures of loading and saving count tensors rather than glibc's heap (tests/e2e/test_scale_memory.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hfdist.metrics.memory import return_freed_memory_to_os

# In a fresh interpreter (a test process's heap already has holes that would serve the tensors): free every other
# one of 32 tensors of 2 MiB, after a 16 MiB free that makes glibc serve 2 MiB blocks from its heap (measured:
# 0 MiB leave the resident set then), and print how many MiB left the resident set.
_HOLES = """
import torch
from hfdist.metrics.memory import current_memory_bytes, return_freed_memory_to_os
assert return_freed_memory_to_os()
cpu = torch.device("cpu")
big = torch.ones(4 * 2**20)
del big
tensors = [torch.ones(512 * 1024) for _ in range(32)]
held = current_memory_bytes(cpu)
del tensors[::2]
print((held - current_memory_bytes(cpu)) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensors_leave_the_resident_set():
    out = subprocess.run([sys.executable, "-c", _HOLES], capture_output=True, text=True, check=True)
    freed = float(out.stdout.split()[-1])
    assert freed >= 28, f"only {freed:.1f} MiB of the 32 MiB freed left the resident set"


def test_the_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert not return_freed_memory_to_os()
