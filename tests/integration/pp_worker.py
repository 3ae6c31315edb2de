"""Worker for tests/integration/test_pipeline.py:
`torchrun --nproc-per-node 2 tests/integration/pp_worker.py OUT.json [--bubble]`.

One launch runs every pipeline case (schedule x tied/untied, LoRA, FSDP inside the stages) so the suite pays the
process start-up once. Rank 0 also trains the single-process reference and writes everything to OUT.json; the
test compares. Cases that raise are recorded with their error instead of aborting the launch.
`--bubble` instead measures the 1F1B bubble on a larger model for the benchmark (~40 s; not run by the tests).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

VOCAB, LR = 256, 1e-2


def max_norm(lora: bool) -> float:
    """Clip threshold below some of the steps' gradient norms, so clipping really acts (LoRA grads are small)."""
    return 0.2 if lora else 1.0


def make_config(tied: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tied)


def make_model(tied: bool, lora: bool):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(make_config(tied))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    return model


def make_batches() -> list[dict[str, torch.Tensor]]:
    """Three batches of 8: right and left padding, prompt tokens masked with -100; the last one is shorter."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for seq in (16, 16, 12):
        ids = torch.randint(0, VOCAB, (8, seq), generator=g)
        mask = torch.ones_like(ids)
        mask[1, seq - 5:] = 0
        mask[2, :3] = 0
        mask[6, seq // 2:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[3, :6] = -100
        labels[7, :] = -100  # a micro-batch row with no real token at all
        batches.append(dict(input_ids=ids, attention_mask=mask, labels=labels))
    return batches


def eval_loss(model, batch) -> float:
    with torch.no_grad():
        return float(model(**batch).loss)


def reference(tied: bool, lora: bool, batches) -> dict:
    model = make_model(tied, lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, norms = [], []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                          max_norm(lora))))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return dict(losses=losses, norms=norms, max_norm=max_norm(lora), final_loss=eval_loss(model, batches[0]))


def reload_loss(state: dict, tied: bool, lora: bool, batch) -> float:
    """Load the saved state into a fresh model, round-trip it through save/from_pretrained, score `batch`."""
    from transformers import LlamaForCausalLM

    fresh = make_model(tied, lora)
    fresh.load_state_dict(state, strict=True)
    if lora:
        return eval_loss(fresh, batch)
    with tempfile.TemporaryDirectory() as tmp:
        fresh.save_pretrained(tmp)
        return eval_loss(LlamaForCausalLM.from_pretrained(tmp), batch)


def saved_state(runner, tied: bool, lora: bool) -> dict | None:
    """Every stage's weights as the streamed HF checkpoint holds them (hfdist.checkpoint.hf_export; collective), read back
    on rank 0; None on the other ranks."""
    import shutil

    from safetensors.torch import load_file

    from hfdist.checkpoint.hf_export import save_hf_checkpoint
    from hfdist.models.load import local_tensors

    folder = tempfile.mkdtemp() if dist.get_rank() == 0 else "unused"  # only rank 0 writes
    save_hf_checkpoint(folder, make_model(tied, lora), local_tensors([(s, s.original_name) for s in runner.stages]))
    if dist.get_rank() != 0:
        return None
    state = load_file(os.path.join(folder, "model.safetensors"))
    shutil.rmtree(folder)
    if tied and "lm_head.weight" not in state:  # written once, as save_pretrained does
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def fsdp_parallelize(dp_mesh):
    from torch.distributed.fsdp import fully_shard

    def parallelize(stage):
        for layer in stage.decoder_layers:
            fully_shard(layer, mesh=dp_mesh)
        return fully_shard(stage, mesh=dp_mesh)
    return parallelize


def run_case(mesh, schedule: str, batches, *, tied: bool = False, lora: bool = False, fsdp: bool = False,
             accum: bool = False) -> dict:
    """Train 3 steps through the pipeline. `accum`: two step() calls per optimizer step (half batches each),
    normalised by the whole batch's token count, which must equal one step over the whole batch."""
    from hfdist.models.loss import shift_labels
    from hfdist.parallel.pipeline.runner import PipelineRunner

    model = make_model(tied, lora)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    runner = PipelineRunner(model, mesh["pp"], schedule=schedule, n_microbatches=4,
                            parallelize=fsdp_parallelize(mesh["dp_shard"]) if fsdp else None)
    # The last stage's loss in sequence chunks of 5 (not dividing 16 or 12), against HF's unchunked reference.
    runner.loss_chunk_size = 5
    del model
    opt = torch.optim.AdamW([p for p in runner.parameters() if p.requires_grad], lr=LR)
    losses, norms, receive_bytes = [], [], []
    grad_types: set[str] = set()
    for batch in batches:
        if accum:
            total = int((shift_labels(batch["labels"]) != -100).sum())
            parts = [runner.step(batch["input_ids"][h], batch["labels"][h], batch["attention_mask"][h],
                                 num_tokens=total) for h in (slice(0, 4), slice(4, 8))]
            loss = None if parts[0] is None else parts[0] + parts[1]
        else:
            loss = runner.step(batch["input_ids"], batch["labels"], batch["attention_mask"])
        grad_types |= {type(p.grad).__name__ for p in runner.parameters() if p.grad is not None}
        receive_bytes.append(runner.receive_buffer_bytes())
        norms.append(float(runner.clip_grad_norm_(max_norm(lora))))
        opt.step()
        opt.zero_grad()
        # The loss lives on the last stage's rank; share it so rank 0 can report it.
        shared = loss.clone() if loss is not None else torch.zeros(())
        dist.all_reduce(shared, group=runner.pp_group)
        losses.append(float(shared))
    state = saved_state(runner, tied, lora)
    out = dict(losses=losses, norms=norms, grad_types=sorted(grad_types), stages=runner.stage_indices,
               receive_bytes=receive_bytes)
    if state is not None:
        out["final_loss"] = reload_loss(state, tied, lora, batches[0])
        if lora:
            changed = {k for k in state if not torch.equal(state[k], initial[k])}
            out["lora_changed"] = sum("lora_" in k for k in changed)
            out["lora_total"] = sum("lora_" in k for k in state)
            out["base_changed"] = sum("lora_" not in k for k in changed)
    return out


