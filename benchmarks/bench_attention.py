"""Attention that costs what the documents cost: the same tokens per rank per step packed into short and long blocks,
with the dense S x S document mask (--attn-implementation sdpa) against hfdist's document attention (auto on CPU:
hfdist_documents), through `hfdist finetune`. Three groups, each at constant tokens per step:
- fsdp_full_shard, 8,192 tokens per rank: 8 x 1,024 vs 1 x 8,192 (issue 25's done-when pair);
- fsdp_full_shard, 16,384 tokens per rank: blocks of 1K, 4K and 16K;
- fsdp_cp (dp_shard 1 x cp 2), 32,768 tokens per step: 8 x 4K vs 1 x 32K.

    python benchmarks/bench_attention.py     # results/<hardware>/attention.{md,json}; est. 60-90 min on 2 idle cores

The model is --preset (llama-small: 4 layers, hidden 256, 8 heads / 4 kv heads) with max_position_embeddings raised
to the longest block, saved once as a checkpoint folder (safetensors + the embedded tokenizer) in a temporary
directory; the data is hfdist's embedded chat conversations (documents of a few hundred tokens), so every block
length packs the same documents. Each run is `python -m hfdist.cli finetune` on 2 ranks, fp32, --steps optimizer
steps (the summary's rates leave out the first), the attention variants alternating within each repeat so drifting
load hits both alike. Reported per run, from hfdist_summary.json: tokens/s per rank (mean over ranks) and the
training memory above set-up per rank (peak RSS over the training steps minus the peak before them, the largest
rank's), medians over --repeats. fsdp_cp runs dp_shard 1 x cp 2: every rank holds half of each block's tokens, and
under sdpa the whole block's mask and its additive copy (one, shared by every layer).

The dense variant holds ~7 GiB per rank at 16K on fsdp_full_shard and 5-7 GiB at 32K on fsdp_cp (the masks, their
fp32 copies, the conversion's temporaries): on a shared machine --dense-max-seq leaves the longest blocks' dense runs
out (the planner's figure for their masks is written instead). A run that fails (the OOM killer on a shared machine)
is recorded with its error and the benchmark goes on; the results files are rewritten after every cell, so a
benchmark stopped part-way keeps its measurements (their "progress" says how many runs they hold).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from measure import recorded, results_dir, worker_env

MEASURED_ON = None  # results/<hardware> names the GPUs where there are any: the fine-tuning job's device
MIB = 2**20
DENSE, NEW = "sdpa", "auto"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-small", help="hfdist model preset (heads divisible by 2)")
    p.add_argument("--check-tokens", type=int, default=8192, help="tokens per rank per step, first group")
    p.add_argument("--check-seqs", type=int, nargs="+", default=[1024, 8192], help="block lengths, first group")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank per step, fsdp_full_shard")
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384], help="block lengths, fsdp_full_shard")
    p.add_argument("--cp-tokens", type=int, default=32768, help="tokens per cp group per step, fsdp_cp")
    p.add_argument("--cp-seqs", type=int, nargs="+", default=[4096, 32768], help="block lengths, fsdp_cp")
    p.add_argument("--dense-max-seq", type=int, default=None,
                   help="run sdpa only on blocks up to this many tokens (longer: the planner's mask figure instead); "
                        "default: every block")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is not timed)")
    p.add_argument("--repeats", type=int, default=2, help="runs per variant, alternating")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/<hardware>)")
    return p.parse_args(argv)


def save_model(preset: str, max_seq: int, folder: Path) -> None:
    """`preset` with max_position_embeddings = max_seq, as a checkpoint folder finetune loads (--model folder)."""
    from hfdist.data.load import TOKENIZER_DIR, load_tokenizer
    from hfdist.models.build import build_model

    tok = load_tokenizer(None, is_preset=True)
    model = build_model(preset, vocab_size=len(tok), seed=0)
    model.config.max_position_embeddings = max_seq
    model.save_pretrained(folder)
    for f in TOKENIZER_DIR.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())


def run(model: Path, config: str, seq: int, rows: int, attention: str, steps: int, timeout: int) -> dict:
    """One finetune run on 2 ranks; its summary's figures, or {"failed": the command and its error's tail}."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "hfdist.cli", "finetune", "--config", config, "--num-processes", "2",
               "--model", str(model), "--seq-len", str(seq), "--micro-batch-size", str(rows),
               "--global-batch-size", str(rows * (2 if config == "fsdp_full_shard" else 1)),
               "--max-steps", str(steps), "--warmup-steps", "0", "--save-steps", "0", "--no-wandb",
               "--attn-implementation", attention, "--output-dir", str(Path(tmp) / "run")]
        proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=timeout)
        if proc.returncode:
            return {"failed": f"{recorded(cmd)} exited {proc.returncode}: {proc.stderr[-1500:]}"}
        s = json.loads((Path(tmp) / "run" / "hfdist_summary.json").read_text())
    ranks = s["ranks"]
    return {"attn_implementation": s["strategy"]["attn_implementation"],
            "tokens_per_s_per_rank": statistics.mean(r["tokens_per_second"] for r in ranks),
            "training_memory_bytes": max(r["peak_memory_bytes"] - r["setup_peak_memory_bytes"] for r in ranks),
            "step_seconds": statistics.mean(r["step_seconds"] for r in ranks),
            "data_wait_seconds": statistics.mean(r["data_wait_seconds"] for r in ranks), "losses": s["losses"]}


