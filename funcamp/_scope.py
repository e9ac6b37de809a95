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

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

__all__ = ["GathersAtUse", "Scope", "StepLayout", "compiling", "current", "in_step", "step_plan", "within"]

R = TypeVar("R")


class Scope:
    """One dynamic scope: :meth:`within` sets the value :meth:`current` returns while ``fn`` runs.

    A plain stack entered and left with ``try``/``finally``, so that ``torch.compile`` traces through it (the
    value is a Python object read at trace time). funcamp keeps one for the layout (:func:`within`,
    :func:`current`) and one for the sharded step's parameter uses (:mod:`funcamp._at_use`).
    """

    def __init__(self) -> None:
        self._stack: list[Any] = []

    def within(self, value: Any, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> R:
        """``fn(*args, **kwargs)`` with ``value`` as :meth:`current` (restored after, also on error)."""
        self._stack.append(value)
        try:
            return fn(*args, **kwargs)
        finally:
            self._stack.pop()

    def current(self) -> Any:
        """The value of the innermost :meth:`within`, or None outside every one."""
        return self._stack[-1] if self._stack else None


@runtime_checkable
class StepLayout(Protocol):
    """What the code a step calls asks of the step's layout (:func:`current`): the optimizer's transforms.

    ``optim.clip_by_global_norm`` takes the norm over every rank's shards; ``optim.stochastic_rounding``
    places each shard in its whole tensor. :class:`funcamp.train.SingleProcess` and its subclasses have both.
    """

    def scaled_global_norm(self, tree: Any, fn: str = "global_norm") -> tuple[torch.Tensor, torch.Tensor]:
        """``(t, s)``, the global L2 norm of ``tree`` over the layout being ``t / s``."""
        ...

    def element_offsets(self) -> Mapping[str, int] | None:
        """Each parameter's first element in its whole tensor, by dotted name; None for whole tensors."""
        ...


@runtime_checkable
class GathersAtUse(Protocol):
    """A layout that makes each parameter where a module uses it (``funcamp.nn``'s parameter uses ask it):
    :class:`funcamp.train.Sharded` gathers the shard there."""

    def param_at_use(self, name: str, stored: Any) -> Any:
        """The tensor the module computes with, for the parameter ``name`` stored as ``stored``."""
        ...


_LAYOUT = Scope()


def within(layout: StepLayout, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> R:
    """``fn(*args, **kwargs)`` with ``layout`` as :func:`current` (restored after, also on error).

    ``layout`` is what the code inside asks for by Protocol: a :class:`StepLayout` for the optimizer's
    transforms, a :class:`GathersAtUse` where ``funcamp.nn``'s parameter uses are to gather (``isinstance``
    on these runtime-checkable Protocols, never a class test).
    """
    return _LAYOUT.within(layout, fn, *args, **kwargs)


def current() -> StepLayout | None:
    """The layout of the innermost :func:`within`, or None outside every step."""
    stack = _LAYOUT._stack  # Scope.current, inline: asked for every parameter use and many leaves
    return stack[-1] if stack else None


_STEP = Scope()


def in_step(plan: Any, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> R:
    """``fn(*args, **kwargs)`` as the body of an assembled step of ``plan`` (``funcamp.train.assemble``'s
    :class:`funcamp.train.StepPlan`: ``plan.compiled`` says whether it is being traced for ``torch.compile``)."""
    return _STEP.within(plan, fn, *args, **kwargs)


def step_plan() -> Any:
    """The plan of the assembled step whose body is running (or being traced), or None outside every one."""
    return _STEP.current()


def compiling() -> bool:
    """Whether the code runs in a compiled step, as it is traced: the one compiled-or-eager question funcamp's
    modules ask (``docs/internals.md``, "Compiled and eager", lists who asks and why).

    Within the body of a step that :func:`funcamp.train.assemble` built compiled (a compiled :func:`in_step`
    plan, at any depth), True: the plan decided it once, when the step was built, and ``funcamp.capture``
    traces a step under its compiled plan the same way, without ``torch.compile``. Elsewhere (outside every
    assembled step, or in an eager step's body), whether ``torch.compile`` is tracing: a model called under the
    user's own ``torch.compile``, also inside an eager step, takes the compiled branches as it always has.
    """
    # is_compiling first: a constant while Dynamo traces, which then traces no walk of the stack (every tree
    # function and parameter use asks)
    return torch.compiler.is_compiling() or any(plan.compiled for plan in _STEP._stack)
