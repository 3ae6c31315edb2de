"""`hfdist tune` from start to end: the refusals that need no process, the machine's measurement, the candidates,
the session of probes, the report."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from hfdist.config.finetune import ConfigError, FinetuneConfig
from hfdist.errors import HfdistError
from hfdist.plan.cost import NOMINAL_HARDWARE
from hfdist.plan.layouts import Cluster
from hfdist.tune.options import TuneOptions

__all__ = ["TuneError", "tune", "MIN_BUDGET_MINUTES"]

# A probe starts its world, builds the model and trains a few steps: under a minute for a small model here, more
# on a GPU (tests/e2e/test_tune_job.py; results/cpu-2core/tune.md).
MIN_BUDGET_MINUTES = 1.0


class TuneError(HfdistError, ValueError):
    """A tune that cannot run as asked: the budget, the cluster, nothing that fits."""


def _world(cfg: FinetuneConfig, opts: TuneOptions, on_gpu: bool) -> Cluster:
    import torch

    if opts.nodes > 1:
        raise TuneError(f"hfdist tune probes on the node it runs on, and --nodes {opts.nodes} asks for more. Tune the "
                        "layouts of one node here (--nodes 1), and plan the whole cluster with `hfdist plan "
                        f"--nodes {opts.nodes}`; the degrees inside a node (tp, cp) carry over.")
    devices = opts.gpus_per_node or cfg.num_processes or (torch.cuda.device_count() if on_gpu else 4)
    if on_gpu and devices > torch.cuda.device_count():
        raise TuneError(f"hfdist tune was asked for {devices} GPUs, but this node has {torch.cuda.device_count()}. "
                        "Pass --gpus-per-node (or --num-processes) of at most that.")
    return Cluster(devices)


def _memory_bytes(cfg: FinetuneConfig, cluster: Cluster, on_gpu: bool) -> int:
    """What one rank may use: --gpu-mem-gb, the GPU's memory, or on a CPU the host's available memory shared by the
    ranks."""
    import torch

    if cfg.gpu_mem_gb is not None:
        return int(cfg.gpu_mem_gb * 1e9)
    if on_gpu:
        return int(torch.cuda.get_device_properties(0).total_memory)
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return available // cluster.world


def _nothing_fits(cfg: FinetuneConfig, opts: TuneOptions, config, cluster: Cluster, memory: int,
                  skipped) -> TuneError:
    from hfdist.plan import plan_rungs

    plan = plan_rungs(config, gpus_per_node=cluster.gpus_per_node, gpu_mem_bytes=memory, seq=cfg.seq_len,
                      global_batch=cfg.global_batch_size, micro_batch=None, activation_checkpointing=None,
                      lora=cfg.lora, qlora=cfg.qlora, model=cfg.model or "model")
    fix = plan.hint or (f"{plan.recommended.name} fits by the plan but not with tune's margin: lower --margin"
                        if plan.recommended else "see `hfdist plan`")
    reasons = "; ".join(f"{s.what}: {s.reason}" for s in skipped[:3])
    return TuneError(f"No layout of the rungs asked for fits {cluster.world} rank(s) of {memory / 1e9:.1f} GB with "
                     f"a {opts.margin:.0%} margin for this job ({reasons}{'; ...' if len(skipped) > 3 else ''}). Fix: {fix}")


def tune(cfg: FinetuneConfig, opts: TuneOptions, command: str) -> int:
    """Run `hfdist tune` for the job `cfg`; returns the exit code (0 with a winner, 1 without)."""
    import torch

    from hfdist.models.presets import DEFAULT_PRESET, load_config
    from hfdist.tune.candidates import tiebreak_candidates, tune_candidates
    from hfdist.tune.report import probe_table, write_report
    from hfdist.tune.session import measure_hardware, run_session

    if opts.budget < MIN_BUDGET_MINUTES:
        raise TuneError(f"--budget {opts.budget:g} minutes cannot hold one probe: each starts the job's processes, "
                        f"builds the model and trains {opts.probe_steps} steps. Give at least {MIN_BUDGET_MINUTES:g} "
                        "minute (a few probes: 10 or more).")
    if cfg.resume:
        raise ConfigError("hfdist tune runs the job from its start in every probe; --resume belongs to the run tune "
                          "chooses (`hfdist finetune tune.yaml --resume`). Leave it out here.")
    on_gpu = torch.cuda.is_available()
    cluster = _world(cfg, opts, on_gpu)
    cfg = replace(cfg, model=cfg.model or DEFAULT_PRESET)
    config = load_config(cfg.model)
    memory = _memory_bytes(cfg, cluster, on_gpu)
    nominal, skipped = tune_candidates(cfg, opts, config, cluster, memory_bytes=memory, hardware=NOMINAL_HARDWARE,
                                       on_gpu=on_gpu)
    if not nominal:
        raise _nothing_fits(cfg, opts, config, cluster, memory, skipped)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"hfdist tune: {len(nominal)} candidate layout(s) fit {cluster.world} rank(s) of {memory / 1e9:.1f} GB; "
          "measuring this machine", flush=True)
    dtype = "bf16" if any(c.numerics != "fp32" for c in nominal) else "fp32"
    hardware = measure_hardware(out, cluster.world, int(config.hidden_size), int(config.intermediate_size), dtype)
    candidates, skipped = tune_candidates(cfg, opts, config, cluster, memory_bytes=memory, hardware=hardware,
                                          on_gpu=on_gpu)
    tiebreaks = tiebreak_candidates(cfg, opts, config, cluster, candidates, memory_bytes=memory,
                                    single_memory_bytes=_memory_bytes(cfg, Cluster(1), on_gpu), hardware=hardware,
                                    on_gpu=on_gpu)
    result = run_session(cfg, opts, candidates, skipped, hardware, on_gpu=on_gpu, tiebreaks=tiebreaks,
                         say=lambda line: print(line, flush=True))
    written = write_report(cfg, result, out, command)
    print("\n" + probe_table(result), flush=True)
    if result.winner is None:
        print(f"hfdist tune: nothing chosen: no probe both ran and was checked by another layout that agrees with it"
              f"{f' ({result.unsettled})' if result.unsettled else ''}; see {out / 'tune.md'}", flush=True)
        return 1
    print(f"\nhfdist tune: chosen: {result.winner.describe} ({result.winner.tokens_per_second:,.0f} tokens/s); run "
          f"it with `hfdist finetune {out / 'tune.yaml'}`", flush=True)
    print("\n".join(f"wrote {p}" for p in written), flush=True)
    return 0
