"""Random ops other than dropout inside a compiled remat region: draws replayed or kept, bitwise.

A region with noise injection (``randn_like``), a VAE's sample (``mu + exp(logvar / 2) * randn_like``),
multiplicative ``rand_like`` noise, ``bernoulli`` of a tensor of probabilities, ``normal_``, ``torch.randn``,
``randint_like`` and dropout. Inductor turns ``rand``/``randn``/``randint`` into ``inductor_random(size,
lookup_seed(seeds, i))``; :class:`funcamp.passes.RematPass` recomputes the draw from the forward's seed (the
same values) and never copies the seed lookup (a copy read the seeds through its gate, which inductor cannot
lower: "NotImplementedError: Pointwise" at every budget before). Elsewhere (``aten.randn`` and friends,
``nondeterministic_seeded``) the draw is kept, never drawn again.

Each run: one SGD step of ``make_train_step`` from the same seed, the new parameters compared bitwise with the
same step without remat. aot_eager at budgets 0, 0.5 and 1 with the pass run on its graph
(:func:`_aot_eager_with_pass`, the aten random ops: the "kept" rule; plain aot_eager never runs the pass, so it
is not run here); inductor at budget 0 (the replay).

Planted (in ``_recomputable``, funcamp/passes/remat_regions.py): the seed lookup made recomputable again: the
inductor case raises (NotImplementedError: Pointwise); random ops made recomputable (returning ``not
node.is_impure(impure_random=False)``): the aot_eager-with-pass cases at budgets 0 and 0.5 fail (the backward
draws new noise).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import funcamp as fa
from funcamp import passes


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        mu, logvar = h.chunk(2, dim=-1)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)  # a VAE's sample
        z = z + 0.1 * torch.randn_like(z)  # noise injection
        z = torch.tanh(z) * torch.rand_like(z)
        z = z * torch.bernoulli(torch.sigmoid(mu))  # probabilities from the data
        z = z + torch.empty_like(z).normal_(0.0, 0.05) + 0.01 * torch.randn(z.shape)
        z = z * (1 + torch.randint_like(z, 0, 3))
        return F.dropout(z, 0.2)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.noisy = Noisy()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.noisy(x))


def _aot_eager_with_pass():
    """aot_eager with RematPass run on the forward graph it compiles (the one graph of the step)."""

    def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        passes.RematPass()(gm.graph)
        gm.recompile()
        return gm

    return aot_autograd(fw_compiler=compiler)


def _step_params(backend: object, budget: float | None) -> dict[str, torch.Tensor]:
    torch._dynamo.reset()  # each step a new compile: the steps share their code, and the recompile limit is 8
    torch.manual_seed(0)
    model = Net()
    remat = None if budget is None else fa.nn.Remat(Noisy, budget=budget)
    apply_fn, params = fa.nn.functionalize(model, "float32", remat=remat)
    optimizer = fa.optim.sgd(0.5)
    step = fa.make_train_step(lambda p, x: apply_fn(p, x).square().mean(), optimizer, backend=backend)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)
    new, _ = step(fa.TrainState.create(params, optimizer), x)
    return new.params


def _assert_bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for k in expected:
        assert torch.equal(got[k], expected[k]), (k, (got[k] - expected[k]).abs().max())


@pytest.fixture(scope="module")
def reference_aot() -> dict[str, torch.Tensor]:
    return _step_params("aot_eager", None)


@pytest.mark.parametrize("budget", [0.0, 0.5, 1.0])
def test_random_ops_bitwise_aot_eager_with_the_pass(reference_aot, budget):
    got = _step_params(_aot_eager_with_pass(), budget)
    _assert_bitwise(got, reference_aot)
    moved = [k for k in reference_aot if not torch.equal(reference_aot[k], Net().state_dict()[k])]
    assert moved  # the step trained


def test_random_ops_bitwise_inductor_replayed(monkeypatch):
    """Budget 0 under inductor: bitwise the step without remat; the draws are recomputed (the pass copied
    them) from the forward's seed lookups, which are not copied."""
    seen: list[list[str]] = []
    run = passes.RematPass.__call__

    def record(self, graph):
        run(self, graph)
        seen.append([n.target.name() for n in graph.nodes if isinstance(n.target, torch._ops.OpOverload)])

    reference = _step_params("inductor", None)
    monkeypatch.setattr(passes.RematPass, "__call__", record)
    got = _step_params("inductor", 0.0)
    _assert_bitwise(got, reference)
    ops = seen[-1]
    draws = ops.count("prims::inductor_random") + ops.count("prims::inductor_randint")
    lookups = ops.count("prims::inductor_lookup_seed")
    # Measured: 7 forward draws, one seed each (the six ops and dropout's, whose decomposition draws with rand
    # under the step's autograd route), and some of them copied for the backward, each from its forward seed.
    assert lookups == 7 and draws > lookups, (lookups, draws)
