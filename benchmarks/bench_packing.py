"""Packing that keeps documents apart vs hfdist's old packing, and what tokenization costs.

    python benchmarks/bench_packing.py        # writes results/<hardware>/packing.{json,md}

1. Training: the same model (llama-small, fp32), data (the embedded default conversations, as `prepare` tokenizes
   and labels them), steps, batch and seed, packed two ways:
   - old (hfdist before issue 14): the documents' tokens concatenated and cut every --seq-len tokens, an all-ones
     attention mask and positions 0..S-1 per block, so tokens attend to unrelated documents before them in the
     block and documents are cut across blocks;
   - new (`hfdist.data.prepare` + `collate`): whole documents per block (best-fit decreasing), padding, restarting
     position ids, block-diagonal causal attention.
   Reported: real tokens and label tokens per step, padding fraction, the training loss reached, and the loss on
   held-out conversations (another seed of the same generator) scored each alone, which neither packing distorts.
2. Tokenization of 100k rows: the old tokenize-and-pack on instruction/response pairs vs `prepare` on the same
   pairs and on `messages` conversations (1 and 2 processes, cold cache), and `prepare` again (cached).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from measure import REPO, recorded, results_dir, worker_env

MEASURED_ON = "cpu"  # results/<hardware> names the CPU on any machine: its workers train and tokenize on the CPU

OLD_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"


def old_tokenize_and_pack(raw, tok, seq_len: int):
    """hfdist's packing before issue 14 (instruction/response pairs), kept here as the baseline it was."""
    def pack(batch):
        ids: list[int] = []
        labels: list[int] = []
        for instruction, response in zip(batch["instruction"], batch["response"]):
            prompt = [tok.bos_token_id] + tok(OLD_PROMPT.format(instruction=instruction),
                                              add_special_tokens=False).input_ids
            answer = tok(str(response), add_special_tokens=False).input_ids + [tok.eos_token_id]
            ids += prompt + answer
            labels += [-100] * len(prompt) + answer
        n = len(ids) // seq_len
        return {"input_ids": [ids[i * seq_len:(i + 1) * seq_len] for i in range(n)],
                "labels": [labels[i * seq_len:(i + 1) * seq_len] for i in range(n)]}

    return raw.map(pack, batched=True, batch_size=1000, remove_columns=raw.column_names)


def old_blocks_from(packed, seq_len: int):
    """The same documents as `packed`, concatenated in its order and cut every seq_len tokens (the old scheme)."""
    import numpy as np

    from hfdist.data.packing import padding_per_row

    ids, labels = np.asarray(packed["input_ids"]), np.asarray(packed["labels"])
    real = seq_len - padding_per_row(np.asarray(packed["position_ids"]))
    stream_ids = np.concatenate([row[:n] for row, n in zip(ids, real)])
    stream_labels = np.concatenate([row[:n] for row, n in zip(labels, real)])
    n = len(stream_ids) // seq_len
    return stream_ids[:n * seq_len].reshape(n, seq_len), stream_labels[:n * seq_len].reshape(n, seq_len)


