"""``functionalize`` runs the module you wrote: callables built in ``__init__`` see the parameters given.

minGPT's ``Block`` stores ``self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))``, a closure over
its ``self.mlp``. ``functionalize`` runs a copy of the module; ``copy.deepcopy`` shares functions, so the
closure ran *your* ``mlp`` with its stored weights: zero gradients for them in float32, without a word,
and a dtype error in bf16. The sweep: closures, nested closures, closures in hooks, bound methods stored
as attributes, ``functools.partial``, registered modules held again in plain lists and dicts, and lambdas
in a list used as a sequence of layers; each compared with ``torch.func.functional_call`` on your module
(which swaps the tensors into the module itself), eager and compiled (aot_eager), float32 and bf16.
What cannot run on the copy (a weakref to a submodule, a parameter held in a plain list, a module with
parameters that is not registered) is refused naming the attribute.

Planted: ``funcamp.nn._copy.copy_structure`` reduced to ``copy.deepcopy(module, memo)`` (the old copy):
every working case but ``bound_method``, ``partial_of_module`` and ``plain_list`` (deepcopy copies those
right) fails, eager and compiled, float32 with all-zero gradients for the weights reached through the
callable and bf16 with a dtype error; the three refusals fail (no error): 19 tests of 27.
"""

from __future__ import annotations

import functools
import types
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcamp as fa

D = 8
F32 = "float32"
MIXED = "params=float32,compute=bfloat16,output=float32"


def _mlp() -> nn.ModuleDict:
    return nn.ModuleDict(
        {"c_fc": nn.Linear(D, 2 * D), "c_proj": nn.Linear(2 * D, D), "act": nn.GELU(), "dropout": nn.Dropout(0.0)}
    )


