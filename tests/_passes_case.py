"""The traced case of the graph passes' golden text (``tests/test_passes.py``, ``tools/make_passes_golden.py``).

:func:`trace` compiles a train step of :class:`Net` with inductor up to its post-grad pass and returns the graph
inductor hands :class:`funcamp.passes.RematPass` (then stops the compile: no code generated, seconds). The graph
holds every kind of node a pass moves or copies: checkpointed regions (every :class:`Block`), dropout draws,
parameters' casts made at their use, a sharded parameter's gather (:class:`Gathered`), a large backward
constructor (the embedding's gradient) and, in each region, an op whose copy reads two inputs of different sizes
(:class:`Shift`: the activation and a bias; the copy waits on the smaller one); the learning rate is a cosine
schedule's scalar, which the embedding's update reads (``scalars_once`` stores it).
"""

from __future__ import annotations

import difflib
import pathlib
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import funcamp as fa
from funcamp import optim, passes

WIDTH, VOCAB = 32, 8192  # an embedding of VOCAB x WIDTH = 2**18 elements: its gradient is a late constructor
GOLDEN = pathlib.Path(__file__).resolve().parent / "golden" / "passes"
GENERATOR = "tools/make_passes_golden.py"

#: The graph as traced (regions of budget 0), the same with budget 0.5, and without regions (remat=None).
VARIANTS = {"remat": None, "budget": 0.5, "no_regions": 0.0}


class _Captured(Exception):
    pass


class Gathered(nn.Module):
    """A linear layer whose weight's cast is tagged as a sharded parameter's gather (as ``funcamp._at_use`` tags
    the all-gather and its casts): recomputed for the backward, moved to its first user."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with passes.gather_region():
            w = self.weight.to(x.dtype) * 1.0
        return F.linear(x, w)


class Shift(nn.Module):
    """``x + bias``, its bias stored in bfloat16 (no cast: the graph input itself): the copy of the add reads
    two inputs that are not copies, the activation (16 x 8 x 32) and the bias (32), and waits on the bias."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.linspace(-0.5, 0.5, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class Block(nn.Module):
    def __init__(self, gathered: bool) -> None:
        super().__init__()
        self.shift = Shift()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = Gathered() if gathered else nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.gelu(self.fc(self.ln(self.shift(x)))))


class Net(nn.Module):
    def __init__(self, gathered: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(gathered) for _ in range(2))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def text(graph: torch.fx.Graph) -> str:
    """Every node's ``format_node()`` and its tags, one line each; the regions' ids renumbered from 1 in the
    order they first appear (the ids come from a process-wide counter: another test's regions shift them)."""
    ids: dict[Any, int] = {}
    lines = []
    for n in graph.nodes:
        tags = dict(n.meta.get("custom") or {})
        if "funcamp_remat" in tags:
            tags["funcamp_remat"] = ids.setdefault(tags["funcamp_remat"], len(ids) + 1)
        lines.append(f"{n.format_node()}  {sorted(tags.items())}")
    return "\n".join(lines) + "\n"


def diff(before: str, after: str) -> str:
    """What the pass changed: a unified diff without context lines (``after`` is ``before`` with it applied)."""
    lines = difflib.unified_diff(before.splitlines(True), after.splitlines(True), "traced", "passed", n=0)
    return "".join(lines)


def copy(graph: torch.fx.Graph, budget: float | None = None) -> torch.fx.Graph:
    """A copy of ``graph``; with ``budget``, its remat regions retagged with that budget (0: no region at all),
    as ``functionalize(remat=Remat(..., budget))`` and ``remat=None`` tag them (the same ops either way)."""
    new = torch.fx.Graph()
    new.output(new.graph_copy(graph, {}))
    for node in new.nodes if budget is not None else ():
        tags = {k: v for k, v in (node.meta.get("custom") or {}).items() if k not in ("funcamp_remat_budget",)}
        if budget == 0:
            tags.pop("funcamp_remat", None)
        elif "funcamp_remat" in tags:
            tags["funcamp_remat_budget"] = budget
        node.meta["custom"] = tags
    return new


def trace() -> torch.fx.Graph:
    """The post-grad graph inductor hands the pass for a step of ``Net(gathered=True)`` with every block
    checkpointed, in bfloat16 (the shifts' biases stored in bfloat16): compiled up to the pass, then stopped."""
    got: list[torch.fx.Graph] = []

    def recording(self: passes.RematPass, graph: torch.fx.Graph) -> None:
        got.append(copy(graph))
        raise _Captured

    shift = {Shift: "p=bf16,c=bf16,o=bf16"}
    model = Net(gathered=True).train()
    apply_fn, params = fa.nn.functionalize(model, "p=f32,c=bf16,o=f32", remat=Block, module_policies=shift)
    loss_fn = lambda p, x: apply_fn(p, x).float().square().mean()  # noqa: E731
    opt = optim.sgd(optim.cosine_decay(0.1, 10))  # the schedule's scalar, read by the embedding's update: scalars_once
    step = fa.make_train_step(loss_fn, opt)
    torch._dynamo.reset()
    call = passes.RematPass.__call__
    passes.RematPass.__call__ = recording  # type: ignore[method-assign]
    try:
        with (
            torch._inductor.config.patch(fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            try:
                step(fa.TrainState.create(params, opt), torch.randint(0, VOCAB, (16, 8)))
            except torch._dynamo.exc.TorchDynamoException:  # the compile stopped (then the step ran eagerly)
                pass
    finally:
        passes.RematPass.__call__ = call  # type: ignore[method-assign]
        torch._dynamo.reset()
    if len(got) != 1:
        raise AssertionError(f"expected one post-grad graph, got {len(got)}")
    return got[0]


def passed(graph: torch.fx.Graph, variant: str) -> tuple[str, str]:
    """``(before, after)``: the text of ``variant``'s graph, and of it after :class:`funcamp.passes.RematPass`."""
    g = copy(graph, VARIANTS[variant])
    before = text(g)
    passes.RematPass()(g)
    return before, text(g)


def header() -> str:
    return f"# made by {GENERATOR} with torch {torch.__version__}; the traced graph of tests/_passes_case.py\n"


def passed_graphs(monkeypatch: Any) -> list[torch.fx.Graph]:
    """The graphs the pass pipeline leaves, appended as each step compiles, under ``monkeypatch`` (a pytest
    ``MonkeyPatch``): inductor's and AOTAutograd's caches off, so that a compile with a pass switched off runs the
    pipeline again instead of loading the graph of the compile before."""
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    graphs: list[torch.fx.Graph] = []
    run = passes.pipeline.run
    monkeypatch.setattr(passes.pipeline, "run", lambda graph: (run(graph), graphs.append(graph))[0])
    return graphs
