"""DistributedMetricsCallback's parts in one process: FLOPs of real batches, memory windows against a mocked CUDA
allocator, the callback-list placement, the gathered records and the console table.

The CUDA case runs on CPU: torch.cuda's memory and device functions are replaced by a fake allocator whose peaks and
counters the test sets, so the GPU code paths (per-window peaks, cumulative counters, the setup peak) are exercised.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback, ProgressCallback, TrainerCallback

from hfdist.callbacks.distributed_metrics import DistributedMetricsCallback
from hfdist.callbacks.placement import find_caller, move_ahead_of_integrations, replace_callback
from hfdist.callbacks.progress import MetricsProgressCallback, rank_table
from hfdist.callbacks.rank_metrics import gather_records, slowest_rank
from hfdist.metrics.flops import batch_lengths, flops_per_token, model_token_flops
from hfdist.models.build import build_model
from hfdist.models.presets import load_config

from helpers import fake_world

GB = 1024**3


def test_batch_lengths_of_padded_packed_and_plain_batches():
    ids = torch.zeros(2, 5, dtype=torch.long)
    assert batch_lengths(ids) == (10, 2 * 25)
    right_and_left_padding = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    tokens, squares = batch_lengths(ids, right_and_left_padding)
    assert (int(tokens), int(squares)) == (7, 3 * 3 + 4 * 4)
    packed = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])  # documents of 3 + 2 and 5 tokens, no padding
    tokens, squares = batch_lengths(ids, None, packed)
    assert (int(tokens), int(squares)) == (10, 9 + 4 + 25)
    embeds = torch.zeros(2, 5, 16)  # inputs_embeds: (batch, seq, hidden)
    assert batch_lengths(embeds) == (10, 50)
    assert batch_lengths() == (0, 0)


def test_batch_flops_match_flops_per_token_of_each_sequence():
    config = load_config("llama-tiny", 1024)
    model = build_model("llama-tiny", vocab_size=1024)
    counts = model_token_flops(model)
    assert counts.per_token(64) == flops_per_token(config, 64)
    # full rows of 64: the per-token figure times the tokens
    assert counts.of_batch(4 * 64, 4 * 64 * 64) == pytest.approx(4 * 64 * flops_per_token(config, 64))
    # a packed row of 48 + 16 tokens costs what the two sequences cost apart
    positions = torch.cat([torch.arange(48), torch.arange(16)]).unsqueeze(0)
    tokens, squares = batch_lengths(torch.zeros(1, 64, dtype=torch.long), None, positions)
    want = 48 * flops_per_token(config, 48) + 16 * flops_per_token(config, 16)
    assert counts.of_batch(int(tokens), int(squares)) == pytest.approx(want)


class FakeAllocator:
    """torch.cuda's allocator statistics as the test sets them: a peak since the last reset and cumulative
    counters that reset_peak_memory_stats leaves alone (as CUDA's do)."""

    def __init__(self) -> None:
        self.current, self.peak, self.retries, self.ooms = 0, 0, 0, 0

    def use(self, peak: int, retries: int = 0, ooms: int = 0) -> None:
        self.peak = max(self.peak, peak)
        self.retries += retries
        self.ooms += ooms

    def reset_peak(self, device=None) -> None:
        self.peak = self.current

    def stats(self, device=None) -> dict[str, int]:
        return {"allocated_bytes.all.peak": self.peak, "reserved_bytes.all.peak": self.peak + GB,
                "active_bytes.all.peak": self.peak, "num_alloc_retries": self.retries, "num_ooms": self.ooms}


@pytest.fixture
def fake_cuda(monkeypatch):
    alloc = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: alloc.peak)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: alloc.current)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", alloc.reset_peak)
    monkeypatch.setattr(torch.cuda, "memory_stats", alloc.stats)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    return alloc


def _args(device: str, **kw) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device(device), world_size=1, bf16=False, fp16=False, report_to=[],
                           output_dir="out", **kw)


