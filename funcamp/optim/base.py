"""The optimizer protocol: ``GradientTransformation``, ``chain`` and ``apply_updates``.

Also holds the small private helpers the transforms share: the compute dtype rule, the device of a
tree, and argument checks that raise ``ValueError`` naming the argument and what is accepted.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from funcamp import _tree
from funcamp._tree import _fast as _tree_fast
from funcamp.optim import _flat, _inplace

__all__ = ["EmptyState", "GradientTransformation", "apply_updates", "chain", "identity"]

Params = Any
Updates = Any
OptState = Any


class GradientTransformation(NamedTuple):
    """A pair of pure functions that turn gradients into parameter updates.

    ``init(params) -> state`` builds the initial state (a NamedTuple of tensors, or a tuple of such
    states for a chain); ``update(updates, state, params=None) -> (updates, state)`` maps incoming
    updates (gradients at the start of a chain) to outgoing ones and returns the next state. Neither
    mutates its inputs; hyperparameters live in the closures, so the state holds tensors only.

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> opt = optim.sgd(0.1)
      >>> params = {"w": torch.tensor([1.0, 2.0])}
      >>> state = opt.init(params)
      >>> updates, state = opt.update({"w": torch.tensor([1.0, -1.0])}, state, params)
      >>> updates["w"]
      tensor([-0.1000,  0.1000])
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]


class EmptyState(NamedTuple):
    """The state of a stateless transformation (no fields)."""


def identity() -> GradientTransformation:
    """Return a transformation that passes updates through unchanged, with an ``EmptyState``.

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> optim.identity().update({"w": torch.ones(2)}, optim.EmptyState())[0]["w"]
      tensor([1., 1.])
    """

    def update(updates: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        del params
        return updates, state

    return _flat.elementwise(_inplace.in_place(GradientTransformation(empty_init, update)))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transformations: the updates of each one are the input of the next.

    The state is a plain tuple with one entry per transformation, in order.

    Args:
      *transforms: ``GradientTransformation`` objects, applied left to right.
    Returns:
      A ``GradientTransformation`` whose state is ``tuple(t.init(params) for t in transforms)``.
    Raises:
      TypeError: if an argument is not a ``GradientTransformation``.

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.scale(-0.5))
      >>> params = {"w": torch.zeros(2)}
      >>> updates, _ = opt.update({"w": torch.tensor([3.0, 4.0])}, opt.init(params), params)
      >>> updates["w"]
      tensor([-0.3000, -0.4000])
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"chain: argument {i} must be a GradientTransformation, got {type(t).__name__}")
    for t in transforms[:-1]:
        name = outermost_name(t)
        if name is not None:
            raise ValueError(
                f"chain: {name} must be the outermost transformation: its updates land each parameter exactly "
                f"on its new bfloat16 value, and a transformation after it would change them and lose the small "
                f"updates; write {name}(chain(...)), not chain(..., {name}(...), ...)"
            )

    def init(params: Params) -> tuple[OptState, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(
        updates: Updates, state: tuple[OptState, ...], params: Params = None
    ) -> tuple[Updates, tuple[OptState, ...]]:
        if len(state) != len(transforms):
            raise ValueError(
                f"chain: state has {len(state)} entries but the chain has {len(transforms)} "
                "transformations; pass the state made by this chain's init"
            )
        new_state = []
        for t, s in zip(transforms, state, strict=True):
            updates, s = _inplace.call(t, updates, s, params)  # a user's transform: pure (funcamp.optim._inplace)
            new_state.append(s)
        return updates, tuple(new_state)

    result = _flat.elementwise(_inplace.in_place(GradientTransformation(init, update)), *transforms)
    last = outermost_name(transforms[-1]) if transforms else None
    return mark_outermost(result, last) if last is not None else result


_OUTERMOST = "_funcamp_outermost"


def mark_outermost(transform: GradientTransformation, name: str) -> GradientTransformation:
    """Mark ``transform`` as one that must come last (outermost): :func:`chain` refuses anything after it.

    Used by the bfloat16 master-weight wrappers, whose updates are exact landings that a later scaling or
    clipping would spoil; a transformation containing a marked one (a group of ``multi_transform``) is
    marked too. Returns ``transform`` (its ``update`` function carries the mark).
    """
    setattr(transform.update, _OUTERMOST, name)
    return transform


def outermost_name(transform: GradientTransformation) -> str | None:
    """The name of the must-be-outermost wrapper inside ``transform`` (see :func:`mark_outermost`), or None."""
    return getattr(transform.update, _OUTERMOST, None)


def apply_updates(params: Params, updates: Updates) -> Params:
    """Return ``params + updates``, leaf by leaf, each result in the dtype of its parameter.

    The sum is computed in float32 when the parameter (or update) is of lower precision (float16,
    bfloat16) and in float64 when either is float64, then cast to the parameter's dtype. Inputs are
    not modified. ``None`` leaves stay ``None``.

    Args:
      params: a tree of floating tensors.
      updates: a tree of floating tensors with the structure and shapes of ``params``.
    Returns:
      The new parameters, a tree with the structure, shapes and dtypes of ``params``.
    Raises:
      ValueError: if ``params`` and ``updates`` have different tree structures (both are named).
      TypeError: if a leaf of ``params`` or ``updates`` is not a floating-point tensor.
      ValueError: if an update's shape differs from its parameter's.

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> params = {"w": torch.ones(2, dtype=torch.bfloat16)}
      >>> optim.apply_updates(params, {"w": torch.tensor([0.5, -0.25], dtype=torch.bfloat16)})["w"]
      tensor([1.5000, 0.7500], dtype=torch.bfloat16)
    """
    fast = _tree.flatten_same(params, updates)  # while torch.compile traces: cheaper than optree's polyfill
    if fast is not None:
        (p_leaves, u_leaves), rebuild = fast
        summed = None if _inplace.current() else _tree_fast.add_alike(p_leaves, u_leaves)  # float32/64: p + u
        if summed is not None:
            return rebuild(summed)
        return rebuild([_add_leaf(p, u) for p, u in zip(p_leaves, u_leaves, strict=True)])
    p_leaves, p_spec = _tree.tree_flatten(params)
    u_leaves, u_spec = _tree.tree_flatten(updates)
    if not _tree.same_structure(p_spec, u_spec, len(p_leaves), len(u_leaves)):
        raise ValueError(
            f"apply_updates: params and updates must have the same tree structure, got params {p_spec} "
            f"and updates {u_spec}"
        )
    return _tree.tree_unflatten(p_spec, [_add_leaf(p, u) for p, u in zip(p_leaves, u_leaves, strict=True)])


def _add_leaf(p: Any, u: Any) -> torch.Tensor:
    for name, x in (("param", p), ("update", u)):
        if not _tree.is_floating(x):
            raise TypeError(
                f"apply_updates: every {name} leaf must be a floating-point tensor, got "
                f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}"
            )
    if p.shape != u.shape:
        raise ValueError(
            f"apply_updates: each update must have its parameter's shape (no broadcasting), got param "
            f"{tuple(p.shape)} and update {tuple(u.shape)}"
        )
    c = compute_dtype(p.dtype, u.dtype)
    return _inplace.write(p, (p.to(c) + u.to(c)).to(p.dtype))  # a donating eager step: into p (funcamp.optim._inplace)


