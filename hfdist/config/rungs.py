"""The rung table: one entry per rung, read by everything that treats rungs differently.

An entry says what a user reads to choose the rung (scenario, what is sharded, when to pick it: `hfdist configs`
and the ladder table of docs/ladder.md), where the planner's recommendation walk puts it (hfdist.plan.planner),
which options beyond its parallelism it takes (--compile, --qlora, --fp8: refused elsewhere before launch by
hfdist.config.features.refuse_unless), and how the test suite trains it end to end (which module, with which
options; on the YAML's own process count). Adding a rung is its YAML (hfdist/configs/accelerate_configs/) plus one
entry here (docs/testing.md, "Adding a rung").
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Callable

__all__ = ["RungInfo", "RUNG_INFO", "FEATURES", "FEATURE_FLAGS", "TESTED_OPTIONS", "E2E_MODULES", "rungs_where"]

# The options a rung may take or refuse; each is a RungInfo field of the same name (True: takes it; False or a
# string, the reason: refused before launch). The value is what hfdist verifies when it does run there.
FEATURES = {"lora": "LoRA adapters (peft)", "qlora": "a 4-bit quantized base model", "fp8": "FP8 matmuls",
            "compile": "compiled layers", "dpo": "DPO (TRL's DPOTrainer)", "grpo": "GRPO (TRL's GRPOTrainer)"}
# The command-line form of a FEATURES option whose flag is not --<name>: the objectives (--objective dpo / grpo).
FEATURE_FLAGS = {"dpo": "--objective dpo", "grpo": "--objective grpo"}
# The options the end-to-end suite trains a rung with, besides its plain full fine-tune (RungInfo.tested_with).
TESTED_OPTIONS = ("bf16", "lora", "qlora", "fp8", "compile")  # bf16: --mixed-precision bf16 (fp32 elsewhere on CPU)
# The end-to-end module that trains a rung against the single-process run (RungInfo.e2e), under tests/e2e/.
E2E_MODULES = {"ladder": "test_finetune_ladder.py", "pipeline": "test_finetune_pipeline.py",
               "context_parallel": "test_context_parallel_job.py", "moe": "test_moe_job.py",
               "reference": "(the single-process reference)"}


# Why a rung refuses --objective dpo / grpo by default, and where the layout cannot hold the objective.
_OBJECTIVE_UNVERIFIED = "hfdist has not trained this objective on this layout against one process yet"
_OBJECTIVE_PP = ("the objective compares whole sequences' log-probabilities, and pipeline stages compute one loss only, "
                 "the last stage's token cross-entropy")
_GRPO_TP = ("on fixed completions its losses equal one process's but its gradient norms do not (1-2% apart at dp 2 x tp "
            "2 on a tiny Qwen3), a difference hfdist has not found yet")
_OBJECTIVE_EP = ("TRL's loss adds the router's load-balancing loss from each rank's own batch, where hfdist's pools it "
                 "over the global batch: GRPO on fixed completions came 1e-4 off one process in the loss and 1e-3 in "
                 "the gradient norm on a tiny Qwen3-MoE at ep 2")
_OBJECTIVE_CP = ("context parallelism splits each sequence over cp ranks, while the objective scores whole sequences "
                 "(and GRPO generates them); not built")


@dataclass(frozen=True)
class RungInfo:
    """One rung's entry: what a user reads in the ladder table, where the planner puts it, what it takes, how the
    suite tests it."""

    table_row: int  # the decision table's row (docs/ladder.md); 0: not a row (the single-process reference)
    scenario: str
    sharded: str
    when: str
    example_args: str = ""  # what its launch command adds in the ladder table (ddp is the LoRA rung)
    _: KW_ONLY
    plan_order: int  # the planner's walk, simplest first (offload rungs go last whatever theirs is)
    lora: bool | str = True  # --lora: True, or why not
    compile: bool | str = False  # --compile: True, or why not (False: not built for it)
    qlora: bool | str = False  # --qlora: as compile
    fp8: bool | str = False  # --fp8: as compile
    # --objective dpo / grpo (hfdist.objectives): as compile; the cells train each against one process (GRPO on
    # fixed completions, hfdist.train.injected_faults)
    dpo: bool | str = _OBJECTIVE_UNVERIFIED
    grpo: bool | str = _OBJECTIVE_UNVERIFIED
    e2e: str = "ladder"  # the E2E_MODULES key of the module that trains it against the single process, on its
    # YAML's own process count (the count a CPU run takes)
    # TESTED_OPTIONS the suite also trains it with end to end beyond its cells (tests/e2e/test_cells.py: every option
    # it takes against one process): lora in its e2e module (saved adapters, resume), each other option in that
    # option's module (tests/e2e/test_bf16.py: fp32 saves; test_fp8.py: compositions, saves; test_qlora.py, ...)
    tested_with: frozenset[str] = frozenset()
    # Mixture-of-experts models (hfdist.models.moe): True where hfdist trains them (verified against one process,
    # the router's aux loss included), else why not (refused before launch by hfdist.parallel.expert_check);
    # takes_ep: --ep splits their experts over the data-parallel ranks there (hfdist.parallel.expert).
    moe: bool | str = False
    takes_ep: bool = False
    # Dense models (every architecture of the registry without experts): True, else why not (refused before launch
    # by hfdist.parallel.expert_check); the rung's option cells then train an MoE model (hfdist.config.cells).
    dense: bool | str = True

    def takes(self, feature: str) -> bool:
        """The rung runs with this FEATURES option (built and verified there)."""
        return getattr(self, feature) is True


# Why the rungs that refuse --compile do (the compiler would trace through what each puts around the layers).
_COMPILE_PP = "pipeline stages run their layers through torch.distributed.pipelining's schedule, not built for it"
_COMPILE_DS = "DeepSpeed's engine puts its own hooks on the layers (ZeRO-3 gathers parameters in them)"
_COMPILE_CP = "context parallelism swaps the attention function for an all-to-all one the compiler would trace"
_COMPILE_OFFLOAD = ("FSDP2's CPU offload copies every layer's shards to the device around its forward and backward; "
                    "not built or tested under --compile")
# Why the rungs that refuse --fp8 do (hfdist.parallel.float8).
_FP8_DS = "DeepSpeed's engine casts and partitions the model itself, around torchao's float8 linears"
_FP8_CP = "context parallelism splits every sequence's tokens over cp ranks, so each rank's float8 scales see a part"
_FP8_OFFLOAD = ("FSDP2's CPU offload keeps the weights in host memory, between which and torchao's float8 all-gather "
                "hfdist has built and tested nothing; the rung is for QLoRA")
# Why the rungs that refuse --lora do.
_LORA_AUTOTP = ("DeepSpeed's AutoTP swaps each Linear for its tensor-parallel layer after the optimizer is built, under "
                "peft's adapters, so ZeRO-2 meets parameters it has no name for (a KeyError in its parameter mapping, "
                "DeepSpeed 0.19.8); fsdp_tp trains LoRA under tensor parallelism")
# Why the rungs that refuse --qlora do (docs/qlora.md).
_QLORA_TP = ("tensor parallelism splits every projection into DTensor shards and runs its matmul on them, while "
             "bitsandbytes' 4-bit matmul takes a plain packed weight, and splitting a projection's input dimension "
             "would cut through the packed codes of every row")
_QLORA_ZERO12 = ("ZeRO-1/2 shard optimizer state and gradients, which under QLoRA are the adapters' (a few MB); the "
                 "4-bit base stays whole on every rank exactly as on ddp, so the rung adds nothing over ddp (zero3 "
                 "shards the base)")
_QLORA_OFFLOAD = ("DeepSpeed's offload would have to move the 4-bit base's packed partitions to the host and back "
                  "with their quantisation state, which stays on the device; not built")

# Why the rungs that refuse mixture-of-experts models do (docs/moe.md).
_MOE_DS = ("DeepSpeed's engine partitions and reduces the experts' stacked 3-D weights itself (its AutoEP covers "
           "ZeRO 0-2 only), which hfdist has not built or verified against one process for an MoE model")
_MOE_PP = ("the router's load-balancing loss pools every MoE layer's statistics, which pipeline stages hold apart; "
           "not built")
_MOE_CP = ("context parallelism splits each sequence over cp ranks, which hfdist's MoE blocks and router statistics "
           "are not built for yet")
_MOE_UNVERIFIED = "hfdist has not verified a mixture-of-experts model on this layout against one process"
# Why fsdp_ep refuses options (docs/moe.md).
_COMPILE_EP = ("the experts' all-to-all takes split sizes read from the routing (a host sync), on which the compiler "
               "would break the graph; not built")
_FP8_EP = "torchao converts Linear layers, and the experts are stacked 3-D weights; not built for MoE"
_QLORA_EP = ("the experts (most of an MoE model's weights) are stacked 3-D parameters bitsandbytes has no 4-bit layer "
             "for here, so a 4-bit base would stay mostly full precision")
_DENSE_EP = ("its experts are split over ep ranks and a dense model has none; fsdp_full_shard is the same layout for "
             "it")

# Table order: the decision table's rows (docs/ladder.md): 1 DDP, 2 FSDP FULL_SHARD / ZeRO-2, 3 HYBRID / ZeRO-3,
# 4 PP or TP (pipeline stages first, then tensor parallelism), 5 3D, 6 ZeRO-3 + offload; ZeRO-1 sits between rows
# 1 and 2. `hfdist configs`, the refusals' lists of rungs and the tests' parametrisations follow it. The planner
# walks plan_order instead: the least sharding first (ZeRO-2 before FSDP full shard).
RUNG_INFO: dict[str, RungInfo] = {
    "single": RungInfo(0, "one process: the reference every rung's losses are compared with", "nothing",
                       "debugging, or the model, grads and Adam state fit one device and one device is enough",
                       plan_order=0, compile=True, fp8=True, qlora=True, e2e="reference", dpo=True, grpo=True,
                       tested_with=frozenset({"bf16", "fp8", "lora", "qlora"}), moe=True),
    "ddp": RungInfo(1, "LoRA fine-tune <= 7B; the model fits on one device", "nothing (full replica per rank)",
                    "the model, grads and Adam state fit one device; fastest", "--lora",
                    plan_order=10, fp8=True, compile=True, qlora=True, dpo=True, grpo=True,
                    tested_with=frozenset({"bf16", "fp8", "lora", "qlora"}), moe=True),
    "zero1": RungInfo(1, "model + grads fit one device, Adam state does not", "optimizer state",
                      "a small step past DDP: frees 12 of 16 bytes/param of Adam state",
                      plan_order=20, fp8=_FP8_DS, compile=_COMPILE_DS, qlora=_QLORA_ZERO12, moe=_MOE_DS),
    "fsdp_full_shard": RungInfo(2, "full fine-tune 7B-13B on one node", "params + grads + optimizer state",
                                "the model states do not fit one device; one node",
                                plan_order=40, fp8=True, compile=True, qlora=True, dpo=True, grpo=True,
                                tested_with=frozenset({"bf16", "fp8", "lora", "qlora"}), moe=True),
    "zero2": RungInfo(2, "full fine-tune 7B-13B on one node", "grads + optimizer state",
                      "weights fit one device but grads + Adam state do not",
                      plan_order=30, fp8=_FP8_DS, compile=_COMPILE_DS, qlora=_QLORA_ZERO12,
                      tested_with=frozenset({"lora"}), moe=_MOE_DS),
    "fsdp_hybrid": RungInfo(3, "full fine-tune 30B-70B on several nodes", "params + grads + optimizer state "
                            "inside a node; replicated across nodes", "multi-node, slow inter-node fabric",
                            plan_order=60, fp8=True, compile=True, qlora=True,
                            tested_with=frozenset({"qlora"}), moe=_MOE_UNVERIFIED),
    "zero3": RungInfo(3, "full fine-tune 30B-70B", "params + grads + optimizer state",
                      "like FSDP FULL_SHARD, when you want DeepSpeed's offload/ecosystem",
                      plan_order=50, fp8=_FP8_DS, compile=_COMPILE_DS, qlora=True, dpo=True, grpo=True,
                      tested_with=frozenset({"bf16", "lora", "qlora"}), moe=_MOE_DS),
    "pp": RungInfo(4, "beyond ~30B: the model's depth spread over GPUs or nodes",
                   "decoder layers over pp ranks (pipeline stages, 1F1B schedule)",
                   "stages fit one device each; only point-to-point activations cross links, so pp spans nodes",
                   plan_order=70, fp8=True, compile=_COMPILE_PP, qlora=True, e2e="pipeline", dpo=_OBJECTIVE_PP,
                   grpo=_OBJECTIVE_PP,
                   tested_with=frozenset({"fp8", "lora", "qlora"}), moe=_MOE_PP),
    "fsdp_tp": RungInfo(4, "pretrain / full fine-tune 70B on 64-128 GPUs", "params + grads + optimizer state "
                        "over dp (FSDP2) and every matrix over tp (Megatron TP, sequence parallel)",
                        "sharding alone is not enough or its all-gathers dominate; tp inside a node",
                        plan_order=80, fp8=True, compile=True, qlora=_QLORA_TP, dpo=True, grpo=_GRPO_TP,
                        tested_with=frozenset({"fp8", "lora"}), moe=True, takes_ep=True),
    "zero2_tp": RungInfo(4, "pretrain / full fine-tune 70B on 64-128 GPUs, with DeepSpeed", "every Linear over tp "
                         "(DeepSpeed AutoTP) x grads + optimizer state over dp (ZeRO-2)",
                         "the DeepSpeed stack and TP; ZeRO-3 does not compose with AutoTP in DeepSpeed 0.19",
                         plan_order=90, lora=_LORA_AUTOTP, fp8=_FP8_DS, compile=_COMPILE_DS, qlora=_QLORA_TP,
                         tested_with=frozenset({"bf16"}), moe=_MOE_DS),
    "3d": RungInfo(5, "pretraining / frontier scale (100B+), hundreds of GPUs", "params + grads + optimizer "
                   "state over dp (FSDP2) x layers over pp (pipeline stages) x every matrix over tp",
                   "the model needs tp inside a node and pp across nodes to fit; dp for the rest",
                   plan_order=100, fp8=True, compile=_COMPILE_PP, qlora=_QLORA_TP, e2e="pipeline", moe=_MOE_PP,
                   dpo=_OBJECTIVE_PP, grpo=_OBJECTIVE_PP),
    "fsdp_cp": RungInfo(4, "long-context fine-tune (32K-128K tokens): activations exceed a device",
                        "every sequence's tokens over cp (Ulysses attention) x params + grads + optimizer state "
                        "over dp_shard x cp (FSDP2)", "activations do not fit even with checkpointing; cp inside "
                        "a node", "--seq-len 32768",
                        plan_order=110, compile=_COMPILE_CP, fp8=_FP8_CP, qlora=True, e2e="context_parallel",
                        dpo=_OBJECTIVE_CP, grpo=_OBJECTIVE_CP,
                        tested_with=frozenset({"qlora"}), moe=_MOE_CP),
    "fsdp_tp_cp": RungInfo(4, "long-context fine-tune of a model that needs TP (70B at 32K-128K tokens)",
                           "every matrix over tp (Megatron TP, sequence parallel) x every sequence's tokens over cp "
                           "(Ulysses, ring or hybrid attention) x params + grads + optimizer state over dp_shard x cp "
                           "(FSDP2)", "the weights need tp and the activations at this length need cp; tp inside a "
                           "node, cp across (the ring passes keys and values point-to-point)",
                           "--seq-len 32768 --activation-checkpointing",
                           plan_order=115, compile=_COMPILE_CP, fp8=_FP8_CP, qlora=_QLORA_TP, e2e="context_parallel",
                           dpo=_OBJECTIVE_CP, grpo=_OBJECTIVE_CP,
                           moe=_MOE_CP),
    "fsdp_ep": RungInfo(4, "mixture-of-experts fine-tune (Qwen3-30B-A3B, Mixtral, Llama 4 Scout)",
                        "each MoE layer's experts whole over ep ranks (tokens dispatched by all-to-all), FSDP2 over "
                        "the rest; attention and dense layers FSDP2 over all ranks",
                        "an MoE model whose experts' all-gathers dominate or do not fit; ep inside a node",
                        "--model qwen3-moe-tiny --ep 2",
                        plan_order=46, compile=_COMPILE_EP, fp8=_FP8_EP, qlora=_QLORA_EP, e2e="moe",
                        moe=True, takes_ep=True, dense=_DENSE_EP, dpo=_OBJECTIVE_EP, grpo=_OBJECTIVE_EP),
    "fsdp_offload": RungInfo(6, "the model exceeds the GPUs' memory even sharded, e.g. QLoRA of 70B on 2 x 24 GB",
                             "params + grads + optimizer state sharded over ranks and kept in CPU RAM (FSDP2 CPU "
                             "offload); each layer's shards copied to the GPU as it runs",
                             "not even a shard fits a GPU; the FSDP2 way to offload, and the one that trains QLoRA",
                             "--qlora",
                             plan_order=125, compile=_COMPILE_OFFLOAD, fp8=_FP8_OFFLOAD, qlora=True,
                             tested_with=frozenset({"qlora"}), moe=_MOE_UNVERIFIED),
    "zero3_offload_cpu": RungInfo(6, "single-node fine-tune, model exceeds the GPUs' memory",
                                  "params + grads + optimizer state, offloaded to CPU RAM",
                                  "not enough GPU memory at any sharding; slow but feasible",
                                  plan_order=120, fp8=_FP8_DS, compile=_COMPILE_DS, qlora=_QLORA_OFFLOAD,
                                  moe=_MOE_DS),
    "zero3_offload_nvme": RungInfo(6, "single node, model exceeds GPU and CPU memory",
                                   "params + optimizer state offloaded to NVMe", "last resort: even CPU RAM is short",
                                   "--nvme-path /local_nvme", plan_order=130, fp8=_FP8_DS, compile=_COMPILE_DS,
                                   qlora=_QLORA_OFFLOAD, moe=_MOE_DS),
}


def rungs_where(test: Callable[[RungInfo], bool] | None = None, **fields: object) -> list[str]:
    """The table's rungs (table order) whose entry passes `test` and equals `fields`, e.g.
    `rungs_where(e2e="ladder")`, `rungs_where(lambda i: "lora" in i.tested_with)`, `rungs_where(compile=True)`."""
    return [name for name, info in RUNG_INFO.items()
            if (test is None or test(info)) and all(getattr(info, k) == v for k, v in fields.items())]
