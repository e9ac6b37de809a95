"""The optimizer's side of flat buffers: which transformations may run on them, and their masks there.

A compiled train step runs the optimizer over one contiguous 1-D buffer per group of parameters
(:mod:`funcamp.train._flat`) instead of leaf by leaf: inductor lowers the update once per buffer, so its
compile time does not grow with the number of tensors (optax's ``flatten``, llm.c's ``adamw_update``). The
optimizer is given a tree ``{group key: buffer}`` where it is normally given the parameters' tree. Two things
make that give the same numbers:

* the transformation computes each element from that element alone (and the leaf's dtype), or from the
  global norm of all of them: funcamp's own transformations, marked with :func:`elementwise`. A user's
  transformation is not marked (it may read shapes or names), and an optimizer that holds one runs leaf by
  leaf (:func:`runs_flat` says which);
* a mask or a label tree (``add_decayed_weights(mask=)``, ``masked``, ``multi_transform``) gives every leaf of
  a buffer the same value. The layout is built from the values the masks give (:class:`Recording`, while the
  optimizer runs once on shape-only copies of the parameters), leaves with the same values (and dtype and
  device) share a buffer, and while the optimizer runs over the buffers each mask gives a buffer its leaves'
  value (:class:`Replay`). Masks and labels are read where they are evaluated, through :func:`leaf_values`.

Both are read from one dynamic scope (:class:`funcamp._scope.Scope`): outside a layout's build and a flat update nothing
changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from funcamp import _scope, _tree

__all__ = ["Recording", "Replay", "elementwise", "leaf_values", "recording", "replaying", "runs_flat"]

_FLAT = "_funcamp_elementwise"
_SCOPE = _scope.Scope()  # a Recording while a layout is built, a Replay while the optimizer runs over buffers


def elementwise(transform: Any, *inner: Any) -> Any:
    """Declare that ``transform`` may run over flat buffers (if each of ``inner`` may); returns it.

    ``funcamp.optim.elementwise``. A state with flat storage (``TrainState.create``, :mod:`funcamp.train._flat`)
    runs its optimizer over one 1-D buffer per group of parameters instead of leaf by leaf; it does so only when
    every transformation of the optimizer is declared elementwise, and keeps the state leaf by leaf otherwise
    (``state.storage.reason`` says so). Declare your own transformation when it holds: each element of its
    updates is computed from the same element of the updates, parameters and state leaves (given their
    dtypes), from 0-d state (counts, rates) and from global norms it asks the step's layout for
    (``funcamp._scope.current().scaled_global_norm``); it reads no shape, name or position of a leaf, and a
    state leaf it makes from a parameter is made from it (``zeros_like(p)``, ``p.new_zeros(...)``) so that the
    layout can match it to the parameter. A wrong declaration gives wrong numbers: compare with
    ``FUNCAMP_FLAT=off`` (bitwise for an elementwise transformation). funcamp's own transformations are
    declared; a combinator (``chain``, ``masked``, ``multi_transform``, the bfloat16 master wrappers) is declared
    only when each of its ``inner`` transformations is.

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> def update(updates, state, params=None):
      ...     return {k: torch.sign(u) for k, u in updates.items()}, state
      >>> sign = optim.elementwise(optim.GradientTransformation(lambda params: (), update))
      >>> import funcamp as fa
      >>> fa.TrainState.create({"w": torch.ones(3)}, optim.chain(sign, optim.sgd(0.1))).storage.kind
      'flat'
    """
    if all(runs_flat(t) for t in inner):
        setattr(transform.update, _FLAT, True)
    return transform


def runs_flat(transform: Any) -> bool:
    """Whether ``transform`` was marked by :func:`elementwise` (and so may run over flat buffers)."""
    return getattr(getattr(transform, "update", None), _FLAT, False)


class Recording:
    """What each mask and label tree gave each leaf, by the leaf's dotted name (while a layout is built).

    ``values[id(spec)][name]`` is the value; ``specs`` lists the specs in the order they were first seen;
    ``consistent`` turns False when a spec gave one leaf two values (a callable that depends on the tree it is
    given): such an optimizer runs leaf by leaf.
    """

    def __init__(self) -> None:
        self.values: dict[int, dict[str, Any]] = {}
        self.specs: list[Any] = []
        self.consistent = True

    def add(self, spec: Any, names: list[str], values: list[Any]) -> None:
        """Record that ``spec`` gave the leaves ``names`` the ``values``."""
        seen = self.values.get(id(spec))
        if seen is None:
            seen = self.values[id(spec)] = {}
            self.specs.append(spec)  # held: the id stays this spec's while the recording lives
        for name, value in zip(names, values, strict=True):
            if name in seen and seen[name] != value:
                self.consistent = False
            seen[name] = value


class Replay:
    """The value each mask and label tree gives each flat buffer, by the buffer's key (while it runs flat).

    Args:
      values: ``id(spec) -> {buffer key: value}`` for every spec the layout's :class:`Recording` saw.
      specs: those specs, held so that their ids stay theirs while the replay lives.
    """

    def __init__(self, values: dict[int, dict[str, Any]], specs: list[Any] = ()) -> None:
        self.values = values
        self.specs = list(specs)

    def __call__(self, spec: Any, tree: Any) -> list[Any]:
        by_key = self.values.get(id(spec))
        if by_key is None:
            raise RuntimeError(
                "funcamp: a mask or label tree that was not seen when the flat layout was built is read over the "
                "flat buffers (an optimizer whose masks depend on values?); build the step with a per-leaf "
                "optimizer state (make_train_step(..., compile=False)) and report this"
            )
        return [by_key[key] for key in _tree.tree_paths(tree)]


def recording(record: Recording, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with every :func:`leaf_values` evaluation recorded into ``record``."""
    return _SCOPE.within(record, fn, *args, **kwargs)