def _step(cb, args, state, model, optimizer, batch: torch.Tensor) -> None:
    cb.on_step_begin(args, state, TrainerControl())
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    state.global_step += 1
    cb.on_step_end(args, state, TrainerControl())


def _log(cb, args, state, loss: float) -> dict:
    logs = {"loss": loss}
    state.log_history.append({**logs, "step": state.global_step})  # as Trainer.log does before the callbacks
    cb.on_log(args, state, TrainerControl(), logs=logs)
    return logs


def test_memory_windows_on_cuda_keep_setup_and_after_training_apart(fake_cuda, capsys):
    """gpu-readiness #9: the load peak is not hidden, retries/OOMs are per window, nothing after training counts."""
    model = build_model("llama-tiny", vocab_size=1024).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args, state = _args("cuda"), TrainerState()
    batch = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    fake_cuda.current = GB
    fake_cuda.use(peak=5 * GB, retries=3)  # loading the model: a peak and 3 retries before training
    cb = DistributedMetricsCallback()
    cb.on_train_begin(args, state, TrainerControl(), model=model, optimizer=optimizer)
    assert "not called by a Trainer's CallbackHandler" in capsys.readouterr().err  # no handler in this test

    fake_cuda.use(peak=2 * GB, retries=1)
    _step(cb, args, state, model, optimizer, batch)
    first = _log(cb, args, state, 3.0)
    assert first["rank0/peak_memory_bytes"] == 2 * GB and first["rank0/peak_reserved_bytes"] == 3 * GB
    assert (first["rank0/alloc_retries"], first["rank0/ooms"]) == (1, 0)  # not the 4 the counter shows
    assert first["rank0/tokens"] == 32 and first["slowest_rank"] == 0
    assert state.log_history[-1]["rank0/peak_memory_bytes"] == 2 * GB  # the entry Trainer.log appended

    fake_cuda.use(peak=int(1.5 * GB))
    _step(cb, args, state, model, optimizer, batch)
    second = _log(cb, args, state, 2.9)
    assert second["rank0/peak_memory_bytes"] == int(1.5 * GB) and second["rank0/alloc_retries"] == 0

    fake_cuda.use(peak=3 * GB, ooms=1)  # a last step that no log covers
    _step(cb, args, state, model, optimizer, batch)
    cb.on_train_end(args, state, TrainerControl())
    (run,) = cb.ranks
    assert run["peak_memory_bytes"] == 3 * GB and run["setup_peak_memory_bytes"] == 5 * GB
    assert (run["alloc_retries"], run["ooms"], run["steps"], run["tokens"]) == (1, 1, 3, 96)
    assert run["param_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    assert run["optimizer_bytes"] > 2 * run["param_bytes"]  # Adam's two moments (+ step counters)
    assert 0 < run["mfu"] < 1 and "H100 SXM datasheet, dense fp32" in cb.closing_table()

    fake_cuda.use(peak=9 * GB)  # saving the model after training: not the run's figure
    model(input_ids=batch)
    assert cb.ranks == [run]


def test_setup_peak_survives_deepspeeds_resets_of_the_peak(fake_cuda, monkeypatch):
    """gpu-readiness B8: DeepSpeed's engine, built inside the Trainer's preparation, resets CUDA's peak statistics
    (ZeRO-1/2's `empty_cache` before flattening each parameter group, on every rank); the setup peak the memory meter
    records at the first step must still be the highest one before it. DeepSpeed's own `empty_cache` runs through its
    CUDA accelerator; the Trainer's preparation is replaced by that engine build (peak 7 GB, then the reset)."""
    import deepspeed.runtime.utils as ds_utils
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    from transformers import Trainer

    import hfdist.train.trainer as trainer_module
    from hfdist.callbacks.memory import MemoryMeter
    from hfdist.config.ladder import load_rung
    from hfdist.metrics.memory import peak_memory_bytes
    from hfdist.train.nonfinite import NonFiniteGuard
    from hfdist.train.precision import PrecisionProbe
    from hfdist.train.preemption import PreemptionWatch

    model = build_model("llama-tiny", vocab_size=1024)
    fake_cuda.current = GB
    fake_cuda.use(peak=3 * GB)  # loading the model

    def build_engine(self, max_steps, loader, resume):
        fake_cuda.use(peak=7 * GB)  # flattening a parameter group
        ds_utils.empty_cache()  # ... and the next group's reset
        return self.model, loader

    monkeypatch.setattr(ds_utils, "get_accelerator", CUDA_Accelerator)
    monkeypatch.setattr(Trainer, "_prepare_for_training", build_engine)
    monkeypatch.setattr(trainer_module, "verify_strategy", lambda *args: None)
    monkeypatch.setattr(trainer_module, "check_precision", lambda *args: None)
    trainer = trainer_module.HfdistTrainer.__new__(trainer_module.HfdistTrainer)
    trainer.model, trainer.rung, trainer.lora, trainer.compile = model, load_rung("zero2"), False, False
    trainer.fp8, trainer.attention, trainer.qlora = None, None, False  # not checked here
    trainer.mixed_precision, trainer.accelerator, trainer.precision = "bf16", None, PrecisionProbe()
    trainer.nonfinite, trainer.preemption = NonFiniteGuard(), PreemptionWatch(())
    trainer._prepare_for_training(10, None, None)
    assert fake_cuda.peak == GB  # DeepSpeed did reset the allocator's peak

    meter, cuda = MemoryMeter(), torch.device("cuda", 0)
    meter.start(model, torch.optim.AdamW(model.parameters()), cuda)
    assert meter._run["setup_peak_memory_bytes"] == 7 * GB
    fake_cuda.use(peak=2 * GB)  # the first window: its own peak, the kept one gone with hfdist's reset
    assert peak_memory_bytes(cuda) == 2 * GB


def test_records_travel_as_floats_and_come_back_as_counts():
    keys = ("tokens", "tokens_per_second", "mfu")
    (record,) = gather_records({"tokens": 640, "tokens_per_second": 12.5}, keys, torch.device("cpu"))
    assert record == {"rank": 0, "tokens": 640, "tokens_per_second": 12.5} and isinstance(record["tokens"], int)
    assert slowest_rank([{"rank": 0, "tokens_per_second": 9.0}, {"rank": 1, "tokens_per_second": 7.0}]) == 1
    assert slowest_rank([{"rank": 0}]) is None


def test_mfu_of_every_rank_is_against_the_highest_peak(monkeypatch):
    """CPU ranks measure their own matmul peak (a busy core measures less); MFU must not differ by that."""
    import hfdist.callbacks.distributed_metrics as module
    from hfdist.metrics.peaks import PeakFlops

    gathered = [{"rank": 0, "mfu": 0.5, "peak_flops": 100.0}, {"rank": 1, "mfu": 0.5, "peak_flops": 50.0}]
    monkeypatch.setattr(module, "gather_records", lambda record, keys, device, distributed: gathered)
    cb = DistributedMetricsCallback()
    cb.peak = PeakFlops(50.0, "measured CPU matmul peak (fp32)")
    assert cb._gather({"mfu": 0.5}, ("mfu",)) == [{"rank": 0, "mfu": 0.5}, {"rank": 1, "mfu": 0.25}]
    assert cb.peak == PeakFlops(100.0, "measured CPU matmul peak (fp32), the highest of the ranks'")


def test_architecture_outside_the_registry_gets_every_figure_but_flops(capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).train()
    args, state = _args("cpu"), TrainerState()
    cb = DistributedMetricsCallback()
    cb.on_train_begin(args, state, TrainerControl(), model=model, optimizer=None)
    assert "reports no TFLOP/s or MFU" in capsys.readouterr().err and cb.flops is None
    _step(cb, args, state, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.zeros(2, 8, dtype=torch.long))
    logs = _log(cb, args, state, 1.0)
    assert logs["rank0/tokens"] == 16 and "rank0/tflops_per_device" not in logs and "rank0/mfu" not in logs
    cb.on_train_end(args, state, TrainerControl())
    assert "no FLOPs count for this architecture" in cb.closing_table()


def test_warns_when_the_trainer_is_not_distributed_in_a_process_group(capsys):
    """torchrun on a CPU machine without use_cpu: each rank trains alone; say so instead of gathering."""
    model = build_model("llama-tiny", vocab_size=1024)
    with fake_world(2):
        cb = DistributedMetricsCallback(progress_bar=False)
        cb.on_train_begin(_args("cpu"), TrainerState(), TrainerControl(), model=model, optimizer=None)
    assert "a process group of 2 ranks exists, but the Trainer trains in one process" in capsys.readouterr().err


class Recorder(TrainerCallback):
    """Counts the events it gets; optionally runs `action(self)` inside on_init_end."""

    def __init__(self, action=None) -> None:
        self.calls, self.action = 0, action

    def on_init_end(self, args, state, control, **kwargs):
        self.calls += 1
        if self.action is not None:
            self.action(self)


def test_moving_ahead_and_replacing_during_an_event_calls_every_callback_once():
    def take_over(me):
        handler = find_caller(CallbackHandler)
        move_ahead_of_integrations(handler, me)
        replace_callback(handler, bar, new_bar)

    integration, mover, later = Recorder(), Recorder(take_over), Recorder()
    bar, new_bar = ProgressCallback(), MetricsProgressCallback()
    handler = CallbackHandler([DefaultFlowCallback(), integration, mover, later, bar], None, None, None, None)
    handler.on_init_end(None, TrainerState(), TrainerControl())
    assert [type(cb) for cb in handler.callbacks][:2] == [DefaultFlowCallback, Recorder]
    assert handler.callbacks[1] is mover and handler.callbacks[-1] is new_bar
    assert (integration.calls, mover.calls, later.calls) == (1, 1, 1)


def test_progress_bar_shows_global_tokens_and_largest_peak():
    cb = DistributedMetricsCallback(ranks_per_replica=2)
    bar = MetricsProgressCallback(cb)
    logs = {"loss": 2.5, "tokens_per_second/sum": 4000.0, "peak_memory_bytes/max": 3 * GB}
    assert bar.postfix(logs) == {"loss": "2.5000", "tok/s": "2,000", "mem": "3.00 GiB"}


def test_rank_table_marks_the_slowest_rank_and_lists_outputs():
    ranks = [{"rank": 0, "peak_memory_bytes": GB, "tokens_per_second": 2000.0, "tflops_per_device": 1.5,
              "mfu": 0.41},
             {"rank": 1, "peak_memory_bytes": 2 * GB, "tokens_per_second": 1500.0, "tflops_per_device": 1.1,
              "mfu": 0.3}]
    table = rank_table(ranks, title="T", notes=["MFU against X"], outputs={"model": "/out"}).splitlines()
    assert table[0] == "T" and table[1].split() == ["rank", "peak", "memory", "tokens/s", "TFLOP/s", "MFU"]
    assert table[2].split() == ["0", "1.00", "GiB", "2,000.0", "1.5", "41.0%"]
    assert table[3].endswith("<- slowest") and table[3].split()[:2] == ["1", "2.00"]
    assert table[4:] == ["MFU against X", "model: /out"]
    assert rank_table([{"rank": 0, "tokens_per_second": 1.0}, {"rank": 1}]).splitlines()[2].split() == ["1", "-"]


def test_cpu_count_includes_what_the_first_step_allocates_outside_the_model():
    """The memory meter reads the bytes held outside the model and optimizer (DDP's buckets, a pipeline's receive
    buffers) when its count of the second step starts, not when training starts: a pipeline allocates its receive
    buffers in the first step, and the planner counts them (hfdist.plan.pipeline_bytes)."""
    from hfdist.callbacks.memory import MemoryMeter

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outside = {"bytes": 0}
    meter = MemoryMeter()
    meter.start(model, optimizer, torch.device("cpu"), held_outside=lambda: outside["bytes"])

    def step():
        model(torch.randn(4, 8)).sum().backward()
        outside["bytes"] = 10**6  # a pipeline's buffers appear in its first step's forward and backward
        optimizer.step()
        optimizer.zero_grad()
        meter.step_end()  # the Trainer's on_step_end

    step()
    meter.take_window()
    step()
    step()
    figures = meter.finish()
    params = sum(p.numel() * 4 for p in model.parameters())
    assert figures["training_peak_bytes"] >= 10**6 + params
    assert figures["training_peak_bytes"] < 10**6 + 3 * params + 4096  # params, their gradients, a step's tensors


@pytest.mark.parametrize("world,reshard", [(2, True), (2, False), (1, True)])
def test_cpu_count_holds_fsdp2s_unsharded_parameters_while_they_are_allocated(world, reshard):
    """FSDP2 gives its unsharded parameters memory by resizing storages it keeps, which no op shows: the count holds
    them while they have memory (filled by the all-gather's copy-out, or on one rank by a copy). Two sharded layers:
    at the second layer's fill the rank holds its unsharded parameters (and on 2 ranks the all-gather's buffer, the
    full layer too), and the first layer's unless FSDP2 resharded it after its forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hfdist.metrics.memory import LiveTensorBytes
    from hfdist.torch_private import fsdp_unsharded_storages

    with fake_world(world):
        mesh = init_device_mesh("cpu", (world,))
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        x = torch.randn(2, 256)
        model(x)  # the first all-gather allocates the unsharded storages, before the count
        for layer in model:
            layer.reshard()
        with torch.no_grad(), LiveTensorBytes(resized=fsdp_unsharded_storages(model)) as counted:
            model(x)
    full_layer = (256 * 256 + 256) * 4
    activations = 2 * 2 * 256 * 4  # each layer's output
    layers_held = (2 if world > 1 else 1) + (0 if reshard else 1)
    assert layers_held * full_layer <= counted.peak <= layers_held * full_layer + activations


def test_state_bytes_hold_every_master_partition_while_deepspeed_steps_one_group():
    """DeepSpeed steps its torch optimizer once per parameter group, with `param_groups` cut to that group (ZeRO-1/2,
    stage_1_and_2.py `_optimizer_step`; ZeRO-3 swaps each group's params in and out): read from the step's hooks, as
    the memory meter reads them, the master bytes are still every fp32 partition the optimizer keeps state for."""
    from hfdist.metrics.memory import rank_state_bytes

    model = torch.nn.Linear(8, 8)
    masters = [p.detach().clone().requires_grad_() for p in model.parameters()]  # DeepSpeed clones its partitions
    optimizer = torch.optim.AdamW([{"params": [masters[0]]}, {"params": [masters[1]]}])
    read = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: read.append(rank_state_bytes(model, opt)))
    for master in masters:
        master.grad = torch.ones_like(master)
    groups = optimizer.param_groups
    for group in groups:
        optimizer.param_groups = [group]
        optimizer.step()
        optimizer.param_groups = groups
    last = read[-1]  # after the last group's step: every partition has its state
    assert last["master_bytes"] == sum(m.numel() * 4 for m in masters)
    assert last["param_bytes"] == sum(p.numel() * 4 for p in model.parameters())


def test_cpu_count_spans_the_second_trainer_step_when_deepspeed_steps_one_group_at_a_time():
    """DeepSpeed calls the torch optimizer's step once per parameter group: the count still opens when the Trainer's
    first step ends and holds the second step's forward and backward."""
    from hfdist.callbacks.memory import MemoryMeter

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    meter = MemoryMeter()
    meter.start(model, optimizer, torch.device("cpu"))
    x = torch.randn(1024, 64)
    for _ in range(3):
        (model(x) ** 2).sum().backward()
        groups = optimizer.param_groups
        for group in groups:  # as DeepSpeed's ZeRO-1/2 step
            optimizer.param_groups = [group]
            optimizer.step()
            optimizer.param_groups = groups
        optimizer.zero_grad()
        meter.step_end()
    figures = meter.finish()
    activations = 2 * x.numel() * 4  # the output and its square, both alive until backward
    assert figures["training_peak_bytes"] >= sum(p.numel() * 4 for p in model.parameters()) + activations
