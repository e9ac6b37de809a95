"""Donation: the step writes the new state into the tensors of the state it is given (JAX's ``donate_argnums``).

A pure step returns a new state while the caller still holds the old one, so both exist at once: parameters,
optimizer state and buffers twice. With ``make_train_step(..., donate=True)`` the step returns a state built on
the tensors of the state it was given, which now hold the next state:

* compiled (:func:`donating`), the step body's last act is to copy every new state tensor into the corresponding
  tensor of the given state (``Tensor.copy_``); AOTAutograd keeps these input mutations inside the one graph and
  inductor writes the fused optimizer kernels' results straight into the input buffers (what
  ``torch.compile(optimizer.step)`` does for ``torch.optim``): the old and new state never coexist.
* eagerly (:func:`in_place`), the step runs within :func:`funcamp.optim._inplace.donating`: the optimizer stage
  runs funcamp's transforms and ``apply_updates`` in place, leaf by leaf (each new moment and parameter written
  into the donated tensor as soon as it is computed, ``where(finite, new, old)``; the updates carried in the
  gradients' buffers), so the step adds the gradients and one leaf's temporaries, not a second state. What was
  not written in place (the loss scale, counters, buffers, the state of a user's own transform) is copied at the
  end as above. A step with telemetry, which reads the gradients and the old parameters after the update, makes
  the new state first and copies it (:func:`copying`), as the compiled step's body does.

Either way every value is the pure step's, bit for bit; a skipped step leaves every value as it was.
The given state is consumed: the step marks it, and passing it to a step, :func:`funcamp.checkpoint.save` or
``TrainState.replace`` raises :class:`DonatedStateError`, as JAX raises for a deleted array. The tensors the
caller holds from it (``state.params["w"]``) now hold the new values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from funcamp import _tree
from funcamp._errors import DONATED, DonatedStateError, check_not_donated, mark_donated
from funcamp.optim import _inplace

__all__ = [
    "DonatedStateError",
    "check_donatable",
    "check_not_donated",
    "copying",
    "donating",
    "eager",
    "in_place",
    "mark_donated",
    "may_update_in_place",
    "returning_state",
    "updates_in_place",
]

_IN_PLACE_BODY = "_funcamp_updates_in_place"


def updates_in_place(body: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a step body that may run its optimizer stage in place when donating eagerly (:func:`in_place`): it
    takes one :class:`funcamp.TrainState` and reads neither its parameters and optimizer state nor the gradients
    after the update (``make_train_step``'s body without telemetry). Returns ``body``."""
    setattr(body, _IN_PLACE_BODY, True)
    return body


def may_update_in_place(body: Callable[..., Any]) -> bool:
    """Whether ``body`` was marked by :func:`updates_in_place`."""
    return getattr(body, _IN_PLACE_BODY, False)


def eager(body: Callable[..., Any], in_place_ok: bool) -> Callable[..., Any]:
    """The eager donating form of ``body``: :func:`in_place` where the body allows it, else :func:`copying`."""
    return in_place(body) if in_place_ok else copying(body)


_DONATED = DONATED


def check_donatable(state: Any) -> None:
    """Before each call of a donating step: refuse tensors that the step must not write into (host side).

    Raises:
      ValueError: if two state leaves share memory (one tensor twice, or overlapping views of one tensor: views
        of disjoint parts of one buffer, as a flat step's state holds, are accepted), or a leaf is an
        ``nn.Parameter`` (a module's own parameter, which the caller still uses); the message names them.
    """
    leaves = _tree.tree_leaves(state)
    paths = _tree.tree_paths(state)
    spans: dict[tuple[Any, ...], list[tuple[int, int, str]]] = {}
    for path, x in zip(paths, leaves):
        if not isinstance(x, torch.Tensor):
            continue
        if isinstance(x, torch.nn.Parameter):
            raise ValueError(
                f"make_train_step(donate=True): state leaf {path!r} is an nn.Parameter, a module's own tensor that "
                "the step would overwrite; build the state from funcamp.nn.functionalize's params, or clone it "
                "({k: p.detach().clone() for k, p in model.named_parameters()})"
            )
        if x.numel() == 0:
            continue
        start = x.storage_offset()
        end = start + 1 + sum((n - 1) * abs(st) for n, st in zip(x.shape, x.stride()))
        size = x.element_size()
        spans.setdefault(_storage(x), []).append((start * size, end * size, path))
    for places in spans.values():  # views of disjoint parts of one buffer (a flat step's state) are fine
        order = {path: i for i, (_, _, path) in enumerate(places)}  # tree order, for the message
        places.sort()
        for (_, end, a), (start, _, b) in zip(places, places[1:]):
            if start < end:
                first, second = sorted((a, b), key=order.__getitem__)
                raise ValueError(
                    f"make_train_step(donate=True): state leaves {first!r} and {second!r} share storage (one tensor "
                    "twice, or overlapping views of one tensor); the step would write both into it. Give each its own "
                    "tensor (.clone()), or build the step with donate=False"
                )


