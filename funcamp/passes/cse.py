"""Sub-pass ``cse``: one node for each value the step computes twice the same way.

The step's graph is an inference graph (Dynamo traced the backward into it), and AOTAutograd merges common
subexpressions only in the graphs its partitioner makes for training, so a value the step asks for twice is
computed twice: the finite check's gradient norm and ``clip_by_global_norm``'s (each two reductions per gradient),
a gradient's ``max |g|`` for its finite flag and for the norm's scale, a mask built twice. :func:`_cse` keeps the
first of two nodes that call the same ATen operator on the same arguments with the same funcamp tags, and points
the second one's users at it.

Only what gives equal values, bit for bit, and only where merging costs no memory the step meant to save: ATen and
prims operators (not collectives: a sharded step gathers a parameter again at each use; not custom ops), and
neither a node tagged as a gather's (``funcamp_gather``) nor one with a mutable argument, nor one with
torch's ``nondeterministic_seeded`` or ``nondeterministic_bitwise`` tags (random draws, scatter-adds whose order
is not fixed) and not a constructor of uninitialized memory (``empty`` and its kin, whose bits are not a value).
A node is merged only with one of equal tags (``node.meta["custom"]``: the forward and backward phases, remat
regions, the flat gradients' concatenation), so the passes after it see every region as it was traced, and a
forward value is never kept alive for a backward that recomputed it on purpose. A value narrower than float32 is
merged only where both nodes are in memory either way (:func:`_rounded_alike`): inductor rounds a narrow value only
where it stores it.
"""

from __future__ import annotations

from typing import Any

import torch

from funcamp.passes._context import PassContext
from funcamp.passes._graph import _in_memory, _read_from_memory
from funcamp.passes.tags import _GATHER

NAME = "cse"

_UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"})
#: ATen and prims only: not collectives (``_c10d_functional``: a sharded step gathers a parameter at each use, so
#: that no rank holds every gathered parameter at once), not custom ops (whose side effects the schema may not say).
_NAMESPACES = frozenset({"aten", "prims"})
_TAGS = ("nondeterministic_seeded", "nondeterministic_bitwise")
_NONDETERMINISTIC = tuple(getattr(torch.Tag, name) for name in _TAGS if hasattr(torch.Tag, name))


def _mergeable(node: torch.fx.Node) -> bool:
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or op.namespace not in _NAMESPACES:
        return False
    if op._schema.is_mutable or any(t in op.tags for t in _NONDETERMINISTIC):
        return False
    if _GATHER in (node.meta.get("custom") or {}):  # a sharded parameter gathered again for each use, on purpose
        return False
    return op._schema.name.split("::")[-1] not in _UNINITIALIZED


def _rounded_alike(kept: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether ``node``'s readers may read ``kept`` instead and get the same bits: always for a value of float32 or
    wider (or not floating); for a narrower one (bfloat16, float16, float8) only where both are in memory either
    way: a graph input's or an extern kernel's result, or read only by extern kernels, regions and the output.
    Inductor does not round a narrow value it computes inside a kernel (it does not emulate precision casts by
    default), so a narrowing stored for a matmul and the same narrowing fused into a pointwise reader are two
    values; merged, the pointwise reader would read the rounded one."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)  # var_mean and the like: a tuple
    if not any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point and v.dtype.itemsize < 4 for v in vals):
        return True
    return all(_in_memory(n) or _read_from_memory(n) for n in (kept, node))


def _key(value: Any) -> Any:
    """A hashable form of a node's argument (nodes as themselves: a merged node's users already point at the
    kept one); raises TypeError for what cannot be hashed (the node is then left alone)."""
    if isinstance(value, torch.fx.Node):
        return ("node", value)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    if isinstance(value, slice):
        return ("slice", _key(value.start), _key(value.stop), _key(value.step))
    if isinstance(value, float) and value != value:  # NaN: equal to itself here (the same constant)
        return ("nan",)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)):
        raise TypeError("symbolic or tensor constant")
    hash(value)
    return (type(value).__name__, value)


def _cse(graph: torch.fx.Graph) -> int:
    """Merge every node into the first equal one (see the module); return how many were removed."""
    seen: dict[Any, torch.fx.Node] = {}
    removed = 0
    for node in list(graph.nodes):
        if not _mergeable(node):
            continue
        try:
            tags = tuple(sorted((node.meta.get("custom") or {}).items()))
            key = (node.target, _key(node.args), _key(node.kwargs), _key(tags))
        except TypeError:
            continue
        kept = seen.setdefault(key, node)
        if kept is node or not _rounded_alike(kept, node):
            continue
        node.replace_all_uses_with(kept)
        graph.erase_node(node)
        removed += 1
    return removed


def run(ctx: PassContext) -> None:
    """:func:`_cse`."""
    _cse(ctx.graph)
