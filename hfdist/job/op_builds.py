"""DeepSpeed's compiled ops as a run on this host would load them: a stale build lock, refused before launch."""

from __future__ import annotations

import os
from pathlib import Path

from hfdist.config.finetune import ConfigError
from hfdist.config.ladder import Rung

__all__ = ["STALE_BUILD_LOCK_SECONDS", "check_deepspeed_build_locks"]

# A build of every DeepSpeed op a host uses takes minutes (6.5 on 2 cores, scripts/prebuild_deepspeed_ops.py): a
# lock older than this belongs to no build still running.
STALE_BUILD_LOCK_SECONDS = 1800


def check_deepspeed_build_locks(rung: Rung, now: float | None = None) -> None:
    """Refuse a DeepSpeed rung while one of torch's extension build locks is stale.

    DeepSpeed loads its ops (the CPU Adam, async I/O, the CPU shared-memory collectives) through
    torch.utils.cpp_extension, which takes a lock file in the op's build folder for every load, built or not, and
    waits for it without a limit while another process holds it. A process killed in that moment (a preempted or
    timed-out run, a killed rank) leaves the file behind, and every later run's ranks would wait on it forever, their
    collectives never reached, so no timeout names it.

    Raises:
        ConfigError: naming the stale lock files and the fix (remove them), before any process starts.
    """
    if not rung.uses_deepspeed:
        return
    import time

    import torch.utils.cpp_extension as cpp

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp.get_default_build_root())
    now = time.time() if now is None else now
    stale = sorted(str(lock) for lock in root.glob("*/*/lock") if now - lock.stat().st_mtime > STALE_BUILD_LOCK_SECONDS)
    if stale:
        raise ConfigError(f"{rung.name} loads DeepSpeed ops through torch's extension builds, and "
                          f"{'these lock files are' if len(stale) > 1 else 'this lock file is'} older than "
                          f"{STALE_BUILD_LOCK_SECONDS // 60} minutes: {', '.join(stale)}. A process killed while "
                          "loading the op left it, and every rank would wait on it forever. If no build is running "
                          "on this machine, remove the file(s) and run again (the built op stays; it is only "
                          "checked again).")
