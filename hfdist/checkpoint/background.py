"""Checkpoints written in the background (`--save-async`, the default on every DCP rung that trains on GPUs): the
step that saves only copies the model and optimizer state into host memory (pinned on GPU); a thread writes the copy
with torch.distributed.checkpoint's `async_save` while the next steps train.

Where training runs on the CPU, the writing thread takes a core that training uses, so a background save costs about
what a synchronous one does there and holds a second copy of the state (docs/checkpoints.md has the figures):
`background_by_default` saves synchronously unless an accelerator trains.

Rules (hfdist.checkpoint.trainer_hooks applies them):
- one save in flight per rank: a save first waits for the previous one (its staged copy is reused, and checkpoints
  land in step order);
- the copy is the state at the saving step: training after it changes the live tensors, never the copy;
- the write's own collectives (DCP's plan and its final gather) run on a gloo process group of their own, so they
  never interleave with the training thread's collectives on the world's group;
- `finish` (rank 0: the identity marker, the rename of the staging folder, the rotation of old checkpoints) runs
  once DCP's save has returned on rank 0, which is after every rank's shard files are written: DCP's save ends with
  a gather of every rank's write results to rank 0. A rank that dies mid-write leaves the staging folder unrenamed,
  which nothing resumes from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from hfdist.checkpoint.format import SHARDED_DIR, raise_write_error

__all__ = ["BackgroundSave", "background_by_default", "world_timeout"]


def background_by_default(device: torch.device | str) -> bool:
    """Whether checkpoints are written in the background when the run does not say: where the model trains on an
    accelerator (its cores stay free for the writing thread), not on the CPU (module docstring)."""
    return torch.device(device).type != "cpu"


def world_timeout() -> timedelta | None:
    """The world group's collective timeout (the --collective-timeout the job put on it), for a group of hfdist's own
    (the checkpoint writes', the preemption agreement's): `new_group` would give it torch's 30 minutes."""
    import torch.distributed as dist

    group = dist.distributed_c10d._get_default_group()
    for device in group._device_types:
        timeout = getattr(getattr(group._get_backend(device), "options", None), "_timeout", None)
        if timeout is not None:
            return timeout
    return None


class BackgroundSave:
    """This rank's checkpoint writer: at most one save in flight, its state staged in a reused host-memory copy."""

    def __init__(self) -> None:
        self._stager = None
        self._group = None
        self._done: Future | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a save was started and not yet waited for."""
        return self._done is not None

    def _process_group(self):
        """The gloo group of the writes' collectives (created on first use, by every rank at the same save); None
        without a process group (one process)."""
        import torch.distributed as dist

        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo", timeout=world_timeout(), group_desc="hfdist_checkpoint")
        return self._group

    def _staging(self):
        """DCP's stager, kept across saves: its host copy of each tensor is allocated once and refilled (no page
        faults at every save), pinned on GPU (fast device-to-host copies), synchronous (the copy is whole when
        `start` returns, before the next optimizer step changes the live tensors)."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(),
                                                        use_shared_memory=False, use_async_staging=False,
                                                        use_non_blocking_copy=False))
        return self._stager

    def start(self, state: dict[str, Any], folder: Path, finish: Callable[[], None] | None = None) -> None:
        """Copy `state` (model + optimizer, as hfdist.checkpoint.format.sharded_state builds it) into host memory
        and write it to folder/sharded from a background thread; returns once the copy is made. Waits for the
        previous save first (raising its error). Collective: every rank calls it at the same save.

        Args:
            finish: called in the writing thread once the write has landed on every rank (rank 0's marker and
                rename); an error it raises is raised by the next `wait`.
        """
        import torch.distributed.checkpoint as dcp

        self.wait()
        done: Future = Future()
        started = time.perf_counter()
        upload = dcp.async_save(state, checkpoint_id=str(folder / SHARDED_DIR), process_group=self._process_group(),
                                async_stager=self._staging())

        def landed(write: Future) -> None:
            try:
                write.result()
                if finish is not None:
                    finish()
            except BaseException as exc:  # noqa: BLE001 (DCP's CheckpointException is a BaseException; wait raises it)
                done.set_exception(exc)
            else:
                done.set_result(time.perf_counter() - started)

        self._done = done
        upload.add_done_callback(landed)

    def wait(self) -> float | None:
        """Block until the save in flight (if any) has landed and finished.

        Returns:
            The seconds its write took on this rank, from the copy to the landing (None: no save was in flight).

        Raises:
            OSError: a shard could not be written (full disk, quota, permissions), as the writing rank saw it.
        """
        done, self._done = self._done, None
        if done is None:
            return None
        try:
            return done.result()
        except BaseException as exc:  # noqa: BLE001 (DCP's CheckpointException gathers every rank's failure)
            raise_write_error(exc)

    def close(self) -> None:
        """Wait for the save in flight, then free the staged copy (the end of training)."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
