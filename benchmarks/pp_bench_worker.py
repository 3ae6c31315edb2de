"""Worker for benchmarks/bench_pipeline.py: one measurement per launch, on 2 ranks (gloo, one thread each).

    torchrun --standalone --nproc-per-node 2 benchmarks/pp_bench_worker.py --case CASE --settings JSON --out OUT.json

Cases: "timing" (1F1B's measured bubble for each micro-batch count and every schedule's step time and bubble at one
global batch, in alternating rounds), "memory" (one schedule's per-rank memory: each schedule gets its own launch
because a process's peak RSS only ever grows) and "native" (transformers' own `DistributedConfig(pp_size=2)`: what it runs,
how fast, and what happens when one tries to train through it). Rank 0 writes OUT.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hfdist.metrics.memory import LiveTensorBytes, current_memory_bytes, peak_memory_bytes

from measure import gather

_MB = 2**20
CPU = torch.device("cpu")


@dataclass(frozen=True)
class BenchSettings:
    """The model and batch shapes every case uses (the entry point parses them; workers get them as JSON).

    Attributes:
        micro_batch: sequences per micro-batch; a step's global batch is micro_batch x its micro-batch count.
        bubble_microbatches: the micro-batch counts m of the 1F1B bubble sweep.
        microbatches: m of the schedule comparison (and the native run's global batch, micro_batch x m).
        schedules: the schedules compared; "NAME@even" splits the decoder layers evenly over the stages.
        steps, warmup, rounds: timed and untimed steps per measurement, and how many times the measurements
            rotate (the median round is reported).
    """

    layers: int = 8
    hidden: int = 256
    intermediate: int = 688
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 512
    seq: int = 128
    micro_batch: int = 2
    bubble_microbatches: tuple[int, ...] = (2, 4, 8, 16)
    microbatches: int = 8
    steps: int = 1
    warmup: int = 1
    rounds: int = 3
    seed: int = 0
    schedules: tuple[str, ...] = ("GPipe", "1F1B", "Interleaved1F1B", "Interleaved1F1B@even")

    @classmethod
    def from_json(cls, text: str) -> BenchSettings:
        """Inverse of `json.dumps(asdict(settings))` (JSON turns the tuples into lists)."""
        raw = json.loads(text)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


def make_config(s: BenchSettings):
    """An untied Llama of the benchmark's shape (untied: transformers' native PP and hfdist split it alike)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                       num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                       max_position_embeddings=max(s.seq, 128), tie_word_embeddings=False)


