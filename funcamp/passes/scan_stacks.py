"""Sub-pass ``scan_stacks``: a stack of equally spaced slices of one buffer is read as one strided view of it.

A scanned run (``functionalize(scan=...)``, :mod:`funcamp.nn._scan`) stacks each parameter name's layers on a
leading axis: ``torch.stack`` of each layer's forward tensor (its cast to the compute dtype), which reaches inductor
as a ``cat`` along the first dimension of the layers' tensors, each a cast (or not) of a view of a slice of a flat
buffer. Inductor lowers such a ``cat`` to one loop per input in one kernel: GPT-2 124M's body, 12 layers of 12
names, a kernel of 147 loops and 2,300 lines, the scanned step's largest compile (6.9 CPU s of the C++ compiler).

With a scanned run laid out name-major (``TrainState.create(..., scan=apply_fn.scan)``,
:func:`funcamp.train._flat._segments`), a name's layers lie in one buffer at offsets ``o, o + s, o + 2s, ...``.
This pass rewrites each run of such a ``cat``'s inputs (consecutive inputs that are slices of one 1-D tensor,
through views of one shape and at most a cast, alike, at equally spaced offsets, in order; a name's layers split
between buffers are a run per buffer) as ``as_strided(buffer, [L, n], [s, 1], o)``, cast (or copied, where the
inputs were not cast), reshaped: one loop per run, the runs and the other inputs concatenated as before. Exact by
construction: the same elements, in the same order, through the same elementwise cast.

The backward's half, each name's stacked gradient written into its buffer whole, is
:mod:`funcamp.passes.flat_gradients`' (the parts that are the layers of one tensor).
"""

from __future__ import annotations

from typing import Any

import torch

from funcamp.passes._context import PassContext
from funcamp.passes._graph import _RESHAPES, _static
from funcamp.passes.gates import _call
from funcamp.passes.tags import _FLAT_GRADS, _tags

NAME = "scan_stacks"

_aten, _prims = torch.ops.aten, torch.ops.prims


def _slice_of(node: torch.fx.Node) -> tuple[torch.fx.Node, int, int, torch.dtype | None] | None:
    """``(base, start, numel, cast dtype or None)`` where ``node`` is ``[cast](view*(slice(base, 0, start, end)))``,
    ``base`` a 1-D contiguous tensor and the slice's result contiguous; None otherwise."""
    cast = None
    if node.target is _prims.convert_element_type.default:
        cast, node = node.args[1], node.args[0]
    while isinstance(node, torch.fx.Node) and node.target in _RESHAPES:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.target is not _aten.slice.Tensor:
        return None
    base, *rest = node.args
    dim, start, end, step = (*rest, *(None, None, None, 1)[len(rest) :])
    val = base.meta.get("val") if isinstance(base, torch.fx.Node) else None
    if (
        val is None
        or not _static(val)
        or val.ndim != 1
        or val.stride() != (1,)
        or dim != 0
        or step != 1
        or not isinstance(start, int)
        or not isinstance(end, int)
        or not 0 <= start < end <= val.shape[0]
    ):
        return None
    return base, start, end - start, cast


def _runs(slices: list[tuple[Any, ...] | None], n: int) -> list[tuple[int, int, int]]:
    """``(first, past, step)``: the inputs cut into maximal runs of consecutive ones that are slices of one base with
    one cast, spaced by one ``step >= n`` in order; an input in no such run of two is a run of one (step 0)."""
    runs, i = [], 0
    while i < len(slices):
        k, step = i + 1, 0
        if slices[i] is not None and k < len(slices) and slices[k] is not None:
            (base, start, _, cast), (base2, start2, _, cast2) = slices[i], slices[k]
            step = start2 - start if (base2, cast2) == (base, cast) else 0
            if step >= n:
                while (
                    k < len(slices)
                    and slices[k] is not None
                    and (slices[k][0], slices[k][3]) == (base, cast)
                    and slices[k][1] - slices[k - 1][1] == step
                ):
                    k += 1
            else:
                k, step = i + 1, 0
        runs.append((i, k, step))
        i = k
    return runs


def _rewrite(graph: torch.fx.Graph, cat: torch.fx.Node) -> bool:
    inputs = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if dim != 0 or len(inputs) < 2 or not all(isinstance(x, torch.fx.Node) for x in inputs):
        return False
    vals = [x.meta.get("val") for x in inputs]
    if any(v is None or not _static(v) or not v.is_contiguous() for v in vals):
        return False  # a symbolic shape (a step recompiled with dynamic shapes) is left as it is
    if len({(tuple(v.shape), v.dtype) for v in vals}) != 1:
        return False
    n = vals[0].numel()
    slices = [_slice_of(x) for x in inputs]
    slices = [s if s is not None and s[2] == n else None for s in slices]
    runs = _runs(slices, n)
    if all(past - first < 2 for first, past, _ in runs):
        return False
    shape = list(vals[0].shape)
    pieces = []
    with graph.inserting_before(cat):
        phase = _tags(inputs[0]).get("funcamp_phase")
        for first, past, step in runs:
            if past - first < 2:
                pieces.append(inputs[first])
                continue
            base, offset, _, cast = slices[first]
            layers = past - first
            view = _call(graph, _aten.as_strided.default, base, [layers, n], [step, 1], offset, phase=phase)
            if cast is not None:
                made = _call(graph, _prims.convert_element_type.default, view, cast, phase=phase)
            else:
                made = _call(graph, _aten.clone.default, view, phase=phase)
            pieces.append(_call(graph, _aten.reshape.default, made, [layers * shape[0], *shape[1:]], phase=phase))
        result = pieces[0] if len(pieces) == 1 else graph.call_function(_aten.cat.default, (pieces,))
        if len(pieces) > 1:
            with vals[0].fake_mode:
                result.meta["val"] = torch.cat([p.meta["val"] for p in pieces])
            result.meta["custom"] = dict(_tags(cat))
    cat.replace_all_uses_with(result)
    graph.erase_node(cat)
    for x in inputs:  # the per-layer casts and views nothing reads now
        while isinstance(x, torch.fx.Node) and not x.users and x.op == "call_function":
            before = x.args[0]
            graph.erase_node(x)
            x = before
    return True


def _scan_stacks(graph: torch.fx.Graph) -> int:
    """Rewrite every such ``cat`` (see the module docstring); the number rewritten."""
    # not a flat state's gradient ``cat`` (tagged): flat_gradients writes those into their buffer
    cats = [n for n in graph.nodes if n.target is _aten.cat.default and not _tags(n).get(_FLAT_GRADS)]
    return sum(_rewrite(graph, cat) for cat in cats)


def run(ctx: PassContext) -> None:
    """:func:`_scan_stacks`."""
    _scan_stacks(ctx.graph)
