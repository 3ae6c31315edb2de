"""Float8ScalesCallback: the float8 scales of the weights FSDP2 gathers in float8, recomputed once per step.

Under `--fp8 tensorwise` where FSDP2 shards, each rank casts its weight shard to float8 before the all-gather
(hfdist.parallel.float8), with the scale of the whole weight. Computing those scales for every weight in one
all-reduce after the optimizer step (torchao's precompute_float8_dynamic_scale_for_fsdp, as torchtitan does) costs
one collective per step instead of one per weight per gather, and gives every rank, tp ranks included, the scale one
process would compute. The first step's scales are computed at train begin, after a resumed checkpoint is loaded.
"""

from __future__ import annotations

from transformers import TrainerCallback

from hfdist.parallel.float8 import precompute_scales

__all__ = ["Float8ScalesCallback"]


class Float8ScalesCallback(TrainerCallback):
    """Recompute the float8 all-gather scales of the Trainer's model before the first step and after every
    optimizer step."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        precompute_scales(model)

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        precompute_scales(model)
