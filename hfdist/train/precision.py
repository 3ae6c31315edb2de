"""Mixed precision as it really runs: checked before the first step, and observed while training.

One mechanism per kind of rung, never two stacked: FSDP2's MixedPrecisionPolicy for hfdist's mesh rungs (bf16
compute, fp32 parameters and gradient reduction; accelerate's autocast stays off), accelerate's autocast over fp32
weights for DDP and the single process, DeepSpeed's bf16 section for ZeRO (bf16 model, fp32 master, gradients
accumulated and reduced in fp32 from the JSON's data_types.grad_accum_dtype and communication_data_type). The
loss is computed in fp32 everywhere (HF's loss and hfdist's upcast the logits).

--fp8 adds float8 matmuls in the decoder projections on top of whichever of these runs (hfdist.parallel.float8):
`check_precision` also verifies that every projection the rule picks is a float8 linear of the asked recipe,
gathered in float8 exactly where FSDP2 shards it.

`check_precision` refuses a run whose strategy objects do not carry the asked precision; `PrecisionProbe` records
the dtypes the rank computed in (a decoder projection's output, the loss) and reduces gradients in, for
hfdist_summary.json.
"""

from __future__ import annotations

import torch
from torch import nn

from hfdist.config.ladder import Rung
from hfdist.parallel.fsdp import fsdp_policy, fsdp_units

__all__ = ["check_precision", "PrecisionProbe", "reduce_dtype"]


def reduce_dtype(rung: Rung, wrapped: nn.Module, model: nn.Module) -> torch.dtype | None:
    """The dtype gradients are reduced in across data-parallel ranks, read from the live strategy objects; None
    when nothing is reduced (one data-parallel rank without FSDP)."""
    if rung.uses_deepspeed:
        return wrapped.communication_data_type
    fsdp = fsdp_units(model)
    if fsdp:
        policy = fsdp_policy(fsdp[0])
        trainable = next((p for p in fsdp[0].parameters() if p.requires_grad), None)
        return policy.reduce_dtype or policy.param_dtype or (trainable.dtype if trainable is not None else None)
    if rung.dims.dp > 1:  # DDP: buckets in the gradients' dtype, the trainable parameters' own
        return next(p.dtype for p in model.parameters() if p.requires_grad)
    return None


def check_precision(rung: Rung, mixed_precision: str, accelerator, wrapped: nn.Module, model: nn.Module,
                    fp8: str | None = None) -> None:
    """Raise StrategyNotInEffect unless the asked precision is the one the strategy objects carry, by exactly one
    mechanism, with gradients reduced in fp32, and the decoder projections compute in float8 exactly as `fp8` (a
    recipe, or None) asks (hfdist.parallel.float8.float8_problems)."""
    from hfdist.parallel.float8 import float8_problems
    from hfdist.parallel.float8_check import gathers_in_float8
    from hfdist.parallel.parallelize import fsdp_shard_ranks
    from hfdist.parallel.verify import StrategyNotInEffect

    bf16 = mixed_precision == "bf16"
    problems = []
    autocast = bool(accelerator.native_amp) and accelerator.mixed_precision == "bf16"
    if rung.owns_sharding:
        if autocast:
            problems.append("accelerate autocasts the forward on top of FSDP2's mixed-precision policy")
        for module in fsdp_units(model):
            policy = fsdp_policy(module)
            if (policy.param_dtype == torch.bfloat16) != bf16:
                problems.append(f"an FSDP2 unit computes in {policy.param_dtype or 'the parameters dtype'}")
                break
        if bf16 and not fsdp_units(model):
            problems.append("no FSDP2 unit carries the bf16 policy")
    elif rung.uses_deepspeed:
        if wrapped.bfloat16_enabled() != bf16:
            problems.append(f"DeepSpeed's bf16 is {'on' if wrapped.bfloat16_enabled() else 'off'}")
    elif autocast != bf16:
        problems.append(f"accelerate's bf16 autocast is {'on' if autocast else 'off'}")
    reduced = reduce_dtype(rung, wrapped, model)
    if reduced not in (None, torch.float32):
        problems.append(f"gradients are reduced in {reduced}")
    all_gather = gathers_in_float8(fp8, fsdp_shard_ranks(rung, mixed_precision))
    problems += float8_problems(model, fp8, rung.dims.tp, all_gather)
    if problems:
        asked = f"--mixed-precision {mixed_precision}" + (f" --fp8 {fp8}" if fp8 else "")
        raise StrategyNotInEffect(
            f"{asked} is not what {rung.name} runs: {'; '.join(problems)}. hfdist stops "
            "rather than train in another precision than asked. For DeepSpeed rungs keep bf16 \"auto\", "
            "data_types.grad_accum_dtype \"fp32\" and communication_data_type \"fp32\" in the JSON."
        )


