"""Errors and markers that several layers share: they live below all of them, so that a low layer (the checkpoint
files, ``funcamp.capture``) raises the same class and reads the same mark as a high one (the train step) without
importing it. Each is re-exported where users meet it (``funcamp.train.DonatedStateError``)."""

from typing import Any

__all__ = ["DONATED", "DonatedStateError", "check_not_donated", "mark_donated"]

#: The attribute a donating step sets on the state it consumed.
DONATED = "_funcamp_donated"


class DonatedStateError(RuntimeError):
    """A state given to a step built with ``donate=True`` was used again; use the state the step returned."""


def mark_donated(state: Any) -> None:
    """Mark ``state`` (a :class:`funcamp.TrainState`) as consumed by a donating step."""
    object.__setattr__(state, DONATED, True)


def check_not_donated(state: Any, fn: str) -> None:
    """Raise :class:`DonatedStateError` if ``state`` was given to a donating step."""
    if getattr(state, DONATED, False):
        raise DonatedStateError(
            f"{fn}: this TrainState was donated to a train step built with donate=True, which wrote the next "
            "state into its tensors; use the state that step returned (state, metrics = train_step(state, batch)), "
            "or build the step with donate=False to keep every state"
        )
