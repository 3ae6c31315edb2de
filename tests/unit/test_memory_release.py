"""While they load and save the model, ranks return freed tensors to the OS (hfdist.metrics.memory.
freed_memory_returned_to_os), so that the per-rank RSS figures of loading and saving count tensors rather than
glibc's heap (tests/e2e/test_scale_memory.py); the training loop between keeps glibc's heap."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hfdist.metrics.memory import freed_memory_returned_to_os

# In a fresh interpreter (a test process's heap already has holes that would serve the tensors): free every other
# one of 32 tensors of 2 MiB, after a 16 MiB free that makes glibc serve 2 MiB blocks from its heap (measured:
# 0 MiB leave the resident set then), and print how many MiB left the resident set, inside the window and after it.
_HOLES = """
import torch
from hfdist.metrics.memory import current_memory_bytes, freed_memory_returned_to_os
cpu = torch.device("cpu")

def holes():
    big = torch.ones(4 * 2**20)
    del big
    tensors = [torch.ones(512 * 1024) for _ in range(32)]
    held = current_memory_bytes(cpu)
    del tensors[::2]
    return (held - current_memory_bytes(cpu)) / 2**20

with freed_memory_returned_to_os() as active:
    assert active
    inside = holes()
print(inside, holes())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensors_leave_the_resident_set_inside_the_window_only():
    out = subprocess.run([sys.executable, "-c", _HOLES], capture_output=True, text=True, check=True)
    inside, after = (float(v) for v in out.stdout.split()[-2:])
    assert inside >= 28, f"only {inside:.1f} MiB of the 32 MiB freed left the resident set"
    # After the window glibc's heap serves these blocks again (no mmap + page faults per tensor in the training loop).
    assert after < 4, f"{after:.1f} MiB left the resident set after the window: the threshold was not restored"


def test_the_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    with freed_memory_returned_to_os() as active:
        assert not active
