"""The graph passes on the inductor-compiled step (:mod:`funcamp.passes`): the graphs they leave are byte-identical
to what the single-file pass (``funcamp/_regions.py`` before it became a package, frozen in
``tests/_frozen_regions.py``) left, and each sub-pass's switch turns it off.

The step of each configuration is compiled with inductor up to the post-grad pass only: the pass is wrapped to
copy the graph it is given, run the frozen pass on the copy and the live pass on the graph, record both texts
(every node's ``format_node()`` and its tags), then stop the compile (no code generated: seconds, not minutes).
When a pass changes on purpose, the same change goes into the frozen copy in the same commit, or the copy goes.

Planted: raising late_constructors' size threshold fails all three cases. Not caught: a gate that waits for its
largest input instead of its smallest (each gated copy in these graphs has one candidate input): a known gap.
"""

from __future__ import annotations

import warnings

import _frozen_regions as frozen
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcamp as fa
from funcamp import optim, passes

WIDTH, VOCAB = 32, 8192  # an embedding of VOCAB x WIDTH = 2**18 elements: its gradient is a late constructor


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


class Block(nn.Module):
    def __init__(self, gathered: bool) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = Gathered() if gathered else nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.gelu(self.fc(self.ln(x))))


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


def _text(graph: torch.fx.Graph) -> str:
    return "\n".join(f"{n.format_node()}  {sorted((n.meta.get('custom') or {}).items())}" for n in graph.nodes)


def _copy(graph: torch.fx.Graph, budget: float | None = None) -> torch.fx.Graph:
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


@pytest.fixture(scope="module")
def traced() -> torch.fx.Graph:
    """The post-grad graph inductor hands the pass for a step of ``Net(gathered=True)`` with every block
    checkpointed, in bfloat16 (regions, dropout draws, casts at use, gathers, a large backward constructor):
    compiled up to the pass, then stopped."""
    got: list[torch.fx.Graph] = []

    def recording(self: passes.RematPass, graph: torch.fx.Graph) -> None:
        got.append(_copy(graph))
        raise _Captured

    apply_fn, params = fa.nn.functionalize(Net(gathered=True).train(), "p=f32,c=bf16,o=f32", remat=Block)
    loss_fn = lambda p, x: apply_fn(p, x).float().square().mean()  # noqa: E731
    opt = optim.sgd(0.1)
    step = fa.make_train_step(loss_fn, opt)
    torch._dynamo.reset()
    with (
        pytest.MonkeyPatch.context() as mp,
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
        warnings.catch_warnings(),
        pytest.raises(torch._dynamo.exc.TorchDynamoException),  # the compile stopped (then the step ran eagerly)
    ):
        mp.setattr(passes.RematPass, "__call__", recording)
        warnings.simplefilter("ignore")
        step(fa.TrainState.create(params, opt), torch.randint(0, VOCAB, (16, 8)))
    assert len(got) == 1
    return got[0]


#: The graph as traced (regions of budget 0), the same with budget 0.5, and without regions (remat=None).
VARIANTS = {"remat": None, "budget": 0.5, "no_regions": 0.0}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_post_pass_graph_is_the_single_file_passs(traced: torch.fx.Graph, variant: str) -> None:
    """Byte for byte, tags included; and the pass did something (the text differs from the graph before)."""
    before, reference, graph = (_copy(traced, VARIANTS[variant]) for _ in range(3))
    frozen.RematPass()(reference)
    passes.RematPass()(graph)
    assert _text(graph) == _text(reference)
    assert _text(graph) != _text(before)


@pytest.mark.slow
def test_switches_turn_each_sub_pass_off(traced: torch.fx.Graph, monkeypatch: pytest.MonkeyPatch) -> None:
    """``FUNCAMP_PASSES_OFF`` names sub-passes to skip: each one alone gives another graph than the full
    pipeline's (on the graph with budget 0.5: every sub-pass has work there, so the byte-for-byte test covers
    each); all of them leave the graph as it was; an unknown name is refused, naming the known ones."""
    full = _copy(traced, 0.5)
    passes.RematPass()(full)
    for name in passes.NAMES:
        graph = _copy(traced, 0.5)
        monkeypatch.setenv("FUNCAMP_PASSES_OFF", name)
        passes.RematPass()(graph)
        assert _text(graph) != _text(full), name
    graph = _copy(traced)
    monkeypatch.setenv("FUNCAMP_PASSES_OFF", " , ".join(passes.NAMES))
    passes.RematPass()(graph)
    assert _text(graph) == _text(traced)
    monkeypatch.setenv("FUNCAMP_PASSES_OFF", "remat_regions,no_such_pass")
    with pytest.raises(ValueError, match="unknown pass 'no_such_pass'.*remat_regions"):
        passes.RematPass()(torch.fx.Graph())
