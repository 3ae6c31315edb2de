"""`hfdist plan`: per-rank memory of every rung of the ladder each rung's best layout and the fastest predicted one that fits."""

from __future__ import annotations

import argparse
import json
import sys

from hfdist.errors import HfdistError

__all__ = ["VERB"]

_PLAN_HELP = """\
Consider every layout of every rung of the config ladder on the cluster (tp / pp / cp degrees, micro-batch,
recompute), predict each one's per-rank GPU memory (weights, grads, fp32 master, optimizer state, activations,
buffers) and step time, show each rung's best layout and recommend the fastest predicted that fits, with its launch
command. Reads the model config only: no weights are loaded. `hfdist tune` measures the candidates instead.

Accounting: --bytes-per-param-adam 16 (default) = 2 bf16 weight + 2 bf16 grad + 4 fp32 master + 8 Adam moments,
what FSDP2 and DDP hold in total; 20 = DeepSpeed's own accounting (adds a 4-byte fp32 grad copy). --dtype fp32:
4 weight + 4 grad + 8 Adam, no master (DeepSpeed keeps one anyway). Exit code 1 when nothing fits.
"""


def add_args(p: argparse.ArgumentParser) -> None:
    from hfdist.config.arg_types import non_negative_int
    from hfdist.config.finetune import CP_METHODS, FP8_RECIPES, OBJECTIVES, FinetuneConfig
    from hfdist.plan import ADAM_BYTES_CHOICES, DTYPES, Workload

    d = Workload()
    p.add_argument("--model", required=True, help="preset name (llama-3.1-8b, ...), local checkpoint folder, or HF id")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory of one GPU in GB = 1e9 bytes (default 80)")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters on a frozen base instead of all weights")
    p.add_argument("--qlora", action="store_true",
                   help="QLoRA: LoRA adapters on a frozen 4-bit NF4 base (the rungs that take --qlora)")
    p.add_argument("--lora-r", type=int, default=d.lora_r, help=f"LoRA rank (default {d.lora_r})")
    p.add_argument("--seq", type=int, default=d.seq, help=f"sequence length (default {d.seq})")
    p.add_argument("--global-batch-size", type=int, default=None, metavar="N",
                   help="sequences per optimizer step over all ranks, the same for every layout (default: one "
                        "micro-batch per GPU); each layout's micro-batch and accumulation make it up")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="pin the sequences per forward (a pipeline stage's micro-batch; default: every one that "
                        "divides a rank's share of the global batch is considered)")
    p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="pin recomputing each decoder layer in backward on (keeps only layer inputs) or off "
                        "(--no-activation-checkpointing; default: both are considered)")
    for axis, what in (("tp", "tensor-parallel degree"), ("pp", "pipeline stages"), ("cp", "context-parallel degree")):
        p.add_argument(f"--{axis}", type=int, default=None,
                       help=f"pin the {what} (default: every degree the model and the cluster allow is considered; "
                            f"rungs without the axis are left out)")
    p.add_argument("--cp-method", choices=CP_METHODS, default=None,
                   help="pin how the cp ranks split attention, as `hfdist finetune --cp-method` (default: every method "
                        "that can split the model at each cp degree is considered: ulysses, ring, hybrid)")
    p.add_argument("--loss-chunk-size", type=non_negative_int, default=d.loss_chunk_size, metavar="N",
                   help=f"sequence positions per chunk of the chunked loss, as `hfdist finetune --loss-chunk-size` "
                        f"(default {d.loss_chunk_size}): one chunk's logits are counted; 0: the whole sequence's")
    p.add_argument("--attn-implementation", default=d.attention, metavar="NAME",
                   help=f"attention as `hfdist finetune --attn-implementation` (default {d.attention}: a "
                        "document-isolating kernel, nothing S x S); sdpa / eager add their dense S x S mask and its "
                        "per-layer copies")
    p.add_argument("--objective", choices=OBJECTIVES, default="sft",
                   help="what trains, as `hfdist finetune --objective`: sft (default); dpo counts the frozen reference "
                        "model, sharded like the policy (none with --lora: the base with its adapters off), and "
                        "--micro-batch counts sequences, 2 per pair; grpo counts the rollout's KV cache (a rank's "
                        "share of --global-batch-size completions of --seq tokens each) and the completion logits. "
                        "Rungs that refuse the objective are left out")
    p.add_argument("--num-generations", type=int, default=FinetuneConfig.num_generations, metavar="G",
                   help=f"GRPO: completions per prompt (default {FinetuneConfig.num_generations})")
    p.add_argument("--max-completion-length", type=int, default=256, metavar="L",
                   help="GRPO: tokens of each completion, part of --seq (default 256)")
    p.add_argument("--rollout-gather", choices=("layer", "once"), default="layer",
                   help="GRPO on FSDP2 rungs, as `hfdist finetune --rollout-gather`: once counts the whole model "
                        "gathered in the compute dtype during the rollout (default layer)")
    p.add_argument("--dtype", choices=DTYPES, default=d.dtype, help=f"training precision (default {d.dtype})")
    p.add_argument("--fp8", nargs="?", const=FP8_RECIPES[0], default=d.fp8, choices=FP8_RECIPES, metavar="RECIPE",
                   help="decoder projections in float8, as `hfdist finetune --fp8` (tensorwise, the default, or "
                        "rowwise): FSDP2 gathers them at 1 byte per element (tensorwise); rungs that refuse --fp8 "
                        "are left out")
    p.add_argument("--bytes-per-param-adam", type=int, choices=ADAM_BYTES_CHOICES, default=d.bytes_per_param_adam,
                   help="mixed-precision Adam accounting: 16 (default; FSDP2/DDP totals, ZeRO paper) or 20 "
                        "(DeepSpeed's estimators)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    from hfdist.models.presets import PRESETS, ModelSpecError, load_config, preset_shape
    from hfdist.plan import GB, plan_rungs

    try:
        # Presets need no transformers import (seconds): the planner only reads sizes.
        config = preset_shape(args.model) if args.model in PRESETS else load_config(args.model)
    except ModelSpecError as exc:
        raise HfdistError(str(exc)) from exc
    plan = plan_rungs(
        config, gpus_per_node=args.gpus_per_node, nodes=args.nodes, gpu_mem_bytes=int(args.gpu_mem_gb * GB),
        seq=args.seq,
        global_batch=args.global_batch_size or args.gpus_per_node * args.nodes * (args.micro_batch or 1),
        micro_batch=args.micro_batch, tp=args.tp, pp=args.pp, cp=args.cp, cp_method=args.cp_method, lora=args.lora,
        lora_r=args.lora_r, qlora=args.qlora,
        activation_checkpointing=args.activation_checkpointing, dtype=args.dtype,
        bytes_per_param_adam=args.bytes_per_param_adam, model=args.model, loss_chunk_size=args.loss_chunk_size or None,
        attention=args.attn_implementation,
        fp8=args.fp8,
        objective=args.objective, generations=args.num_generations,
        completion_len=args.max_completion_length if args.objective == "grpo" else 0,
        rollout_gather=args.rollout_gather,
    )
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan.table())
    if plan.recommended is None:
        if args.json:  # the table already ends with the message; JSON readers get it on stderr too
            print(f"hfdist: {plan.failure_message()}", file=sys.stderr)
        return 1
    return 0



VERB = ("plan", "per-rank memory of every rung and the simplest that fits", _PLAN_HELP, add_args, run)
