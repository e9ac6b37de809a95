"""Sub-pass ``region_casts``: a nested compile region handed a widened tensor gets the narrow one and widens it inside.

A donating flat step updates each buffer in a nested compile region (:mod:`funcamp.train._flat_regions`), a
subgraph inductor compiles once per kind of buffer. A weight's gradient reaches its region in float32, widened from
the bfloat16 gradient the backward's matmul made, and a region's operand is a tensor in memory: the widening was a
kernel of its own that wrote a float32 copy of every such gradient (GPT-2 124M's body: 3 kernels, 36 calls, 4 bytes
written and 4 read per weight element where the update over all buffers read 2), where the update over all buffers
read the bfloat16 gradient and widened it as it went.

Here, for each region (one ``invoke_subgraph`` identifier), an operand that is in every call a widening
(``convert_element_type``, or ``_to_copy`` before inductor's decompositions) of a narrower floating tensor, through
views, is handed as that tensor (viewed to the operand's shape), and every call runs a copy of the region that
widens it first. The values are the same bit for bit (a widening is exact); what is gone is the widened copy in
memory and its kernel.

Before that, an operand that a region multiplies by a 0-d operand before anything else reads it (a flat update's
gradient ``g * unit``, :mod:`funcamp.train._flat_regions`), where every call hands a product ``a * c`` and a constant
one, is handed as ``a`` and ``c``: the region computes the same product of the same values, and it is not written
out for it (a dynamic loss scale's unscaled gradient buffer, in float32). Then ``a`` may be handed narrow as above.

Only a narrow tensor that is in memory with the pass or without it is handed: a graph input, or the result of an op
inductor runs as a kernel it does not generate (a matmul, a convolution, attention, a region), through views. A
narrow tensor the graph computes otherwise (``x.bfloat16()`` of a float32 value, then widened) is left alone:
inductor fuses the narrowing into its reader and, not emulating precision casts by default
(``emulate_precision_casts``), does not round there, so a region handed the stored narrow tensor would read rounded
values where the step without the pass read unrounded ones.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from funcamp.passes._context import PassContext
from funcamp.passes._graph import _factors, _first_axis_reversal, _in_memory, _val

NAME = "region_casts"

_HOP = torch.ops.higher_order.invoke_subgraph
_FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized_v2
_CONVERT = torch.ops.prims.convert_element_type.default
_TO_COPY = torch.ops.aten._to_copy.default
_RESHAPES = (torch.ops.aten.reshape.default, torch.ops.aten.view.default)
_OWN = (*_RESHAPES, _CONVERT, _TO_COPY)  # what an operand's widening is made of (erased once nothing reads it)
_WIDE = (torch.float32, torch.float64)


def _narrow_source(operand: Any) -> torch.fx.Node | None:
    """The narrower floating tensor ``operand`` widens: ``convert_element_type(x, float32 or float64)`` (or
    ``_to_copy(x, dtype=)``, as AOTAutograd traces it), through reshapes and views of whole tensors; None otherwise."""
    node = operand
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _RESHAPES:
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"):
        return None
    if node.target is _CONVERT and len(node.args) == 2 and not node.kwargs:
        x, wide = node.args
    elif node.target is _TO_COPY and len(node.args) == 1 and node.kwargs.keys() == {"dtype"}:
        x, wide = node.args[0], node.kwargs["dtype"]  # before inductor's decompositions
    else:
        return None
    val, out = _val(x), _val(operand)
    if val is None or out is None or wide not in _WIDE or out.dtype != wide:
        return None
    if not val.dtype.is_floating_point or val.dtype.itemsize >= out.dtype.itemsize or val.numel() != out.numel():
        return None
    if not val.is_contiguous() or not out.is_contiguous():
        return None
    return x if _in_memory(x) else None


def _narrowed_region(sub: torch.fx.GraphModule, positions: dict[int, torch.dtype]) -> torch.fx.GraphModule:
    """A copy of the region ``sub`` whose placeholders at ``positions`` take the given narrower dtypes and are
    widened back (``convert_element_type``) before any use."""
    graph = torch.fx.Graph()
    output = graph.graph_copy(sub.graph, {})
    graph.output(output)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        for k, dtype in positions.items():
            ph = placeholders[k]
            wide_val = ph.meta["val"]
            ph.meta = {**ph.meta, "val": wide_val.to(dtype)}
            ph.meta["tensor_meta"] = _extract_tensor_metadata(ph.meta["val"])
            wide = graph.call_function(_CONVERT, (ph, wide_val.dtype))
            wide.meta = {"val": wide_val, "tensor_meta": _extract_tensor_metadata(wide_val)}
            ph.replace_all_uses_with(wide, delete_user_cb=lambda user, wide=wide: user is not wide)
    return torch.fx.GraphModule(sub, graph)


_NAMES = itertools.count()


class _Call:
    """One call of a region as the post-grad graph holds it: ``invoke_subgraph(subgraph, identifier, *operands)``,
    or before inductor decomposes it (where the region writes into its operands),
    ``auto_functionalized_v2(invoke_subgraph, subgraph=, identifier=, arg0=, ...)``, whose written operands are
    given as bases (``_all_bases``) and are never a widening."""

    def __init__(self, node: torch.fx.Node) -> None:
        self.node = node
        self.functionalized = node.target is not _HOP
        if self.functionalized:
            self.attr, self.identifier = node.kwargs.get("subgraph"), node.kwargs.get("identifier")
        else:
            self.attr, self.identifier = node.args[0], node.args[1]

    @staticmethod
    def of(node: torch.fx.Node) -> _Call | None:
        if node.op != "call_function":
            return None
        if node.target is _HOP or (node.target is _FUNCTIONALIZED and node.args and node.args[0] is _HOP):
            call = _Call(node)
            attr = call.attr
            if isinstance(call.identifier, str) and isinstance(attr, torch.fx.Node) and attr.op == "get_attr":
                return call
        return None

    def operand(self, k: int) -> Any:
        """Operand ``k`` (the region's placeholder ``k``); None where it is written (a base) or absent."""
        if self.functionalized:
            return self.node.kwargs.get(f"arg{k}")
        return self.node.args[2 + k] if 2 + k < len(self.node.args) else None

    def count(self) -> int | None:
        """How many operands the call passes (None where the functionalized form does not say)."""
        return None if self.functionalized else len(self.node.args) - 2

    def replace(self, attr: torch.fx.Node, identifier: str, operands: dict[int, torch.fx.Node]) -> None:
        """Call region ``attr`` (``identifier``) with ``operands`` in place of those at their positions, and
        record their values in the node's ``eager_input_vals`` (inductor lowers the region on those)."""
        node, eager = self.node, self.node.meta.get("eager_input_vals")
        if self.functionalized:
            kwargs = {**node.kwargs, "subgraph": attr, "identifier": identifier}
            kwargs.update({f"arg{k}": v for k, v in operands.items()})
            node.kwargs = kwargs
            if eager is not None and isinstance(eager[1], dict):
                vals = {**eager[1], **{f"arg{k}": _val(v) for k, v in operands.items()}}
                node.meta["eager_input_vals"] = (eager[0], vals)
            return
        args = [attr, identifier, *node.args[2:]]
        for k, v in operands.items():
            args[2 + k] = v
        node.args = tuple(args)
        if eager is not None:
            vals = list(eager[0])
            for k, v in operands.items():
                vals[2 + k] = _val(v)
            node.meta["eager_input_vals"] = (tuple(vals), eager[1])


def _region_casts(graph: torch.fx.Graph) -> int:
    """Hand every region whose calls all widen an operand the narrow operand (see the module); the number of
    regions changed."""
    root = graph.owning_module
    if root is None:
        return 0
    calls: dict[str, list[_Call]] = {}
    for node in graph.nodes:
        call = _Call.of(node)
        if call is not None:
            calls.setdefault(call.identifier, []).append(call)
    changed = 0
    for identifier, group in calls.items():
        attrs = {call.attr.target for call in group}
        if len(attrs) != 1:
            continue
        target = attrs.pop()
        sub = getattr(root, target, None)
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        if any(call.count() not in (None, len(placeholders)) for call in group):
            continue
        scaled = _hand_scales(graph, group, placeholders)
        positions: dict[int, torch.dtype] = {}
        sources: dict[int, list[torch.fx.Node]] = {}  # per position, each call's narrow tensor
        for k, ph in enumerate(placeholders):
            want = _val(ph)
            operands = [call.operand(k) for call in group]
            narrow_ones = [_narrow_source(op) for op in operands]
            if want is None or any(s is None for s in narrow_ones):
                continue
            dtypes = {_val(s).dtype for s in narrow_ones}
            alike = all(_val(op).shape == want.shape and _val(op).dtype == want.dtype for op in operands)
            if len(dtypes) == 1 and alike:
                positions[k], sources[k] = dtypes.pop(), narrow_ones
        if not positions:
            changed += scaled
            continue
        name = f"{target}_{NAME}_{next(_NAMES)}"
        root.register_module(name, _narrowed_region(sub, positions))
        new_identifier = f"{identifier}_{NAME}"
        for n, call in enumerate(group):
            old = [call.attr, *(call.operand(k) for k in positions)]
            narrow = {}
            with graph.inserting_before(call.node):
                attr = graph.get_attr(name)
                attr.meta = dict(call.attr.meta)
                for k in positions:
                    operand = call.operand(k)
                    source, shape = sources[k][n], list(_val(operand).shape)
                    view = graph.call_function(torch.ops.aten.reshape.default, (source, shape))
                    view.meta = {**source.meta, "val": _val(source).reshape(shape)}
                    view.meta["tensor_meta"] = _extract_tensor_metadata(view.meta["val"])
                    narrow[k] = view
            call.replace(attr, new_identifier, narrow)
            for dead in old:
                _erase_unused(graph, dead)
        changed += 1
    return changed


_MUL = torch.ops.aten.mul.Tensor
_FULL = torch.ops.aten.full.default
_ONES = torch.ops.aten.ones.default


def _scaled_pairs(placeholders: list[torch.fx.Node]) -> list[tuple[int, int]]:
    """``(k, j)`` for each placeholder ``k`` of a region read only by ``k * j`` (``aten.mul``), placeholder ``j``
    0-d and read only there: the region multiplies operand ``k`` by operand ``j`` before anything else reads it."""
    index = {ph: n for n, ph in enumerate(placeholders)}
    pairs = []
    for k, ph in enumerate(placeholders):
        if len(ph.users) != 1:
            continue
        (mul,) = ph.users
        if mul.target is not _MUL or len(mul.args) != 2 or mul.kwargs or ph not in mul.args:
            continue
        other = mul.args[1] if mul.args[0] is ph else mul.args[0]
        val = _val(other)
        if other in index and other is not ph and len(other.users) == 1 and val is not None and val.ndim == 0:
            pairs.append((k, index[other]))
    return pairs


def _one(node: Any, dtype: torch.dtype) -> bool:
    """Whether ``node`` is a 0-d constant one of ``dtype``: ``aten.full([], 1)``, or ``aten.ones([])`` before
    inductor's decompositions."""
    val = _val(node)
    if val is None or val.ndim != 0 or val.dtype != dtype:
        return False
    if node.target is _FULL:
        return len(node.args) == 2 and node.args[1] == 1
    return node.target is _ONES and len(node.args) == 1


def _product(operand: Any, want: torch.Tensor, scale: torch.dtype) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(a, c)`` where ``operand`` is ``a * c`` (through reshapes, :func:`funcamp.passes._graph._factors`): ``a`` of
    ``want``'s dtype and element count, contiguous, ``c`` 0-d of dtype ``scale``; None otherwise."""
    node = operand
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _RESHAPES:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node):
        return None
    for a, c in _factors(node):
        va = _val(a)
        if _val(c).dtype == scale and va.dtype == want.dtype and va.numel() == want.numel() and va.is_contiguous():
            return a, c
    return None