def planned_mask_bytes(preset: str, config: str, seq: int, rows: int) -> int:
    """The planner's extra per-rank bytes of sdpa's dense mask on `config`'s 2 ranks (fsdp_cp: dp_shard 1 x cp 2),
    fp32."""
    from hfdist.config.dims import ParallelDims
    from hfdist.config.ladder import load_rung
    from hfdist.models.presets import load_config
    from hfdist.models.shape import ModelShape
    from hfdist.plan.bytes import Workload, rung_rank_bytes

    shape, rung = ModelShape.from_config(load_config(preset)), load_rung(config)
    dims = ParallelDims(cp=2) if config == "fsdp_cp" else ParallelDims(dp_shard=2)
    return (rung_rank_bytes(shape, rung, dims, Workload(seq=seq, micro_batch=rows, dtype="fp32",
                                                        attention=DENSE)).activations
            - rung_rank_bytes(shape, rung, dims, Workload(seq=seq, micro_batch=rows, dtype="fp32")).activations)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = recorded([sys.executable, "benchmarks/bench_attention.py", *(argv if argv is not None else sys.argv[1:])])
    cells = [cell for group in groups(args) for cell in group]
    skipped = {(config, seq, DENSE) for config, seq, _ in cells if seq > (args.dense_max_seq or seq)}
    samples: dict[tuple, list[dict]] = {}  # (config, seq, rows, attention) -> runs
    failures: list[str] = []
    loads = [uptime()]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        save_model(args.preset, max(args.check_seqs + args.seqs + args.cp_seqs), model)
        for _ in range(args.repeats):
            for config, seq, rows in cells:
                for attention in (DENSE, NEW):  # alternating, so drifting load hits both alike
                    if (config, seq, attention) not in skipped:
                        key = (config, seq, rows, attention)
                        got = run(model, config, seq, rows, attention, args.steps, args.timeout)
                        print(*key, got, flush=True)
                        if "failed" in got:
                            failures.append(got["failed"])
                        else:
                            samples.setdefault(key, []).append(got)
                loads.append(uptime())
                # After every cell, so a long benchmark stopped part-way keeps what it measured (and says so).
                done = sum(map(len, samples.values()))
                write(args, command, cells, skipped, samples, loads, failures,
                      f"{done} of {args.repeats * (2 * len(cells) - len(skipped))} runs")
    print(markdown(json.loads((results_dir(args.out, MEASURED_ON) / "attention.json").read_text())))


def write(args: argparse.Namespace, command: str, cells: list[tuple[str, int, int]], skipped: set,
          samples: dict[tuple, list[dict]], loads: list[str], failures: list[str], progress: str) -> None:
    """results/<hardware>/attention.{json,md} from the runs so far: per cell and attention, the medians over its
    runs; a skipped cell gets the planner's mask figure, a pending one nothing."""
    rows = []
    for config, seq, per_step in cells:
        for attention in (DENSE, NEW):
            got = samples.get((config, seq, per_step, attention))
            row = {"config": config, "seq": seq, "rows_per_step": per_step, "tokens_per_step": seq * per_step,
                   "attention": attention}
            if (config, seq, attention) in skipped:
                row["planned_mask_bytes"] = planned_mask_bytes(args.preset, config, seq, per_step)
            elif got:
                row |= {"attn_implementation": got[0]["attn_implementation"], "runs": got,
                        **{k: statistics.median(g[k] for g in got)
                           for k in ("tokens_per_s_per_rank", "training_memory_bytes", "step_seconds")}}
            rows.append(row)
    result = {"command": command, "preset": args.preset, "steps": args.steps, "repeats": args.repeats,
              "progress": progress, "dtype": "fp32", "ranks": 2, "load": loads, "rows": rows,
              "ratios": ratios(rows, args), "failures": failures}
    out = results_dir(args.out, MEASURED_ON)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "attention.md").write_text(markdown(result))


