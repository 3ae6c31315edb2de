"""Find the Trainer and its CallbackHandler from inside a callback event, and put a callback ahead of the
Trainer's `report_to` integrations.

Why: `Trainer.log` (transformers 5.23) appends a copy of `logs` to `state.log_history`, then calls each callback's
`on_log` in list order, and the Trainer builds that list as [DefaultFlowCallback, the report_to integrations
(W&B, TensorBoard, MLflow, trackio, ...), the user's callbacks, the progress bar]. A user's callback that adds
figures to `logs` therefore runs after every integration has logged. Callbacks are given neither the Trainer nor
its CallbackHandler, so the callback finds them among its callers (the handler calls each callback directly, from
inside the Trainer's own methods) and moves itself to just after DefaultFlowCallback.
tests/unit/test_callbacks_trainer.py fails if a transformers release changes how callbacks are called.
"""

from __future__ import annotations

import sys
from typing import TypeVar

from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback, TrainerCallback

__all__ = ["find_caller", "move_ahead_of_integrations", "replace_callback"]

_MAX_DEPTH = 16  # the Trainer is three frames above a callback's event (Trainer -> handler event -> call_event)
_T = TypeVar("_T")


def find_caller(kind: type[_T]) -> _T | None:
    """The nearest object of type `kind` whose method is among the current callers (`self` of a calling frame)."""
    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, kind):
            return owner
        frame = frame.f_back
    return None


def move_ahead_of_integrations(handler: CallbackHandler, callback: TrainerCallback) -> None:
    """Move `callback` to just after the handler's DefaultFlowCallback(s), ahead of every other callback.

    Safe while the handler is iterating its list to call `callback`: the list changes in place and `callback`
    only moves to an earlier index, so the callbacks between shift by one place into positions already visited
    and every callback is still called exactly once for the current event.
    """
    callbacks = handler.callbacks
    position = next(i for i, cb in enumerate(callbacks) if cb is callback)
    target = 0
    while target < len(callbacks) and isinstance(callbacks[target], DefaultFlowCallback):
        target += 1
    if target < position:
        callbacks.insert(target, callbacks.pop(position))


def replace_callback(handler: CallbackHandler, old: TrainerCallback, new: TrainerCallback) -> None:
    """Put `new` in `old`'s place in the handler's list (in place: safe during an event, and `new` gets the rest of
    the event if `old` had not been called yet)."""
    callbacks = handler.callbacks
    callbacks[next(i for i, cb in enumerate(callbacks) if cb is old)] = new
