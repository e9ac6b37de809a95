"""The ``scan_copies`` pass (funcamp/passes/scan_copies.py): a scan's body does not copy a tensor back into the layout
it had, and the forward scan does not stack copies of the layers of its own ``xs`` for the backward.

The scans are AOTAutograd's (``aot_autograd`` with compilers that run the pass and return the graph to run eagerly),
where torch 2.13's functionalized scan bodies write every view as a copy (``t_copy``). The oracle is the same
function compiled with ``aot_eager`` (no pass). GPT-2 124M's figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._higher_order_ops.scan import scan
from torch.fx.experimental.proxy_tensor import make_fx

from funcamp.passes import scan_copies


def _linear_layers(h, w, b):
    """A scan of ``tanh(c @ w[i].T + b)``, square weights, with a carry and a stacked output: a scanned linear
    layer, whose backward reads each layer's weight."""

    def body(c, wl):
        c = torch.tanh(c @ wl.t() + b)
        return c, c.sum(0)

    c, ys = scan(body, h, w)
    return c.sum() + ys.square().sum()


def _grads(fn, backend, w):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    h, b = torch.randn(3, 4, generator=g, requires_grad=True), torch.randn(4, generator=g, requires_grad=True)
    w = w.detach().requires_grad_()
    out = torch.compile(fn, backend=backend, fullgraph=True)(h, w, b)
    return [out, *torch.autograd.grad(out, [h, w, b])]


def _passed(counts, graphs):
    def compiler(gm, example_inputs):
        counts.append(scan_copies._rewrite(gm.graph))
        gm.recompile()
        graphs.append(gm)
        return make_boxed_func(gm)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def _stack():
    return torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(1))


def test_a_scanned_linear_layer_saves_no_copy_of_its_weights():
    """The forward body's saved weight, ``t_copy(t_copy(w[i]))`` (torch's functionalized transpose, twice), is no
    longer stacked: the forward graph hands the backward the weight stack itself; the backward body's weight
    gradient, ``t_copy(t_copy(mm))``, is the ``mm``. The loss and the gradients bitwise those without the pass
    (planted: a chain taken for the identity wherever shape and strides agree: the forward's transposed square
    weight read untransposed, the values differ)."""
    counts, graphs = [], []
    got = _grads(_linear_layers, _passed(counts, graphs), _stack())
    ref = _grads(_linear_layers, "aot_eager", _stack())
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert counts == [(1, 1), (0, 1)]
    forward = graphs[0]
    (node,) = forward.graph.find_nodes(op="call_function", target=scan_copies._SCAN)
    assert len(node.meta["val"]) == 4  # carry, ys and two saved values (was three)
    saved = forward.graph.output_node().args[0]
    assert any(s.op == "placeholder" and tuple(s.meta["val"].shape) == (5, 4, 4) for s in saved)
    body = getattr(
        graphs[1], graphs[1].graph.find_nodes(op="call_function", target=scan_copies._SCAN)[0].args[0].target
    )
    assert not body.graph.find_nodes(op="call_function", target=torch.ops.aten.t_copy.default)[1:]


def test_a_weight_stack_in_another_layout_is_still_saved():
    """The same scan over a stack stored transposed (``w.transpose(1, 2)``, each layer non-contiguous): the saved
    stack is contiguous, the weights' is not, so the forward keeps its saved copy; the values bitwise those
    without the pass (planted: the strides of the stack not compared: the forward drops it)."""
    counts, graphs = [], []
    got = _grads(lambda h, w, b: _linear_layers(h, w.transpose(1, 2), b), _passed(counts, graphs), _stack())
    ref = _grads(lambda h, w, b: _linear_layers(h, w.transpose(1, 2), b), "aot_eager", _stack())
    assert counts[0][0] == 0
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_a_copy_into_another_layout_is_kept():
    """A copy of a non-contiguous tensor into a contiguous one holds the same values in other strides: it stays (a
    reader such as a float16 matmul gives other bits on other strides); a copy of a copy, the same layout, goes
    (planted: strides not compared: the first is dropped too)."""

    def f(x):
        a = torch.ops.aten.clone.default(x, memory_format=torch.contiguous_format)
        b = torch.ops.aten.clone.default(torch.ops.aten.clone.default(a))
        return torch.mm(a, a) + torch.mm(b, b)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 4).t())
    clones = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.clone.default)
    assert len(clones) == 3
    assert scan_copies._drop_in_body(gm) == 2  # the second copy read the first, the matmul the second
    left = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.clone.default)
    assert [n.args[0].op for n in left] == ["placeholder"]
    x = torch.randn(4, 4).t()
    assert torch.equal(gm(x), f(x))


def test_a_result_never_becomes_a_view_of_an_input():
    """A body result that copies a view of an input the same layout (a full ``expand``, a ``slice`` of the whole
    tensor, a ``squeeze`` of nothing) stays a copy: a result must alias no input (planted: only the chain's own
    view ops counted as views: the results share the inputs' memory)."""
    aten = torch.ops.aten

    def f(h, x):
        whole = aten.slice.Tensor(h, 1, 0, 4)
        same = aten.expand.default(x, [3, 4])
        kept = aten.squeeze.dim(h, 0)
        return (h * 2, aten.clone.default(whole), aten.clone.default(same), aten.clone.default(kept))

    gm = make_fx(f, tracing_mode="fake")(torch.randn(3, 4), torch.randn(3, 4))
    scan_copies._drop_in_body(gm)
    h, x = torch.randn(3, 4), torch.randn(3, 4)
    out = gm(h, x)
    inputs = {h.untyped_storage().data_ptr(), x.untyped_storage().data_ptr()}
    assert not inputs & {o.untyped_storage().data_ptr() for o in out}
    assert all(torch.equal(a, b) for a, b in zip(out, f(h, x), strict=True))
