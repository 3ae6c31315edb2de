"""Worker for tests/e2e/test_cells.py: `torchrun --nproc-per-node N tests/e2e/cells_worker.py CASES.json OUT.json`.

Trains every case of CASES.json (a list of {"id", "args", "output_dir"[, "env"]}: the job's command line, and the
variables a case adds to the environment) one after the other
in this one world, each through the job's own path as a launched rank runs it: the command line parsed
(hfdist.config.finetune.parse_command), the rung resolved against the world, the checks before launch
(hfdist.job.preflight), the world and the launcher's environment checked (hfdist.job.launch.ensure_world), then
hfdist.job.run.train_in_world: the Trainer with the job's defaults and callbacks, verification of the strategy before
step 1, the summary written by rank 0 into the case's output folder. What a launch of its own would add is the
process start-up (a few seconds of imports per rank), which is what one world for many cases saves.

Between cases: accelerate's state, transformers' DeepSpeed config and dynamo's caches are reset (each launch starts
without them), and the environment accelerate's launcher gives a rank of the case's rung is set
(ACCELERATE_USE_DEEPSPEED and its siblings, computed by accelerate's own launch functions from the rung's launch
arguments). A case that raises on every rank is recorded with its traceback and the next one runs; rank 0 prints
`cell: start ID` before each, so a case that ends the process (a hang report's exit) is named in the log.
Rank 0 writes {id: {"error": traceback | None, "seconds": wall time, "resident_mib": its memory after it}} to
OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch.distributed as dist

# What accelerate's launcher sets in a rank's environment, by prefix (the rest of the environment is the parent's).
_LAUNCHER_PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")


def launcher_env(rung) -> dict[str, str]:
    """The variables accelerate's launcher gives a rank of `rung` (its hand-over's arguments, as the job builds
    them), with the prefixes above."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    from hfdist.job.launch import accelerate_arguments

    args = launch_command_parser().parse_args(accelerate_arguments(rung, [__file__], [], on_gpu=False))
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed and not args.cpu:  # as accelerate's launch_command does before its DeepSpeed launcher
        fields = list(defaults.deepspeed_config) if defaults else []
        args.deepspeed_fields_from_accelerate_config = ",".join(fields + (["mixed_precision"] if mp_from_config else []))
        env = prepare_deepspeed_cmd_env(args)[1]
    elif (args.use_fsdp or args.multi_gpu) and not args.cpu:
        env = prepare_multi_gpu_env(args)
    else:
        env = prepare_simple_launcher_cmd_env(args)[1]
    return {k: v for k, v in env.items() if k.startswith(_LAUNCHER_PREFIXES)}


def _set_launcher_env(rung) -> None:
    """os.environ as accelerate's launcher makes it for a rank of `rung`: the earlier case's launcher variables (and
    those the libraries set from them, such as transformers' ACCELERATE_USE_DEEPSPEED) gone first."""
    for key in [k for k in os.environ if k.startswith(_LAUNCHER_PREFIXES)]:
        del os.environ[key]
    if rung.yaml_path is not None:
        os.environ.update(launcher_env(rung))


