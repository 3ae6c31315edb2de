"""The machine's own rates, measured by a short launch of the world the probes will run on: what the cost model
(hfdist.plan.cost.Hardware) predicts step times with under `hfdist tune`.

    python -m torch.distributed.run --standalone --nproc-per-node N -m hfdist.tune.hardware OUT.json --hidden H \
        --intermediate I --dtype fp32

Every rank at once (so each sees the share of the machine it will have in training):
- matmuls of the model's shape ((rows x hidden) @ (hidden x intermediate)) at four row counts; the rate at rows M
  is fitted as peak x M / (M + M_half) (1 / rate is linear in 1 / M: least squares);
- a copy of 64 MiB (memory bandwidth: two bytes moved per byte copied);
- all-gathers over the whole group of 4 KiB (latency) and 16 MiB (bus bandwidth: (n - 1) / n of the buffer per
  rank), gloo on a CPU host and NCCL on GPUs;
- on a GPU, a pinned host-to-device copy of 64 MiB (the host link);
- the workspace, on a GPU: two training steps (forward, backward, AdamW) of hfdist's tiny Llama on 16 tokens,
  whose own gradients, optimizer state and activations are a few MB: the rest of the allocator's peak (cuBLAS
  workspaces, the caching allocator's rounding), plus what the card holds outside the allocator (the CUDA context,
  NCCL's buffers), is what every training rank holds besides its model's tensors; at least 1 GiB (NCCL's buffers
  of the mesh groups the measurement does not make). On a CPU the probes' figure is the tensors a step holds (hfdist.callbacks.memory: training_peak_bytes),
  so nothing besides them is planned: counting the resident set's growth there (kernels' code, the autograd
  engine's threads, ~8 MB) over-planned small layouts by up to 50% (results/cpu-2core/tune.md).
Each figure is the best of a few windows of back-to-back calls (other work on a machine only ever slows a window
down), the ranks lined up by a barrier between windows, never inside one (hfdist.metrics.timing). Rank 0 writes the Hardware
as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["measure", "hardware_from_json", "ROWS"]

ROWS = (64, 256, 1024, 4096)
_GPU_WORKSPACE_FLOOR = 2**30


def _fit_rate(rows: tuple[int, ...], rates: list[float]) -> tuple[float, float]:
    """(peak, half-rate rows) of rate(M) = peak M / (M + half), by least squares on 1 / rate = a + b / M."""
    xs, ys = [1 / m for m in rows], [1 / r for r in rates]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    if a <= 0:  # the smallest matmuls were the fastest: no slowdown to model
        return max(rates), 0.0
    return 1 / a, max(b / a, 0.0)


def _workspace(device) -> int:
    """Bytes two training steps of a tiny model add beyond its gradients and optimizer state on a GPU; 0 on a CPU
    (module docstring)."""
    import torch

    if device.type == "cpu":
        return 0

    from hfdist.metrics.memory import peak_memory_bytes, rank_state_bytes, start_peak_window
    from hfdist.models.build import build_model

    model = build_model("llama-tiny", seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), device=device)
    start = start_peak_window(device)
    held = 0
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        state = rank_state_bytes(model, optimizer)
        held = state["grad_bytes"] + state["optimizer_bytes"]
        optimizer.zero_grad()
    # What the caching allocator does not hold but the card does: the CUDA context, NCCL's buffers (its
    # communicator ran above), cuBLAS handles. The planner's budget is the card's whole memory, so they count here.
    free, total = torch.cuda.mem_get_info(device)
    outside = max(total - free - torch.cuda.memory_reserved(device), 0)
    # NCCL allocates buffers per communicator, and a training run makes one per mesh group (tp, dp, cp, ...) where
    # this measurement made one: a floor for what it cannot see.
    return max(max(peak_memory_bytes(device) - start - held, 0) + outside, _GPU_WORKSPACE_FLOOR)


def measure(hidden: int, intermediate: int, dtype: str) -> dict:
    """This rank's part of the measurement (every rank of the initialised group calls it); rank 0 gets the
    Hardware's fields."""
    import torch
    import torch.distributed as dist

    from hfdist.metrics.timing import device_window, per_call

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    on_gpu = device.type == "cuda"
    elem = torch.bfloat16 if dtype == "bf16" and on_gpu else torch.float32

    def line_up() -> None:
        if on_gpu:
            torch.cuda.synchronize(device)
        dist.barrier()
        if on_gpu:  # NCCL's barrier is a collective on the stream: drained too, so the window starts empty
            torch.cuda.synchronize(device)

    def timed(fn: Callable[[], object], calls: int = 10) -> float:
        return per_call(fn, line_up, device_window(device), calls)

    rates = []
    weight = torch.randn(hidden, intermediate, device=device, dtype=elem)
    for rows in ROWS:
        x = torch.randn(rows, hidden, device=device, dtype=elem)
        rates.append(2 * rows * hidden * intermediate / timed(lambda: torch.mm(x, weight)))
    peak, half = _fit_rate(ROWS, rates)
    big = torch.empty(64 * 2**20 // 4, device=device)
    other = torch.empty_like(big)
    memory = 2 * big.nbytes / timed(lambda: other.copy_(big))
    world = dist.get_world_size()
    small = torch.zeros(1024 * world, device=device)
    large = torch.zeros(4 * 2**20 * world, device=device)  # 16 MiB gathered
    piece = small.chunk(world)[dist.get_rank()].clone()
    latency = timed(lambda: dist.all_gather_into_tensor(small, piece), calls=50)
    chunk = large.chunk(world)[dist.get_rank()].clone()
    seconds = timed(lambda: dist.all_gather_into_tensor(large, chunk))
    bandwidth = (world - 1) / world * large.nbytes / max(seconds - latency, 1e-9) if world > 1 else memory
    host = memory
    if on_gpu:
        pinned = torch.empty(64 * 2**20 // 4, pin_memory=True)
        host = pinned.nbytes / timed(lambda: big.copy_(pinned, non_blocking=True))
    kind = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    workspace = _workspace(device)
    return {"workspace_bytes": workspace, "matmul_flops": peak, "half_rate_rows": half, "memory_bandwidth": memory,
            "intra_node_bandwidth": bandwidth, "inter_node_bandwidth": bandwidth, "latency": latency,
            "host_bandwidth": host, "host_memory_bandwidth": memory,
            "source": f"measured by hfdist tune on this machine: {world} {kind} rank(s) at once, {dtype} matmuls of "
                      f"{hidden} x {intermediate} at {', '.join(map(str, ROWS))} rows, all-gathers over "
                      f"{'NCCL' if on_gpu else 'gloo'}"}


def hardware_from_json(path: Path):
    """The Hardware a measurement wrote."""
    from hfdist.plan.cost import Hardware

    return Hardware(**json.loads(Path(path).read_text()))


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    p = argparse.ArgumentParser(description="hfdist tune's measurement of this machine (run under torchrun)")
    p.add_argument("out", type=Path)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--intermediate", type=int, required=True)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32")
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        import os

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    try:
        figures = measure(args.hidden, args.intermediate, args.dtype)
        if dist.get_rank() == 0:
            args.out.write_text(json.dumps(figures, indent=2))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

