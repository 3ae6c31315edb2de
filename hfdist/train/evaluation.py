"""Evaluation on every rung: the held-out set's eval loss (the mean over its label tokens, documents kept apart as in
training) and perplexity, through the Trainer's own `evaluate` (so every callback and tracker gets them); and, when
the trainer has a `generation` (hfdist.train.generation), its prompts answered greedily after each evaluation.

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
from hfdist.train.generation import Generation, greedy_generate, write_generations

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
    `eval_tokens` (the label tokens scored). With `generation` set, each evaluation also answers its prompts.
    """

    generation: Generation | None = None

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        if self.generation is not None:
            self.generate_samples()
        return metrics

    def last_token_logits(self, batch: dict[str, Any], positions: torch.Tensor) -> torch.Tensor | None:
        """The whole logits of row b of `batch` at positions[b], (B, V), on every rank: the model's own forward
        (FSDP2 and ZeRO-3 gathering as they train), its outputs made whole over a tp / cp group
        (hfdist.parallel.whole_outputs), lm_head on those positions only. Collective."""
        from hfdist.parallel.whole_outputs import whole_outputs

        batch = self._prepare_inputs({k: v for k, v in batch.items() if k != "labels"})
        keep = torch.unique(positions)
        cut = self.rung.uses_tp or self.rung.dims.cp > 1
        hooks = whole_outputs(self.model) if cut and not getattr(self, "whole_output_hooks", None) else []
        try:
            with self.compute_loss_context_manager():
                logits = self.model_wrapped(**batch, logits_to_keep=keep.to(self.args.device)).logits
        finally:
            for hook in hooks:
                hook.remove()
        return logits[torch.arange(len(positions)), torch.searchsorted(keep, positions).to(logits.device)]

    def _generation_source(self) -> int:
        """The lowest global rank that holds the logits (every rank, but under pipeline parallelism the last
        stage's): whose greedy choice every rank follows."""
        rank = self.args.process_index
        if not self.rung.uses_pipeline:
            return 0
        holds = torch.tensor(rank if self.model.has_last_stage else self.args.world_size, device=self.args.device)
        dist.all_reduce(holds, op=dist.ReduceOp.MIN)
        return int(holds)

    def generate_samples(self) -> list[list[int]]:
        """Answer `generation`'s prompts with the model as it is now (greedy, up to its token cap); rank 0 writes
        them (hfdist.train.generation.write_generations). Collective. Returns the generated token ids."""
        gen, model = self.generation, self.model_wrapped
        config = getattr(self.model, "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        tokenizer = self.processing_class
        pad = next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None)
        dims = self.rung.dims
        was_training = model.training
        model.eval()
        try:
            completions = greedy_generate(
                self.last_token_logits, self.data_collator, gen.prompts, max_new_tokens=gen.max_new_tokens,
                eos_ids=eos_ids or {tokenizer.eos_token_id}, pad_id=pad,
                multiple=self.rung.pipeline.n_microbatches if self.rung.uses_pipeline else 1,
                round_to=dims.tp * dims.cp, source_rank=self._generation_source(), device=self.args.device)
        finally:
            model.train(was_training)
        if self.args.process_index == 0:
            write_generations(gen, self.state.global_step, completions, tokenizer)
        return completions

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
