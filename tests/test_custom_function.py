"""A user's own ``torch.autograd.Function`` trains compiled as it trains eagerly (issue 35, item 1).

torch 2.13's ``torch.compile(torch.func.grad(f))`` differentiates the *forward* of a custom Function applied to a
differentiated input itself, silently. The compiled step differentiates with Dynamo-traced
``torch.autograd.grad`` instead (:mod:`funcamp._dynamo_autograd`). Each case trains one small model for two
SGD steps, compiled (aot_eager, bitwise; one inductor case, to float32 round-off) and eagerly, from the same
state, and compares every parameter. The model holds, at once: a straight-through rounding and a gradient
reversal on a parameter, a gradient reversal on an activation, a linear Function with saved tensors whose backward reads
``ctx.needs_input_grad``, and a Function with a non-differentiable output (``mark_non_differentiable``). Each
backward differs from its forward's derivative, so a forward differentiated in its place shows.

Policies: float32 (the parameters reach the Functions uncast: where torch.func's compiled grad goes wrong),
bfloat16 parameters and compute (uncast too), float32 masters with bfloat16 compute (a cast in between), a
frozen layer (``needs_input_grad`` False for its weight) and the same layer stored in int8. Also: the old route
planted back gets the parameter-position leaves wrong (what these tests guard against); a Function Dynamo cannot
trace is refused with its name; ``torch.utils.checkpoint`` with dropout inside the model trains as before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import funcamp as fa
from funcamp import _dynamo_autograd, grad, optim
from funcamp.nn import RematInactiveWarning, functionalize
from funcamp.quant import Int8WeightOnlyConfig


class StraightThrough(torch.autograd.Function):
    """Round to 1/8 forward; the identity backward (quantization-aware training's estimator)."""

    @staticmethod
    def forward(ctx, w):
        return torch.round(w * 8) / 8

    @staticmethod
    def backward(ctx, g):
        return g


class Reverse(torch.autograd.Function):
    """The identity forward; ``-lam * g`` backward (gradient reversal, Ganin & Lempitsky 2015)."""

    @staticmethod
    def forward(x, lam):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.lam = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return -ctx.lam * g, None


class ScaledLinear(torch.autograd.Function):
    """``x @ w.T + b``; a backward from saved tensors that scales the input's gradient by 3 where the weight
    needs a gradient and by 5 where it does not, and the weight's by 2: the same ``needs_input_grad`` compiled
    and eager, or the gradients differ."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        k = 3.0 if ctx.needs_input_grad[1] else 5.0
        gx = k * (g @ w) if ctx.needs_input_grad[0] else None
        gw = 2.0 * (g.t() @ x) if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.needs_input_grad[2] else None
        return gx, gw, gb


class Tagged(torch.autograd.Function):
    """``(2 * h, argmax(h))``: the index is non-differentiable; the backward is ``0.5 * g`` (not the forward's 2)."""

    @staticmethod
    def forward(ctx, h):
        idx = h.argmax(-1)
        ctx.mark_non_differentiable(idx)
        return 2 * h, idx

    @staticmethod
    def backward(ctx, g, _):
        return 0.5 * g


class QATLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, StraightThrough.apply(self.weight), Reverse.apply(self.bias, 0.5))


class CustomLinear(nn.Linear):
    def forward(self, x):
        return ScaledLinear.apply(x, self.weight, self.bias)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qat = QATLinear(6, 8)
        self.custom = CustomLinear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = Reverse.apply(torch.tanh(self.qat(x)), 2.0)  # a reversal on an activation
        h, idx = Tagged.apply(self.custom(h))
        return self.head(h) + h.gather(-1, idx[:, None])


POLICIES = {
    # A parameter dict and torch.func.functional_call, the policy's casts by hand: under float32, and under
    # bfloat16 parameters and compute, the Functions get the parameters themselves.
    "float32": dict(policy="float32"),
    "bf16": dict(policy="params=bfloat16,compute=bfloat16,output=float32"),
    "f32_bf16_compute": dict(policy="params=float32,compute=bfloat16,output=float32"),
    # funcamp.nn.functionalize (which hands each use a tensor of its own, so torch.func's route was right here)
    "module_float32": dict(policy="float32", module=True),
    "frozen": dict(policy="float32", module=True, frozen=True),
    "int8": dict(policy="params=float32,compute=bfloat16,output=float32", module=True, frozen=True, int8=True),
}
#: The leaves whose gradient runs through a Function applied to the parameter itself.
AT_PARAMETER = {"qat.weight", "qat.bias", "custom.weight", "custom.bias"}


def _batches():
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(8, 6, generator=g), "y": torch.randint(0, 3, (8,), generator=g)} for _ in range(2)]


def _train(name: str, backend: str | None):
    case = POLICIES[name]
    model = Net()
    if case.get("module"):
        if case.get("frozen"):
            model.custom.requires_grad_(False)
        kwargs = {"quantize": Int8WeightOnlyConfig(targets="custom")} if case.get("int8") else {}
        apply_fn, params = functionalize(model, case["policy"], **kwargs)
    else:
        policy = fa.get_policy(case["policy"])
        params = policy.cast_to_param({k: v.detach().clone() for k, v in model.named_parameters()})

        def apply_fn(p, x):
            out = torch.func.functional_call(model, policy.cast_to_compute(p), (policy.cast_to_compute(x),))
            return policy.cast_to_output(out)

    def loss_fn(p, batch):
        return F.cross_entropy(apply_fn(p, batch["x"]).float(), batch["y"])

    opt = optim.sgd(0.5)
    torch._dynamo.reset()
    step = fa.make_train_step(loss_fn, opt, compile=backend is not None, backend=backend)
    state = fa.TrainState.create(params, opt)
    for batch in _batches():
        state, metrics = step(state, batch)
        assert bool(metrics["grads_finite"])
    return params, state.params


