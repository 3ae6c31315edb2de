"""Picking a strategy in a user's script: a rung name, an accelerate YAML, or degrees, fitted to the launched world.

    strategy = resolve_strategy("fsdp_tp")              # or "single", "my_fsdp.yaml", or resolve_strategy(tp=2)
    args = strategy.training_arguments(SFTConfig, output_dir="out", global_batch_size=8, max_steps=3)

The world is the one the launcher started (torchrun / accelerate launch: WORLD_SIZE), and the rung is rescaled to it
as `hfdist finetune --num-processes` would (the data-parallel axis absorbs the rest). The training arguments carry
what the strategy decides and a user must not set apart from it: the per-rank batch and accumulation of a global
batch, the device, the precision mechanism, DeepSpeed's config, that the Trainer must not move a model hfdist placed,
and that activation checkpointing is hfdist's (prepare_model) on the rungs it shards itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from hfdist.config.dims import DimsError, ParallelDims, batch_layout
from hfdist.config.ladder import LadderError, PipelineSettings, Rung, StrategyKind, load_rung
from hfdist.config.precision import settle_mixed_precision
from hfdist.errors import HfdistError

__all__ = ["StrategyRefused", "Strategy", "resolve_strategy", "process_group_backend", "placed_by_hfdist"]

Args = TypeVar("Args")

# Settings the strategy owns: passing them to `training_arguments` is refused, naming where they are set instead.
_OWNED = {
    "per_device_train_batch_size": "global_batch_size= (and micro_batch_size=)",
    "gradient_accumulation_steps": "global_batch_size= (and micro_batch_size=)",
    "use_cpu": "the machine (a GPU when there is one)", "bf16": "resolve_strategy(mixed_precision=...)",
    "fp16": "resolve_strategy(mixed_precision=...)", "deepspeed": "the rung's DeepSpeed JSON",
    "ddp_backend": "the rung", "activation_checkpointing": "prepare_model(activation_checkpointing=True)",
    "gradient_checkpointing": "prepare_model(activation_checkpointing=True)",
}


class StrategyRefused(HfdistError, ValueError):
    """A strategy that cannot apply to this world, model, data or Trainer; refused before the first step, naming
    the fix."""


@dataclass(frozen=True)
class Strategy:
    """A rung fitted to the launched world, and the precision it trains in.

    Attributes:
        rung: the strategy (hfdist.config.ladder.Rung): kind, degrees, FSDP / pipeline / DeepSpeed settings.
        mixed_precision: "bf16", "fp16" (DDP and DeepSpeed on a GPU) or "no", as this machine runs it.
        nvme_path: the folder a DeepSpeed rung offloading to NVMe swaps into (its JSON's, when None).
    """

    rung: Rung
    mixed_precision: str
    nvme_path: str | None = None

    @property
    def name(self) -> str:
        """The rung's name (fsdp_tp, pp, ..., or a YAML's stem)."""
        return self.rung.name

    @property
    def dims(self) -> ParallelDims:
        """The degrees: dp_replicate x dp_shard x cp x pp x tp."""
        return self.rung.dims

    def batch_layout(self, global_batch_size: int, micro_batch_size: int | None = None) -> tuple[int, int]:
        """(rows per rank per forward, gradient-accumulation steps) of a global batch over the data-parallel ranks.

        Raises:
            DimsError: sizes the data-parallel degree does not divide, naming sizes that work.
        """
        return batch_layout(global_batch_size, micro_batch_size, self.dims.dp)

    def training_arguments(self, cls: type[Args] | None = None, *, global_batch_size: int,
                           micro_batch_size: int | None = None, **kwargs: Any) -> Args:
        """`cls(**kwargs)` (TrainingArguments or a subclass such as TRL's SFTConfig / DPOConfig) with the strategy's
        settings: batch layout, device, precision, DeepSpeed config, no model placement by the Trainer on the rungs
        hfdist shards itself. Builds the process group when a launcher started a world.

        Raises:
            StrategyRefused: a setting the strategy owns given in kwargs (the message names where it is set).
        """
        from transformers import TrainingArguments

        cls = cls or TrainingArguments
        owned = sorted(set(kwargs) & set(_OWNED))
        if owned:
            raise StrategyRefused(f"{', '.join(owned)} belong to the strategy ({self.name}); set them through "
                                  f"{'; '.join(_OWNED[k] for k in owned)} instead of the training arguments.")
        import torch

        on_gpu = torch.cuda.is_available()
        micro, accumulation = self.batch_layout(global_batch_size, micro_batch_size)
        mesh = self.rung.owns_sharding
        settings = dict(per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                        use_cpu=not on_gpu, bf16=self.mixed_precision == "bf16" and not mesh,
                        fp16=self.mixed_precision == "fp16",
                        deepspeed=self.deepspeed_config()[0], ddp_backend=process_group_backend(self.rung, on_gpu))
        # Activation checkpointing is prepare_model's on every rung (the Trainer cannot reach the layers inside
        # pipeline stages); TRL's configs default the Trainer's own on, which would apply it a second time.
        settings["activation_checkpointing"] = False
        if _has_field(cls, "gradient_checkpointing"):
            settings["gradient_checkpointing"] = False
        # A non-finite step stops the run (hfdist.train.nonfinite); the Trainer's default would log it as the mean of
        # the earlier losses (0.0 when every step is logged), hiding it. A caller's own value wins.
        args = cls(**{"logging_nan_inf_filter": False, **kwargs, **settings})
        return placed_by_hfdist(args) if mesh else args

    def deepspeed_config(self) -> tuple[dict | None, str | None]:
        """The DeepSpeed config this run hands the Trainer (the rung's JSON with the run's precision, AutoTP degree
        and NVMe folder filled in) and a note of what was changed in it; (None, None) on the other rungs."""
        if self.rung.ds_config_path is None:
            return None, None
        from hfdist.config.translate import deepspeed_config_for_run

        return deepspeed_config_for_run(self.rung.ds_config_path, self.mixed_precision, tp=self.dims.tp,
                                        nvme_path=self.nvme_path)


def _has_field(cls, name: str) -> bool:
    from dataclasses import fields

    return name in {f.name for f in fields(cls)}


def process_group_backend(rung: Rung, on_gpu: bool) -> str | None:
    """The backend the process group needs beyond accelerate's default (None: the default). FSDP2's CPU offload on GPU
    keeps parameters and gradients in host memory, so clipping's all-reduce and the save's gathers run on CPU tensors:
    they need gloo beside NCCL in the same group."""
    offloads = rung.owns_sharding and rung.fsdp is not None and rung.fsdp.offload_params
    return "cuda:nccl,cpu:gloo" if on_gpu and offloads else None


_PLACED: dict[type, type] = {}


def placed_by_hfdist(args: Args) -> Args:
    """`args` as an instance of a subclass of its own class whose `place_model_on_device` is False: the Trainer must
    never `.to(device)` a model hfdist sharded and placed itself (FSDP2's CPU-offloaded parameters would be pulled
    onto the GPU, or raise). TrainingArguments exposes this switch only as a property to override."""
    if args.place_model_on_device is False:
        return args
    cls = type(args)
    if cls not in _PLACED:
        _PLACED[cls] = type(cls.__name__, (cls,), {"place_model_on_device": property(lambda self: False),
                                                   "__module__": cls.__module__, "__doc__": cls.__doc__})
    args.__class__ = _PLACED[cls]
    return args


def _world() -> tuple[int, int | None]:
    """(processes in the launched world, processes on this node when there are GPUs to count them by)."""
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return world, int(local) if local and torch.cuda.is_available() else None


def _rung_of_degrees(world: int, dp_replicate: int, dp_shard: int | None, tp: int, pp: int, cp: int) -> Rung:
    """The shipped mesh rung with these axes (its FSDP settings and name), with exactly these degrees."""
    name = ("3d" if pp > 1 and tp > 1 else "pp" if pp > 1 else "fsdp_tp_cp" if cp > 1 and tp > 1 else "fsdp_cp"
            if cp > 1 else "fsdp_tp" if tp > 1 else "fsdp_hybrid" if dp_replicate > 1 else "fsdp_full_shard")
    rest = dp_replicate * tp * pp * cp
    try:
        dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard or max(world // rest, 1), tp=tp, pp=pp, cp=cp)
        dims.check_world(world)
    except DimsError as exc:
        raise StrategyRefused(f"{exc} (The launched world has {world} processes: pick degrees that multiply to it.)") \
            from exc
    template = load_rung(name)
    pipeline = (template.pipeline or PipelineSettings()) if pp > 1 else None
    fsdp = replace(template.fsdp, hybrid=dp_replicate > 1)
    return replace(template, num_processes=world, dims=dims, pipeline=pipeline, fsdp=fsdp)


def resolve_strategy(config: str | None = None, *, dp_replicate: int | None = None, dp_shard: int | None = None,
                     tp: int | None = None, pp: int | None = None, cp: int | None = None, ep: int | None = None,
                     pp_schedule: str | None = None, pp_microbatches: int | None = None,
                     mixed_precision: str = "auto", cp_method: str = "auto") -> Strategy:
    """The strategy a script asked for, fitted to the world its launcher started.

    Args:
        config: a shipped rung's name ("fsdp_tp", "pp", "3d", ...), a path to an accelerate YAML, or "single"
            (one process). None: build a mesh rung from the degrees (one process when none is given).
        dp_replicate, tp, pp: override the rung's degrees (CLI > YAML, as `hfdist finetune --tp/--pp`); with
            config=None they, dp_shard and cp are the degrees themselves.
        ep: a mixture-of-experts model's expert-parallel degree on fsdp_ep / fsdp_tp (docs/moe.md).
        pp_schedule, pp_microbatches: a pipeline rung's schedule and micro-batches per step.
        mixed_precision: "auto" (the rung's on a GPU, fp32 on a CPU), "bf16" or "no".
        cp_method: how the cp ranks split attention, as `hfdist finetune --cp-method` ("auto": Ulysses where the
            heads allow, else hybrid, else ring; planned for the model by prepare_model).

    Raises:
        StrategyRefused: a config or degrees that do not fit the world, or settings hfdist cannot honour; the
        message names the fix.
    """
    import torch

    world, node = _world()
    try:
        if config is None:
            if ep not in (None, 1):
                raise StrategyRefused(f"ep={ep} splits an MoE model's experts over a rung that takes it: pass "
                                      "config='fsdp_ep' (or 'fsdp_tp') with ep.")
            if world == 1 and not any(d not in (None, 1) for d in (dp_replicate, dp_shard, tp, pp, cp)):
                rung = load_rung("single")
            else:
                rung = _rung_of_degrees(world, dp_replicate or 1, dp_shard, tp or 1, pp or 1, cp or 1)
        else:
            if dp_shard is not None:
                raise StrategyRefused("dp_shard is a degree of a config of your own (config=None); a named rung "
                                      f"({config}) takes tp / pp / cp / dp_replicate overrides only, the "
                                      "data-parallel axis absorbing the rest. Pass config=None with the degrees.")
            rung = load_rung(config).with_num_processes(world, tp=tp, pp=pp, cp=cp, dp_replicate=dp_replicate,
                                                        node_size=node, ep=ep)
        rung = rung.with_pipeline(pp_schedule, pp_microbatches).with_context(cp_method)
    except LadderError as exc:
        raise StrategyRefused(f"{exc} (The launched world has {world} processes.)") from exc
    if rung.kind is StrategyKind.SINGLE and world > 1:
        raise StrategyRefused(f"The single rung runs one process, but the launcher started {world}. Launch one "
                              "process, or pick a distributed rung (e.g. fsdp_full_shard).")
    return Strategy(rung, settle_mixed_precision(rung, torch.cuda.is_available(), mixed_precision))
