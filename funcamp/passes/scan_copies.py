"""Sub-pass ``scan_copies``: a scan's body does not copy a tensor back into the layout it had.

torch 2.13 differentiates a scan by tracing its body's joint graph and functionalizing it with
``remove="mutations_and_views"`` (``torch/_higher_order_ops/partitioner.py``): every view becomes a copy, so the
forward body's transposed weight, ``permute(w)``, becomes ``clone(permute(w))``, and the saved value the backward
reads is ``clone(permute(clone(permute(w))))``, the weight itself, copied twice; the backward body computes a
weight's gradient and transposes it out and back the same way. Inductor makes each clone a copy in memory: for a
scanned transformer, every layer's weights copied into the saved stack (the stack a whole copy of the weights, kept
from the forward to the backward) and every weight gradient copied twice, each step.

Two rewrites, each exact by construction: both tensors hold the same values at every index in the same strides,
so every reader reads the same bytes.

* In a body, a chain of copies and views (``clone`` and the ``*_copy`` ops functionalization writes, ``permute``,
  ``t``, ``transpose``, ``view``, ``reshape``, ``_unsafe_view``, ``alias``, ``detach``) from ``a`` to ``b`` that
  maps every index to itself, ``b`` with ``a``'s shape, dtype and strides, is dropped: ``b``'s readers read ``a``.
  As a result of the body, ``b`` is kept where ``a`` is not computed into memory of its own in the body (an input,
  a view, an item of an op's results) or is a result already (a result must alias no input and no other result).
* A result of the body stacked by the scan (a ``ys``) that is, by such a chain, the layer the scan reads of one of
  its ``xs`` stacks, with the stack's shape, dtype and strides, is no longer computed: the outer graph reads the
  ``xs`` stack in its place (for a scanned linear layer, the weight the backward reads).

Identity is checked on real index tensors (``arange`` through the chain), for static shapes up to
:data:`_MAX_ELEMENTS` elements; anything else is left as it is.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from funcamp.passes._context import PassContext
from funcamp.passes._graph import _val

NAME = "scan_copies"

_SCAN = torch.ops.higher_order.scan
_aten = torch.ops.aten
#: Copies: each makes a new tensor of its own holding its operand's values (``clone``, and the ``*_copy`` ops
#: functionalization writes for views, each the values of its view); the layout is the one its node's value records.
_COPIES = frozenset(
    {
        _aten.clone.default,
        _aten.t_copy.default,
        _aten.permute_copy.default,
        _aten.transpose_copy.int,
        _aten.view_copy.default,
        _aten.alias_copy.default,
        _aten.detach_copy.default,
    }
)
#: Views: their result shares their operand's memory (a result of the body must not be one).
_VIEWS = frozenset(
    {
        _aten.permute.default,
        _aten.t.default,
        _aten.transpose.int,
        _aten.view.default,
        _aten.reshape.default,
        _aten._unsafe_view.default,
        _aten.alias.default,
        _aten.detach.default,
    }
)
#: The ops of a chain: one tensor operand (the first), no value computed.
_CHAIN = _COPIES | _VIEWS
#: The largest tensor whose identity is checked (the check runs the chain on an index tensor of that size).
_MAX_ELEMENTS = 1 << 26


def _static(val: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in (*val.shape, *val.stride()))


def _link(node: Any) -> bool:
    """Whether ``node`` is one op of a chain: a copy (no layout but the contiguous one) or a view."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _CHAIN):
        return False
    if node.target is _aten.clone.default:
        return set(node.kwargs) <= {"memory_format"} and node.kwargs.get("memory_format", torch.contiguous_format) in (
            torch.contiguous_format,
            torch.preserve_format,
        )
    return not node.kwargs


def _replay(chain: list[torch.fx.Node], x: torch.Tensor) -> torch.Tensor | None:
    """``x`` through the ops of ``chain`` (each reading the one before), or None where an op refuses it."""
    for node in chain:
        try:
            x = node.target(x, *node.args[1:], **node.kwargs)
        except RuntimeError:
            return None
    return x


def _same(a: torch.fx.Node, b: torch.fx.Node, chain: list[torch.fx.Node]) -> bool:
    """Whether ``b``, ``chain`` applied to ``a``, holds ``a``'s values at every index in ``a``'s layout."""
    va, vb = _val(a), _val(b)
    if va is None or vb is None or not (_static(va) and _static(vb)):
        return False
    if va.dtype != vb.dtype or va.shape != vb.shape or va.stride() != vb.stride() or va.numel() > _MAX_ELEMENTS:
        return False
    with unset_fake_temporarily():  # a compiler may run the pass under its fake mode: the check needs values
        index = torch.arange(va.numel(), dtype=torch.int32).view(va.shape)
        out = _replay(chain, index)
        return out is not None and out.shape == index.shape and torch.equal(out, index)


