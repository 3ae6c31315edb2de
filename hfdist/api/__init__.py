"""hfdist's strategies in your own training script: FSDP2, TP, PP, CP and 3D (and DDP, ZeRO) under any
transformers.Trainer, TRL's SFTTrainer and DPOTrainer included. `hfdist finetune` runs on the same calls.

    from hfdist.api import prepare_model, resolve_strategy, strategy_trainer

    strategy = resolve_strategy("fsdp_tp")            # a rung name, an accelerate YAML, "single", or degrees
    args = strategy.training_arguments(SFTConfig, output_dir="out", global_batch_size=8, max_steps=100)
    model = prepare_model(strategy, "meta-llama/Llama-3.2-1B", tokenizer=tokenizer)   # sharded as it is built
    trainer = strategy_trainer(SFTTrainer, strategy)(model=model, args=args, train_dataset=data,
                                                      processing_class=tokenizer)
    trainer.train()                                    # the strategy verified before step 1
    trainer.save_model()                               # a HF checkpoint (or LoRA adapter), fp32

Modules:
    strategy.py  Strategy, resolve_strategy: a rung fitted to the launched world; its training arguments
    model.py     prepare_model: build on meta, LoRA, the parallelize recipe, sharded load; load_tokenizer
    trainer.py   strategy_trainer: any Trainer subclass with hfdist's mixins for the strategy
docs/library.md documents every public name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Strategy", "StrategyRefused", "StrategyNotInEffect", "PreparedModel", "resolve_strategy",
           "prepare_model", "load_tokenizer", "strategy_trainer"]

# Imported on first use: `from hfdist.api import resolve_strategy` does not pay for transformers.
_EXPORTS = {"Strategy": "strategy", "StrategyRefused": "strategy", "resolve_strategy": "strategy",
            "PreparedModel": "model", "prepare_model": "model", "load_tokenizer": "model",
            "strategy_trainer": "trainer"}

if TYPE_CHECKING:
    from hfdist.api.model import PreparedModel, load_tokenizer, prepare_model
    from hfdist.api.strategy import Strategy, StrategyRefused, resolve_strategy
    from hfdist.api.trainer import strategy_trainer
    from hfdist.parallel.verify import StrategyNotInEffect


def __getattr__(name: str) -> Any:
    import importlib

    if name == "StrategyNotInEffect":
        return importlib.import_module("hfdist.parallel.verify").StrategyNotInEffect
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hfdist.api' has no attribute '{name}'")
    return getattr(importlib.import_module(f"hfdist.api.{_EXPORTS[name]}"), name)
