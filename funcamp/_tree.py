"""Pytree utilities: the one module of funcamp that imports optree.

Every tree operation in funcamp goes through here, with the registry namespace ``"funcamp"`` (so the
loss scales and train state, registered in that namespace, flatten into their tensors) and optree's
default of treating ``None`` as an empty node (a ``None`` leaf is kept in place and never visited).

``torch.func`` walks differentiated arguments with ``torch.utils._pytree`` instead; funcamp never zips
leaf lists that came from the two libraries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import optree
import optree.dataclasses
import torch

__all__ = [
    "NAMESPACE",
    "all_finite",
    "cast_floating",
    "dataclass",
    "field",
    "finite_flags",
    "first_non_floating",
    "global_norm",
    "is_floating",
    "select_tree",
    "tree_bytes",
    "tree_device",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_paths",
    "tree_structure",
    "tree_unflatten",
]

NAMESPACE = "funcamp"

T = TypeVar("T")


def dataclass(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen dataclass registered as a pytree node in the funcamp namespace.

    Flatten and unflatten are derived from the fields: fields made with ``field(pytree_node=False)``
    are static configuration (part of the tree structure), all others are children.
    """
    return optree.dataclasses.dataclass(cls, frozen=True, namespace=NAMESPACE)


field = optree.dataclasses.field


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Map ``fn`` over the leaves of ``tree`` (and of ``rest``, which must have its structure)."""
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def tree_leaves(tree: Any) -> list[Any]:
    """Leaves of ``tree`` in optree order (dict keys sorted, ``None`` skipped)."""
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def tree_flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """``(leaves, treespec)`` of ``tree``."""
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def tree_unflatten(treespec: optree.PyTreeSpec, leaves: Any) -> Any:
    """Rebuild a tree from ``treespec`` and an iterable of leaves."""
    return optree.tree_unflatten(treespec, leaves)


def tree_paths(tree: Any) -> list[str]:
    """A dotted name for each leaf of ``tree``, in leaf order (``"layer.weight"``, ``"0.bias"``)."""
    paths, _, _ = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return [".".join(str(k) for k in path) for path in paths]


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


def _floating_leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_leaves(tree) if is_floating(x)]


def tree_device(tree: Any) -> torch.device:
    """The device of the first floating leaf of ``tree`` (CPU for a tree with none)."""
    for x in tree_leaves(tree):
        if is_floating(x):
            return x.device
    return torch.device("cpu")


def first_non_floating(tree: Any) -> tuple[str, str] | None:
    """``(path, what)`` of the first leaf of ``tree`` that is not a floating tensor, or None.

    ``what`` is the leaf's dtype for a tensor, its type name otherwise; used by error messages.
    """
    for path, leaf in zip(tree_paths(tree), tree_leaves(tree)):
        if not is_floating(leaf):
            return path, str(leaf.dtype) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
    return None


def finite_flags(tree: Any) -> torch.Tensor:
    """Per-leaf finiteness: a 1-d bool tensor with one entry per floating leaf, in leaf order.

    Non-floating leaves are skipped. For an empty tree the result has shape ``(0,)`` on the CPU.
    """
    leaves = _floating_leaves(tree)
    if not leaves:
        return torch.ones(0, dtype=torch.bool)
    return torch.stack([torch.isfinite(x).all() for x in leaves])


def all_finite(tree: Any) -> torch.Tensor:
    """Whether every element of every floating leaf of ``tree`` is finite.

    Returns:
      A 0-d bool tensor on the device of the first floating leaf (CPU for a tree with none). It is
      ``False`` if any element is NaN, +inf or -inf; ``True`` for an empty tree. ``None`` leaves and
      non-floating leaves are ignored. No host sync.
    """
    return finite_flags(tree).all()


def select_tree(pred: torch.Tensor, a: T, b: T) -> T:
    """Elementwise ``a if pred else b`` over two trees of the same structure.

    Tensor leaves are combined with ``torch.where`` (no host sync, traceable); each pair of tensor
    leaves must have the same dtype and shape (no broadcasting). Non-tensor leaves must be equal in
    both trees and are taken from ``a``.

    Args:
      pred: a 0-d ``torch.bool`` tensor.
      a: the tree taken where ``pred`` is true.
      b: the tree taken where ``pred`` is false; same structure as ``a``.
    Raises:
      TypeError: if ``pred`` is not a tensor, or is not of dtype ``torch.bool``.
      ValueError: if ``pred`` is not 0-d, if the structures of ``a`` and ``b`` differ, or if two
        paired leaves differ in dtype, in shape, or in value (for non-tensors).
    """
    if not isinstance(pred, torch.Tensor):
        raise TypeError(f"select_tree: pred must be a 0-d torch.bool tensor, got {type(pred).__name__}")
    if pred.dtype != torch.bool:
        raise TypeError(f"select_tree: pred must be a 0-d torch.bool tensor, got dtype {pred.dtype}")
    if pred.ndim != 0:
        raise ValueError(f"select_tree: pred must be 0-d (a scalar), got shape {tuple(pred.shape)}")
    leaves_a, spec_a = tree_flatten(a)
    leaves_b, spec_b = tree_flatten(b)
    if spec_a != spec_b:
        raise ValueError(f"select_tree: a and b must have the same structure, got {spec_a} and {spec_b}")
    return tree_unflatten(spec_a, [_select_leaf(pred, x, y) for x, y in zip(leaves_a, leaves_b)])


def _select_leaf(pred: torch.Tensor, x: Any, y: Any) -> Any:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        if x.dtype != y.dtype:
            raise ValueError(f"select_tree: paired leaves differ in dtype: {x.dtype} and {y.dtype}")
        if x.shape != y.shape:
            raise ValueError(
                f"select_tree: paired leaves must have the same shape, got {tuple(x.shape)} and {tuple(y.shape)}"
            )
        return torch.where(pred, x, y)
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or x != y:
        raise ValueError(f"select_tree: non-tensor leaves must be equal in a and b, got {x!r} and {y!r}")
    return x


def global_norm(tree: Any) -> torch.Tensor:
    """The L2 norm of all floating leaves of ``tree`` taken together, computed in float32.

    Returns:
      A 0-d float32 tensor on the device of the first floating leaf (CPU and 0.0 for a tree with
      none). Non-finite elements make it non-finite.
    """
    leaves = _floating_leaves(tree)
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    # float64 leaves are normed in float64 (vector_norm will not narrow), then every norm is float32.
    norms = [torch.linalg.vector_norm(x, dtype=torch.promote_types(x.dtype, torch.float32)).float() for x in leaves]
    return torch.linalg.vector_norm(torch.stack(norms))


def tree_bytes(tree: Any) -> int:
    """Bytes held by the tensor leaves of ``tree`` (``numel * element_size``), a Python int."""
    return sum(x.numel() * x.element_size() for x in tree_leaves(tree) if isinstance(x, torch.Tensor))
