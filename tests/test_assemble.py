"""``funcamp.train.assemble``: a step composed from the stages gets what ``make_train_step`` gets (issue 46).

The same graph passes on the same model (counted around each pass of the pipeline), ``functionalize(remat=)``
saving memory, a user's ``torch.autograd.Function`` keeping its backward (the traced-autograd route), a flat
state's buffers, and a plan made once.
"""

from __future__ import annotations

import pytest
import torch

import funcamp as fa
from funcamp import optim
from funcamp.passes import pipeline


class Reverse(torch.autograd.Function):
    """A gradient reversal applied to a parameter itself: forward ``x``, backward ``-g`` (torch.func's compiled
    grad would take the forward's derivative, ``+g``)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(16, 3))


@pytest.fixture
def counted(monkeypatch):
    """Each compile's pipeline run: ``[(name, before, after), ...]`` per graph; the caches off, so the passes run."""
    runs = []
    run = pipeline.run

    def count(graph, *args, **kwargs):
        ctx = run(graph, *args, **kwargs)
        runs.append([(c.name, c.before, c.after) for c in ctx.counts])
        return ctx

    monkeypatch.setattr(pipeline, "run", count)
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    return runs


@pytest.mark.slow
def test_composed_step_runs_the_passes_of_make_train_step(counted):
    """The same model, loss and optimizer: ``make_train_step`` and a body of ``fa.train.run`` given to
    ``assemble`` hand inductor the same graph and run the same passes on it (the same node counts around each
    pass); the regions of ``remat=Block`` are recomputed (``remat_regions`` and ``recompute`` grow the graph).
    Planted: ``assemble`` without funcamp's inductor options (no pipeline run: nothing counted)."""
    apply_fn, params = fa.nn.functionalize(_model(), "params=float32,compute=bfloat16,output=float32", remat=Block)
    optimizer = optim.adamw(1e-2)

    def loss_fn(p, batch):
        return torch.nn.functional.cross_entropy(apply_fn(p, batch[0]), batch[1])

    def body(state, batch):
        record = fa.train.run(loss_fn, optimizer, state, batch)
        return record.new_state, record.metrics

    batch = (torch.randn(8, 16), torch.randint(0, 3, (8,)))
    for build in (lambda: fa.make_train_step(loss_fn, optimizer), lambda: fa.train.assemble(body)):
        torch._dynamo.reset()
        state = fa.TrainState.create({k: v.clone() for k, v in params.items()}, optimizer)
        build()(state, batch)
    assert len(counted) == 2 and counted[0] == counted[1], counted
    grew = {name for name, before, after in counted[0] if after > before}
    assert {"recompute", "flat_gradients"} <= grew, counted[0]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "aot_eager"])
def test_composed_step_keeps_a_functions_backward_and_its_plan(compile):
    """A body of the stages, assembled: the gradient of a weight through a gradient reversal applied to the
    weight itself is ``-g`` (the traced-autograd route; torch.func's compiled grad gives ``+g``), equal to
    ``make_train_step``'s bitwise; the plan says what was decided. Planted: ``gradients`` left on torch.func's
    route inside an assembled compiled body: the aot_eager case trains the other way."""
    params = {"w": torch.ones(4)}
    optimizer = optim.sgd(0.5)

    def loss_fn(p, x):
        return (Reverse.apply(p["w"]) * x).sum()

    def body(state, batch):
        record = fa.train.run(loss_fn, optimizer, state, batch)
        return record.new_state, record.metrics

    kwargs = {"backend": "aot_eager"} if compile else {"compile": False}
    x = torch.arange(1.0, 5.0)
    torch._dynamo.reset()
    composed = fa.train.assemble(body, **kwargs)
    a, _ = composed(fa.TrainState.create(params, optimizer), x)
    b, _ = fa.make_train_step(loss_fn, optimizer, **kwargs)(fa.TrainState.create(params, optimizer), x)
    assert torch.equal(a.params["w"], 1 + 0.5 * x)  # the gradient is -x: the reversal's backward
    assert torch.equal(a.params["w"], b.params["w"])
    assert composed.plan.compiled is compile and not composed.plan.donate
    assert "storage flat" in composed.plan_for(a)


def test_the_plan_is_logged_once_and_says_why_a_state_is_per_leaf(caplog):
    """One INFO line on ``funcamp.train`` at the first call with a plan, none at the next; a state kept leaf by
    leaf says why (a transformation of one's own is not known to be elementwise). Planted: the line logged at
    every call (``_log_once`` without its cache): two lines."""

    def own(updates, state, params=None):
        return {k: -0.1 * u for k, u in updates.items()}, state

    from funcamp.train import _assemble

    _assemble._log_once.cache_clear()  # another test of this process may have logged the same line
    optimizer = optim.GradientTransformation(lambda p: (), own)
    params = {"w": torch.ones(3, 7)}
    state = fa.TrainState.create(params, optimizer)
    step = fa.make_train_step(lambda p, x: (p["w"] @ x).sum(), optimizer, compile=False, max_consecutive_skips=2)
    with caplog.at_level("INFO", logger="funcamp.train"):
        state, _ = step(state, torch.ones(7))
        state, _ = step(state, torch.ones(7))
    lines = [r.getMessage() for r in caplog.records if r.name == "funcamp.train"]
    assert len(lines) == 1, lines
    assert "step: eager, probes skip_limit" in lines[0] and "storage per leaf (" in lines[0]
    assert "not marked elementwise" in lines[0] and lines[0].endswith(step.plan_for(state))