def bubble_cases(mesh, full: bool) -> list[dict]:
    """Bubble of GPipe (m = 1) and 1F1B for several micro-batch counts m. `full`: a model big enough that compute
    dominates (the benchmark numbers, ~40 s); otherwise the tiny model, only to exercise the helper."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hfdist.metrics.bubble import measure_bubble
    from hfdist.parallel.pipeline.runner import PipelineRunner

    if full:
        torch.set_num_threads(1)
        cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    else:
        cfg = make_config(tied=False)
    seq, counts, steps = (128, (1, 2, 4, 8), 3) if full else (16, (1, 4), 1)
    results = []
    g = torch.Generator().manual_seed(0)
    for m in counts:
        torch.manual_seed(0)
        runner = PipelineRunner(LlamaForCausalLM(cfg), mesh["pp"], schedule="GPipe" if m < 2 else "1F1B",
                                n_microbatches=m)
        ids = torch.randint(0, cfg.vocab_size, (2 * m, seq), generator=g)  # micro-batch size 2 throughout
        results.append(measure_bubble(runner, ids, ids.clone(), steps=steps).to_dict())
    return results


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    from hfdist.config.dims import ParallelDims

    mesh = ParallelDims(pp=2).build_mesh("cpu")  # axes (dp_shard=1, pp=2)
    rank = dist.get_rank()
    result: dict = {"refs": {}, "runs": {}}
    if "--bubble" in sys.argv:
        result["bubble"] = bubble_cases(mesh, full=True)
    else:
        result["bubble"] = bubble_cases(mesh, full=False)
        batches = make_batches()
        if rank == 0:
            for name, tied, lora in (("untied", False, False), ("tied", True, False), ("lora", False, True)):
                result["refs"][name] = reference(tied, lora, batches)
        cases = [(f"{s}/{'tied' if tied else 'untied'}", s, dict(tied=tied)) for tied in (False, True)
                 for s in ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")]
        cases += [("1F1B/lora", "1F1B", dict(lora=True)), ("1F1B/untied/fsdp", "1F1B", dict(fsdp=True)),
                  ("Interleaved1F1B/tied/fsdp", "Interleaved1F1B", dict(tied=True, fsdp=True)),
                  ("1F1B/tied/accum", "1F1B", dict(tied=True, accum=True))]
        for name, schedule, options in cases:
            try:
                result["runs"][name] = run_case(mesh, schedule, batches, **options)
            except Exception as exc:  # recorded for the test to report; a hang is cut by the pg timeout
                result["runs"][name] = {"error": f"{type(exc).__name__}: {exc}"[:2000],
                                        "trace": traceback.format_exc()[-3000:]}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    # Both ranks leave together: gloo aborts a process whose peer tears the group down under it.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The results are written and the group destroyed; gloo's threads can still abort interpreter teardown
    # (SIGABRT, "terminate called without an active exception"), so leave without it (as scripts/finetune.py does).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