def _reset_between_cases(nvme: bool) -> None:
    """What a fresh process would not hold: accelerate's singletons, transformers' DeepSpeed config, DeepSpeed's stack
    of modules in forward and its record of its AutoTP initialisation, dynamo's compiled graphs; after an NVMe-offload
    case (`nvme`), DeepSpeed's swap buffers: 2 GB of page-locked host memory per rank, which its engine keeps alive
    past the case (held in reference cycles through hooks torch keeps outside Python's collector; about 45 MB a case
    without the buffers). No collection of the whole heap here: the Trainer's own free_memory makes one per case."""
    import deepspeed.runtime.tensor_parallel.init_utils as autotp_init
    import deepspeed.runtime.zero.parameter_offload as zero3_offload
    import torch._dynamo
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    if nvme:
        import gc

        from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper

        # type(), not isinstance(): gc also lists weak proxies, whose isinstance raises once their object is gone.
        for swapper in [o for o in gc.get_objects() if type(o) is AsyncPartitionedParameterSwapper]:
            # DeepSpeed's page-locked buffers are process-wide: only their handle frees them (as its own
            # SwapBufferManager.__del__ does for the optimizer's).
            for name, handle in (("buffers", "aio_read_handle"), ("partitioned_swap_buffer", "aio_write_handle")):
                if getattr(swapper, name, None) is not None:
                    getattr(swapper, handle).free_cpu_locked_tensor(getattr(swapper, name))
                    setattr(swapper, name, None)
    zero3_offload.FWD_MODULE_STACK.clear()
    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()
    autotp_init._TP_MODEL_INIT_ARGS = None
    torch._dynamo.reset()


def _resident_mib() -> float:
    """This process's resident memory now (MiB), from /proc."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_case(argv: list[str]) -> None:
    """One case through the job's path after the launch (module docstring)."""
    from hfdist.config.dims import batch_layout
    from hfdist.config.finetune import parse_command
    from hfdist.job.launch import ensure_world
    from hfdist.job.preflight import plan_context_parallel, preflight
    from hfdist.job.run import train_in_world
    from hfdist.job.world import resolve_rung

    cfg, _ = parse_command(argv)
    rung = plan_context_parallel(cfg, resolve_rung(cfg))
    preflight(cfg, rung, batch_layout(cfg.global_batch_size, cfg.micro_batch_size, rung.dims.dp)[0])
    _set_launcher_env(rung)
    assert ensure_world(rung, cfg, [__file__], argv) is None  # this world is the rung's (a launch would start none)
    code = train_in_world(cfg, rung)
    if code != 0:
        raise RuntimeError(f"the job's ranks returned {code}")


def _freeze_imports() -> None:
    """Import what every case runs, then move the heap so far (some 600,000 objects of torch, transformers, DeepSpeed
    and the rest, measured) out of the collector's sight: each case's full collections (the Trainer's free_memory
    makes one per case, the allocation count more) then scan what the cases made, 0.3 s less each than a heap of
    imports (measured). Objects live for the process anyway: nothing is kept that would have been freed. The
    collector is paused while they are made, as in a job's processes (hfdist.job.collector)."""
    from hfdist.job.collector import pause_collector, resume_collector

    pause_collector()
    import deepspeed  # noqa: F401
    import transformers.trainer  # noqa: F401

    import hfdist.job.run  # noqa: F401

    resume_collector()


def main(cases_path: str, out_path: str) -> None:
    _freeze_imports()
    launched = "WORLD_SIZE" in os.environ  # the references run as one process does, without a process group
    if launched:
        os.environ["HFDIST_HANDED_OVER"] = "1"  # as in a hand-over's ranks (the launcher's checks: each case's)
        dist.init_process_group("gloo")
    rank = dist.get_rank() if launched else 0
    cases = json.loads(open(cases_path).read())
    results = {}
    for case in cases:
        if rank == 0:
            print(f"cell: start {case['id']}", flush=True)
        started, error = time.perf_counter(), None
        os.environ.update(case.get("env", {}))  # a fault a case plants (hfdist.train.injected_faults)
        try:
            run_case([*case["args"], "--output-dir", case["output_dir"]])
        except BaseException:  # noqa: BLE001 - recorded for the test, which names the case
            error = traceback.format_exc()
        for key in case.get("env", {}):
            del os.environ[key]
        _reset_between_cases(nvme="--nvme-path" in case["args"])
        if launched:
            dist.barrier()
        results[case["id"]] = {"error": error, "seconds": round(time.perf_counter() - started, 2),
                               "resident_mib": round(_resident_mib())}
    if rank == 0:
        with open(out_path, "w") as out:
            json.dump(results, out, indent=1)
    if launched:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