def replaying(replay: Replay, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` over flat buffers: :func:`leaf_values` answers from ``replay``."""
    return _SCOPE.within(replay, fn, *args, **kwargs)


def leaf_values(spec: Any, tree: Any, evaluate: Callable[[], list[Any]]) -> list[Any]:
    """The value ``spec`` (a mask or label tree, or a callable making one) gives each leaf of ``tree``.

    ``evaluate()`` computes them as the transformation always has (one per leaf of ``tree``, in leaf order,
    checked); over flat buffers (:func:`replaying`) the recorded values of each buffer's leaves are returned
    instead, and while a layout is built (:func:`recording`) the computed ones are recorded by leaf name.
    """
    current = _SCOPE.current()
    if isinstance(current, Replay):
        return current(spec, tree)
    if not isinstance(current, Recording):
        return evaluate()
    with _StateTensorsOnly():
        values = evaluate()
    current.add(spec, _tree.tree_paths(tree), values)
    return values


class _StateTensorsOnly(torch.overrides.TorchFunctionMode):
    """While a layout records a mask's values: refuse a mask callable that reads ``requires_grad`` or the device.

    A mask or label callable is evaluated on the state's parameters, which are tensors of the state (detached:
    ``requires_grad`` is False in every step), not on the module's ``nn.Parameter``s; a rule such as nanoGPT's
    ``p.requires_grad and p.ndim >= 2`` would select nothing, silently. Select by name or by ``ndim`` instead.
    The layout records on shape-only (meta) stand-ins: a callable that reads the device (``p.device``,
    ``p.is_cpu``...) would record the stand-in's, so it is refused here too, and the state is kept leaf by leaf
    (where the callable sees the parameters themselves), with this reason.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        owner = getattr(func, "__self__", None)  # an attribute's getter: its descriptor
        if owner is torch.Tensor.requires_grad:
            raise TypeError(
                "funcamp.optim: a mask or label callable read p.requires_grad; it is given the train state's "
                "parameters, which are plain tensors (requires_grad False in every step), not the module's "
                "nn.Parameters. Select by name (a dict of bools) or by shape (p.ndim >= 2) instead"
            )
        if func is torch.Tensor.get_device or any(owner is d for d in _DEVICE_READS):
            raise TypeError(
                "funcamp.optim: a mask or label callable read the parameters' device, which the flat layout's "
                "shape-only stand-ins do not have"
            )
        return func(*args, **(kwargs or {}))


_DEVICE_READS = (torch.Tensor.device, torch.Tensor.is_cpu, torch.Tensor.is_cuda, torch.Tensor.is_meta)
