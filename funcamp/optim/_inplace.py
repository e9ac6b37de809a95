"""In-place updates for an eager donating train step: funcamp's own transforms write into the donated state.

An eager ``make_train_step(..., donate=True, compile=False)`` would otherwise compute the whole next state
(every moment, every update, every parameter) beside the old one and copy it over at the end, so its peak
would be a pure step's. Instead the step runs its optimizer and ``apply_updates`` within a
:class:`Donation` (a dynamic scope, :class:`funcamp._scope.Scope`): funcamp's own elementwise transforms
then, leaf by leaf, compute the new leaf and write it at once into the donated tensor
(``torch.where(finite, new, old, out=old)``: a skipped step writes the old values back, bit for bit), and
carry their updates in the buffers of the step's own gradients. So only one leaf's temporaries exist at a
time, on top of the gradients; the numbers are those of the pure step, bit for bit.

Who may be written into, and when (the rules that keep it bitwise):

* a *donated* tensor (a leaf of the given state's parameters or optimizer state, 0-d counters excepted,
  which the transforms return new) is written by :func:`write`, only while no other tensor shares its
  storage (a view, a detached alias such as an aux output);
* a *reusable* tensor (one of the step's own gradients: plain, dense, owning its whole storage, shared with
  nothing) is overwritten by :func:`reuse` with the next update of its leaf;
* only funcamp's transforms opt in (:func:`in_place`). A combinator calls its inner transforms with
  :func:`call`: a transform that did not opt in (a user's) runs with the scope suspended, so everything it
  calls is pure, and what it was given (updates and parameters) is no longer reused nor written, since it
  may have kept them (a transform that stores its input gradients in its state). Outside a donating eager
  step (a pure step, a compiled one, a direct ``opt.update``) there is no scope and nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from funcamp import _scope, _tree

__all__ = ["Donation", "bound", "call", "current", "donating", "in_place", "is_in_place", "reuse", "within", "write"]

#: One dynamic scope: an :class:`_Armed` step (a donating eager step, until its update binds it), the
#: :class:`Donation` of the update running, or None (suspended for a user's transform).
_SCOPE = _scope.Scope()
_IN_PLACE = "_funcamp_in_place"


def _storage_users(x: torch.Tensor) -> int | None:
    """How many tensors share ``x``'s storage (plus the probe itself), or None where torch cannot say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(x.untyped_storage()._cdata)


_ALONE = _storage_users(torch.empty(1))  # the count of a tensor that shares its storage with no other


def _where(x: torch.Tensor) -> tuple[Any, int]:
    """``x``'s storage, by device and storage object (fake tensors' storages have no address)."""
    return (x.device, x.untyped_storage()._cdata)


def _alone(x: torch.Tensor) -> bool:
    """``x`` is the only tensor on its storage (no view, no alias), and covers all of it."""
    return (
        _ALONE is not None
        and type(x) is torch.Tensor
        and x.is_contiguous()
        and x.storage_offset() == 0
        and x.untyped_storage().nbytes() == x.numel() * x.element_size()
        and _storage_users(x) == _ALONE
    )


class Donation:
    """The tensors an eager donating step may write into, and the step's verdict.

    Args:
      donated: the donated state's tensors (written only by :func:`write`, with ``where(finite, new, old)``).
      finite: the step's 0-d bool verdict.
      reusable: the step's own temporaries (its gradients), overwritten by :func:`reuse`; those that share
        their storage with anything (a view, one tensor in two leaves) are left out.
    """

    def __init__(self, donated: Iterable[Any], finite: torch.Tensor, reusable: Iterable[Any] = ()) -> None:
        self.finite = finite
        self._donated = {id(x): x for x in donated if isinstance(x, torch.Tensor) and x.ndim > 0}
        self._sharers: dict[tuple[Any, int], int] = {}  # donated tensors on each storage
        for x in self._donated.values():
            self._sharers[_where(x)] = self._sharers.get(_where(x), 0) + 1
        seen: dict[int, int] = {}
        for x in reusable:
            if isinstance(x, torch.Tensor):
                seen[id(x)] = seen.get(id(x), 0) + 1
        self._reusable = {
            id(x): x
            for x in reusable
            if isinstance(x, torch.Tensor)
            and seen[id(x)] == 1
            and id(x) not in self._donated
            and _tree.is_floating(x)
            and _alone(x)
        }

    def writable(self, x: Any) -> bool:
        """``x`` is a donated tensor whose memory nothing but the donated tensors shares (a flat state's views of
        one buffer share it with each other and with the buffer they are views of: nothing else)."""
        if not (isinstance(x, torch.Tensor) and self._donated.get(id(x)) is x):
            return False
        if _ALONE is None or type(x) is not torch.Tensor:
            return False
        sharers = self._sharers[_where(x)] + (x._base is not None)
        return _storage_users(x) == _ALONE - 1 + sharers

    def reusable(self, x: Any) -> bool:
        """``x`` is one of the step's temporaries, still seen by funcamp's transforms only."""
        return isinstance(x, torch.Tensor) and self._reusable.get(id(x)) is x

    def release(self, *trees: Any) -> None:
        """The tensors of ``trees`` are neither written nor reused from now on (someone may keep them)."""
        for tree in trees:
            for x in _tree.tree_leaves(tree):
                self._donated.pop(id(x), None)
                self._reusable.pop(id(x), None)


