"""The ``region_casts`` pass (funcamp/passes/region_casts.py): a nested compile region handed a widened tensor
gets the narrow one and widens it inside, the values bit for bit.

The graphs are AOTAutograd's (``aot_autograd`` with a forward compiler that runs the pass and returns the graph to
run eagerly): a region that writes into its operands comes as ``auto_functionalized_v2(invoke_subgraph, ...)``, as
inductor's pre-pass sees funcamp's flat update; a pure one as ``invoke_subgraph`` itself. The oracle is the same
function compiled with ``aot_eager`` (no pass). The GPT-2 body's counts are in docs/benchmarks.md.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

from funcamp.passes import _graph, region_casts


@torch.compiler.nested_compile_region
def _writing(g, p, m):
    new_m = 0.9 * m + 0.1 * g
    p.copy_(p - 0.01 * new_m / (new_m.abs() + 1e-8))
    m.copy_(new_m)
    return new_m.sum()


@torch.compiler.nested_compile_region
def _pure(g, p, m):
    new_m = 0.9 * m + 0.1 * g
    return p - 0.01 * new_m / (new_m.abs() + 1e-8), new_m


def _step(region, widen_both=True):
    def step(x, w, p1, m1, p2, m2):
        g1 = (x @ w).float().reshape(-1)  # a bfloat16 matmul's result, widened: the weight gradient's case
        g2 = (x @ w.t()).float().reshape(-1) if widen_both else p1 * 0.5
        return region(g1, p1, m1), region(g2, p2, m2)

    return step


def _inputs():
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(8, 8, generator=g).bfloat16() for _ in range(2))
    return [x, w, *(torch.randn(64, generator=g) for _ in range(4))]


def _run(step, backend):
    torch._dynamo.reset()
    args = _inputs()
    out = torch.compile(step, backend=backend, fullgraph=True)(*args)
    return torch.utils._pytree.tree_leaves(out), args


def _passed(graphs):
    def compiler(gm, example_inputs):
        graphs.append((region_casts._region_casts(gm.graph), gm))
        gm.recompile()
        return gm

    return aot_autograd(fw_compiler=compiler)


@pytest.mark.parametrize("region", [_writing, _pure], ids=["writes_its_operands", "pure"])
def test_a_region_widens_its_narrow_operand_itself(region):
    """Both calls widen a bfloat16 matmul's result for the gradient's operand: the calls hand the bfloat16 tensor
    (reshaped), the widening is gone from the step, and the new region's operand there is bfloat16, widened to
    float32 before any use; outputs and the written operands bitwise those without the pass."""
    graphs = []
    got, got_args = _run(_step(region), _passed(graphs))
    ref, ref_args = _run(_step(region), "aot_eager")
    ((changed, gm),) = graphs
    assert changed == 1
    nodes = list(gm.graph.nodes)
    assert not any(n.target in (torch.ops.aten._to_copy.default, region_casts._CONVERT) for n in nodes)
    calls = [n for n in nodes if region_casts._Call.of(n) is not None]
    assert len(calls) == 2
    for node in calls:
        call = region_casts._Call(node)
        sub = getattr(gm, call.attr.target)
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        narrow = [k for k in range(len(placeholders)) if placeholders[k].meta["val"].dtype == torch.bfloat16]
        assert call.identifier.endswith("_region_casts") and len(narrow) == 1, (call.identifier, narrow)
        assert call.operand(narrow[0]).meta["val"].dtype == torch.bfloat16
        (use,) = placeholders[narrow[0]].users
        assert use.target is region_casts._CONVERT and use.args[1] == torch.float32
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got_args, ref_args, strict=True))


def test_a_region_keeps_its_operand_where_one_call_does_not_widen():
    """One call hands a float32 tensor computed in float32: the region is left as it is (every call of a region
    runs one copy of it)."""
    graphs = []
    got, _ = _run(_step(_pure, widen_both=False), _passed(graphs))
    ref, _ = _run(_step(_pure, widen_both=False), "aot_eager")
    assert [changed for changed, _ in graphs] == [0]
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_a_narrow_tensor_the_graph_computes_is_left_to_inductor():
    """Both calls widen a bfloat16 tensor the graph computes from float32 values (a user's round to bfloat16, or
    the backward of a cast): the region is left as it is. Inductor fuses such a narrowing into its reader without
    rounding (it does not emulate precision casts by default), so handing the region the stored bfloat16 tensor
    changed the values: a funcamp step's grad norm 26.1633 against 26.1120 without the pass, one step's parameters
    up to 2e-3 apart. Only graph inputs and extern kernels' results (a matmul's: the tests above) are handed narrow.
    (Planted: every narrow tensor handed -> the region is rewritten here.)"""

    def step(x, w, p1, m1, p2, m2):
        g1 = (p1 * 1.37 + 0.1).bfloat16().float()  # computed, then narrowed and widened
        g2 = (p2 * 1.37 + 0.1).bfloat16().float()
        return _pure(g1, p1, m1), _pure(g2, p2, m2)

    graphs = []
    got, _ = _run(step, _passed(graphs))
    ref, _ = _run(step, "aot_eager")
    assert [changed for changed, _ in graphs] == [0]
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_a_matmul_is_not_taken_as_stored_under_max_autotune():
    """With max-autotune inductor may generate a matmul as a template that fuses its readers (the widening among
    them), so a matmul's narrow result is handed to no region then. (Planted: the option not read -> rewritten.)"""
    graphs = []
    with torch._inductor.config.patch(max_autotune=True):
        got, _ = _run(_step(_pure), _passed(graphs))
    ref, _ = _run(_step(_pure), "aot_eager")
    assert [changed for changed, _ in graphs] == [0]
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


