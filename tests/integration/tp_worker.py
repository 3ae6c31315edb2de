"""Worker for tests/integration/test_tensor_parallel.py:
`torchrun --nproc-per-node 4 tests/integration/tp_worker.py OUT.json`.

One launch of 4 ranks on a (dp_shard=2, tp=2) mesh runs every multi-rank tensor-parallel case, so the suite pays the
process start-up once: TP=2 alone (on the tp sub-mesh; both dp groups run it), TP=2 with LoRA, FSDP2 x TP = 2 x 2
(with and without LoRA), Qwen2 and Qwen3 under TP, collective counts, per-rank bytes, checkpoint round trips. Rank 0 trains the
single-process references and shares them, and writes the measurements to OUT.json; the test asserts on them. A
case that raises is recorded with its traceback instead of aborting the launch.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hfdist.models.build import build_model
from hfdist.models.loss import count_loss_tokens
from hfdist.models.presets import load_config
from hfdist.models.registry import LORA_TARGETS
from hfdist.parallel.tensor import (
    TPError,
    apply_tp,
    count_tp_collectives,
    gather_full_state_dict,
    tp_causal_lm_loss,
)

VOCAB, SEQ, LR, MAX_NORM, STEPS = 1024, 16, 1e-3, 0.5, 3
WORLD = 4
# 4 ranks need 4 GPUs (NCCL allows one rank per device); with fewer the test runs on CPU/gloo.
DEVICE = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= WORLD else "cpu"


def make_batch() -> dict[str, torch.Tensor]:
    """A global batch of 4 sequences: right and left padding, prompt tokens masked with -100."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, SEQ - 5:] = 0
    mask[2, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :4] = -100
    return {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE), "labels": labels.to(DEVICE)}


def split(batch: dict[str, torch.Tensor], parts: int, index: int) -> dict[str, torch.Tensor]:
    return {k: v.chunk(parts)[index] for k, v in batch.items()}


def make_model(lora: bool = False, tied: bool = False, biases: bool = False):
    """llama-tiny; `tied`: tied embeddings; `biases`: every linear of the layers with a (non-zero) bias, so a
    row-split linear's bias added on every rank instead of once after the sum shows from the first step."""
    if not (tied or biases):
        model = build_model("llama-tiny", vocab_size=VOCAB, seed=0)
    else:
        from transformers import AutoModelForCausalLM

        config = load_config("llama-tiny", VOCAB)
        config.tie_word_embeddings = tied
        config.attention_bias = config.mlp_bias = biases
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                torch.nn.init.normal_(p, std=0.1)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(LORA_TARGETS)))
        # peft starts lora_B at zero, which would leave lora_A without gradient on the first step.
        torch.manual_seed(2)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
    return model.to(DEVICE)