def groups(args: argparse.Namespace) -> list[list[tuple[str, int, int]]]:
    """(config, block tokens, blocks per step) of each group: the same tokens per step in every cell of a group."""
    return [[("fsdp_full_shard", seq, args.check_tokens // seq) for seq in args.check_seqs],
            [("fsdp_full_shard", seq, args.tokens // seq) for seq in args.seqs],
            [("fsdp_cp", seq, args.cp_tokens // seq) for seq in args.cp_seqs]]


def ratios(rows: list[dict], args: argparse.Namespace) -> list[dict]:
    """Longest vs shortest block of each group under each attention: tokens/s and training memory (issue 25's
    done-when: >= 0.8 x and <= 1.25 x with the new path)."""
    out = []
    for group in groups(args):
        (config, short_seq, short_rows), (_, long_seq, long_rows) = min(group), max(group)
        for attention in (DENSE, NEW):
            short, long = (next(r for r in rows if (r["config"], r["seq"], r["rows_per_step"], r["attention"])
                                == (config, seq, n, attention)) for seq, n in ((short_seq, short_rows),
                                                                                (long_seq, long_rows)))
            if "runs" in short and "runs" in long:
                out.append({"config": config, "attention": attention, "tokens_per_step": short["tokens_per_step"],
                            "short": f"{short_rows} x {short_seq}", "long": f"{long_rows} x {long_seq}",
                            "tokens_per_s": long["tokens_per_s_per_rank"] / short["tokens_per_s_per_rank"],
                            "memory": long["training_memory_bytes"] / short["training_memory_bytes"]})
    return out


def markdown(r: dict) -> str:
    lines = [
        "# Attention: the same tokens per step in short and long packed blocks",
        "",
        f"`{r['command']}`",
        "",
        f"{r['preset']} (max_position_embeddings raised), the embedded chat data, fp32, 2 ranks, {r['steps']} steps "
        f"per run (the first not timed), medians over the alternating runs per variant ({r['progress']} done). "
        "Tokens per step: "
        "per rank on fsdp_full_shard; per step on fsdp_cp (dp_shard 1 x cp 2), half of each block on each rank. "
        "sdpa: the dense (B, 1, S, S) document mask; auto: hfdist's document attention (hfdist_documents; nothing "
        "S x S). Memory: training memory above set-up (peak RSS of the training steps minus the peak before them), "
        "the largest rank's.",
        "",
        "| rung | tokens per step | blocks x tokens | attention | tokens/s per rank | training memory MiB | step s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        head = (f"| {row['config']} | {row['tokens_per_step']:,} | {row['rows_per_step']} x {row['seq']:,} | "
                f"{row['attention']} |")
        if "runs" in row:
            lines.append(f"{head} {row['tokens_per_s_per_rank']:,.0f} | {row['training_memory_bytes'] / MIB:,.0f} | "
                         f"{row['step_seconds']:.2f} |")
        elif "planned_mask_bytes" in row:
            lines.append(f"{head} not run | planned +{row['planned_mask_bytes'] / MIB:,.0f} for the mask | - |")
        else:
            lines.append(f"{head} pending | - | - |")
    lines += ["", "Longest against shortest block at the same tokens per step (issue 25's bar for the new path: "
              "tokens/s >= 0.8 x, training memory <= 1.25 x):", "",
              "| rung | tokens per step | attention | blocks | tokens/s ratio | memory ratio |",
              "|---|---|---|---|---|---|"]
    for q in r["ratios"]:
        lines.append(f"| {q['config']} | {q['tokens_per_step']:,} | {q['attention']} | {q['long']} vs {q['short']} | "
                     f"{q['tokens_per_s']:.2f} | {q['memory']:.2f} |")
    lines += ["", "Load (`uptime`) before the runs and after each cell's pair:", ""]
    lines += [f"- {load}" for load in r["load"]]
    if r["failures"]:
        lines += ["", "Runs that failed (not in the medians):", ""]
        lines += [f"- {' '.join(f.split())[:600]}" for f in r["failures"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