def _source(b: torch.fx.Node) -> torch.fx.Node | None:
    """The furthest ``a`` up the chain ending in the copy ``b`` that ``b`` holds whole, in the same layout."""
    if b.target not in _COPIES or not _link(b):
        return None
    chain = [b]
    found = None
    while True:
        a = chain[0].args[0]
        if not isinstance(a, torch.fx.Node):
            return found
        if _same(a, b, chain):
            found = a
        if not _link(a):
            return found
        chain.insert(0, a)


def _fresh(node: torch.fx.Node) -> bool:
    """Whether ``node`` is computed into memory of its own: an ATen op whose schema says its results alias
    nothing (not an input, not a view such as ``slice`` or ``expand``, not an item of a higher-order op's results)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return all(r.alias_info is None for r in node.target._schema.returns)


def _drop_in_body(body: torch.fx.GraphModule) -> int:
    """Readers of a copy that reproduces its source read the source (see the module); returns how many copies."""
    graph = body.graph
    output = graph.output_node()
    dropped = 0
    for b in list(graph.nodes):
        if b.op != "call_function" or not b.users:
            continue
        a = _source(b)
        if a is None:
            continue
        keep_result = not _fresh(a) or a in output.all_input_nodes
        if keep_result and all(user.op == "output" for user in b.users):
            continue
        b.replace_all_uses_with(a, delete_user_cb=(lambda user: user.op != "output") if keep_result else None)
        dropped += 1
    graph.eliminate_dead_code()
    body.recompile()
    return dropped


def _drop_saved_layers(graph: torch.fx.Graph, node: torch.fx.Node) -> int:
    """Results of the scan ``node`` that stack the layers of one of its ``xs``: readers read that ``xs`` (see the
    module); returns how many."""
    gm = graph.owning_module
    body_attr, init, xs, additional = node.args
    body = getattr(gm, body_attr.target)
    placeholders = body.graph.find_nodes(op="placeholder")
    output = body.graph.output_node()
    results = list(output.args[0])
    layer_of = {placeholders[len(init) + j]: j for j in range(len(xs))}
    vals = node.meta.get("val")
    if not isinstance(vals, (list, tuple)) or len(vals) != len(results):
        return 0
    drop = {}
    for k in range(len(init), len(results)):
        r = results[k]
        layer = r if r in layer_of else _source(r) if isinstance(r, torch.fx.Node) else None
        if layer not in layer_of:
            continue
        stack, ys = xs[layer_of[layer]], vals[k]
        sv = _val(stack)
        if sv is None or not (_static(sv) and _static(ys)):
            continue
        if sv.dtype != ys.dtype or sv.shape != ys.shape or sv.stride() != ys.stride() or sv.device != ys.device:
            continue
        drop[k] = stack
    if not drop:
        return 0
    getitems = [u for u in node.users if u.target is operator.getitem]
    if len(getitems) != len(node.users):
        return 0
    for user in getitems:
        k = user.args[1]
        if k in drop:
            user.replace_all_uses_with(drop[k])
            graph.erase_node(user)
        else:
            user.args = (node, k - sum(1 for d in drop if d < k))
    output.args = ([r for k, r in enumerate(results) if k not in drop],)  # the dead copies go in _drop_in_body
    node.meta["val"] = [v for k, v in enumerate(vals) if k not in drop]
    node.meta.pop("tensor_meta", None)
    return len(drop)


def _rewrite(graph: torch.fx.Graph) -> tuple[int, int]:
    """:func:`_drop_saved_layers` and :func:`_drop_in_body` for every scan of ``graph`` whose body no other node
    reads; returns how many results and copies were dropped."""
    gm = graph.owning_module
    saved = copies = 0
    if gm is None:
        return 0, 0
    for node in list(graph.find_nodes(op="call_function", target=_SCAN)):
        if len(node.args) != 4 or node.kwargs:
            continue
        body_attr = node.args[0]
        if not (isinstance(body_attr, torch.fx.Node) and body_attr.op == "get_attr") or len(body_attr.users) != 1:
            continue
        if len(graph.find_nodes(op="get_attr", target=body_attr.target)) != 1:
            continue
        saved += _drop_saved_layers(graph, node)
        copies += _drop_in_body(getattr(gm, body_attr.target))  # after it: its dead code eliminated, recompiled
    return saved, copies


def run(ctx: PassContext) -> None:
    """:func:`_rewrite` of the graph."""
    _rewrite(ctx.graph)
