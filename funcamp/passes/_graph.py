"""Graph helpers the passes share: the view and cast ops, what inductor keeps in memory, and moving a group of
nodes to its first user."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch

from funcamp.passes.tags import _PHASE, _tags


def _view_ops() -> frozenset[Any]:
    aten, prims = torch.ops.aten, torch.ops.prims
    names = [(aten, "permute", "default"), (aten, "t", "default"), (aten, "transpose", "int")]
    names += [(aten, "view", "default")]
    names += [(aten, "_unsafe_view", "default"), (aten, "reshape", "default"), (aten, "expand", "default")]
    names += [(aten, "slice", "Tensor"), (aten, "select", "int"), (aten, "unsqueeze", "default")]
    names += [(aten, "alias", "default"), (prims, "convert_element_type", "default"), (aten, "_to_copy", "default")]
    return frozenset(getattr(getattr(ns, op), overload) for ns, op, overload in names)


#: Views and casts a module makes of a gathered parameter (a Linear's transposed weight, after the gather region).
_VIEWS = _view_ops()

_SPLITS = frozenset({torch.ops.aten.split_with_sizes.default, torch.ops.aten.split.Tensor})


_aten = torch.ops.aten
#: Views a tensor may be read through back to where it is stored. Not :data:`_VIEWS`: that set holds the casts
#: too, and a cast computes a new value (a narrowing inductor may fuse into its reader without rounding).
_STORAGE_VIEWS = frozenset(
    {
        _aten.reshape.default,
        _aten.view.default,
        _aten._unsafe_view.default,
        _aten.permute.default,
        _aten.t.default,
        _aten.transpose.int,
        _aten.squeeze.dim,
        _aten.unsqueeze.default,
        _aten.select.int,
    }
)
#: The matrix multiplies inductor runs as kernels it does not generate (without max-autotune, and for the sizes
#: :func:`_full_matmul` allows): ``(index of mat1, of mat2, batched)`` in their arguments.
_MATMULS = {
    _aten.mm.default: (0, 1, False),
    _aten.addmm.default: (1, 2, False),
    _aten.bmm.default: (0, 1, True),
    _aten.baddbmm.default: (1, 2, True),
    _aten._scaled_mm.default: (0, 1, False),
}
#: Ops inductor runs as kernels it does not generate (on a CPU and a GPU, without max-autotune): their operands and
#: results are in memory, fused into no other kernel. Results of several (attention, a convolution's backward) are
#: read by ``getitem``; their names hold one of :data:`_STORED_MANY`.
_STORED = frozenset({*_MATMULS, _aten.convolution.default})
_STORED_MANY = ("convolution_backward", "scaled_dot_product")
#: Nested compile regions (plain and functionalized): their operands and results are tensors in memory.
_REGIONS = (torch.ops.higher_order.invoke_subgraph, torch.ops.higher_order.auto_functionalized_v2)
#: Loops (a scanned run of layers, :mod:`funcamp.nn._scan`, before and after inductor lowers its scan to a
#: ``while_loop``): their results are tensors in memory, read by ``getitem``.
_LOOPS = tuple(
    getattr(torch.ops.higher_order, name) for name in ("scan", "while_loop") if hasattr(torch.ops.higher_order, name)
)


#: Reshapes: a tensor's elements in the same row-major order under another shape (a ``cat`` part's flattening).
_RESHAPES = (_aten.reshape.default, _aten.view.default, _aten._unsafe_view.default)


def _static(val: torch.Tensor) -> bool:
    """Whether ``val``'s shape and strides are plain ints (not a dynamic-shape compile's symbols)."""
    return all(isinstance(d, int) for d in (*val.shape, *val.stride()))


def _val(node: Any) -> torch.Tensor | None:
    """The tensor ``node`` computes (its ``meta["val"]``, a fake tensor), or None for a non-node or a non-tensor."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _value(node: Any) -> Any:
    """What ``node`` computes (its ``meta["val"]``: a fake tensor, a SymInt, ...), or ``node`` itself where it is a
    constant argument: the example a traced call is handed."""
    return node.meta["val"] if isinstance(node, torch.fx.Node) else node


#: Reversals: ``prims.rev(x, dims)`` (what AOTAutograd records for torch's scan's backward) and ``flip(x, dims)``.
_REVERSES = (torch.ops.prims.rev.default, torch.ops.aten.flip.default)


def _first_axis_reversal(node: Any) -> torch.fx.Node | None:
    """``x`` where ``node`` reverses the tensor ``x`` along its first dimension alone (``rev(x, [0])``, or a
    negative dimension naming it), else None: a stack of layers read last layer first."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _REVERSES):
        return None
    if len(node.args) != 2 or node.kwargs:
        return None
    x, dims = node.args
    val = _val(x)
    if val is None or val.ndim == 0 or [d % val.ndim for d in dims] != [0]:
        return None
    return x


def _autotuned() -> bool:
    """Whether inductor may generate a matmul or a convolution as a template that fuses what it reads and what
    reads it (max-autotune): read while the compile's option patch is active."""
    from torch._inductor import config

    return bool(config.max_autotune or config.max_autotune_gemm)


