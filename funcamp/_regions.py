"""Activation checkpointing inside the one compiled graph: regions tagged while tracing, recomputed by a graph pass.

``torch.utils.checkpoint`` cannot recompute under ``torch.func`` gradient transforms (saved-tensor hooks are
disabled there), and the compiled train step differentiates with ``torch.func``: without this module a
checkpointed region keeps its activations once compiled. Instead, while ``torch.compile`` traces,

- :func:`phase` tags the nodes of the differentiated function's forward (``"forward"``) and of the gradient
  computation around it (``"backward"``), in :mod:`funcamp.grad`;
- :func:`remat_region` tags the nodes of a checkpointed module's forward (``functionalize(remat=...)``);
- :func:`gather_region` tags a sharded parameter's all-gather (:mod:`funcamp._at_use`);

with ``torch.fx.traceback.annotate``, whose tags reach the graph inductor compiles. :class:`RematPass`, an
inductor ``post_grad_custom_pre_pass``, then gives every backward use of a tagged forward node a copy of it
(and of the tagged nodes it depends on) placed just before that use, so the forward's copy dies after its last
forward use: only the region's inputs live on to the backward, as with ``torch.utils.checkpoint``. The copies
compute the same ops on the same inputs, so gradients are bitwise those without remat. Random ops (dropout
masks) and ops that write to their inputs are never copied: their results are kept, so masks are replayed.
A gathered parameter is recomputed the same way: its backward uses get a new all-gather (every rank compiles the
same graph, so every rank runs the same collectives in the same order), and a gather nothing uses any more (an
up-front gather every use gathered again) is dropped. Where torch has no ``annotate`` (before 2.9) nothing is
tagged and the pass does nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

import torch

__all__ = ["RematPass", "gather_region", "phase", "recompute_for_backward", "remat_region"]

_PHASE, _REMAT, _GATHER = "funcamp_phase", "funcamp_remat", "funcamp_gather"


def _annotate(tags: dict[str, Any]) -> Any:
    annotate = getattr(torch.fx.traceback, "annotate", None)
    if annotate is None or not torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return annotate(tags)


def phase(name: str) -> Any:
    """A context that tags the nodes traced inside it as ``name`` (``"forward"`` or ``"backward"``)."""
    return _annotate({_PHASE: name})


def remat_region() -> Any:
    """A context that tags the nodes traced inside it as recomputable for the backward."""
    return _annotate({_REMAT: True})


def gather_region() -> Any:
    """A context that tags the nodes traced inside it as a parameter gather, re-gathered for the backward."""
    return _annotate({_GATHER: True})


def _tags(node: torch.fx.Node) -> dict[str, Any]:
    return node.meta.get("custom") or {}


def _recomputable(node: torch.fx.Node) -> bool:
    tags = _tags(node)
    if node.op != "call_function" or not (tags.get(_REMAT) or tags.get(_GATHER)) or tags.get(_PHASE) != "forward":
        return False
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None and (
        schema.is_mutable or any(a.alias_info and a.alias_info.is_write for a in schema.arguments)
    ):
        return False
    if tags.get(_GATHER):  # a functional all-gather and its wait: impure to fx (they communicate), but every
        return True  # rank recomputes the same ones in the same order, and they read only the shards
    tags_of_op = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded not in tags_of_op and not node.is_impure()


def recompute_for_backward(graph: torch.fx.Graph, recomputable: Any) -> None:
    """Give every backward use of a ``recomputable(node)`` forward node a copy of it (and of the recomputable
    nodes it depends on) placed before that use, made to wait for a backward value (see the module)."""
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    aten = torch.ops.aten

    def call(op: Any, *args: Any) -> torch.fx.Node:
        """A new node of ``op``, with the fake value later passes read (``meta["val"]``)."""
        node = graph.call_function(op, args)
        vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
        with vals[0].fake_mode:
            node.meta["val"] = op(*vals)
        node.meta["custom"] = {_PHASE: "backward"}
        return node

    def gate(before: torch.fx.Node) -> torch.fx.Node | None:
        """A 0-d bool made from one of ``before``'s backward inputs: what the copies wait for."""
        for inp in before.all_input_nodes:
            val = inp.meta.get("val")
            if _tags(inp).get(_PHASE) == "backward" and hasattr(val, "fake_mode") and val.numel():
                with graph.inserting_before(before):
                    first = inp
                    for _ in range(val.ndim):  # its first element, a 0-d view
                        first = call(aten.select.int, first, 0, 0)
                    return call(aten.eq.Tensor, first, first)
        return None

    def copy(node: torch.fx.Node, before: torch.fx.Node, flag: torch.fx.Node | None) -> torch.fx.Node:
        if node in copies:
            return copies[node]
        for dep in node.all_input_nodes:
            if recomputable(dep):
                copy(dep, before, flag)

        def arg(n: torch.fx.Node) -> torch.fx.Node:
            if n in copies:
                return copies[n]
            val = n.meta.get("val")
            if flag is None or not hasattr(val, "fake_mode") or val.is_complex():
                return n
            # where(flag, n, n) is n, bitwise, but makes the copy wait for the backward: inductor cannot
            # fuse it into the forward's kernel (which would keep its result alive until the backward)
            return call(aten.where.self, flag, n, n)

        with graph.inserting_before(before):
            dup = graph.node_copy(node, arg)
        dup.meta["custom"] = {**_tags(node), _PHASE: "backward"}
        copies[node] = dup
        return dup

    for node in list(graph.nodes):
        if _tags(node).get(_PHASE) != "backward" or recomputable(node):
            continue
        deps = [dep for dep in node.all_input_nodes if recomputable(dep)]
        if deps:
            flag = gate(node)
            for dep in deps:
                node.replace_input_with(dep, copy(dep, node, flag))


