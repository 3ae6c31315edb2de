"""Worker of benchmarks/bench_load_memory.py: `torchrun --nproc-per-node N load_memory_worker.py CKPT METHOD OUT.json`.

Loads the bf16 checkpoint CKPT into fsdp_full_shard on N ranks, in fp32, one way (METHOD):
- from_pretrained: every rank builds the whole model with transformers' from_pretrained, then shards it (the path
  hfdist took before it built on the meta device);
- dcp_stock: hfdist's recipe (meta device, shard, materialise the local shards) filled through DCP's stock
  HuggingFaceStorageReader, which keeps each file mapped while it reads all of that file's slices;
- hfdist: the recipe as the job runs it (hfdist.models.load: the file opened per tensor).
Each rank records the peak memory the load added above its baseline (Linux VmHWM, restarted at the baseline) and
the seconds it took; rank 0 writes them to OUT.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main(checkpoint: str, method: str, out: str) -> None:
    from hfdist.config.ladder import load_rung
    from hfdist.metrics.memory import peak_memory_bytes, start_peak_window
    from hfdist.models import load as load_module
    from hfdist.models.build import meta_model
    from hfdist.models.load import weight_plan
    from hfdist.parallel.parallelize import parallelize

    from measure import gather

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    rung = load_rung("fsdp_full_shard").with_num_processes(world)
    cpu = torch.device("cpu")
    if method == "dcp_stock":
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        load_module.SafetensorsSliceReader = HuggingFaceStorageReader
    model_bytes = 4 * sum(p.numel() for p in meta_model(checkpoint).parameters())
    baseline = start_peak_window(cpu)
    start = time.perf_counter()
    if method == "from_pretrained":
        from transformers import AutoModelForCausalLM

        from hfdist.parallel.fsdp import apply_fsdp

        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        apply_fsdp(model, rung.dims.build_mesh("cpu")["dp_shard"])
    else:
        model = meta_model(checkpoint)
        parallelize(model, rung, device=cpu, mixed_precision="no", activation_checkpointing=False,
                    weights=weight_plan(model, Path(checkpoint), seed=0))
    record = {"rank": dist.get_rank(), "added_x_fp32": (peak_memory_bytes(cpu) - baseline) / model_bytes,
              "seconds": time.perf_counter() - start}
    records = gather(record)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"method": method, "world": world, "model_fp32_bytes": model_bytes,
                                         "ranks": records}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