def full(t: torch.Tensor) -> torch.Tensor:
    """A copy of the global value of a (possibly sharded or partial) tensor; a collective for DTensors."""
    # full_tensor() of a Replicate DTensor is its local tensor, not a copy: clipping would scale it in place.
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b|: one number per tensor, insensitive to entries near zero."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def train(model, micro_batches: list[dict], dp_group=None, dp: int = 1, foreach: bool | None = None) -> dict:
    """STEPS AdamW steps with grad clipping; each step accumulates `micro_batches` normalised by their global count.

    Returns per-step losses and grad norms, the first step's (pre-clipping) gradients and the final parameters, all
    as full tensors. `dp`: the data-parallel degree whose gradient averaging the loss scale undoes.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=foreach)
    n_items = torch.tensor(float(sum(count_loss_tokens(b["labels"]) for b in micro_batches)), device=DEVICE)
    if dp_group is not None:
        dist.all_reduce(n_items, group=dp_group)
    losses, norms, first_grads = [], [], {}
    for step in range(STEPS):
        opt.zero_grad()
        step_loss = torch.zeros((), device=DEVICE)
        for mb in micro_batches:
            with loss_parallel():
                loss = tp_causal_lm_loss(model, mb, n_items)
                (loss * dp).backward()
            step_loss += loss.detach()
        if dp_group is not None:
            dist.all_reduce(step_loss, group=dp_group)
        if step == 0:
            first_grads = {n: full(p.grad) for n, p in model.named_parameters() if p.requires_grad}
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=foreach)
        opt.step()
        losses.append(float(step_loss))
        norms.append(float(full(norm)))
    final = {n: full(p.detach()) for n, p in model.named_parameters() if p.requires_grad}
    return {"losses": losses, "norms": norms, "grads": first_grads, "params": final}


def compare(run: dict, ref: dict) -> dict:
    """Worst relative errors of a distributed run against the single-process reference."""
    assert run["grads"].keys() == ref["grads"].keys(), sorted(set(run["grads"]) ^ set(ref["grads"]))
    return {
        "losses": run["losses"], "ref_losses": ref["losses"], "norms": run["norms"],
        "loss_rel_err": max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"])),
        "norm_rel_err": max(abs(a - b) / abs(b) for a, b in zip(run["norms"], ref["norms"])),
        "grad_rel_err": max((rel_err(run["grads"][n], g), n) for n, g in ref["grads"].items()),
        "param_abs_err": max(float((run["params"][n] - p).abs().max()) for n, p in ref["params"].items()),
        "n_tensors": len(ref["grads"]),
    }


def linear_bytes(model) -> dict:
    """Local vs full bytes of every sharded linear / embedding weight (this rank)."""
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements):
            local = p.to_local()
            out[name] = [local.numel() * local.element_size(), p.numel() * p.element_size()]
    return out


def case_tp(mesh, batch, refs: dict) -> dict:
    """TP=2 with and without sequence parallel: 2 micro-batches (gradient accumulation) per step."""
    out = {}
    micro = [split(batch, 2, 0), split(batch, 2, 1)]
    for sp in (True, False):
        model = apply_tp(make_model(), mesh["tp"], sequence_parallel=sp)
        out[f"sp={sp}"] = compare(train(model, micro), refs["base"])
        if sp:
            out["bytes"] = linear_bytes(model)
    return out


def case_architectures(mesh, batch) -> dict:
    """Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms, whose replicated weights get tp-partial gradients) under
    TP=2 with sequence parallel, 2 accumulated micro-batches per step, against one process; then Llama with a bias
    on every linear (row-split o/down biases are added after the reduce-scatter), with and without LoRA."""
    out = {}
    micro = [split(batch, 2, 0), split(batch, 2, 1)]
    for preset in ("qwen2-tiny", "qwen3-tiny"):
        ref = train(build_model(preset, vocab_size=VOCAB, seed=0).to(DEVICE), [batch])
        model = apply_tp(build_model(preset, vocab_size=VOCAB, seed=0).to(DEVICE), mesh["tp"])
        out[preset] = compare(train(model, micro), ref)
    # With LoRA only the adapters train and their gradients here are small: fp32 rounding alone reached 1.5e-5 of
    # the largest entry (k_proj's lora_B, measured), fp64 brings it to 9e-8; a bias added on every rank would not
    # shrink with the precision. (The loss upcasts to fp32 either way.)
    for name, lora, dtype in (("llama-biases", False, torch.float32), ("llama-biases-lora", True, torch.float64)):
        ref = train(make_model(lora=lora, biases=True).to(dtype), [batch])
        out[name] = compare(train(apply_tp(make_model(lora=lora, biases=True).to(dtype), mesh["tp"]), micro), ref)
    return out


def case_lora(mesh, batch, refs: dict, path: str) -> dict:
    """TP=2 + LoRA on all seven linears, with and without sequence parallel; then the adapter is gathered, saved
    (rank 0) and loaded both into one process and under TP."""
    from peft import PeftModel

    out = {}
    for sp in (False, True):  # the sequence-parallel model is kept for the round trip
        model = apply_tp(make_model(lora=True), mesh["tp"], sequence_parallel=sp)
        out[f"sp={sp}"] = compare(train(model, [batch]), refs["lora"])
    out["frozen_have_grad"] = any(p.grad is not None for p in model.parameters() if not p.requires_grad)
    adapter = gather_full_state_dict(model, trainable_only=True)
    if dist.get_rank() == 0:
        model.save_pretrained(path, state_dict=adapter)
        out["adapter_keys"] = len(adapter)
    dist.barrier()
    loaded = PeftModel.from_pretrained(make_model(), path).to(DEVICE)
    with torch.no_grad():
        out["loaded_single_loss"] = tp_causal_lm_loss(loaded, batch).item()
        apply_tp(loaded, mesh["tp"])
        with loss_parallel():
            out["loaded_tp_loss"] = tp_causal_lm_loss(loaded, batch).item()
            out["trained_tp_loss"] = tp_causal_lm_loss(model, batch).item()
    return out


def fully_shard_layers(model, mesh) -> None:
    """FSDP2 per decoder layer + root, as hfdist.parallel.fsdp.apply_fsdp does (kept local: this tests TP)."""
    from torch.distributed.fsdp import fully_shard
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    for layer in [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def case_fsdp_tp(mesh, batch, refs: dict, path: str) -> dict:
    """FSDP2 over dp_shard x TP over tp (2 x 2), each dp rank with half the batch, with and without LoRA; then the
    full model's HF checkpoint round trip."""
    from transformers import AutoModelForCausalLM

    out = {}
    dp_rank = mesh["dp_shard"].get_local_rank()
    half = split(batch, 2, dp_rank)
    for lora in (True, False):  # the model without LoRA is kept for the checkpoint
        model = apply_tp(make_model(lora=lora), mesh["tp"])
        fully_shard_layers(model, mesh["dp_shard"])
        run = train(model, [half], dp_group=mesh["dp_shard"].get_group(), dp=2)
        out["lora" if lora else "base"] = compare(run, refs["lora" if lora else "base"])
    out["bytes"] = linear_bytes(model)
    out["placements"] = sorted({str(p.placements) for p in model.parameters()})
    state = gather_full_state_dict(model)
    with torch.no_grad(), loss_parallel():
        trained_loss = tp_causal_lm_loss(model, half).item()
    if dist.get_rank() == 0:
        out["state_abs_err"] = max(float((state[n] - p).abs().max()) for n, p in refs["base"]["params"].items())
        out["state_keys"] = sorted(state) == sorted(make_model().state_dict())
        model.save_pretrained(path, state_dict=state)
        reloaded = AutoModelForCausalLM.from_pretrained(path).to(DEVICE)
        with torch.no_grad():
            out["reloaded_loss"] = tp_causal_lm_loss(reloaded, half).item()  # rank 0 is dp rank 0
        out["trained_loss_dp0"] = trained_loss
    return out


