"""Parameters materialized where their module uses them (funcamp.nn._use), the layout's hook there, and
functionalize's one return convention.

References: the module's own forward and autograd in float32 (``functionalize(model, "float32")`` must
give the same outputs and gradients bitwise), and the order in which the model's forwards run.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from funcamp import _scope, fp8, quant
from funcamp.nn import Functional, FunctionalWithBuffers, functionalize

MIXED = "params=float32,compute=bfloat16,output=float32"
LOG: list[str] = []


class Logged(nn.Linear):
    """A Linear that logs when its forward starts (after its wrapper has bound its parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        LOG.append(f"forward {self.tag}")
        return super().forward(x)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(16, 8)
        self.fc1, self.fc2 = Logged(8, 8), Logged(8, 8)
        self.fc1.tag, self.fc2.tag = "fc1", "fc2"
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(F.gelu(self.fc1(self.tok(idx)))))


class Recording:
    """A layout whose ``param_at_use`` logs each call and returns the stored tensor times one (differentiable)."""

    def __init__(self) -> None:
        self.stored: dict[str, list[torch.Tensor]] = {}

    def param_at_use(self, name: str, stored: torch.Tensor) -> torch.Tensor:
        LOG.append(f"use {name}")
        self.stored.setdefault(name, []).append(stored)
        return stored * 1 if isinstance(stored, torch.Tensor) else stored  # an Int8Weight as it is


IDX = torch.randint(0, 16, (3, 5), generator=torch.Generator().manual_seed(1))


def test_hook_called_once_per_use_at_the_module_with_the_stored_tensor():
    """Eager: fc2's parameters are asked for after fc1's forward ran (not all up front); the tied weight is
    asked for twice (the embedding's use and the head's), under its first name; the hook gets the very
    tensors of ``params``, and gradients flow through what it returns."""
    apply_fn, params = functionalize(Tied(), MIXED)
    layout = Recording()
    LOG.clear()
    _scope.within(layout, apply_fn, params, IDX)
    assert LOG == [
        "use tok.weight",
        "use fc1.weight",
        "use fc1.bias",
        "forward fc1",
        "use fc2.weight",
        "use fc2.bias",
        "forward fc2",
        "use tok.weight",  # the head's use of the tied weight: a second call, under the master's name
    ]
    assert all(t is params[name] for name, ts in layout.stored.items() for t in ts)
    grads = _scope.within(Recording(), torch.func.grad(lambda p: apply_fn(p, IDX).square().mean()), params)
    plain = torch.func.grad(lambda p: apply_fn(p, IDX).square().mean())(params)
    for name in params:  # stored * 1 is the identity: the same gradients as without a layout
        assert torch.equal(grads[name], plain[name]), name


def test_hook_compiled_is_called_once_per_use_up_front():
    """Compiled (aot_eager): every use is made up front by the same function, once per name."""
    apply_fn, params = functionalize(Tied(), MIXED)
    layout = Recording()
    torch._dynamo.reset()
    fn = torch.compile(lambda p: _scope.within(layout, apply_fn, p, IDX), backend="aot_eager", fullgraph=True)
    LOG.clear()
    out = fn(params)
    uses = [e for e in LOG if e.startswith("use")]
    assert sorted(uses) == sorted(
        ["use tok.weight"] * 2 + [f"use fc{i}.{k}" for i in (1, 2) for k in ("weight", "bias")]
    )
    assert torch.equal(out, apply_fn(params, IDX))


def test_frozen_and_int8_tensors_go_through_the_hook_as_stored():
    model = Tied()
    model.fc1.requires_grad_(False)
    apply_fn, params = functionalize(model, MIXED, quantize=quant.Int8WeightOnlyConfig(targets=["fc1"]))
    layout = Recording()
    LOG.clear()
    out = _scope.within(layout, apply_fn, params, IDX)
    assert layout.stored["fc1.weight"][0] is apply_fn.frozen["fc1.weight"]  # the Int8Weight itself
    assert layout.stored["fc1.bias"][0] is apply_fn.frozen["fc1.bias"]
    assert torch.equal(out, apply_fn(params, IDX))


# --- reads of a submodule's parameters outside its forward ---------------------------------------------


