"""Issue 26, items 1, 2 (fp8 part) and 9: delayed scaling's first call, scales of tiny amaxes, state under remat.

Item 1: a delayed-recipe layer whose amax history holds no amax (its first call) casts with the scale
of its current amax, as tensorwise does; before, it cast with scale 1 (TransformerEngine's start), which
saturates inputs of ~1000 and flushes inputs of ~1e-3. Item 2: every scale (``amax_to_scale``, the
delayed update, the casts' inverse scales) is finite and exact for zero, subnormal and tiny amaxes; the
oracle is float64 arithmetic with the fp8 formats' own rounding bound, not the code's scale rule.
Item 9: a layer run several times in one forward, recomputed under ``remat=``, casts each recompute with
the scales its call used, so that gradients and recipe state equal the run without remat bit for bit.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import funcamp as fa
from funcamp import fp8, optim
from funcamp.formats import get_format

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise", "delayed")


def normwise(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


# --- item 1: the first call of a delayed layer ------------------------------------------------------------


def _first_call(recipe: str, magnitude: float) -> tuple[float, float]:
    """(output, weight-gradient) normwise errors of one call of a fresh Float8Linear(32, 32) on
    ``randn(16, 32) * magnitude`` (seed 0), against float64 ``F.linear`` and ``g.T @ x``."""
    torch.manual_seed(0)
    layer = fp8.Float8Linear(32, 32, recipe=recipe)
    x = (torch.randn(16, 32) * magnitude).requires_grad_()
    g = torch.randn(16, 32)
    y = layer(x)
    y.backward(g)
    w, b = layer.weight.detach().double(), layer.bias.detach().double()
    return normwise(y.detach(), F.linear(x.detach().double(), w, b)), normwise(
        layer.weight.grad, g.double().t() @ x.detach().double()
    )


@pytest.mark.parametrize("magnitude", [1000.0, 1e-3])
def test_delayed_first_call_is_as_accurate_as_tensorwise(magnitude) -> None:
    """The issue's values: inputs ~1000 gave a 69.7% output error (every value above 448 saturated; here
    0.697, seed 0) where tensorwise gives 0.036; inputs ~1e-3 gave a weight gradient 70.5% off in the
    issue, 0.499 here (values below 2**-10 flushed). Now both equal tensorwise's (measured: 0.0359 and
    0.0568, the same scales)."""
    delayed, tensorwise = _first_call("delayed", magnitude), _first_call("tensorwise", magnitude)
    assert delayed[0] <= 1.05 * tensorwise[0] + 1e-6 and delayed[0] < 0.05, (delayed, tensorwise)
    assert delayed[1] <= 1.05 * tensorwise[1] + 1e-6 and delayed[1] < 0.08, (delayed, tensorwise)


def test_delayed_first_call_equals_the_emulation_and_later_calls_use_the_state() -> None:
    """First call: cast with ``448 / amax`` of the current input (the scale it then stores); an all-zero
    input leaves the history without an amax, so the next call scales from its own amax again; then the
    stored scale is used (inputs 10x larger saturate, as delayed scaling does)."""
    torch.manual_seed(0)
    layer = fp8.Float8Linear(32, 32, bias=False, recipe="delayed")
    w = layer.weight.detach()
    x = torch.randn(16, 32) * 1000

    def expected(x, sx):
        sw = torch.tensor(448.0) / w.abs().amax()
        return fp8.fp8_linear(x, w, recipe="delayed", scales=(sx, sw))

    assert torch.equal(layer(torch.zeros(16, 32)).detach(), torch.zeros(16, 32))
    assert layer.fp8_amax_history_input.max() == 0 and layer.fp8_scale_input == 1  # no amax seen yet
    first = torch.tensor(448.0) / x.abs().amax()
    assert torch.equal(layer(x).detach(), expected(x, first))
    assert layer.fp8_scale_input == first  # what the first call used is what it stored
    assert torch.equal(layer(x * 10).detach(), expected(x * 10, first))  # the stored scale: saturates
    assert layer.fp8_scale_input == torch.tensor(448.0) / (x * 10).abs().amax()


def test_delayed_first_and_later_calls_are_one_graph() -> None:
    """The choice between the current and the stored scale is a torch.where: a fresh state and a used one
    run the same compiled graph (aot_eager, fullgraph), with eager's numbers."""
    model = fp8.convert(nn.Sequential(nn.Linear(32, 32)), "delayed", filter="*")
    apply_fn, params, buffers = fa.nn.functionalize(
        model, "f32", module_policies=fp8.MODULE_POLICIES, with_buffers=True
    )
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(apply_fn, backend=counter, fullgraph=True)
    x = torch.randn(16, 32) * 1000
    state = buffers
    for _ in range(3):
        out, new = compiled(params, state, x)
        ref, ref_new = apply_fn(params, state, x)
        assert torch.equal(out, ref) and all(torch.equal(new[k], ref_new[k]) for k in new)
        state = new
    assert counter.frame_count == 1


