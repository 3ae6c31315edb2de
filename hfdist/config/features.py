"""Options beyond a rung's parallelism (--compile, --qlora, --fp8): the rung table says which rungs take each, and
`refuse_unless` refuses the others before any process starts.

The entry that speaks for a run's rung is its own, unless the command line gave it an axis its shipped YAML lacks
(`--config fsdp_full_shard --pp 2` is a pipeline) or it has none (a user's YAML, a launcher's environment): then it
is the first rung of the table with the same shape (strategy, ZeRO stage, offload, pipeline, tensor and context
parallelism), so a user's FSDP1 full-shard YAML answers as fsdp_full_shard does and an unknown shape is refused.
"""

from __future__ import annotations

from hfdist.config.finetune import ConfigError
from hfdist.config.ladder import Rung, known_rung_names, load_rung
from hfdist.config.rungs import FEATURE_FLAGS, FEATURES, RUNG_INFO, rungs_where

__all__ = ["refuse_unless", "rungs_taking", "speaking_entry"]


def _shape(rung: Rung) -> tuple:
    """What decides whether an option can run: who applies the parallelism and which axes it has."""
    return (rung.kind, rung.zero_stage, rung.offload_param, rung.offload_optimizer, rung.uses_pipeline, rung.uses_tp,
            rung.dims.cp > 1, rung.dims.ep > 1 and not rung.uses_tp)


def speaking_entry(rung: Rung) -> str | None:
    """The name of the table entry that answers for `rung` (see the module docstring), or None if no rung of the
    table has its shape."""
    shape = _shape(rung)
    listed = {"single", *known_rung_names()}
    for name in dict.fromkeys([rung.name, *RUNG_INFO]):
        if name in RUNG_INFO and name in listed and _shape(load_rung(name)) == shape:
            return name
    return None


def rungs_taking(feature: str) -> list[str]:
    """The rungs whose entry takes `feature` (a FEATURES key), in table order."""
    return rungs_where(lambda info: info.takes(feature))


def refuse_unless(rung: Rung, feature: str) -> None:
    """Refuse `--<feature>` on a rung whose table entry does not take it, before any process starts.

    Raises:
        ConfigError: one paragraph naming the rung, why it does not take the option and the rungs that do.
    """
    if feature not in FEATURES:
        raise ValueError(f"unknown feature {feature!r}; the rung table has {', '.join(FEATURES)}")
    name = speaking_entry(rung)
    verdict = getattr(RUNG_INFO[name], feature) if name is not None else False
    if verdict is True:
        return
    if name is None:
        why = "no rung of hfdist's table has its layout, so nothing says the option is built for it"
    else:
        why = verdict or "hfdist's recipe for it does not cover this rung yet"
    shaped = f" (laid out as {name})" if name not in (None, rung.name) else ""
    takers, flag = rungs_taking(feature), FEATURE_FLAGS.get(feature, f"--{feature}")
    fix = (f"Drop {flag}, or use a rung that takes it: {', '.join(takers)} (or a YAML of theirs)." if takers
           else f"Drop {flag}: no rung takes it yet.")
    raise ConfigError(f"{flag} does not run on {rung.name}{shaped}: {why}, and hfdist has not verified "
                      f"{FEATURES[feature]} there. {fix}")
