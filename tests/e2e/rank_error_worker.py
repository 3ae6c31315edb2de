"""A job whose ranks stop on bad input only they meet (hfdist's own job refuses what it can before it starts any
process): it hands over to the fsdp_full_shard world as `hfdist finetune` does, and each rank raises.

    python tests/e2e/rank_error_worker.py OUTPUT_DIR
"""

import os
import sys
import time
from pathlib import Path

from hfdist.config.finetune import ConfigError, parse_args
from hfdist.errors import ERROR_DIR_ENV, run_with_clear_errors
from hfdist.job.launch import ensure_world
from hfdist.job.world import resolve_rung


def job() -> int:
    cfg = parse_args(["--config", "fsdp_full_shard", "--output-dir", sys.argv[1]])
    handed_over = ensure_world(resolve_rung(cfg), cfg, [__file__], sys.argv[1:])
    if handed_over is not None:
        return handed_over
    if os.environ["RANK"] == "0":
        # torch elastic stops the other ranks as soon as one exits; rank 0 waits (30 s at most) for rank 1's paragraph
        # so that the collection of several ranks is what the test sees, however loaded the machine is
        other = Path(os.environ[ERROR_DIR_ENV]) / "rank-1.txt"
        deadline = time.monotonic() + 30
        while not other.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    raise ConfigError("The shard of this rank holds no rows (a problem only the ranks can see). Fix the data.")


if __name__ == "__main__":
    sys.exit(run_with_clear_errors(job))
