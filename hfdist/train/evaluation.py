"""Evaluation on every rung: the held-out set's eval loss (the mean over its label tokens, documents kept apart as in
training) and perplexity, through the Trainer's own `evaluate` (so every callback and tracker gets them).

The Trainer's evaluation averages per-batch means over samples and gathers a sampler's padded copies; hfdist's
`evaluation_loop` adds token-loss sums and label counts instead, so the loss is the held-out set's exact token mean on
any layout. Each strategy's forward is its trainer's `score` (the model's loss; the pipeline schedule's forward-only
pass through the stages; the cp group's chunks added), asked for sums. The data-parallel ranks evaluate rows r,
r + dp, ... of the held-out blocks; the ranks that share a batch (tp, pp, cp) evaluate the same rows, and every rank
runs as many batches of one shape (padded with rows that carry no label), so the collectives inside the forward
(FSDP's and ZeRO-3's gathers, the pipeline's sends) meet.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_utils import EvalLoopOutput

from hfdist.models.registry import IGNORE_INDEX

__all__ = ["EvaluationMixin", "EvalBatches", "EvaluationSchedule"]


class EvalBatches:
    """The held-out blocks one data-parallel rank evaluates, as model-input batches of `batch_size` rows: rows
    `dp_rank`, `dp_rank + dp`, ... in order, the last batch filled up with a row that carries no label, and as many
    batches on every rank."""

    def __init__(self, dataset: Sequence[dict[str, Any]], dp_rank: int, dp: int, batch_size: int,
                 collate: Callable[[list], dict[str, Any]]) -> None:
        self.dataset, self.collate, self.batch_size = dataset, collate, batch_size
        self.rows = list(range(dp_rank, len(dataset), dp))
        self.batches = math.ceil(math.ceil(len(dataset) / dp) / batch_size)

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        first = self.dataset[0]
        filler = {**first, "labels": [IGNORE_INDEX] * len(first["labels"])}  # counts for nothing
        for b in range(self.batches):
            rows = [self.dataset[i] for i in self.rows[b * self.batch_size:(b + 1) * self.batch_size]]
            yield self.collate(rows + [filler] * (self.batch_size - len(rows)))


class EvaluationMixin:
    """Mixed in before a CausalLMLossMixin + StrategyMixin trainer: `evaluate()` scores the eval dataset on any rung.

    Metrics (prefix "eval"): `eval_loss` (token mean over the whole held-out set), `eval_perplexity` (its exp),
    `eval_tokens` (the label tokens scored).
    """

    def get_eval_dataloader(self, eval_dataset=None) -> EvalBatches:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        dims = self.rung.dims
        return EvalBatches(dataset, self.args.process_index // dims.ranks_per_batch, dims.dp,
                           self.args.per_device_eval_batch_size, self.data_collator)

    @torch.no_grad()
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """(token-loss sum of this rank's batch, None, None): its strategy's forward (`score`), in the training
        precision."""
        inputs = self._prepare_inputs(inputs)
        with self.loss_context(), self.compute_loss_context_manager():
            loss_sum = self.score(model, inputs, num_items_in_batch=1)
        return torch.tensor(loss_sum, dtype=torch.float64), None, None

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """Every batch of `dataloader` on every rank; the token-loss sums and label counts added over the world."""
        model = self.model_wrapped
        was_training = model.training
        model.eval()
        totals = torch.zeros(2, dtype=torch.float64)
        for batch in dataloader:
            loss_sum, _, _ = self.prediction_step(model, batch, prediction_loss_only=True)
            totals += torch.stack([loss_sum, (batch["labels"][:, 1:] != IGNORE_INDEX).sum().double()])
        if dist.is_available() and dist.is_initialized():
            # The ranks that share a batch hold the same sums: every data-parallel part is counted as often.
            totals = totals.to(self.args.device)
            dist.all_reduce(totals)
            totals = totals.cpu() / self.rung.dims.ranks_per_batch
        loss_sum, tokens = totals.tolist()  # hfdist.data refuses held-out data without a label token
        loss = loss_sum / tokens
        model.train(was_training)
        metrics = {f"{metric_key_prefix}_loss": loss, f"{metric_key_prefix}_perplexity": math.exp(loss),
                   f"{metric_key_prefix}_tokens": int(round(tokens))}
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics,
                              num_samples=len(dataloader.dataset))


class EvaluationSchedule(TrainerCallback):
    """When the job evaluates beyond --eval-steps: at the last step always, and (with --load-best) at every step a
    checkpoint is saved, so that each checkpoint has an eval loss to be chosen by."""

    def __init__(self, at_saves: bool = False) -> None:
        self.at_saves = at_saves

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps or (self.at_saves and control.should_save):
            control.should_evaluate = True
        return control
