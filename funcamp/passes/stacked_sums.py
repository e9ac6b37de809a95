"""Sub-pass ``stacked_sums``: the same reduction of every layer of a stack is computed once, over the stack.

A scanned run's weight gradients come out of the backward scan stacked, one tensor per weight with a leading layer
axis, and each layer's gradient is a ``select`` of it. A flat state's finite check and global norm then reduce each
gradient buffer as rows (:func:`funcamp._tree.scaled_row_sums`: widened to float64, squared, summed per row), and
where a buffer is one weight that chain reads one layer of the stack: inductor gave each layer its own loop, which
differed from the others only in the offset it read at (GPT-2 124M's scanned step: 48 of the 86 loops of its
largest kernel, 3,199 lines of C++).

Here every ``sum`` that reads ``select(G, 0, k)`` through a chain of casts, reshapes and powers, for two
or more ``k`` with the same chain, is computed once over ``G`` (each reshape given the layer axis in front, each
summed dimension moved one along), and each layer's sum is ``select(sums, 0, k)``, a view. Each row is summed in
the same order as before (the reduction is the same, over the same elements), so the values are the same bit for
bit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from funcamp.passes._context import PassContext
from funcamp.passes._graph import _val

NAME = "stacked_sums"

_SUM = torch.ops.aten.sum.dim_IntList
_SELECT = torch.ops.aten.select.int
_CONVERT = torch.ops.prims.convert_element_type.default
_RESHAPES = (torch.ops.aten.reshape.default, torch.ops.aten.view.default)
_POW = torch.ops.aten.pow.Tensor_Scalar
_CHAIN = (_CONVERT, _POW, *_RESHAPES)


def _layer_chain(node: torch.fx.Node) -> tuple[torch.fx.Node, int, list[torch.fx.Node]] | None:
    """``(G, k, chain)`` where the sum ``node`` reads ``select(G, 0, k)`` through ``chain`` (the casts, reshapes and
    powers, then ``node``), or None. A node of the chain that something else reads too stays for that reader."""
    chain = [node]
    x = node.args[0]
    while isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target in _CHAIN:
        if x.kwargs or not all(not isinstance(a, torch.fx.Node) for a in x.args[1:]):
            return None
        chain.append(x)
        x = x.args[0]
    if not (isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target is _SELECT and not x.kwargs):
        return None
    stack, dim, k = x.args
    val = _val(stack)
    if dim != 0 or not isinstance(k, int) or val is None or not isinstance(val.shape[0], int):
        return None
    if getattr(val, "fake_mode", None) is None:
        return None
    return stack, k % val.shape[0], chain[::-1]


def _signature(chain: list[torch.fx.Node]) -> tuple[Any, ...]:
    """What must be equal for two layers' chains to be computed as one: each node's op and its other arguments."""
    return tuple((n.target, repr(n.args[1:]), repr(sorted(n.kwargs.items()))) for n in chain)


def _stacked(graph: torch.fx.Graph, stack: torch.fx.Node, chain: list[torch.fx.Node], at: torch.fx.Node) -> Any:
    """The chain applied to the whole ``stack``, its nodes inserted before ``at``; returns the stacked sum's node."""
    n = _val(stack).shape[0]
    x, val = stack, _val(stack)
    with val.fake_mode, graph.inserting_before(at):
        for node in chain:
            if node.target in _RESHAPES:
                args, kwargs = (x, [n, *node.args[1]]), {}
                target = torch.ops.aten.reshape.default
            elif node.target is _SUM:
                ndim = _val(node.args[0]).ndim
                dims = [d % ndim + 1 for d in node.args[1]]
                args, kwargs, target = (x, dims, *node.args[2:]), dict(node.kwargs), _SUM
            else:
                args, kwargs, target = (x, *node.args[1:]), dict(node.kwargs), node.target
            val = target(*(_val(a) if isinstance(a, torch.fx.Node) else a for a in args), **kwargs)
            x = graph.call_function(target, args, kwargs)
            x.meta = {**node.meta, "val": val, "tensor_meta": _extract_tensor_metadata(val)}
    return x


def _stack_sums(graph: torch.fx.Graph) -> int:
    """Compute each group of layer sums over its stack (see the module); returns the number of sums replaced."""
    groups: dict[tuple[Any, ...], dict[int, list[torch.fx.Node]]] = {}
    for node in graph.find_nodes(op="call_function", target=_SUM):
        found = _layer_chain(node)
        if found is not None:
            stack, k, chain = found
            groups.setdefault((stack, _signature(chain)), {}).setdefault(k, chain)
    replaced = 0
    order = {node: i for i, node in enumerate(graph.nodes)}
    for (stack, _), layers in groups.items():
        if len(layers) < 2:
            continue
        first = min((chain[-1] for chain in layers.values()), key=order.__getitem__)
        sums = _stacked(graph, stack, next(iter(layers.values())), first)
        for k, chain in layers.items():
            with graph.inserting_after(sums):
                layer = graph.call_function(_SELECT, (sums, 0, k))
            val = _val(sums).select(0, k)
            layer.meta = {**chain[-1].meta, "val": val, "tensor_meta": _extract_tensor_metadata(val)}
            chain[-1].replace_all_uses_with(layer)
            select = chain[0].args[0]
            for node in (*reversed(chain), select):
                if not node.users:
                    graph.erase_node(node)
            replaced += 1
    return replaced


def run(ctx: PassContext) -> None:
    """:func:`_stack_sums` of the graph."""
    _stack_sums(ctx.graph)