@torch.compiler.nested_compile_region
def _unit_scaled(g, unit, p, m):
    """As ``_writing``, reading ``g * unit`` (``funcamp.train._flat_regions``' update, its gradient times a 0-d one)."""
    new_m = 0.9 * m + 0.1 * (g * unit)
    p.copy_(p - 0.01 * new_m / (new_m.abs() + 1e-8))
    m.copy_(new_m)
    return new_m.sum()


def test_a_region_is_handed_the_factors_of_a_product_it_multiplies_again():
    """Each call hands ``(x @ w).float() * c`` (an unscaled gradient: ``c`` the loss scale's reciprocal, 0-d) and a
    constant one that the region multiplies it by first: the calls hand the factors instead, so the region
    computes the product itself and it is never written out; then the widening is handed as above (the bfloat16
    matmul result). Outputs and written operands bitwise those without the pass. (Planted: ``_one`` always
    False -> the product is handed, the matmul result widened outside.)"""

    def step(x, w, p1, m1, p2, m2):
        c = torch.reciprocal(p1.sum().abs().double() + 3.0).float()  # a computed 0-d factor, as 1 / loss scale
        one = torch.ones((), dtype=torch.float32)
        g1 = ((x @ w).float() * c).reshape(-1)
        g2 = ((x @ w.t()).float() * c).reshape(-1)
        return _unit_scaled(g1, one, p1, m1), _unit_scaled(g2, one, p2, m2)

    graphs = []
    got, got_args = _run(step, _passed(graphs))
    ref, ref_args = _run(step, "aot_eager")
    ((changed, gm),) = graphs
    assert changed == 1
    calls = [region_casts._Call(n) for n in gm.graph.nodes if region_casts._Call.of(n) is not None]
    assert len(calls) == 2
    ones = (torch.ops.aten.ones.default, torch.ops.aten.full.default)
    for call in calls:
        sub = getattr(gm, call.attr.target)
        count = sum(n.op == "placeholder" for n in sub.graph.nodes)
        operands = [op for op in map(call.operand, range(count)) if isinstance(op, torch.fx.Node)]
        vals = [op.meta["val"] for op in operands]
        assert sum(v.ndim == 0 for v in vals) == 1 and not any(op.target in ones for op in operands)  # c, not one
        assert sum(v.dtype == torch.bfloat16 for v in vals) == 1  # the matmul's result itself
    assert not any(n.target is torch.ops.aten.mul.Tensor and n.users for n in gm.graph.nodes)  # no product outside
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got_args, ref_args, strict=True))


