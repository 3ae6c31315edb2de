"""End-to-end: `--compile` on a rung that does not take it is refused before launch, in one paragraph.

The rungs that take it train compiled against the eager single process (rel 1e-4, every decoder layer checked
compiled on every rank) in tests/e2e/test_cells.py, one cell per rung the rung table says takes --compile.
"""

from __future__ import annotations

import sys

import pytest

from helpers import FINETUNE, run_cmd

pytestmark = pytest.mark.multiproc


def test_compile_on_a_pipeline_rung_is_refused_before_launch(tmp_path):
    out = tmp_path / "o"
    proc = run_cmd([sys.executable, str(FINETUNE), "--config", "pp", "--compile", "--output-dir", str(out)],
                   timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--compile does not run on pp" in proc.stderr and "Drop --compile" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
