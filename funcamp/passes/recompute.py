"""The copy mechanism of the remat and gather sub-passes: each backward use of a chosen node reads a copy.

:class:`_Recompute` gives every backward use of a node to recompute a copy of it (and of the chosen nodes it
reads) placed just before that use, so the forward's value dies after its last forward use. The copies compute
the same ops on the same inputs, so the gradients are bitwise those without the copies. They wait for the loss's
gradient through one input read as ``where(flag, x, x)`` (:mod:`funcamp.passes.gates`), so inductor can neither
run them during the forward nor fuse them into the forward's kernels. A dropout draw is read as the bool kept
from the forward. The gathers join the regions' recompute (one :class:`_Recompute`) because a region's copy that
reads a gathered weight must read the gather's copy, placed and gated with it.
"""

from __future__ import annotations

import torch

from funcamp.passes._context import PassContext
from funcamp.passes.gates import _after_gradient, _call, _Gate, _gateable
from funcamp.passes.tags import _PHASE, _tags

#: The copy step's name in the pipeline (no switch of its own: it copies what the passes before it chose).
NAME = "recompute"

#: Dtypes inductor cannot select with ``where`` (no type promotion with the bool flag): never a gated input; a
#: copy that reads only such values (a cast of an fp8 value its budget kept) is not gated.
_FLOAT8 = frozenset(getattr(torch, n) for n in dir(torch) if n.startswith("float8_"))


class _Recompute:
    """Gives every backward use of a node in ``recompute`` a copy of it (and of the nodes of ``recompute`` it
    reads) placed just before that use, each copy made once; a ``draws`` node (a dropout draw) is read as the
    bool kept from the forward. The copies wait for the gradient through :class:`_Gate`."""

    def __init__(self, graph: torch.fx.Graph, recompute: set[torch.fx.Node], draws: set[torch.fx.Node]) -> None:
        self.graph, self.recompute, self.draws = graph, recompute, draws
        self.copies: dict[torch.fx.Node, torch.fx.Node] = {}
        self.masks: dict[torch.fx.Node, torch.fx.Node] = {}
        self.after = _after_gradient(graph)

    def run(self) -> None:
        for node in list(self.graph.nodes):
            if _tags(node).get(_PHASE) != "backward" or node in self.recompute:
                continue
            deps = [dep for dep in node.all_input_nodes if dep in self.recompute or dep in self.draws]
            if deps:
                gate = _Gate(self.graph, self.after, node)
                for dep in deps:
                    new = self.copy(dep, gate) if dep in self.recompute else self.mask(dep, gate)
                    node.replace_input_with(dep, new)

    def mask(self, node: torch.fx.Node, gate: _Gate) -> torch.fx.Node:
        """What the backward reads for a region's dropout draw (0 or 1): a bool kept from the forward, made the
        draw's dtype again once the backward begins (the same values; a quarter of float32's bytes)."""
        if node in self.masks:
            return self.masks[node]
        graph = self.graph
        with graph.inserting_after(node):
            kept = _call(graph, torch.ops.aten.ne.Scalar, node, 0)
        kept.meta["custom"] = dict(_tags(node))
        flag = gate.flag()
        with graph.inserting_before(gate.before):
            if flag is not None:
                kept = _call(graph, torch.ops.aten.where.self, flag, kept, kept)
            self.masks[node] = _call(graph, torch.ops.prims.convert_element_type.default, kept, node.meta["val"].dtype)
        return self.masks[node]

    def copy(self, node: torch.fx.Node, gate: _Gate) -> torch.fx.Node:
        """``node``'s copy for the backward, made before ``gate.before`` after the copies (and masks) it reads."""
        if node in self.copies:
            return self.copies[node]
        for dep in node.all_input_nodes:
            if dep in self.recompute:
                self.copy(dep, gate)
            elif dep in self.draws:
                self.mask(dep, gate)
        gated = self._gated_input(node, gate)

        def arg(n: torch.fx.Node) -> torch.fx.Node:
            if n in self.copies:
                return self.copies[n]
            if n in self.draws:
                return self.masks[n]
            if n is gated:
                return _call(self.graph, torch.ops.aten.where.self, gate.flag(), n, n)
            return n

        with self.graph.inserting_before(gate.before):
            dup = self.graph.node_copy(node, arg)
        dup.meta["custom"] = {**_tags(node), _PHASE: "backward"}
        self.copies[node] = dup
        return dup

    def _gated_input(self, node: torch.fx.Node, gate: _Gate) -> torch.fx.Node | None:
        """The input a copy reads as ``where(flag, x, x)`` (bitwise ``x``), so that inductor can neither run it
        early nor fuse it into the forward's kernel (which would keep its result alive until the backward): the
        smallest, for a copy that reads no other copy or mask (copies of copies wait with it), never a float8 one;
        else ``None``."""
        if any(dep in self.copies or dep in self.draws for dep in node.all_input_nodes):
            return None
        inputs = [d for d in node.all_input_nodes if _gateable(d) and d.meta["val"].dtype not in _FLOAT8]
        if not inputs or gate.flag() is None:
            return None
        return min(inputs, key=lambda d: d.meta["val"].numel())


def run(ctx: PassContext) -> None:
    """The copies: every backward use of ``ctx.recompute`` and ``ctx.gathers`` reads one, ``ctx.draws`` as bools.
    Not switchable on its own: with ``remat_regions`` and ``sharded_gathers`` off it has nothing to copy."""
    _Recompute(ctx.graph, ctx.recompute | ctx.gathers, ctx.draws).run()
