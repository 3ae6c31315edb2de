"""Pipeline parallelism for HF Llama training with `torch.distributed.pipelining` schedules.

Order of use on every rank of a pipeline group (all ranks get the same batch):

    runner = PipelineRunner(model, mesh["pp"], schedule="1F1B", n_microbatches=8)
    del model                                   # frees the layers this rank does not run
    opt = torch.optim.AdamW(runner.parameters(), lr=...)
    loss = runner.step(input_ids, labels, attention_mask)   # a 0-dim tensor on the last stage's rank, else None
    runner.clip_grad_norm_(1.0)
    opt.step(); opt.zero_grad()
    save_hf_checkpoint(out_dir, skeleton, local_tensors([(s, s.original_name) for s in runner.stages]))
                                                # hfdist.checkpoint.hf_export: one tensor at a time, rank 0 writes

The loss is the single-process one: summed cross-entropy of every micro-batch divided by the number of real
label tokens of the whole batch, so micro-batching changes neither the loss nor the gradients (torch's default,
a mean of per-micro-batch means, weights micro-batches with few real tokens too much). Stage assignment, layer
balancing and micro-batch rules live in plan.py (pure), the stage module in stage.py; the bubble meter
(hfdist.metrics.bubble) times a runner through its public `pipeline_stages` and `loss_fn`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from hfdist.models.chunked_loss import DEFAULT_LOSS_CHUNK_SIZE
from hfdist.models.loss import IGNORE_INDEX, shift_labels
from hfdist.parallel.dtensors import local_tensor
from hfdist.parallel.pipeline.plan import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    PipelineConfigError,
    default_stages_per_rank,
    split_stages,
    stage_indices_for_rank,
    validate_microbatches,
)
from hfdist.parallel.pipeline.stage import (
    CausalLMStage,
    PipelineModelError,
    build_stage_module,
    find_causal_lm,
)

__all__ = ["PipelineRunner", "token_sum_loss"]


def token_sum_loss(token_loss_sum: torch.Tensor, target: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """One micro-batch's share of the batch loss: the last stage's summed token cross-entropy (it computes it
    chunk by chunk from its hidden states against `target`, passed to it as `loss_target`) over `num_tokens`,
    the number of real (not IGNORE_INDEX) shifted labels in the whole batch. Summed over micro-batches it is the
    batch mean. (`target` is what torch's schedule hands every loss function; the stage has used it already.)"""
    return token_loss_sum / num_tokens


def _stage_device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


class PipelineRunner:
    """The local pipeline stages of one rank plus a torch schedule that trains them.

    Args:
        model: a HF causal LM of a registered architecture (or a PeftModel around one), the same weights on
            every rank.
        pp_mesh: 1-D DeviceMesh over the pipeline ranks (e.g. `mesh["pp"]`); its device type picks the device.
        schedule: one of SCHEDULES: "GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble".
        n_microbatches: micro-batches per step; the batch size must be a multiple of it.
        stages_per_rank: stages per rank (default: 1, or 2 for the multi-stage schedules). Stage i runs on rank
            i % pp ("loop"), except ZBVZeroBubble's V layout: rank r runs r and 2 pp - 1 - r.
        layers_per_stage, embed_weight, head_weight: passed to `split_stages`.
        parallelize: applied to each local stage module before the schedule is built; returns that module,
            changed in place (as `fully_shard` and `parallelize_module` do): the hook for FSDP2 (on a dp mesh)
            within a stage, i.e. for 3D parallelism.
        activation_mesh: the mesh of DTensor activations that cross stage boundaries: with TP applied to the
            whole model before splitting (hfdist.parallel.tensor.apply_tp), the hidden states are DTensors on the
            tp mesh, and a receiving stage rebuilds them on this mesh. Call `step` inside `loss_parallel()` then.

    Tied embeddings (Llama-3.2-1B ties lm_head to embed_tokens) stay tied: when the first and the last stage are
    on different ranks each holds a copy, and after every step their gradients are summed between those two
    ranks, so both copies get the same update. On one rank (ZBV's V layout) the stages share the Parameter,
    which is why ZBV with a tied model refuses `parallelize`.
    """

    def __init__(
        self,
        model: nn.Module,
        pp_mesh,
        *,
        schedule: str = "1F1B",
        n_microbatches: int = 4,
        stages_per_rank: int | None = None,
        layers_per_stage: list[int] | None = None,
        embed_weight: float = 1.0,
        head_weight: float = 1.0,
        parallelize: Callable[[CausalLMStage], nn.Module] | None = None,
        activation_mesh=None,
    ):
        if pp_mesh.ndim != 1:
            raise PipelineConfigError(
                f"pp_mesh must be the 1-D pipeline sub-mesh (e.g. mesh['pp']), got a {pp_mesh.ndim}-D mesh with axes "
                f"{pp_mesh.mesh_dim_names}."
            )
        self.schedule_name = schedule
        self.pp = pp_mesh.size()
        self.pp_rank = pp_mesh.get_local_rank()
        self.pp_group = pp_mesh.get_group()
        self.stages_per_rank = stages_per_rank if stages_per_rank is not None else default_stages_per_rank(schedule)
        self.n_microbatches = n_microbatches
        validate_microbatches(schedule, n_microbatches, self.pp, self.stages_per_rank)
        self.num_stages = self.pp * self.stages_per_rank
        style = "v" if schedule == "ZBVZeroBubble" else "loop"

        _, lm = find_causal_lm(model)
        self.layer_ranges = split_stages(len(lm.model.layers), self.num_stages, embed_weight=embed_weight,
                                         head_weight=head_weight, layers_per_stage=layers_per_stage)
        self.stage_indices = stage_indices_for_rank(self.pp_rank, self.pp, self.stages_per_rank, style)
        # Read before `parallelize`: FSDP / TP replace the parameters and with them this identity.
        tied = lm.lm_head.weight is lm.model.embed_tokens.weight
        if tied and style == "v" and parallelize is not None:
            raise PipelineModelError(
                "ZBVZeroBubble puts the first and the last stage on rank 0, where they share the tied embedding "
                "Parameter; sharding each stage separately (parallelize) would split that Parameter in two. Use a "
                "loop-layout schedule (Interleaved1F1B / InterleavedZeroBubble) or an untied model."
            )
        stages = [build_stage_module(model, i, self.num_stages, self.layer_ranges[i]) for i in self.stage_indices]
        self.stages: list[nn.Module] = [parallelize(s) for s in stages] if parallelize else stages
        self.device = _stage_device(pp_mesh.device_type)
        self._activation_mesh = activation_mesh

        # Tied embeddings across ranks: the pp ranks of the first and last stage exchange that weight's gradient.
        last_rank = next(r for r in range(self.pp)
                         if self.num_stages - 1 in stage_indices_for_rank(r, self.pp, self.stages_per_rank, style))
        self.last_stage_rank = last_rank  # pp rank holding the last stage: where losses are
        self._tie_peer: int | None = None
        self._tied_param: nn.Parameter | None = None
        if tied and last_rank != 0 and self.pp_rank in (0, last_rank):
            self._tie_peer = last_rank if self.pp_rank == 0 else 0
            owner = self.stages[0] if self.pp_rank == 0 else self.stages[-1]
            self._tied_param = owner.embed_tokens.weight if self.pp_rank == 0 else owner.lm_head.weight
        self._schedule = None
        self._schedule_shape: tuple[int, int] | None = None
        # Public so that instruments (hfdist.metrics.bubble) can wrap them: torch's PipelineStage objects of the
        # current schedule, and the per-micro-batch loss the schedule calls.
        self.pipeline_stages: list = []
        self.loss_fn: Callable[..., torch.Tensor] = token_sum_loss
        self.loss_chunk_size = DEFAULT_LOSS_CHUNK_SIZE

    @property
    def loss_chunk_size(self) -> int | None:
        """Sequence positions per lm_head + cross-entropy chunk of the last stage (None: unchunked)."""
        return self._loss_chunk_size

    @loss_chunk_size.setter
    def loss_chunk_size(self, value: int | None) -> None:
        self._loss_chunk_size = value
        for stage in self.stages:
            stage.loss_chunk_size = value

    @property
    def has_first_stage(self) -> bool:
        """Whether this rank runs stage 0 (consumes input_ids)."""
        return 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank runs the last stage (computes the loss; the logging rank under PP)."""
        return self.num_stages - 1 in self.stage_indices

    def receive_buffer_bytes(self) -> int:
        """Bytes of the buffers this rank's stages receive activations and gradients into: torch allocates one per
        micro-batch at the first step and keeps them for the run (0 before it)."""
        from hfdist.torch_private import pipeline_receive_buffers

        return sum(t.numel() * t.element_size() for stage in self.pipeline_stages
                   for t in pipeline_receive_buffers(stage))

    def parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of the local stages, each once (stages on one rank may share a tied weight)."""
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name in the original model, parameter) for the local stages, each parameter once."""
        seen: set[int] = set()
        for stage in self.stages:
            for name, p in stage.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield stage.original_name(name), p

    def _build_schedule(self) -> None:
        import torch.distributed.pipelining as pipelining

        cls = getattr(pipelining, SCHEDULES[self.schedule_name])
        stages = [pipelining.PipelineStage(m, i, self.num_stages, self.device, group=self.pp_group,
                                           get_mesh=self._mesh_of_activation)
                  for i, m in zip(self.stage_indices, self.stages)]
        self.pipeline_stages = stages
        # scale_grads=False: token_sum_loss already divides by the batch's token count; torch's default would
        # divide the gradients by n_microbatches once more. The lambda reads loss_fn at call time (instruments).
        kwargs = dict(n_microbatches=self.n_microbatches, scale_grads=False,
                      loss_fn=lambda *args, **kwargs: self.loss_fn(*args, **kwargs))
        self._schedule = cls(stages, **kwargs) if self.schedule_name in MULTI_STAGE_SCHEDULES \
            else cls(stages[0], **kwargs)

    def _mesh_of_activation(self, mesh_dim_names, mesh_layout):
        """torch's lookup for the mesh of a received DTensor activation (None: not one this runner knows)."""
        mesh = self._activation_mesh
        return mesh if mesh is not None and tuple(mesh.mesh_dim_names or ()) == tuple(mesh_dim_names or ()) else None

    def step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        num_tokens: float | None = None,
        shifted: bool = False,
        row_position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Forward and backward of one batch through the pipeline; gradients accumulate into the parameters.

        Call it on every rank of the pipeline group with the same batch (B, S): input_ids feed the first stage,
        labels (IGNORE_INDEX = -100 for tokens without a loss, unshifted as for HF models) the last, and the
        attention mask / position ids every stage, split into micro-batches with the rest (a packed batch's 4-D
        block mask from hfdist.data.collate under sdpa / eager, or its position ids alone, from which each stage
        rebuilds the micro-batch's document boundaries under hfdist_documents / flash varlen, or transformers its
        BlockMask under flex). A new (B, S) rebuilds the schedule's communication buffers,
        so pad batches to a fixed length for speed.

        Args:
            num_tokens: real label tokens to normalise by; default: those of this batch. Pass the count over all
                data-parallel ranks and accumulation steps to get their exact token mean (and sum, not average,
                gradients over dp).
            shifted: the labels are shifted already (a cp rank's part of rows shifted whole before the cut).
            row_position_ids: under context parallelism, the whole rows' position ids (B, S): every stage rebuilds
                its micro-batch's document boundaries from them (the rank's own position ids are a part of each row).

        Returns:
            The batch loss (0-dim, detached) on the rank holding the last stage, None on the others.
        """
        args, kwargs = self._schedule_inputs(input_ids, labels, attention_mask, position_ids, num_tokens, shifted,
                                             row_position_ids)
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        # The tie exchange must add only this step's gradient: set earlier (accumulated) ones aside.
        earlier = self._tied_param.grad if self._tied_param is not None else None
        if self._tied_param is not None:
            self._tied_param.grad = None
        self._schedule.step(*args, losses=losses, return_outputs=False, **kwargs)
        self._exchange_tied_grad(earlier)
        return torch.stack(losses).sum().detach() if losses is not None else None

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, *, num_tokens: float | None = None, shifted: bool = False,
                 row_position_ids: torch.Tensor | None = None) -> float | None:
        """The batch's mean token loss with the current weights (its token-loss sum over `num_tokens` when given);
        same rules and ranks as `step`. Gradients and weights are left as they were.

        Returns:
            The loss on the rank holding the last stage, None on the others.
        """
        if self.schedule_name == "ZBVZeroBubble":
            # torch 2.13's ScheduleZBVZeroBubble.eval still runs its backward actions and fails ("can't
            # steal_bwd_input if this stage doesn't have backward"): score with a step, then restore the gradients.
            saved = [(p, p.grad) for p in self.parameters()]
            for p, _ in saved:
                p.grad = None
            with torch.enable_grad():
                loss = self.step(input_ids, labels, attention_mask, position_ids, num_tokens=num_tokens,
                                 shifted=shifted, row_position_ids=row_position_ids)
            for p, grad in saved:
                p.grad = grad
            return None if loss is None else float(loss)
        args, kwargs = self._schedule_inputs(input_ids, labels, attention_mask, position_ids, num_tokens, shifted,
                                             row_position_ids)
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        with torch.no_grad():
            # return_outputs=False: the last stage's outputs are its micro-batches' 0-dim loss sums, not logits.
            self._schedule.eval(*args, losses=losses, return_outputs=False, **kwargs)
        return float(torch.stack(losses).sum()) if losses is not None else None

    def last_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """The whole logits of row b at positions[b], (B, V), through the schedule's forward-only pass (what
        generation reads); same rules and ranks as `step`.

        Returns:
            The logits on the rank holding the last stage, None on the others.

        Raises:
            PipelineConfigError: a batch the micro-batches do not divide, or ZBVZeroBubble (whose forward-only pass
                torch 2.13 cannot run).
        """
        batch, seq = input_ids.shape
        if self.schedule_name == "ZBVZeroBubble":
            raise PipelineConfigError("Generation runs the pipeline's forward-only schedule, which torch 2.13 cannot "
                                      "run for ZBVZeroBubble. Use another --pp-schedule with --eval-prompts.")
        if batch % self.n_microbatches:
            raise PipelineConfigError(f"Batch size {batch} is not a multiple of n_microbatches={self.n_microbatches}.")
        if self._schedule_shape != (batch, seq, "logits"):  # other stage inputs and outputs than training's
            self._build_schedule()
            self._schedule_shape = (batch, seq, "logits")
        kwargs = {"logit_positions": positions.to(self.device)}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.to(self.device)
        if position_ids is not None:
            kwargs["position_ids"] = position_ids.to(self.device)
        args = (input_ids.to(self.device),) if self.has_first_stage else ()
        # The schedule hands the last stage's outputs to its loss function whenever it has one: a placeholder target
        # keeps it quiet (its result is not read).
        target = torch.zeros(batch, 1, device=self.device) if self.has_last_stage else None
        with torch.no_grad():
            logits = self._schedule.eval(*args, target=target, return_outputs=True,
                                         loss_kwargs={"num_tokens": 1}, **kwargs)
        return logits if self.has_last_stage else None

    def _schedule_inputs(self, input_ids, labels, attention_mask, position_ids, num_tokens, shifted=False,
                         row_position_ids=None):
        """Validate a batch and turn it into the schedule's (args, kwargs); (re)build the schedule for its shape."""
        batch, seq = input_ids.shape
        if labels.shape != input_ids.shape:
            raise PipelineConfigError(f"labels {tuple(labels.shape)} must match input_ids {tuple(input_ids.shape)}.")
        if batch % self.n_microbatches:
            raise PipelineConfigError(
                f"Batch size {batch} is not a multiple of n_microbatches={self.n_microbatches}: every micro-batch "
                f"must have the same shape. Use a batch size that n_microbatches divides."
            )
        target = labels if shifted else shift_labels(labels)
        if num_tokens is None:
            num_tokens = int((target != IGNORE_INDEX).sum())
        if self._schedule_shape != (batch, seq):
            self._build_schedule()
            self._schedule_shape = (batch, seq)
        # An all-ignored batch gives loss 0 (and no gradient) instead of 0/0.
        num_tokens = num_tokens if num_tokens > 0 else 1
        kwargs = {"target": target.to(self.device) if self.has_last_stage else None,
                  "loss_kwargs": {"num_tokens": num_tokens}}
        if self.has_last_stage:  # split into micro-batches with the other stage inputs (CausalLMStage.forward)
            kwargs["loss_target"] = kwargs["target"]
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.to(self.device)
        if position_ids is not None:
            kwargs["position_ids"] = position_ids.to(self.device)
        if row_position_ids is not None:
            kwargs["row_position_ids"] = row_position_ids.to(self.device)
        args = (input_ids.to(self.device),) if self.has_first_stage else ()
        return args, kwargs

    def _exchange_tied_grad(self, earlier: torch.Tensor | None) -> None:
        p = self._tied_param
        if p is None or not p.requires_grad:
            return
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        mine = local_tensor(p.grad)
        theirs = torch.empty_like(mine)
        ops = [dist.P2POp(dist.isend, mine, group=self.pp_group, group_peer=self._tie_peer),
               dist.P2POp(dist.irecv, theirs, group=self.pp_group, group_peer=self._tie_peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        mine.add_(theirs)
        if earlier is not None:
            p.grad.add_(earlier)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients of all stages by their global L2 norm (hfdist.parallel.grad_norm, summed over the pp
        ranks); return that norm (same on every rank). A tied weight counts once."""
        from hfdist.parallel.grad_norm import clip_grad_norm

        params = list(self.parameters())
        counted = [p for p in params if not (p is self._tied_param and not self.has_first_stage)]
        return clip_grad_norm(params, max_norm, group=self.pp_group, device=self.device, counted=counted)
