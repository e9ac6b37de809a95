"""Sub-pass ``sharded_gathers``: a sharded parameter's all-gather is recomputed for its backward uses.

A sharded step gathers each parameter at its use (:func:`funcamp.passes.tags.gather_region`, :mod:`funcamp._at_use`);
kept for the backward, every gathered parameter would live from its forward use to its backward. Instead its
backward uses get a new all-gather (:mod:`funcamp.passes.recompute`; every rank compiles the same graph, so every
rank runs the same collectives in the same order; its only input is the shard, a graph input), always, whatever
the regions. Afterwards (:func:`_regather`) a forward gather nothing uses any more (an up-front gather every use
gathered again) is dropped, and each remaining forward gather is moved to just before its first user.
"""

from __future__ import annotations

import torch

from funcamp.passes._context import PassContext
from funcamp.passes._graph import _VIEWS, _sink
from funcamp.passes.tags import _GATHER, _PHASE, _tags

NAME = "sharded_gathers"


def _gathered(node: torch.fx.Node) -> bool:
    """A forward :func:`gather_region` node (a functional all-gather, its wait, casts and views of a shard), or a
    forward view or cast of one only (a Linear's ``permute`` of its weight: left out, the backward kept the
    forward's gather alive through it). Impure to fx (they communicate), recomputed all the same: every rank
    recomputes the same ones in the same order."""
    tags = _tags(node)
    if node.op != "call_function" or tags.get(_PHASE) != "forward":
        return False
    if tags.get(_GATHER):
        return True
    inputs = node.all_input_nodes
    return node.target in _VIEWS and bool(inputs) and all(_gathered(i) for i in inputs)


def _gathers(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The forward gather nodes: every one is recomputed for its backward uses."""
    return {n for n in graph.nodes if _gathered(n)}


def _regather(graph: torch.fx.Graph) -> None:
    """After the recompute: the forward gathers nothing uses are dropped, the others moved to their first user."""
    _drop_unused_gathers(graph)
    _sink_gathers(graph)


def _drop_unused_gathers(graph: torch.fx.Graph) -> None:
    """Erase the forward gather nodes nothing uses (an up-front gather that every use gathered again)."""
    for node in reversed(list(graph.nodes)):
        if _gathered(node) and not node.users:
            graph.erase_node(node)


def _sink_gathers(graph: torch.fx.Graph) -> None:
    """Move each forward gather (a collective and its views) to just before its first user (:func:`_sink`)."""
    _sink(graph, _gathered)


def select(ctx: PassContext) -> None:
    """Fill ``ctx.gathers`` (:func:`_gathers`): the recompute step copies them with the regions' nodes."""
    ctx.gathers = _gathers(ctx.graph)


def regather(ctx: PassContext) -> None:
    """After the recompute step: :func:`_regather`."""
    _regather(ctx.graph)
