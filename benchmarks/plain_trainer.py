"""A plain causal-LM fine-tune, written as a user writes one with transformers, accelerate and datasets only (no
hfdist): the baseline of benchmarks/bench_overhead.py.

    accelerate launch --config_file CONFIG.yaml benchmarks/plain_trainer.py --model DIR --data FILE.jsonl
    accelerate launch --config_file ZERO2.yaml benchmarks/plain_trainer.py ... --deepspeed ds_config.json

The text column of a JSON Lines file is tokenized, concatenated and cut into --seq-len blocks (the run_clm
recipe), and the Trainer trains on them with the learning-rate schedule and clipping hfdist uses, then saves the
model to --output-dir.
"""

from __future__ import annotations

import argparse
from itertools import chain

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, default_data_collator


def blocks(data_file: str, tokenizer, seq_len: int):
    """Every text tokenized (EOS after each), concatenated and cut into seq_len-token blocks, labels = inputs."""
    raw = load_dataset("json", data_files=data_file, split="train")

    def tokenize(batch):
        return {"input_ids": [ids + [tokenizer.eos_token_id]
                              for ids in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]]}

    def group(batch):
        ids = list(chain.from_iterable(batch["input_ids"]))
        cut = len(ids) // seq_len * seq_len
        rows = [ids[i:i + seq_len] for i in range(0, cut, seq_len)]
        return {"input_ids": rows, "labels": [list(r) for r in rows]}

    tokenized = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
    return tokenized.map(group, batched=True, batch_size=1000)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--per-device-batch-size", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=120)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--deepspeed", default=None)
    p.add_argument("--seed", type=int, default=42, help="seed of the data order (default 42, the Trainer's)")
    args = p.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    model.config.use_cache = False
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.per_device_batch_size, max_steps=args.max_steps,
        learning_rate=args.learning_rate, lr_scheduler_type="cosine", warmup_steps=args.warmup_steps,
        weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none",
        dataloader_drop_last=True, ddp_find_unused_parameters=False, deepspeed=args.deepspeed,
        use_cpu=not torch.cuda.is_available(), seed=args.seed, data_seed=args.seed)
    trainer = Trainer(model=model, args=training, train_dataset=blocks(args.data, tokenizer, args.seq_len),
                      data_collator=default_data_collator)
    trainer.train()
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
