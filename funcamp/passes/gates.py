"""Ordering gates: a value made to wait for another by reading it as ``where(flag, x, x)`` (bitwise ``x``).

Inductor schedules a node as soon as its inputs exist and fuses a node without graph inputs into any earlier
kernel; moving a node in the graph does not make it wait. A gate does: ``flag`` is a 0-d bool made from a value
computed from a later value (its first element compared with itself; both branches of the select are ``x``, so
the result is ``x`` whatever the flag), and the gated read, and everything computed from it, can run only once that
value exists. The passes gate their copies on a value of the loss's gradient
(:func:`_after_gradient`), or, for the casts moved to their use, on the forward's last value before the use.
"""

from __future__ import annotations

from typing import Any

import torch

from funcamp.passes._graph import _value
from funcamp.passes.tags import _PHASE, _tags


def _after_gradient(graph: torch.fx.Graph) -> dict[torch.fx.Node, torch.fx.Node]:
    """The backward's values computed from the loss's gradient, each mapped to itself, and every other node
    mapped to the last such value before it in the graph's order.

    A backward node computed from forward values alone (LayerNorm's ``x - mean``, GELU's ``x * x``) could run
    during the forward: a copy gated on it would not wait. The loss's gradient (the seed, ``ones`` or the loss
    scale) is found as the backward node without backward inputs that the most gradients (backward nodes
    without backward users) are computed from.
    """
    roots: dict[torch.fx.Node, int] = {}  # backward node -> bit set of the input-less backward nodes it reads
    count = 0
    for node in graph.nodes:
        if _tags(node).get(_PHASE) != "backward":
            continue
        bits = 0
        for inp in node.all_input_nodes:
            bits |= roots.get(inp, 0)
        if not bits:
            bits, count = 1 << count, count + 1
        roots[node] = bits
    ends = [bits for node, bits in roots.items() if not any(user in roots for user in node.users)]
    if not ends:
        return {}
    seed = max((1 << i for i in range(count)), key=lambda bit: sum(1 for bits in ends if bits & bit))
    out: dict[torch.fx.Node, torch.fx.Node] = {}
    last = None
    for node in graph.nodes:
        if roots.get(node, 0) & seed and _gateable(node):
            last = node
        if last is not None:
            out[node] = last
    return out


def _gateable(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return hasattr(val, "fake_mode") and val.numel() > 0 and not val.is_complex()


def _call(graph: torch.fx.Graph, op: Any, *args: Any, phase: str | None = "backward") -> torch.fx.Node:
    """A new node of ``op`` at the graph's insertion point, tagged ``phase`` (``None``: untagged, as the
    optimizer's nodes are), with the fake value later passes read."""
    node = graph.call_function(op, args)
    vals = [_value(a) for a in args]
    with vals[0].fake_mode:
        node.meta["val"] = op(*vals)
    if phase is not None:
        node.meta["custom"] = {_PHASE: phase}
    return node


def _flag(graph: torch.fx.Graph, source: torch.fx.Node, phase: str = "backward") -> torch.fx.Node:
    """A 0-d bool computed from ``source`` (its first element compared with itself), at the insertion point: a
    value that exists only once ``source`` does, for ``where(flag, x, x)`` (bitwise ``x``, NaN or not)."""
    first = source
    for _ in range(source.meta["val"].ndim):  # its first element, a 0-d view
        first = _call(graph, torch.ops.aten.select.int, first, 0, 0, phase=phase)
    return _call(graph, torch.ops.aten.eq.Tensor, first, first, phase=phase)


class _Gate:
    """What the copies made for one backward node wait for: a 0-d bool made from a value of the gradient, made at
    most once, when a copy first needs it (:meth:`flag`); ``None`` where the graph has no gradient value before."""

    def __init__(self, graph: torch.fx.Graph, after: dict[torch.fx.Node, torch.fx.Node], before: torch.fx.Node):
        self.graph, self.after, self.before = graph, after, before
        self.made: list[torch.fx.Node | None] = []

    def flag(self) -> torch.fx.Node | None:
        if not self.made:
            self.made.append(self._make())
        return self.made[0]

    def _make(self) -> torch.fx.Node | None:
        """One of ``before``'s gradient inputs, or else (an input-only part of a backward formula, such as
        LayerNorm's ``x - mean``) the gradient value last computed before it in the graph's order: its first
        element compared with itself."""
        before, after = self.before, self.after
        source = next((inp for inp in before.all_input_nodes if after.get(inp) is inp), None) or after.get(before)
        if source is None:
            return None
        with self.graph.inserting_before(before):
            return _flag(self.graph, source)
