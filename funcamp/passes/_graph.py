"""Graph helpers the passes share: the view and cast ops, and moving a group of nodes to its first user."""

from __future__ import annotations

import operator
from collections.abc import Callable
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