# --- item 2: scales of zero, subnormal and tiny amaxes ------------------------------------------------------

AMAXES = [0.0, 1e-45, 1e-39, 1e-37, 3.7e-37, 1e-30, 1.0, 448.0, 1e30, math.inf]
LOW, HIGH = 2.0**-126, 2.0**126


def _reference_scale(amax: float, fp8_max: float, margin: int = 0, pow2: bool = False) -> float:
    """float64: ``fp8_max / amax / 2**margin`` kept in [2**-126, 2**126], rounded to float32, then
    down to a power of two (by frexp, exactly)."""
    raw = fp8_max / amax / 2.0**margin if amax > 0 else math.inf
    scale = torch.tensor(min(max(raw, LOW), HIGH), dtype=torch.float64).float().item()
    return 2.0 ** (math.frexp(scale)[1] - 1) if pow2 else scale


def _check_scale(scale: torch.Tensor, reference: float, ulps: int = 0) -> None:
    assert scale.dtype == torch.float32 and torch.isfinite(scale).all() and (scale >= LOW).all()
    assert (scale <= HIGH).all() and torch.isfinite(scale.reciprocal()).all() and (scale.reciprocal() > 0).all()
    spacing = math.ulp(reference) * 2**29  # a float32 ulp at the reference
    assert abs(scale.item() - reference) <= ulps * spacing, (scale.item(), reference)


@pytest.mark.parametrize("amax", AMAXES, ids=str)
def test_every_scale_is_finite_and_exact(amax) -> None:
    """amax_to_scale (float64 division, torchao's) equals the float64 reference exactly; the delayed
    update (float32 division, TransformerEngine's) within its one rounding, for margins 0 and 3 and power
    of two rounding; both stay in [2**-126, 2**126] so that the inverse scale is a finite normal float32.
    Before: a zero amax gave 4.48e14 and 1e-30 the same (every value of such a tensor flushed to 0), the
    delayed update gave inf for 1e-37 and below (and 448 / inf = 0 for inf: kept out of the state)."""
    t = torch.tensor(amax)
    if math.isfinite(amax):
        for dtype in (E4M3, E5M2):
            for pow2 in (False, True):
                reference = _reference_scale(amax, get_format(dtype).max, pow2=pow2)
                _check_scale(fp8.amax_to_scale(t, dtype, pow2), reference)
    for margin in (0, 3):
        for pow2 in (False, True):
            recipe = fp8.Recipe("delayed", margin=margin, round_scales_to_power_of_2=pow2)
            state = fp8.update_delayed_state(fp8.init_delayed_state(recipe), t, recipe)
            if not math.isfinite(amax) or amax == 0:  # nothing to learn from: the state stays as it was
                assert state.scale == 1 and state.amax_history.max() == 0
                continue
            _check_scale(state.scale, _reference_scale(amax, 448.0, margin, pow2), ulps=0 if pow2 else 1)


