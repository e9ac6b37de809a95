"""Sub-pass ``scan_reversal``: a scan over reversed stacks reads each stack from its last layer, with no copy.

torch's scan is differentiated by a second scan that runs the layers last to first over the forward's inputs and
saved intermediates, each reversed along the layer axis (``prims.rev(x, [0])``; torch 2.13's
``torch/_higher_order_ops/scan.py`` notes that the flip copies), and inductor makes every reversal a copy in
memory before the loop starts: for a scanned transformer, a copy of every stacked weight and every saved
activation, every step (GPT-2 124M's body, batch 4 x 128, bfloat16: one kernel of 24 reversals, 65 ms of a 690 ms
step on a 2-core AMD EPYC).

Here such a scan (every ``xs`` operand a reversal along the first dimension of a tensor in CPU memory) gets the
stacks themselves as additional inputs, read whole, and one ``xs`` operand, the layer indices ``n - 1, ..., 0``
(int64, on the CPU); its body reads layer ``i`` of each stack as ``select(stack, 0, index.item())``, a view, which
is what inductor's lowering of a scan reads from its reversed copy (``select(copy, 0, loop index)``). The values
are the same bit for bit; what is gone is the copies, their kernel and their memory.

Only scans of CPU tensors: the index tensor lives on the CPU, and the pass has been checked there alone. A scan with
some operand not reversed is left as it is (torch makes every operand of the backward scan a reversal).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from funcamp.passes._context import PassContext
from funcamp.passes._graph import _first_axis_reversal, _val, _value

NAME = "scan_reversal"

_SCAN = torch.ops.higher_order.scan


def _reversed_stack(node: Any) -> torch.fx.Node | None:
    """``x`` where ``node`` is ``rev(x, [0])`` or ``flip(x, [0])`` (the first dimension alone) of a CPU tensor."""
    stack = _first_axis_reversal(node)
    return stack if stack is not None and _val(stack).device.type == "cpu" else None


def _body(body: torch.fx.GraphModule, carries: int, n: int, rest: int) -> Callable[..., Any]:
    """The scan body that reads its layers from whole stacks: called with ``(*carry, index, *additional,
    *stacks)`` (``index`` the 0-d int64 layer index, ``additional`` the scan's own ``rest`` additional inputs), it
    calls ``body`` with ``(*carry, *layers, *additional)``, layer ``index`` of each stack a view of it."""

    def read_reversed(*args: Any) -> Any:
        carry, index = args[:carries], args[carries]
        additional, stacks = args[carries + 1 : carries + 1 + rest], args[carries + 1 + rest :]
        at = index.item()
        torch._check(at >= 0)
        torch._check(at < n)
        return body(*carry, *(x.select(0, at) for x in stacks), *additional)

    return read_reversed


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node, stacks: list[torch.fx.Node]) -> None:
    """Replace the scan ``node`` over ``rev(stack)`` for each of ``stacks`` by one over the layer indices, reversed,
    that reads the stacks whole (see the module)."""
    from torch._inductor.pattern_matcher import fwd_only  # traces a function to an ATen graph, as inductor's own
    # lowering of a scan to a while loop does

    gm = graph.owning_module
    body_attr, init, xs, additional = node.args
    n = _val(stacks[0]).shape[0]
    fake_mode = _val(stacks[0]).fake_mode
    with fake_mode:
        index_val = torch.arange(n - 1, -1, -1, dtype=torch.int64, device="cpu")
        # a carry or an additional input may be a SymInt (a dynamic size the body reads): ``_value``, not ``_val``
        carry, rest = [_value(c) for c in init], [_value(a) for a in additional]
        example = [*carry, index_val[0], *rest, *(_val(s) for s in stacks)]
        body = fwd_only(  # no decompositions: the body's ops as they are
            _body(getattr(gm, body_attr.target), len(init), n, len(additional)),
            example,
            run_functional_passes=False,
            get_decomp_fn=dict,
        )
    name = f"{body_attr.target}_reversed"
    while hasattr(gm, name):
        name += "_"
    gm.register_module(name, body)
    with graph.inserting_before(node):
        attr = graph.get_attr(name)
        index = graph.call_function(
            torch.ops.aten.arange.start_step,
            (n - 1, -1, -1),
            {"dtype": torch.int64, "device": torch.device("cpu"), "pin_memory": False},
        )
        scan = graph.call_function(_SCAN, (attr, list(init), [index], [*additional, *stacks]))
    index.meta = {"val": index_val, "tensor_meta": _extract_tensor_metadata(index_val)}
    scan.meta = dict(node.meta)
    node.replace_all_uses_with(scan)
    graph.erase_node(node)
    for x in xs:
        if not x.users:
            graph.erase_node(x)
    if not body_attr.users:
        graph.erase_node(body_attr)
        if not graph.find_nodes(op="get_attr", target=body_attr.target):
            gm.delete_submodule(body_attr.target)


def _read_reversed(graph: torch.fx.Graph) -> int:
    """Rewrite every scan whose ``xs`` are all reversed stacks on the CPU (see the module); returns how many."""
    changed = 0
    for node in list(graph.find_nodes(op="call_function", target=_SCAN)):
        if len(node.args) != 4 or node.kwargs or graph.owning_module is None:
            continue
        _, init, xs, _ = node.args
        stacks = [_reversed_stack(x) for x in xs]
        if not xs or any(s is None for s in stacks):
            continue
        n = _val(stacks[0]).shape[0]
        if not isinstance(n, int) or any(_val(s).shape[0] != n for s in stacks):
            continue
        if getattr(_val(stacks[0]), "fake_mode", None) is None:  # the body is traced with the graph's fake tensors
            continue
        _rewrite(graph, node, stacks)
        changed += 1
    return changed


def run(ctx: PassContext) -> None:
    """:func:`_read_reversed` of the graph."""
    _read_reversed(ctx.graph)