class _Armed:
    """The donated tensors of an eager donating step, until the step's update takes them (:func:`bound`, once)."""

    def __init__(self, donated: list[Any]) -> None:
        self.donated: list[Any] | None = donated


def donating(donated: Iterable[Any], fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` as an eager donating step: ``donated`` (the given state's parameters and optimizer
    state) may be written by the optimizer stage, which binds them with :func:`bound`."""
    return _SCOPE.within(_Armed(list(donated)), fn, *args, **kwargs)


def bound(finite: torch.Tensor | None, grads: Any) -> Donation | None:
    """The :class:`Donation` of the optimizer stage of a donating eager step (None elsewhere, or without a verdict).

    ``grads``: the step's own gradients, which no one reads after the update (their buffers are reused).
    Once per step: the step's one update takes the donation (an update that the loss itself might run, before
    the step's, would take it instead and leave the step's pure).
    """
    armed = _SCOPE.current()
    if not isinstance(armed, _Armed) or armed.donated is None or finite is None:
        return None  # no donating step, its donation taken, or a user's transform (suspended: pure)
    donated, armed.donated = armed.donated, None
    return Donation(donated, finite, _tree.tree_leaves(grads))


def current() -> Donation | None:
    """The donation of the innermost :func:`within`, or None (no donating eager step, its update not begun, or a
    user's transform)."""
    stack = _SCOPE._stack  # Scope.current, inline: asked for every leaf of every transformation
    donation = stack[-1] if stack else None
    return donation if isinstance(donation, Donation) else None


def within(donation: Donation | None, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with ``donation`` as :func:`current` (None: suspended)."""
    return _SCOPE.within(donation, fn, *args, **kwargs)


def in_place(transform: Any) -> Any:
    """Mark ``transform`` (a ``GradientTransformation`` of funcamp's) as one that writes through this module.

    Only funcamp's transforms are marked: their ``update`` writes donated state leaves with :func:`write`,
    carries updates with :func:`reuse`, and calls its inner transforms with :func:`call`. Returns ``transform``.
    """
    setattr(transform.update, _IN_PLACE, True)
    return transform


def is_in_place(transform: Any) -> bool:
    """Whether ``transform`` was marked by :func:`in_place`."""
    return getattr(transform.update, _IN_PLACE, False)


def call(transform: Any, updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
    """``transform.update(updates, state, params)`` as a combinator of funcamp's calls its inner transforms.

    A transform marked :func:`in_place` runs within the current donation; any other runs with it suspended
    (pure), and the updates and parameters it was given are released first: it may keep them.
    """
    donation = current()
    if donation is None or is_in_place(transform):
        return transform.update(updates, state, params)
    donation.release(updates, params)
    return within(None, transform.update, updates, state, params)


def write(old: Any, new: torch.Tensor) -> torch.Tensor:
    """The next value of a state leaf: ``new``, or within a donation ``old`` holding ``where(finite, new, old)``.

    Written at once, so that ``new`` can be freed before the next leaf; a ``new`` of another dtype or shape than
    ``old`` is returned as it is (never cast into it).
    """
    stack = _SCOPE._stack  # current(), inline: asked for every leaf of every transformation, traced for each
    donation = stack[-1] if stack else None
    if (
        not isinstance(donation, Donation)
        or new is old
        or not donation.writable(old)
        or new.dtype != old.dtype
        or new.shape != old.shape
    ):
        return new
    return torch.where(donation.finite, new, old, out=old)


def reuse(old: Any, new: torch.Tensor) -> torch.Tensor:
    """The next update of a leaf: ``new``, or within a donation ``old`` holding it when ``old`` is reusable.

    A reusable ``old`` is one of the step's own gradients (or a buffer of one, carrying an earlier update);
    ``new`` is copied into it when dtype and shape agree, so the updates occupy the gradients' memory.
    """
    stack = _SCOPE._stack  # current(), inline (as in write)
    donation = stack[-1] if stack else None
    if (
        not isinstance(donation, Donation)
        or new is old
        or not donation.reusable(old)
        or new.dtype != old.dtype
        or new.shape != old.shape
    ):
        return new
    return old.copy_(new)
