"""Sub-pass ``flat_gradients``: a flat state's gradients written into their buffer as the backward makes them.

A state with flat storage (:mod:`funcamp.train._flat`) runs its optimizer over one buffer per group, so the step
concatenates the gradients (a ``cat`` tagged by :func:`funcamp.passes.tags.flat_gradients`). As traced, that
``cat`` comes after the whole backward and the finite check: inductor copies every gradient into the buffer at
the end, when all of them exist, so the step holds every gradient twice (8 x Linear(2048, 2048) with AdamW and
bfloat16 compute: 192 MB over the state at rest against 64 MB leaf by leaf). And a gradient computed in bfloat16
and cast to the float32 parameter's dtype is copied as float32: twice its bytes.

This pass rewrites each tagged ``cat`` as a buffer the gradients are written into one by one, each placed right
after the node that makes it, with ``as_strided_scatter``, which inductor's reinplacing always turns into a copy
into the buffer. (A ``slice_scatter`` it keeps functional when its input is not realized, and a chain of them became
one pointwise ``where`` per element over every part: on 96 parameters of 131,072 bfloat16 elements, 561 ms against
19 ms for the ``cat``; a GPT-2 124M step 5.25x torch.amp's.) The buffer is made when the first gradient exists,
uninitialized: each element is written once, by a gradient or by the zeros the ``cat`` held as padding (gated on the
first gradient: :mod:`funcamp.passes.gates`; past :data:`_GAP_FILLS` gaps, zero-filled whole first instead): a zero
fill first was a pass over the whole buffer of its own (GPT-2 124M's body, 16 MiB buffers: 20 ms of a 560 ms step).
A slice of the buffer that is one gradient's part (the norm a clip takes of each member, :mod:`funcamp.train._flat`)
is a view of it. Where every gradient reaches the ``cat`` as the cast of a narrower tensor
(``convert_element_type``, the backward of a parameter's cast to the compute dtype), the buffer holds the narrower
values and is cast once, after it is full: the cast is fused into the update that reads it. Likewise where every
gradient reaches it unscaled, ``x_i * c`` with one 0-d ``c`` (a dynamic loss scale's reciprocal), and the buffer has
no padding (zeros times some ``c`` are ``-0`` or NaN): the buffer holds the ``x_i`` and is multiplied by ``c`` once,
where each part read ``c`` before (GPT-2 124M's body: 192 nodes read the scale, and inductor's scheduler paired each
with up to 32 others in every fusion round; its ``Scheduler.__init__`` 10.3-10.6 s, now 6.0-6.4 s, with
``region_casts`` handing the factors on to the update's regions). The values the update reads are the ``cat``'s,
bit for bit (the same elements; a cast and a product by one factor are elementwise).

Memory: the finite check and the norms read each member's view of the buffer
(:meth:`funcamp.train._flat.Flat.gradients`), so a gradient is read only on its way into the buffer. Where a buffer
holds many parameters, inductor's peak-memory reordering (``torch._inductor.config.reorder_for_peak_memory``) may
still schedule the writes after the last gradient: it counts the update's fused intermediates as allocations
(the new values a donating step writes straight into its inputs), so its estimate of the step's peak sits in the
update, where both orders tie (8 x Linear(2048, 2048) in one buffer: 469,991,466 bytes as placed here, 469,991,465
reordered: a 1-byte scalar computed after the update), and the gradients of a buffer's members live beside it
until then. That probe, compiled and donating with AdamW, adds 128.3 MB over the state at rest in one buffer per
group (80.5 MB with the reordering off, which costs remat most of its saving: GPT small 33.0 -> 77.4 MB, so it stays
on), against 64.1 MB leaf by leaf and 136.1 MB for torch's compiled in-place AdamW. So no buffer holds more than
``funcamp.train._flat.BUFFER_BYTES`` (8 MiB) of parameters, on every device: each of those weights is a buffer of
its own, 64.1 MB, and whatever the order a step holds at most one buffer's gradients more than leaf by leaf.
"""

from __future__ import annotations

from typing import Any

import torch

from funcamp.passes._context import PassContext
from funcamp.passes._graph import _RESHAPES, _factors, _static
from funcamp.passes.gates import _call, _flag
from funcamp.passes.tags import _FLAT_GRADS, _tags

NAME = "flat_gradients"

_aten, _prims = torch.ops.aten, torch.ops.prims
_ZEROS = (_aten.full.default, _aten.zeros.default, _aten.new_zeros.default)


def _source(node: torch.fx.Node, dtype: torch.dtype) -> tuple[torch.fx.Node, bool]:
    """``(source, narrowed)``: the tensor a ``cat`` input is a flattening and a cast to ``dtype`` of (``narrowed``),
    or the input itself."""
    inner = node.args[0] if node.target in _RESHAPES and isinstance(node.args[0], torch.fx.Node) else node
    if inner.target is _prims.convert_element_type.default and inner.args[1] == dtype:
        src = inner.args[0]
        if isinstance(src, torch.fx.Node) and src.meta["val"].dtype.itemsize < dtype.itemsize:
            return src, True
    return node, False


