"""Every way a parameter reaches an op inside ``apply_fn``, against torch itself (issue 40, item 1).

``functionalize``'s module copy holds a placeholder in each parameter slot, made into the parameter's forward
tensor where it is used (funcamp.nn._use). A use that skipped that binding trained silently wrong: a custom
``torch.autograd.Function`` applied to a submodule's parameter from outside that submodule's own call (a
straight-through estimator on ``self.lin.weight`` written in the parent's forward, as QAT code does) got the
placeholder itself (``Function.apply`` does not call ``__torch_function__`` for its inputs) and the eager step
gave that parameter a zero gradient; a first read under ``no_grad`` (or inside a Function's forward) made a
use without autograd history that later uses took again, so in a half compute dtype those gradients were lost.

The sweep: for each way (a Function from the parent, a grandchild, by keyword, with two inputs, through
``parameters()``, ``named_parameters()``, ``_parameters``, a helper, a closure, a hook; a ``torch.library``
custom op; ``torch.utils.checkpoint`` reentrant and not; a first read under ``no_grad``, under
``inference_mode`` and inside a Function's forward; ``remat=`` around the reader), one SGD step of
``make_train_step(compile=False)`` and of the compiled step (aot_eager) gives each parameter the gradient
torch's own autograd gives the original module (``loss.backward()``): float32, and float32 masters with
bfloat16 compute against the module cast to bfloat16. Each Function's backward differs from its forward's
derivative (a rounding's identity backward, a tripled weight gradient), so a forward differentiated in its
place, or a gradient dropped, shows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import funcamp as fa
from funcamp import optim
from funcamp.nn import functionalize


class STE(torch.autograd.Function):
    """Round to 1/8 forward; the identity backward (the rounding's own derivative is 0)."""

    @staticmethod
    def forward(ctx, w):
        return torch.round(w * 8) / 8

    @staticmethod
    def backward(ctx, g):
        return g


class KeywordSTE(torch.autograd.Function):
    """:class:`STE` with the step a keyword (``apply(w=..., k=...)``: the setup_context form)."""

    @staticmethod
    def forward(w, k=8.0):
        return torch.round(w * k) / k

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g, None


class TripleMatmul(torch.autograd.Function):
    """``x @ w.T``; the weight's gradient tripled (not the forward's derivative), the input's as usual."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, 3.0 * (g.t() @ x)


class Peek(torch.autograd.Function):
    """The identity on ``x`` (plus zero times ``module.weight``'s sum: its forward reads the weight, a first read
    with gradients off); the identity backward."""

    @staticmethod
    def forward(ctx, x, module):
        return x + 0.0 * module.weight.sum()

    @staticmethod
    def backward(ctx, g):
        return g, None


@torch.library.custom_op("funcamp_tests::round_ste", mutates_args=())
def round_ste(w: torch.Tensor) -> torch.Tensor:
    return torch.round(w * 8) / 8


round_ste.register_fake(lambda w: torch.empty_like(w))
round_ste.register_autograd(lambda ctx, g: g)


#: ``Inner(ALL)``: every way at once, their outputs summed (the compiled check: one compile per policy).
ALL = "all"


def _ste_linear(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, STE.apply(lin.weight), lin.bias)


class Inner(nn.Module):
    """``lin`` and ``block.lin`` (4 -> 3); ``how`` says how the forward reaches a parameter of one of them."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.lin = nn.Linear(4, 3)
        self.block = nn.Module()
        self.block.lin = nn.Linear(4, 3)
        lin = self.lin
        self.closure = lambda x: F.linear(x, STE.apply(lin.weight), lin.bias)
        if how in ("function in the parent's pre-hook", ALL):
            self.register_forward_pre_hook(lambda m, args: (args[0] * (1 + STE.apply(m.lin.weight).mean()),))
        if how in ("function in a sibling's forward hook", ALL):
            self.block.lin.register_forward_hook(lambda m, args, out: out + STE.apply(lin.weight).sum(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == ALL:
            return sum(self.way(how, x) for how in WAYS)
        return self.way(self.how, x)

    def way(self, how: str, x: torch.Tensor) -> torch.Tensor:  # noqa: C901 (one branch per way)
        lin = self.lin
        if how in ("function from the parent", "remat around the parent"):
            return F.linear(x, STE.apply(self.lin.weight), self.lin.bias)
        if how == "function on a grandchild's parameter":
            return F.linear(x, STE.apply(self.block.lin.weight), self.block.lin.bias)
        if how == "function after the holder ran":
            return lin(x) + F.linear(x, STE.apply(lin.weight))
        if how == "function by keyword":
            return F.linear(x, KeywordSTE.apply(w=lin.weight, k=8.0), lin.bias)
        if how == "function with two inputs":
            return TripleMatmul.apply(x, lin.weight) + lin.bias
        if how == "function through parameters()":
            w, b = lin.parameters()
            return F.linear(x, STE.apply(w), b)
        if how == "function through named_parameters()":
            named = dict(self.named_parameters())
            return F.linear(x, STE.apply(named["lin.weight"]), named["lin.bias"])
        if how == "function through _parameters":
            return F.linear(x, STE.apply(lin._parameters["weight"]), lin._parameters["bias"])
        if how == "function in a helper given the module":
            return _ste_linear(lin, x)
        if how == "function in a closure over the module":
            return self.closure(x)
        if how in ("function in the parent's pre-hook", "function in a sibling's forward hook"):
            return self.block.lin(x)
        if how == "custom op from the parent":
            return F.linear(x, round_ste(lin.weight), lin.bias)
        if how == "checkpoint of a function from the parent":
            return checkpoint(lambda x: F.linear(x, STE.apply(lin.weight), lin.bias), x, use_reentrant=False)
        if how == "reentrant checkpoint of a function from the parent":
            return checkpoint(lambda x: F.linear(x, STE.apply(lin.weight), lin.bias), x, use_reentrant=True)
        if how == "first read under no_grad":
            with torch.no_grad():
                s = lin.weight.abs().mean()
            return lin(x) * (1 + s)
        if how == "first read under inference_mode":
            with torch.inference_mode():
                s = lin.weight.abs().mean()
            return lin(x) * (1 + s.clone())
        if how == "first read in a function's forward":
            return lin(Peek.apply(x, lin))
        raise ValueError(how)


WAYS = [
    "function from the parent",
    "function on a grandchild's parameter",
    "function after the holder ran",
    "function by keyword",
    "function with two inputs",
    "function through parameters()",
    "function through named_parameters()",
    "function through _parameters",
    "function in a helper given the module",
    "function in a closure over the module",
    "function in the parent's pre-hook",
    "function in a sibling's forward hook",
    "custom op from the parent",
    "checkpoint of a function from the parent",
    "reentrant checkpoint of a function from the parent",
    "first read under no_grad",
    "first read under inference_mode",
    "first read in a function's forward",
    "remat around the parent",
]


class Case(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = Inner(how)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inner(x)))


X = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
POLICIES = {"float32": torch.float32, "params=float32,compute=bfloat16,output=float32": torch.bfloat16}
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-3)}


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _torch_grads(how: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """torch's own gradients of the original module (cast to ``dtype``, as the policy computes), in float32. The
    input requires grad: torch's reentrant checkpoint gives no parameter gradients otherwise (its known pitfall,
    which funcamp avoids by running it as the non-reentrant one)."""
    model = Case(how).to(dtype)
    _loss(model(X.to(dtype, copy=True).requires_grad_())).backward()
    return {n: torch.zeros(p.shape) if p.grad is None else p.grad.float() for n, p in model.named_parameters()}


def _step_grads(how: str, policy: str, backend: str | None) -> dict[str, torch.Tensor]:
    """The gradient one SGD step (learning rate 1) of ``make_train_step`` applies to each parameter."""
    remat = "inner" if how in ("remat around the parent", ALL) else None
    apply_fn, params = functionalize(Case(how), policy, remat=remat)
    opt = optim.sgd(1.0)
    state = fa.TrainState.create(params, opt)
    loss_fn = lambda p, x: _loss(apply_fn(p, x))  # noqa: E731
    step = (
        fa.make_train_step(loss_fn, opt, compile=False)
        if backend is None
        else fa.make_train_step(loss_fn, opt, backend=backend)
    )
    new, _ = step(state, X)
    return {n: params[n] - new.params[n] for n in params}


def _check(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    assert expected["inner.lin.weight"].abs().max() > 0 or expected["inner.block.lin.weight"].abs().max() > 0
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, **TOLERANCE[dtype], msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("policy", list(POLICIES), ids=["float32", "bf16_compute"])
@pytest.mark.parametrize("how", WAYS)
def test_eager_step_gives_torchs_gradient(how, policy):
    """Each way alone, eagerly: the holder of the parameter is not called before the read (unless the way says
    so), which is where the old code handed the placeholder on."""
    _check(_step_grads(how, policy, None), _torch_grads(how, POLICIES[policy]), POLICIES[policy])


def test_compiled_step_gives_torchs_gradient():
    """Every way at once (their outputs summed), compiled with aot_eager, float32 masters and bfloat16 compute
    (the casts in between): a dropped or wrong gradient of any way changes the sum. The compiled step binds every
    parameter before the forward (funcamp.nn._use), so the order of the reads does not matter there; remat= is on
    the module that reads (a tagged region under compile). One compile: float32 Functions on parameters
    themselves, compiled, are tests/test_custom_function.py's."""
    policy = "params=float32,compute=bfloat16,output=float32"
    _check(_step_grads(ALL, policy, "aot_eager"), _torch_grads(ALL, POLICIES[policy]), POLICIES[policy])
