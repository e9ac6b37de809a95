"""Deprecated names, kept in one place until they are removed: each warns (``DeprecationWarning``) and says
what to use instead, and is re-exported at its old path (``funcamp.sharding.clip_by_global_norm``,
``funcamp.sharding.check_optimizer``, ``funcamp.parallel.register_buffer_reduction``).

This module sits below the modules that re-export it: it imports from funcamp only inside
:func:`clip_by_global_norm` (:mod:`funcamp.optim`, which imports neither).
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["BUFFER_REDUCTIONS", "check_optimizer", "clip_by_global_norm", "register_buffer_reduction"]

#: Deprecated (:func:`register_buffer_reduction`): buffer attribute name -> "max" or "min", for buffers whose
#: reduction the state does not carry (``TrainState.buffer_reductions``). It starts with the names of
#: :mod:`funcamp.fp8`'s delayed-scaling buffers (``Float8Linear.buffer_reductions``), the fallback for states
#: made without ``buffer_reductions=``: the amax histories take the maximum over ranks, the scales the minimum.
BUFFER_REDUCTIONS: dict[str, str] = {
    **{f"fp8_amax_history_{role}": "max" for role in ("input", "weight")},
    **{f"fp8_scale_{role}": "min" for role in ("input", "weight")},
}


def clip_by_global_norm(max_norm: float, group: Any = True) -> Any:
    """Deprecated: use ``funcamp.optim.clip_by_global_norm(max_norm)``, which is right in every layout.

    Inside a train step ``funcamp.optim.clip_by_global_norm`` takes the norm from the step's layout (the
    state's): over all ranks' shards in a sharded step (one float64 ``all_reduce``, as this function
    did), the local norm of the (already averaged) gradients otherwise. This alias warns and returns
    that transform; ``group`` is ignored (the step's layout has it).

    Raises:
      ValueError: if ``max_norm`` is not a finite number > 0.
    """
    from funcamp.optim.transforms import clip_by_global_norm as clip

    del group
    warnings.warn(
        "funcamp.sharding.clip_by_global_norm is deprecated: use funcamp.optim.clip_by_global_norm(max_norm), "
        "which takes the norm over all shards from the sharded step's layout",
        DeprecationWarning,
        stacklevel=2,
    )
    return clip(max_norm)


def check_optimizer(optimizer: Any, group: Any = None, **kwargs: Any) -> None:
    """Deprecated, does nothing: no optimizer needs refusing any more.

    ``funcamp.optim.clip_by_global_norm`` and ``funcamp.optim.stochastic_rounding`` take the norm and the
    element offsets from the layout of the step they run in, so the same optimizer is right with and
    without ``shard=``.
    """
    del optimizer, group, kwargs
    warnings.warn(
        "funcamp.sharding.check_optimizer is deprecated and does nothing: funcamp.optim.clip_by_global_norm and "
        "funcamp.optim.stochastic_rounding take the norm and element offsets from the train step's layout",
        DeprecationWarning,
        stacklevel=2,
    )


def register_buffer_reduction(name: str, reduction: str) -> None:
    """Deprecated: declare the reduction on the module that owns the buffer instead.

    A module class declares ``buffer_reductions = {"attribute_name": "max" | "min"}`` (as
    :class:`funcamp.fp8.Float8Linear` does for its delayed-scaling state); ``funcamp.nn.functionalize``
    reads it for each buffer and gives ``apply_fn.buffer_reductions`` (dotted name -> reduction), which
    ``TrainState.create(..., buffer_reductions=...)`` carries to the step. This function still makes
    :func:`funcamp.parallel.reduce_buffers` take the maximum or the minimum over ranks of every buffer called
    ``name`` (the last part of its dotted path) whose reduction the state does not give, and warns.

    Args:
      name: the buffer's attribute name, without dots.
      reduction: ``"max"`` or ``"min"``.
    Raises:
      TypeError: if ``name`` is not a string.
      ValueError: if ``name`` is empty or has a dot, ``reduction`` is not ``"max"`` or ``"min"``, or
        ``name`` is registered already with the other reduction.
    """
    warnings.warn(
        "funcamp.parallel.register_buffer_reduction is deprecated: declare buffer_reductions = {name: 'max' | "
        "'min'} on the module class that owns the buffer, and pass apply_fn.buffer_reductions (from "
        "funcamp.nn.functionalize) to TrainState.create(..., buffer_reductions=)",
        DeprecationWarning,
        stacklevel=2,
    )
    _register(name, reduction)


def _register(name: str, reduction: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"register_buffer_reduction: name must be a buffer's attribute name (str), got {name!r}")
    if not name or "." in name:
        raise ValueError(f"register_buffer_reduction: name must be an attribute name without dots, got {name!r}")
    if reduction not in ("max", "min"):
        raise ValueError(f"register_buffer_reduction: reduction must be 'max' or 'min', got {reduction!r}")
    old = BUFFER_REDUCTIONS.setdefault(name, reduction)
    if old != reduction:
        raise ValueError(f"register_buffer_reduction: {name!r} is registered with {old!r} already, not {reduction!r}")
