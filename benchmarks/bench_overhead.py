"""hfdist's overhead against the libraries it wraps: tokens/s of hfdist's ddp and zero2 rungs and of a plain
`accelerate launch` + transformers.Trainer script (benchmarks/plain_trainer.py), side by side in one run.

    python benchmarks/bench_overhead.py       # writes results/<hardware>/overhead.{json,md}

Held equal: the model (the embedded default's shape and seeded weights, saved as one HF folder both load), the text
(one JSON Lines file), tokens per optimizer step (global batch x --seq-len, no accumulation), fp32, the optimizer,
schedule and clipping, the launcher (`accelerate launch` with the ladder's ddp.yaml / zero2.yaml and DeepSpeed JSON,
2 processes, one thread each), no checkpoints, no W&B. Both are timed by one clock (benchmarks/step_clock.py: the
end of every optimizer step, on rank 0); the first --warmup steps are left out. Variants alternate within every
repeat (the order rotating), and each figure is the median over repeats. What still differs: hfdist packs whole
documents into blocks (padding the rest, a block-diagonal attention mask) where the plain script concatenates the
text and cuts it (no padding, plain causal attention); hfdist's callbacks (memory, throughput, progress) run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from step_clock import CLOCK, add_run_arguments, clocked_run, load_line, tokens_per_s

from measure import REPO, recorded, results_dir

MEASURED_ON = None  # results/<hardware> names the GPUs where there are any: the fine-tuning job's device

FINETUNE = REPO / "scripts" / "finetune.py"
PLAIN = REPO / "benchmarks" / "plain_trainer.py"
CONFIGS = REPO / "hfdist" / "configs"
RUNGS = ("ddp", "zero2")
NPROC = 2


def _model_and_data(folder: Path) -> tuple[Path, Path]:
    """The embedded default model (seeded init) with its tokenizer as an HF folder, and the embedded conversations
    as a JSON Lines file of plain text (one conversation per line)."""
    from hfdist.data import load_raw_dataset, load_tokenizer
    from hfdist.models.build import build_model
    from hfdist.models.presets import DEFAULT_PRESET

    tokenizer = load_tokenizer(None, is_preset=True)
    model_dir, data = folder / "model", folder / "text.jsonl"
    build_model(DEFAULT_PRESET, vocab_size=len(tokenizer), seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with data.open("w") as f:
        for row in load_raw_dataset(None):
            text = "\n".join(f"{m['role']}: {m['content']}" for m in row["messages"])
            f.write(json.dumps({"text": text}) + "\n")
    return model_dir, data


def _mask_cost(args, steps: int = 8) -> float:
    """CPU time of one forward + backward with hfdist's block-diagonal mask (two documents per row) over the same
    batch with plain causal attention (no mask), one thread, medians after two warm-up steps: what keeping documents
    apart costs the model, apart from anything hfdist runs around it. CPU time, so other jobs on the machine do not
    move it."""
    import torch

    from hfdist.data.collation import block_causal_mask
    from hfdist.models.build import build_model
    from hfdist.models.presets import DEFAULT_PRESET

    torch.set_num_threads(1)
    model = build_model(DEFAULT_PRESET, seed=0).train()
    model.config.use_cache = False
    rows, seq = args.global_batch // NPROC, args.seq_len
    ids = torch.randint(0, model.config.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq).repeat(rows, 1)
    positions[:, seq // 2:] -= seq // 2
    masked = {"attention_mask": block_causal_mask(positions), "position_ids": positions}

    def cpu_seconds(extra: dict) -> float:
        start = time.process_time()
        model(input_ids=ids, labels=ids, **extra).loss.backward()
        model.zero_grad()
        return time.process_time() - start

    plain, block = [], []
    for _ in range(steps):
        plain.append(cpu_seconds({}))
        block.append(cpu_seconds(masked))
    return statistics.median(block[2:]) / statistics.median(plain[2:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(variant: str, args, model: Path, data: Path, out: Path) -> list[str]:
    """`accelerate launch` of the step clock around hfdist's job or the plain script, in the rung's world."""
    tool, rung = variant.split("-")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(CONFIGS / "accelerate_configs" / f"{rung}.yaml"), "--num_processes", str(NPROC),
              "--num_machines", "1", "--main_process_port", str(_free_port())]
    ds_json = CONFIGS / "ds_configs" / f"{rung}.json"
    launch += ["--deepspeed_config_file", str(ds_json)] if rung == "zero2" else ["--mixed_precision", "no"]
    common = ["--seq-len", str(args.seq_len), "--max-steps", str(args.steps), "--learning-rate", "1e-3",
              "--warmup-steps", "10", "--output-dir", str(out)]
    if tool == "hfdist":
        # --num-processes: the launched world's size; without it hfdist scales the rung to every GPU of the host
        # (one process per GPU) and refuses this 2-process world.
        script = [str(FINETUNE), "--config", rung, "--num-processes", str(NPROC), "--model", str(model), "--dataset",
                  str(data), "--global-batch-size", str(args.global_batch), "--save-steps", "0", "--no-wandb", *common]
    else:
        script = [str(PLAIN), "--model", str(model), "--data", str(data),
                  "--per-device-batch-size", str(args.global_batch // NPROC), *common]
        script += ["--deepspeed", str(ds_json)] if rung == "zero2" else []
    return [*launch, str(CLOCK), *script]


def _write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(result, indent=2))
    med = result["median_tokens_per_s"]
    rows = "".join(
        f"| {rung} | {med[f'hfdist-{rung}']:,.0f} | {med[f'plain-{rung}']:,.0f} | "
        f"{result['hfdist_vs_plain'][rung]:.3f} | "
        f"{', '.join(f'{x:,.0f}' for x in result['runs'][f'hfdist-{rung}'])} | "
        f"{', '.join(f'{x:,.0f}' for x in result['runs'][f'plain-{rung}'])} |\n" for rung in RUNGS)
    (out / "overhead.md").write_text(
        f"# hfdist against plain accelerate + Trainer ({out.name})\n\n`{result['command']}` "
        f"({result['wall_seconds'] / 60:.0f} min)\n\n"
        f"{result['model']}, seq {result['seq_len']} x global batch {result['global_batch']} tokens per step, "
        f"fp32, {NPROC} processes x 1 thread, {result['steps']} steps of which the first {result['warmup']} are "
        f"left out, {result['repeats']} alternating repeats; tokens/s = tokens per step x steps / time between "
        f"step ends (rank 0).\n\n"
        f"| rung | hfdist tokens/s (median) | plain Trainer tokens/s (median) | hfdist / plain | hfdist runs | "
        f"plain runs |\n|---|---|---|---|---|---|\n{rows}\n"
        f"What differs: {result['differences']}\n\n"
        f"The block-diagonal mask alone: one forward + backward of a rank's batch (two documents per row) takes "
        f"{result['block_mask_cpu_time_vs_causal']:.3f}x the CPU time of plain causal attention on the same batch "
        f"(one thread, median of 6).\n\n"
        f"{load_line(result['load_average'], result['cpu_count'])}\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p)
    args = p.parse_args()
    start, load_before = time.perf_counter(), os.getloadavg()
    variants = [f"{tool}-{rung}" for rung in RUNGS for tool in ("hfdist", "plain")]
    runs: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        model, data = _model_and_data(Path(tmp))
        for i in range(args.repeats):
            order = variants[i % len(variants):] + variants[:i % len(variants)]
            for variant in order:
                out = Path(tmp) / f"repeat-{i}" / variant
                record = clocked_run(_command(variant, args, model, data, out / "run"), out)
                runs[variant].append(tokens_per_s(record, args))
            print(f"repeat {i + 1}/{args.repeats}: " + ", ".join(f"{v} {runs[v][-1]:,.0f}" for v in variants),
                  flush=True)
    median = {v: statistics.median(r) for v, r in runs.items()}
    mask_cost = _mask_cost(args)
    command = [sys.executable, str(Path(__file__).resolve()), "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--repeats", str(args.repeats), "--seq-len", str(args.seq_len), "--global-batch",
               str(args.global_batch)]
    result = {"command": recorded(command), "model": "llama-small (embedded default shape, seeded init)",
              "seq_len": args.seq_len, "global_batch": args.global_batch, "steps": args.steps,
              "warmup": args.warmup, "repeats": args.repeats, "processes": NPROC, "cpu_count": os.cpu_count(),
              "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
              "wall_seconds": time.perf_counter() - start, "runs": runs, "median_tokens_per_s": median,
              "hfdist_vs_plain": {r: median[f"hfdist-{r}"] / median[f"plain-{r}"] for r in RUNGS},
              "block_mask_cpu_time_vs_causal": mask_cost,
              "differences": __doc__.split("What still differs: ")[1].strip().replace("\n", " ")}
    _write(results_dir(args.out, MEASURED_ON), result)
    print("hfdist / plain: " + ", ".join(f"{r} {v:.3f}" for r, v in result["hfdist_vs_plain"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
