"""Reward functions named by import path (--reward-funcs module:function,...), resolved with a clear error before
launch and again in every rank (a function is not sent between processes)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from hfdist.errors import HfdistError

__all__ = ["RewardError", "load_reward_funcs"]


class RewardError(HfdistError, ValueError):
    """A --reward-funcs entry that does not name a callable."""


def load_reward_funcs(paths: tuple[str, ...]) -> list[Callable]:
    """The callables `paths` name ("package.module:function" each), in order.

    Raises:
        RewardError: a path without ':', a module that does not import, or a name that is not a callable there.
    """
    funcs = []
    for path in paths:
        module_name, sep, attr = path.partition(":")
        if not sep or not module_name or not attr:
            raise RewardError(f"--reward-funcs {path!r} is not an import path: write module:function, e.g. "
                              "hfdist.objectives.arithmetic:correct_sum (the module importable from the job's "
                              "working directory or PYTHONPATH).")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 (ImportError, or the module's own error while importing)
            raise RewardError(f"--reward-funcs {path!r}: module {module_name!r} does not import ({type(exc).__name__}: "
                              f"{exc}). Put it on PYTHONPATH (or in the directory the job starts from) on every node, "
                              "and check the name.") from exc
        func = getattr(module, attr, None)
        if not callable(func):
            raise RewardError(f"--reward-funcs {path!r}: {module_name} has no callable {attr!r}. A reward function "
                              "takes (prompts, completions, **columns) and returns one float per completion.")
        funcs.append(func)
    return funcs
