"""Errors that several layers raise: they live below all of them, so that a low layer (the checkpoint files)
raises the same class as a high one (the train step) without importing it. Each is re-exported where users
meet it (``funcamp.train.DonatedStateError``)."""

__all__ = ["DonatedStateError"]


class DonatedStateError(RuntimeError):
    """A state given to a step built with ``donate=True`` was used again; use the state the step returned."""
