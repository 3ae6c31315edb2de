"""What loading a checkpoint costs each rank: a 153 M-parameter Llama (llama-medium) saved in bf16 safetensors, loaded
in fp32 into fsdp_full_shard on 1, 2 and 4 ranks, three ways (benchmarks/load_memory_worker.py).

    python benchmarks/bench_load_memory.py          # writes results/<hardware>/load_memory.{json,md}

The figure is the peak memory the load added above each rank's baseline (Linux VmHWM), in units of the model's fp32
bytes: what hfdist_summary.json records as load_peak_memory_bytes - baseline_memory_bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from measure import REPO, recorded, results_dir, torchrun, worker_env

MEASURED_ON = "cpu"  # results/<hardware> names the CPU on any machine: its workers run gloo on CPU tensors

METHODS = {"from_pretrained": "from_pretrained on every rank, then fully_shard (before)",
           "dcp_stock": "meta -> shard -> local shards, DCP's stock HuggingFaceStorageReader",
           "hfdist": "meta -> shard -> local shards, hfdist (file opened per tensor)"}
WORLDS = (1, 2, 4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = results_dir(args.out, MEASURED_ON)
    env = worker_env()
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        import torch

        from hfdist.data.load import load_tokenizer
        from hfdist.models.build import build_model

        checkpoint = Path(tmp) / "llama-medium-bf16"
        build_model("llama-medium", dtype=torch.bfloat16, seed=0).save_pretrained(checkpoint)
        load_tokenizer(None, is_preset=True).save_pretrained(checkpoint)
        for world in WORLDS:
            for method in METHODS:
                result = Path(tmp) / f"{method}-{world}.json"
                cmd = torchrun(world, REPO / "benchmarks" / "load_memory_worker.py", str(checkpoint), method,
                               str(result))
                subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
                rows.append(json.loads(result.read_text()))
                worst = max(r["added_x_fp32"] for r in rows[-1]["ranks"])
                print(f"{method:16s} world {world}: worst rank adds {worst:.3f} x the fp32 model", flush=True)
    command = recorded(["python", "benchmarks/bench_load_memory.py"])
    load = f"1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on 2 cores"
    out.mkdir(parents=True, exist_ok=True)
    (out / "load_memory.json").write_text(json.dumps({"command": command, "load": load, "runs": rows}, indent=2))
    lines = [f"# Loading a 153 M-parameter bf16 checkpoint into fp32 FSDP2 ranks ({out.name})", "",
             f"`{command}` ({load}; memory does not depend on it, seconds do). Peak memory a rank's load adds above "
             "its baseline "
             "(VmHWM), in units of the model's fp32 bytes "
             f"({rows[0]['model_fp32_bytes'] / 1e6:.0f} MB); worst rank, and the seconds it took.", "",
             "| method | " + " | ".join(f"{w} rank(s)" for w in WORLDS) + " |", "|---|" + "---|" * len(WORLDS)]
    for method, label in METHODS.items():
        cells = []
        for world in WORLDS:
            run = next(r for r in rows if r["method"] == method and r["world"] == world)
            worst = max(run["ranks"], key=lambda r: r["added_x_fp32"])
            cells.append(f"{worst['added_x_fp32']:.2f} x ({worst['seconds']:.1f} s)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    (out / "load_memory.md").write_text("\n".join(lines) + "\n")
    print(f"-> {out / 'load_memory.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
