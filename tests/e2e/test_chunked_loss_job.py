"""End-to-end: the job's loss in sequence chunks (--loss-chunk-size 16 of 64 positions) through scripts/finetune.py
gives the single-process run's losses (whose 64 positions fit one default chunk: unchunked), on one process, on a
DeepSpeed rung (the Trainer's loss through DeepSpeed's engine) and on the pipeline rung (the last stage's loss).

The zero2 and pipeline runs are the session's shared ones (helpers.SHARED_RUNS: they run with helpers.LOSS_CHUNKS),
whose sharding, schedule and saved models tests/e2e/test_finetune_ladder.py and test_finetune_pipeline.py check;
the one-process run is launched here.
"""

from __future__ import annotations

import pytest

from helpers import LOSS_CHUNKS

pytestmark = pytest.mark.multiproc

LOSS_RTOL = 1e-5  # as tests/e2e/test_finetune_ladder.py: the reduction order differs across ranks
SHARED = {"zero2": "zero2", "pp": "pp_Interleaved1F1B"}  # case -> the SHARED_RUNS name that computes it


@pytest.fixture(scope="module")
def chunked_runs(tmp_path_factory, shared_runs) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("chunked")
    own = shared_runs.launch(list(SHARED.values()),
                             also={"single": (root / "single", (*LOSS_CHUNKS, "--no-wandb"), {})})
    return {**own, **{case: shared_runs[name] for case, name in SHARED.items()}}


@pytest.mark.parametrize("name", ["single", "zero2", "pp"])
def test_chunked_job_losses_equal_unchunked_single_process(chunked_runs, references, name):
    run, ref = chunked_runs[name], references["single"]
    assert run["config"]["loss_chunk_size"] == int(LOSS_CHUNKS[1])  # the chunks are what ran ...
    assert ref["config"]["loss_chunk_size"] >= ref["strategy"]["seq_len"]  # ... against one chunk
    got = run["losses"]
    assert len(got) == len(ref["losses"]) == 4
    assert got == pytest.approx(ref["losses"], rel=LOSS_RTOL if name != "single" else 1e-6), \
        f"{name}: {got} vs {ref['losses']}"
