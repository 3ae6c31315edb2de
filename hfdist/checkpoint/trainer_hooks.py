"""CheckpointingMixin: the HF Trainer's checkpoints made atomic, and in one layout-free format for every rung but
DeepSpeed.

DeepSpeed keeps the Trainer's own files (DeepSpeed writes its sharded checkpoint). Every other rung (DDP, FSDP2,
TP, PP, 3D, one process) writes its model and optimizer state with torch.distributed.checkpoint under the full
model's parameter names (pipeline stages renamed back), so any of them resumes from any other's checkpoint on any
world (hfdist.checkpoint.format). All of it goes into a staging folder that becomes checkpoint-N by one rename, so an
interrupted save never replaces or impersonates a complete checkpoint.

With `save_async` (by default where an accelerator trains: hfdist.checkpoint.background.background_by_default)
those rungs write the model and optimizer state in the background (hfdist.checkpoint.background): the saving step
copies it and training goes on; the small files (scheduler, RNG, trainer state) are written before the write starts,
and the marker, rename and rotation follow once it has landed on every rank. A save waits for the previous one, and
the end of training waits for the last one (before the Trainer's closing metrics, so train_runtime counts it).

What each checkpoint cost is measured and logged once it has landed (`checkpoint_costs`, the Trainer's logs, so the
trackers and hfdist_summary.json get it): the seconds the step loop waited for it (held) and the seconds its files
took to write, the slowest rank's of each.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hfdist.checkpoint.background import BackgroundSave, background_by_default
from hfdist.checkpoint.format import (
    CheckpointError,
    load_sharded,
    replace_staging,
    save_sharded,
    sharded_state,
    staging_dir,
    write_marker,
)

__all__ = ["CheckpointingMixin", "CheckpointCost"]

SCHEDULER_FILE = "scheduler.pt"


@dataclass
class CheckpointCost:
    """What one checkpoint cost training.

    Attributes:
        step: the checkpoint's step.
        background: written in the background.
        held_s: seconds the step loop waited for it: its save call (a background save's copy, or the whole
            synchronous write) and any later wait for its background write to land (the next save's, the end's).
        write_s: seconds its model and optimizer files took to write (background: from the copy to the landing).
        bytes: the landed checkpoint folder's size on disk, every file (rank 0 measures it; 0 elsewhere).
    """

    step: int
    background: bool
    held_s: float = 0.0
    write_s: float = 0.0
    bytes: int = 0

    def slowest(self) -> CheckpointCost:
        """The cost with the slowest rank's held and write seconds, and rank 0's bytes (collective: one
        all_gather_object)."""
        costs = [self]
        if dist.is_available() and dist.is_initialized():
            costs = [None] * dist.get_world_size()
            dist.all_gather_object(costs, self)
        return CheckpointCost(self.step, self.background, max(c.held_s for c in costs),
                              max(c.write_s for c in costs), max(c.bytes for c in costs))


def folder_bytes(folder: Path) -> int:
    """The size of every file under `folder`."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


