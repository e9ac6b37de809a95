"""Parameter groups, optax-style: ``masked``, ``multi_transform`` and ``set_to_zero``.

A group is chosen by a tree with the structure of the parameters, or a prefix of it, as in optax:
Python bools for ``masked``, labels for ``multi_transform`` (or a callable ``params -> such a tree``,
evaluated on the Python side when the step is traced, so it must depend on names, shapes and dtypes
only, never on values). In a prefix, one value stands for a whole subtree: ``{"encoder": False,
"decoder": True}`` masks every tensor of a nested ``{"encoder": {...}, "decoder": {...}}``. Dict keys are
matched whole: funcamp's own parameters are usually a flat dict with dotted names (``"0.weight"``,
``functionalize``'s), and there ``{"0": False}`` is refused (optax's trees are nested, so it never
matches names by their dotted prefix either); write the flat tree, or a callable such as ``lambda params:
{k: not k.startswith("0.") for k in params}``. What is neither the structure nor a prefix is refused with a
``ValueError`` naming the path where the two differ.

Each inner transformation sees a tree of the same structure in which the leaves outside its group are
``None`` (optree treats ``None`` as an empty node, so the inner transform neither visits them nor keeps
state for them); optax puts its ``MaskedNode`` there. States are NamedTuples of the inner states, so
they compose with ``chain``, compile with ``fullgraph=True``, and are kept bitwise by ``TrainState``
on a skipped step like every other optimizer state.

Nesting (a ``masked`` inside a ``multi_transform`` group, say) works the same way one level down: where
the tree an inner mask or labels tree is matched against has ``None`` (a leaf outside the outer group),
any value is accepted and ignored, as optax accepts any value in place of its ``MaskedNode``; a callable
gets those leaves as ``None``.

optax's ``update(updates, state, params, **extra_args)`` passes extra arguments (a loss value, say) down to
the transforms that take them, and ``masked``/``multi_transform``'s ``mask_compatible_extra_args=True``
masks those shaped like the parameters. funcamp's ``update(updates, state, params)`` takes none (hyperparameters
and anything else a transform needs live in its closure), so there is nothing to mask:
``mask_compatible_extra_args=False`` (optax's default) is accepted and changes nothing, ``True`` is refused
with a ``ValueError``, and an extra argument to ``update`` with a ``TypeError``.

This is what ``torch.optim``'s parameter groups do (``[{"params": ..., "lr": ...}, ...]``): e.g.
no weight decay on biases and norms, another learning rate for a head, or frozen tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import torch

from funcamp import _tree
from funcamp.optim import _flat, _inplace
from funcamp.optim.base import (
    EmptyState,
    GradientTransformation,
    OptState,
    Params,
    Updates,
    empty_init,
    mark_outermost,
    outermost_name,
)

__all__ = ["MaskedState", "MultiTransformState", "masked", "multi_transform", "set_to_zero"]


class MaskedState(NamedTuple):
    """State of ``masked``."""

    inner_state: OptState  # the inner transformation's state, built on the masked-in leaves only


class MultiTransformState(NamedTuple):
    """State of ``multi_transform``."""

    inner_states: dict[Hashable, OptState]  # label -> state of transforms[label], built on that group


def set_to_zero() -> GradientTransformation:
    """Replace every update by zeros: the parameters it is applied to do not move (frozen).

    The zeros are negative zeros (``-0.0``) in each update's dtype, because ``p + (-0.0) == p`` bit
    for bit for every ``p`` including ``-0.0``, whereas ``-0.0 + 0.0`` is ``+0.0``; optax's
    ``set_to_zero`` returns ``+0.0``. With ``apply_updates`` a frozen parameter therefore stays bitwise
    unchanged, as a ``torch.optim`` parameter that is in no group (or has no gradient).

    Returns:
      A ``GradientTransformation`` with an ``EmptyState``.

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> optim.set_to_zero().update({"w": torch.ones(2)}, optim.EmptyState())[0]["w"]
      tensor([-0., -0.])
    """

    def update(updates: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        del params
        return _tree.tree_map(lambda u: _inplace.reuse(u, torch.full_like(u, -0.0)), updates), state

    return _flat.elementwise(_inplace.in_place(GradientTransformation(empty_init, update)))


def masked(
    inner: GradientTransformation, mask: Any, *, mask_compatible_extra_args: bool = False
) -> GradientTransformation:
    """Apply ``inner`` to the leaves where ``mask`` is ``True``; pass the other updates through unchanged.

    ``inner`` sees trees (updates, params) in which the masked-out leaves are ``None``, so its state
    holds nothing for them (no moments for biases under ``masked(add_decayed_weights(...))``, say) and
    a norm it computes (``clip_by_global_norm``) is over the masked-in leaves only, as in optax.

    Args:
      inner: the transformation to apply to the masked-in leaves.
      mask: a tree of Python bools with the structure of the parameters or a prefix of it (a bool for a whole
        subtree; dict keys matched whole, not as dotted prefixes: see the module docstring), or a callable
        returning one (called with ``params`` in ``init`` and with ``updates`` in ``update``, as optax does).
      mask_compatible_extra_args: keyword-only, optax's; ``False`` (the default) only: funcamp's ``update``
        takes no extra arguments, so there are none to mask (module docstring).
    Returns:
      A ``GradientTransformation`` with a ``MaskedState``; the updates keep the structure of the input.
    Raises:
      TypeError: if ``inner`` is not a ``GradientTransformation``.
      TypeError: if ``mask_compatible_extra_args`` is not a bool; ValueError: if it is ``True``.
      ValueError: (from ``init``/``update``) if the mask tree is neither the parameters' structure nor a prefix
        of it (the message names the path).
      TypeError: (from ``init``/``update``) if a mask leaf is not a Python bool (tensors are refused:
        a group must be known when the step is traced).
      TypeError: (from ``update``) if it is given an extra argument (optax's ``**extra_args``).

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> params = {"b": torch.ones(2), "w": torch.ones(2)}
      >>> opt = optim.masked(optim.scale(-0.5), {"b": False, "w": True})
      >>> opt.update({"b": torch.ones(2), "w": torch.ones(2)}, opt.init(params), params)[0]
      {'b': tensor([1., 1.]), 'w': tensor([-0.5000, -0.5000])}
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"masked: inner must be a GradientTransformation, got {type(inner).__name__}")
    _check_extra_args_flag("masked", mask_compatible_extra_args)

    def flags(tree: Any) -> list[bool]:
        return _group_leaves("masked", "mask", mask, tree, _check_bool)

    def init(params: Params) -> MaskedState:
        return MaskedState(inner_state=_init_group(inner, params, flags(params)))

    def update(
        updates: Updates, state: MaskedState, params: Params = None, **extra_args: Any
    ) -> tuple[Updates, MaskedState]:
        _refuse_extra_args("masked", extra_args)
        keep = flags(updates)
        out, inner_state = _update_group("masked", inner, updates, state.inner_state, params, keep)
        return _merge(updates, [(out, keep)]), MaskedState(inner_state=inner_state)

    result = _flat.elementwise(_inplace.in_place(GradientTransformation(init, update)), inner)
    return _outermost_if_inside(result, [inner])


