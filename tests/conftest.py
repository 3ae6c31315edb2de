"""pytest fixtures shared by every layer (helpers without fixtures live in helpers.py)."""

from __future__ import annotations

import os

import pytest

# The suite runs on a GPU host exactly as on a CPU one: GPUs are hidden from the tests and from every process they
# start, before anything imports torch (GPU code paths are tested through a mocked device API instead).
os.environ["CUDA_VISIBLE_DEVICES"] = ""

from helpers import finetune


@pytest.fixture(scope="session")
def references(tmp_path_factory) -> dict[str, dict]:
    """The single-process runs every strategy is compared with: {"single": summary, "lora_single": summary}."""
    root = tmp_path_factory.mktemp("references")
    out = {"single": finetune(root / "single", via="python"),
           "lora_single": finetune(root / "lora_single", "--lora", via="python")}
    for name, summary in out.items():
        summary["_dir"] = root / name
    return out