@pytest.mark.parametrize(
    "reverse",
    [lambda x: torch.flip(x, [0]), lambda x: torch.ops.prims.rev.default(x, [0])],
    ids=["flip", "prims_rev"],
)
def test_a_layer_of_a_reversed_stack_is_read_from_the_stack(reverse):
    """A scanned run's stacked gradients come from torch's scan last layer first and are reversed (``flip`` /
    ``prims.rev``) before each layer's is selected: the selects of the reversal are read from the stack itself
    (layer ``i`` at ``n - 1 - i``, a view), so each layer's widened gradient is a view of memory the region is handed
    narrow. The reversal was computed in the kernels that read it, each layer's at its own offset (GPT-2 124M's
    scanned step: 48 of 76 C++ compiles; docs/benchmarks.md). Here the stack is a batched matmul's, reversed by
    ``flip`` or by ``prims.rev`` (what AOTAutograd records for a scan's backward); outputs and written operands bitwise
    those without the pass (planted: no un-reversing: the region is left widened). A 12-layer scanned GPT's compiled
    step, one parameter a buffer, gave bitwise the same parameters with the pass and without it in bfloat16 and in
    float16 with a dynamic loss scale (checked once; two inductor compiles each, outside the suite)."""

    def plain(x, w, p1, m1, p2, m2):
        stack = reverse(torch.bmm(torch.stack([x, w]), torch.stack([w, x])))  # bfloat16 [2, 8, 8]
        g1 = stack[0].float().reshape(-1)
        g2 = stack[1].float().reshape(-1)
        return _writing(g1, p1, m1), _writing(g2, p2, m2)

    graphs = []
    got, got_args = _run(plain, _passed_unreversed(graphs))
    ref, ref_args = _run(plain, "aot_eager")
    ((changed, gm),) = graphs
    assert changed == 1
    nodes = list(gm.graph.nodes)
    assert not any(n.target in _graph._REVERSES for n in nodes)
    selects = [n for n in nodes if n.target is region_casts._SELECT]
    assert sorted(n.args[1:] for n in selects) == [(0, 0), (0, 1)]
    assert all(n.args[0].target is torch.ops.aten.bmm.default for n in selects)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got_args, ref_args, strict=True))


def _passed_unreversed(graphs):
    def compiler(gm, example_inputs):
        region_casts._unreverse(gm.graph)
        graphs.append((region_casts._region_casts(gm.graph), gm))
        gm.recompile()
        return gm

    return aot_autograd(fw_compiler=compiler)


def test_a_stack_reversed_along_another_dimension_is_left_as_it_is():
    """``select(flip(x, [1]), 0, i)`` is not layer ``n - 1 - i`` of ``x``: only a reversal along the first dimension
    is read from the stack; the values bitwise those without the pass (planted: the dimension not checked: the
    layers read from the wrong end, the outputs differ)."""

    def step(x, w, p1, m1, p2, m2):
        stack = torch.flip(torch.bmm(torch.stack([x, w]), torch.stack([w, x])), [1])
        return _writing(stack[0].float().reshape(-1), p1, m1), _writing(stack[1].float().reshape(-1), p2, m2)

    graphs = []
    got, got_args = _run(step, _passed_unreversed(graphs))
    ref, ref_args = _run(step, "aot_eager")
    ((_, gm),) = graphs
    assert any(n.target in _graph._REVERSES for n in gm.graph.nodes)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got_args, ref_args, strict=True))