def _hand_scales(graph: torch.fx.Graph, group: list[_Call], placeholders: list[torch.fx.Node]) -> int:
    """Where a region multiplies operand ``k`` by a 0-d operand ``j`` first (:func:`_scaled_pairs`) and every call
    hands it ``a * c`` and a constant one, hand ``a`` and ``c`` instead: the region computes ``a * c`` itself, the
    same product of the same values, and the product is not written out for it (``funcamp.train._flat_regions``:
    a gradient unscaled by the loss scale's reciprocal). Returns 1 if any call changed, else 0."""
    done = 0
    for k, j in _scaled_pairs(placeholders):
        want, unit = _val(placeholders[k]), _val(placeholders[j])
        if want is None or unit is None:
            continue
        products = [_product(call.operand(k), want, unit.dtype) for call in group]
        if any(p is None for p in products) or not all(_one(call.operand(j), unit.dtype) for call in group):
            continue
        for call, (a, c) in zip(group, products, strict=True):
            with graph.inserting_before(call.node):
                view = graph.call_function(torch.ops.aten.reshape.default, (a, list(want.shape)))
                view.meta = {**a.meta, "val": _val(a).reshape(want.shape)}
                view.meta["tensor_meta"] = _extract_tensor_metadata(view.meta["val"])
            old = (call.operand(k), call.operand(j))
            call.replace(call.attr, call.identifier, {k: view, j: c})
            for dead in old:
                _erase_unused(graph, dead)
        done = 1
    return done


