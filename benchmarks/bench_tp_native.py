"""Benchmark hfdist's tensor parallelism against transformers' native TP: same model, batches, optimizer and world.

    python benchmarks/bench_tp_native.py        # llama-small, TP=2, writes results/<hardware>/tp_vs_native.{json,md}
    python benchmarks/bench_tp_native.py --preset llama-tiny --steps 2 --out /tmp/tp_native   # a quick check

The preset is built once (seed 0) and saved with save_pretrained; the packed embedded default data gives one global
batch per step, saved once. Four runs then load both, each in processes of its own (peak RSS cannot be reset
within a process), with OMP_NUM_THREADS=--threads per rank, --repeats times in alternating rounds (each round runs
every variant once, odd rounds in reverse order, so a load change on a shared machine hits all variants alike):
- reference: one process, no parallelism;
- hfdist TP with and without sequence parallel (`apply_tp`, loss parallel on): torchrun, --tp processes, gloo; and
  with sequence parallel and torch's public SequenceParallel style on the norms (what hfdist.torch_private weighs);
- native TP (`from_pretrained(distributed_config=DistributedConfig(tp_size=--tp))`): the same launch.
Every run takes one AdamW step per batch; the first step is a warm-up left out of the throughput. A run's rate is
its median step; a variant's is the median of its runs' rates (one run per variant swung 0.36x-0.80x between
hfdist and native on this shared machine). Memory and collectives are the first round's. After writing its
results the script checks that every step's loss of every TP run is within --loss-rtol of the reference's, and exits
non-zero if not (or if the reference or an hfdist run failed; a native failure is reported, not fatal).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from measure import REPO, recorded, results_dir, torchrun, worker_env

MEASURED_ON = "cpu"  # results/<hardware> names the CPU on any machine: its workers run gloo on CPU tensors

WORKER = REPO / "benchmarks" / "tp_native_worker.py"
RUNS = {  # variant -> label in the table
    "reference": "single process (reference)",
    "hfdist_sp": "hfdist TP, sequence parallel",
    "hfdist_nosp": "hfdist TP, no sequence parallel",
    "hfdist_sp_torch_norms": "hfdist TP, sequence parallel, torch's SequenceParallel norms",
    "native": "transformers native TP",
}
MB = 1e6
# A run's rates, each its median step: tokens per wall second, and per CPU second of the rank's process (all its
# threads), which other jobs on the cores inflate far less than wall time.
RATES = {"tokens_per_s_median_step": "tokens_per_s", "tokens_per_cpu_s_median_step": "tokens_per_cpu_s"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-small", help="hfdist model preset")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree = processes per TP run")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step (each TP rank sees all of them)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="AdamW steps, the first one an untimed warm-up (>= 2)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    p.add_argument("--repeats", type=int, default=5, help="rounds of runs (every variant once per round)")
    p.add_argument("--loss-rtol", type=float, default=1e-5,
                   help="largest |loss - reference| / reference allowed at any step (fp32; the TP tests' bound)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run before it counts as hung")
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/<hardware>)")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2: the first step is a warm-up and is not timed")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def prepare(args: argparse.Namespace, workdir: Path) -> tuple[Path, Path, int]:
    """Save the model once (save_pretrained, so native TP can load it) and the batches once; returns their paths
    and the vocabulary size."""
    import torch

    from hfdist.data import collate, load_raw_dataset, load_tokenizer
    from hfdist.data import prepare as prepare_data
    from hfdist.models.build import build_model

    tok = load_tokenizer(None, is_preset=True)
    packed = prepare_data(load_raw_dataset(None), tok, args.seq_len)
    needed = args.steps * args.global_batch
    if len(packed) < needed:
        raise SystemExit(f"The default data packs into {len(packed)} blocks of {args.seq_len} tokens; "
                         f"{args.steps} steps x {args.global_batch} sequences need {needed}.")
    batches = [collate([packed[i] for i in range(step * args.global_batch, (step + 1) * args.global_batch)])
               for step in range(args.steps)]
    batches_path = workdir / "batches.pt"
    torch.save(batches, batches_path)
    model_dir = workdir / "model"
    build_model(args.preset, vocab_size=len(tok), seed=0).save_pretrained(model_dir)
    return model_dir, batches_path, len(tok)


def launch(variant: str, args: argparse.Namespace, model_dir: Path, batches: Path, workdir: Path) -> dict[str, Any]:
    """Run one variant; returns its command, per-rank records and, if it failed, the error."""
    worker_args = [str(WORKER), "--variant", variant, "--model-dir", str(model_dir), "--batches", str(batches),
                   "--out", str(workdir), "--lr", str(args.lr), "--weight-decay", str(args.weight_decay)]
    cmd = [sys.executable, *worker_args] if variant == "reference" else torchrun(args.tp, *worker_args)
    env = worker_env(args.threads)
    run: dict[str, Any] = {"command": recorded(cmd, env)}
    print(f"[{variant}] {run['command']}", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
        returncode, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode, stderr = None, f"timed out after {args.timeout} s\n{exc.stderr or ''}"
    world = 1 if variant == "reference" else args.tp
    files = [workdir / f"{variant}-rank{r}.json" for r in range(world)]
    run["ranks"] = [json.loads(f.read_text()) for f in files if f.is_file()]
    errors = [r["error"] for r in run["ranks"] if "error" in r]
    if returncode != 0 or errors or len(run["ranks"]) != world:
        # The workers' own exception when they wrote one, else the launcher's last words.
        run["error"] = errors[0] if errors else (stderr or "")[-3000:]
        run["traceback"] = next((r["traceback"] for r in run["ranks"] if "traceback" in r), (stderr or "")[-6000:])
        print(f"[{variant}] FAILED: {run['error']}", flush=True)
    return run


def run_rounds(args: argparse.Namespace, model_dir: Path, batches: Path,
               workdir: Path) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Every variant --repeats times in alternating rounds; returns the merged run per variant and, per round, its
    order, the 1-minute load average before and after, and each variant's rank-0 rate."""
    attempts: dict[str, list[dict[str, Any]]] = {v: [] for v in RUNS}
    rounds = []
    for i in range(args.repeats):
        order = list(RUNS) if i % 2 == 0 else list(reversed(RUNS))
        out = workdir / f"round{i}"
        out.mkdir()
        load_before = os.getloadavg()[0]
        for variant in order:
            attempts[variant].append(launch(variant, args, model_dir, batches, out))
        done = [v for v in order if "error" not in attempts[v][-1]]
        rounds.append({"order": order, "load_before": load_before, "load_after": os.getloadavg()[0],
                       **{f"{name}_rank0": {v: attempts[v][-1]["ranks"][0][key] for v in done}
                          for key, name in RATES.items()}})
        print(f"round {i + 1}/{args.repeats}: " + ", ".join(
            f"{v} {rounds[-1]['tokens_per_s_rank0'][v]:.0f} ({rounds[-1]['tokens_per_cpu_s_rank0'][v]:.0f} per "
            "CPU-s)" for v in done), flush=True)
    return {v: merge_repeats(a) for v, a in attempts.items()}, rounds


