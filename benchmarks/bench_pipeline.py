"""Pipeline-parallel benchmark (issue 6): 1F1B's measured bubble against (p-1)/(m+p-1), the schedules' tokens/s and
per-rank memory at one global batch, and transformers' native pipeline split on the same model.

    python benchmarks/bench_pipeline.py          # writes results/<hardware>/pipeline.{json,md}

Every measurement is its own 2-rank launch of benchmarks/pp_bench_worker.py (`torchrun --standalone
--nproc-per-node 2`, run as `python -m torch.distributed.run` so this interpreter's torch launches it; gloo,
OMP_NUM_THREADS=1), so each schedule's peak RSS is that schedule's alone. A step is
forward + backward of the whole global batch (no optimizer step, which costs every schedule the same).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from measure import REPO, recorded, results_dir, torchrun, worker_env

MEASURED_ON = "cpu"  # results/<hardware> names the CPU on any machine: its workers run gloo on CPU tensors

WORKER = REPO / "benchmarks" / "pp_bench_worker.py"

from pp_bench_worker import BenchSettings  # noqa: E402


class LaunchError(RuntimeError):
    """A worker launch exited non-zero or wrote no result."""


def parse_args(argv: list[str]) -> tuple[BenchSettings, argparse.Namespace]:
    """Settings from the command line (defaults: BenchSettings') plus the entry point's own options."""
    d = BenchSettings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "seq", "micro_batch",
                 "microbatches", "steps", "warmup", "rounds"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument("--bubble-microbatches", default=",".join(map(str, d.bubble_microbatches)),
                   help="comma-separated micro-batch counts of the 1F1B bubble sweep")
    p.add_argument("--schedules", default=",".join(d.schedules), help="comma-separated schedules to compare")
    p.add_argument("--out", type=Path, default=None, help="default: results/<hardware>")
    p.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    args = p.parse_args(argv)
    settings = BenchSettings(
        layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, heads=args.heads,
        kv_heads=args.kv_heads, vocab=args.vocab, seq=args.seq, micro_batch=args.micro_batch,
        bubble_microbatches=tuple(int(m) for m in args.bubble_microbatches.split(",")),
        microbatches=args.microbatches, steps=args.steps, warmup=args.warmup, rounds=args.rounds,
        schedules=tuple(args.schedules.split(",")))
    return settings, args


def launch(case: str, settings: BenchSettings, workdir: Path, timeout: int, *extra: str) -> tuple[dict, list[str]]:
    """Run one worker case on 2 ranks; return rank 0's result and the exact command.

    A case that raised inside the worker comes back with "error"; a launch that crashed raises LaunchError.
    """
    out = workdir / f"{case}-{len(list(workdir.iterdir()))}.json"
    cmd = torchrun(2, WORKER, "--case", case, "--settings", json.dumps(asdict(settings)), "--out", str(out), *extra)
    proc = subprocess.run(cmd, cwd=REPO, env=worker_env(1), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out.is_file():
        raise LaunchError(f"{shlex.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text()), cmd


def _pair(values: list[float], fmt: str = "{:.0f}") -> str:
    return " / ".join(fmt.format(v) for v in values)


def _label(spec: str) -> str:
    name, _, split = spec.partition("@")
    return f"{name} (even layer split)" if split == "even" else name


def _step(r: dict) -> str:
    return f"{r['step_s']:.3f} ({min(r['rounds_step_s']):.3f}-{max(r['rounds_step_s']):.3f})"


def _bubble_table(rows: list[dict]) -> list[str]:
    lines = ["| m | global batch (seqs) | step s (range) | busy s (rank 0 / 1) | measured bubble | (p-1)/(m+p-1) | "
             "measured - formula | tokens/s |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['n_microbatches']} | {r['global_batch']} | {_step(r)} | "
                     f"{_pair(r['busy_s'], '{:.3f}')} | {r['bubble']:.3f} | {r['ideal']:.3f} | "
                     f"{r['bubble'] - r['ideal']:+.3f} | {r['tokens_per_s']:.0f} |")
    return lines


def _schedule_table(rows: list[dict]) -> list[str]:
    lines = ["| schedule | stages on rank 0 ; rank 1 | step s (range) | tokens/s | busy s (rank 0 / 1) | "
             "measured bubble | ideal bubble | peak RSS MB (rank 0 / 1) | RSS growth during steps MB | "
             "peak step tensors MB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {_label(r['spec'])} | failed: `{r['error']}` ||||||||")
            continue
        ranks = r["ranks"]
        lines.append(
            f"| {_label(r['spec'])} | {' ; '.join(' , '.join(k['modules']) for k in ranks)} | {_step(r)} | "
            f"{r['tokens_per_s']:.0f} | {_pair(r['busy_s'], '{:.3f}')} | {r['bubble']:.3f} | {r['ideal']:.3f} | "
            f"{_pair([k['peak_rss_mb'] for k in ranks])} | "
            f"{_pair([k['peak_rss_mb'] - k['rss_before_steps_mb'] for k in ranks])} | "
            f"{_pair([k['peak_step_tensors_mb'] for k in ranks], '{:.1f}')} |")
    return lines


def _native_table(native: dict) -> list[str]:
    if "error" in native:
        return [f"The native run failed: `{native['error']}`"]
    ranks = native["ranks"]
    attempts = [r["train_attempt"] for r in ranks]
    rows = [
        ("stages (split by transformers)", " ; ".join(f"rank {i}: {r['modules']}" for i, r in enumerate(ranks))),
        ("what one call does", f"forward of the whole batch of {native['global_batch']} sequences: no micro-batches, "
                               f"no schedule; the last rank broadcasts the full logits {attempts[0]['logits_shape']} "
                               f"to every rank"),
        ("forward step s / tokens/s (no grad)", f"{native['step_s']:.3f} / {native['forward_tokens_per_s']:.0f}"),
        ("forward bubble (idle fraction; balanced theory (p-1)/p = 0.5)", f"{native['bubble']:.3f}"),
        ("peak RSS MB (rank 0 / 1; includes the training attempt's whole-batch forward)",
         _pair([r["peak_rss_mb"] for r in ranks])),
        ("peak forward tensors MB (rank 0 / 1)", _pair([r["peak_step_tensors_mb"] for r in ranks], "{:.1f}")),
        ("`model(input_ids=ids, labels=ids).loss` (rank 0 / 1)",
         " / ".join(str(a["loss_from_labels"]) for a in attempts)),
        ("logits require grad (rank 0 / 1)", " / ".join(str(a["logits_requires_grad"]) for a in attempts)),
    ]
    for i, a in enumerate(attempts):
        warned = f"; warning: \"{a['warnings'][0]}\"" if a["warnings"] else ""
        rows.append((f"`cross_entropy(logits, ids).backward()` on rank {i}",
                     f"`{a['backward']}`{warned}; parameters with a gradient: {a['params_with_grad']} of "
                     f"{a['params']}"))
    return ["| | result |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]


def _bubble_sentence(rows: list[dict]) -> str:
    lo, hi = rows[0], rows[-1]
    falls = all(a["bubble"] > b["bubble"] for a, b in zip(rows, rows[1:]))
    excess = [r["bubble"] - r["ideal"] for r in rows]
    return (f"1F1B's measured bubble {'falls steadily' if falls else 'does not fall steadily'} with the micro-batch "
            f"count, from {lo['bubble']:.2f} at m={lo['n_microbatches']} (formula {lo['ideal']:.2f}) to "
            f"{hi['bubble']:.2f} at m={hi['n_microbatches']} (formula {hi['ideal']:.2f}); it differs from "
            f"(p-1)/(m+p-1) by {min(excess):+.2f} to {max(excess):+.2f}, the part the formula leaves out: gloo "
            f"transfers, the schedule's own bookkeeping and unequal stages")


def _schedule_sentences(rows: dict[str, dict]) -> list[str]:
    out = []
    if rows:
        steps = [r["step_s"] for r in rows.values()]
        noise = max(max(r["rounds_step_s"]) / min(r["rounds_step_s"]) - 1 for r in rows.values())
        spread = max(steps) / min(steps) - 1
        out.append(f"at the same global batch the schedules' median step times lie within {spread:.0%} of each other"
                   + (f", less than the up to {noise:.0%} between rounds of one schedule, so on 2 cores their "
                      f"throughput is indistinguishable" if spread < noise else
                      f" (rounds of one schedule vary by up to {noise:.0%})"))
    g, o = rows.get("GPipe"), rows.get("1F1B")
    if not o:
        return out
    o_act = [k["peak_step_tensors_mb"] for k in o["ranks"]]
    if g:
        m, p = o["n_microbatches"], o["pp"]
        g_act = [k["peak_step_tensors_mb"] for k in g["ranks"]]
        theory = " / ".join(f"{m / min(m, p - r):.0f}x" for r in range(p))
        measured = " / ".join(f"{a / b:.1f}x" for a, b in zip(g_act, o_act))
        rss = _pair([a["peak_rss_mb"] - b["peak_rss_mb"] for a, b in zip(g["ranks"], o["ranks"])])
        out.append(f"memory is where they differ: GPipe holds all {m} micro-batches' activations until its backward "
                   f"starts, 1F1B at most p - rank of them, so GPipe's peak of step tensors should be {theory} "
                   f"1F1B's on rank 0 / 1 and measured {measured} ({_pair(g_act)} vs {_pair(o_act)} MB), with "
                   f"{rss} MB more peak RSS")
    for spec in ("Interleaved1F1B", "Interleaved1F1B@even"):
        i = rows.get(spec)
        if not i:
            continue
        i_act = [k["peak_step_tensors_mb"] for k in i["ranks"]]
        more = all(a > b for a, b in zip(i_act, o_act))
        out.append(f"{_label(spec)} cuts the ideal bubble to {i['ideal']:.3f} and measured {i['bubble']:.2f} "
                   f"(rounds {min(i['rounds_bubble']):.2f}-{max(i['rounds_bubble']):.2f}; 1F1B's "
                   f"{o['bubble']:.2f}, rounds {min(o['rounds_bubble']):.2f}-{max(o['rounds_bubble']):.2f}), its ranks "
                   f"were busy {i['busy_s'][0]:.2f} / {i['busy_s'][1]:.2f} s, and its peak of step tensors is "
                   f"{_pair(i_act)} MB against 1F1B's {_pair(o_act)}"
                   + (" (interleaving keeps more micro-batches in flight)" if more else ""))
    return out


def _interpretation(result: dict) -> str:
    """One paragraph that reads this run's numbers (every figure in it comes from the run)."""
    parts = [_bubble_sentence(result["bubble_1f1b"])] if result["bubble_1f1b"] else []
    parts += _schedule_sentences({r["spec"]: r for r in result["schedules"] if "error" not in r})
    native = result["native"]
    if "error" not in native:
        a0, a1 = (r["train_attempt"] for r in native["ranks"])
        ours = next((r for r in result["schedules"] if r.get("spec") == "1F1B" and "error" not in r), None)
        same = ours is not None and [k["modules"] for k in ours["ranks"]] == [[r["modules"]] for r in native["ranks"]]
        split = "splits the model as hfdist's 1F1B does" if same else "splits the model differently from hfdist's 1F1B"
        parts.append(
            f"transformers' native `DistributedConfig(pp_size=2)` {split} but only runs "
            f"forward passes of the whole batch, so each rank idles while the other works (measured "
            f"{native['bubble']:.2f}); it returns no loss for labels, and a backward through its logits fails on "
            f"rank 0 (`{a0['backward']}`) while on rank 1 it reaches only that rank's {a1['params_with_grad']} "
            f"parameters: the first stage never gets a gradient, so the native split cannot train")
    return " ".join(part[0].upper() + part[1:] + "." for part in parts) + (
        " On this 2-core CPU the bubble fractions are meaningful (they are idle time), while the absolute tokens/s "
        "are small and move with whatever else runs on the machine (load averages are in pipeline.json).")


def render_markdown(result: dict) -> str:
    """pipeline.md: the three tables and the interpretation."""
    s = result["settings"]
    hw = result["hardware"]
    return "\n".join([
        f"# Pipeline parallelism benchmark ({hw})", "",
        f"Command: `{result['command']}` ({result['wall_s']:.0f} s; worker launches are listed in pipeline.json).",
        "",
        f"Model: untied Llama, {s['layers']} layers, hidden {s['hidden']}, intermediate {s['intermediate']}, "
        f"{s['heads']} heads / {s['kv_heads']} kv heads, vocab {s['vocab']} ({result['params_m']:.2f} M parameters, "
        f"fp32). Sequences of {s['seq']} tokens, {s['micro_batch']} sequence(s) per micro-batch. pp = 2 ranks, gloo, "
        f"one thread each (OMP_NUM_THREADS=1). A step is forward + backward of the global batch (no optimizer step); "
        f"each measurement ({s['warmup']} warm-up + {s['steps']} timed step(s), slowest rank) ran in {s['rounds']} "
        f"rounds that rotate through all of them in one launch, so load from other jobs spreads over all; the tables "
        f"show the median round (and the range of step times over the rounds). "
        f"Bubble = 1 - (time inside the stages' forward/backward and the loss) / step time, averaged over the ranks "
        f"(`hfdist.parallel.measure_bubble`). tokens/s: the global batch's tokens over the step time, for the whole "
        f"2-rank pipeline. Load average (1 min) at start / end: {result['load_avg_start'][0]:.1f} / "
        f"{result['load_avg_end'][0]:.1f} (the benchmark's own 2 ranks account for about 2).", "",
        "## 1. 1F1B: measured bubble vs (p-1)/(m+p-1), pp = 2", "",
        *_bubble_table(result["bubble_1f1b"]),
        *([f"The timing launch failed: `{result['timing_error']}`"] if "timing_error" in result else []), "",
        f"## 2. Schedules at the same global batch ({s['micro_batch'] * s['microbatches']} sequences, "
        f"m = {s['microbatches']})", "",
        *_schedule_table(result["schedules"]), "",
        "Peak RSS: VmHWM of each rank's process at the end (`hfdist.metrics.memory.peak_memory_bytes`; one launch per "
        "schedule; it includes the interpreter, torch and transformers). RSS growth: that peak minus the RSS just "
        "before the first step (gradients, receive buffers, activations, allocator slack). Peak step tensors: the "
        "most bytes held at once by tensors created during one step (a TorchDispatchMode counts each from its "
        "creation to its free): activations, activation gradients and temporaries; parameters, the gradients "
        "they accumulate into and the schedule's preallocated receive buffers are not in it.", "",
        "## 3. transformers' native pipeline parallelism (same model, same global batch)", "",
        f"`LlamaForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(pp_size=2))`, transformers "
        f"{result['versions']['transformers']}.", "",
        *_native_table(result["native"]), "",
        "## Interpretation", "", _interpretation(result), "",
    ])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    settings, args = parse_args(argv)
    import torch
    import transformers

    from hfdist.report.matrix import hardware_name

    from pp_bench_worker import make_model

    out_dir = results_dir(args.out, MEASURED_ON)
    start = time.perf_counter()
    result: dict = {
        "command": shlex.join(["python", "benchmarks/bench_pipeline.py", *argv]),
        "hardware": hardware_name(MEASURED_ON),
        "settings": asdict(settings), "params_m": sum(p.numel() for p in make_model(settings).parameters()) / 1e6,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "load_avg_start": os.getloadavg(), "launches": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)

        def run(case: str, *extra: str) -> dict:
            t0 = time.perf_counter()
            out, cmd = launch(case, settings, work, args.timeout, *extra)
            result["launches"].append({"command": recorded(cmd, worker_env(1)),
                                       "wall_s": time.perf_counter() - t0, "load_avg": out["load_avg_end"]})
            print(f"{case} {' '.join(extra[:2])}: {time.perf_counter() - t0:.0f} s", flush=True)
            if "error" in out:
                print(f"  failed: {out['error']}\n{out['trace']}", file=sys.stderr)
            return out

        timing = run("timing")
        result["bubble_1f1b"] = timing.get("row", {}).get("bubble", [])
        if "error" in timing:
            result["timing_error"] = timing["error"]
        result["schedules"] = []
        for spec in settings.schedules:
            timed = next((r for r in timing.get("row", {}).get("schedule", []) if r["spec"] == spec), None)
            memory = run("memory", "--schedule", spec)
            error = timing.get("error") or memory.get("error")
            result["schedules"].append({"spec": spec, "error": error} if error else {**timed, **memory["row"]})
        native = run("native", "--checkpoint", str(work / "native-checkpoint"))
        result["native"] = native.get("row", {"error": native.get("error")})
    result["wall_s"] = time.perf_counter() - start
    result["load_avg_end"] = os.getloadavg()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pipeline.json").write_text(json.dumps(result, indent=1))
    (out_dir / "pipeline.md").write_text(render_markdown(result))
    print(f"{result['wall_s']:.0f} s -> {out_dir / 'pipeline.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
