"""hfdist against its peers on one chat fine-tune: `hfdist finetune`, TRL's SFTTrainer (its default packing, wrapped
packing, no packing) and a plain transformers Trainer, on one process and on two.

    python benchmarks/bench_peers.py       # writes results/<hardware>/peers.{json,md}

Held equal: the model (llama-small, hfdist's embedded default shape, seeded init, saved as one HF folder every tool
loads), the conversations (the embedded chat data as a messages JSON Lines file; the last --heldout of them kept out
of training), the rendering (hfdist's default chat template), the global batch (--global-batch rows of --seq-len
tokens), the steps, seed, learning rate, cosine schedule, warm-up, clipping, fp32, threads (one per process), no
checkpoints, no W&B. Every run is timed by one clock (benchmarks/step_clock.py, rank 0's step ends; the first
--warmup steps left out), which also counts each rank's non-padding input tokens per step where the Trainer's
training step receives its batch: tokens/s is those tokens over the time, summed over ranks. Variants alternate
within every repeat (the order rotating); figures are medians over repeats.

What each trains on, per step: hfdist packs whole conversations into --seq-len blocks (best-fit decreasing; a
conversation longer than a block is split between exchanges), each attending only to itself, the loss on the
assistant answers. TRL (assistant_only_loss, the template marked for it): bfd packs whole conversations into
--seq-len bins (best-fit decreasing, the overflow truncated) and, padding-free, flattens a batch's bins into one
sequence whose documents are told apart by position ids only, which sdpa does not use to mask: on CPU every token
attends to every earlier token of the whole batch (--global-batch x --seq-len of them); wrapped concatenates the
conversations and cuts blocks (documents attend to each other, conversations cut anywhere); none pads each
conversation to the batch's longest (truncated at --seq-len). The plain Trainer concatenates the rendered text and
cuts blocks (run_clm), the loss on every token.

Held-out loss: each trained model scores every held-out conversation alone (one sequence, no padding, no packing),
the loss on the assistant answers as hfdist encodes them, averaged over their tokens: what each way of packing
costs in quality, measured the same way for all.
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

from step_clock import CLOCK, clocked_run, load_line

from measure import REPO, recorded, results_dir

MEASURED_ON = None  # results/<hardware> names the GPUs where there are any: the fine-tuning job's device

FINETUNE = REPO / "scripts" / "finetune.py"
TRL = REPO / "benchmarks" / "trl_sft.py"
PLAIN = REPO / "benchmarks" / "plain_trainer.py"
ACCELERATE_CONFIGS = REPO / "hfdist" / "configs" / "accelerate_configs"
# (name, processes): hfdist's rungs, TRL's packings, the plain Trainer.
VARIANTS = {1: ["hfdist", "trl-bfd", "trl-wrapped", "trl-none", "plain"],
            2: ["hfdist-ddp", "hfdist-fsdp_full_shard", "trl-bfd", "trl-wrapped", "trl-none", "plain"]}
LABELS = {"hfdist": "hfdist finetune", "hfdist-ddp": "hfdist finetune --config ddp",
          "hfdist-fsdp_full_shard": "hfdist finetune --config fsdp_full_shard",
          "trl-bfd": "TRL SFTTrainer, packing=True (default: bfd, padding-free)",
          "trl-wrapped": "TRL SFTTrainer, packing_strategy=\"wrapped\"", "trl-none": "TRL SFTTrainer, packing=False",
          "plain": "transformers Trainer (run_clm-style blocks)"}


def _trl_fsdp2_config() -> Path:
    """TRL's own FSDP2 accelerate config (what a TRL user launches 2 processes with)."""
    import trl

    return Path(trl.__file__).parent / "accelerate_configs" / "fsdp2.yaml"