def _tolerance(params):
    bf16 = any(p.dtype == torch.bfloat16 for p in params.values())
    return dict(atol=1e-2, rtol=1e-2) if bf16 else dict(atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def eager():
    return {name: _train(name, None) for name in POLICIES}


@pytest.mark.parametrize("name", list(POLICIES))
def test_compiled_step_uses_each_functions_backward(name, eager):
    start, expected = eager[name]
    _, got = _train(name, "aot_eager")
    assert got.keys() == expected.keys()
    for k in expected:
        assert not torch.equal(expected[k], start[k]), k  # it trained
        assert got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]), (name, k)  # aot_eager: bitwise
    if name == "frozen":
        assert "custom.weight" not in got  # needs_input_grad[1] was False: the input's gradient took k=5


def test_compiled_step_inductor(eager):
    start, expected = eager["float32"]
    _, got = _train("float32", "inductor")
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], **_tolerance(start), msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("name", ["float32", "bf16"])
def test_torch_func_route_compiled_drops_the_backward_at_parameters(name, eager, monkeypatch):
    """The fault guarded against: the step compiled on torch.func's route (planted back here) trains the
    parameter-position leaves on their forward's derivative. If this fails, torch now honours
    the backward there (pytorch/pytorch#193279): the route may be reconsidered."""
    monkeypatch.setattr(_dynamo_autograd, "route", grad._func_route)
    start, expected = eager[name]
    _, got = _train(name, "aot_eager")
    wrong = {k for k in expected if not torch.allclose(got[k], expected[k], **_tolerance(start))}
    assert AT_PARAMETER <= wrong, wrong


class PrintingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return w.clone()

    @staticmethod
    def backward(ctx, g):
        print("backward")  # host work: Dynamo cannot trace it
        return 2 * g


class ItemBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return w.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float(g.abs().max().item() > 0) * 2  # a host sync: Dynamo cannot trace it


@pytest.mark.parametrize(
    "function, note",
    [
        (PrintingBackward, "the torch.autograd.Function PrintingBackward.backward ("),
        (ItemBackward, "failed while tracing the backward of the loss"),
    ],
)
def test_a_function_dynamo_cannot_trace_is_refused_with_a_note(function, note, capsys):
    """Refused loudly (fullgraph), with a note naming the Function where Dynamo names the operator; the eager
    step uses the backward. Without funcamp's note, neither message mentions a Function (the .item() one)."""
    params = {"w": torch.ones(3)}

    def loss_fn(p, batch):
        return (function.apply(p["w"]) * batch).sum()

    torch._dynamo.reset()
    step = fa.make_train_step(loss_fn, optim.sgd(0.1), backend="aot_eager")
    state = fa.TrainState.create(params, optim.sgd(0.1))
    with pytest.raises(torch._dynamo.exc.TorchDynamoException) as info:
        step(state, torch.ones(3))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert note in notes and "make_train_step(..., compile=False)" in notes, notes
    eager_state, _ = fa.make_train_step(loss_fn, optim.sgd(0.1), compile=False)(state, torch.ones(3))
    assert torch.equal(eager_state.params["w"], torch.full((3,), 0.8))  # eagerly its backward (2 * g) runs


class CheckpointedNet(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 16)
        self.block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.head(h + checkpoint(self.block, h, use_reentrant=False))


def _train_checkpointed(dropout: float, backend: str | None, route=None, monkeypatch=None):
    if route is not None:
        monkeypatch.setattr(_dynamo_autograd, "route", route)
    apply_fn, params = functionalize(CheckpointedNet(dropout), "float32")

    def loss_fn(p, batch):
        return F.cross_entropy(apply_fn(p, batch["x"]), batch["y"])

    opt = optim.sgd(0.5)
    torch._dynamo.reset()
    step = fa.make_train_step(loss_fn, opt, compile=backend is not None, backend=backend)
    state = fa.TrainState.create(params, opt)
    torch.manual_seed(5)
    for batch in _batches():
        state, _ = step(state, batch)
    return params, state.params


def test_user_checkpoint_trains_as_eager():
    """torch.utils.checkpoint inside the model: the compiled step equals the eager one (no dropout)."""
    start, expected = _train_checkpointed(0.0, None)
    _, got = _train_checkpointed(0.0, "aot_eager")
    for k in expected:
        assert not torch.equal(expected[k], start[k]), k
        torch.testing.assert_close(got[k], expected[k], atol=1e-6, rtol=1e-5)


def test_user_checkpoint_with_dropout_trains_as_before(monkeypatch):
    """With dropout: the same parameters, bitwise, as the step compiled on torch.func's route (the same
    draws in the same order). AOTAutograd's own recompute of checkpoint regions, which refuses dropout in a
    graph with a traced torch.autograd.grad, stays off in the step (planted on: "does not support RNG ops in
    recompute regions")."""
    start, new = _train_checkpointed(0.5, "aot_eager")
    from funcamp.nn import _remat

    _remat._warned = False  # said once a process: another test in this process may have made it say so
    with pytest.warns(RematInactiveWarning):  # torch.func's route: torch.utils.checkpoint cannot recompute there
        _, old = _train_checkpointed(0.5, "aot_eager", grad._func_route, monkeypatch)
    for k in new:
        assert torch.equal(new[k], old[k]), k
        assert not torch.equal(new[k], start[k]), k