def _scaled(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(x, c)`` where a ``cat`` input is ``x * c`` (through a flattening): ``x`` of the input's dtype and element
    count, ``c`` a 0-d tensor of that dtype (an unscaled gradient: the loss scale's reciprocal); None otherwise."""
    inner = node.args[0] if node.target in _RESHAPES and isinstance(node.args[0], torch.fx.Node) else node
    dtype = node.meta["val"].dtype
    return next(((x, c) for x, c in _factors(inner) if c.meta["val"].dtype == dtype), None)


def _is_zeros(node: torch.fx.Node) -> bool:
    if node.target not in _ZEROS:
        return False
    value = node.args[1] if node.target is _aten.full.default else 0
    return value == 0


def _rewrite(graph: torch.fx.Graph, cat: torch.fx.Node) -> bool:
    inputs = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    out = cat.meta["val"]
    if dim != 0 or out.ndim != 1 or not all(isinstance(x, torch.fx.Node) for x in inputs):
        return False
    if not all(isinstance(x.meta["val"].numel(), int) for x in (cat, *inputs)):
        return False  # symbolic sizes (a step recompiled with dynamic shapes): the ``cat`` stays
    parts, gaps, at = [], [], 0  # (offset, numel, node): the non-zero inputs where they go; (offset, numel): zeros
    for x in inputs:
        n = x.meta["val"].numel()
        if not _is_zeros(x):
            parts.append((at, n, x))
        elif gaps and sum(gaps[-1]) == at:
            gaps[-1] = (gaps[-1][0], gaps[-1][1] + n)
        elif n:
            gaps.append((at, n))
        at += n
    if not parts:
        return False
    # every part ``x_i * c`` with one ``c`` and no padding (whose zeros times ``c`` would be ``-0`` or NaN for some
    # ``c``): the buffer holds the ``x_i`` and is multiplied by ``c`` once it is full
    products = [_scaled(x) for _, _, x in parts]
    scale = products[0][1] if not gaps and all(products) and len({c for _, c in products}) == 1 else None
    if scale is not None:
        parts = [(off, n, x) for (off, n, _), (x, _) in zip(parts, products, strict=True)]
    sources = [_source(x, out.dtype) for _, _, x in parts]
    narrow = all(ok for _, ok in sources) and len({s.meta["val"].dtype for s, _ in sources}) == 1
    dtype = sources[0][0].meta["val"].dtype if narrow else out.dtype
    chosen = [(off, n, s if narrow else x) for (off, n, x), (s, _) in zip(parts, sources, strict=True)]
    order = {node: i for i, node in enumerate(graph.nodes)}
    chosen.sort(key=lambda part: order[part[2]])
    first = chosen[0][2]
    with graph.inserting_before(first.next):  # made once the first gradient exists: the buffer waits for it
        if len(gaps) > _GAP_FILLS:  # zero-filled whole: one pass, fewer nodes than a fill per gap
            last = _zeros(graph, out, dtype, out.shape[0], first, _flag(graph, first))
        else:
            # uninitialized: written once, by the gradients and the padding's zeros (a zero fill first was a pass
            # over the whole buffer of its own); no computation, so inductor allocates it here, not earlier
            with out.fake_mode:
                value = torch.empty(out.shape, dtype=dtype, device=out.device)
            last = graph.call_function(
                _aten.empty.memory_format,
                ([out.shape[0]],),
                {"dtype": dtype, "device": out.device, "pin_memory": False},
            )
            last.meta["val"], last.meta["custom"] = value, dict(_tags(first))
            flag = _flag(graph, first) if gaps else None
            for off, n in gaps:
                zeros = _zeros(graph, out, dtype, n, first, flag)
                last = _call(graph, _aten.as_strided_scatter.default, last, zeros, [n], [1], off)
    order[last] = order[first]  # a new node's place: that of the node of the graph it follows
    writes = _stacked([(off, [n], [1], src, None, False, None, None) for off, n, src in chosen], dtype)
    writes.sort(key=lambda part: order[part[3]])
    for off, size, stride, src, cast, flipped, factor, layer in writes:
        anchor = src if order[src] > order[last] else last
        if factor is not None and order[factor] > order[anchor]:
            anchor = factor
        with graph.inserting_before(anchor.next):
            value = src
            if layer is not None and size[0] != src.meta["val"].shape[0]:  # some of the stack's layers
                value = _call(graph, _aten.slice.Tensor, value, 0, layer, layer + size[0])
            value = _call(graph, _aten.flip.default, value, [0]) if flipped else value
            value = _call(graph, _prims.convert_element_type.default, value, cast) if cast is not None else value
            value = _call(graph, _aten.mul.Tensor, value, factor) if factor is not None else value
            flat = _call(graph, _aten.reshape.default, value, size)
            last = _call(graph, _aten.as_strided_scatter.default, last, flat, size, stride, off)
        order[last] = order[anchor]  # after its anchor (a node of the graph, or one placed after it)
    with graph.inserting_before(cat):
        result = _call(graph, _prims.convert_element_type.default, last, out.dtype) if narrow else last
        if scale is not None:
            result = _call(graph, _aten.mul.Tensor, result, scale)
    cat.replace_all_uses_with(result)
    graph.erase_node(cat)
    return True


def _layer_of(node: torch.fx.Node) -> tuple[torch.fx.Node, int, torch.dtype | None, Any] | None:
    """``(stack, j, cast, factor)`` where a part is ``[flatten]([mul](([cast](select(stack, 0, j)), factor)))``: layer
    ``j`` of a tensor whose first dimension stacks layers (a scanned run's stacked gradient), cast to ``cast`` or
    not, multiplied by a 0-d ``factor`` (an unscaled gradient) or not (None); None otherwise."""
    if node.target in _RESHAPES and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    factor = None
    for a, c in _factors(node):
        node, factor = a, c
        break
    cast = None
    if node.target is _prims.convert_element_type.default and isinstance(node.args[0], torch.fx.Node):
        cast, node = node.args[1], node.args[0]
    if node.target is not _aten.select.int or node.args[1] != 0 or not isinstance(node.args[2], int):
        return None
    stack = node.args[0]
    if not isinstance(stack, torch.fx.Node) or stack.meta.get("val") is None:
        return None
    j = node.args[2]
    return (stack, j, cast, factor) if 0 <= j < stack.meta["val"].shape[0] else None


def _stacked(writes: list[tuple[Any, ...]], dtype: torch.dtype) -> list[tuple[Any, ...]]:
    """``writes`` (``(offset, size, stride, source, cast, flipped, factor, first layer)``, each one part's) with the
    parts that are consecutive layers (two or more) of one stacked tensor, cast and multiplied alike, at equally
    spaced offsets (a name-major scanned run's layers in this buffer, :func:`funcamp.train._flat._segments`)
    written as one: those layers of the stack (reversed along the first dimension where the offsets fall as the
    layer index rises; in the compiled scanned steps tried, the layers reach this pass in order), cast, multiplied,
    viewed as ``[layers, numel]`` and written with strides ``[spacing, 1]``. The same elementwise ops on the same
    elements, written to the same places: inductor wrote one loop per part (GPT-2 124M's scanned body: the kernel
    that wrote its 144 layer gradients, 222 loops)."""
    by_stack: dict[tuple[Any, ...], dict[int, tuple[Any, ...]]] = {}
    for write in writes:
        found = _layer_of(write[3])
        if found is not None:
            stack, j, cast, factor = found
            by_stack.setdefault((stack, cast, factor), {}).setdefault(j, write)
    merged, out = set(), []
    for (stack, cast, factor), layers in by_stack.items():
        val = stack.meta["val"]
        if not _static(val):
            continue  # a symbolic shape (a step recompiled with dynamic shapes): written part by part
        n = val[0].numel()
        first, count = min(layers), len(layers)
        if count < 2 or max(layers) - first + 1 != count or any(w[1] != [n] for w in layers.values()):
            continue  # two layers at least, and every layer between them
        if (cast if cast is not None else val.dtype) != dtype or not val.is_contiguous():
            continue
        offsets = [layers[j][0] for j in range(first, first + count)]
        if not all(isinstance(o, int) for o in offsets):
            continue
        step = offsets[1] - offsets[0]
        if abs(step) < n or any(b - a != step for a, b in zip(offsets, offsets[1:], strict=False)):
            continue
        merged.update(id(w) for w in layers.values())
        out.append((min(offsets), [count, n], [abs(step), 1], stack, cast, step < 0, factor, first))
    return out + [w for w in writes if id(w) not in merged]


#: A buffer with at most this many gaps of padding (runs of the ``cat``'s zeros) is made uninitialized and each gap
#: written (three nodes each); one with more is zero-filled whole first (one pass over it, two nodes in all): GPT-2's
#: parameters are whole rows and leave no gap, a model of many small ones (LayerNorms of 128) leaves one per member.
_GAP_FILLS = 2


def _zeros(
    graph: torch.fx.Graph, out: torch.Tensor, dtype: torch.dtype, n: int, first: torch.fx.Node, flag: torch.fx.Node
) -> torch.fx.Node:
    """``n`` zeros that wait for ``flag`` (made from ``first``, a gradient), as ``where(flag, zeros, zeros)``: without
    an input, inductor would compute them in any earlier kernel, the forward's included."""
    with out.fake_mode:
        value = torch.zeros(n, dtype=dtype, device=out.device)
    zeros = graph.call_function(
        _aten.full.default, ([n], 0), {"dtype": dtype, "device": out.device, "pin_memory": False}
    )
    zeros.meta["val"], zeros.meta["custom"] = value, dict(_tags(first))
    return _call(graph, _aten.where.self, flag, zeros, zeros)


def _flat_gradients(graph: torch.fx.Graph) -> int:
    """Rewrite every tagged gradient ``cat`` (see the module docstring); the number rewritten."""
    cats = [n for n in graph.nodes if n.target is _aten.cat.default and _tags(n).get(_FLAT_GRADS)]
    return sum(_rewrite(graph, cat) for cat in cats)


def run(ctx: PassContext) -> None:
    """:func:`_flat_gradients`."""
    _flat_gradients(ctx.graph)
