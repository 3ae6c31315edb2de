"""The decision table the ladder follows: for each shipped rung, what a user reads to choose it (scenario, what is
sharded, when to pick it), shown by `hfdist configs` and the README's ladder table."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RungInfo", "RUNG_INFO"]


@dataclass(frozen=True)
class RungInfo:
    """What a user reads in the ladder table."""

    table_row: int
    scenario: str
    sharded: str
    when: str
    example_args: str = ""  # what its launch command adds in the README's table (ddp is the LoRA rung)


# Decision-table order (the README's ladder table): rows 1 DDP, 2 FSDP FULL_SHARD / ZeRO-2, 3 HYBRID / ZeRO-3,
# 4 PP or TP (pipeline stages first, then tensor parallelism), 5 3D, 6 ZeRO-3 + offload. ZeRO-1 sits between rows
# 1 and 2.
RUNG_INFO: dict[str, RungInfo] = {
    "ddp": RungInfo(1, "LoRA fine-tune <= 7B; the model fits on one device", "nothing (full replica per rank)",
                    "the model, grads and Adam state fit one device; fastest", "--lora"),
    "zero1": RungInfo(1, "model + grads fit one device, Adam state does not", "optimizer state",
                      "a small step past DDP: frees 12 of 16 bytes/param of Adam state"),
    "fsdp_full_shard": RungInfo(2, "full fine-tune 7B-13B on one node", "params + grads + optimizer state",
                                "the model states do not fit one device; one node"),
    "zero2": RungInfo(2, "full fine-tune 7B-13B on one node", "grads + optimizer state",
                      "weights fit one device but grads + Adam state do not"),
    "fsdp_hybrid": RungInfo(3, "full fine-tune 30B-70B on several nodes", "params + grads + optimizer state "
                            "inside a node; replicated across nodes", "multi-node, slow inter-node fabric"),
    "zero3": RungInfo(3, "full fine-tune 30B-70B", "params + grads + optimizer state",
                      "like FSDP FULL_SHARD, when you want DeepSpeed's offload/ecosystem"),
    "pp": RungInfo(4, "beyond ~30B: the model's depth spread over GPUs or nodes",
                   "decoder layers over pp ranks (pipeline stages, 1F1B schedule)",
                   "stages fit one device each; only point-to-point activations cross links, so pp spans nodes"),
    "fsdp_tp": RungInfo(4, "pretrain / full fine-tune 70B on 64-128 GPUs", "params + grads + optimizer state "
                        "over dp (FSDP2) and every matrix over tp (Megatron TP, sequence parallel)",
                        "sharding alone is not enough or its all-gathers dominate; tp inside a node"),
    "zero2_tp": RungInfo(4, "pretrain / full fine-tune 70B on 64-128 GPUs, with DeepSpeed", "every Linear over tp "
                         "(DeepSpeed AutoTP) x grads + optimizer state over dp (ZeRO-2)",
                         "the DeepSpeed stack and TP; ZeRO-3 does not compose with AutoTP in DeepSpeed 0.19"),
    "3d": RungInfo(5, "pretraining / frontier scale (100B+), hundreds of GPUs", "params + grads + optimizer "
                   "state over dp (FSDP2) x layers over pp (pipeline stages) x every matrix over tp",
                   "the model needs tp inside a node and pp across nodes to fit; dp for the rest"),
    "fsdp_cp": RungInfo(4, "long-context fine-tune (32K-128K tokens): activations exceed a device",
                        "every sequence's tokens over cp (Ulysses attention) x params + grads + optimizer state "
                        "over dp_shard x cp (FSDP2)", "activations do not fit even with checkpointing; cp inside "
                        "a node", "--seq-len 32768"),
    "zero3_offload_cpu": RungInfo(6, "single-node fine-tune, model exceeds the GPUs' memory",
                                  "params + grads + optimizer state, offloaded to CPU RAM",
                                  "not enough GPU memory at any sharding; slow but feasible"),
    "zero3_offload_nvme": RungInfo(6, "single node, model exceeds GPU and CPU memory",
                                   "params + optimizer state offloaded to NVMe", "last resort: even CPU RAM is short",
                                   "--nvme-path /local_nvme"),
}
