"""QLoRA's evidence: which 4-bit implementation, what it costs and saves, and whether it learns.

    python benchmarks/bench_qlora.py                    # every part; writes results/<hardware>/qlora.{json,md}
    python benchmarks/bench_qlora.py --parts impl plan  # some of them (the others keep their last results)

Parts:
- impl: torchao's NF4Tensor vs bitsandbytes' Params4bit (bf16 storage) as the frozen base of a LoRA stack, on 2 gloo
  ranks under FSDP2 (fp32 and bf16 policies), DDP and DeepSpeed ZeRO-3 (benchmarks/qlora_impl_worker.py): does it
  train, do the loss and the adapter's gradient equal the unsharded model's, what each rank holds of the base; and one
  projection's forward + backward and quantisation time on this CPU (one thread, alternating repeats).
- train: 50 steps of QLoRA and of LoRA on the same data, model and rung (the embedded default, one process, bf16).
- scale: the 153 M-parameter checkpoint tests/e2e/test_scale_memory.py trains (llama-medium, bf16 safetensors) on
  fsdp_full_shard, 2 ranks, QLoRA vs LoRA: parameter bytes per rank, and what loading adds per rank against the bf16
  model's bytes.
- plan: `hfdist plan` for Llama-3.1-70B QLoRA on 2 x 24 GB against `hfdist simulate --qlora` of its recommendation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import REPO, recorded, results_dir, torchrun, worker_env

# results/<hardware> names the GPUs where there are any: the train and scale parts run hfdist's job on its device
# (the impl part's workers are gloo ranks on CPU tensors wherever it runs, as its table says).
MEASURED_ON = None

PARTS = ("impl", "train", "scale", "plan")
STRATEGIES = ("fsdp2", "fsdp2_bf16", "ddp", "zero3")
IMPLS = ("torchao", "bnb")


def _impl(tmp: Path, env: dict) -> dict:
    runs = []
    for strategy in STRATEGIES:
        for impl in IMPLS:
            out = tmp / f"{impl}-{strategy}.json"
            subprocess.run(torchrun(2, REPO / "benchmarks" / "qlora_impl_worker.py", impl, strategy, str(out)),
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
            runs.append(json.loads(out.read_text()) if out.is_file() else
                        {"impl": impl, "strategy": strategy, "ranks": [{"ran": False, "error": "no result"}]})
            print(f"impl {impl} {strategy}: {runs[-1]['ranks'][0].get('error') or 'ran'}", flush=True)
    speed = json.loads(subprocess.run([sys.executable, str(Path(__file__)), "--speed-only"], cwd=REPO, env=env,
                                      capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    return {"runs": runs, "speed": speed}


def _speed(repeats: int = 7) -> dict:
    """ms per forward + backward of one 3072 x 1024 projection (bf16, 512 tokens) and per quantisation."""
    import torch
    from torch import nn

    sys.path.insert(0, str(REPO / "benchmarks"))
    from qlora_impl_worker import four_bit

    torch.set_num_threads(1)
    weight = (torch.randn(3072, 1024, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    x = torch.randn(512, 1024, dtype=torch.bfloat16, requires_grad=True)
    plain = nn.Linear(1024, 3072, bias=False)
    plain.weight = nn.Parameter(weight.clone(), requires_grad=False)
    layers = {"bf16 Linear": plain, "torchao": four_bit(weight, "torchao"), "bnb": four_bit(weight, "bnb")}
    times: dict[str, list[float]] = {k: [] for k in layers}
    for layer in layers.values():
        layer(x).float().sum().backward()
    for _ in range(repeats):  # alternating: the machine's load drifts over all three alike
        for name, layer in layers.items():
            start = time.perf_counter()
            layer(x).float().sum().backward()
            times[name].append(time.perf_counter() - start)
    quantise = {}
    for name in ("torchao", "bnb"):
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            four_bit(weight, name)
            runs.append(time.perf_counter() - start)
        quantise[name] = 1e3 * min(runs)
    return {"fwd_bwd_ms_median": {k: 1e3 * sorted(v)[len(v) // 2] for k, v in times.items()},
            "quantise_ms_min": quantise, "shape": [3072, 1024], "tokens": 512, "threads": 1}


def _finetune(out: Path, *args: str, env: dict) -> dict:
    cmd = [sys.executable, str(REPO / "scripts" / "finetune.py"), "--output-dir", str(out), "--no-wandb", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "hfdist_summary.json").read_text())


def _train(tmp: Path, env: dict) -> dict:
    args = ("--max-steps", "50", "--global-batch-size", "8", "--seq-len", "64", "--save-steps", "0",
            "--mixed-precision", "bf16")
    out = {}
    for name in ("qlora", "lora"):
        summary = _finetune(tmp / f"train-{name}", *args, f"--{name}", env=env)
        out[name] = {"losses": summary["losses"], "final_loss": summary["losses"][-1]}
        print(f"train {name}: {summary['losses'][0]:.4f} -> {summary['losses'][-1]:.4f}", flush=True)
    out["final_ratio"] = out["qlora"]["final_loss"] / out["lora"]["final_loss"]
    out["command_args"] = list(args)
    return out


def _scale(tmp: Path, env: dict) -> dict:
    import torch

    from hfdist.data.load import load_tokenizer
    from hfdist.models.build import build_model

    checkpoint = tmp / "llama-medium-bf16"
    model = build_model("llama-medium", dtype=torch.bfloat16, seed=7)
    bf16_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(checkpoint)
    del model
    load_tokenizer(None, is_preset=True).save_pretrained(checkpoint)
    args = ("--config", "fsdp_full_shard", "--model", str(checkpoint), "--max-steps", "2", "--global-batch-size",
            "4", "--seq-len", "32", "--learning-rate", "1e-3", "--warmup-steps", "0", "--save-steps", "0",
            "--mixed-precision", "no")
    # Recorded with the temporary folder's path left out: a results file names no machine's paths.
    out: dict = {"model_bf16_bytes": bf16_bytes,
                 "command_args": [a.replace(str(tmp), "<tmp>") for a in args]}
    for name in ("qlora", "lora"):
        summary = _finetune(tmp / f"scale-{name}", *args, f"--{name}", env=env)
        out[name] = [{"rank": r["rank"], "param_bytes": r["param_bytes"],
                      "load_added_bytes": r["load_peak_memory_bytes"] - r["baseline_memory_bytes"],
                      "load_seconds": r["load_seconds"]} for r in summary["ranks"]]
        print(f"scale {name}: {out[name]}", flush=True)
    out["param_ratio"] = max(r["param_bytes"] for r in out["qlora"]) / min(r["param_bytes"] for r in out["lora"])
    out["load_added_x_bf16"] = max(r["load_added_bytes"] for r in out["qlora"]) / bf16_bytes
    return out


def _plan(env: dict) -> dict:
    plan_cmd = [sys.executable, "-m", "hfdist.cli", "plan", "--model", "llama-3.1-70b", "--qlora", "--gpus-per-node",
                "2", "--gpu-mem-gb", "24", "--activation-checkpointing", "--json"]
    plan = json.loads(subprocess.run(plan_cmd, cwd=REPO, env=env, capture_output=True, text=True).stdout)
    name = plan["recommended"]["name"]
    planned = next(r for r in plan["rungs"] if r["name"] == name)["per_rank_bytes"]
    sim_cmd = [sys.executable, "-m", "hfdist.cli", "simulate", "--model", "llama-3.1-70b", "--config", name,
               "--num-processes", "2", "--qlora", "--json"]
    sim = json.loads(subprocess.run(sim_cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout)
    held = sim["ranks"][0]["param_bytes"]
    return {"recommended": name, "planned_per_rank": planned, "simulated_param_bytes": held,
            "params_rel_diff": abs(planned["params"] - held) / held, "verified": sim["verified"],
            "plan_command": recorded(plan_cmd), "simulate_command": recorded(sim_cmd)}


def _markdown(results: dict, command: str) -> str:
    lines = [f"# QLoRA ({results['hardware']})", "", f"`{command}`; {results['load']}.", ""]
    impl = results.get("impl")
    if impl:
        lines += ["## The 4-bit implementation (2 gloo ranks; `impl`)", "",
                  "| implementation | strategy | trains | loss vs unsharded (rel) | adapter grad max abs diff | "
                  "4-bit base bytes held per rank (unsharded) |", "|---|---|---|---|---|---|"]
        for run in impl["runs"]:
            r = run["ranks"][0]
            cells = (["yes", f"{r['loss_rel_diff']:.1e}", f"{r['grad_max_abs_diff']:.1e}",
                      f"{r['base_bytes']:,} ({r['unsharded_base_bytes']:,})"] if r["ran"] else
                     [f"no: {r['error']}", "-", "-", "-"])
            lines.append(f"| {run['impl']} | {run['strategy']} | " + " | ".join(cells) + " |")
        speed = impl["speed"]
        lines += ["", f"One {speed['shape'][0]} x {speed['shape'][1]} projection, {speed['tokens']} tokens, bf16, "
                  f"{speed['threads']} thread: forward + backward (median of alternating repeats) and quantisation "
                  "(best of 3), ms:", "", "| | forward + backward | quantise |", "|---|---|---|"]
        for name, ms in speed["fwd_bwd_ms_median"].items():
            q = speed["quantise_ms_min"].get(name)
            lines.append(f"| {name} | {ms:.0f} | {'-' if q is None else f'{q:.0f}'} |")
    train = results.get("train")
    if train:
        lines += ["", "## 50 steps, QLoRA vs LoRA (`train`)", "",
                  f"The embedded default, one process, `{' '.join(train['command_args'])}`: QLoRA "
                  f"{train['qlora']['losses'][0]:.4f} -> {train['qlora']['final_loss']:.4f}, LoRA "
                  f"{train['lora']['losses'][0]:.4f} -> {train['lora']['final_loss']:.4f}; QLoRA's final loss is "
                  f"{train['final_ratio']:.3f} x LoRA's."]
    scale = results.get("scale")
    if scale:
        lines += ["", "## The 153 M checkpoint on fsdp_full_shard, 2 ranks (`scale`)", "",
                  f"`{' '.join(scale['command_args'])}` with --qlora / --lora (bf16 model: "
                  f"{scale['model_bf16_bytes'] / 1e6:.0f} MB).", "",
                  "| | rank | parameter bytes | loading added (x bf16 model) | load s |", "|---|---|---|---|---|"]
        for name in ("qlora", "lora"):
            for r in scale[name]:
                lines.append(f"| {name} | {r['rank']} | {r['param_bytes']:,} | {r['load_added_bytes']:,} "
                             f"({r['load_added_bytes'] / scale['model_bf16_bytes']:.2f} x) | {r['load_seconds']:.1f} |")
        lines += ["", f"QLoRA's parameter bytes per rank: {scale['param_ratio']:.3f} x LoRA's; its load adds at most "
                  f"{scale['load_added_x_bf16']:.2f} x the bf16 model's bytes."]
    plan = results.get("plan")
    if plan:
        p = plan["planned_per_rank"]
        lines += ["", "## Llama-3.1-70B QLoRA on 2 x 24 GB (`plan`)", "",
                  f"`{plan['plan_command']}` recommends {plan['recommended']} ({p['total'] / 1e9:.1f} GB per GPU, "
                  f"{p['offloaded'] / 1e9:.1f} GB per rank in CPU RAM); planned parameter bytes per rank "
                  f"{p['params'] / 1e9:.3f} GB, `{plan['simulate_command']}` holds "
                  f"{plan['simulated_param_bytes'] / 1e9:.3f} GB (verify {'passed' if plan['verified'] else 'FAILED'}"
                  f"): {plan['params_rel_diff']:.2%} apart."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--speed-only", action="store_true", help=argparse.SUPPRESS)  # the impl part's own subprocess
    args = p.parse_args()
    if args.speed_only:
        print(json.dumps(_speed()))
        return 0
    from hfdist.report.matrix import hardware_name

    out = results_dir(args.out, MEASURED_ON)
    path = out / "qlora.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    env = worker_env()
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.parts:
            if part == "impl":
                results["impl"] = _impl(Path(tmp), env)
            elif part == "train":
                results["train"] = _train(Path(tmp), env)
            elif part == "scale":
                results["scale"] = _scale(Path(tmp), env)
            else:
                results["plan"] = _plan(env)
    command = recorded(["python", "benchmarks/bench_qlora.py", "--parts", *args.parts])
    results.update(hardware=hardware_name(MEASURED_ON), command=command,
                   load=f"1-minute load average {before:.1f} before, {os.getloadavg()[0]:.1f} after, on "
                        f"{os.cpu_count()} cores shared with other work (times are noisy; bytes and losses are not)")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    (out / "qlora.md").write_text(_markdown(results, command))
    print(f"-> {out / 'qlora.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
