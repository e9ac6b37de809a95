"""Sub-pass ``late_constructors``: a large tensor the backward builds from nothing waits for the gradient.

An embedding's gradient starts as zeros that ``index_put`` accumulates into; without inputs, inductor may compute
it with any earlier kernel, so it lived from the forward on. :func:`_late_constructors` reads each such tensor
(at least :data:`_LARGE` elements) as ``where(flag, x, x)`` with ``flag`` made from the gradient its first user
reads (:mod:`funcamp.passes.gates`) and from the gradients its result is then added to (:func:`_partners`: a tied
head's weight gradient).
"""

from __future__ import annotations

import torch

from funcamp.passes._context import PassContext
from funcamp.passes.gates import _after_gradient, _call, _flag, _Gate, _gateable
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
            for partner in _partners(first, order, after):
                flag = _call(graph, torch.ops.aten.bitwise_and.Tensor, flag, _flag(graph, partner))
            late = _call(graph, torch.ops.aten.where.self, flag, node, node)
        node.replace_all_uses_with(late, delete_user_cb=lambda user, late=late: user is not late)


#: How far :func:`_partners` follows a constructor's result (index_put, add, a view or two).
_CHAIN = 4


def _partners(first: torch.fx.Node, order: dict[torch.fx.Node, int], after: dict) -> list[torch.fx.Node]:
    """The gradient values the result of ``first`` (a constructor's first user) is combined with further down
    its chain of single users, each as the backward value it is a cast or view of that exists before ``first``:
    a tied embedding's gradient is the lookup's (the constructor's) plus the head's weight gradient, a matmul
    that reads the logits' gradient. Waiting for them, the constructor is made after the matmul, whose input,
    the largest of the backward, is then freed before it (inductor otherwise ran the matmul last, just before the
    sum, with the zeros allocated at the end of the layers' backward)."""
    out: list[torch.fx.Node] = []
    x = first
    for _ in range(_CHAIN):
        if len(x.users) != 1:
            break
        (y,) = x.users
        for src in y.all_input_nodes:
            if src is x:
                continue
            while order.get(src, -1) >= order[first] and len(src.all_input_nodes) == 1:
                src = src.all_input_nodes[0]
            if order.get(src, order[first]) < order[first] and after.get(src) is src and _gateable(src):
                out.append(src)
        x = y
    return out


def run(ctx: PassContext) -> None:
    """:func:`_late_constructors`."""
    _late_constructors(ctx.graph)