def _erase_unused(graph: torch.fx.Graph, node: Any) -> None:
    """Erase ``node`` if nothing reads it, and then the views and widening it read that nothing else reads."""
    while isinstance(node, torch.fx.Node) and not node.users and (node.op == "get_attr" or node.target in _OWN):
        inputs = node.all_input_nodes
        graph.erase_node(node)
        node = inputs[0] if inputs else None


_SELECT = torch.ops.aten.select.int


def _unreverse(graph: torch.fx.Graph) -> int:
    """Read each layer of a reversed stack from the stack itself: ``select(rev(x, [0]), 0, i)`` (a scanned run's
    stacked gradients, which torch's scan makes last layer first and reverses) becomes ``select(x, 0, n - 1 - i)``,
    the same tensor, a view. A reversal is computed by the kernels that read it, so the layers' widened gradients
    were read at ``(n - 1 - i) * size`` in kernels that differed only in that offset, each compiled on its own (GPT-2
    124M's scanned step: 48 of the first step's 76 C++ compiles), and were no view of memory :func:`_narrow_source`
    could hand a region. Returns the number of selects changed."""
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SELECT or len(node.args) != 3 or node.kwargs:
            continue
        rev, dim, index = node.args
        stack = _first_axis_reversal(rev)
        if dim != 0 or not isinstance(index, int) or stack is None:
            continue
        val = _val(stack)
        n = val.shape[0]
        if not isinstance(n, int) or not -n <= index < n:
            continue
        at = n - 1 - index % n
        with graph.inserting_before(node):
            layer = graph.call_function(_SELECT, (stack, 0, at))
        layer.meta = {**node.meta, "val": val.select(0, at)}
        layer.meta["tensor_meta"] = _extract_tensor_metadata(layer.meta["val"])
        node.replace_all_uses_with(layer)
        graph.erase_node(node)
        if not rev.users:
            graph.erase_node(rev)
        changed += 1
    return changed


def run(ctx: PassContext) -> None:
    """:func:`_unreverse`, then :func:`_region_casts` of the graph."""
    _unreverse(ctx.graph)
    _region_casts(ctx.graph)
