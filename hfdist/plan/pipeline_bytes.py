"""What a pipeline stage holds beyond its decoder layers' saved tensors and the loss head's, as torch.distributed.
pipelining's stages and schedules keep it. Torch-free: hfdist.plan.bytes adds it to a pipeline rung's stages.

Measured per stage by `hfdist tune`'s probes on CPU (llama-small, pp 4 and dp_shard 2 x pp 2, 1F1B over 4
micro-batches; results/cpu-2core/tune.md), with the tensors alive at each rank's peak listed by the op that made
them: the layers' saved tensors were as hfdist.models.shape counts them, and the rest was these.
"""

from __future__ import annotations

from hfdist.models.shape import ModelShape

__all__ = ["pipeline_stage_bytes"]


def pipeline_stage_bytes(shape: ModelShape, pp: int, stage: int, n_microbatches: int, tokens: int, elem: int,
                         grad_elem: int, tp: int = 1) -> tuple[int, int, int]:
    """(held with the activations, one layer's backward working set, receive buffers) of pipeline stage `stage` of
    `pp` under a 1F1B schedule of `n_microbatches`, for micro-batches of `tokens` tokens on a rank (elem: bytes per
    activation element; grad_elem: per weight-gradient element).

    - Each micro-batch's stage output stays in the stage's forward cache until that micro-batch's backward (all but
      the last stage, whose output is the loss), and each backward leaves the gradient of the stage's input on its
      receive buffer until the step ends (all but the first stage): pp - stage micro-batches in flight, so
      n_microbatches - in flight + 1 input gradients at the steady state's end. The stage's input, which its first
      layer saves (whole, or as the checkpoint under recompute), is the receive buffer: not counted twice.
    - A stage without the loss head peaks in a backward: the gradients of the MLP's three intermediate-wide tensors
      exist together, and a weight's gradient exists whole before it is added to `.grad`.
    - torch allocates, at the first step and for the whole run, one receive buffer per micro-batch for the
      activations a stage gets (all but the first) and one for the gradients it gets back (all but the last).
    """
    first, last = stage == 0, stage == pp - 1
    in_flight = pp - stage
    hidden = tokens * shape.hidden * elem  # one micro-batch's hidden states, as they cross a stage boundary
    held = (0 if last else in_flight * hidden) + (0 if first else (n_microbatches + 1 - 2 * in_flight) * hidden)
    working = (tokens * 3 * shape.intermediate * elem + shape.largest_projection * grad_elem) // tp
    buffers = n_microbatches * hidden * ((not first) + (not last))
    return held, working, buffers