def make_model(s: BenchSettings):
    """The same weights on every rank and in every launch."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(s.seed)
    return LlamaForCausalLM(make_config(s))


def make_batch(s: BenchSettings, batch: int) -> torch.Tensor:
    """Random token ids (batch, seq), the same on every rank; they double as labels (every token is scored)."""
    g = torch.Generator().manual_seed(s.seed + batch)
    return torch.randint(0, s.vocab, (batch, s.seq), generator=g)


def stage_modules(index: int, num_stages: int, layers: range) -> str:
    """What hfdist's stage `index` runs, e.g. "embed_tokens + layers 0-3" (build_stage_module's layout)."""
    parts = ["embed_tokens"] if index == 0 else []
    parts.append(f"layers {layers.start}-{layers.stop - 1}")
    return " + ".join(parts + (["norm", "lm_head"] if index == num_stages - 1 else []))


def build_runner(mesh, s: BenchSettings, spec: str, m: int):
    """The runner for `spec`: a schedule name, or "NAME@even" for equal decoder-layer counts per stage instead of
    hfdist's default split (which counts the embedding and the head as one layer each)."""
    from hfdist.parallel.pipeline.plan import default_stages_per_rank
    from hfdist.parallel.pipeline.runner import PipelineRunner

    schedule, _, split = spec.partition("@")
    if split not in ("", "even"):
        raise ValueError(f"Unknown split '{split}' in '{spec}': use NAME or NAME@even.")
    layers_per_stage = None
    if split == "even":
        stages = mesh["pp"].size() * default_stages_per_rank(schedule)
        layers_per_stage = [s.layers // stages + (i < s.layers % stages) for i in range(stages)]
    return PipelineRunner(make_model(s), mesh["pp"], schedule=schedule, n_microbatches=m,
                          layers_per_stage=layers_per_stage)


def timing_case(mesh, s: BenchSettings) -> dict:
    """Every timed measurement in one process, in alternating rounds: 1F1B for each m of the sweep, then each
    schedule at s.microbatches. Other jobs on the machine slow whichever measurement they overlap; rotating spreads
    that over all of them, and each measurement reports its median round (by step time).

    Forward + backward only (no optimizer step, which costs every schedule the same); gradients keep accumulating,
    which does not change the work of a step.
    """
    from hfdist.metrics.bubble import measure_bubble

    keys = [("bubble", "1F1B", m) for m in s.bubble_microbatches]
    keys += [("schedule", spec, s.microbatches) for spec in s.schedules]
    setups = {key: (build_runner(mesh, s, key[1], key[2]), make_batch(s, s.micro_batch * key[2])) for key in keys}
    rounds: dict[tuple, list[dict]] = {key: [] for key in keys}
    for _ in range(s.rounds):
        for key, (runner, ids) in setups.items():
            rounds[key].append(measure_bubble(runner, ids, ids.clone(), steps=s.steps, warmup=s.warmup).to_dict())
    out: dict[str, list[dict]] = {"bubble": [], "schedule": []}
    for (kind, spec, m), done in rounds.items():
        median = sorted(done, key=lambda r: r["step_s"])[(len(done) - 1) // 2]
        batch = s.micro_batch * m
        out[kind].append({**median, "spec": spec, "global_batch": batch,
                          "tokens_per_s": batch * s.seq / median["step_s"],
                          "rounds_step_s": [r["step_s"] for r in done], "rounds_bubble": [r["bubble"] for r in done]})
    return out


def memory_case(mesh, s: BenchSettings, spec: str) -> dict:
    """Per-rank memory of one schedule at s.microbatches, alone in its process (a peak RSS only ever grows).

    One step allocates the gradients and the schedule's buffers; a second runs under LiveTensorBytes, so its peak is
    the activations and temporaries of a step, with the gradients accumulated in place.
    """
    batch = s.micro_batch * s.microbatches
    runner = build_runner(mesh, s, spec, s.microbatches)
    ids = make_batch(s, batch)
    rss_before = current_memory_bytes(CPU)
    runner.step(ids, ids.clone())
    tracker = LiveTensorBytes()
    with tracker:
        runner.step(ids, ids.clone())
    ranks = gather({"rss_before_steps_mb": rss_before / _MB, "peak_rss_mb": peak_memory_bytes(CPU) / _MB,
                    "peak_step_tensors_mb": tracker.peak / _MB,
                    "param_mb": sum(p.numel() * p.element_size() for p in runner.parameters()) / _MB,
                    "modules": [stage_modules(i, runner.num_stages, runner.layer_ranges[i])
                                for i in runner.stage_indices]})
    return {"spec": spec, "global_batch": batch, "ranks": ranks}


def _native_forward(model, ids: torch.Tensor, s: BenchSettings) -> dict:
    """Time no-grad forwards of the whole batch. A rank is idle while it waits in the stage's receive or in the
    logits broadcast (both also carry the transfer, which a CPU run cannot separate from waiting)."""
    from hfdist.metrics.bubble import timed

    stage = model._pp_stage
    with torch.no_grad():
        for _ in range(s.warmup):
            model(input_ids=ids)
        wait = [0.0]
        stage.communicate = timed(stage.communicate, wait)
        stage.broadcast_from_last = timed(stage.broadcast_from_last, wait)
        wall, calls = 0.0, s.rounds * s.steps
        for _ in range(calls):
            dist.barrier()
            start = time.perf_counter()
            model(input_ids=ids)
            wall += time.perf_counter() - start
        del stage.communicate, stage.broadcast_from_last  # the class methods are visible again
        tracker = LiveTensorBytes()
        with tracker:
            model(input_ids=ids)
    return {"wall_s": wall / calls, "wait_s": wait[0] / calls, "peak_step_tensors_mb": tracker.peak / _MB}


def _native_train_attempt(model, ids: torch.Tensor) -> dict:
    """What a user gets when training through the split: the loss for `labels`, then the token cross-entropy of the
    returned logits and its backward. Errors and warnings are recorded verbatim."""
    import torch.nn.functional as F

    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = model(input_ids=ids, labels=ids)
        out["loss_from_labels"] = None if result.loss is None else float(result.loss)
        out["logits_shape"] = list(result.logits.shape)
        out["logits_requires_grad"] = result.logits.requires_grad
        loss = F.cross_entropy(result.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        try:
            loss.backward()
            out["backward"] = "ok"
        except Exception as exc:  # the point of the case: report the exact error
            out["backward"] = f"{type(exc).__name__}: {exc}"
    out["warnings"] = sorted({str(w.message).split(". ")[0] for w in caught})
    params = list(model.parameters())
    out["params_with_grad"] = sum(p.grad is not None for p in params)
    out["params"] = len(params)
    return out


def native_modules(model) -> str:
    """What this rank runs under transformers' split, in the same words as `stage_modules` (transformers swaps the
    modules of other ranks for PipelineIdentityLayer)."""
    def real(module) -> bool:
        return type(module).__name__ != "PipelineIdentityLayer"

    layers = [i for i, layer in enumerate(model.model.layers) if real(layer)]
    parts = ["embed_tokens"] if real(model.model.embed_tokens) else []
    parts.append(f"layers {layers[0]}-{layers[-1]}")
    return " + ".join(parts + [n for n, m in (("norm", model.model.norm), ("lm_head", model.lm_head)) if real(m)])


def native_case(s: BenchSettings, checkpoint: Path) -> dict:
    """transformers' `DistributedConfig(pp_size=2)` on the same model and global batch as the schedule case."""
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    if dist.get_rank() == 0:
        make_model(s).save_pretrained(checkpoint)
    dist.barrier()
    rss_before = current_memory_bytes(CPU)
    model = LlamaForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(pp_size=2))
    batch = s.micro_batch * s.microbatches
    ids = make_batch(s, batch)
    forward = _native_forward(model, ids, s)
    attempt = _native_train_attempt(model, ids)
    ranks = gather({"modules": native_modules(model), "rss_before_load_mb": rss_before / _MB,
                    "peak_rss_mb": peak_memory_bytes(CPU) / _MB, **forward, "train_attempt": attempt})
    step_s = max(r["wall_s"] for r in ranks)
    return {"global_batch": batch, "step_s": step_s, "forward_tokens_per_s": batch * s.seq / step_s,
            "bubble": sum(1 - (r["wall_s"] - r["wait_s"]) / step_s for r in ranks) / len(ranks), "ranks": ranks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--case", choices=("timing", "memory", "native"), required=True)
    p.add_argument("--schedule", default="1F1B")
    p.add_argument("--settings", required=True, help="BenchSettings as JSON")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--checkpoint", type=Path, help="native case: where rank 0 saves the model for from_pretrained")
    args = p.parse_args()
    s = BenchSettings.from_json(args.settings)
    torch.set_num_threads(1)  # two ranks share two cores
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    result: dict = {"case": args.case, "load_avg_start": os.getloadavg()}
    try:
        if args.case == "native":
            result["row"] = native_case(s, args.checkpoint)
        else:
            from hfdist.config.dims import ParallelDims

            mesh = ParallelDims(pp=2).build_mesh("cpu")
            result["row"] = timing_case(mesh, s) if args.case == "timing" else memory_case(mesh, s, args.schedule)
    except Exception as exc:  # recorded for the report; the entry point shows it
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["trace"] = traceback.format_exc()[-3000:]
    result["load_avg_end"] = os.getloadavg()
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
