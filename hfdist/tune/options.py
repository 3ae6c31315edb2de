"""TuneOptions: the settings of `hfdist tune` beyond the job's own (one source, as the job's: hfdist.config.options)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from hfdist.config.arg_types import fraction, names, positive_float, positive_int
from hfdist.config.options import OptionGroup, option

__all__ = ["TuneOptions", "CONSIDER", "TUNE", "consider_list"]

# What tune may change besides the rung and its degrees (always searched unless the job pins them).
CONSIDER = ("micro-batch", "recompute", "compile", "fp8")


def consider_list(text: str) -> tuple[str, ...]:
    """argparse type of --consider: names from CONSIDER, or none (the rung and its degrees only)."""
    if text.strip() == "none":
        return ()
    given = names(text)
    unknown = [n for n in given if n not in CONSIDER]
    if unknown:
        raise argparse.ArgumentTypeError(f"cannot consider {', '.join(unknown)}: choose from {', '.join(CONSIDER)}")
    return given


TUNE = OptionGroup("Tune", "What hfdist tune may change, how long it may probe, and where it writes. The job's own "
                   "options (above, or a job file) say what is trained; tune never changes them.")


@dataclass(frozen=True)
class TuneOptions:
    """How `hfdist tune` searches (docs/tune.md)."""

    budget: float = option(30.0, "Minutes the probes may take in all (default {default}); tune stops starting "
                           "probes that would not end in time.", group=TUNE, type=positive_float, metavar="MIN")
    configs: tuple[str, ...] | None = option(
        None, "Comma-separated rungs to consider (default: every shipped rung but single and the offload rungs).",
        group=TUNE, type=names, metavar="RUNGS")
    consider: tuple[str, ...] = option(
        ("micro-batch", "recompute"), "Comma-separated settings tune may change besides the rung and its degrees, "
        f"from {', '.join(CONSIDER)}, or none (default {{default}}); the others stay the job's.", group=TUNE,
        type=consider_list, metavar="NAMES")
    gpus_per_node: int | None = option(
        None, "Devices to tune for (default: the GPUs of this node; on CPU the job's --num-processes, else 4).",
        group=TUNE, type=positive_int)
    nodes: int = option(1, "Nodes (default {default}; tune probes on this one node).", group=TUNE,
                        type=positive_int)
    probe_steps: int = option(5, "Optimizer steps per probe; the first is a warm-up left out of the measurement "
                              "(default {default}).", group=TUNE, type=positive_int, metavar="N")
    margin: float = option(0.1, "Memory a candidate must leave free by the plan, as a share of a device "
                           "(default {default}).", group=TUNE, type=fraction)
    exhaustive: bool = option(False, "Probe every candidate, not only those the cost model cannot rule out (a "
                              "sweep: the reference bench_tune compares tune with).", group=TUNE)
    out: str = option("outputs/tune", "Where tune writes the probes, its log (a rerun resumes from it), tune.md, "
                      "tune.json and tune.yaml (default {default}).", group=TUNE, metavar="DIR")
