"""The ``scan_reversal`` pass (funcamp/passes/scan_reversal.py): the backward of a scan reads the forward's stacks
from their last layer instead of reversed copies of them, the gradients bit for bit.

The graphs are AOTAutograd's backward (``aot_autograd`` with a backward compiler that runs the pass and returns the
graph to run eagerly), where torch 2.13 hands the backward scan every operand reversed (``flip(x, [0])``). The
oracle is the same function compiled with ``aot_eager`` (no pass). GPT-2 124M's figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._higher_order_ops.scan import scan

from funcamp.passes import _graph, scan_reversal


def _layers(h, w, b):
    """A scan of ``tanh(c @ w[i] + b)`` over the layers of ``w`` (``b`` an additional input, read by every layer),
    with a carry and a stacked output."""

    def body(c, wl):
        c = torch.tanh(c @ wl + b)
        return c, c.sum(0)

    c, ys = scan(body, h, w)
    return c.sum() + ys.square().sum()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g, requires_grad=True) for shape in ((3, 4), (5, 4, 4), (4,))]


def _grads(backend):
    torch._dynamo.reset()
    args = _inputs()
    out = torch.compile(_layers, backend=backend, fullgraph=True)(*args)
    return [out, *torch.autograd.grad(out, args)]


def _passed(graphs):
    def backward(gm, example_inputs):
        graphs.append((scan_reversal._read_reversed(gm.graph), gm))
        gm.recompile()
        return make_boxed_func(gm)

    def forward(gm, example_inputs):
        graphs.append((scan_reversal._read_reversed(gm.graph), gm))
        return make_boxed_func(gm)

    return aot_autograd(fw_compiler=forward, bw_compiler=backward)


def test_the_backward_scan_reads_the_forward_stacks_from_their_last_layer():
    """The backward scan's operands, each the forward's stack reversed (a copy in memory under inductor: GPT-2 124M's
    scanned body, 65 ms of a 690 ms step), are handed whole, with the layer indices ``n - 1, ..., 0`` as the one
    scanned operand; the body reads layer ``i`` as a view. The forward scan (nothing reversed) is left as it is. The
    loss and the gradients of the carry, the stack and the additional input bitwise those without the pass
    (planted: the indices ``0, ..., n - 1``: the gradients differ)."""
    graphs = []
    got = _grads(_passed(graphs))
    ref = _grads("aot_eager")
    (fw_changed, _), (bw_changed, gm) = graphs
    assert (fw_changed, bw_changed) == (0, 1)
    (node,) = gm.graph.find_nodes(op="call_function", target=scan_reversal._SCAN)
    _, _, xs, additional = node.args
    assert [x.target for x in xs] == [torch.ops.aten.arange.start_step]
    assert xs[0].args == (4, -1, -1)
    assert not any(a.op == "call_function" and a.target in _graph._REVERSES for a in additional)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


@pytest.mark.parametrize(
    ("dims", "changed"), [([0], 1), ([-2], 1), ([1], 0), ([0, 1], 0)], ids=["first", "first_negative", "other", "two"]
)
def test_only_a_stack_reversed_along_its_first_dimension_is_read_in_place(dims, changed):
    """A reversal along the first dimension alone is the layers read last to first (here in a forward scan); a scan
    over ``flip(x, [1])`` or ``flip(x, [0, 1])`` keeps its operand; the values bitwise those without the pass either
    way (planted: the dimensions not checked: those two rewritten, the values differ)."""

    def f(x, h):
        def body(c, xl):
            c = torch.tanh(c + xl)
            return c, c * 2

        return scan(body, h, torch.flip(x, dims))

    g = torch.Generator().manual_seed(0)
    x, h = torch.randn(5, 4, generator=g), torch.randn(4, generator=g)
    graphs = []
    torch._dynamo.reset()
    got = torch.compile(f, backend=_passed(graphs), fullgraph=True)(x, h)
    torch._dynamo.reset()
    ref = torch.compile(f, backend="aot_eager", fullgraph=True)(x, h)
    assert [c for c, _ in graphs] == [changed]
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_a_backward_scan_with_a_dynamic_size_is_read_in_place():
    """With a dynamic batch the backward scan's body also reads the batch size, a SymInt additional input; the
    rewritten body is traced with it (planted: the example built from tensors alone: the trace fails on the
    missing size), and the gradients are bitwise those without the pass."""

    def layers(h, w, b):
        def body(c, wl):
            c = torch.tanh(c @ wl + b) * c.shape[0]
            return c, c.sum(0)

        c, ys = scan(body, h, w)
        return c.sum() + ys.square().sum()

    def grads(backend):
        torch._dynamo.reset()
        g = torch.Generator().manual_seed(0)
        args = [torch.randn(*shape, generator=g, requires_grad=True) for shape in ((6, 4), (5, 4, 4), (4,))]
        torch._dynamo.mark_dynamic(args[0], 0)  # the batch, not the layers
        out = torch.compile(layers, backend=backend, fullgraph=True)(*args)
        return [out, *torch.autograd.grad(out, args)]

    graphs = []
    got = grads(_passed(graphs))
    ref = grads("aot_eager")
    assert [c for c, _ in graphs] == [0, 1]
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
