"""`hfdist simulate`: the parallelize recipe on a meta model under a fake process group, at any scale."""

from __future__ import annotations

import argparse
import json

from hfdist.config.finetune import CP_METHODS

__all__ = ["VERB"]

_SIMULATE_HELP = """\
Build the model on the meta device (no weights, no memory), run hfdist's parallelize recipe for every distinct
rank role of a mesh rung under torch's fake process group (as many ranks as you ask, in this one process), check
the result with the verification a run does before step 1, and report each role's parameter, gradient and
optimizer bytes next to the planner's prediction. Seconds on a laptop for Llama-3.1-405B at 512 ranks.

Example: hfdist simulate --model llama-3.1-70b --config 3d --num-processes 512 --tp 8 --pp 4

Mesh rungs only (fsdp_full_shard, fsdp_hybrid, fsdp_tp, pp, 3d, fsdp_cp, fsdp_tp_cp); DeepSpeed rungs are
refused (their engine needs real memory and collectives), use `hfdist plan` for them. Exit code 1 when
verification fails.
"""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name (llama-3.1-8b, ...), local checkpoint folder, or HF id")
    p.add_argument("--config", required=True, help="mesh rung: fsdp_full_shard, fsdp_hybrid, fsdp_tp, pp, 3d, fsdp_cp, "
                                                   "fsdp_tp_cp, fsdp_ep (or a YAML path)")
    p.add_argument("--num-processes", type=int, required=True, help="ranks to simulate (the world size)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: the YAML's)")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages (default: the YAML's)")
    p.add_argument("--cp", type=int, default=None, help="context-parallel degree (default: the YAML's)")
    p.add_argument("--cp-method", choices=CP_METHODS, default="auto",
                   help="how the cp ranks split attention (default auto: ulysses where the heads allow, else hybrid, "
                        "else ring); the plan is applied and verified as a run's")
    p.add_argument("--dp-replicate", type=int, default=None, help="replica groups of a hybrid rung")
    p.add_argument("--ep", type=int, default=None,
                   help="expert-parallel degree of an MoE model on fsdp_ep / fsdp_tp (default: the YAML's)")
    p.add_argument("--pp-schedule", default=None, help="pipeline schedule (default: the YAML's)")
    p.add_argument("--pp-microbatches", type=int, default=None,
                   help="pipeline micro-batches per step (default: the YAML's; 1F1B needs at least pp)")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs per node: a hybrid rung shards over one node (default 8)")
    p.add_argument("--mixed-precision", choices=("bf16", "fp32"), default="bf16",
                   help="the run's precision (default bf16, the GPU default; decides FSDP2 on a pp stage with dp=1)")
    p.add_argument("--activation-checkpointing", action="store_true", help="as the run would apply it")
    p.add_argument("--step", action="store_true",
                   help="also simulate one training step in fake tensors under FSDP2's memory tracker and report its "
                        "activation peak against the planner's (non-pipeline rungs; minutes for the largest models)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length of the simulated step (default 2048)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank in the simulated step (default 1)")
    p.add_argument("--attn-implementation", default="auto", metavar="NAME",
                   help="attention of the simulated step, as `hfdist finetune --attn-implementation` (default auto: "
                        "nothing S x S); sdpa / eager hold their dense S x S mask and its per-layer copies")
    p.add_argument("--qlora", action="store_true",
                   help="simulate QLoRA's model: 4-bit NF4 projections (0.5 B/param + quantisation states whole on "
                        "every rank) and LoRA adapters (rungs that take --qlora, no pipeline stages, no --step)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank under --qlora (default 16)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    from hfdist.models.presets import load_config
    from hfdist.plan.simulate import simulate, simulation_rung

    rung = simulation_rung(args.config, args.num_processes, tp=args.tp, pp=args.pp, cp=args.cp,
                           dp_replicate=args.dp_replicate, ep=args.ep,
                           pp_schedule=args.pp_schedule, pp_microbatches=args.pp_microbatches,
                           gpus_per_node=args.gpus_per_node, model_config=load_config(args.model),
                           cp_method=args.cp_method)
    sim = simulate(args.model, rung, mixed_precision=args.mixed_precision,
                   activation_checkpointing=args.activation_checkpointing, gpus_per_node=args.gpus_per_node,
                   step_seq=args.seq if args.step else None, micro_batch=args.micro_batch,
                   attention=args.attn_implementation, qlora=args.qlora, lora_r=args.lora_r)
    print(json.dumps(sim.to_json(), indent=2) if args.json else sim.table())
    return 0 if sim.verified else 1


VERB = ("simulate", "run the parallelize recipe at any scale on a meta model (fake process group)", _SIMULATE_HELP,
        add_args, run)