class MinGPTBlock(nn.Module):
    """minGPT's Block, attention left out: the MLP reached through a lambda over ``self.mlp``."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(D)
        self.mlp = _mlp()
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlpf(self.ln_1(x))


class NestedClosure(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

        def make(first: nn.Module) -> types.FunctionType:
            second = self.b
            return lambda x: second(torch.tanh(first(x)))

        self.f = make(self.a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x)


class HookClosure(nn.Module):
    """A forward hook of ``a`` closing over ``b``: it adds ``b``'s output to ``a``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        b = self.b
        self.a.register_forward_hook(lambda mod, args, out: out + b(args[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def _run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x).relu()


class BoundMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.f = self.a.forward
        self.g = types.MethodType(_run, self.a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x) + self.g(x)


class PartialOfModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.f = functools.partial(_run, self.a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x)


class PartialOfClosure(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        a = self.a
        self.f = functools.partial(lambda x, scale: a(x) * scale, scale=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x)


class PlainList(nn.Module):
    """Registered modules held again in a plain list and a plain dict."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.order = [self.a, self.b]
        self.by_name = {"first": self.a, "second": self.b}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.order:
            x = torch.tanh(layer(x))
        return x + self.by_name["second"](x)


class LambdaSequence(nn.Module):
    """A sequence of callables, as a Sequential of lambdas: closures over ``self`` and a default argument."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.steps = [lambda x: self.a(x), F.gelu, lambda x, b=self.b: b(x)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            x = step(x)
        return x


class KeywordOnlyDefault(nn.Module):
    """A helper whose keyword-only default is a submodule (``def f(x, *, lin=self.a)``), and a lambda's keyword-only
    default next to a positional one."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

        def f(x, *, lin=self.a):
            return torch.tanh(lin(x))

        self.f = f
        self.g = lambda x, scale=0.5, *, lin=self.b: lin(x) * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g(self.f(x))


WORKING = {
    "mingpt_closure": MinGPTBlock,
    "nested_closure": NestedClosure,
    "hook_closure": HookClosure,
    "bound_method": BoundMethod,
    "partial_of_module": PartialOfModule,
    "partial_of_closure": PartialOfClosure,
    "plain_list": PlainList,
    "lambda_sequence": LambdaSequence,
    "keyword_only_default": KeywordOnlyDefault,
}


def _loss(apply: object, params: dict, x: torch.Tensor) -> torch.Tensor:
    return (apply(params, x).float() ** 2).sum()  # type: ignore[operator]


def _reference(model: nn.Module, policy: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of the same loss by ``functional_call`` on your module, with the policy's casts by hand."""
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    half = policy == MIXED

    def apply(p: dict, x: torch.Tensor) -> torch.Tensor:
        if half:  # bf16 copies of every parameter (the norm default is turned off, see _functionalize)
            p = {k: v.to(torch.bfloat16) for k, v in p.items()}
            x = x.to(torch.bfloat16)
        return torch.func.functional_call(model, p, (x,)).float()

    return torch.func.grad(lambda p, x: _loss(apply, p, x))(params, x)


def _functionalize(model: nn.Module, policy: str) -> fa.nn.Functional:
    """LayerNorm computing in the surrounding dtype, as the hand-cast reference does."""
    return fa.nn.functionalize(model, policy, module_policies={nn.LayerNorm: None})


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return WORKING[name]()


@pytest.mark.parametrize("policy", [F32, MIXED])
@pytest.mark.parametrize("name", sorted(WORKING))
def test_gradients_equal_functional_call(name: str, policy: str) -> None:
    model = _model(name)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(1))
    apply_fn, params = _functionalize(model, policy)
    grads = torch.func.grad(lambda p, x: _loss(apply_fn, p, x))(params, x)
    expected = _reference(model, policy, x)
    assert grads.keys() == expected.keys()
    for k in grads:
        assert grads[k].abs().sum() > 0, k  # every weight is reached: none trains with a zero gradient
        assert torch.equal(grads[k], expected[k]), (k, (grads[k] - expected[k]).abs().max())


@pytest.mark.parametrize("policy", [F32, MIXED])
@pytest.mark.parametrize("name", ["mingpt_closure", "partial_of_closure", "lambda_sequence"])
def test_compiled_gradients_equal_functional_call(name: str, policy: str) -> None:
    model = _model(name)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(1))
    apply_fn, params = _functionalize(model, policy)
    grad = torch.compile(torch.func.grad(lambda p, x: _loss(apply_fn, p, x)), backend="aot_eager", fullgraph=True)
    grads, expected = grad(params, x), _reference(model, policy, x)
    for k in expected:
        assert grads[k].abs().sum() > 0, k
        assert torch.equal(grads[k], expected[k]), (k, (grads[k] - expected[k]).abs().max())


def test_the_copy_does_not_change_or_keep_your_module() -> None:
    model = _model("mingpt_closure")
    before = model.mlpf
    apply_fn, _ = fa.nn.functionalize(model, F32)
    assert model.mlpf is before  # your closure is not rebuilt in place
    ref = weakref.ref(model)
    del model
    assert ref() is None  # the copied closure holds the copy's modules, not yours


class WeakRefToSubmodule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.ref = weakref.ref(self.a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ref()(x)


class ParameterInPlainList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.weights = [self.a.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weights[0].T


class UnregisteredModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.extra = {"head": nn.Linear(D, D)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra["head"](self.a(x))


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (WeakRefToSubmodule, r"WeakRefToSubmodule\.ref \(weakref\) reaches your module's submodule"),
        (ParameterInPlainList, r"ParameterInPlainList\.weights\[0\] holds the tensor ParameterInPlainList\.a\.weight"),
        (UnregisteredModule, r"UnregisteredModule\.extra\['head'\] is a Linear .* not registered"),
    ],
)
def test_refused_by_name(cls: type, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        fa.nn.functionalize(cls(), F32)


def test_parameterless_callables_and_rnn_are_accepted() -> None:
    """What needs no copy is shared (a plain function, an activation module in a list); LSTM's own list of its
    weights is kept in step by torch and not refused."""
    model = nn.Module()
    model.lstm = nn.LSTM(D, D)
    model.acts = [nn.GELU()]
    model.fn = F.gelu
    apply_fn, params = fa.nn.functionalize(model, F32)
    assert sorted(params) == sorted(k for k, _ in model.named_parameters())
