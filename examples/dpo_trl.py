"""TRL's DPOTrainer on any hfdist strategy, the reference model sharded like the policy:

    torchrun --nproc-per-node 4 examples/dpo_trl.py --config fsdp_tp --dataset pairs.jsonl --output-dir out/tp
    python examples/dpo_trl.py --config single --dataset pairs.jsonl --output-dir out/single

--dataset: a local JSON/JSONL file with prompt, chosen and rejected columns. The output folder gets the model, and
trainer_state.json: the losses, TRL's rewards and accuracies, and every rank's memory, throughput and MFU per step.
Pipeline rungs (pp, 3d) are refused: DPO's loss compares whole sequences of two models, not the last stage's tokens.
"""

import argparse

from datasets import load_dataset
from trl import DPOConfig, DPOTrainer

from hfdist.api import load_tokenizer, prepare_model, resolve_strategy, strategy_trainer
from hfdist.errors import run_with_clear_errors


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--config", default="single", help="a rung (fsdp_full_shard, fsdp_tp, ...), a YAML, or single")
    cli.add_argument("--model", default="llama-tiny", help="a preset, a local checkpoint folder or a hub id")
    cli.add_argument("--dataset", required=True, help="a local JSON/JSONL file: prompt, chosen, rejected")
    cli.add_argument("--max-steps", type=int, default=10)
    cli.add_argument("--seed", type=int, default=0)
    cli.add_argument("--output-dir", required=True)
    cli.add_argument("--global-batch-size", type=int, default=8, help="pairs per step over all ranks (default 8)")
    flags = cli.parse_args()

    strategy = resolve_strategy(flags.config)
    Trainer = strategy_trainer(DPOTrainer, strategy)  # refuses, before any model is built, what cannot train
    args = strategy.training_arguments(
        DPOConfig, output_dir=flags.output_dir, global_batch_size=flags.global_batch_size, max_steps=flags.max_steps,
        seed=flags.seed, data_seed=flags.seed, learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1,
        max_length=128, report_to="none", save_strategy="no", dataloader_drop_last=True)
    tokenizer = load_tokenizer(flags.model)
    policy = prepare_model(strategy, flags.model, tokenizer=tokenizer, seed=flags.seed)
    reference = prepare_model(strategy, flags.model, tokenizer=tokenizer, seed=flags.seed, trainable=False)
    trainer = Trainer(
        model=policy, ref_model=reference, args=args, processing_class=tokenizer,
        train_dataset=load_dataset("json", data_files=flags.dataset, split="train"))
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    return 0


if __name__ == "__main__":
    raise SystemExit(run_with_clear_errors(main))
