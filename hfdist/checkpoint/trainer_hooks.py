"""CheckpointingMixin: the HF Trainer's checkpoints made atomic, and in one layout-free format for every rung but
DeepSpeed.

DeepSpeed keeps the Trainer's own files (DeepSpeed writes its sharded checkpoint). Every other rung (DDP, FSDP2,
TP, PP, 3D, one process) writes its model and optimizer state with torch.distributed.checkpoint under the full
model's parameter names (pipeline stages renamed back), so any of them resumes from any other's checkpoint on any
world (hfdist.checkpoint.format). All of it goes into a staging folder that becomes checkpoint-N by one rename, so an
interrupted save never replaces or impersonates a complete checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hfdist.checkpoint.format import (
    CheckpointError,
    load_sharded,
    replace_staging,
    save_sharded,
    staging_dir,
    write_marker,
)

__all__ = ["CheckpointingMixin"]

SCHEDULER_FILE = "scheduler.pt"


class CheckpointingMixin:
    """Mixed into HfdistTrainer (needs `self.rung`, `self.checkpoint_identity` and `self.qlora`)."""

    rung: Any
    checkpoint_identity: dict[str, Any]
    qlora: bool

    def _saves_dcp(self) -> bool:
        """Every rung but DeepSpeed (whose ZeRO partitions only DeepSpeed reads) checkpoints through DCP."""
        return not self.rung.uses_deepspeed

    def _adapters_only(self) -> bool:
        """Whether checkpoints hold the model's trainables only: QLoRA's (its 4-bit base is rebuilt identically from
        the model's weights by every run)."""
        return self.qlora

    def _canonical_name(self):
        """Maps this rank's parameter names to the full model's: a pipeline stage's "stages.<i>.<local>" to the
        stage's original name; None where the names already are the full model's (DDP, FSDP2, TP)."""
        if not self.rung.uses_pipeline:
            return None
        stages = self.model.runner.stages

        def rename(fqn: str) -> str:
            _, index, local = fqn.split(".", 2)
            return stages[int(index)].original_name(local)

        return rename

    @staticmethod
    def _barrier() -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def _save_checkpoint(self, model, trial) -> None:
        final = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
        staging = staging_dir(final)
        self.store_flos()
        if self.args.should_save and staging.exists():
            shutil.rmtree(staging)  # what a crashed save left behind
        self._barrier()
        try:
            self._write_checkpoint(staging)
        except OSError as exc:
            raise CheckpointError(
                f"Could not write checkpoint {final.name} into {final.parent} ({exc.strerror or exc}). Training "
                f"stopped; every earlier checkpoint is intact (the failed one stays in {staging.name}, which is "
                "never resumed from). Free space (or raise the quota) and rerun with --resume."
            ) from exc
        self._barrier()
        if self.args.should_save:
            write_marker(staging, self.checkpoint_identity, self.state.global_step)
            replace_staging(staging, final)
            from transformers.trainer_utils import rotate_checkpoints

            rotate_checkpoints(output_dir=str(final.parent), save_total_limit=self.args.save_total_limit,
                               use_mtime=False)
        self._barrier()

    def _write_checkpoint(self, folder: Path) -> None:
        """Every rank's part of one checkpoint: model + optimizer, scheduler, RNG, trainer state."""
        folder.mkdir(parents=True, exist_ok=True)
        if self._saves_dcp():
            save_sharded(self.model, self.optimizer, folder, self._canonical_name(), self._adapters_only())
            if self.args.should_save:
                torch.save(self.lr_scheduler.state_dict(), folder / SCHEDULER_FILE)
        else:
            self.save_model(str(folder), _internal_call=True)
            self._save_optimizer_and_scheduler(str(folder))
        self._save_rng_state(str(folder))
        if self.args.should_save:
            from transformers.trainer import TRAINER_STATE_NAME

            self.state.save_to_json(str(folder / TRAINER_STATE_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        if self._saves_dcp():
            return  # the model state is loaded together with the optimizer's, after prepare
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is None or not self._saves_dcp():
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_sharded(self.model, self.optimizer, Path(checkpoint), self._canonical_name(), self._adapters_only())
        self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / SCHEDULER_FILE, weights_only=True))
