"""The compiled train step's differentiation: ``torch.autograd.grad`` traced by Dynamo, so that every custom
``torch.autograd.Function``'s backward is the one used.

torch 2.13's ``torch.compile(torch.func.grad(f))`` differentiates the *forward* of a custom Function applied to
a differentiated input itself, silently (pytorch/pytorch#193279): a straight-through estimator on a float32
parameter trains with the rounding's zero derivative, a gradient reversal with the wrong sign, a Function with
saved tensors with its forward's derivative. Dynamo-traced ``torch.autograd.grad`` (its
``trace_autograd_ops`` setting) uses the Function's backward wherever it is applied, under aot_eager and
inductor, and its graph is the same single graph (:func:`funcamp.grad._autograd_route`).

:func:`compile` is ``torch.compile`` with that setting switched on while the compiled function traces, and
only then: ``torch._dynamo.config.patch`` around each call, never a process-wide change (another compiled
function in the process keeps Dynamo's default). :data:`route` is the route the compiled step differentiates
with; the public :func:`funcamp.grad_and_value` keeps ``torch.func``'s (it composes with ``vmap``).

A Function whose forward or backward Dynamo cannot trace (a ``print``, an ``.item()``, a call into another
library) is refused by ``fullgraph=True`` with Dynamo's error at the line in question; :func:`function_note`
adds a note naming the Function and what to do, rather than differentiating its forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from funcamp.grad import _autograd_route

__all__ = ["compile", "function_note", "route"]

#: The compiled step's route (:data:`funcamp.grad._Route`): ``torch.autograd.grad`` on detached inputs.
route = _autograd_route

_FUNCTION_OP = "autograd.Function"  # the higher-order operator Dynamo names in a Function's trace errors


def compile(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``torch.compile(fn, **options)``, traced with ``torch._dynamo.config.trace_autograd_ops`` on.

    The setting is patched around each call (a retrace after a guard failure sees it too) and restored after;
    the calls that do not trace pay one context manager. Same arguments and errors as ``torch.compile``.
    """
    compiled = torch.compile(fn, **options)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            return compiled(*args, **kwargs)

    return call


def function_note(error: BaseException) -> str | None:
    """A note naming the user's ``torch.autograd.Function`` that Dynamo could not trace, or None.

    Recognised by the higher-order operator Dynamo names (``autograd.Function``) in its error; the Function is
    the subclass whose ``forward``, ``setup_context`` or ``backward`` holds the last line of the error's user
    stack that lies in one of them.
    """
    message = str(error)
    if _FUNCTION_OP not in message:
        return None
    where = _function_frame(message)
    name = f"the torch.autograd.Function {where}" if where else "a torch.autograd.Function"
    return (
        f"funcamp: torch.compile cannot trace {name} in the loss, so the compiled step cannot use its backward, "
        "and refuses rather than differentiate its forward. Make its forward and backward traceable (no print, "
        ".item(), numpy or other host work), or run make_train_step(..., compile=False), which uses its backward "
        "eagerly"
    )


_METHODS = ("forward", "setup_context", "backward")


def _function_frame(message: str) -> str | None:
    """``'Name.method (file:line)'`` for the last frame of ``message``'s user stack inside a Function method."""
    found = None
    for line in message.splitlines():
        text = line.strip()
        if not text.startswith('File "'):
            continue
        try:
            path, rest = text[len('File "') :].split('", line ', 1)
            lineno, method = rest.split(", in ", 1)
            lineno_int = int(lineno)
        except ValueError:
            continue
        if method in _METHODS:
            owner = _owner(path, lineno_int, method)
            found = f"{owner}.{method} ({path}:{lineno})" if owner else f"{method} ({path}:{lineno})"
    return found


def _owner(path: str, lineno: int, method: str) -> str | None:
    """The qualified name of the ``torch.autograd.Function`` subclass whose ``method`` spans ``path:lineno``."""
    pending, seen = list(torch.autograd.Function.__subclasses__()), set()
    while pending:
        cls = pending.pop()
        if cls in seen:
            continue
        seen.add(cls)
        pending.extend(cls.__subclasses__())
        code = getattr(cls.__dict__.get(method), "__func__", cls.__dict__.get(method))
        code = getattr(code, "__code__", None)
        if code is None or code.co_filename != path:
            continue
        lines = [line for _, _, line in code.co_lines() if line is not None]
        if lines and min(lines + [code.co_firstlineno]) <= lineno <= max(lines):
            return cls.__qualname__
    return None