def _inputs(folder: Path, heldout: int) -> dict[str, Path]:
    """The model folder, the training and held-out conversations (messages JSONL) and the training text rendered
    with the chat template (text JSONL, for the plain Trainer)."""
    from hfdist.data import load_raw_dataset, load_tokenizer
    from hfdist.data.chat import ensure_chat_template
    from hfdist.models.build import build_model
    from hfdist.models.presets import DEFAULT_PRESET

    tokenizer = load_tokenizer(None, is_preset=True)
    paths = {"model": folder / "model", "train": folder / "train.jsonl", "heldout": folder / "heldout.jsonl",
             "text": folder / "train_text.jsonl"}
    build_model(DEFAULT_PRESET, vocab_size=len(tokenizer), seed=0).save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])  # without a chat template: each tool is given the same one
    ensure_chat_template(tokenizer)
    rows = [r["messages"] for r in load_raw_dataset(None)]
    train, held = rows[:-heldout], rows[-heldout:]
    for path, part in ((paths["train"], train), (paths["heldout"], held)):
        path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in part))
    paths["text"].write_text("".join(json.dumps({"text": tokenizer.apply_chat_template(m, tokenize=False)}) + "\n"
                                     for m in train))
    return paths


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(variant: str, nproc: int, args, paths: dict[str, Path], out: Path) -> list[str]:
    """The step clock around one tool's script, on one process or `accelerate launch` of two."""
    common = ["--seq-len", str(args.seq_len), "--max-steps", str(args.steps), "--learning-rate", "1e-3",
              "--warmup-steps", str(args.steps // 10), "--output-dir", str(out)]
    tool, _, rung = variant.partition("-")
    if tool == "hfdist":
        script = [str(FINETUNE), "--model", str(paths["model"]), "--dataset", str(paths["train"]),
                  "--global-batch-size", str(args.global_batch), "--seed", "0", "--save-steps", "0", "--no-wandb",
                  *common] + (["--config", rung, "--num-processes", str(nproc)] if nproc > 1 else [])
        config = ACCELERATE_CONFIGS / f"{rung}.yaml"
    elif tool == "trl":
        script = [str(TRL), "--model", str(paths["model"]), "--data", str(paths["train"]), "--packing", rung,
                  "--per-device-batch-size", str(args.global_batch // nproc), "--seed", "0", *common]
        config = _trl_fsdp2_config()
    else:
        script = [str(PLAIN), "--model", str(paths["model"]), "--data", str(paths["text"]),
                  "--per-device-batch-size", str(args.global_batch // nproc), "--seed", "0", *common]
        config = ACCELERATE_CONFIGS / "ddp.yaml"
    if nproc == 1:
        return [sys.executable, str(CLOCK), *script]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
              str(nproc), "--num_machines", "1", "--mixed_precision", "no", "--main_process_port", str(_free_port())]
    return [*launch, str(CLOCK), *script]


def _measure(variant: str, nproc: int, args, paths: dict[str, Path], out: Path) -> dict:
    """One run: tokens/s (all ranks' tokens over rank 0's time, after the warm-up), peak resident memory (the
    largest rank's), the mean logged training loss of the last 5 steps, and what TRL ran (its record)."""
    record = clocked_run(_command(variant, nproc, args, paths, out / "run"), out)
    ranks = [json.loads((out / "clock" / f"rank-{r}.json").read_text()) for r in range(nproc)]
    ends = record["step_ends"]
    assert len(ends) == args.steps, (variant, len(ends))
    tokens = sum(sum(r["step_tokens"][args.warmup:]) for r in ranks)
    trl = out / "run" / "trl_run.json"
    return {"tokens_per_s": tokens / (ends[-1] - ends[args.warmup - 1]),
            "tokens_per_step": tokens / (args.steps - args.warmup),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
            "train_loss": statistics.mean(record["losses"][-5:]), "model_dir": str(out / "run"),
            "trl": json.loads(trl.read_text()) if trl.exists() else None}


def _heldout_loss(model_dir: str, heldout: Path) -> float:
    """The model's mean loss over the assistant tokens of every held-out conversation, each scored alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from hfdist.data import load_tokenizer
    from hfdist.data.chat import ensure_chat_template
    from hfdist.data.encode import encode_rows
    from hfdist.data.formats import detect_format

    tokenizer = load_tokenizer(None, is_preset=True)
    ensure_chat_template(tokenizer)
    rows = [json.loads(line)["messages"] for line in heldout.read_text().splitlines()]
    docs = encode_rows({"messages": rows}, list(range(len(rows))), format_name=detect_format(["messages"]).name,
                       tokenizer=tokenizer, seq_len=1024, long_documents="split")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels in zip(docs["input_ids"], docs["labels"]):
            n = sum(1 for x in labels[1:] if x != -100)
            if n:
                loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]), use_cache=False).loss
                total, count = total + float(loss) * n, count + n
    return total / count


def _row(nproc: int, variant: str, result: dict) -> str:
    runs = result["runs"][str(nproc)][variant]
    med = result["median"][str(nproc)][variant]
    speed = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in runs)
    return (f"| {nproc} | {LABELS[variant]} | {med['tokens_per_s']:,.0f} | {med['tokens_per_step']:,.0f} | "
            f"{result['hfdist_vs'][str(nproc)][variant]:.2f} | {med['peak_rss_bytes'] / 2**20:,.0f} | "
            f"{med['train_loss']:.3f} | {med['heldout_loss']:.3f} | {speed} |")


def _write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(result, indent=2))
    rows = "\n".join(_row(n, v, result) for n in result["processes"] for v in VARIANTS[int(n)])
    ran = result["trl_under_2_processes"]
    (out / "peers.md").write_text(
        f"# hfdist against TRL's SFTTrainer and a plain Trainer ({out.name})\n\n`{result['command']}` "
        f"({result['wall_seconds'] / 60:.0f} min)\n\n"
        f"llama-small (hfdist's embedded default shape, {result['parameters'] / 1e6:.1f} M parameters, seeded "
        f"init), the embedded chat data ({result['train_rows']} conversations trained on, {result['heldout_rows']} "
        f"held out), global batch {result['global_batch']} x seq {result['seq_len']}, {result['steps']} steps "
        f"(the first {result['warmup']} left out of tokens/s), lr 1e-3 cosine, fp32, one thread per process, "
        f"{result['repeats']} alternating repeats (medians). Tokens: non-padding input tokens the training steps "
        f"received, all ranks. Peak memory: the largest rank's peak resident set (VmHWM). Training loss: the "
        f"logged loss of the last 5 steps (each tool's own loss over its own tokens). Held-out loss: every held-out "
        f"conversation scored alone on its assistant answers, the same scorer for every model. \"hfdist x\": the "
        f"hfdist row of that process count (ddp under 2) over this row's tokens/s.\n\n"
        f"| processes | tool | tokens/s | tokens/step | hfdist x | peak MiB | train loss | held-out loss | runs "
        f"(tokens/s) |\n|---|---|---|---|---|---|---|---|---|\n{rows}\n\n"
        f"Under 2 processes TRL is launched with its own accelerate config ({result['trl_config']}: "
        f"distributed_type FSDP, fsdp_version 2) and really runs {ran}: accelerate's FSDP switch engages only "
        f"for GPU-like distributed types, so on CPU the model is wrapped in DistributedDataParallel (replicated, "
        f"not sharded; the wrapper above is what the Trainer held). hfdist's fsdp_full_shard row is real FSDP2 sharding "
        f"(verified by hfdist before the first step).\n\n"
        f"What each trains on: {result['what_each_trains_on']}\n\n"
        f"{load_line(result['load_average'], result['cpu_count'])} {result['load_note']}\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of tokens/s")
    p.add_argument("--repeats", type=int, default=3, help="alternating repeats (figures are medians)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--heldout", type=int, default=200, help="conversations kept out of training and scored")
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    p.add_argument("--load-note", default="", help="what else ran on the machine, as the results file says it")
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/<hardware>)")
    args = p.parse_args()
    from hfdist.models.build import meta_model
    from hfdist.models.presets import DEFAULT_PRESET

    start, load_before = time.perf_counter(), os.getloadavg()
    runs: dict[str, dict[str, list[dict]]] = {str(n): {v: [] for v in VARIANTS[n]} for n in args.processes}
    with tempfile.TemporaryDirectory() as tmp:
        paths = _inputs(Path(tmp), args.heldout)
        for i in range(args.repeats):
            for n in args.processes:
                variants = VARIANTS[n][i % len(VARIANTS[n]):] + VARIANTS[n][:i % len(VARIANTS[n])]
                for variant in variants:
                    runs[str(n)][variant].append(_measure(variant, n, args, paths, Path(tmp) / f"{i}-{n}-{variant}"))
                print(f"repeat {i + 1}/{args.repeats}, {n} process(es): " + ", ".join(
                    f"{v} {runs[str(n)][v][-1]['tokens_per_s']:,.0f}" for v in VARIANTS[n])
                    + f" tokens/s (load {os.getloadavg()[0]:.1f})", flush=True)
        for by_variant in runs.values():
            for variant_runs in by_variant.values():
                for run in variant_runs:
                    run["heldout_loss"] = _heldout_loss(run.pop("model_dir"), paths["heldout"])
        train_rows = len(paths["train"].read_text().splitlines())

    keys = ("tokens_per_s", "tokens_per_step", "peak_rss_bytes", "train_loss", "heldout_loss")
    median = {n: {v: {k: statistics.median(r[k] for r in rs) for k in keys} for v, rs in by.items()}
              for n, by in runs.items()}
    reference = {"1": "hfdist", "2": "hfdist-ddp"}
    hfdist_vs = {n: {v: median[n][reference[n]]["tokens_per_s"] / m["tokens_per_s"] for v, m in by.items()}
                 for n, by in median.items()}
    trl_2 = next((r["trl"] for r in runs.get("2", {}).get("trl-bfd", []) if r["trl"]), None)
    command = [sys.executable, str(Path(__file__).resolve()), "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--repeats", str(args.repeats), "--seq-len", str(args.seq_len), "--global-batch",
               str(args.global_batch), "--heldout", str(args.heldout), "--processes", *map(str, args.processes)]
    result = {"command": recorded(command), "model": DEFAULT_PRESET,
              "parameters": sum(t.numel() for t in meta_model(DEFAULT_PRESET).parameters()),
              "train_rows": train_rows, "heldout_rows": args.heldout, "seq_len": args.seq_len,
              "global_batch": args.global_batch, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
              "processes": [str(n) for n in args.processes], "cpu_count": os.cpu_count(),
              "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
              "load_note": args.load_note, "wall_seconds": time.perf_counter() - start,
              "trl_config": "trl/accelerate_configs/fsdp2.yaml", "trl_under_2_processes": (
                  f"{trl_2['distributed_type']} with a {trl_2['model_wrapper']} model" if trl_2 else "not measured"),
              "trl_record_2_processes": trl_2, "runs": runs, "median": median, "hfdist_vs": hfdist_vs,
              "what_each_trains_on": __doc__.split("What each trains on, per step: ")[1].split("\n\nHeld-out")[0]
              .replace("\n", " ")}
    _write(results_dir(args.out, MEASURED_ON), result)
    for n, by in hfdist_vs.items():
        print(f"{n} process(es): hfdist x " + ", ".join(f"{v} {x:.2f}" for v, x in by.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
