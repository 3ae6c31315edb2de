"""Worker for tests/integration/test_chunked_loss_parallel.py:
`torchrun --nproc-per-node 4 tests/integration/chunked_loss_worker.py OUT.json`.

On 4 gloo ranks, the chunked loss (hfdist.models.chunked_loss, sequence chunks of 7 positions, not dividing the
sequence), fused (the default) and recomputing, against the plain unchunked one (fused=False, chunk_size=None) on
the same model and batch, for DDP, FSDP2 (dp_shard=4), FSDP2 x TP with sequence and loss parallelism (2 x 2, the
fsdp_tp rung's recipe; the fused loss vocab-parallel) and a 2-stage pipeline (1F1B, the dp ranks of each stage
running it alike): the loss and every local gradient. Also: FSDP2 with bf16 mixed precision, fused against
recomputing; the vocab-parallel loss alone on a vocabulary of 1001 split unevenly over 4 ranks, with a bias and
sequence-sharded hidden states, against the loss of the whole weight. Rank 0 writes the largest relative loss and
gradient (in norm) differences per case; a case that raises is recorded with its traceback.
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


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference in norm (elementwise ratios mean nothing where fp32 sums cancel to near zero)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def differences(loss, grads, ref_loss, ref_grads) -> dict:
    """The largest relative loss and gradient differences over the ranks."""
    assert len(grads) == len(ref_grads) > 0 and all(a.dtype == b.dtype for a, b in zip(grads, ref_grads))
    stats = torch.tensor([abs(loss - ref_loss) / abs(ref_loss), max(rel(a, b) for a, b in zip(grads, ref_grads))],
                         dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return {"loss_rel_diff": float(stats[0]), "grad_rel_diff": float(stats[1])}


def compare(step, reference=(None, False)) -> dict:
    """Run `step(chunk_size, fused)` (loss and backward; returns the loss and the parameters) for the reference
    (default: unchunked, not fused), then chunked and fused, then chunked and recomputing."""
    ref_loss, params = step(*reference)
    ref_grads = local_grads(params)
    out = {"loss": ref_loss, "grads": len(ref_grads)}
    for name, fused in (("fused", True), ("recomputed", False)):
        loss, params = step(CHUNK, fused)
        out[name] = differences(loss, local_grads(params), ref_loss, ref_grads)
    return out


def case_data_parallel(wrap, batch, reference=(None, False)) -> dict:
    """DDP or FSDP2 (`wrap` applies it) over the 4 ranks, each on its quarter of the batch."""
    model = wrap(build_model("llama-tiny", vocab_size=VOCAB, seed=0))
    mine = {k: v.chunk(4)[dist.get_rank()] for k, v in batch.items()}

    def step(chunk, fused):
        loss = causal_lm_loss(model, mine, chunk_size=chunk, fused=fused)
        loss.backward()
        return float(loss), list(model.parameters())
    return compare(step, reference)


def case_fsdp_tp(mesh, batch) -> dict:
    from hfdist.parallel.fsdp import apply_fsdp
    from hfdist.parallel.tensor import apply_tp

    model = build_model("llama-tiny", vocab_size=VOCAB, seed=0)
    apply_tp(model, mesh["tp"], sequence_parallel=True, loss_parallel=True)
    apply_fsdp(model, mesh["dp_shard"])
    mine = {k: v.chunk(2)[mesh["dp_shard"].get_local_rank()] for k, v in batch.items()}

    def step(chunk, fused):
        with loss_parallel():
            loss = causal_lm_loss(model, mine, chunk_size=chunk, fused=fused)
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

    def use(chunk, fused) -> None:
        runner.loss_chunk_size = chunk
        for stage in runner.stages:
            stage.fused_loss = fused

    def step(chunk, fused):
        use(chunk, fused)
        return shared(runner.step(batch["input_ids"], batch["labels"], batch["attention_mask"])), \
            list(runner.parameters())
    result = compare(step)
    scores = []  # the forward-only schedule (HfdistTrainer.batch_loss under PP): unchunked, fused chunks
    for chunk, fused in ((None, False), (CHUNK, True)):
        use(chunk, fused)
        scores.append(shared(runner.evaluate(batch["input_ids"], batch["labels"], batch["attention_mask"])))
    return {**result, "eval_rel_diff": abs(scores[1] - scores[0]) / abs(scores[0])}


def case_vocab_parallel_uneven(mesh) -> dict:
    """vocab_parallel_cross_entropy with a weight and bias of 1001 rows split 251/251/251/248 and hidden states
    sequence-sharded (Shard(1)), against fused_linear_cross_entropy of the whole weight on one rank."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from hfdist.models.fused_loss import fused_linear_cross_entropy, vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(2)
    hidden, weight, bias = torch.randn(2, 10, 16, generator=g), torch.randn(1001, 16, generator=g) * 0.3, \
        torch.randn(1001, generator=g) * 0.1
    targets = torch.randint(0, 1001, (2, 10), generator=g)
    targets[0, :3] = -100
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ref_loss = fused_linear_cross_entropy(leaves[0].flatten(0, 1), leaves[1], leaves[2], targets.flatten(), 6)
    (ref_loss / 17).backward()
    sharded = [distribute_tensor(t, mesh, [p]).detach().requires_grad_()
               for t, p in zip((hidden, weight, bias), (Shard(1), Shard(0), Shard(0)))]
    loss = vocab_parallel_cross_entropy(*sharded, targets, 6)
    (loss / 17).backward()
    assert [t.grad.placements for t in sharded] == [t.placements for t in sharded]
    return {"loss": float(ref_loss), "grads": 3, "fused": differences(
        float(loss), [t.grad.full_tensor() for t in sharded], float(ref_loss), [t.grad for t in leaves])}


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
        # bf16 compute, fp32 reduction: fused against the recomputing loss (the same bf16 products per chunk).
        "fsdp_bf16": lambda: case_data_parallel(lambda model: apply_fsdp(model, flat, param_dtype=torch.bfloat16),
                                                batch, (CHUNK, False)),
        "vocab_parallel_uneven": lambda: case_vocab_parallel_uneven(flat),
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
