"""Sub-pass ``late_constructors``: a large tensor the backward builds from nothing waits for the gradient.

An embedding's gradient starts as zeros that ``index_put`` accumulates into; without inputs, inductor may compute
it with any earlier kernel, so it lived from the forward on. :func:`_late_constructors` reads each such tensor
(at least :data:`_LARGE` elements) as ``where(flag, x, x)`` with ``flag`` made from the gradient its first user
reads (:mod:`funcamp.passes.gates`).
"""

from __future__ import annotations

import torch

from funcamp.passes._context import PassContext
from funcamp.passes.gates import _after_gradient, _call, _Gate, _gateable
from funcamp.passes.tags import _PHASE, _tags

NAME = "late_constructors"


#: A backward constructor at least this large (elements) waits for the gradient: see :func:`_late_constructors`.
_LARGE = 1 << 18


def _late_constructors(graph: torch.fx.Graph) -> None:
    """Make each large tensor the backward builds from nothing (an embedding's gradient, zeros that
    ``index_put`` accumulates into) wait for the gradient its first user reads, as ``where(flag, x, x)``
    (bitwise ``x``).

    Without inputs, inductor may compute it with any earlier kernel: on GPT-2 124M it filled the token
    embedding's float32 gradient (50304 x 768, 147 MiB) with the forward's last LayerNorm, so that it lived
    through the LM head's logits, the compiled step's peak.
    """
    after = _after_gradient(graph)
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.all_input_nodes or _tags(node).get(_PHASE) != "backward":
            continue
        if not node.users or not _gateable(node) or node.meta["val"].numel() < _LARGE:
            continue
        first = min(node.users, key=order.__getitem__)
        flag = _Gate(graph, after, first).flag()
        if flag is None:
            continue
        with graph.inserting_before(first):
            late = _call(graph, torch.ops.aten.where.self, flag, node, node)
        node.replace_all_uses_with(late, delete_user_cb=lambda user, late=late: user is not late)


def run(ctx: PassContext) -> None:
    """:func:`_late_constructors`."""
    _late_constructors(ctx.graph)