def donating(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body(state, batch) -> (new_state, metrics)`` made to write ``new_state`` into ``state``'s tensors.

    Returns ``fn(state, batch) -> metrics``: every tensor leaf of ``new_state`` is copied into the leaf of
    ``state`` in the same place (the two trees have one structure), and every tensor in the metrics, at any
    depth (``metrics["aux"]`` is the user's tree), is a copy taken before the writes. The compiled step's body;
    eagerly, :func:`copying` and :func:`in_place`.

    Why every metric: a metric may alias a state tensor in ways a trace cannot see (the scale this step used
    is the state's ``loss_scale``; an aux output may be a parameter, a slice of one, or the detached alias that
    the differentiation made of it), and an output that aliases a mutated graph input is rebuilt from the
    input *after* the writes, so it would hold the next state's value. Dynamo cannot ask a tensor for its
    storage; a copy is always right. Inductor drops the copy of a tensor that aliases no graph input (its
    no-op ``clone`` pass keeps only those that would make an output alias an input), so only the aliasing
    metrics cost a copy there; other backends (``aot_eager``) copy every metric.
    """

    def fn(state: Any, batch: Any) -> dict[str, Any]:
        new_state, metrics = body(state, batch)
        metrics = _tree.tree_map(_copy, metrics)  # before any write
        for dst, src in zip(_state_leaves(state), _state_leaves(new_state), strict=True):
            if isinstance(dst, torch.Tensor) and src is not dst:
                dst.copy_(src)
        return metrics

    return fn


#: The pytree fields of each state class by which :func:`_state_leaves` pairs leaves; filled on the host (by
#: :func:`returning_state`'s first look at a class), read while tracing (Dynamo cannot read a field's metadata).
_LEAF_FIELDS: dict[type, tuple[str, ...]] = {}


def _leaf_fields(cls: type) -> tuple[str, ...]:
    """The names of ``cls``'s fields that hold leaves (not its static ones), remembered (host side)."""
    if cls not in _LEAF_FIELDS:
        fields = dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ()
        _LEAF_FIELDS[cls] = tuple(f.name for f in fields if f.metadata.get("pytree_node", True))
    return _LEAF_FIELDS[cls]


def _state_leaves(state: Any) -> list[Any]:
    if isinstance(state, dict):  # a composed step's states (funcamp.train.assemble): each state's leaves in turn
        return [leaf for value in state.values() for leaf in _state_leaves(value)]
    if type(state) in (list, tuple):
        return [leaf for value in state for leaf in _state_leaves(value)]
    return _fields_leaves(state)


def _fields_leaves(state: Any) -> list[Any]:
    """The leaves of a :class:`funcamp.TrainState`, field by field (each field in optree's leaf order).

    While Dynamo traces, :func:`funcamp._tree.tree_leaves` takes its fast path only for plain containers, and the
    train state is a registered dataclass: flattened whole, it went through Dynamo's optree polyfill, which fails
    on an optimizer state holding a dict whose every leaf is None (``masked(multi_transform(...))`` with a group
    that holds no parameter, its ``scale_by_lion``/``scale_by_adam`` moments over an all-None dict). Its fields
    (params, buffers, optimizer state) are plain containers and take the fast path.
    """
    names = _LEAF_FIELDS.get(type(state))
    if not names:
        return _tree.tree_leaves(state)
    return [leaf for name in names for leaf in _tree.tree_leaves(getattr(state, name))]


def _each_state(tree: Any) -> list[Any]:
    """The dataclass states of a donated argument: the state itself, or those of a dict, list or tuple of them."""
    if isinstance(tree, dict):
        return [s for v in tree.values() for s in _each_state(v)]
    if type(tree) in (list, tuple):
        return [s for v in tree for s in _each_state(v)]
    return [tree] if dataclasses.is_dataclass(tree) else []


def _replaced(tree: Any) -> Any:
    """A new container of new state objects on the same tensors (the given ones are marked donated after)."""
    if isinstance(tree, dict):
        return type(tree)((k, _replaced(v)) for k, v in tree.items())
    if type(tree) in (list, tuple):
        return type(tree)(_replaced(v) for v in tree)
    return dataclasses.replace(tree) if dataclasses.is_dataclass(tree) else tree


def _copy(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


def copying(body: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`donating` for an eager ``body``: the new state is made, then copied in, checked by storage.

    A metric that shares storage with a state tensor (the loss scale; an aux output that is a parameter) and a
    new leaf that is an old state tensor in another place are copied before any write.
    """

    def fn(state: Any, batch: Any) -> dict[str, Any]:
        new_state, metrics = body(state, batch)
        return _write_into(state, new_state, metrics)

    return fn


def in_place(body: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`copying`, but ``body``'s optimizer stage writes into ``state``'s tensors as it goes.

    ``body`` runs within :func:`funcamp.optim._inplace.donating` over the parameters and optimizer state of
    ``state``, so that :func:`funcamp.train.update` (given the verdict) updates them in place, leaf by leaf; what
    it did not write (new tensors in ``new_state``) is copied in after, as :func:`copying` does. ``body`` must
    not read the given state's parameters or optimizer state, nor the gradients, after the update (the step's
    metrics and the skip-limit and aux probes do not; telemetry does: use :func:`copying` with it).
    """

    def fn(state: Any, batch: Any) -> dict[str, Any]:
        donated = _tree.tree_leaves((state.params, state.opt_state))
        new_state, metrics = _inplace.donating(donated, body, state, batch)
        return _write_into(state, new_state, metrics)

    return fn


def _write_into(state: Any, new_state: Any, metrics: dict[str, Any]) -> dict[str, Any]:
    """Copy ``new_state``'s tensors into ``state``'s (skipping those already there); the metrics, safe from it.

    A new leaf that is an old state tensor in another place (a user's transform that keeps the parameters in its
    state, or swaps two of its leaves) is copied before any write, so that it keeps the value it had.
    """
    old = _tree.tree_leaves(state)
    places = {_storage(x) for x in old if isinstance(x, torch.Tensor)}
    metrics = _tree.tree_map(lambda x: _copy_if_in(x, places), metrics)  # aux is a tree
    pairs = [
        (dst, _copy_if_in(src, places) if src is not dst else src)
        for dst, src in zip(old, _tree.tree_leaves(new_state))
    ]
    for dst, src in pairs:
        if isinstance(dst, torch.Tensor) and src is not dst:
            dst.copy_(src)
    return metrics


def _storage(x: torch.Tensor) -> tuple[Any, int]:
    """Where ``x``'s elements live: its device and storage address; a storage with no address (``meta`` and fake
    tensors, such as ``funcamp.capture.check``'s stand-ins, all at 0) by the storage itself."""
    storage = x.untyped_storage()
    if x.device.type == "meta" or torch._subclasses.fake_tensor.is_fake(x):
        return (x.device, storage._cdata)
    return (x.device, storage.data_ptr())


def _copy_if_in(x: Any, places: set[tuple[Any, int]]) -> Any:
    """``x`` cloned if it is a tensor on the storage of a state tensor (which is about to be written)."""
    if isinstance(x, torch.Tensor) and x.numel() and _storage(x) in places:
        return x.clone()
    return x


def returning_state(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run(state, batch) -> metrics`` (a donating step) as ``step(state, batch) -> (new_state, metrics)``.

    ``new_state`` is a new :class:`funcamp.TrainState` on the tensors of ``state``, which now hold the next
    state; ``state`` is marked consumed.
    """

    def step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        states = _each_state(state)
        for one in states:
            check_not_donated(one, "train_step")
            _leaf_fields(type(one))  # for the traced body's _state_leaves
        check_donatable(state)  # every call: each state may hold other tensors
        metrics = run(state, batch)
        new_state = _replaced(state)
        for one in states:
            mark_donated(one)
        return new_state, metrics

    return step
