"""What the GPU suite measures (benchmarks/gpu/run.sh): one cell per run, for the GPUs visible (or CPU stand-ins
under --dry-run), in the order the parts run them: the headline figures first, so that a lent machine's first
command (part 1, at most FIRST_PART_S by the estimates) gives them.

On one GPU, part 1: the Llama-3.2-1B shape (preset llama-3.2-1b, seeded weights: nothing is downloaded) in bf16 at
2048 tokens per sequence (tokens/s, MFU, peak memory against `hfdist plan`), the same through a plain transformers
Trainer (benchmarks/gpu/baseline.py), 8192-token packed rows with the default attention (flash varlen where
installed) and with sdpa, --compile, --fp8 and LoRA. Then TRL's SFTTrainer, the other attention backends, rowwise
FP8, the compiled long sequence, and the Llama-3.1-8B shape where the planner says it fits (LoRA on one 80 GB
GPU). With two or more GPUs, the core single-GPU cells, the ladder through `hfdist compare` (bf16, then --fp8 on
rungs that take it) and the 8B shape on fsdp_full_shard. Each cell's peak memory is set against what `hfdist plan`
predicts; no cell saves its model (`--no-save-model`: saving is not what they measure).

The estimates are start-up (imports, building the model, the optimizer) plus the steps, guessed for an H100 and
not yet measured on one: the first run records each cell's wall seconds beside them (gpu_suite.json).

--dry-run swaps the shapes for CPU ones (llama-tiny, 64 / 128 tokens, 2 steps) and leaves out what a CPU cannot
run or would take minutes on (compiled layers, GPU-only attention kernels, the 8B shape, the multi-GPU ladder): the
suite's own code (parts, resume, baselines, report) runs in the test suite that way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ATTENTION_BACKENDS", "FIRST_PART_S", "LADDER", "Cell", "Shape", "GPU", "DRY_RUN", "suite_cells"]

# Part 1's estimated seconds at most: the headline figures within the first 8 minutes of a lent machine (15 in all,
# start-up included).
FIRST_PART_S = 480

# The attention kernels the suite compares (`hfdist finetune --attn-implementation`): the one place to change them.
ATTENTION_BACKENDS = ("sdpa", "flash_attention_2", "flex_attention", "auto")


@dataclass(frozen=True)
class Shape:
    """Model and workload sizes of one suite flavour."""

    model: str  # the 1B-class preset
    big: str  # the 8B-class preset (None: left out)
    seqs: tuple[int, int]  # (short, long) tokens per sequence
    steps: int
    global_batch: int  # sequences per step on one device (scaled by the device count on the ladder)
    estimate_s: int  # expected wall seconds of one run at the short sequence (parts are packed with it)


GPU = Shape(model="llama-3.2-1b", big="llama-3.1-8b", seqs=(2048, 8192), steps=12, global_batch=4, estimate_s=60)
DRY_RUN = Shape(model="llama-tiny", big=None, seqs=(64, 128), steps=2, global_batch=2, estimate_s=20)


@dataclass(frozen=True)
class Cell:
    """One measured run.

    Attributes:
        name: unique within the suite; also the run's folder.
        kind: "hfdist" (`hfdist finetune`), "plain" / "trl" (benchmarks/gpu/baseline.py), "compare" (`hfdist compare`),
            "kernels" (benchmarks/gpu/kernels.py: the ring / hybrid block kernels and the MoE experts).
        args: the run's own arguments (the runner adds the model, output folder and shared workload).
        seq: tokens per sequence; lora / fp8 / checkpointing as the run asks (the memory plan reads them).
        estimate_s: expected wall seconds.
    """

    name: str
    kind: str
    args: tuple[str, ...] = ()
    seq: int = 0
    model: str = ""
    lora: bool = False
    fp8: str | None = None
    checkpointing: bool = False
    estimate_s: int = 0
    notes: tuple[str, ...] = field(default=())


def _hfdist(shape: Shape, name: str, seq: int, *args: str, model: str | None = None, lora: bool = False,
            fp8: str | None = None, checkpointing: bool = False, scale: float = 1.0) -> Cell:
    extra = (*args, *(("--lora",) if lora else ()), *(("--fp8", fp8) if fp8 else ()),
             *(("--activation-checkpointing",) if checkpointing else ()))
    return Cell(name, "hfdist", extra, seq, model or shape.model, lora, fp8, checkpointing,
                int(shape.estimate_s * scale))


# The ladder on two or more GPUs, in groups of rungs that `hfdist compare` runs within one part each: one rung per
# decision-table row that a single node distinguishes (zero1 and zero2_tp, fsdp_hybrid (fsdp_full_shard on one
# node), the offload rungs and fsdp_cp (a long sequence of its own) left out: the 30 minutes of a lent machine).
LADDER = {"ladder-data-parallel": ("ddp", "zero2", "fsdp_full_shard", "zero3"),
          "ladder-model-parallel": ("pp", "fsdp_tp", "3d"),
          "ladder-fp8": ("fsdp_full_shard", "fsdp_tp", "3d")}
LADDER_RUNG_S = 90  # one rung's world: start-up, the 1B model, the steps, its save


def suite_cells(shape: Shape, gpus: int, dry_run: bool, attention: bool, long_needs_checkpointing: bool,
                big_fits: bool) -> list[Cell]:
    """Every cell, most wanted first (a session that runs out of device time has measured those).

    Args:
        gpus: devices visible: one runs every single-device cell; two or more run the core single-device cells
            (on one of them) and the ladder.
        attention: `hfdist finetune` takes --attn-implementation (the attention backends' cells).
        long_needs_checkpointing: the planner says the long sequence needs activation checkpointing on one device.
        big_fits: the planner says the 8B shape's LoRA fits one device.
    """
    short, long = shape.seqs
    compiled = () if dry_run else ("--compile",)
    ckpt = long_needs_checkpointing
    headline = [
        _hfdist(shape, f"full-{short}", short),
        Cell(f"plain-trainer-{short}", "plain", (), short, shape.model, estimate_s=shape.estimate_s),
        _hfdist(shape, f"full-{long}", long, checkpointing=ckpt, scale=1.1),
    ]
    if attention and not dry_run:  # the packed long rows by sdpa beside the default (flash varlen where installed)
        headline.append(_hfdist(shape, f"full-{long}-attn-sdpa", long, "--attn-implementation", "sdpa",
                                 checkpointing=ckpt, scale=1.1))
    if not dry_run:  # a CPU compiles each layer for a minute
        headline.append(_hfdist(shape, f"full-{short}-compile", short, *compiled, scale=1.9))
    headline.append(_hfdist(shape, f"full-{short}-fp8", short, fp8="tensorwise"))
    if not dry_run:  # the dry run keeps to one cell of each kind: the test's time
        headline.append(_hfdist(shape, f"lora-{short}", short, lora=True, scale=0.8))
    # Part 2 on one GPU: this round's work (the ring and hybrid kernels, the MoE experts, generation at evaluation)
    new_work = [Cell("kernels", "kernels", estimate_s=shape.estimate_s)]
    if not dry_run:
        new_work.append(_hfdist(shape, f"full-{short}-eval-prompts", short, "--eval-fraction", "0.02",
                                "--eval-prompts", "4", "--eval-max-new-tokens", "32", scale=1.5))
    cells = [*headline, *new_work, Cell(f"trl-sft-{short}", "trl", (), short, shape.model, estimate_s=shape.estimate_s)]
    if dry_run:
        return cells
    if gpus >= 2:  # the ladder's FP8 group measures float8 under sharding in place of the compiled single-GPU cell
        return cells + [*(Cell(name, "compare", ("--configs", *rungs, *(("--fp8",) if "fp8" in name else ())),
                               short, shape.model, fp8="tensorwise" if "fp8" in name else None,
                               estimate_s=LADDER_RUNG_S * len(rungs)) for name, rungs in LADDER.items()),
                        _hfdist(shape, f"8b-full-{short}-fsdp", short, "--config", "fsdp_full_shard",
                                model=shape.big, checkpointing=True, scale=3)]
    cells += [_hfdist(shape, f"full-{short}-fp8-compile", short, *compiled, fp8="tensorwise", scale=1.9),
              _hfdist(shape, f"full-{short}-fp8-rowwise", short, fp8="rowwise"),
              _hfdist(shape, f"full-{long}-compile", long, *compiled, checkpointing=ckpt, scale=2)]
    if attention:  # `auto` is what full-{long} ran, sdpa part 1
        cells += [_hfdist(shape, f"full-{long}-attn-{name}", long, "--attn-implementation", name,
                          checkpointing=ckpt, scale=1.1) for name in ATTENTION_BACKENDS if name not in ("auto", "sdpa")]
    if shape.big and big_fits:
        cells.append(_hfdist(shape, f"8b-lora-{short}", short, model=shape.big, lora=True, checkpointing=True,
                             scale=3))
    return cells