class Reads(nn.Module):
    """``how`` says how the forward reads ``inner.lin``'s weight outside ``inner.lin``'s forward."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.inner = nn.Module()
        self.inner.lin = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.inner.lin.weight.T

    def forward(me, x: torch.Tensor) -> torch.Tensor:  # noqa: N805 (the first argument need not be "self")
        h = me.inner.lin(x)  # its own use first: the read below comes after its forward has returned
        if me.how == "attribute":
            w = me.inner.lin.weight
        elif me.how == "getattr":
            w = getattr(me.inner.lin, "weight")  # noqa: B009
        elif me.how == "method":
            return me.logits(h)
        elif me.how == "passed":
            return _logits(h, me.inner.lin)
        elif me.how == "helper given the model":
            return h @ _weight_of_lin(me).T
        elif me.how == "computed name":
            w = getattr(me.inner.lin, "".join(["wei", "ght"]))
        elif me.how == "parameters":
            w = next(iter(me.inner.lin.parameters()))
        elif me.how == "index":
            return h @ me.blocks[1].weight.T
        elif me.how == "computed index":
            i = len(me.blocks) - 1
            return h @ me.blocks[i].weight.T
        return h @ w.T


def _logits(h: torch.Tensor, lin: nn.Module) -> torch.Tensor:
    return h @ lin.weight.T


def _weight_of_lin(model: nn.Module) -> torch.Tensor:
    return model.inner.lin.weight


READS = [
    "attribute",
    "getattr",
    "computed name",
    "method",
    "passed",
    "helper given the model",
    "parameters",
    "index",
    "computed index",
]


@pytest.mark.parametrize("how", READS)
def test_reads_outside_the_holders_forward_see_the_parameter(how):
    """Sweep: ways of reading a submodule's parameter outside that submodule's forward (after its forward
    returned and put its placeholder back). The placeholder makes the use at the first torch operation on
    it; outputs and gradients equal the module's own (float32) bitwise. A plain ``meta`` placeholder would
    give uninitialised values for the matmuls here (on the CPU ``x @ meta_tensor`` returns a CPU tensor)."""
    model = Reads(how)
    apply_fn, params = functionalize(model, "float32")
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    out = apply_fn(params, x)
    assert torch.equal(out, model(x))
    grads = torch.func.grad(lambda p: apply_fn(p, x).square().sum())(params)
    model.zero_grad()
    model(x).square().sum().backward()
    for name, p in model.named_parameters():
        expected = p.grad if p.grad is not None else torch.zeros_like(p)
        assert torch.equal(grads[name], expected), name


def test_a_read_outside_the_holder_is_made_where_it_is_used():
    """The head reads fc2's weight without calling fc2: the use is made at that read, after fc1 ran."""

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = Logged(8, 8), Logged(8, 8)
            self.fc1.tag, self.fc2.tag = "fc1", "fc2"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc1(x)
            LOG.append("read fc2.weight")
            return h @ self.fc2.weight.T

    apply_fn, params = functionalize(Head(), MIXED)
    LOG.clear()
    out = _scope.within(Recording(), apply_fn, params, torch.randn(2, 8))
    assert LOG == ["use fc1.weight", "use fc1.bias", "forward fc1", "read fc2.weight", "use fc2.weight"]
    assert out.dtype == torch.float32


def test_parameters_metadata_is_the_forward_dtype():
    """A model reading ``next(self.parameters()).dtype`` (Hugging Face's ``self.dtype``) sees the dtype the
    tensor enters the forward in, as when every tensor was bound up front."""

    class DtypeReader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x.to(next(self.parameters()).dtype))

    apply_fn, params = functionalize(DtypeReader(), "params=float32,compute=bfloat16,output=bfloat16")
    assert apply_fn(params, torch.randn(2, 4)).dtype == torch.bfloat16


def test_module_run_twice_uses_one_forward_tensor():
    """A block applied twice in one forward: the hook is asked once (the use is made once per call), so the
    gradients of the two uses add in the compute dtype, as when every tensor was made up front."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = Logged(8, 8)
            self.fc1.tag = "fc1"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc1(self.fc1(x))

    apply_fn, params = functionalize(Twice(), MIXED)
    LOG.clear()
    _scope.within(Recording(), apply_fn, params, torch.randn(2, 8))
    assert LOG == ["use fc1.weight", "use fc1.bias", "forward fc1", "forward fc1"]


# --- one return convention ----------------------------------------------------------------------------------


def _models():
    yield "Linear", lambda: nn.Linear(4, 4)
    yield "BatchNorm", lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    yield "fp8 delayed", lambda: fp8.convert(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), "delayed", filter="*")


@pytest.mark.parametrize("with_buffers", [True, False])
@pytest.mark.parametrize("name, make", list(_models()), ids=[n for n, _ in _models()])
def test_the_number_of_values_follows_the_arguments(name, make, with_buffers):
    """Sweep: a model with buffers, one without, and one with fp8 state give the same arity for the same
    arguments, with no warning; the values are named tuples."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = functionalize(make(), "float32", with_buffers=with_buffers)
    assert type(out) is (FunctionalWithBuffers if with_buffers else Functional)
    assert len(out) == (3 if with_buffers else 2)
    assert out.apply_fn is out[0] and out.params is out[1]
    if with_buffers:
        assert out.buffers is out[2] and (out.buffers == {}) == (name == "Linear")


def test_with_buffers_left_out_on_a_model_with_buffers_warns_and_keeps_three_values():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.warns(FutureWarning, match=r"Sequential has persistent buffers .*pass with_buffers=True"):
        apply_fn, params, buffers = functionalize(model, "float32")
    assert sorted(buffers) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(functionalize(nn.Linear(4, 4), "float32")) == 2  # no buffers: no warning, two values


def test_with_buffers_must_be_a_bool():
    with pytest.raises(TypeError, match="with_buffers must be None, True or False, got 'yes'"):
        functionalize(nn.Linear(4, 4), "float32", with_buffers="yes")