def multi_transform(
    transforms: Mapping[Hashable, GradientTransformation],
    param_labels: Any,
    *,
    mask_compatible_extra_args: bool = False,
) -> GradientTransformation:
    """Give each group of parameters its own transformation, chosen by a label per parameter.

    Every parameter belongs to exactly one group: the leaves labelled ``k`` are updated by
    ``transforms[k]`` (which sees the other leaves as ``None``), and the results are put back together.
    Use ``set_to_zero()`` for a group that must not move. A transformation whose label no parameter
    carries is allowed, as in optax: its state is built on an empty tree and it never changes.

    Args:
      transforms: a mapping ``label -> GradientTransformation``.
      param_labels: a tree of labels (hashable Python values such as strings) with the structure of the
        parameters or a prefix of it (one label for a whole subtree, as optax's; dict keys matched whole, not
        as dotted prefixes: see the module docstring), or a callable returning one (called with ``params`` in
        ``init`` and with ``updates`` in ``update``, as optax does).
      mask_compatible_extra_args: keyword-only, optax's; ``False`` (the default) only: funcamp's ``update``
        takes no extra arguments, so there are none to mask (module docstring).
    Returns:
      A ``GradientTransformation`` with a ``MultiTransformState`` (one inner state per label, in the
      order of ``transforms``).
    Raises:
      TypeError: if ``transforms`` is not a non-empty mapping of ``GradientTransformation`` objects.
      TypeError: if ``mask_compatible_extra_args`` is not a bool; ValueError: if it is ``True``.
      ValueError: (from ``init``/``update``) if the labels tree is neither the parameters' structure nor a
        prefix of it (the message names the path).
      ValueError: (from ``init``/``update``) if a parameter's label has no transformation (the message
        names the parameter, its label and the labels that have one).
      TypeError: (from ``init``/``update``) if a label is a tensor or not hashable.
      ValueError: (from ``update``) if the state's labels differ from ``transforms``'.
      TypeError: (from ``update``) if it is given an extra argument (optax's ``**extra_args``).

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> params = {"head": torch.ones(1), "body": torch.ones(1), "frozen": torch.ones(1)}
      >>> labels = {"head": "fast", "body": "slow", "frozen": "none"}
      >>> opt = optim.multi_transform(
      ...     {"fast": optim.sgd(1.0), "slow": optim.sgd(0.1), "none": optim.set_to_zero()}, labels
      ... )
      >>> grads = {"head": torch.ones(1), "body": torch.ones(1), "frozen": torch.ones(1)}
      >>> updates, state = opt.update(grads, opt.init(params), params)
      >>> optim.apply_updates(params, updates)
      {'head': tensor([0.]), 'body': tensor([0.9000]), 'frozen': tensor([1.])}
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError(
            "multi_transform: transforms must be a non-empty mapping label -> GradientTransformation, "
            f"got {transforms!r}"
        )
    for label, t in transforms.items():
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"multi_transform: transforms[{label!r}] must be a GradientTransformation, got {type(t).__name__}"
            )
    transforms = dict(transforms)
    _check_extra_args_flag("multi_transform", mask_compatible_extra_args)

    def groups(tree: Any) -> dict[Hashable, list[bool]]:
        labels = _group_leaves("multi_transform", "param_labels", param_labels, tree, _check_label)
        for i, label in enumerate(labels):
            if label not in transforms:
                raise ValueError(
                    f"multi_transform: parameter {_tree.tree_paths(tree)[i]!r} has label {label!r}, which has no "
                    "transformation; "
                    f"transforms has labels {list(transforms)}. Add transforms[{label!r}] "
                    "(optim.set_to_zero() to freeze the group) or fix the label."
                )
        return {k: [label == k for label in labels] for k in transforms}

    def init(params: Params) -> MultiTransformState:
        by_label = groups(params)
        return MultiTransformState(inner_states={k: _init_group(t, params, by_label[k]) for k, t in transforms.items()})

    def update(
        updates: Updates, state: MultiTransformState, params: Params = None, **extra_args: Any
    ) -> tuple[Updates, MultiTransformState]:
        _refuse_extra_args("multi_transform", extra_args)
        if not isinstance(state, MultiTransformState) or set(state.inner_states) != set(transforms):
            got = list(state.inner_states) if isinstance(state, MultiTransformState) else type(state).__name__
            raise ValueError(
                f"multi_transform: the state has labels {got} but transforms has {list(transforms)}; "
                "pass the state made by this multi_transform's init"
            )
        by_label = groups(updates)
        parts, new_states = [], {}
        for k, t in transforms.items():
            inner_state = state.inner_states[k]
            out, new_states[k] = _update_group("multi_transform", t, updates, inner_state, params, by_label[k])
            parts.append((out, by_label[k]))
        return _merge(updates, parts), MultiTransformState(inner_states=new_states)

    result = _flat.elementwise(_inplace.in_place(GradientTransformation(init, update)), *transforms.values())
    return _outermost_if_inside(result, list(transforms.values()))


# --- private helpers ---------------------------------------------------------------------------------


def _check_bool(fn: str, path: Callable[[], str], x: Any) -> None:
    if not isinstance(x, bool):
        raise TypeError(
            f"{fn}: mask leaves must be Python bools (True: in the group), got {type(x).__name__} at {path()!r}"
        )


def _check_label(fn: str, path: Callable[[], str], x: Any) -> None:
    if isinstance(x, torch.Tensor) or not isinstance(x, Hashable):
        raise TypeError(
            f"{fn}: labels must be hashable Python values such as strings, got {type(x).__name__} at {path()!r}"
        )


def _check_extra_args_flag(fn: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: mask_compatible_extra_args must be a bool (True or False), got {value!r}")
    if value:
        raise ValueError(
            f"{fn}: mask_compatible_extra_args=True has nothing to mask: funcamp's update(updates, state, params) "
            "takes no extra arguments (optax's **extra_args); put what a transform needs in its closure, and drop "
            "the argument (False, optax's default, is accepted)"
        )


def _refuse_extra_args(fn: str, extra_args: dict[str, Any]) -> None:
    if extra_args:
        raise TypeError(
            f"{fn}: update takes (updates, state, params) and no extra arguments (optax's **extra_args), got "
            f"{sorted(extra_args)}; put what a transform needs in its closure"
        )


Check = Callable[[str, Callable[[], str], Any], None]


def _group_leaves(fn: str, name: str, spec: Any, tree: Any, check: Check) -> list[Any]:
    """The leaves of ``spec`` (or of ``spec(tree)``), one per leaf of ``tree``, each checked (over flat buffers,
    the values their leaves have: :func:`funcamp.optim._flat.leaf_values`)."""
    return _flat.leaf_values(spec, tree, lambda: _evaluated_leaves(fn, name, spec, tree, check))


def _evaluated_leaves(fn: str, name: str, spec: Any, tree: Any, check: Check) -> list[Any]:
    """The values of ``spec`` (or of ``spec(tree)``), one per leaf of ``tree``, each checked.

    ``spec`` has ``tree``'s structure or is a prefix of it (:func:`funcamp._tree.prefix_leaves`: a plain-Python
    walk, which Dynamo traces; Dynamo cannot flatten a dict of Python values such as bools and strings).
    """
    if callable(spec):
        spec = spec(tree)
    leaves = _tree.prefix_leaves(spec, tree, fn, name)
    for i, x in enumerate(leaves):
        check(fn, lambda i=i: _tree.tree_paths(tree)[i], x)
    return leaves


def _flatten(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """``(leaves, rebuild)`` of ``tree``; ``rebuild(new_leaves)`` is a tree of its structure.

    While Dynamo traces, the fast path's (:func:`funcamp._tree.flatten_same`): Dynamo's polyfill of optree fails
    on a tree whose every leaf is ``None`` (a group that holds no parameter: a label that no parameter carries,
    a mask that selects nothing), in ``tree_flatten``, ``tree_unflatten`` and ``tree_structure`` alike, so the
    group helpers here take the fast path first.
    """
    fast = _tree.flatten_same(tree)
    if fast is not None:
        return fast[0][0], fast[1]
    leaves, spec = _tree.tree_flatten(tree)
    return leaves, lambda new: _tree.tree_unflatten(spec, new)


def _subtree(tree: Any, keep: list[bool]) -> Any:
    """``tree`` with the leaves where ``keep`` is False replaced by ``None`` (an empty node)."""
    leaves, rebuild = _flatten(tree)
    return rebuild([x if k else None for x, k in zip(leaves, keep, strict=True)])


def _init_group(inner: GradientTransformation, params: Params, keep: list[bool]) -> OptState:
    state = inner.init(_subtree(params, keep))
    # A group with no parameters gets its counters on the CPU (tree_device of an empty tree): move
    # them to the parameters' device so that TrainState's select_tree and the compiled step see one device.
    device = _tree.tree_device(params)
    return _tree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, state)


def _update_group(
    fn: str, inner: GradientTransformation, updates: Updates, state: OptState, params: Params, keep: list[bool]
) -> tuple[Any, OptState]:
    sub = _subtree(updates, keep)
    out, new_state = _inplace.call(inner, sub, state, None if params is None else _subtree(params, keep))
    if not _same_structure(out, sub):
        raise ValueError(
            f"{fn}: an inner transformation changed the structure of its updates, from {_tree.tree_structure(sub)} "
            f"to {_tree.tree_structure(out)}"
        )
    return out, new_state


def _same_structure(a: Any, b: Any) -> bool:
    """Whether trees ``a`` and ``b`` have one structure; while Dynamo traces, by the fast path where it can
    (see :func:`_flatten`)."""
    if _tree.flatten_same(a, b) is not None:
        return True
    leaves_a, spec_a = _tree.tree_flatten(a)
    leaves_b, spec_b = _tree.tree_flatten(b)
    return _tree.same_structure(spec_a, spec_b, len(leaves_a), len(leaves_b))


def _merge(updates: Updates, parts: list[tuple[Any, list[bool]]]) -> Updates:
    """``updates`` with, for each ``(out, keep)``, the kept leaves replaced by ``out``'s leaves in order."""
    leaves, rebuild = _flatten(updates)
    merged = list(leaves)
    for out, keep in parts:
        it = iter(_tree.tree_leaves(out))
        for i, k in enumerate(keep):
            if k:
                merged[i] = next(it)
    return rebuild(merged)


def _outermost_if_inside(result: GradientTransformation, inner: list[GradientTransformation]) -> GradientTransformation:
    """Carry the must-be-outermost mark of a group's transformation (a bfloat16 master-weight wrapper) up."""
    name = next((n for t in inner if (n := outermost_name(t)) is not None), None)
    return mark_outermost(result, name) if name is not None else result