def case_counts(mesh, batch) -> dict:
    """Collectives of one forward + backward, per decoder layer and in total, with and without sequence parallel,
    with the fused loss and with loss_parallel(); the shape of each rank's logits (vocab-sharded)."""
    out = {}
    for sp in (True, False):
        for fused in (True, False):
            model = apply_tp(make_model(), mesh["tp"], sequence_parallel=sp)
            out[f"sp={sp},fused={fused}"] = count_tp_collectives(model, batch, fused=fused)
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], use_cache=False).logits
        out[f"sp={sp},fused=False"]["local_logits_shape"] = list(logits.to_local().shape)
    out["layers"] = len(model.model.layers)
    return out


def case_variants(mesh, batch) -> dict:
    """One forward + backward against the reference for: tied embeddings (vocab-parallel embedding), gathered
    logits (loss_parallel=False), a sequence length tp does not divide; and the missing-loss_parallel() error."""
    out = {}
    odd = {k: v[:, :SEQ - 1] for k, v in batch.items()}
    variants = (("tied", True, {}, batch), ("no_loss_parallel", False, {"loss_parallel": False}, batch),
                ("odd_seq_len", False, {}, odd))
    for name, tied, kwargs, data in variants:
        ref = make_model(tied=tied)
        ref_loss = tp_causal_lm_loss(ref, data)
        ref_loss.backward()
        model = apply_tp(make_model(tied=tied), mesh["tp"], **kwargs)
        with loss_parallel() if kwargs.get("loss_parallel", True) else nullcontext():
            loss = tp_causal_lm_loss(model, data)
            loss.backward()
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        out[name] = {
            "loss_rel_err": abs(loss.item() - ref_loss.item()) / ref_loss.item(),
            "grad_rel_err": max(rel_err(grads[n], p.grad) for n, p in ref.named_parameters()),
            "still_tied": model.lm_head.weight is model.model.embed_tokens.weight,
        }
    try:
        tp_causal_lm_loss(model, batch, fused=False)  # the fused loss needs no loss_parallel(); the other does
        out["missing_loss_parallel"] = "no error"
    except TPError as exc:
        out["missing_loss_parallel"] = str(exc)
    return out


def main(out_path: str) -> None:
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    if DEVICE == "cuda":
        torch.cuda.set_device(dist.get_rank())
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(DEVICE, (2, 2), mesh_dim_names=("dp_shard", "tp"))
    batch = make_batch()
    results: dict = {"world": dist.get_world_size(), "timings": {}}
    t0 = time.perf_counter()
    # Rank 0 trains the single-process references (the others would only repeat it) and shares them.
    refs = [{"base": train(make_model(), [batch]), "lora": train(make_model(lora=True), [batch])}
            if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(refs, src=0)
    refs = refs[0]
    results["timings"]["reference"] = time.perf_counter() - t0
    results["max_norm"] = MAX_NORM
    tmp = str(Path(out_path).parent)  # rank 0 writes the checkpoints there, all ranks read them
    cases = {
        "tp": lambda: case_tp(mesh, batch, refs),
        "architectures": lambda: case_architectures(mesh, batch),
        "lora": lambda: case_lora(mesh, batch, refs, f"{tmp}/adapter"),
        "fsdp_tp": lambda: case_fsdp_tp(mesh, batch, refs, f"{tmp}/full"),
        "counts": lambda: case_counts(mesh, batch),
        "variants": lambda: case_variants(mesh, batch),
    }
    for name, case in cases.items():
        t0 = time.perf_counter()
        try:
            results[name] = case()
        except Exception:  # recorded, so one broken case does not hide the others' results
            results[name] = {"error": traceback.format_exc()}
        results["timings"][name] = time.perf_counter() - t0
        dist.barrier()
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {k: results[k].get("bytes") for k in ("tp", "fsdp_tp")})
    if dist.get_rank() == 0:
        results["bytes_per_rank"] = per_rank
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # The results are written and the group destroyed; gloo's threads can still abort interpreter teardown
    # (SIGABRT, "terminate called without an active exception"), so leave without it (as scripts/finetune.py does).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