# --- private helpers shared by the transforms ---


@torch._dynamo.assume_constant_result  # dtypes in, a dtype out: Dynamo calls it, it traces nothing per leaf
def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype arithmetic runs in: the widest of ``dtypes`` and float32."""
    known = _COMPUTE.get(dtypes)  # one or two floating dtypes: a table made at import
    if known is not None:
        return known
    out = torch.float32
    for d in dtypes:
        out = torch.promote_types(out, d)
    return out


_FLOATING = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
#: :func:`compute_dtype` of one and of two floating dtypes, made at import: a compiled step asks it for every
#: buffer in every transformation, and Dynamo would otherwise trace the promotions each time.
_COMPUTE: dict[tuple[torch.dtype, ...], torch.dtype] = {
    **{(a,): torch.promote_types(torch.float32, a) for a in _FLOATING},
    **{(a, b): torch.promote_types(torch.promote_types(torch.float32, a), b) for a in _FLOATING for b in _FLOATING},
}


def empty_init(params: Params) -> EmptyState:
    """The ``init`` of a stateless transform: ``EmptyState()`` whatever the params."""
    del params
    return EmptyState()


def zero_count(params: Params) -> torch.Tensor:
    """A 0-d int32 zero on the device of ``params``: the step count of a fresh state."""
    return torch.zeros((), dtype=torch.int32, device=_tree.tree_device(params))


def check_real(fn: str, name: str, value: Any) -> float:
    """``value`` as a float; ``ValueError`` if it is not a finite real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{fn}: {name} must be a finite real number, got {value!r}")
    return float(value)


def check_nonnegative(fn: str, name: str, value: Any) -> float:
    """``value`` as a float; ``ValueError`` unless it is finite and ``>= 0``."""
    if check_real(fn, name, value) < 0:
        raise ValueError(f"{fn}: {name} must be >= 0, got {value!r}")
    return float(value)


def check_positive(fn: str, name: str, value: Any) -> float:
    """``value`` as a float; ``ValueError`` unless it is finite and ``> 0``."""
    if check_real(fn, name, value) <= 0:
        raise ValueError(f"{fn}: {name} must be > 0, got {value!r}")
    return float(value)


def check_beta(fn: str, name: str, value: Any) -> float:
    """``value`` as a float; ``ValueError`` unless ``0 <= value < 1``."""
    if not 0.0 <= check_real(fn, name, value) < 1.0:
        raise ValueError(f"{fn}: {name} must be in [0, 1), got {value!r}")
    return float(value)


def check_steps(fn: str, name: str, value: Any, minimum: int) -> int:
    """``value`` as an int; ``ValueError`` unless it is an integer ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{fn}: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_bool(fn: str, name: str, value: Any) -> bool:
    """``value`` if it is a Python bool; ``TypeError`` otherwise (a number here is an argument out of place)."""
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be a bool (True or False), got {value!r}")
    return value


def check_dtype(fn: str, value: Any) -> torch.dtype | None:
    """``value`` if it is ``None`` or a floating torch dtype; ``ValueError`` otherwise."""
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ValueError(f"{fn}: moment_dtype must be None or a floating torch.dtype, got {value!r}")
    return value
