"""The structure side of :mod:`funcamp._tree`: flatten, map, rebuild, paths, prefixes, casts.

Every call goes through optree with the registry namespace ``"funcamp"``, except while a compiled step is
traced, where trees of plain containers take the fast path (:mod:`funcamp._tree._fast`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import optree
import optree.dataclasses
import torch

from funcamp._tree import _fast
from funcamp._tree._fast import NAMESPACE

T = TypeVar("T")


def dataclass(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen dataclass registered as a pytree node in the funcamp namespace.

    Flatten and unflatten are derived from the fields: fields made with ``field(pytree_node=False)``
    are static configuration (part of the tree structure), all others are children.
    """
    out = optree.dataclasses.dataclass(cls, frozen=True, namespace=NAMESPACE)
    fields = [f for f in dataclasses.fields(out) if f.init]
    children = tuple(f.name for f in fields if f.metadata.get("pytree_node", True))
    statics = tuple(f.name for f in fields if not f.metadata.get("pytree_node", True))
    setattr(out, _fast.FIELDS, (out, children, statics))  # the traced walk's copy of optree's flatten
    return out


field = optree.dataclasses.field


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Map ``fn`` over the leaves of ``tree`` (and of ``rest``, which must have its structure).

    As ``optree.tree_map``: each tree in ``rest`` is taken up to ``tree``'s leaves (a leaf of ``tree``
    may face a subtree there, passed to ``fn`` whole). While ``torch.compile`` traces, trees of dicts,
    lists, tuples, NamedTuples and ``None`` take the fast path (:func:`funcamp._tree._fast.flatten`: the same
    leaves, order and result); anything else, and every eager call, goes through optree.
    """
    if _fast.traced():
        flat = _fast.flatten(tree, rest, strict=False)
        if flat is not None:
            leaves, rest_leaves, skeleton = flat
            return _fast.unflatten(skeleton, list(map(fn, leaves, *rest_leaves)))  # no traced loop of its own
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def flatten_same(tree: Any, *rest: Any) -> tuple[list[list[Any]], Callable[[list[Any]], Any]] | None:
    """``([leaves, *rest_leaves], rebuild)`` for trees of one structure, or None outside the fast path.

    The leaves of ``tree`` and of each tree of ``rest`` in leaf order, and ``rebuild(new_leaves)``, a
    tree of ``tree``'s structure. Only while ``torch.compile`` traces and only for trees of dicts (string
    keys), lists, tuples, NamedTuples and ``None`` whose structures are all equal (as optree's treespecs
    compare); None otherwise, and the caller takes optree's path, which also raises the structure errors.
    """
    if not _fast.traced():
        return None
    flat = _fast.flatten(tree, rest, strict=True)
    if flat is None:
        return None
    leaves, rest_leaves, skeleton = flat
    return [leaves, *rest_leaves], lambda new_leaves: _fast.unflatten(skeleton, new_leaves)


def flatten_as_torch(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]] | None:
    """``(leaves, rebuild)`` of ``tree`` by the fast path, while a compiled step traces and only where
    ``torch.utils._pytree`` gives the same leaves (:func:`funcamp._tree._fast.torch_leaves`: no ``None`` and no
    funcamp dataclass, leaves there); None otherwise, and the caller walks the tree with torch's pytree."""
    flat = _fast.flatten(tree, (), strict=True) if _fast.traced() else None
    if flat is None or not _fast.torch_leaves(flat[2]):
        return None
    leaves, _, skeleton = flat
    return leaves, lambda new: _fast.unflatten(skeleton, new)


def tree_leaves(tree: Any) -> list[Any]:
    """Leaves of ``tree`` in optree order (dict keys sorted, ``None`` skipped)."""
    if _fast.traced():
        flat = _fast.flatten(tree, (), strict=True)
        if flat is not None:
            return flat[0]
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def tree_flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """``(leaves, treespec)`` of ``tree``."""
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def tree_unflatten(treespec: optree.PyTreeSpec, leaves: Any) -> Any:
    """Rebuild a tree from ``treespec`` and an iterable of leaves."""
    return optree.tree_unflatten(treespec, leaves)


#: Whether torch.compile (Dynamo) can compare two optree treespecs: torch 2.13's can; torch 2.11's pytree
#: polyfill compares them through a function object's ``__eq__``, which it cannot trace (seen on 2.11.0).
_DYNAMO_COMPARES_SPECS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


def same_structure(spec_a: optree.PyTreeSpec, spec_b: optree.PyTreeSpec, n_a: int, n_b: int) -> bool:
    """Whether two flattened trees (their specs and leaf counts) have the same structure.

    While torch.compile traces on a torch before 2.13, only the leaf counts are compared: Dynamo there
    cannot compare treespecs. Eager calls, and traced calls on torch 2.13+, compare the whole structure.
    """
    if n_a != n_b:
        return False
    if not _DYNAMO_COMPARES_SPECS and _fast.traced():
        return True
    return spec_a == spec_b


