"""The process layout a train step runs under, for the code the step calls (a dynamic scope).

A train step runs its loss and its optimizer inside :func:`within` its layout; a function called there
(``optim.clip_by_global_norm``'s norm, ``optim.stochastic_rounding``'s element offsets, a per-module
parameter gather in ``funcamp.nn.functionalize``) asks :func:`current` instead of being given the
layout again, so that one transform is right in every layout and the user never passes the group twice
(the role of ``axis_name`` in a JAX ``pmap``, here set by the step rather than named by the user).

The scope is a plain module-level stack entered and left with ``try``/``finally``: ``torch.compile``
traces through it into one graph (the layout is a Python object, read at trace time; nothing is
guarded on tensor values), and eager code sees it the same way. Outside every step :func:`current`
is None, which callers treat as one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["current", "within"]

R = TypeVar("R")
_STACK: list[Any] = []


def within(layout: Any, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> R:
    """``fn(*args, **kwargs)`` with ``layout`` as :func:`current` (restored after, also on error)."""
    _STACK.append(layout)
    try:
        return fn(*args, **kwargs)
    finally:
        _STACK.pop()


def current() -> Any:
    """The layout of the innermost :func:`within`, or None outside every step."""
    return _STACK[-1] if _STACK else None
