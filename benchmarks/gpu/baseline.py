"""The GPU suite's baselines: the same fine-tune written as a user writes it with a plain transformers Trainer, or
with TRL's SFTTrainer, each with hfdist's metrics callback (the same tokens/s, MFU and peak memory readers as
hfdist's runs), no hfdist strategy.

    python benchmarks/gpu/baseline.py --trainer plain --model DIR --data FILE.jsonl --output-dir DIR \\
        --figures OUT.json --seq-len 2048 --steps 12 --batch 1 --grad-accum 4 --bf16

The plain Trainer trains on the text cut into --seq-len blocks (the run_clm recipe, benchmarks/plain_trainer.py);
TRL packs the same text to --seq-len itself. Both in bf16 as the Trainer runs it (autocast over fp32 weights), the
learning-rate schedule and clipping hfdist uses, no checkpoints. OUT.json holds every rank's figures
(DistributedMetricsCallback.ranks) and the losses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the plain Trainer's data recipe

from hfdist.callbacks import DistributedMetricsCallback  # noqa: E402

from plain_trainer import blocks  # noqa: E402


def _common(args: argparse.Namespace) -> dict:
    """TrainingArguments (or SFTConfig) fields both baselines share, as hfdist's job sets them."""
    return dict(output_dir=args.output_dir, per_device_train_batch_size=args.batch,
                gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=args.learning_rate,
                lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1,
                save_strategy="no", report_to="none", bf16=args.bf16, dataloader_drop_last=True,
                use_cpu=not torch.cuda.is_available())


def _trainer(args: argparse.Namespace, metrics: DistributedMetricsCallback):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.trainer == "plain":
        from transformers import Trainer, TrainingArguments, default_data_collator

        model = AutoModelForCausalLM.from_pretrained(args.model)
        model.config.use_cache = False
        return Trainer(model=model, args=TrainingArguments(**_common(args)),
                       train_dataset=blocks(args.data, tokenizer, args.seq_len),
                       data_collator=default_data_collator, callbacks=[metrics])
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    return SFTTrainer(model=args.model, processing_class=tokenizer,
                      train_dataset=load_dataset("json", data_files=args.data, split="train"),
                      args=SFTConfig(**_common(args), packing=True, max_length=args.seq_len,
                                     model_init_kwargs={"dtype": "float32"}),
                      callbacks=[metrics])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", choices=["plain", "trl"], required=True)
    p.add_argument("--model", required=True, help="HF model folder (with its tokenizer)")
    p.add_argument("--data", required=True, help="JSON Lines with a text field")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--figures", type=Path, required=True, help="where rank 0 writes the figures (JSON)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=1, help="sequences per device per forward")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--bf16", action="store_true")
    args = p.parse_args()
    metrics = DistributedMetricsCallback(progress_bar=False, print_table=False)
    trainer = _trainer(args, metrics)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        args.figures.write_text(json.dumps({"ranks": metrics.ranks, "losses": losses}, indent=2))


if __name__ == "__main__":
    main()
