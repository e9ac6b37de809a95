"""``torch.utils.checkpoint`` inside ``apply_fn``: recompute with the tensors of the call that saved.

``apply_fn`` runs your module's forward on a structural copy whose parameters are ``meta``
placeholders, with the call's tensors swapped in by ``torch.func.functional_call`` and swapped out
again when the forward returns. Activation checkpointing recomputes a region *later*, in the backward
pass, by calling the region's function again: on its own it would find the placeholders ("Tensor on
device meta is not on the expected device cpu!"). This module makes the recompute see what the
forward saw:

- Non-reentrant checkpoints (``use_reentrant=False``, ``checkpoint_sequential``, Hugging Face's
  ``gradient_checkpointing_enable()``): a checkpoint taken inside ``apply_fn`` records the call's
  tensors, and its recompute runs with them swapped in again (buffers as they were when the call
  began, in fresh copies, so running statistics are not updated twice). The gradients are those of
  the same model without checkpointing, bitwise.
- Reentrant checkpoints (``use_reentrant=True``) cannot work with ``torch.autograd.grad`` or
  ``torch.func`` (which funcamp differentiates with: torch refuses ``.grad()`` there), so inside
  ``apply_fn`` they run as non-reentrant ones: the same gradients, and no lost parameter gradients
  when no input requires grad (the reentrant variant's known pitfall).
- Under ``torch.func`` gradient transforms (``torch.func.grad``, ``vjp``: the compiled train step,
  and eager calls nested in another transform) torch 2.13 cannot checkpoint at all: saved-tensor hooks
  are disabled there, and ``torch.utils.checkpoint`` raises "torch.func transforms don't yet support
  saved tensor hooks". There the region runs without recomputation (the same gradients; its
  activations are kept, so no memory is saved) and a :class:`RematInactiveWarning` says so once.

How: the first ``functionalize`` call wraps two private entry points of ``torch.utils.checkpoint``
(``_checkpoint_without_reentrant_generator`` and ``CheckpointFunction``; both are looked up at call
time, so ``from torch.utils.checkpoint import checkpoint`` in your model is covered). Outside
``apply_fn`` they behave as torch's own, except where torch would raise the saved-tensor-hooks error
above.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

__all__ = ["RematInactiveWarning"]


class RematInactiveWarning(UserWarning):
    """A checkpointed region ran without recomputation (torch.func transforms cannot checkpoint)."""


class _Call:
    """What a recompute needs from one ``apply_fn`` call: the module copy and the tensors it ran with.

    ``tensors`` are the forward-dtype parameters (the very tensors of the call's graph); buffers are
    re-made from ``buffers`` (the caller's, never written) by ``make_buffers`` at each recompute.
    """

    def __init__(
        self,
        skeleton: nn.Module,
        tensors: Mapping[str, torch.Tensor],
        make_buffers: Callable[[], Mapping[str, torch.Tensor]],
        mode: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.skeleton = skeleton
        self.tensors = dict(tensors)
        self.make_buffers = make_buffers
        self.mode = mode  # the call's per-op precision (funcamp.ops.OpPolicies), re-entered to recompute

    @contextlib.contextmanager
    def bound(self) -> Iterator[None]:
        tensors = {**self.tensors, **self.make_buffers()}
        token = _CALL.set(self)
        try:
            with _reparametrize_module(self.skeleton, tensors, tie_weights=False, strict=False), self.mode():
                yield
        finally:
            _CALL.reset(token)


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("funcamp_nn_call", default=None)


@contextlib.contextmanager
def inside(call: _Call) -> Iterator[None]:
    """Mark the forward of one ``apply_fn`` call (eager only: not traced by ``torch.compile``)."""
    token = _CALL.set(call)
    try:
        yield
    finally:
        _CALL.reset(token)


def _hooks_disabled() -> bool:
    return torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is not None


_warned = False


def _warn_inactive() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "funcamp: a torch.utils.checkpoint region ran without recomputation, because torch.func "
            "gradient transforms (the compiled train step, torch.func.grad) cannot use saved-tensor hooks "
            "in this torch version. Gradients are unchanged; the region's activations are kept. Eager "
            "funcamp.grad_and_value and make_train_step(compile=False) do recompute.",
            RematInactiveWarning,
            stacklevel=4,
        )


def _wrap_generator(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def generator(fn: Callable[..., Any], *rest: Any, **kwargs: Any) -> Iterator[None]:
        if torch.is_grad_enabled() and _hooks_disabled():  # torch would raise here: run the region as is
            _warn_inactive()
            yield
            return
        call = _CALL.get()
        if call is not None:
            inner = fn

            def fn(*args: Any, **kw: Any) -> Any:
                with call.bound():
                    return inner(*args, **kw)

        yield from original(fn, *rest, **kwargs)

    generator._funcamp_original = original  # type: ignore[attr-defined]
    return generator


def _wrap_function(original: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    class CheckpointFunction(original):  # type: ignore[valid-type, misc]
        """torch's reentrant checkpoint; inside funcamp's ``apply_fn`` the non-reentrant one instead."""

        _funcamp_original = original

        @classmethod
        def apply(cls, function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
            if _CALL.get() is None:
                return original.apply(function, preserve_rng_state, *args)
            return torch_checkpoint.checkpoint(
                function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state
            )

    CheckpointFunction.__qualname__ = original.__qualname__
    CheckpointFunction.__module__ = original.__module__
    return CheckpointFunction


_lock = threading.Lock()


def install() -> None:
    """Wrap ``torch.utils.checkpoint``'s two entry points (idempotent, thread-safe); see the module doc."""
    with _lock:
        gen = torch_checkpoint._checkpoint_without_reentrant_generator
        if not hasattr(gen, "_funcamp_original"):
            torch_checkpoint._checkpoint_without_reentrant_generator = _wrap_generator(gen)
        fn = torch_checkpoint.CheckpointFunction
        if not hasattr(fn, "_funcamp_original"):
            torch_checkpoint.CheckpointFunction = _wrap_function(fn)
