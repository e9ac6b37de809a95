"""What the compiled step hands the compiler: no node that computes nothing, and the counting benchmark's hooks.

``benchmarks/bench_graph_size.py`` counts, per phase, what funcamp's step and ``torch.compile(model)`` hand to
AOTAutograd and inductor (docs/benchmarks.md). These tests hold two of the removals it measured (no ``to`` of a
tensor to the dtype it has in the Dynamo graph; the op-policy rules checked once, not in every traced forward)
and check that the benchmark's hooks on torch's compiler still catch the graphs and the generated C++.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import funcamp as fa
from funcamp import ops, optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


class _Net(torch.nn.Module):
    """A Linear (bfloat16 under the policy), a LayerNorm (kept float32: its own casts) and an embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(self.emb(idx))).sum(-1)


def _dynamo_graph_of_step() -> torch.fx.GraphModule:
    """The Dynamo graph of one compiled train step of :class:`_Net` (bfloat16 compute), caught by a backend."""
    torch.manual_seed(0)
    apply_fn, params = fa.nn.functionalize(_Net(), "params=float32,compute=bfloat16,output=float32")
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    step = fa.make_train_step(lambda p, b: apply_fn(p, b).float().mean(), opt, backend=backend)
    step(fa.TrainState.create(params, opt), torch.randint(0, 16, (4, 3)))
    assert len(graphs) == 1
    return graphs[0]


def _innermost_funcamp_frame(node: torch.fx.Node) -> str | None:
    """The file (``funcamp/...``) of the innermost funcamp frame in ``node``'s stack trace, or None."""
    frames = [line.split('"')[1] for line in (node.meta.get("stack_trace") or "").splitlines() if 'File "' in line]
    inner = [f for f in frames if f"{Path('funcamp')}" in f and "site-packages" not in f]
    return ("funcamp" + inner[-1].rsplit("funcamp", 1)[1]) if inner else None


def test_step_graph_has_no_cast_to_the_dtype_a_tensor_has() -> None:
    # A float32 gradient of a float32 parameter, a parameter used in the dtype it is stored in: no ``to`` node
    # (Dynamo records one, AOTAutograd drops it: tracing work for nothing). Planted: cast_like's g.to(p.dtype)
    # for every gradient, or to_forward's tensor.to(dtype) for every use: fails.
    # (Others remain, in the finite check's and the norm's per-leaf code: docs/benchmarks.md names them.)
    gm = _dynamo_graph_of_step()
    same = []
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target == "to" and len(node.args) > 1:
            source, dtype = node.args[0].meta.get("example_value"), node.args[1]
            if isinstance(dtype, torch.dtype) and source is not None and source.dtype == dtype:
                same.append((_innermost_funcamp_frame(node), node.format_node()))
    assert not [x for x in same if x[0] in ("funcamp/train/_stages.py", "funcamp/nn/_use.py")], same
    casts = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "to"]
    assert casts, "the bfloat16 uses of the Linear's weight and bias are casts: the test must see them"


def test_op_policies_rules_are_checked_once_not_at_each_forward(monkeypatch) -> None:
    # functionalize's op-policy mode (and with_op_policies') is entered at every forward, which torch.compile
    # traces with the step: the rules are checked when built, never again. Planted: op_mode returning
    # partial(OpPolicies, rules) (each entry checks): fails.
    checked = []
    real = ops._check_rule
    monkeypatch.setattr(ops, "_check_rule", lambda name, rule: checked.append(name) or real(name, rule))
    apply_fn, params = fa.nn.functionalize(_Net(), "params=float32,compute=bfloat16,output=float32")
    wrapped = ops.with_op_policies(lambda x: torch.nn.functional.softmax(x, -1), {"softmax": torch.float32})
    built = len(checked)
    assert built > 0
    for _ in range(2):
        apply_fn(params, torch.randint(0, 16, (2, 3)))
        wrapped(torch.ones(2, 3, dtype=torch.bfloat16))
    assert len(checked) == built
    assert isinstance(ops.checked_rules({"softmax": "float32"})["softmax"], torch.dtype)


def test_bench_graph_size_hooks_catch_graphs_and_generated_code() -> None:
    # The benchmark hooks torch's compiler (compile_fx, its inner compile, GraphLowering.save_output_code, Dynamo's
    # instruction loop): a torch upgrade that moves them must fail here, not print zeros.
    import bench_graph_size

    recorder = bench_graph_size.Recorder()
    with recorder.recording():
        torch.compile(lambda x: (x * 2).sin().sum(), fullgraph=True)(torch.randn(64))
        torch._dynamo.reset()
    record = recorder.record()
    assert [r["kind"] for r in record["dynamo"]] == ["dynamo"] and record["dynamo"][0]["nodes"] == 3
    assert [r["kind"] for r in record["aot"]] == ["inference"] and record["post_grad"][0]["nodes"] >= 3
    code = record["code"][0]
    assert code["kernels"] == 1 and code["cpp_lines"] > 5 and code["extern_calls"] == 0
    assert sum(record["traced_instructions"]["step"].values()) > 0
