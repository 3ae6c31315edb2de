"""The private transformers.Trainer API hfdist builds on is still there, with the parameters hfdist relies on.

hfdist's trainer classes and mixins (HfdistTrainer, PipelineMixin, ContextParallelMixin, hfdist.api's) override and
call private Trainer methods (hfdist/train/trainer.py's PRIVATE_OVERRIDES / PRIVATE_CALLS). A transformers release that
renames or reshapes one would otherwise fail deep inside a multi-process run; this fails here, naming the method.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import transformers
from transformers import Trainer, TrainingArguments

from hfdist.api.trainer import StrategyAwareMixin, WholeOutputsMixin
from hfdist.train.context_trainer import ContextParallelMixin
from hfdist.train.pipeline_trainer import PipelineMixin
from hfdist.train.trainer import PRIVATE_CALLS, PRIVATE_OVERRIDES, HfdistTrainer

TRAINERS = (HfdistTrainer, PipelineMixin, ContextParallelMixin, StrategyAwareMixin, WholeOutputsMixin)

REPO = Path(__file__).resolve().parents[2]


def test_overridden_private_methods_exist_with_the_same_parameters():
    for name, params in PRIVATE_OVERRIDES.items():
        assert hasattr(Trainer, name), f"transformers {transformers.__version__} has no Trainer.{name}"
        theirs = [p for p in inspect.signature(getattr(Trainer, name)).parameters if p != "self"]
        assert tuple(theirs[:len(params)]) == params, f"Trainer.{name}{tuple(theirs)} vs hfdist's {params}"
        for cls in (c for c in TRAINERS if hasattr(c, name)):
            mine = [p for p in inspect.signature(getattr(cls, name)).parameters if p != "self"]
            assert tuple(mine[:len(params)]) == params, f"{cls.__name__}.{name} drifted from the contract"


def test_called_private_methods_exist():
    missing = [name for name in PRIVATE_CALLS if not hasattr(Trainer, name)]
    assert not missing, f"transformers {transformers.__version__} lacks {missing}"


def test_every_private_override_is_declared():
    """No private Trainer method is overridden without being in the contract (and so in this test)."""
    overridden = {name for cls in TRAINERS for c in cls.__mro__ if c.__module__.startswith("hfdist") for name in vars(c)
                  if name.startswith("_") and not name.startswith("__") and hasattr(Trainer, name)}
    assert overridden == set(PRIVATE_OVERRIDES), overridden ^ set(PRIVATE_OVERRIDES)


def test_transformers_is_bounded_above_in_the_requirements():
    """hfdist/requirements/base.txt (pyproject's dependencies) bounds transformers to the release whose private
    methods the checks above hold for."""
    spec = next(line for line in (REPO / "hfdist" / "requirements" / "base.txt").read_text().splitlines()
                if line.startswith("transformers"))
    upper = re.search(r"<\s*([\d.]+)", spec)
    assert upper, f"transformers has no upper bound in hfdist/requirements/base.txt: {spec.strip()}"
    installed = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    assert installed < tuple(int(x) for x in upper.group(1).split(".")[:2])



def test_mesh_models_are_never_moved_by_the_trainer(tmp_path):
    """Trainer.__init__ calls `.to(device)` on the model unless its arguments' `place_model_on_device` says no: a
    model hfdist sharded itself (FSDP2, possibly CPU-offloaded on GPU) gets arguments that say no; a DDP model is
    placed by the Trainer as usual."""
    import torch

    from hfdist.api import Strategy
    from hfdist.config.finetune import FinetuneConfig
    from hfdist.config.ladder import load_rung
    from hfdist.job.run import _training_arguments

    cfg = FinetuneConfig(output_dir=str(tmp_path), save_steps=1)
    for name, owns in (("fsdp_full_shard", True), ("ddp", False)):
        rung = load_rung(name)
        args = _training_arguments(cfg, Strategy(rung, "no"))
        assert isinstance(args, TrainingArguments) and args.place_model_on_device is (False if owns else None)
        trainer = HfdistTrainer(model=torch.nn.Linear(2, 2), args=args, rung=rung)
        assert trainer.place_model_on_device is not owns, name
        assert trainer.is_distributed_loading_by_transformers is owns, name


def test_batches_are_collated_by_workers_on_gpu_only(tmp_path):
    """On GPU two pinned, persistent DataLoader workers collate the next batches while the device computes; on CPU
    the ranks keep the cores (no workers), as the job's arguments show."""
    from hfdist.api import Strategy
    from hfdist.config.finetune import FinetuneConfig
    from hfdist.config.ladder import load_rung
    from hfdist.job.run import _training_arguments, dataloader_settings

    assert dataloader_settings(True) == {"dataloader_num_workers": 2, "dataloader_persistent_workers": True,
                                         "dataloader_pin_memory": True}
    args = _training_arguments(FinetuneConfig(output_dir=str(tmp_path)), Strategy(load_rung("ddp"), "no"))
    assert (args.dataloader_num_workers, args.dataloader_persistent_workers, args.dataloader_pin_memory) == \
        (0, False, False)


def test_fsdp_cpu_offload_on_gpu_gets_gloo_beside_nccl():
    """An FSDP YAML with fsdp_offload_params on a GPU machine: the process group carries a CPU backend for the
    offloaded gradients (clipping, gathers); without offload, or on CPU, accelerate's default stands."""
    from dataclasses import replace

    from hfdist.api.strategy import process_group_backend
    from hfdist.config.ladder import load_rung

    rung = load_rung("fsdp_full_shard")
    offloaded = replace(rung, fsdp=replace(rung.fsdp, offload_params=True))
    backend = {(r.fsdp.offload_params, gpu): process_group_backend(r, on_gpu=gpu)
               for r in (rung, offloaded) for gpu in (False, True)}
    assert backend == {(False, False): None, (False, True): None, (True, False): None,
                       (True, True): "cuda:nccl,cpu:gloo"}