class CheckpointingMixin:
    """Mixed into hfdist's trainers (needs `self.rung`, `self.checkpoint_identity`, `self.lora` and `self.qlora`).

    A LoRA / QLoRA run's checkpoints hold the trainable parameters (the adapters), their optimizer state, the
    scheduler, RNG and data position; not the frozen base, which every run rebuilds from its --model (the identity
    record's `base` fingerprint lets --resume refuse another base: hfdist.checkpoint.resume). DCP writes and reads the
    trainables only; DeepSpeed leaves frozen parameters out of its files (exclude_frozen_parameters, as the Trainer
    asks for a peft model), and the Trainer's model files, which repeat the adapters, are left out.

    Args:
        save_async: write the model and optimizer state of DCP checkpoints in the background (DeepSpeed rungs
            always save synchronously); None: where an accelerator trains (background_by_default).
        checkpoint_base: LoRA: checkpoints hold the frozen base too (--checkpoint-base); resuming still loads the
            trainables only, onto the base --model gives.

    Attributes:
        checkpoint_costs: every landed checkpoint's CheckpointCost as a dict (the slowest rank's figures, the same
            on every rank).
    """

    rung: Any
    checkpoint_identity: dict[str, Any]
    lora: bool
    qlora: bool

    def __init__(self, *args, save_async: bool | None = None, checkpoint_base: bool = False, **kwargs) -> None:
        self.save_async = save_async
        self.checkpoint_base = checkpoint_base
        self.checkpoint_costs: list[dict[str, Any]] = []
        self._background = BackgroundSave()
        self._in_flight: str | None = None  # the checkpoint being written in the background
        self._in_flight_cost: CheckpointCost | None = None
        self.last_save: tuple[int, float] | None = None  # rank 0: (step, seconds) of the last checkpoint that landed
        self._landed_bytes = 0  # rank 0: the size of the checkpoint that landed last, until its cost is recorded
        super().__init__(*args, **kwargs)

    def _in_background(self) -> bool:
        """Whether this run's DCP checkpoints are written in the background (`save_async`, or by the device)."""
        wanted = self.save_async if self.save_async is not None else background_by_default(self.args.device)
        return wanted and self._saves_dcp()

    def _saves_dcp(self) -> bool:
        """Every rung but DeepSpeed (whose ZeRO partitions only DeepSpeed reads) checkpoints through DCP."""
        return not self.rung.uses_deepspeed

    def _adapters_only(self) -> bool:
        """Whether checkpoints hold the model's trainables only: an adapter run's, unless `checkpoint_base` (QLoRA's
        always: its 4-bit base is quantised anew, identically, from the model's weights by every run)."""
        return self.qlora or (self.lora and not self.checkpoint_base)

    def checkpoint_contents(self) -> dict[str, Any]:
        """What this run's checkpoints hold ("adapters", "adapters and base" or "model") and the bytes of the
        trained state they must hold, counted from the full model's trainable parameters (None without its
        structure, `self.skeleton`): each one's fp32 value and AdamW's two fp32 moments, 12 bytes; ZeRO-1/2 also
        write the module's own copy of the trainables beside their fp32 master partitions (its element size more).
        The files add the scheduler, RNG streams, trainer state and the format's metadata."""
        skeleton = getattr(self, "skeleton", None)
        trainable = None if skeleton is None else sum(p.numel() for p in skeleton.parameters() if p.requires_grad)
        per_param, counted = 12, "trainable parameters and AdamW's two moments of each, fp32 (12 bytes a parameter)"
        if self.rung.uses_deepspeed and self.rung.zero_stage < 3:
            module = next(p for p in self.model.parameters() if p.requires_grad).element_size()
            per_param += module
            counted += f", and ZeRO's module copy of the trainables ({module} bytes a parameter)"
        return {"holds": "adapters" if self._adapters_only() else "adapters and base" if self.lora else "model",
                "counted": counted, "counted_bytes": None if trainable is None else per_param * trainable}

    def _loads_trainables_only(self) -> bool:
        """Resuming an adapter run loads its trainables only, whatever its checkpoint holds: the frozen base is the
        one --model gives (its fingerprint checked before launch), so a checkpoint with or without it resumes."""
        return self.lora

    def _canonical_name(self):
        """Maps this rank's parameter names to the full model's; None where they already are the full model's (DDP,
        FSDP2, TP). A trainer whose model renames them (pipeline stages: hfdist.train.pipeline_trainer) overrides
        this."""
        return None

    @staticmethod
    def _barrier() -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    @staticmethod
    def _write_failed(final: Path, exc: OSError) -> CheckpointError:
        return CheckpointError(
            f"Could not write checkpoint {final.name} into {final.parent} ({exc.strerror or exc}). Training "
            f"stopped; every earlier checkpoint is intact (the failed one stays in {staging_dir(final).name}, which "
            "is never resumed from). Free space (or raise the quota) and rerun with --resume.")

    def _save_checkpoint(self, model, trial) -> None:
        final = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
        if self.state.best_global_step == self.state.global_step:  # evaluated just now, the best eval loss so far
            self.state.best_model_checkpoint = str(final)
        staging = staging_dir(final)
        self.store_flos()
        self._wait_for_checkpoint()  # one save in flight: its staged copy is refilled, checkpoints land in order
        started = time.perf_counter()
        if self.args.should_save and staging.exists():
            shutil.rmtree(staging)  # what a crashed save left behind
        self._barrier()
        background = self._in_background()
        cost = CheckpointCost(self.state.global_step, background)
        finish = (partial(self._finish_checkpoint, staging, final, self.state.global_step, background,
                          self.state.best_model_checkpoint, started) if self.args.should_save else None)
        try:
            cost.write_s = self._write_checkpoint(staging, background, finish)
        except OSError as exc:
            raise self._write_failed(final, exc) from exc
        if background:
            self._in_flight, self._in_flight_cost = str(final), cost
            cost.held_s = time.perf_counter() - started
            return
        self._barrier()
        if finish is not None:
            finish()
        self._barrier()
        cost.held_s = time.perf_counter() - started
        self._record_cost(cost)

    def _record_cost(self, cost: CheckpointCost) -> None:
        """Keep a landed checkpoint's cost (the slowest rank's) and log it, so the trackers and the summary get it.
        Collective: every rank calls it for the same checkpoint."""
        cost.bytes, self._landed_bytes = self._landed_bytes, 0  # rank 0's measure of the folder (0 elsewhere)
        slowest = asdict(cost.slowest())
        self.checkpoint_costs.append(slowest)
        self.log({f"checkpoint/{key}": float(value) for key, value in slowest.items()})

    def _finish_checkpoint(self, staging: Path, final: Path, step: int, background: bool, best: str | None,
                           started: float) -> None:
        """Rank 0, once every rank's files are written: the marker (with the seconds the save took since `started`:
        the grace a preemption needs, hfdist.train.preemption), the rename, the rotation of older checkpoints (which
        sees complete checkpoints only, the newest among them this one, and keeps `best`: the checkpoint of the best
        evaluation loss when this save began)."""
        from transformers.trainer_utils import rotate_checkpoints

        seconds = time.perf_counter() - started
        write_marker(staging, {**self.checkpoint_identity, "async_save": background, "save_seconds": seconds}, step)
        self._landed_bytes = folder_bytes(staging)
        replace_staging(staging, final)
        rotate_checkpoints(output_dir=str(final.parent), save_total_limit=self.args.save_total_limit,
                           best_model_checkpoint=best, use_mtime=False)
        self.last_save = (step, seconds)

    def _wait_for_checkpoint(self) -> None:
        """Block until the checkpoint being written in the background (if any) is complete, and record its cost
        (the wait held the step loop too); its write error as the synchronous save reports it."""
        final, self._in_flight = self._in_flight, None
        cost, self._in_flight_cost = self._in_flight_cost, None
        started = time.perf_counter()
        try:
            write_s = self._background.wait()
        except OSError as exc:
            raise self._write_failed(Path(final), exc) from exc
        if cost is not None:
            cost.held_s += time.perf_counter() - started
            cost.write_s = write_s or 0.0
            self._record_cost(cost)

    def land_checkpoints(self) -> None:
        """The checkpoint being written in the background (if any) lands, and the writer closes: the end of training,
        or a stop before it (a diverged run keeps its last finite checkpoint)."""
        self._wait_for_checkpoint()
        self._background.close()

    def _finalize_training(self, trial, num_train_samples, start_time):
        self.land_checkpoints()  # the last checkpoint lands before the run's closing metrics and final save
        return super()._finalize_training(trial, num_train_samples, start_time)

    def _write_checkpoint(self, folder: Path, background: bool = False, finish=None) -> float:
        """Every rank's part of one checkpoint: scheduler, RNG, trainer state, then model + optimizer (background:
        written from a thread, which calls `finish` once it has landed on every rank; the small files come first,
        so the folder is whole when `finish` renames it). Returns the seconds the model and optimizer files took
        (0 in the background: the write's own time comes when it lands)."""
        folder.mkdir(parents=True, exist_ok=True)
        if self._saves_dcp() and self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), folder / SCHEDULER_FILE)
        self._save_rng_state(str(folder))
        if self.args.should_save:
            from transformers.trainer import TRAINER_STATE_NAME

            self.state.save_to_json(str(folder / TRAINER_STATE_NAME))
        started = time.perf_counter()
        if not self._saves_dcp():
            if not self._adapters_only():  # DeepSpeed's own files hold the adapters: no second copy of them
                self.save_model(str(folder), _internal_call=True)
            if self.lora and self.checkpoint_base:  # the Trainer would leave a peft model's frozen parameters out
                self.model_wrapped.save_checkpoint(str(folder), exclude_frozen_parameters=False)
                if self.args.should_save:  # the rest of what the Trainer's own save writes
                    torch.save(self.lr_scheduler.state_dict(), folder / SCHEDULER_FILE)
            else:
                self._save_optimizer_and_scheduler(str(folder))
        elif background:
            state = sharded_state(self.model, self.optimizer, self._canonical_name(), self._adapters_only())
            self._background.start(state, folder, finish)
            return 0.0
        else:
            save_sharded(self.model, self.optimizer, folder, self._canonical_name(), self._adapters_only())
        return time.perf_counter() - started

    def load_best_checkpoint(self) -> int | None:
        """Put the weights of the checkpoint with the best eval loss (kept from rotation) back into the model, when
        they are not the model's already; its step, or None when no checkpoint was evaluated. Collective."""
        best = self.state.best_model_checkpoint
        if best is None:
            return None
        step = int(Path(best).name.rsplit("-", 1)[1])
        if step != self.state.global_step:
            if self._saves_dcp():  # with its optimizer state, which nothing uses after training
                load_sharded(self.model, self.optimizer, Path(best), self._canonical_name(),
                             self._loads_trainables_only())
            else:
                self._load_best_model()  # the Trainer's DeepSpeed load
        return step

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        if self._saves_dcp():
            return  # the model state is loaded together with the optimizer's, after prepare
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is None or not self._saves_dcp():
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_sharded(self.model, self.optimizer, Path(checkpoint), self._canonical_name(),
                     self._loads_trainables_only())
        state = torch.load(Path(checkpoint) / SCHEDULER_FILE, weights_only=True)
        self.lr_scheduler.load_state_dict(_regrouped(state, len(self.optimizer.param_groups)))


def _regrouped(state: dict, groups: int) -> dict:
    """A scheduler state saved with another number of param groups, fitted to `groups`: transformers gives expert
    parallelism's experts (on their own device mesh) param groups of their own, so a checkpoint resharded onto or
    off an ep layout has more or fewer groups. Each per-group list holds one value repeated (one schedule for every
    group, as the Trainer makes it); a state whose groups differ is left as it is (torch then refuses it)."""
    out = dict(state)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        values = state.get(key)
        if isinstance(values, list) and values and len(values) != groups and all(v == values[0] for v in values):
            out[key] = [values[0]] * groups
    return out