def structures_equal(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` have one structure (their optree treespecs are equal).

    While a compiled step traces, trees the fast path walks are compared by that walk (strict: leaf facing
    leaf); anything else, and every eager call, compares optree's treespecs.
    """
    if _fast.traced() and _fast.flatten(a, (b,), strict=True) is not None:
        return True
    return tree_structure(a) == tree_structure(b)


def tree_paths(tree: Any) -> list[str]:
    """A dotted name for each leaf of ``tree``, in leaf order (``"layer.weight"``, ``"0.bias"``).

    Dict entries are named by their key, sequence and NamedTuple entries by their index (``None``
    entries count: they are skipped but keep their index), as optree's ``tree_flatten_with_path``.
    """
    if _fast.traced():  # the fast path's skeleton: no optree polyfill to trace
        flat = _fast.flatten(tree, (), strict=True)
        if flat is not None:
            # Walked as traced, not handed whole to a constant helper: a skeleton may hold a dataclass's static
            # value that Dynamo cannot take for a constant (an object of the user's).
            paths: list[str] = []
            _fast.skeleton_paths(flat[2], (), paths)
            return paths
    paths, _, _ = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return [".".join(str(k) for k in path) for path in paths]


def tree_flatten_with_path(tree: Any) -> tuple[list[tuple[Any, ...]], list[Any], optree.PyTreeSpec]:
    """``(paths, leaves, treespec)`` of ``tree``: each leaf's path a tuple of keys and indices (optree's)."""
    return optree.tree_flatten_with_path(tree, namespace=NAMESPACE)


def rebuilder(tree: Any) -> Callable[[list[Any]], Any]:
    """``rebuild(leaves)``: a tree of ``tree``'s structure with ``leaves`` in leaf order.

    For trees of plain containers (dicts with string keys, lists, tuples, NamedTuples, None) a rebuild that
    Dynamo traces in a few bytecodes per node (the fast path's); otherwise optree's ``tree_unflatten``. Made
    on the host, called while tracing.
    """
    flat = _fast.flatten(tree, (), strict=True)
    if flat is not None:
        skeleton = flat[2]
        return lambda leaves: _fast.unflatten(skeleton, leaves)
    spec = tree_structure(tree)
    return lambda leaves: optree.tree_unflatten(spec, leaves)


def prefix_leaves(prefix: Any, tree: Any, fn: str, name: str) -> list[Any]:
    """One value of ``prefix`` for each leaf of ``tree``, in ``tree``'s leaf order: optax's mask and label trees.

    ``prefix`` has ``tree``'s structure or is a prefix of it. Where ``prefix`` holds a value (a bool, a
    label: anything but a dict, list, tuple or other registered node) and ``tree`` a subtree, the value
    stands for every leaf of the subtree, as optax broadcasts a mask or label over ``jax.tree.map(f, prefix,
    tree)``. Where ``tree`` holds a leaf, the value of ``prefix`` there is taken whole (a tuple label too). A
    ``None`` of ``tree`` is an empty subtree: it has no leaves, whatever ``prefix`` holds there (optax
    accepts any value in place of its ``MaskedNode``). Containers match node by node: a dict by its keys,
    compared whole, never as dotted prefixes (``{"0": False}`` does not cover the flat ``{"0.weight": w}``:
    optax's trees are nested, and so is this match), a list or tuple by type and length, a NamedTuple by
    type. A plain-Python walk over plain containers (so Dynamo traces it); other nodes go through optree.

    Args:
      prefix: the mask or label tree.
      tree: the parameters (or updates) it is matched against.
      fn: the function matching them, and ``name`` the argument ``prefix`` was given as (for the message).
    Returns:
      A list with one value of ``prefix`` per leaf of ``tree``.
    Raises:
      ValueError: where ``prefix`` is neither ``tree``'s structure nor a prefix of it (the message names the
        path, and what each side holds there).
    """
    out: list[Any] = []
    _prefix_walk(prefix, tree, (), out, (fn, name))
    return out


_PLAIN_VALUES = (bool, int, float, complex, str, bytes, type(None))


def _is_node(x: Any) -> bool:
    """Whether optree flattens ``x`` into children (a container), not a leaf; ``None`` counts as a value here."""
    if isinstance(x, _PLAIN_VALUES) or isinstance(x, torch.Tensor):
        return False
    return type(x) in (dict, list, tuple) or optree.register_pytree_node.get(type(x), namespace=NAMESPACE) is not None


def _prefix_walk(prefix: Any, node: Any, path: tuple[str, ...], out: list[Any], what: tuple[str, str]) -> None:
    if node is None:
        return  # an empty subtree: no leaf to give a value
    if not _is_node(node):
        out.append(prefix)  # a leaf: the prefix's value here, whole
        return
    if not _is_node(prefix):
        out.extend([prefix] * len(tree_leaves(node)))  # a value over a subtree: broadcast
        return
    cls = type(node)
    if cls is dict and type(prefix) is dict and all(type(k) is str for k in node):
        missing, extra = sorted(set(node) - set(prefix)), sorted(set(prefix) - set(node))
        if missing or extra:
            raise ValueError(_prefix_error(what, path, node, prefix, missing, extra))
        for k in sorted(node):
            _prefix_walk(prefix[k], node[k], (*path, k), out, what)
        return
    plain = cls is list or cls is tuple or (isinstance(node, tuple) and _fast.is_plain_namedtuple(cls))
    if plain and type(prefix) is cls and len(prefix) == len(node):
        for i, (p, x) in enumerate(zip(prefix, node)):
            _prefix_walk(p, x, (*path, str(i)), out, what)
        return
    if plain or type(prefix) is not cls:
        raise ValueError(_prefix_error(what, path, node, prefix, [], []))
    children, _, entries, _ = optree.tree_flatten_one_level(node, namespace=NAMESPACE)
    p_children, _, p_entries, _ = optree.tree_flatten_one_level(prefix, namespace=NAMESPACE)
    if tuple(entries) != tuple(p_entries):
        raise ValueError(_prefix_error(what, path, node, prefix, [], []))
    for entry, p, x in zip(entries, p_children, children):
        _prefix_walk(p, x, (*path, str(entry)), out, what)


def _prefix_error(
    what: tuple[str, str], path: tuple[str, ...], node: Any, prefix: Any, missing: list, extra: list
) -> str:
    fn, name = what
    where = f"at {'.'.join(path)!r}" if path else "at the top"

    def kind(x: Any) -> str:
        size = f" of {len(x)}" if isinstance(x, (list, tuple, dict)) else ""
        return f"a {type(x).__name__}{size}"

    def keys(ks: list) -> str:
        return str(ks) if len(ks) <= 5 else f"{ks[:5]} (and {len(ks) - 5} more)"

    if missing or extra:
        said = []
        if missing:
            said.append(f"{name} has no entry for the parameters' key(s) {keys(missing)}")
        if extra:
            said.append(f"{name} has key(s) {keys(extra)} that the parameters do not have")
        detail = f"{where} {' and '.join(said)}"
        dotted = [k for k in extra if any(n.startswith(f"{k}.") for n in node)]
        if dotted:
            covered = next(n for n in node if n.startswith(f"{dotted[0]}."))
            detail += (
                f"; dict keys are matched whole, not as dotted prefixes: {dotted[0]!r} does not cover {covered!r} "
                "in a flat dict of parameters. Nest the parameters, or pass a callable, e.g. "
                f"lambda params: {{k: not k.startswith({dotted[0] + '.'!r}) for k in params}}"
            )
    else:
        detail = f"{where} the parameters hold {kind(node)} and {name} holds {kind(prefix)}"
    return (
        f"{fn}: {name} must have the structure of the parameters, or be a prefix of it (one value for a whole "
        f"subtree); {detail}"
    )


def tree_structure(tree: Any) -> optree.PyTreeSpec:
    """The structure (treespec) of ``tree``."""
    return optree.tree_structure(tree, namespace=NAMESPACE)


def is_floating(x: Any) -> bool:
    """True for a real floating-point tensor (complex tensors are not floating)."""
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def cast_floating(tree: T, dtype: torch.dtype) -> T:
    """Cast the real floating-point tensor leaves of ``tree`` to ``dtype``.

    Integer, bool and complex tensors, Python numbers, strings, ``None`` and any other object are
    returned as the same object. A tensor that already has ``dtype`` is returned as is (no copy).
    Works inside ``torch.compile`` and under autograd (the cast is differentiable).
    """
    return tree_map(lambda x: x.to(dtype) if is_floating(x) and x.dtype != dtype else x, tree)


def tree_device(tree: Any) -> torch.device:
    """The device of the first floating leaf of ``tree`` (CPU for a tree with none)."""
    for x in tree_leaves(tree):
        if is_floating(x):
            return x.device
    return torch.device("cpu")


def first_non_floating(tree: Any) -> tuple[str, str] | None:
    """``(path, what)`` of the first leaf of ``tree`` that is not a floating tensor, or None.

    ``what`` is the leaf's dtype for a tensor, its type name otherwise; used by error messages. The paths are
    made only when such a leaf is found (a compiled step traces one walk of a tree whose leaves all float).
    """
    leaves = tree_leaves(tree)
    kinds = _fast.dtypes(leaves) if _fast.traced() else None  # plain tensors: one question of their dtypes
    if kinds is not None and _fast.all_floating(kinds, wide=False):
        return None
    for i, leaf in enumerate(leaves):
        if not is_floating(leaf):
            path = tree_paths(tree)[i]
            return path, str(leaf.dtype) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
    return None


def tree_bytes(tree: Any) -> int:
    """Bytes held by the tensor leaves of ``tree`` (``numel * element_size``), a Python int."""
    return sum(x.numel() * x.element_size() for x in tree_leaves(tree) if isinstance(x, torch.Tensor))
