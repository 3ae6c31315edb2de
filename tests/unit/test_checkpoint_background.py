"""Checkpoints written in the background (hfdist.checkpoint.background), in one process: the saving call returns
while the write is still held, the checkpoint holds the state of the saving step whatever training does during the
write, `finish` (rank 0's marker and rename) runs only after the write, a second save waits for the first, a failed
write is raised by the next wait as the OSError it was, and rotation never touches a checkpoint still being written.

The write is held by wrapping DCP's file writer (the thread that writes calls it) around a threading.Event."""

from __future__ import annotations

import errno
import io
import threading

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import _FileSystemWriter

from hfdist.checkpoint.background import BackgroundSave
from hfdist.checkpoint.format import MARKER, SHARDED_DIR, load_sharded, sharded_state, staging_dir


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model after one AdamW step (so the optimizer holds moments)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"p.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in enumerate(optimizer.state.values()):
        out |= {f"o.{i}.{k}": v.clone() for k, v in state.items()}
    return out


@pytest.fixture
def held(monkeypatch):
    """An Event the background write waits for before writing anything, and the list of folders written."""
    gate, written = threading.Event(), []
    original = _FileSystemWriter.write_data

    def write_data(self, plan, planner):
        assert gate.wait(60), "the test never released the write"
        written.append(str(self.path))
        return original(self, plan, planner)

    monkeypatch.setattr(_FileSystemWriter, "write_data", write_data)
    return gate, written


def test_training_goes_on_while_the_saved_state_is_written(tmp_path, held):
    gate, _ = held
    model, optimizer = _trained(0)
    before = _snapshot(model, optimizer)
    folder, events = staging_dir(tmp_path / "checkpoint-1"), []
    folder.mkdir()
    saver = BackgroundSave()
    saver.start(sharded_state(model, optimizer), folder, finish=lambda: events.append("finished"))
    # Returned with the write held: nothing finished, no DCP metadata yet.
    assert saver.in_flight and events == [] and not (folder / SHARDED_DIR / ".metadata").exists()
    model(torch.randn(3, 8)).square().sum().backward()  # the next step, mutating parameters and moments in place
    optimizer.step()
    assert _snapshot(model, optimizer).keys() == before.keys()
    assert any(not torch.equal(v, before[k]) for k, v in _snapshot(model, optimizer).items())
    gate.set()
    saver.close()
    assert events == ["finished"] and not saver.in_flight
    restored, restored_optimizer = _trained(1)  # another state, overwritten by the load
    load_sharded(restored, restored_optimizer, folder)
    after = _snapshot(restored, restored_optimizer)
    assert after.keys() == before.keys()
    for key, value in before.items():  # the state of the saving step, not the step trained during the write
        assert torch.equal(after[key], value), key


def test_a_second_save_waits_until_the_first_has_finished(tmp_path, held):
    gate, written = held
    model, optimizer = _trained(0)
    saver, order = BackgroundSave(), []
    first, second = staging_dir(tmp_path / "checkpoint-1"), staging_dir(tmp_path / "checkpoint-2")
    saver.start(sharded_state(model, optimizer), first, finish=lambda: order.append("first finished"))

    def save_again():
        saver.start(sharded_state(model, optimizer), second, finish=lambda: order.append("second finished"))
        order.append("second started")

    thread = threading.Thread(target=save_again)
    thread.start()
    thread.join(timeout=1.0)
    assert thread.is_alive() and order == []  # held behind the first save's write
    gate.set()
    thread.join(timeout=60)
    saver.close()
    assert order == ["first finished", "second started", "second finished"]
    assert written == [str(first / SHARDED_DIR), str(second / SHARDED_DIR)]


def test_a_full_disk_inside_torch_save_is_raised_as_the_disk_error(tmp_path, monkeypatch):
    """torch.save hides a write that fails inside a record behind a RuntimeError ('unexpected pos ...', what a
    benchmark that filled its disk saw); the wait raises the OSError underneath, which the job reports as a full
    disk."""
    class FullDisk(io.RawIOBase):  # full after its first 700 bytes: inside the tensor's record
        written = 0

        def writable(self):
            return True

        def write(self, data):
            if self.written + len(data) > 700:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += len(data)
            return len(data)

    def write_into_a_full_disk(self, plan, planner):
        torch.save(torch.zeros(1000), FullDisk())

    monkeypatch.setattr(_FileSystemWriter, "write_data", write_into_a_full_disk)
    with pytest.raises(RuntimeError, match="unexpected pos"):  # what torch.save itself raises
        write_into_a_full_disk(None, None, None)
    model, optimizer = _trained(0)
    saver = BackgroundSave()
    saver.start(sharded_state(model, optimizer), tmp_path / "staging")
    with pytest.raises(OSError) as raised:
        saver.wait()
    assert raised.value.errno == errno.ENOSPC
    saver.close()


def test_a_failed_write_is_raised_by_the_next_wait_and_nothing_is_finished(tmp_path, monkeypatch):
    def full_disk(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_FileSystemWriter, "write_data", full_disk)
    model, optimizer = _trained(0)
    saver, events = BackgroundSave(), []
    saver.start(sharded_state(model, optimizer), tmp_path / "staging", finish=lambda: events.append("finished"))
    with pytest.raises(OSError) as raised:
        saver.wait()
    assert raised.value.errno == errno.ENOSPC and events == []
    saver.wait()  # the error is raised once; nothing is in flight any more
    saver.close()


def test_rotation_keeps_the_newest_complete_checkpoint_and_the_one_being_written(tmp_path):
    """What `_finish_checkpoint` runs after its rename (transformers' rotation, save_total_limit 1): a save in flight
    is a `.partial-` folder, which the rotation does not see."""
    from transformers.trainer_utils import rotate_checkpoints

    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / MARKER).write_text("{}")
    staging_dir(tmp_path / "checkpoint-6").mkdir()
    rotate_checkpoints(output_dir=str(tmp_path), save_total_limit=1, use_mtime=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".partial-checkpoint-6", "checkpoint-4"]


def test_param_groups_are_saved_once_a_group_and_restored_by_name(tmp_path):
    """A param group's settings are one record (not a dozen objects a parameter); loading restores each parameter's
    group settings by name, whatever group it sits in on the loading side."""
    from torch.distributed.checkpoint import FileSystemReader

    from hfdist.checkpoint.format import load_sharded, save_sharded

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.25, betas=(0.8, 0.9))
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    save_sharded(model, optimizer, tmp_path)
    keys = FileSystemReader(str(tmp_path / "sharded")).read_metadata().state_dict_metadata
    assert [k for k in keys if k.startswith("param_groups.")] == ["param_groups.0.weight"]
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    # Another grouping on the loading side: each parameter in a group of its own, other settings.
    loaded = torch.optim.AdamW([{"params": [p]} for p in fresh.parameters()], lr=1.0, betas=(0.5, 0.5))
    load_sharded(fresh, loaded, tmp_path)
    assert [(g["lr"], tuple(g["betas"])) for g in loaded.param_groups] == [(0.25, (0.8, 0.9))] * 4
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert torch.equal(loaded.state[fresh[1].bias]["exp_avg"], optimizer.state[model[1].bias]["exp_avg"])