def _drop_unused_gathers(graph: torch.fx.Graph) -> None:
    """Erase the :func:`gather_region` nodes nothing uses (an up-front gather that every use gathered again).

    A functional collective is not a side effect to ``torch.fx``, but inductor may keep one whose result is
    unused; every rank traces the same graph, so every rank drops the same collectives.
    """
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and _tags(node).get(_GATHER) and not node.users:
            graph.erase_node(node)


def _sink_gathers(graph: torch.fx.Graph) -> None:
    """Move each forward :func:`gather_region` (a collective and its views) to just before its first user.

    ``funcamp.nn.functionalize`` makes every use up front when compiled, so the gathers come first in the
    graph; inductor schedules in graph order, which would hold every gathered parameter from the start of
    the forward. Moved, a parameter is gathered where its module needs it. Only regions whose other inputs
    all come before that user are moved (the shards and their casts are graph inputs or made early).
    """
    order = {node: i for i, node in enumerate(graph.nodes)}

    def forward_gather(n: torch.fx.Node) -> bool:
        tags = _tags(n)
        return n.op == "call_function" and bool(tags.get(_GATHER)) and tags.get(_PHASE) == "forward"

    done: set[torch.fx.Node] = set()
    for node in list(graph.nodes):
        if node in done or not forward_gather(node):
            continue
        region, todo = [], [node]  # the connected tagged nodes
        while todo:
            n = todo.pop()
            if n in done or not forward_gather(n):
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
        if any(order[i] >= order[first] for i in inputs) or order[region[-1]] >= order[first]:
            continue
        for n in region:
            first.prepend(n)


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _Base
except ImportError:  # older torch: a plain callable
    _Base = object


class RematPass(_Base):  # type: ignore[misc, valid-type]
    """The inductor graph pass that recomputes :func:`remat_region` nodes for their backward uses (see module)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        recompute_for_backward(graph, _recomputable)
        _drop_unused_gathers(graph)
        _sink_gathers(graph)

    def uuid(self) -> bytes:
        """The pass's identity for inductor's caches: a hash of this module's source."""
        with open(__file__, "rb") as f:
            return hashlib.sha256(f.read()).digest()
