"""hfdist's strategies in your own Ray Train loop: Ray's TorchTrainer starts the workers and their process group, and
hfdist.api builds the rung on it (the mesh, the model sharded as it is built, the strategy-aware Trainer):

    python examples/ray_train.py --config fsdp_full_shard --num-workers 2 --dataset chats.jsonl --output-dir out/ray

RAY_ADDRESS names a running cluster (without it, Ray starts one on this machine); --output-dir must be on storage
every node shares. --dataset: a local JSON/JSONL file in one of TRL's formats (messages, prompt/completion, text). The
output folder gets the model and trainer_state.json (the losses, every rank's figures per step).
"""

import argparse
import os

from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def train_loop(flags: dict) -> None:
    """One worker. Ray has set RANK / WORLD_SIZE / LOCAL_WORLD_SIZE and initialised torch.distributed (gloo on CPU,
    NCCL on GPUs); resolve_strategy fits the rung to that world and everything after adopts its process group."""
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    from hfdist.api import load_tokenizer, prepare_model, resolve_strategy, strategy_trainer

    strategy = resolve_strategy(flags["config"])
    Trainer = strategy_trainer(SFTTrainer, strategy)
    args = strategy.training_arguments(
        SFTConfig, output_dir=flags["output_dir"], global_batch_size=flags["global_batch_size"],
        max_steps=flags["max_steps"], seed=0, data_seed=0, learning_rate=1e-3, lr_scheduler_type="constant",
        logging_steps=1, max_length=128, report_to="none", save_strategy="no", dataloader_drop_last=True)
    tokenizer = load_tokenizer(flags["model"])
    model = prepare_model(strategy, flags["model"], tokenizer=tokenizer, seed=0)
    trainer = Trainer(model=model, args=args, processing_class=tokenizer,
                      train_dataset=load_dataset("json", data_files=flags["dataset"], split="train"))
    trainer.train()
    trainer.save_model()
    trainer.save_state()


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--config", default="fsdp_full_shard", help="a rung (fsdp_tp, pp, 3d, zero3, ...) or a YAML")
    cli.add_argument("--num-workers", type=int, default=2, help="Ray workers: the world's processes (default 2)")
    cli.add_argument("--gpus", action="store_true", help="a GPU per worker (default: CPU workers)")
    cli.add_argument("--model", default="llama-tiny", help="a preset, a local checkpoint folder or a hub id")
    cli.add_argument("--dataset", required=True, help="a local JSON/JSONL file")
    cli.add_argument("--max-steps", type=int, default=10)
    cli.add_argument("--global-batch-size", type=int, default=8, help="rows per step over all workers (default 8)")
    cli.add_argument("--output-dir", required=True)
    flags = cli.parse_args()
    flags.output_dir, flags.dataset = os.path.abspath(flags.output_dir), os.path.abspath(flags.dataset)
    TorchTrainer(train_loop, train_loop_config=vars(flags),
                 scaling_config=ScalingConfig(num_workers=flags.num_workers, use_gpu=flags.gpus),
                 run_config=RunConfig(storage_path=os.path.join(flags.output_dir, "ray"))).fit()


if __name__ == "__main__":
    main()