def train(scheme: str, args) -> dict[str, Any]:
    """One training run of `scheme` ("old" or "new") in this process; its per-step figures and losses."""
    import datasets
    import numpy as np
    import torch
    from transformers import get_cosine_schedule_with_warmup

    from hfdist.data import collate, load_raw_dataset, load_tokenizer, prepare
    from hfdist.data.default import generate_conversations
    from hfdist.data.packing import padding_per_row
    from hfdist.models.build import build_model

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(None, is_preset=True)
    packed = prepare(load_raw_dataset(None), tok, args.seq_len)
    if scheme == "new":
        rows = [packed[i] for i in range(len(packed))]
        real = args.seq_len - padding_per_row(np.asarray(packed["position_ids"]))
        label_tokens = np.asarray([(np.asarray(r["labels"][1:]) != -100).sum() for r in rows])
    else:
        ids, labels = old_blocks_from(packed, args.seq_len)
        rows = [{"input_ids": a, "labels": b} for a, b in zip(ids, labels)]
        real = np.full(len(rows), args.seq_len)
        label_tokens = (labels[:, 1:] != -100).sum(axis=1)

    def batch_of(indices):
        if scheme == "new":
            return collate([rows[i] for i in indices])
        ids = torch.as_tensor(np.stack([rows[i]["input_ids"] for i in indices]), dtype=torch.long)
        return {"input_ids": ids, "labels": torch.as_tensor(np.stack([rows[i]["labels"] for i in indices]),
                                                               dtype=torch.long),
                "attention_mask": torch.ones_like(ids)}

    model = build_model("llama-small", vocab_size=len(tok), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = get_cosine_schedule_with_warmup(optimizer, 10, args.steps)
    generator = torch.Generator().manual_seed(0)
    order: list[int] = []
    losses, seconds, step_real, step_labels = [], [], [], []
    model.train()
    for _ in range(args.steps):
        if len(order) < args.batch:
            order += torch.randperm(len(rows), generator=generator).tolist()
        indices, order = order[:args.batch], order[args.batch:]
        start = time.perf_counter()
        loss = model(**batch_of(indices)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
        step_real.append(int(real[indices].sum()))
        step_labels.append(int(label_tokens[indices].sum()))
    held_out = prepare(datasets.Dataset.from_list(generate_conversations(600, seed=4321)), tok, args.seq_len)
    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for i in range(0, len(held_out), args.batch):
            batch = collate([held_out[j] for j in range(i, min(i + args.batch, len(held_out)))])
            n = int((batch["labels"][:, 1:] != -100).sum())
            total += float(model(**batch).loss) * n
            count += n
    return {"scheme": scheme, "blocks": len(rows), "padding_fraction": 1 - float(real.sum()) / (len(rows) * args.seq_len),
            "real_tokens_per_step": statistics.mean(step_real), "label_tokens_per_step": statistics.mean(step_labels),
            "losses": losses, "final_train_loss": statistics.mean(losses[-10:]), "held_out_loss": total / count,
            "median_step_seconds": statistics.median(seconds[1:])}


def tokenization(args) -> dict[str, Any]:
    """Seconds to tokenize (and pack) 100k rows each way; runs in a fresh datasets cache."""
    import datasets

    from hfdist.data import load_tokenizer, prepare
    from hfdist.data.default import generate_conversations, generate_examples

    pairs = datasets.Dataset.from_list(generate_examples(args.rows, seed=11))
    conversations = generate_conversations(3 * args.rows, seed=12)[:args.rows]  # about 2 exchanges each
    out: dict[str, Any] = {"rows": args.rows}
    with tempfile.TemporaryDirectory() as tmp:
        for name, rows in (("pairs", pairs.to_list()), ("messages", conversations)):
            path = Path(tmp) / f"{name}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tok = load_tokenizer(None, is_preset=True)
        start = time.perf_counter()
        old_tokenize_and_pack(datasets.load_dataset("json", data_files=str(Path(tmp) / "pairs.jsonl"),
                                                    split="train", cache_dir=str(Path(tmp) / "old")), tok, 128)
        out["old_pairs_1proc_s"] = time.perf_counter() - start
        for name in ("pairs", "messages"):
            for procs in (1, 2):
                cache = Path(tmp) / f"{name}-{procs}"
                raw = datasets.load_dataset("json", data_files=str(Path(tmp) / f"{name}.jsonl"), split="train",
                                            cache_dir=str(cache))
                start = time.perf_counter()
                prepare(raw, load_tokenizer(None, is_preset=True), 128, num_proc=procs)
                out[f"new_{name}_{procs}proc_s"] = time.perf_counter() - start
            start = time.perf_counter()
            prepare(raw, load_tokenizer(None, is_preset=True), 128, num_proc=2)
            out[f"new_{name}_cached_s"] = time.perf_counter() - start
    return out


def _run_worker(what: str, args, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{what}.json"
    cmd = [sys.executable, __file__, "--worker", what, "--steps", str(args.steps), "--seq-len", str(args.seq_len),
           "--batch", str(args.batch), "--rows", str(args.rows), "--threads", str(args.threads), "--out", str(out)]
    env = worker_env(args.threads)
    load = os.getloadavg()[0]
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    return {**json.loads(out.read_text()), "command": recorded(cmd, env), "load_before": load}


def _markdown(result: dict[str, Any], out_name: str) -> str:
    old, new, tok = result["old"], result["new"], result["tokenization"]
    rows = [("real (non-padding) tokens per step", "real_tokens_per_step", "{:.0f}"),
            ("label tokens per step", "label_tokens_per_step", "{:.0f}"),
            ("padding fraction", "padding_fraction", "{:.1%}"),
            ("training loss, mean of the last 10 steps", "final_train_loss", "{:.4f}"),
            ("held-out loss (each conversation alone)", "held_out_loss", "{:.4f}"),
            ("median step seconds", "median_step_seconds", "{:.3f}")]
    table = "\n".join(f"| {label} | {fmt.format(old[key])} | {fmt.format(new[key])} |" for label, key, fmt in rows)
    n = tok["rows"]
    return (
        f"# Packing that keeps documents apart vs the old packing ({out_name})\n\n"
        f"`{result['command']}`\n\nllama-small (fp32), the embedded default conversations as `prepare` labels them "
        f"(assistant turns only), {result['steps']} steps of {result['batch']} x {result['seq_len']} tokens, AdamW "
        f"lr {result['lr']}, cosine, seed 0; the two runs differ only in how the same documents are packed "
        f"(benchmarks/bench_packing.py docstring). Load average before the runs: {old['load_before']:.1f} / "
        f"{new['load_before']:.1f} (2 cores shared with other jobs: step times are indicative only).\n\n"
        f"| | old: concatenate + cut, all-ones mask | new: whole documents, block-diagonal mask |\n|---|---|---|\n"
        f"{table}\n\nThe old training loss is not comparable to the new one: it includes predictions made across "
        "document boundaries and answers cut from their prompts. The held-out loss scores both models the same "
        "way.\n\n"
        f"## Tokenization of {n:,} rows\n\nSame command; each `prepare` in a fresh datasets cache (load average before: "
        f"{tok['load_before']:.1f}).\n\n"
        "| | seconds | rows/s |\n|---|---|---|\n" + "\n".join(
            f"| {label} | {tok[key]:.1f} | {n / tok[key]:,.0f} |" for label, key in (
                ("old tokenize-and-pack, instruction/response pairs, 1 process", "old_pairs_1proc_s"),
                ("`prepare`, the same pairs (chat template), 1 process", "new_pairs_1proc_s"),
                ("`prepare`, the same pairs, 2 processes", "new_pairs_2proc_s"),
                ("`prepare`, the same pairs again (cached)", "new_pairs_cached_s"),
                ("`prepare`, `messages` conversations (1-3 exchanges), 1 process", "new_messages_1proc_s"),
                ("`prepare`, `messages` conversations, 2 processes", "new_messages_2proc_s"),
                ("`prepare`, `messages` conversations again (cached)", "new_messages_cached_s"))) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", choices=["old", "new", "tokenization"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        result = tokenization(args) if args.worker == "tokenization" else train(args.worker, args)
        args.out.write_text(json.dumps(result))
        return 0
    out = results_dir(args.out, MEASURED_ON)
    result: dict[str, Any] = {"command": recorded([sys.executable, "benchmarks/bench_packing.py", *sys.argv[1:]]),
                              "steps": args.steps, "seq_len": args.seq_len, "batch": args.batch, "lr": args.lr}
    with tempfile.TemporaryDirectory() as tmp:
        for what in ("old", "new", "tokenization"):
            result[what] = _run_worker(what, args, Path(tmp))
            print(f"{what}: done", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "packing.json").write_text(json.dumps(result, indent=2))
    (out / "packing.md").write_text(_markdown(result, out.name))
    print((out / "packing.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