def _dtype_of(output) -> torch.dtype:
    return getattr(output, "_local_tensor", output).dtype


class PrecisionProbe:
    """Records the dtypes one rank computes in: a decoder projection's output and, under pipeline parallelism, the
    hidden states a stage hands to the next (each at its first call), and the loss."""

    def __init__(self) -> None:
        self.compute_dtype: torch.dtype | None = None
        self.activation_dtype: torch.dtype | None = None
        self.loss_dtype: torch.dtype | None = None
        self._hooks: list = []

    def attach(self, model: nn.Module) -> None:
        """Watch the first Linear inside a decoder layer of `model` (or of this rank's first pipeline stage; the
        layer DeepSpeed's AutoTP put in a Linear's place, whose weight carries AutoTP's gather), and the output of
        each pipeline stage but the last."""
        layer_linear = next((m for name, m in model.named_modules()
                             if (isinstance(m, nn.Linear) or hasattr(getattr(m, "weight", None), "gather_params"))
                             and ".layers." in f".{name}" and "lora_" not in name), None)
        if layer_linear is not None:
            self._hooks.append(layer_linear.register_forward_hook(self._computed))
        from hfdist.parallel.pipeline.model import PipelineModel

        for stage in model.stages if isinstance(model, PipelineModel) else ():
            if not stage.is_last:
                self._hooks.append(stage.register_forward_hook(self._handed_on))

    def _computed(self, module, args, output) -> None:
        # Under autocast a matmul computes in the autocast dtype even where the layer hands back its input's dtype
        # (bitsandbytes' 4-bit layers cast their output back).
        device = getattr(output, "device", torch.device("cpu")).type
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        self.compute_dtype = self.compute_dtype or autocast or _dtype_of(output)

    def _handed_on(self, module, args, output) -> None:
        self.activation_dtype = self.activation_dtype or _dtype_of(output)

    def note_loss(self, loss: torch.Tensor | None) -> None:
        """The loss as computed (before any scaling for logging)."""
        if loss is not None and self.loss_dtype is None:
            self.loss_dtype = loss.dtype

    def record(self, rung: Rung, wrapped: nn.Module, model: nn.Module) -> dict[str, str | None]:
        """{"compute_dtype", "loss_dtype", "activation_dtype" (between pipeline stages), "reduce_dtype",
        "param_dtype" (the trainables'), "base_dtype" (QLoRA's 4-bit base: its quantisation type)} as dtype
        names (None: not on this rank, or no 4-bit base)."""
        from hfdist.models.quantize import four_bit_modules

        def name(dtype):
            return str(dtype).removeprefix("torch.") if dtype is not None else None

        from torch.distributed.fsdp import FSDPModule

        # FSDP2 leaves the root's parameters unsharded after a forward that does not reshard (an evaluation at the
        # end of training): reshard, so the dtype read is the stored one, not the bf16 compute copy.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        trainable = next((p for p in model.parameters() if p.requires_grad), None)
        param = getattr(trainable, "_local_tensor", trainable)
        for hook in self._hooks:
            hook.remove()
        return {"compute_dtype": name(self.compute_dtype), "loss_dtype": name(self.loss_dtype),
                "activation_dtype": name(self.activation_dtype),
                "reduce_dtype": name(reduce_dtype(rung, wrapped, model)),
                "param_dtype": name(param.dtype if param is not None else None),
                "base_dtype": next((m.quant_state.quant_type for _, m in four_bit_modules(model)), None)}
