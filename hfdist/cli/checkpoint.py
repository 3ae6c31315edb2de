"""`hfdist checkpoint export DIR --to hf OUT`: a training checkpoint of any rung as a HF model or LoRA adapter."""

from __future__ import annotations

import argparse

__all__ = ["VERB"]


def add_args(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", required=True, metavar="<action>")
    export = actions.add_parser("export", help="write a checkpoint as a Hugging Face model or LoRA adapter",
                                description=_EXPORT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    export.add_argument("checkpoint", metavar="DIR",
                        help="a checkpoint-N folder, or a run's --output-dir (its latest complete checkpoint)")
    export.add_argument("--to", required=True, choices=["hf"], help="the output format (hf: save_pretrained's)")
    export.add_argument("out", metavar="OUT", help="the folder to write (new or empty)")
    export.add_argument("--merge", action="store_true",
                        help="a LoRA / QLoRA run: write one bf16 model, the adapter merged into its base (QLoRA: the "
                             "4-bit base dequantised, as trained), instead of the adapter")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hfdist.checkpoint.convert import export_checkpoint

    out = Path(args.out)
    checkpoint = export_checkpoint(Path(args.checkpoint), out, merge=args.merge)
    what = "the adapter merged into its base, bf16" if args.merge else "fp32 master weights"
    print(f"hfdist: exported {checkpoint} -> {out} ({what}, one tensor at a time)")
    return 0


_EXPORT_HELP = """\
Write a training checkpoint (any rung: DDP, FSDP2, TP, PP, 3D as DCP shards, or DeepSpeed ZeRO partitions; full
fine-tune or LoRA) as a Hugging Face model (model.safetensors + config.json, loadable by from_pretrained) or, for a
LoRA run, as a peft adapter (adapter_model.safetensors + adapter_config.json), plus the tokenizer. One tensor is in
memory at a time. The model's structure comes from the checkpoint's hfdist_checkpoint.json. --merge writes a
LoRA or QLoRA run as one bf16 model instead: its adapter merged into the base it trained against (QLoRA: the
4-bit base dequantised), the base read again from the run's --model.

    hfdist checkpoint export outputs/run/checkpoint-200 --to hf exported/
    hfdist checkpoint export outputs/qlora-run --to hf merged/ --merge
"""

VERB = ("checkpoint", "export a training checkpoint as a Hugging Face model or adapter", _EXPORT_HELP, add_args, run)