def merge_repeats(attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's runs as one: the first run's records, each rank's rates (RATES) now the medians over the runs
    (every run's in `<rate>_repeats`), every run's losses in `repeat_losses`; the first failed run instead if any
    failed."""
    failed = next((a for a in attempts if "error" in a), None)
    if failed is not None:
        return failed
    run = {**attempts[0], "repeat_losses": [[r["losses"] for r in a["ranks"]] for a in attempts]}
    for rank, record in enumerate(run["ranks"]):
        for key, name in RATES.items():
            rates = [a["ranks"][rank][key] for a in attempts]
            record[f"{name}_repeats"] = rates
            record[key] = statistics.median(rates)
    return run


def speed_ratio(rounds: list[dict[str, Any]], rate: str = "tokens_per_s") -> dict[str, Any] | None:
    """hfdist TP (sequence parallel) over native TP, rank 0, by `rate` (a RATES name): the median of each round's
    ratio (paired, so a load change between rounds cancels) and each round's."""
    ratios = [r[f"{rate}_rank0"]["hfdist_sp"] / r[f"{rate}_rank0"]["native"] for r in rounds
              if {"hfdist_sp", "native"} <= r[f"{rate}_rank0"].keys()]
    return {"median_of_rounds": statistics.median(ratios), "per_round": ratios} if ratios else None


def summarize(runs: dict[str, dict[str, Any]], rtol: float) -> dict[str, dict[str, Any]]:
    """Per-run figures for the table; `loss_max_*_diff` and `within_tol` compare every step with the reference."""
    ref = runs["reference"]["ranks"][0]["losses"] if "error" not in runs["reference"] else None
    rows = {}
    for variant, run in runs.items():
        if "error" in run:
            rows[variant] = {"error": run["error"]}
            continue
        ranks = run["ranks"]
        losses = ranks[0]["losses"]
        every = [r for repeat in run["repeat_losses"] for r in repeat]  # every rank of every repeat
        # TP ranks (and repeats) compute the same loss; a difference between them would be a bug of its own.
        rank_spread = max(abs(a - b) / abs(a) for r in every for a, b in zip(r, losses))
        diffs = [abs(a - b) for r in every for a, b in zip(r, ref)] if ref is not None else None
        rel = max(abs(a - b) / abs(b) for r in every for a, b in zip(r, ref)) if ref is not None else None
        rows[variant] = {
            "losses": losses, "final_loss": losses[-1], "loss_max_abs_diff": max(diffs) if diffs else None,
            "loss_max_rel_diff": rel, "loss_rank_spread_rel": rank_spread,
            "within_tol": rel is not None and rel <= rtol and rank_spread <= rtol,
            "grad_norm_last_step": [r["grad_norm_last_step"] for r in ranks],
            "peak_rss_mb": [r["peak_rss_bytes"] / MB for r in ranks],
            "rss_growth_mb": [(r["peak_rss_bytes"] - r["rss_after_imports_bytes"]) / MB for r in ranks],
            "rss_after_imports_mb": [r["rss_after_imports_bytes"] / MB for r in ranks],
            "param_mb": [r["state_bytes"]["param_bytes"] / MB for r in ranks],
            "param_shard_mb": [r["param_shard_bytes"] / MB for r in ranks],
            "grad_mb": [r["state_bytes"]["grad_bytes"] / MB for r in ranks],
            "optimizer_mb": [(r["state_bytes"]["optimizer_bytes"] + r["state_bytes"]["master_bytes"]) / MB
                             for r in ranks],
            "saved_activation_mb": [r["saved_activation_bytes"] / MB for r in ranks],
            "logits_local_shape": ranks[0]["logits_local_shape"],
            "params_viewing_larger_storage": ranks[0]["layout"]["params_viewing_larger_storage"],
            "collectives_per_step": ranks[0]["collectives_per_step"],
            **{name: [r[key] for r in ranks] for key, name in RATES.items()},
            **{f"{name}_repeats": [r[f"{name}_repeats"] for r in ranks] for name in RATES.values()},
        }
    return rows


def _per_rank(values: list[float], fmt: str) -> str:
    """A table cell with one value per rank."""
    return " / ".join(format(v, fmt) for v in values)


def _norm_cell(probes: list[dict[str, Any]]) -> str:
    """Rank 0's clip_grad_norm_ result: the norm, or the start of the error it raised."""
    probe = probes[0]
    return f"{probe['norm']:.6f}" if "norm" in probe else f"fails: `{probe['error'][:100]}...`"


def table(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The Markdown results table, one line per run; per-rank cells read rank 0 / rank 1."""
    header = ("run", "final loss", "max loss diff vs reference, all steps: abs (rel)", "grad norm, last step",
              "peak RSS per rank (MB)", "RSS growth after imports (MB)", "params: storage held / local elements (MB)",
              "grads (MB)", "optimizer state (MB)", "saved activations (MB)", "logits per rank",
              "collectives per fwd+bwd", "tokens/s per rank", "tokens per CPU-second per rank")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for variant, row in rows.items():
        if "error" in row:
            lines.append(f"| {RUNS[variant]} | failed: `{row['error'].splitlines()[0][:200]}` |"
                         + " |" * (len(header) - 2))
            continue
        diff = "0 (is the reference)" if variant == "reference" else (
            "n/a" if row["loss_max_abs_diff"] is None
            else f"{row['loss_max_abs_diff']:.2e} ({row['loss_max_rel_diff']:.1e})")
        params = " / ".join(f"{held:.3f} : {local:.3f}" for held, local in zip(row["param_mb"], row["param_shard_mb"]))
        comms = ", ".join(f"{n} {op}" for op, n in sorted(row["collectives_per_step"].items()) if n) or "none"
        cells = (RUNS[variant], f"{row['final_loss']:.6f}", diff, _norm_cell(row["grad_norm_last_step"]),
                 _per_rank(row["peak_rss_mb"], ".1f"), _per_rank(row["rss_growth_mb"], ".1f"), params,
                 _per_rank(row["grad_mb"], ".3f"), _per_rank(row["optimizer_mb"], ".3f"),
                 _per_rank(row["saved_activation_mb"], ".2f"), "x".join(map(str, row["logits_local_shape"])), comms,
                 _per_rank(row["tokens_per_s"], ".0f"), _per_rank(row["tokens_per_cpu_s"], ".0f"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def layout_differences(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Parameters that hfdist (sequence parallel) and native TP hold differently, and gradients larger than their
    parameter's shard, read from rank 0 of each run."""
    if "error" in runs["hfdist_sp"] or "error" in runs["native"]:
        return []
    ours, native = runs["hfdist_sp"]["ranks"][0]["layout"], runs["native"]["ranks"][0]["layout"]
    lines = ["| parameter | hfdist | transformers native |", "|---|---|---|"]
    lines += [f"| {name} | {held} | {native['params'].get(name)} |" for name, held in ours["params"].items()
              if held != native["params"].get(name)]
    for label, lay in (("hfdist", ours), ("transformers native", native)):
        big = lay["grads_larger_than_shard"]
        lines += ["", f"Gradients larger than their parameter's local shard, {label}: "
                  + ("; ".join(f"{name}: {what}" for name, what in big.items()) if big else "none") + "."]
    return lines


def _mb(row: dict[str, Any], key: str) -> str:
    """Rank 0's value of a per-rank MB figure, for the prose."""
    return f"{row[key][0]:.3f} MB"


def interpretation(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Short reading of the numbers; every figure quoted is taken from `rows`."""
    ok = {v: r for v, r in rows.items() if "error" not in r}
    notes = []
    if "native" not in ok:
        notes.append("- transformers' native TP did not train here; its exact error is under *Failures*.")
    if {"hfdist_sp", "native"} <= ok.keys():
        ours, native = ok["hfdist_sp"], ok["native"]
        notes.append(
            f"- Logits: native TP gathers the full logits on every rank "
            f"({'x'.join(map(str, native['logits_local_shape']))}; Llama's lm_head style is `colwise_gather_output`, "
            f"then HF's loss); hfdist keeps them vocab-sharded ({'x'.join(map(str, ours['logits_local_shape']))}) "
            f"and computes the loss under `loss_parallel()`.")
        act = {v: ok[v]["saved_activation_mb"][0] for v in RUNS if v in ok}
        notes.append(
            "- Activations saved for backward, rank 0: " + ", ".join(f"{RUNS[v]} {mb:.2f} MB" for v, mb in act.items())
            + ". Sequence parallel shards the norms' inputs and the residual stream on the sequence dim; native TP "
            "has no sequence parallel (`DistributedConfig.enable_sequence_parallel` is documented as \"not wired up "
            "yet\") and leaves the norms out of its plan, so they run replicated on plain tensors.")
        notes.append(
            f"- Parameters, rank 0: hfdist keeps {_mb(ours, 'param_mb')} of storage for {_mb(ours, 'param_shard_mb')} "
            f"of local elements, native {_mb(native, 'param_mb')} for {_mb(native, 'param_shard_mb')}.")
        views = native["params_viewing_larger_storage"]
        if views:
            notes.append(
                "  Native parameters that are views into a larger storage: " + ", ".join(f"`{n}`" for n in views)
                + ". They are loaded with safetensors' `get_slice`, which returns a view of the whole checkpoint "
                "tensor in the mmapped file, and `.to('cpu')` copies nothing, so the full tensor's storage stays "
                "referenced (a private file mapping: pages of the other rank's part need not be resident). On a GPU "
                "`.to(device)` would copy only the slice; that case is not measured here.")
        notes.append(
            f"- Gradients, rank 0: hfdist {_mb(ours, 'grad_mb')}, native {_mb(native, 'grad_mb')}; see *Where the "
            "layouts differ* for any gradient larger than its parameter's shard. Optimizer state is sized by the "
            f"local elements in both ({_mb(ours, 'optimizer_mb')} vs {_mb(native, 'optimizer_mb')}).")
        comms = {v: ok[v]["collectives_per_step"] for v in ("hfdist_sp", "hfdist_nosp", "native") if v in ok}
        notes.append(
            "- Collectives per forward + backward: "
            + "; ".join(f"{RUNS[v]} " + ", ".join(f"{n} {op}" for op, n in sorted(c.items()) if n)
                        for v, c in comms.items())
            + ". transformers 5.23's ColwiseParallel wraps each split linear's input on its own, so in backward each "
            "of q/k/v/gate/up all-reduces its own partial input gradient (5 per decoder layer, plus 2 forward); "
            "hfdist's plan, like Megatron's, reduces once per attention and once per MLP block (an all-reduce, or "
            "with sequence parallel an all-gather / reduce-scatter pair). Native's one all-gather is the full logits.")
        tps = {v: ok[v]["tokens_per_s"][0] for v in ok}
        notes.append(
            "- Throughput, rank 0, median over the rounds: " + ", ".join(f"{RUNS[v]} {t:.0f} tokens/s"
                                                                       for v, t in tps.items())
            + f". With {args.threads} thread(s) per rank on CPU/gloo and a model this small, collectives and per-op "
            "dispatch weigh about as much as the matmuls, so these rates compare the implementations' overheads "
            "here, not TP's scaling on GPUs; read them with the load averages of the rounds below.")
        notes.append(
            "- hfdist computes each decoder layer on local tensors (split linears, residual stream, residual adds "
            "and RMSNorms off DTensor's per-op dispatch, each module using local views of its DTensor parameters; "
            "`hfdist.parallel.tensor_styles`), keeps a DTensor between layers (HF reads the global sequence length "
            "from it), and sums the norms' tp-partial weight gradients in one all-reduce per backward rather than in "
            "every optimizer op that reads them. Native TP runs every split linear through DTensor and has no "
            "sequence parallel; it all-reduces each split linear's input gradient on its own instead of once per "
            "block.")
    norms = {v: r["grad_norm_last_step"][0] for v, r in ok.items()}
    failing = [v for v, probe in norms.items() if "error" in probe]
    if failing:
        notes.append("- `torch.nn.utils.clip_grad_norm_` fails on " + ", ".join(RUNS[v] for v in failing) + ": "
                     + "; ".join(f"`{norms[v]['error']}`" for v in failing)
                     + " (its norms are plain tensors, every other parameter a DTensor). The runs above train "
                     "without clipping so that every variant has numbers; the probe ran on the last step's "
                     "gradients, outside the timed step.")
    passing = [v for v, probe in norms.items() if "norm" in probe]
    if passing:
        notes.append("- `clip_grad_norm_` works on " + ", ".join(RUNS[v] for v in passing) + " with last-step norms "
                     + ", ".join(f"{norms[v]['norm']:.6f}" for v in passing) + ".")
    notes.append("- Peak RSS is VmHWM, the process's own high-water mark (`hfdist.metrics.memory.peak_memory_bytes`), "
                 "not getrusage's ru_maxrss, which on Linux carries over exec, so a child would start at its "
                 "launcher's peak.")
    return notes


def speed_lines(result: dict[str, Any]) -> list[str]:
    """The paired speed comparison and every round's rates with the machine's load."""
    ratio, cpu_ratio = result["speed_ratio_hfdist_sp_over_native"], result["cpu_speed_ratio_hfdist_sp_over_native"]
    lines = []
    if ratio is not None:
        lines += [f"**hfdist TP with sequence parallel at {ratio['median_of_rounds']:.2f}x native TP tokens/s** "
                  "(rank 0, median of the rounds' paired ratios: "
                  + ", ".join(f"{r:.2f}" for r in ratio["per_round"]) + f"); per CPU-second "
                  f"{cpu_ratio['median_of_rounds']:.2f}x (" + ", ".join(f"{r:.2f}" for r in cpu_ratio["per_round"])
                  + ").", ""]
    header = ["round", "order", "load before / after", *(RUNS[v] for v in RUNS)]
    lines += ["Rank 0's tokens/s (tokens per CPU-second) per round:", "",
              "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, r in enumerate(result["rounds"], 1):
        rates = [f"{r['tokens_per_s_rank0'][v]:.0f} ({r['tokens_per_cpu_s_rank0'][v]:.0f})"
                 if v in r["tokens_per_s_rank0"] else "failed" for v in RUNS]
        lines.append(f"| {i} | {' > '.join(r['order'])} | {r['load_before']:.1f} / {r['load_after']:.1f} | "
                     + " | ".join(rates) + " |")
    return lines


def markdown(result: dict[str, Any], runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    """The report: settings, definitions, tolerance verdict, table, interpretation, layouts, failures, commands."""
    s, rows = result["settings"], result["rows"]
    lines = [
        f"# hfdist TP vs transformers native TP ({result['hardware']})", "",
        f"Command: `{result['command']}`", "",
        f"Model `{s['preset']}` (vocab {s['vocab_size']}, seed 0, fp32), saved once with save_pretrained and loaded by "
        f"every run. Data: the packed embedded default, one global batch of {s['global_batch']} x {s['seq_len']} "
        f"tokens per step, the same batches for every run. {s['steps']} AdamW steps (lr {s['lr']}, weight decay "
        f"{s['weight_decay']}, no clipping in the update), TP={s['tp']} on {s['tp']} processes (torchrun, gloo), "
        f"OMP_NUM_THREADS={s['threads']} per process. Each run has processes of its own. The machine's 1-minute load "
        f"average was {s['load_before']:.1f} before and {s['load_after']:.1f} after the runs on {os.cpu_count()} cores "
        f"(other jobs shared it); the benchmark took {s['wall_minutes']:.1f} minutes.", "",
        "Definitions: *tokens/s per rank* = positions of the global batch (packed rows, padding included), which "
        "every TP rank's model processes whole, divided by the rank's wall time of forward + backward + optimizer "
        f"step; a run's rate is its median over steps 2..{s['steps']} (step 1 is an untimed warm-up), the table's the "
        f"median over the {s['repeats']} rounds' runs (the JSON has every run's, every step's time and the "
        "total-based rate); *tokens per CPU-second* = the same with the CPU time of the rank's process (all its "
        "threads: gloo's too) in place of wall time, which waiting for a core shared with other jobs does not "
        "inflate, while waiting for the other rank in a collective (blocking) does not count. *Peak RSS* = the process's VmHWM at the end "
        "(libraries included); *RSS growth* = that minus VmHWM right after the imports (torch, transformers, hfdist), "
        "i.e. what loading and training the model added. *params / grads / optimizer state* = bytes of the tensors "
        "this rank holds, measured before the last optimizer step with `hfdist.metrics.memory.rank_state_bytes` "
        "(storage of DTensors' local shards, each storage once); *local elements* = the parameters' local element "
        "bytes, whatever storage they view. *Saved activations* = bytes of the tensors autograd saved for backward "
        "in the warm-up step, parameters excluded. *Collectives* = CommDebugMode's count for the warm-up step's "
        "forward + backward. *Grad norm* = `clip_grad_norm_(max_norm=inf)` on the last step's gradients. "
        "Per-rank cells read rank 0 / rank 1.", "",
        f"Tolerance: every step's loss of every TP run within a relative {s['loss_rtol']:g} of the single-process "
        "reference (fp32; the bound of hfdist's TP tests: sharded matmuls and all-reduces sum in another order), "
        "and both TP ranks' losses equal within the same bound: "
        f"**{'passed' if result['all_within_tol'] else 'FAILED'}**.", "",
        *table(rows), "", *speed_lines(result), "",
        "Loss per step: " + "; ".join(f"{RUNS[v]}: " + ", ".join(f"{x:.6f}" for x in r["losses"])
                                      for v, r in rows.items() if "error" not in r), "",
        "## Interpretation", "", *interpretation(rows, args), "",
    ]
    differences = layout_differences(runs)
    if differences:
        lines += ["## Where the layouts differ (rank 0)", "", *differences, ""]
    failures = [(v, run) for v, run in runs.items() if "error" in run]
    if failures:
        lines += ["## Failures", ""]
        for variant, run in failures:
            lines += [f"### {RUNS[variant]}", "", f"`{run['command']}`", "", "```", run["traceback"].strip(), "```", ""]
    lines += ["## Commands of the runs (in a temporary folder this script removes)", "",
              *(f"- {RUNS[v]}: `{run['command']}`" for v, run in runs.items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from hfdist.report.matrix import hardware_name

    hardware = hardware_name(MEASURED_ON)
    out = results_dir(args.out, MEASURED_ON)
    command = shlex.join(["python", "benchmarks/bench_tp_native.py", *(sys.argv[1:] if argv is None else argv)])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tp_native_") as tmp:
        workdir = Path(tmp)
        model_dir, batches, vocab = prepare(args, workdir)
        load_before = os.getloadavg()[0]
        runs, rounds = run_rounds(args, model_dir, batches, workdir)
        load_after = os.getloadavg()[0]
    rows = summarize(runs, args.loss_rtol)
    checked = {v: r for v, r in rows.items() if v != "reference"}
    all_ok = "error" not in rows["reference"] and all(r.get("within_tol") for r in checked.values() if "error" not in r)
    settings = {k: getattr(args, k) for k in ("preset", "tp", "global_batch", "seq_len", "steps", "lr", "weight_decay",
                                              "threads", "repeats", "loss_rtol")}
    settings.update(vocab_size=vocab, load_before=load_before, load_after=load_after,
                    wall_minutes=(time.perf_counter() - started) / 60)
    result = {"command": command, "hardware": hardware, "settings": settings, "all_within_tol": all_ok,
              "speed_ratio_hfdist_sp_over_native": speed_ratio(rounds),
              "cpu_speed_ratio_hfdist_sp_over_native": speed_ratio(rounds, "tokens_per_cpu_s"), "rounds": rounds, "rows": rows, "runs": runs}
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp_vs_native.json").write_text(json.dumps(result, indent=1))
    md = markdown(result, runs, args)
    (out / "tp_vs_native.md").write_text(md)
    print(md)
    for variant, row in checked.items():
        if "error" not in row:
            print(f"{RUNS[variant]}: max |loss - reference| = {row['loss_max_abs_diff']:.3e}, relative "
                  f"{row['loss_max_rel_diff']:.3e} (tolerance {args.loss_rtol:g}), rank spread "
                  f"{row['loss_rank_spread_rel']:.3e}")
    print(f"wrote {out / 'tp_vs_native.md'} and {out / 'tp_vs_native.json'}")
    broken = [RUNS[v] for v in ("reference", "hfdist_sp", "hfdist_nosp") if "error" in rows[v]]
    if broken:
        raise SystemExit(f"failed: {', '.join(broken)} (see the md's Failures section)")
    if not all_ok:
        raise SystemExit(f"a TP run missed the reference loss by more than a relative {args.loss_rtol:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
