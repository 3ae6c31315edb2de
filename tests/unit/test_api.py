"""hfdist.api in one process: strategies resolved against the launched world, the training arguments a strategy
owns, the trainer classes strategy_trainer composes, and the refusals before step 1 (each one paragraph naming the
fix). Models are prepared for simulated ranks under a fake process group; the numbers of real runs are
tests/e2e/test_examples.py's."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer

from hfdist.api import Strategy, StrategyRefused, prepare_model, resolve_strategy, strategy_trainer
from hfdist.api.trainer import StrategyAwareMixin, WholeOutputsMixin
from hfdist.checkpoint.trainer_hooks import CheckpointingMixin
from hfdist.config.ladder import CONFIG_ROOT, load_rung
from hfdist.train.context_trainer import ContextParallelMixin
from hfdist.train.pipeline_trainer import PipelineMixin
from hfdist.train.preemption import PreemptionMixin
from hfdist.train.trainer import CausalLMLossMixin, StrategyMixin

from helpers import fake_world


@pytest.fixture
def world(monkeypatch):
    """Pretend a launcher started `n` processes (what resolve_strategy reads)."""
    def launched(n: int) -> None:
        monkeypatch.setenv("WORLD_SIZE", str(n))
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return launched


def _dims(strategy: Strategy) -> tuple[int, ...]:
    d = strategy.dims
    return d.dp_replicate, d.dp_shard, d.cp, d.pp, d.tp


def test_a_strategy_is_a_rung_name_a_yaml_or_degrees_fitted_to_the_world(world):
    world(4)
    assert _dims(resolve_strategy("fsdp_tp")) == (1, 2, 1, 1, 2)
    assert _dims(resolve_strategy("pp")) == (1, 2, 1, 2, 1)  # the YAML's 2 stages, the data-parallel axis absorbs 4
    assert _dims(resolve_strategy(str(CONFIG_ROOT / "accelerate_configs" / "fsdp_cp.yaml"))) == (1, 2, 2, 1, 1)
    assert _dims(resolve_strategy("fsdp_tp", tp=4)) == (1, 1, 1, 1, 4)
    by_degrees = resolve_strategy(tp=2, pp=2)
    assert by_degrees.name == "3d" and _dims(by_degrees) == (1, 1, 1, 2, 2) and by_degrees.rung.pipeline is not None
    assert resolve_strategy(cp=2).name == "fsdp_cp" and resolve_strategy(dp_replicate=2).rung.fsdp.hybrid
    assert resolve_strategy("pp", pp_microbatches=8).rung.pipeline.n_microbatches == 8
    world(1)
    assert resolve_strategy().name == resolve_strategy("single").name == "single"
    assert resolve_strategy("single", mixed_precision="bf16").mixed_precision == "bf16"


@pytest.mark.parametrize("n, call, words", [
    (4, lambda: resolve_strategy("single"), "runs one process"),
    (4, lambda: resolve_strategy(tp=3), "processes"),
    (4, lambda: resolve_strategy("fsdp_tp", dp_shard=2), "config=None"),
    (4, lambda: resolve_strategy("ddp", cp=2), "replicates the whole model"),
    (5, lambda: resolve_strategy("fsdp_tp"), "must divide the processes"),
    (4, lambda: resolve_strategy("no_such_rung"), "Known rungs"),
])
def test_a_strategy_that_does_not_fit_is_refused_naming_the_fix(world, n, call, words):
    world(n)
    with pytest.raises(StrategyRefused, match=words):
        call()


def test_training_arguments_carry_what_the_strategy_owns(tmp_path):
    from trl import SFTConfig

    mesh = Strategy(load_rung("fsdp_tp"), "no")  # 4 processes: dp_shard 2 x tp 2
    args = mesh.training_arguments(SFTConfig, output_dir=str(tmp_path), global_batch_size=8, max_steps=1)
    assert isinstance(args, SFTConfig) and args.max_steps == 1
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 1)
    assert args.place_model_on_device is False  # the Trainer never moves what hfdist placed
    assert not args.gradient_checkpointing and not args.bf16  # TRL's defaults are on; hfdist's own rule here
    ddp = Strategy(load_rung("ddp"), "no").training_arguments(output_dir=str(tmp_path), global_batch_size=8,
                                                               micro_batch_size=2)
    assert (ddp.per_device_train_batch_size, ddp.gradient_accumulation_steps, ddp.place_model_on_device) == (2, 2, None)
    with pytest.raises(StrategyRefused, match="resolve_strategy\\(mixed_precision"):
        mesh.training_arguments(output_dir=str(tmp_path), global_batch_size=8, bf16=True)
    with pytest.raises(ValueError, match="not divisible by the 2 data-parallel ranks"):
        mesh.training_arguments(output_dir=str(tmp_path), global_batch_size=7)


def _mixins(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if c.__module__.startswith("hfdist")]


def test_strategy_trainer_puts_the_mixins_the_strategy_needs_before_the_trainer():
    from trl import SFTTrainer

    rungs = {name: Strategy(load_rung(name), "no") for name in ("single", "fsdp_tp", "fsdp_cp", "pp")}
    plain = {name: _mixins(strategy_trainer(Trainer, s)) for name, s in rungs.items()}
    assert plain["single"] == plain["fsdp_tp"][:] and CausalLMLossMixin in plain["fsdp_tp"]  # hfdist's own loss
    assert plain["fsdp_cp"][0] is ContextParallelMixin and plain["pp"][0] is PipelineMixin
    sft = {name: _mixins(strategy_trainer(SFTTrainer, s)) for name, s in rungs.items()}
    assert all(CausalLMLossMixin not in m for m in sft.values())  # TRL's compute_loss stays
    assert sft["fsdp_tp"][0] is sft["fsdp_cp"][0] is WholeOutputsMixin and WholeOutputsMixin not in sft["single"]
    assert sft["pp"][:2] == [PipelineMixin, StrategyAwareMixin] and sft["pp"][-3] is StrategyMixin
    assert sft["pp"][-2:] == [PreemptionMixin, CheckpointingMixin]  # under StrategyMixin: its checkpoints, preemption
    made = strategy_trainer(SFTTrainer, rungs["fsdp_tp"])
    assert issubclass(made, SFTTrainer) and made.__name__ == "SFTTrainerOnFsdpTp"


def test_a_loss_pipeline_stages_cannot_compute_is_refused_before_anything_is_built():
    from trl import DPOTrainer

    class MyLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).logits.sum()

    for cls in (DPOTrainer, MyLoss):
        with pytest.raises(StrategyRefused, match="pipeline stages compute one loss only.*fsdp_tp"):
            strategy_trainer(cls, Strategy(load_rung("3d"), "no"))
    with pytest.raises(StrategyRefused, match="transformers.Trainer class"):
        strategy_trainer(torch.nn.Linear, Strategy(load_rung("single"), "no"))


def test_a_tp_degree_the_heads_do_not_split_is_refused_before_anything_is_built():
    from hfdist.parallel.tensor_check import TPError

    strategy = Strategy(load_rung("fsdp_tp").with_num_processes(4, tp=4), "no")  # llama-tiny: 2 kv heads
    with pytest.raises(TPError, match="num_key_value_heads=2.*would work: \\[1, 2\\]"):
        prepare_model(strategy, "llama-tiny")


def test_a_model_prepare_model_did_not_make_is_refused(tmp_path):
    strategy = Strategy(load_rung("single"), "no")
    args = strategy.training_arguments(output_dir=str(tmp_path), global_batch_size=2, report_to="none")
    with pytest.raises(StrategyRefused, match="prepare_model\\(strategy"):
        strategy_trainer(Trainer, strategy)(model=torch.nn.Linear(2, 2), args=args)


@pytest.fixture
def simulated_rank(monkeypatch):
    """Rank 0 of 2 under a fake process group, as a launcher would describe it to accelerate; accelerate's
    process-wide state is reset around it, so no other test sees this world."""
    from accelerate.state import AcceleratorState, PartialState

    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(key, value)
    AcceleratorState._reset_state(True)
    with fake_world(2):
        yield
    AcceleratorState._reset_state(True)
    PartialState._reset_state()


def test_a_trainer_that_moves_the_model_is_refused_naming_the_fix(tmp_path, simulated_rank):
    class Moving(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.model.to(torch.float64)

    strategy = resolve_strategy("fsdp_full_shard")
    args = strategy.training_arguments(output_dir=str(tmp_path), global_batch_size=8, report_to="none")
    model = prepare_model(strategy, "llama-tiny")
    assert model.hfdist_prepared.strategy is strategy and not model.hfdist_prepared.lora
    trainer = strategy_trainer(Trainer, strategy)(model=model, args=args)  # a Trainer that leaves it: accepted
    assert trainer.rung is strategy.rung and any(type(c).__name__ == "DistributedMetricsCallback"
                                                 for c in trainer.callback_handler.callbacks)
    with pytest.raises(StrategyRefused, match="moved or changed after hfdist placed it.*torch.float64"):
        strategy_trainer(Moving, strategy)(model=model, args=args)


def test_a_frozen_reference_copy_cannot_be_trained(tmp_path):
    strategy = Strategy(load_rung("single"), "no")
    args = strategy.training_arguments(output_dir=str(tmp_path), global_batch_size=2, report_to="none")
    reference = prepare_model(strategy, "llama-tiny", trainable=False, lora=None)
    assert not any(p.requires_grad for p in reference.parameters())
    with pytest.raises(StrategyRefused, match="trainable=False"):
        strategy_trainer(Trainer, strategy)(model=reference, args=args)


def test_dpo_under_lora_gets_its_reference_adapter_sharded_with_the_model(tmp_path):
    """TRL's DPOTrainer without a ref_model adds a "ref" copy of the trained adapter: prepare_model makes it (frozen,
    placed like the rest) when asked, and a trainer that adds an adapter hfdist did not make is refused."""
    class AddsReference(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.model.add_adapter("ref", self.model.peft_config["default"])

    strategy = Strategy(load_rung("single"), "no")
    args = strategy.training_arguments(output_dir=str(tmp_path), global_batch_size=2, report_to="none")
    with pytest.raises(StrategyRefused, match="reference_adapter=True"):
        strategy_trainer(AddsReference, strategy)(model=prepare_model(strategy, "llama-tiny", lora=4), args=args)
    model = prepare_model(strategy, "llama-tiny", lora=4, reference_adapter=True)
    assert set(model.peft_config) == {"default", "ref"}
    assert {n for n, p in model.named_parameters() if p.requires_grad} == \
        {n for n, _ in model.named_parameters() if ".lora_" in n and ".default." in n}
    strategy_trainer(AddsReference, strategy)(model=model, args=args)  # the adapter it adds is the one prepared
