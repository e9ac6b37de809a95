"""Pytree utilities: the one package of funcamp that imports optree.

Every tree operation in funcamp goes through here, with the registry namespace ``"funcamp"`` (so the
loss scales and train state, registered in that namespace, flatten into their tensors) and optree's
default of treating ``None`` as an empty node (a ``None`` leaf is kept in place and never visited).

``torch.func`` walks differentiated arguments with ``torch.utils._pytree`` instead; funcamp never zips
leaf lists that came from the two libraries.

Three rooms, one story each: :mod:`funcamp._tree._structure` (flatten, map, rebuild, paths, prefixes,
casts), :mod:`funcamp._tree._fast` (the plain-Python walk a compiled step traces instead of optree's
polyfill) and :mod:`funcamp._tree._numerics` (finite checks, the select of a skipped step, norms). The
names below are the package's; callers use ``funcamp._tree.<name>``.
"""

from __future__ import annotations

from funcamp._tree._fast import NAMESPACE
from funcamp._tree._numerics import (
    all_finite,
    finite_flag_paths,
    finite_flags,
    global_norm,
    norm_dtype,
    norm_of_scaled,
    scaled_global_norm,
    scaled_row_sums,
    select_tree,
    widened,
)
from funcamp._tree._structure import (
    cast_floating,
    dataclass,
    field,
    first_non_floating,
    flatten_as_torch,
    flatten_same,
    is_floating,
    prefix_leaves,
    rebuilder,
    same_structure,
    structures_equal,
    tree_bytes,
    tree_device,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_paths,
    tree_structure,
    tree_unflatten,
)

__all__ = [
    "NAMESPACE",
    "all_finite",
    "cast_floating",
    "dataclass",
    "field",
    "finite_flag_paths",
    "finite_flags",
    "first_non_floating",
    "flatten_as_torch",
    "flatten_same",
    "global_norm",
    "is_floating",
    "norm_dtype",
    "norm_of_scaled",
    "prefix_leaves",
    "rebuilder",
    "same_structure",
    "structures_equal",
    "scaled_global_norm",
    "scaled_row_sums",
    "select_tree",
    "tree_bytes",
    "tree_device",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_paths",
    "tree_structure",
    "tree_unflatten",
    "widened",
]
