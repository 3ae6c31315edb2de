"""Worker for tests/integration/test_chunked_loss_parallel.py:
`torchrun --nproc-per-node 4 tests/integration/chunked_loss_worker.py OUT.json`.

On 4 gloo ranks, the chunked loss (hfdist.models.chunked_loss, sequence chunks of 7 positions, not dividing the
sequence) against the unchunked one (chunk_size=None) on the same model and batch, for DDP, FSDP2 (dp_shard=4),
FSDP2 x TP with sequence and loss parallelism (2 x 2, the fsdp_tp rung's recipe) and a 2-stage pipeline (1F1B,
the dp ranks of each stage running it alike): the loss and every local gradient. Rank 0 writes the largest
relative loss difference and gradient difference per case; a case that raises is recorded with its traceback.
"""

from __future__ import annotations

import json
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hfdist.models.build import build_model
from hfdist.models.chunked_loss import causal_lm_loss

VOCAB, SEQ, CHUNK = 32768, 24, 7


def make_batch() -> dict[str, torch.Tensor]:
    """4 sequences (the same on every rank): two right-padded, prompt tokens of the first masked with -100."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    lengths = torch.tensor([[SEQ], [SEQ - 5], [SEQ], [SEQ - 9]])
    mask = (torch.arange(SEQ) < lengths).long()
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :4] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def local_grads(params) -> list[torch.Tensor]:
    out = []
    for p in params:
        if p.grad is not None:
            g = p.grad
            out.append((g.to_local() if isinstance(g, DTensor) else g).clone())
            p.grad = None
    return out


def compare(step) -> dict:
    """Run `step(chunk_size)` (loss and backward; returns the loss and the parameters) unchunked, then chunked."""
    loss_whole, params = step(None)
    grads_whole = local_grads(params)
    loss_chunked, params = step(CHUNK)
    grads_chunked = local_grads(params)
    assert len(grads_whole) == len(grads_chunked) > 0
    grad_diff = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                    for a, b in zip(grads_chunked, grads_whole))
    loss_diff = abs(loss_chunked - loss_whole) / abs(loss_whole)
    stats = torch.tensor([loss_diff, grad_diff], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return {"loss": loss_whole, "loss_rel_diff": float(stats[0]), "grad_rel_diff": float(stats[1]),
            "grads": len(grads_whole)}


def case_data_parallel(wrap, batch) -> dict:
    """DDP or FSDP2 (`wrap` applies it) over the 4 ranks, each on its quarter of the batch."""
    model = wrap(build_model("llama-tiny", vocab_size=VOCAB, seed=0))
    mine = {k: v.chunk(4)[dist.get_rank()] for k, v in batch.items()}

    def step(chunk):
        loss = causal_lm_loss(model, mine, chunk_size=chunk)
        loss.backward()
        return float(loss), list(model.parameters())
    return compare(step)


def case_fsdp_tp(mesh, batch) -> dict:
    from hfdist.parallel.fsdp import apply_fsdp
    from hfdist.parallel.tensor import apply_tp, tp_causal_lm_loss

    model = build_model("llama-tiny", vocab_size=VOCAB, seed=0)
    apply_tp(model, mesh["tp"], sequence_parallel=True, loss_parallel=True)
    apply_fsdp(model, mesh["dp_shard"])
    mine = {k: v.chunk(2)[mesh["dp_shard"].get_local_rank()] for k, v in batch.items()}

    def step(chunk):
        with loss_parallel():
            loss = tp_causal_lm_loss(model, mine, chunk_size=chunk)
            loss.backward()
        return float(loss), list(model.parameters())
    return compare(step)


def case_pp(mesh, batch) -> dict:
    from hfdist.parallel.pipeline.runner import PipelineRunner

    runner = PipelineRunner(build_model("llama-tiny", vocab_size=VOCAB, seed=0), mesh["pp"], schedule="1F1B",
                            n_microbatches=2)

    def shared(value) -> float:
        """The last stage's loss, on every rank of the pipeline."""
        box = [None if value is None else float(value)]
        dist.broadcast_object_list(box, group=runner.pp_group, group_src=runner.last_stage_rank)
        return box[0]

    def step(chunk):
        runner.loss_chunk_size = chunk
        return shared(runner.step(batch["input_ids"], batch["labels"], batch["attention_mask"])), \
            list(runner.parameters())
    result = compare(step)
    scores = []  # the forward-only schedule (HfdistTrainer.batch_loss under PP) with and without chunks
    for chunk in (None, CHUNK):
        runner.loss_chunk_size = chunk
        scores.append(shared(runner.evaluate(batch["input_ids"], batch["labels"], batch["attention_mask"])))
    return {**result, "eval_rel_diff": abs(scores[1] - scores[0]) / abs(scores[0])}


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from hfdist.parallel.fsdp import apply_fsdp

    batch = make_batch()
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    cases = {
        "ddp": lambda: case_data_parallel(DistributedDataParallel, batch),
        "fsdp": lambda: case_data_parallel(lambda model: apply_fsdp(model, flat), batch),
        "fsdp_tp": lambda: case_fsdp_tp(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp")), batch),
        "pp": lambda: case_pp(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp")), batch),
    }
    results: dict = {}
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception:  # recorded, so one broken case does not hide the others' results
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
