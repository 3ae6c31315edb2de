"""hfdist.job.collector: the cyclic collector paused while a job's process imports, then one collection, the
survivors frozen, the collector on again; nothing changed in a process that never paused (each case runs in a
fresh interpreter: the collector's state is process-wide)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO

PAUSED_THEN_RESUMED = """
import gc
from hfdist.job.collector import pause_collector, resume_collector
pause_collector()
assert not gc.isenabled()
cycle = []; cycle.append(cycle); del cycle  # garbage only the collector frees
kept = [object() for _ in range(1000)]
resume_collector()
assert gc.isenabled() and gc.get_freeze_count() >= 1000, gc.get_freeze_count()
assert gc.collect() == 0  # the cycle went in resume's collection, before the freeze
resume_collector()  # a second resume: nothing more
"""

NEVER_PAUSED = """
import gc
from hfdist.job.collector import resume_collector
resume_collector()
assert gc.isenabled() and gc.get_freeze_count() == 0
gc.disable()  # a process that turned the collector off itself keeps it off
from hfdist.job.collector import pause_collector
pause_collector(); resume_collector()
assert not gc.isenabled() and gc.get_freeze_count() == 0
"""


@pytest.mark.parametrize("script", [PAUSED_THEN_RESUMED, NEVER_PAUSED], ids=["paused", "never-paused"])
def test_collector(script):
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
