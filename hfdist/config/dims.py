"""ParallelDims: the one source of truth for a run's parallel degrees.

The world is factored as dp_replicate x dp_shard x cp x pp x tp (outermost to innermost), the layout torchtitan and
accelerate's ParallelismConfig use: tp innermost so its frequent collectives stay between neighbouring ranks (one
node), data parallelism outermost so its once-per-step collectives may cross nodes. cp (context parallelism: the
ranks holding one sequence's chunks, hfdist.parallel.context) sits next to dp_shard, so FSDP2 can shard over the
flattened dp_shard x cp axis; under pipeline stages the batch is cut over cp before stage 0, and each stage's cp
group holds the same layers. ep (expert parallelism) is no axis of the world: it borrows its ranks from dp_shard,
which the MoE layers' experts see as dp_shard_mod_ep x ep (hfdist.parallel.expert).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hfdist.errors import HfdistError

__all__ = ["ParallelDims", "DimsError", "batch_layout"]


class DimsError(HfdistError, ValueError):
    """Parallel degrees that do not describe a valid world."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel axis; their product is the world size.

    Attributes:
        dp_replicate: replicas of the (sharded) model; gradients all-reduced across them (DDP / HSDP replicas).
        dp_shard: ranks a model replica is sharded over (FSDP / ZeRO); 1 means no sharding.
        pp: pipeline stages.
        tp: tensor-parallel degree.
        cp: context-parallel degree: ranks that each hold 1/cp of every sequence (the same parameters, sharded
            together with dp_shard by FSDP2).
        ep: expert-parallel degree: the dp_shard ranks over which an MoE layer's experts are split whole (E / ep
            each); it divides dp_shard and adds no process.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        bad = {k: v for k, v in asdict(self).items() if not isinstance(v, int) or v < 1}
        if bad:
            raise DimsError(
                f"Parallel degrees must be positive integers, got {self.describe()} (bad: {bad}). "
                "Fix the config's parallelism sizes or the --num-processes flag."
            )
        if self.dp_shard % self.ep:
            raise DimsError(f"ep={self.ep} borrows its ranks from the dp_shard={self.dp_shard} ranks FSDP2 shards "
                            f"over, so it must divide them ({self.describe()}). Use an --ep dividing {self.dp_shard}, "
                            "or more processes.")

    @property
    def world_size(self) -> int:
        """Number of processes these degrees need."""
        return self.dp_replicate * self.dp_shard * self.cp * self.pp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches are processed side by side."""
        return self.dp_replicate * self.dp_shard

    @property
    def ranks_per_batch(self) -> int:
        """Ranks that process one micro-batch together: cp x pp x tp (each token counted once across them)."""
        return self.cp * self.pp * self.tp

    def describe(self) -> str:
        """Every factor and the product, for error messages and logs."""
        experts = f" (experts over ep={self.ep} of the dp_shard ranks)" if self.ep > 1 else ""
        return (
            f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x cp={self.cp} x pp={self.pp} x "
            f"tp={self.tp} = {self.world_size} processes{experts}"
        )

    def layout(self) -> str:
        """The degrees above 1, e.g. "dp_replicate=2 x dp_shard=4" ("1 rank" when none is)."""
        parts = [f"{n}={v}" for n, v in self.to_dict().items() if v > 1]
        return " x ".join(parts) if parts else "1 rank"

    def check_world(self, world_size: int) -> None:
        """Raise DimsError unless these degrees multiply to `world_size`."""
        if world_size != self.world_size:
            raise DimsError(
                f"The parallel degrees need {self.world_size} processes ({self.describe()}) but the world has "
                f"{world_size}. Launch with as many processes as the degrees multiply to (scripts/finetune.py "
                f"--config NAME starts the right number itself), or pass --num-processes to rescale the "
                f"data-parallel axis."
            )

    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Axis names and sizes of the DeviceMesh for these degrees, leaving out axes of size 1.

        The data-parallel axes are always kept (a 1-D mesh needs at least one axis).
        """
        axes = [("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("cp", self.cp), ("pp", self.pp),
                ("tp", self.tp)]
        kept = [(n, s) for n, s in axes if s > 1 or n == "dp_shard"]
        names, sizes = zip(*kept)
        return tuple(names), tuple(sizes)

    @staticmethod
    def placement_rule() -> str:
        """Where each axis goes on a cluster, from the mesh's own order (mesh_shape: the last axis varies fastest, so
        consecutive ranks, one node's GPUs, take it first): what the README, docs/multi-node.md and `hfdist plan`'s
        multi-node note say, in these words."""
        names, _ = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, pp=2, tp=2).mesh_shape()
        return (f"hfdist lays the ranks out as {' x '.join(names)}, {names[-1]} varying fastest, so one node's GPUs "
                f"(consecutive ranks) take {names[-1]} first, then {', then '.join(reversed(names[2:-1]))}, then dp")

    def build_mesh(self, device_type: str):
        """Build the DeviceMesh over the current process group (needs torch.distributed initialised)."""
        from torch.distributed.device_mesh import init_device_mesh

        names, sizes = self.mesh_shape()
        return init_device_mesh(device_type, sizes, mesh_dim_names=names)

    def fsdp_mesh(self, mesh):
        """The part of `mesh` FSDP2 works over: dp_shard (x cp, flattened into one shard axis "dp_shard_cp": the cp
        ranks hold the same parameters and their gradients are reduced together), under dp_replicate for HSDP."""
        import warnings

        shard = "dp_shard"
        if self.cp > 1:
            flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            if self.dp_replicate == 1:
                return flat
            shard = "dp_shard_cp"
        if self.dp_replicate == 1:
            return mesh[shard]
        with warnings.catch_warnings():  # torch 2.13 warns on slicing a flattened axis from the root mesh
            warnings.simplefilter("ignore", UserWarning)
            return mesh["dp_replicate", shard]

    def to_dict(self) -> dict[str, int]:
        """Plain dict of the degrees (for summaries and W&B configs)."""
        return asdict(self)


def batch_layout(global_batch: int, micro_batch: int | None, dp: int) -> tuple[int, int]:
    """(micro batch per rank, gradient accumulation steps) for a global batch over `dp` data-parallel ranks.

    Raises:
        DimsError: sizes the data-parallel degree does not divide, naming sizes that work.
    """
    if global_batch % dp:
        raise DimsError(f"--global-batch-size {global_batch} is not divisible by the {dp} data-parallel ranks. "
                        f"Use a multiple of {dp}.")
    micro = micro_batch or global_batch // dp
    if global_batch % (micro * dp):
        raise DimsError(f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size {micro} x "
                        f"{dp} data-parallel ranks = {micro * dp}. Pick sizes where it is.")
    return micro, global_batch // (micro * dp)
