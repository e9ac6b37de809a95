"""The ``stacked_sums`` pass (funcamp/passes/stacked_sums.py): the same reduction of every layer of a stack is
computed once over the stack, the values bit for bit.

The graphs are AOTAutograd's with inductor's decompositions (casts as ``convert_element_type``, as inductor's
pre-pass sees them), run eagerly after the pass; the oracle is the same function compiled with ``aot_eager``.
GPT-2 124M's figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table

from funcamp.passes import stacked_sums


def _rows(x, row):
    """A flat check's row sums of one gradient (``funcamp._tree.scaled_row_sums``): widened, squared, per row."""
    return x.float().reshape(-1).reshape(-1, row).double().square().sum(1)


def _layers(a, b):
    """Row sums of the four layers of a batched matmul's bfloat16 result: layers 0 and 1 as rows of 4, 2 and 3 as
    rows of 8 (two chains, each computed once), the last layer's also read whole (a chain node with another user)."""
    stack = torch.bmm(a, b)  # [4, 8, 8]
    last = stack[3].float()
    return (
        torch.cat([_rows(stack[0], 4), _rows(stack[1], 4)]),
        torch.cat([_rows(stack[2], 8), last.reshape(-1).reshape(-1, 8).double().square().sum(1)]),
        last * 2,
    )


def _run(backend):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(4, 8, 8, generator=g).bfloat16() for _ in range(2))
    return torch.compile(_layers, backend=backend, fullgraph=True)(a, b)


def test_the_layers_sums_of_a_stack_are_computed_once_over_it():
    """Each group of layer sums with one chain becomes one sum over the stack and a view per layer: two groups of
    two here, so two sums where there were four, each reading the matmul's result whole; the outputs bitwise
    ``aot_eager``'s (planted: the summed dimension not moved past the layer axis, or the chains grouped without
    their reshapes' shapes: the outputs differ)."""
    graphs = []

    def compiler(gm, example_inputs):
        graphs.append((stacked_sums._stack_sums(gm.graph), gm))
        gm.recompile()
        return make_boxed_func(gm)

    got = _run(aot_autograd(fw_compiler=compiler, decompositions=select_decomp_table()))
    ref = _run("aot_eager")
    ((replaced, gm),) = graphs
    assert replaced == 4
    sums = gm.graph.find_nodes(op="call_function", target=stacked_sums._SUM)
    assert len(sums) == 2
    assert all(tuple(s.meta["val"].shape)[0] == 4 for s in sums)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, ref, strict=True))
