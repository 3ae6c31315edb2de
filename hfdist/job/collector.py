"""Python's cyclic garbage collector paused while a job's process imports its libraries.

Importing torch, transformers' Trainer, accelerate, peft and the rest makes some 600,000 objects that live as long
as the process; the collector's passes over them while they are made cost a process about 2 s of a core (22% of
those imports, user CPU measured on the 2-core development machine: 7.0 s against 9.0 s for `import
transformers.trainer, deepspeed`), and every rank and launcher of a run pays it. `pause_collector()` at the start of
a job; `resume_collector()` once the imports are done and before the work that makes garbage of its own (data
preparation, the model's weights, training, the launcher's wait for its ranks): one full collection, then what
survives is frozen out of the collector's later passes (gc.freeze), which then scan only what the run makes.
"""

from __future__ import annotations

import gc

__all__ = ["pause_collector", "resume_collector"]

_paused = False


def pause_collector() -> None:
    """Stop the cyclic collector until `resume_collector()` (reference counting still frees everything else)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_collector() -> None:
    """Collect once, freeze the survivors and restart the collector, if `pause_collector()` stopped it (else
    nothing: a process that never paused, such as one that calls the job's functions itself, keeps its own
    settings)."""
    global _paused
    if _paused:
        _paused = False
        gc.collect()
        gc.freeze()
        gc.enable()
