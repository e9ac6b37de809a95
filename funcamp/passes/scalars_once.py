"""Sub-pass ``scalars_once``: a step's scalars are computed once, not once per vector of every loop that reads them.

An optimizer's per-step scalars (Adam's bias corrections ``-expm1(t * log(b))`` and their square root, a
schedule's cosine, a clip's ``max_norm / norm``) are 0-d float tensors computed from the step count or a norm.
Inductor inlines a pointwise value into each kernel that reads it, and its C++ kernels compute an inlined scalar
inside the vectorized loop: two ``std::expm1`` and a ``std::sqrt`` for every 16 elements of every parameter.
On GPT-2 124M's AdamW (124M float32 elements, 2 threads, AVX-512) that loop took 116-136 ms against 70 ms with
the scalars read from memory (``torch._fused_adamw_``: 76 ms).

:func:`_scalars_once` reads each such scalar, where a large loop uses it, through a value inductor must store:
the maximum over a broadcast pair of it (``amax(expand(view(x, [1]), [2]), [0])``), exactly ``x`` (NaN and
signed zeros included), computed in its own two-element loop before the large ones. Only on a CPU and for
float32 and float64 scalars: a GPU kernel computes an inlined scalar at no cost where a stored one costs a
launch, and a narrower scalar inlined keeps float32 precision that a stored one would round away.
"""

from __future__ import annotations

import torch

from funcamp.passes._context import PassContext
from funcamp.passes.gates import _call
from funcamp.passes.tags import _PHASE, _tags

NAME = "scalars_once"

#: A user at least this large (elements) has its scalars stored: below it the loop's recomputation is negligible.
_LARGE = 1 << 14

_DTYPES = (torch.float32, torch.float64)


def _scalar(node: torch.fx.Node) -> bool:
    """A one-element float32/float64 CPU tensor computed by a pointwise op from other nodes (what inductor
    inlines); not a graph input, a reduction or an external kernel's output (those are stored anyway)."""
    if node.op != "call_function" or not node.all_input_nodes or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if torch.Tag.pointwise not in node.target.tags:
        return False
    val = node.meta.get("val")
    return (
        isinstance(val, torch.Tensor)
        and _numel(val) == 1
        and val.dtype in _DTYPES
        and val.device.type == "cpu"
        and not val.requires_grad
    )


def _numel(val: torch.Tensor) -> int | None:
    """The element count where it is a plain int; ``None`` for a symbolic one (a dynamic shape: asking it would
    add a guard after the graph's guards were made)."""
    n = val.numel()
    return n if isinstance(n, int) else None


def _large(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    n = _numel(val) if isinstance(val, torch.Tensor) else None
    return n is not None and n >= _LARGE


def _stored(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    """``node``'s value through ``amax(expand(view(node, [1]), [2]), [0])`` (viewed back to its shape), inserted
    after it with its phase tag."""
    aten, val, phase = torch.ops.aten, node.meta["val"], _tags(node).get(_PHASE)
    with graph.inserting_before(node.next):
        one = _call(graph, aten.view.default, node, [1], phase=phase)
        pair = _call(graph, aten.expand.default, one, [2], phase=phase)
        kept = _call(graph, aten.amax.default, pair, [0], phase=phase)
        return kept if val.dim() == 0 else _call(graph, aten.view.default, kept, list(val.shape), phase=phase)


def _scalars_once(graph: torch.fx.Graph) -> int:
    """Read every inlined scalar (:func:`_scalar`) that a large node uses through a stored copy
    (:func:`_stored`) in those large users; return how many were stored."""
    stored = 0
    for node in list(graph.nodes):
        if not _scalar(node):
            continue
        users = [user for user in node.users if _large(user)]
        if not users:
            continue
        kept = _stored(graph, node)
        for user in users:
            user.replace_input_with(node, kept)
        stored += 1
    return stored


def run(ctx: PassContext) -> None:
    """:func:`_scalars_once`."""
    _scalars_once(ctx.graph)
