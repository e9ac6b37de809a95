"""Where a train state keeps its parameters and optimizer state: the storage layout, beside the process layout.

The process layout (:mod:`funcamp.train._layout`) says what travels between processes; the storage layout says
how one process holds the state. Two implement the :class:`ParamStorage` Protocol:

- :class:`PerLeaf`: every parameter and every optimizer-state leaf its own tensor, the optimizer run leaf by leaf.
- :class:`funcamp.train._flat.Flat`: flat buffers, one contiguous 1-D buffer per (device, dtype, optimizer
  group) for the parameters and for every optimizer-state tree shaped like them; ``state.params`` and
  ``state.opt_state`` hold views of them with the user's names and shapes. The compiled step runs the
  optimizer once per buffer (llm.c's flat-from-birth layout, optax's ``flatten``).

``TrainState.create`` chooses the storage once (:func:`choose`) and the state carries it as a static field
(``state.storage``); the stages call the Protocol and never ask which kind it is. Whenever the state is kept
leaf by leaf, ``storage.reason`` says why. ``FUNCAMP_FLAT=off`` in the environment keeps every new state leaf by
leaf (a switch for debugging and for tests: an elementwise optimizer's numbers do not change).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from funcamp.optim import GradientTransformation

__all__ = ["ParamStorage", "PerLeaf", "choose", "flat_enabled"]

#: The environment switch: ``FUNCAMP_FLAT=off`` (or ``0``, ``false``, ``no``) keeps every new state leaf by leaf.
SWITCH = "FUNCAMP_FLAT"


@runtime_checkable
class ParamStorage(Protocol):
    """How a state holds its parameters and optimizer state; what the stages ask of it.

    Inside the step (traced): :meth:`tree` (the parameter tree the loss sees), :meth:`gradients` (the gradients as
    the update reads them: flat, one buffer per group, whose members' views the finite check reads), :meth:`check`
    (the finite check over the storage) and :meth:`update` (the optimizer stage over the storage). On the host:
    :meth:`lay_out` (a new state's tensors placed in the storage), :meth:`admit` (a step's optimizer checked
    against the one the storage was laid out for), :meth:`adopt` (tensors given to a state in other memory, copied
    into its storage: a loaded or replaced state), :meth:`enter` (the state as the compiled step takes it) and
    :meth:`leave` (the compiled step's result as the user sees it). ``kind`` names it (``"per leaf"``,
    ``"flat"``); ``reason``, for a per-leaf storage chosen where flat buffers were asked for, why.
    """

    kind: str
    reason: str | None

    def tree(self, params: Any) -> Any: ...
    def held(self, params: Any) -> tuple[Any, Callable[[Any], Any]]: ...
    def gradients(self, grads: Any, params: Any) -> Any: ...
    def check(self, stage: Callable[..., Any], grads: Any, loss: Any, layout: Any) -> Any: ...
    def update(
        self,
        stage: Callable[..., tuple[Any, Any]],
        optimizer: GradientTransformation,
        grads: Any,
        opt_state: Any,
        params: Any,
        layout: Any,
        finite: Any,
    ) -> tuple[Any, Any]: ...
    def lay_out(self, params: Any, optimizer: GradientTransformation) -> tuple[Any, Any]: ...
    def admit(self, optimizer: GradientTransformation) -> None: ...
    def adopt(self, params: Any, opt_state: Any) -> tuple[Any, Any] | None: ...
    def compact(self, params: Any, opt_state: Any) -> tuple[Any, Any]: ...
    def expand(self, params: Any, opt_state: Any) -> tuple[Any, Any]: ...
    def enter(self, state: Any) -> tuple[Any, Callable[[], None]]: ...
    def leave(self, state: Any) -> Any: ...


class PerLeaf:
    """Every parameter and optimizer-state leaf its own tensor; the optimizer runs leaf by leaf.

    Args:
      reason: why the state is kept leaf by leaf where flat buffers were possible (None: not asked).
    """

    kind = "per leaf"

    def __init__(self, reason: str | None = None) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return "PerLeaf()" if self.reason is None else f"PerLeaf(reason={self.reason!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PerLeaf)

    def __hash__(self) -> int:
        return hash(PerLeaf)

    def describe(self) -> str:
        """One line for the step's plan."""
        return "per leaf" if self.reason is None else f"per leaf ({self.reason})"

    def tree(self, params: Any) -> Any:
        """The parameters as they are."""
        return params

    def held(self, params: Any) -> tuple[Any, Callable[[Any], Any]]:
        """``(params, identity)``: the tensors that hold the parameters, and the tree from them."""
        return params, _identity

    def gradients(self, grads: Any, params: Any) -> Any:
        """The gradients as the update reads them: ``grads`` as they are."""
        del params
        return grads

    def check(self, stage: Callable[..., Any], grads: Any, loss: Any, layout: Any) -> Any:
        """The finite check (``stage``, :mod:`funcamp.train._stages`'): ``stage(grads, loss, layout)``."""
        return stage(grads, loss, layout)

    def update(
        self,
        stage: Callable[..., tuple[Any, Any]],
        optimizer: GradientTransformation,
        grads: Any,
        opt_state: Any,
        params: Any,
        layout: Any,
        finite: Any,
    ) -> tuple[Any, Any]:
        """``stage(optimizer, grads, opt_state, params, layout, finite)``, leaf by leaf: ``(params, opt_state,
        updates)`` (the optimizer stage of :mod:`funcamp.train._stages`, with the updates it applied)."""
        return stage(optimizer, grads, opt_state, params, layout, finite)

    def lay_out(self, params: Any, optimizer: GradientTransformation) -> tuple[Any, Any]:
        """``(params, optimizer.init(params))``: the given tensors are the state's."""
        return params, optimizer.init(params)

    def admit(self, optimizer: GradientTransformation) -> None:
        """Any optimizer runs leaf by leaf."""
        del optimizer

    def adopt(self, params: Any, opt_state: Any) -> None:
        """None: the state holds the tensors it is given."""
        del params, opt_state

    def compact(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """The trees as they are (pickling)."""
        return params, opt_state

    def expand(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """The trees as they are (unpickling)."""
        return params, opt_state

    def enter(self, state: Any) -> tuple[Any, Callable[[], None]]:
        """``(state, after)``: the state as it is, nothing to do after the call."""
        return state, _nothing

    def leave(self, state: Any) -> Any:
        """The state as it is."""
        return state


def _nothing() -> None:
    return None


def _identity(x: Any) -> Any:
    return x


def flat_enabled() -> bool:
    """Whether ``FUNCAMP_FLAT`` allows flat buffers (anything but ``off``, ``0``, ``false``, ``no``)."""
    return os.environ.get(SWITCH, "").strip().lower() not in ("off", "0", "false", "no")


def choose(
    params: Any, optimizer: GradientTransformation, *, sharded: bool, stacked: tuple[str, ...] = ()
) -> ParamStorage:
    """The storage of a new state of ``params`` under ``optimizer``: flat buffers where they keep the per-leaf
    numbers (:func:`funcamp.train._flat.layout`; the runs of ``stacked`` name-major), else :class:`PerLeaf`
    with the reason."""
    if not flat_enabled():
        return PerLeaf(f"{SWITCH}=off")
    if sharded:
        return PerLeaf("a sharded layout is kept leaf by leaf (flat shards are not built yet)")
    from funcamp.train import _flat  # the flat layout builds on the optimizer's meta run: loaded when asked

    built = _flat.layout(params, optimizer, stacked=stacked)
    if isinstance(built, str):
        return PerLeaf(built)
    built.admit(optimizer)  # its update's regions planned now, for the plan's line
    return built
