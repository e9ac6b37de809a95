"""The train state never carries autograd history (issue 47, classes 5 and 6).

A state built from parameters that require grad (``dict(model.named_parameters())``, which
``TrainState.create`` accepts) made the eager step chain every step's autograd graph onto the state (84 more
nodes a step) and the compiled step fail inside torch ("returning intermediate with requires_grad_()") wherever
it runs leaf by leaf (telemetry, a transform of one's own). ``TrainState.create`` now takes such tensors as
``detach()``; a state built by hand with one is refused at the step's first call.
"""

import pytest
import torch

import funcamp as fa
from funcamp import _tree, optim


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def loss_fn(p, batch):
    h = torch.tanh(batch["x"] @ p["0.weight"].T + p["0.bias"])
    return ((h @ p["2.weight"].T + p["2.bias"] - batch["y"]) ** 2).mean()


def _batches():
    g = torch.Generator().manual_seed(7)
    return [{"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 1, generator=g)} for _ in range(3)]


def _own_transform():
    """A transform of one's own (the step runs it leaf by leaf): the updates halved."""
    return optim.GradientTransformation(
        lambda params: (), lambda u, s, p=None: (_tree.tree_map(lambda g: g * 0.5, u), s)
    )


def _no_history(tree, where):
    for path, leaf in zip(_tree.tree_paths(tree), _tree.tree_leaves(tree)):
        if isinstance(leaf, torch.Tensor):
            assert not leaf.requires_grad and leaf.grad_fn is None, f"{where}: {path} carries autograd history"


@pytest.mark.parametrize("mode", ["plain", "telemetry", "own transform"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_parameters_that_require_grad_train_without_history(compiled, mode):
    """Before the fix: eager, every new leaf had a grad_fn; compiled (telemetry, own transform), torch's
    ``Unsupported: returning intermediate with requires_grad_()``."""
    opt = optim.adam(1e-2)
    if mode == "own transform":
        opt = optim.chain(_own_transform(), opt)
    model = _model()
    start = {k: p.detach().clone() for k, p in model.named_parameters()}
    state = fa.TrainState.create(dict(model.named_parameters()), opt)
    reference = fa.TrainState.create({k: p.clone() for k, p in start.items()}, opt)
    created = state
    kw = {"compile": compiled, "backend": "aot_eager", "telemetry": 1 if mode == "telemetry" else None}
    step = fa.make_train_step(loss_fn, opt, **kw)  # one step for both states: one compile
    for batch in _batches():
        state, metrics = step(state, batch)
        reference, _ = step(reference, batch)
        _no_history(state, "new state")
        _no_history(metrics, "metrics")
    _no_history(created, "created")
    for k in start:  # the same numbers as from detached copies; the module is not trained by a pure step
        assert torch.equal(state.params[k], reference.params[k]), k
        assert torch.equal(model.get_parameter(k).detach(), start[k]), k


def test_create_detaches_keeping_memory(monkeypatch):
    """Kept leaf by leaf, the state holds ``p.detach()`` (the same memory); flat, a copy in its buffers. Either way
    no leaf requires grad."""
    model = _model()
    flat = fa.TrainState.create(dict(model.named_parameters()), optim.sgd(0.1))
    assert flat.storage.kind == "flat" and not any(p.requires_grad for p in flat.params.values())
    assert all(torch.equal(flat.params[k], p) for k, p in model.named_parameters())
    monkeypatch.setenv("FUNCAMP_FLAT", "off")
    state = fa.TrainState.create(
        dict(model.named_parameters()), optim.sgd(0.1), buffers={"b": torch.ones(2, requires_grad=True)}
    )
    for k, p in model.named_parameters():
        held = state.params[k]
        assert type(held) is torch.Tensor and not held.requires_grad
        assert held.data_ptr() == p.data_ptr()  # p.detach(): the same memory, no copy
    assert not state.buffers["b"].requires_grad
    plain = torch.zeros(3)
    assert fa.TrainState.create({"w": plain}, optim.sgd(0.1)).params["w"] is plain  # nothing else is touched


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_state_built_by_hand_with_a_parameter_is_refused(compiled, monkeypatch):
    """Kept leaf by leaf (a flat state copies what ``replace`` gives it into its buffers: no history either)."""
    monkeypatch.setenv("FUNCAMP_FLAT", "off")
    model = _model()
    opt = optim.sgd(0.1)
    state = fa.TrainState.create({k: p.detach().clone() for k, p in model.named_parameters()}, opt)
    by_hand = state.replace(params=dict(model.named_parameters()))
    step = fa.make_train_step(loss_fn, opt, compile=compiled, backend="aot_eager")
    with pytest.raises(TypeError, match=r"state leaf 'params.0.bias' requires grad .*TrainState.create"):
        step(by_hand, _batches()[0])
