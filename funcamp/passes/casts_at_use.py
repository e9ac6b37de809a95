"""Sub-pass ``casts_at_use``: a parameter's forward casts and views are made just before their first use.

Compiled, ``funcamp.nn.functionalize`` makes every parameter's forward tensor up front, before any module runs;
inductor schedules in graph order and fuses nodes without graph inputs into any earlier kernel, which held every
block's bfloat16 weights from the step's first kernel on. The casts and views that one region reads
(:func:`funcamp.passes.remat_regions._param_uses`) are moved to just before their first user and made to wait
(:func:`_wait_for_user`) for the value the forward computed last before them.
"""

from __future__ import annotations

import torch

from funcamp.passes import remat_regions
from funcamp.passes._context import PassContext
from funcamp.passes._graph import _VIEWS, _is_input, _sink
from funcamp.passes.gates import _call, _flag, _gateable
from funcamp.passes.tags import _PHASE, _tags

NAME = "casts_at_use"


#: What a graph input's forward tensor is made with: views, casts and the waits' ``where(flag, x, x)``.
_INPUT_OPS = _VIEWS | {torch.ops.aten.where.self}


def _of_inputs_only(node: torch.fx.Node) -> bool:
    """A graph input, or views, casts and ``where`` of graph inputs only (a weight's cast, its transpose)."""
    if _is_input(node):
        return True
    return node.op == "call_function" and node.target in _INPUT_OPS and all(map(_of_inputs_only, node.all_input_nodes))


def _wait_for_user(graph: torch.fx.Graph, group: list[torch.fx.Node]) -> None:
    """Make ``group`` (casts and views of graph inputs, moved to just before their first user) wait for the
    value the forward computed last before it: each graph input it reads is read as ``where(flag, x, x)``
    (bitwise ``x``), ``flag`` made from that value (not from another parameter's cast).

    Moving the casts in the graph is not enough: inductor fuses nodes that have no inputs in the graph into
    any earlier kernel, and put every block's bfloat16 weights into the step's first kernel, all alive through
    the forward (GPT-2 124M: 74 MiB at its peak)."""
    source = group[0].prev
    while source.op != "root" and not (
        source.op == "call_function"
        and _tags(source).get(_PHASE) == "forward"
        and _gateable(source)
        and not _of_inputs_only(source)
    ):
        source = source.prev
    if source.op == "root":
        return
    with graph.inserting_before(group[0]):
        flag = _flag(graph, source, phase="forward")
        gated = {}
        for node in group:
            for inp in node.all_input_nodes:
                if _is_input(inp) and inp not in gated:
                    gated[inp] = _call(graph, torch.ops.aten.where.self, flag, inp, inp, phase="forward")
    for node in group:
        for inp, late in gated.items():
            node.replace_input_with(inp, late)


def _casts_at_use(graph: torch.fx.Graph, param_uses: dict[torch.fx.Node, int]) -> None:
    """Move each group of ``param_uses`` to just before its first user (:func:`funcamp.passes._graph._sink`),
    waiting for the forward's value before it (:func:`_wait_for_user`)."""
    for group, _ in _sink(graph, param_uses.__contains__):
        _wait_for_user(graph, group)


def run(ctx: PassContext) -> None:
    """:func:`_casts_at_use` of the parameters' uses (:func:`funcamp.passes.remat_regions.param_uses`)."""
    _casts_at_use(ctx.graph, remat_regions.param_uses(ctx))