def _full_matmul(node: torch.fx.Node) -> bool:
    """Whether a matrix multiply's ``M``, ``N`` and ``K`` are all known and at least 2: inductor decomposes the others
    into pointwise ops and sums it generates (torch 2.13: ``mm`` with ``K == 1`` or ``M == N == 1``, ``addmm`` with
    ``M == 1``, ``bmm`` with ``M == 1`` or ``N == 1`` on a CPU, an outer-product ``bmm``), which may fuse what they
    read and what reads them like any pointwise op."""
    a_at, b_at, batched = _MATMULS[node.target]
    try:
        a, b = node.args[a_at].meta["val"], node.args[b_at].meta["val"]
    except (AttributeError, IndexError, KeyError):
        return False
    dims = (a.shape[-2], a.shape[-1], b.shape[-1]) if batched else (a.shape[0], a.shape[1], b.shape[1])
    return all(isinstance(d, int) and d >= 2 for d in dims)


def _extern(node: torch.fx.Node) -> bool:
    """Whether the call ``node`` is a kernel inductor does not generate (:data:`_STORED`, :data:`_STORED_MANY`): its
    operands and results in memory."""
    target = node.target
    if target in _STORED:
        return not _autotuned() and (target not in _MATMULS or _full_matmul(node))
    name = target.name() if isinstance(target, torch._ops.OpOverload) else ""
    return any(part in name for part in _STORED_MANY)


def _factors(node: torch.fx.Node) -> Iterator[tuple[torch.fx.Node, torch.fx.Node]]:
    """``(a, c)`` for each way ``node`` is ``aten.mul(a, c)`` (either order): ``c`` a 0-d tensor, ``a`` a tensor of
    the product's dtype and element count (an unscaled gradient: ``c`` the loss scale's reciprocal). Callers add what
    else they need of ``c`` and ``a``."""
    out = node.meta.get("val")
    if node.target is not _aten.mul.Tensor or len(node.args) != 2 or node.kwargs or not isinstance(out, torch.Tensor):
        return
    for a, c in (node.args, node.args[::-1]):
        if not (isinstance(a, torch.fx.Node) and isinstance(c, torch.fx.Node)):
            continue
        va, vc = a.meta.get("val"), c.meta.get("val")
        if not (isinstance(va, torch.Tensor) and isinstance(vc, torch.Tensor)):
            continue
        if vc.ndim == 0 and va.dtype == out.dtype and va.numel() == out.numel():
            yield a, c


def _in_memory(node: torch.fx.Node) -> bool:
    """Whether ``node`` is, through views, a graph input, an extern kernel's result (:func:`_extern`, directly or
    read by ``getitem``), a region's or a loop's (:data:`_LOOPS`): in memory whatever inductor fuses."""
    while node.op == "call_function" and node.target in _STORAGE_VIEWS:
        node = node.args[0]
    if node.op == "placeholder":
        return True
    if node.op != "call_function":
        return False
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        source = node.args[0]
        return source.op == "call_function" and (source.target in (*_REGIONS, *_LOOPS) or _extern(source))
    return _extern(node)


def _read_from_memory(node: torch.fx.Node) -> bool:
    """Whether every reader of ``node``, through views, reads it from memory: an extern kernel, a region, the
    graph's output; never a kernel inductor generates, which may compute ``node`` inline instead of storing it."""
    for user in node.users:
        if user.op == "output":
            continue
        if user.op != "call_function":
            return False
        if user.target in _STORAGE_VIEWS:
            if not _read_from_memory(user):
                return False
        elif not (user.target in _REGIONS or _extern(user)):
            return False
    return True


def _is_input(node: torch.fx.Node) -> bool:
    """A graph input as a parameter's tensor: a placeholder, or a piece of one made outside the forward (no
    phase tag): a step that runs on flat buffers (:mod:`funcamp.train._flat`) takes each parameter as a view of
    a piece of its group's buffer (``split_with_sizes``, ``getitem``, ``view``)."""
    if node.op == "placeholder":
        return True
    return (
        node.op == "call_function"
        and _PHASE not in _tags(node)
        and (node.target in _VIEWS or node.target in _SPLITS or node.target is operator.getitem)
        and bool(node.all_input_nodes)
        and all(map(_is_input, node.all_input_nodes))
    )


def _sink(
    graph: torch.fx.Graph, member: Callable[[torch.fx.Node], bool]
) -> list[tuple[list[torch.fx.Node], torch.fx.Node]]:
    """Move each connected group of ``member`` nodes to just before the first node outside it that uses it;
    return the moved groups (in graph order) with that user.

    ``funcamp.nn.functionalize`` makes every use up front when compiled, so the gathers and the parameters'
    casts come first in the graph; inductor schedules in graph order, which would hold every gathered or cast
    parameter from the start of the forward. Only groups whose other inputs all come before that user are moved.
    """
    moved = []
    order = {node: i for i, node in enumerate(graph.nodes)}
    done: set[torch.fx.Node] = set()
    for node in list(graph.nodes):
        if node in done or not member(node):
            continue
        region, todo = [], [node]  # the connected member nodes
        while todo:
            n = todo.pop()
            if n in done or not member(n):
                continue
            done.add(n)
            region.append(n)
            todo += list(n.users) + list(n.all_input_nodes)
        region.sort(key=order.__getitem__)
        inside = set(region)
        users = [u for n in region for u in n.users if u not in inside]
        if not users:
            continue
        first = min(users, key=order.__getitem__)
        inputs = [i for n in region for i in n.all_input_nodes if i not in inside]
        if any(order[i] >= order[first] for i in inputs):
            continue
        for n in region:
            first.prepend(n)
        moved.append((region, first))
    return moved
