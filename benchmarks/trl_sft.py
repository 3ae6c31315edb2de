"""A chat fine-tune with TRL's SFTTrainer, written as a user writes one: the TRL side of benchmarks/bench_peers.py.

    python benchmarks/trl_sft.py --model DIR --data train.jsonl --output-dir OUT --packing bfd
    accelerate launch --config_file fsdp2.yaml benchmarks/trl_sft.py ...     (2 processes)

--packing bfd: SFTConfig(packing=True), TRL's default packing (best-fit decreasing, padding-free: a batch's
sequences flattened into one, documents told apart by position ids); wrapped: packing_strategy="wrapped" (the text
concatenated and cut into --seq-len blocks, documents attending to each other); none: packing=False (each
conversation padded to the batch's longest, truncated at --seq-len). The loss is on the assistant turns only
(assistant_only_loss, as hfdist trains chat data), with the chat template hfdist gives a tokenizer without one,
marked with {% generation %} as TRL needs. The model is saved to OUT when training ends; OUT/trl_run.json says what
the Trainer really ran (its model's wrapper, accelerate's distributed type).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# hfdist.data.chat.DEFAULT_CHAT_TEMPLATE with each assistant answer (and its EOS) marked for assistant_only_loss.
TEMPLATE = (
    "{%- if bos_token %}{{ bos_token }}{% endif %}"
    "{%- for message in messages %}"
    "{{- '### ' ~ (message['role'] | capitalize) ~ ':\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}{% if eos_token %}{{ eos_token }}{% endif %}{% endgeneration %}"
    "{%- else %}{{ message['content'] }}{% endif %}"
    "{{- '\\n\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '### Assistant:\\n' }}{% endif %}"
)
PACKING = {"bfd": {"packing": True}, "wrapped": {"packing": True, "packing_strategy": "wrapped"},
           "none": {"packing": False}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="JSON Lines with a messages column")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--packing", choices=list(PACKING), default="bfd")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--per-device-batch-size", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.chat_template = TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(args.model)
    config = SFTConfig(
        output_dir=args.output_dir, max_length=args.seq_len, per_device_train_batch_size=args.per_device_batch_size,
        max_steps=args.max_steps, learning_rate=args.learning_rate, lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps, weight_decay=0.0, max_grad_norm=1.0, seed=args.seed, data_seed=args.seed,
        logging_steps=1, save_strategy="no", report_to="none", dataloader_drop_last=True,
        use_cpu=not torch.cuda.is_available(), assistant_only_loss=True, **PACKING[args.packing])
    trainer = SFTTrainer(model=model, args=config, processing_class=tokenizer,
                         train_dataset=load_dataset("json", data_files=args.data, split="train"))
    trainer.train()
    trainer.save_model(args.output_dir)
    if trainer.is_world_process_zero():
        ran = {"model_wrapper": type(trainer.model_wrapped).__name__,
               "distributed_type": str(trainer.accelerator.distributed_type),
               "num_processes": trainer.accelerator.num_processes,
               "padding_free": trainer.padding_free, "attn_implementation": model.config._attn_implementation,
               "world_size_env": int(os.environ.get("WORLD_SIZE", "1"))}
        (Path(args.output_dir) / "trl_run.json").write_text(json.dumps(ran, indent=2))


if __name__ == "__main__":
    main()