def _pattern(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """float64 values in [1/16, 1] with the largest exactly 1: positive, so products do not cancel."""
    gen = torch.Generator().manual_seed(seed)
    u = 2.0 ** -(torch.rand(shape, generator=gen, dtype=torch.float64) * 4)
    u[0, 0] = 1.0
    return u


def _cast_error(t: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """Per-element bound on ``|dequantized fp8 - t|`` for a cast with the ideal scale ``fp8_max / amax``:
    half an ulp relative (2**-4 e4m3, 2**-3 e5m2) plus half the smallest subnormal at the ideal inverse
    scale ``max(amax / fp8_max, 2**-126)`` (float32's normal range: the scales stop at 2**126); twice that
    where scales are rounded down to powers of two, with one float32 ulp of slack."""
    f = get_format(dtype)
    inverse = max(t.abs().max().item() / f.max, LOW) * (2.0 if pow2 else 1.0 + 2.0**-20)
    return 2.0 ** -(f.mantissa_bits + 1) * t.abs() + f.smallest_subnormal / 2 * inverse


def _product_bound(a, da, b, db) -> torch.Tensor:
    """Bound on ``|fp8 product - a @ b.T|`` (float64, ``a`` (M, K), ``b`` (N, K)): the operands' cast
    errors, float32 accumulation (K + 2 roundings) and the output rounding, and float32's subnormal
    spacing 2**-149 for products and sums under its normal range."""
    k = a.shape[1]
    a, b = a.abs(), b.abs()
    fp8 = da @ b.t() + a @ db.t() + da @ db.t()
    accumulation = (k + 2) * 2.0**-24 * ((a + da) @ (b + db).t())
    subnormal = (k + 2) * 2.0**-149 * (1 + a.max() + b.max())
    return fp8 + accumulation + subnormal


def _operands(which: str, amax: float) -> dict[str, torch.Tensor]:
    """x (16, 32), w (32, 32), g (16, 32) in float32, positive; ``which`` of them has the given amax (an inf
    amax: one inf element)."""
    scale = {"x": 3.0, "w": 0.05, "g": 1e-3}
    shapes = {"x": (16, 32), "w": (32, 32), "g": (16, 32)}
    out = {}
    for i, name in enumerate(scale):
        u = _pattern(shapes[name], seed=i)
        if name == which and math.isfinite(amax):
            out[name] = (u * amax).float()
        else:
            out[name] = (u * scale[name]).float()
            if name == which:
                out[name][3, 5] = math.inf
    return out


REACHES = {"x": ("y", "gw"), "w": ("y", "gx"), "g": ("gx", "gw")}  # the products each operand enters


@pytest.mark.parametrize("amax", AMAXES, ids=str)
@pytest.mark.parametrize("which", ["x", "w", "g"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_layer_is_exact_for_tiny_amaxes(recipe, which, amax) -> None:
    """A Float8Linear's output and both gradients, with one operand (input x, weight w or output gradient
    g) of the given amax, equal float64 products within the fp8 rounding bound of each cast at its ideal
    scale (and float32's own subnormal spacing). The delayed layer is called twice: the first call from
    the current amax, the second with the stored scale. An inf amax makes the result non-finite (the step
    skips) where it enters, and stays out of the delayed state. Before: amaxes of 1e-30 and below cast to zeros (a scale
    floor of 448 / 1e-12) and the delayed recipe's scale for 1e-37 was inf (NaN outputs)."""
    r = fp8.get_recipe(recipe)
    ops = _operands(which, amax)
    layer = fp8.Float8Linear(32, 32, bias=False, recipe=r)
    with torch.no_grad():
        layer.weight.copy_(ops["w"])
    for _ in range(2 if recipe == "delayed" else 1):
        layer.weight.grad = None
        x = ops["x"].clone().requires_grad_()
        y = layer(x)
        y.backward(ops["g"])
        got = {"y": y.detach(), "gx": x.grad, "gw": layer.weight.grad}
        if not math.isfinite(amax):
            assert all(not torch.isfinite(got[k]).all() for k in REACHES[which]), which
            continue
        x64, w64, g64 = (ops[k].double() for k in ("x", "w", "g"))
        pow2, gd = r.round_scales_to_power_of_2, r.grad_dtype
        dx, dw, dg = _cast_error(x64, E4M3, pow2), _cast_error(w64, E4M3, pow2), _cast_error(g64, gd, pow2)
        exact = {"y": x64 @ w64.t(), "gx": g64 @ w64, "gw": g64.t() @ x64}
        bound = {
            "y": _product_bound(x64, dx, w64, dw),
            "gx": _product_bound(g64, dg, w64.t(), dw.t()),
            "gw": _product_bound(g64.t(), dg.t(), x64.t(), dx.t()),
        }
        for k in exact:
            assert got[k].dtype == torch.float32 and torch.isfinite(got[k]).all(), k
            err = (got[k].double() - exact[k]).abs()
            worst = (err / bound[k]).max().item()
            assert worst <= 1, f"{k}: error {worst:.3g} x the bound (largest error {err.max().item():.3g})"
            if amax == 0 and k in REACHES[which]:
                assert (got[k] == 0).all(), k  # exactly zero, no NaN from 0 * inf
    if recipe == "delayed":
        for role in ("input", "weight"):
            state = layer.delayed_state(role)
            assert torch.isfinite(state.amax_history).all() and torch.isfinite(state.scale), role
            assert LOW <= state.scale.item() <= HIGH, role


# --- item 9: the delayed state under remat ----------------------------------------------------------------

FORWARD_CALLS = {"n": 0}


class Counted(fp8.Float8Linear):
    """A Float8Linear that counts its eager forward calls (recomputes included)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            FORWARD_CALLS["n"] += 1
        return super().forward(x)


class Block(nn.Module):
    """An fp8 layer and a GELU."""

    def __init__(self, recipe: str) -> None:
        super().__init__()
        self.fc = Counted(32, 32, recipe=recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class Reused(nn.Module):
    """Three towers in one forward: tower ``i`` applies its one Block ``i`` times (calls 1, 2 and 3 per
    forward, the same layer each time), so one model and one compile cover every count of calls."""

    def __init__(self, recipe: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.towers = nn.ModuleList(Block(recipe) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = []
        for calls, block in enumerate(self.towers, start=1):
            h = x
            for _ in range(calls):
                h = block(h) * 4.0  # the next call sees other amaxes: its scale differs
            out.append(h)
        return torch.stack(out)


REMAT = {"off": None, "block": Block, "layer": Counted}  # a block applied again; a shared layer


@functools.cache
def _train(recipe: str, remat: str, compiled: bool) -> tuple[list, int]:
    """Two SGD steps of Reused (float32, fp8.MODULE_POLICIES): the parameters and buffers after each, and
    the fp8 layers' forward calls in eager steps (twice as many where regions are recomputed)."""
    model = Reused(recipe)
    apply_fn, params, buffers = fa.nn.functionalize(
        model, "f32", module_policies=fp8.MODULE_POLICIES, remat=REMAT[remat], with_buffers=True
    )

    def loss_fn(params, buffers, x):
        out, new = apply_fn(params, buffers, x)
        return out.square().mean(), new

    opt = optim.sgd(0.5)
    state = fa.TrainState.create(params, opt, buffers=buffers)
    if compiled:
        torch._dynamo.reset()  # every run compiles the same step function: start each from an empty cache
    step = fa.make_train_step(loss_fn, opt, compile=compiled, backend="aot_eager")
    FORWARD_CALLS["n"] = 0
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fa.nn.RematInactiveWarning)  # the compiled step keeps activations
        for i in range(2):
            state, _ = step(state, torch.randn(16, 32, generator=torch.Generator().manual_seed(i)))
            out.append((state.params, state.buffers))
    return out, FORWARD_CALLS["n"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("calls", [1, 2, 3])
@pytest.mark.parametrize("remat", ["block", "layer"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_remat_recomputes_each_call_with_its_own_scales(recipe, remat, calls, compiled) -> None:
    """Parameters and recipe state after each of two steps equal those without remat bit for bit, for
    the tower whose layer runs ``calls`` times per forward (towers are independent: each one's gradients
    come from its own output); eager steps really recompute (twice the fp8 layer calls). Before: the
    recompute of a layer's second and third calls cast with the state of the forward's start (wrong
    gradients, no error), and the compiled step raised dynamo's "HOP: Unsafe side effect" for a delayed
    layer in a checkpointed region."""
    ref, ref_calls = _train(recipe, "off", compiled)
    got, got_calls = _train(recipe, remat, compiled)
    if not compiled:
        assert (ref_calls, got_calls) == (2 * 6, 2 * 12)
    tower = f"towers.{calls - 1}."
    for s, ((p0, b0), (p1, b1)) in enumerate(zip(ref, got)):
        for tree0, tree1 in ((p0, p1), (b0, b1)):
            for k in tree0:
                if k.startswith(tower):
                    assert torch.equal(tree0[k], tree1[k]), (s, k)
    if recipe == "delayed":  # the state advanced once per call: `calls` amaxes per step
        history = ref[-1][1][f"{tower}fc.fp8_amax_history_input"]
        assert (history[: 2 * calls] > 0).all() and (history[2 * calls :] == 0).all()


class Counter(nn.Module):
    """Scales its input by a count it advances in place at each call (a buffer written, not reassigned)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("count", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1.0)
        return self.lin(x) * self.count.clone()  # a copy for autograd: the next call writes the buffer again


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.counter = Counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.counter(self.counter(x))


def test_remat_recompute_sees_buffers_written_in_place() -> None:
    """The same rule for a buffer written in place: the recompute of the second call multiplies by the
    count that call saw (3), not the count at the forward's start (2); gradients and the new buffer
    equal the run without remat bit for bit (the recompute's own writes land in copies)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    results = []
    for remat in (None, Counter):
        apply_fn, params, buffers = fa.nn.functionalize(Twice(), "f32", remat=remat, with_buffers=True)

        def loss(p, b=buffers, f=apply_fn):
            out, new = f(p, b, x)
            return out.square().sum(), new

        grads, (_, new), _ = fa.grad_and_value(loss, fa.NoOpLossScale(), has_aux=True)(params)
        results.append((grads, new))
    (g0, b0), (g1, b1) = results
    assert b0["counter.count"] == b1["counter.count"] == 3
    assert all(torch.equal(g0[k], g1[k]) for k in g0)


class Mixed(nn.Module):
    """Reassigns its count at the first call and writes it in place at the second (both read it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("count", torch.ones(()))

    def forward(self, x: torch.Tensor, reassign: bool) -> torch.Tensor:
        if reassign:
            self.count = self.count + 1.0
        else:
            self.count.add_(1.0)
        return self.lin(x) * self.count.clone()


class MixedTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixed = Mixed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mixed(self.mixed(x, True), False)


def test_remat_refuses_a_buffer_reassigned_then_written_in_place() -> None:
    """The one case the recompute cannot replay (the value a region saw is gone) is an error naming the
    buffer and the fix, not a wrong gradient."""
    apply_fn, params, buffers = fa.nn.functionalize(MixedTwice(), "f32", remat=Mixed, with_buffers=True)

    def loss(p):
        out, new = apply_fn(p, buffers, torch.ones(2, 8))
        return out.sum(), new

    with pytest.raises(RuntimeError, match="'mixed.count' was reassigned in the forward before a checkpointed"):
        fa.grad_and_value(loss, fa.NoOpLossScale(), has_aux=True)(params)
