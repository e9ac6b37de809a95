"""The block-scaled recipes (mxfp8, nvfp4) against torchao 0.18 on the CPU, and their rules.

torchao is the reference where it runs here: its emulated MXFP8 linear
(``torchao.prototype.moe_training.mxfp8_linear._to_mxfp8_then_scaled_mm(x, w, KernelPreference.EMULATED,
ScaleCalculationMode.FLOOR)``, and RCEIL, and ``wgrad_with_hp``) for the three matmuls, and
``NVFP4Tensor.to_nvfp4`` for NVFP4's cast (torchao's NVFP4 training linear is Triton-only). The inputs span
40 binades (``randn * 2**U[-20, 20)`` per element), so every block has its own scale. Skipped where torchao is
absent, as tests/test_fp8.py's torchao test. The emulation warning is silenced here but in the test of it.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import funcamp as fa
from funcamp import _block_scaling as blocks
from funcamp import fp8, optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::funcamp.fp8.Fp8EmulationWarning")


def spanning(*shape: int, seed: int = 0, binades: int = 20) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-binades, binades, shape, generator=gen).float()
    return torch.randn(*shape, generator=gen) * torch.exp2(exponents)


def three(fn, x, w, g):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    return (y, *torch.autograd.grad(y, (x, w), g))


def assert_close_to_largest(got, ref, tol=1e-5):
    for name, a, b in zip(("output", "grad_input", "grad_weight"), got, ref, strict=True):
        err = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
        assert err <= tol, f"{name}: {err:.3g} of the largest magnitude"


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1"])
def test_element_rounding_is_quantize_to(name):
    """The casts' float32 bit arithmetic rounds every value, midpoint and neighbour of a midpoint as
    :func:`funcamp.formats.quantize_to` (tested against torch's and torchao's casts). Planted: ties away from
    zero (``floor(units + 0.5)``): fails on the midpoints."""
    from funcamp.formats import get_format, quantize_to

    elem = blocks.ELEMENTS[name]
    f = get_format(name)
    grid = torch.unique(quantize_to(torch.linspace(0, f.max, 20001), f))
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9)), grid])
    x = torch.cat([near, -near, torch.randn(5000) * f.max / 4]).clamp(-f.max, f.max)
    got = blocks.round_elements(x, elem)
    assert torch.equal(got.view(torch.int32), quantize_to(x, f).view(torch.int32))


# --- mxfp8 against torchao's emulated MX linear ------------------------------------------------------


@pytest.fixture(scope="module")
def torchao_mx():
    pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    modes = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}

    def linear(x, w, rounding, hp=False):
        return _to_mxfp8_then_scaled_mm(x, w, KernelPreference.EMULATED, modes[rounding], hp)

    return linear


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
@pytest.mark.parametrize("wgrad_with_hp", [False, True])
def test_mxfp8_three_matmuls_equal_torchao_emulated(torchao_mx, rounding, wgrad_with_hp):
    """The target: within 1e-5 of the largest magnitude (measured: 0, bit for bit: the same float32 values
    multiplied by the same ``torch.mm``). Planted: FLOOR with emax 7 instead of 8 (1.0 off), RCEIL without the
    +1 for a mantissa (2**-5 off), the cast without rounding the elements (6e-3 off): each fails."""
    x, w, g = spanning(96, 128, seed=1), spanning(64, 128, seed=2), spanning(96, 64, seed=3)
    recipe = fp8.Recipe("mxfp8", scale_rounding=rounding, wgrad_with_hp=wgrad_with_hp)
    got = three(lambda a, b: fp8.fp8_linear(a, b, recipe=recipe), x, w, g)
    ref = three(lambda a, b: torchao_mx(a, b, rounding, wgrad_with_hp), x, w, g)
    assert_close_to_largest(got, ref)
    plain = three(lambda a, b: a @ b.t(), x, w, g)  # and the quantization is there: far from float32
    assert ((got[0] - plain[0]).abs().max() / plain[0].abs().max()).item() > 1e-3


def test_mxfp8_hybrid_gradients_in_e5m2_equal_torchao(torchao_mx):
    """``fp8_format="HYBRID"``: e5m2 gradient elements (emax 15), torchao's ``mx_mm`` with ``grad_elem_dtype``."""
    from torchao.prototype.moe_training.mxfp8_linear import mx_mm
    from torchao.prototype.mx_formats.config import (
        MXFP8Dim0CastKernelChoice,
        MXFP8Dim1CastKernelChoice,
        ScaleCalculationMode,
    )
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    x, w, g = spanning(64, 64, seed=4), spanning(32, 64, seed=5), spanning(64, 32, seed=6)
    recipe = fp8.Recipe("mxfp8", fp8_format="HYBRID", scale_rounding="floor")
    got = three(lambda a, b: fp8.fp8_linear(a, b, recipe=recipe), x, w, g)
    e4m3, torch_cast = torch.float8_e4m3fn, (MXFP8Dim0CastKernelChoice.TORCH, MXFP8Dim1CastKernelChoice.TORCH)
    args = (e4m3, e4m3, torch.float8_e5m2, 32, KernelPreference.EMULATED, *torch_cast, ScaleCalculationMode.FLOOR)
    ref = three(lambda a, b: mx_mm.apply(a, b, *args, False), x, w, g)
    assert_close_to_largest(got, ref)


def test_mxfp8_token_rows_padded_to_a_block(torchao_mx):
    """M = 40 (not a multiple of 32): the weight gradient pads the tokens with zero rows; torchao refuses the
    shape, and equals funcamp on the zero-padded operands. Planted: no padding (reshape error)."""
    x, w, g = spanning(40, 64, seed=7), spanning(32, 64, seed=8), spanning(40, 32, seed=9)
    got = three(lambda a, b: fp8.fp8_linear(a, b, recipe=fp8.Recipe("mxfp8", scale_rounding="floor")), x, w, g)
    pad = lambda t: torch.cat([t, t.new_zeros(24, t.shape[1])])  # noqa: E731
    ref = three(lambda a, b: torchao_mx(a, b, "floor"), pad(x), w, pad(g))
    assert_close_to_largest(got, (ref[0][:40], ref[1][:40], ref[2]))


def test_mx_cast_rules_bitwise_torchao():
    """The cast alone, over 60 binades, zero blocks included: FLOOR and RCEIL scales, e4m3 and e5m2 elements,
    bitwise torchao's ``to_mx`` then ``to_dtype``."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode as Mode

    x = spanning(32, 256, seed=10, binades=30)
    x[5] = 0.0
    for dtype, elem in ((torch.float8_e4m3fn, "e4m3"), (torch.float8_e5m2, "e5m2")):
        for mode, rounding in ((Mode.FLOOR, "floor"), (Mode.RCEIL, "rceil")):
            scale, data = mx.to_mx(x, dtype, 32, mode)
            ref = mx.to_dtype(data, scale, dtype, 32, torch.float32)
            got = blocks.mx_values(x, elem, rounding)
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (elem, rounding)


def test_rceil_never_saturates_floor_may():
    """A block whose amax is 1.9 * 2**k: FLOOR's scale maps it to 486 > 448 (saturated); RCEIL's keeps it."""
    x = torch.full((1, 32), 0.5)
    x[0, 0] = 1.9
    floor, rceil = blocks.mx_values(x, "e4m3", "floor"), blocks.mx_values(x, "e4m3", "rceil")
    assert floor[0, 0] == 448 * 2.0**-8 and rceil[0, 0] == 1.875  # e4m3's nearest to 1.9 at RCEIL's scale


# --- nvfp4 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tensor_scale", [False, True])
def test_nvfp4_cast_bitwise_torchao(tensor_scale):
    """The target: quantize then dequantize bitwise ``NVFP4Tensor.to_nvfp4(...).dequantize(float32)``, one and
    two-level scaling (torchao's ``per_tensor_amax_to_scale``), blocks of 16 values over 30 binades. Planted:
    the block scale not rounded to e4m3 (each level fails), amax / 4 for amax / 6 (both fail)."""
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, 256, generator=gen) * torch.exp2(torch.randint(-15, 15, (64, 1), generator=gen).float())
    pts = nv.per_tensor_amax_to_scale(x.abs().max()) if tensor_scale else None
    ref = nv.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts).dequantize(torch.float32)
    got = blocks.nvfp4_values(x, blocks.nvfp4_tensor_scale(x) if tensor_scale else None)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


def test_nvfp4_matmuls_equal_torchao_casts():
    """Without stochastic rounding, 2-D weight tiles and the Hadamard transform, each matmul is the float32 product
    of the operands ``to_nvfp4`` casts along its contraction dimension (with their per-tensor scales); with the
    transform, the weight gradient is the product of the casts of the rotated operands."""
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")

    def cast(t):
        t = t.contiguous()
        pts = nv.per_tensor_amax_to_scale(t.abs().max())
        return nv.NVFP4Tensor.to_nvfp4(t, per_tensor_scale=pts).dequantize(torch.float32)

    x, w, g = spanning(48, 64, seed=12, binades=8), spanning(32, 64, seed=13, binades=8), spanning(48, 32, seed=14)
    recipe = fp8.Recipe("nvfp4", stochastic_rounding=False, weight_2d_blocks=False, random_hadamard=False)
    got = three(lambda a, b: fp8.fp8_linear(a, b, recipe=recipe), x, w, g)
    ref = (cast(x) @ cast(w).t(), cast(g) @ cast(w.t()).t(), cast(g.t()) @ cast(x.t()).t())
    assert_close_to_largest(got, ref, tol=1e-6)
    rotated = dataclasses.replace(recipe, random_hadamard=True)
    got = three(lambda a, b: fp8.fp8_linear(a, b, recipe=rotated), x, w, g)
    gt, xt = blocks.hadamard_rows(g.t().contiguous()), blocks.hadamard_rows(x.t().contiguous())
    assert_close_to_largest(got, (*ref[:2], cast(gt) @ cast(xt).t()), tol=1e-6)


def test_hadamard_transform_keeps_the_product_and_is_applied():
    """``hadamard_rows`` is orthogonal per block of 16 (the product of two operands rotated alike is theirs, to
    float32 round-off); the nvfp4 weight gradient with it is another cast of the same product (it differs from the
    one without, and stays within the format's error of the float32 gradient). Planted: the signs applied to one
    operand only: the product changes. (No claim of a smaller error here: on a single huge outlier per block both
    casts lose the block's small values; TransformerEngine's case for it is statistical.)"""
    a, b = spanning(8, 64, seed=20, binades=6), spanning(12, 64, seed=21, binades=6)
    exact = a @ b.t()
    assert (blocks.hadamard_rows(a) @ blocks.hadamard_rows(b).t() - exact).abs().max() <= 1e-5 * exact.abs().max()
    gen = torch.Generator().manual_seed(22)
    x, g, w = (
        torch.randn(256, 64, generator=gen),
        torch.randn(256, 32, generator=gen),
        torch.randn(32, 64, generator=gen),
    )
    grads = {}
    for rotate in (False, True):
        recipe = fp8.Recipe("nvfp4", stochastic_rounding=False, random_hadamard=rotate)
        grads[rotate] = three(lambda p, q, recipe=recipe: fp8.fp8_linear(p, q, recipe=recipe), x, w, g)[2]
    reference = g.t() @ x
    assert not torch.equal(grads[True], grads[False])
    for got in grads.values():
        assert float((got - reference).norm() / reference.norm()) < 0.2  # e2m1: 2 mantissa bits


def test_nvfp4_weight_tiles_cast_the_same_both_ways():
    """With 16 x 16 weight tiles the weight's cast along K (forward) and along N (input gradient) are one."""
    w = spanning(32, 64, seed=15, binades=6)
    tiles = blocks.nvfp4_values(w, blocks.nvfp4_tensor_scale(w), tile=True)
    assert torch.equal(blocks.nvfp4_values(w.t().contiguous(), blocks.nvfp4_tensor_scale(w), tile=True), tiles.t())
    rows = blocks.nvfp4_values(w, blocks.nvfp4_tensor_scale(w))
    assert not torch.equal(rows.t(), blocks.nvfp4_values(w.t().contiguous(), blocks.nvfp4_tensor_scale(w)))


def test_stochastic_rounding_is_unbiased_and_draws_from_the_default_generator():
    """Each draw is one of the two e2m1 neighbours; the mean of 4000 draws is within 4 standard errors of the
    value; the same ``torch.manual_seed`` gives the same gradient, another seed another. Planted: noise 0.5 for
    every element (round half up: biased) fails the mean."""
    v = torch.tensor([[0.3, 1.2, 2.6, 4.9, -3.4, 5.5, 0.1, -0.7, 1.75, 2.25, 3.1, -5.1, 0.6, 4.2, -1.4, 2.9]])
    lo_hi = torch.tensor([[0.0, 0.5], [1.0, 1.5], [2.0, 3.0], [4.0, 6.0], [-4.0, -3.0], [4.0, 6.0]])
    noise = torch.rand(4000, 16, generator=torch.Generator().manual_seed(0))
    draws = blocks.round_elements(v.expand(4000, 16), blocks.ELEMENTS["e2m1"], noise)
    for j, (lo, hi) in enumerate(lo_hi.tolist()):
        assert set(draws[:, j].unique().tolist()) <= {lo, hi}
    spread = (draws.std(0) / 4000**0.5).clamp(min=1e-3)
    assert ((draws.mean(0) - v[0]).abs() <= 4 * spread).all()

    x, w, g = spanning(32, 64, seed=16, binades=4), spanning(32, 64, seed=17, binades=4), spanning(32, 32, seed=18)

    def grads(seed):
        torch.manual_seed(seed)
        return three(lambda a, b: fp8.fp8_linear(a, b, recipe="nvfp4"), x, w, g)

    a, b, c = grads(0), grads(0), grads(1)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert torch.equal(a[0], c[0]) and not torch.equal(a[1], c[1]) and not torch.equal(a[2], c[2])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(nn.functional.dropout(torch.relu(self.up(x)), 0.1))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(16, 32), Block(), nn.Linear(32, 1)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))


def _sr_step(backend, remat, compile=True):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = fp8.convert(Net(), "nvfp4")
    apply_fn, params = fa.nn.functionalize(
        model, "float32", module_policies=fp8.MODULE_POLICIES, remat=Block if remat else None
    )
    opt = optim.sgd(0.1)
    step = fa.make_train_step(lambda p, x: apply_fn(p, x).square().mean(), opt, backend=backend, compile=compile)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)
    start = {k: v.clone() for k, v in params.items()}
    new, _ = step(fa.TrainState.create(params, opt), x)
    return start, new.params


@pytest.mark.parametrize("compiled", [False, True])
def test_stochastic_rounding_replays_under_remat(compiled):
    """A block with dropout and two nvfp4 layers whose gradients round stochastically, checkpointed (eager:
    torch.utils.checkpoint; compiled: aot_eager with the remat pass at budget 0) or not: one SGD step from the
    same seed gives bitwise the same parameters, and they moved."""
    from torch._dynamo.backends.common import aot_autograd

    from funcamp import passes

    def with_pass(gm, example_inputs):
        passes.RematPass()(gm.graph)
        gm.recompile()
        return gm

    backend = aot_autograd(fw_compiler=with_pass) if compiled else None
    (start, plain), (_, remat) = _sr_step(backend, False, compiled), _sr_step(backend, True, compiled)
    for k in plain:
        assert torch.equal(plain[k], remat[k]), k
    assert all(not torch.equal(start[k], plain[k]) for k in plain)


# --- shapes, selection, warnings ---------------------------------------------------------------------


def test_shapes_the_block_does_not_divide_are_refused_or_fall_back():
    x = torch.randn(8, 48)
    with pytest.raises(ValueError, match="multiples of 32, the mxfp8 block size"):
        fp8.fp8_linear(x, torch.randn(64, 48), recipe="mxfp8")
    with pytest.raises(ValueError, match="multiples of 16, the nvfp4 block size"):
        fp8.fp8_linear(torch.randn(8, 64), torch.randn(24, 64), recipe="nvfp4")
    with pytest.raises(ValueError, match="multiples of 32"):
        fp8.Float8Linear(48, 64, recipe="mxfp8")
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 48), nn.Linear(48, 64), nn.Linear(64, 8))
    with pytest.warns(fp8.Fp8FallbackWarning, match=r"not multiples of 32: 1 \(64->48\), 2 \(48->64\)"):
        converted = fp8.convert(model, "mxfp8")
    assert not isinstance(converted[1], fp8.Float8Linear)
    fp8.convert(model, "nvfp4")  # 48 is a multiple of 16: no fallback warning (errors here if there were one)


def test_emulation_is_announced_once():
    fp8._announced.clear()
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        converted = fp8.convert(model, "mxfp8")
        converted(torch.randn(4, 32))
        fp8.convert(model, "mxfp8")
    emulated = [w for w in seen if issubclass(w.category, fp8.Fp8EmulationWarning)]
    assert len(emulated) == 1 and "mxfp8 recipe runs its exact float32 emulation on cpu" in str(emulated[0].message)


def test_auto_filter_small_kn():
    big, small, odd = nn.Linear(2048, 2048), nn.Linear(1024, 1024), nn.Linear(2048 + 16, 4096)
    keep = fp8.auto_filter_small_kn("mxfp8", exclude=["head"])
    assert keep(big, "blocks.0.fc") and not keep(small, "blocks.0.fc") and not keep(big, "lm_head")
    assert not keep(odd, "x")  # 2064 is no multiple of 32
    assert fp8.auto_filter_small_kn("nvfp4")(odd, "x")
    tensorwise = fp8.auto_filter_small_kn("tensorwise")  # torchao's H100 rule: K <= 4096 and N <= 1024 skipped
    assert not tensorwise(nn.Linear(4096, 1024), "x") and tensorwise(nn.Linear(4096, 1040), "x")
    rowwise = fp8.auto_filter_small_kn("rowwise")
    assert not rowwise(nn.Linear(2048, 4096), "x") and rowwise(nn.Linear(2064, 4096), "x")
    model = nn.Sequential(nn.Linear(64, 1024), nn.Linear(1024, 2048), nn.Linear(2048, 64))
    converted = fp8.convert(model, "mxfp8", filter=keep)  # by size, not by position: the last one converts
    assert [type(m).__name__ for m in converted] == ["Linear", "Float8Linear", "Float8Linear"]
    with pytest.raises(TypeError, match="list of name substrings"):
        fp8.auto_filter_small_kn("mxfp8", exclude="head")


def test_mixtral_experts_named_in_the_fallback_warning():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    with pytest.warns(fp8.Fp8FallbackWarning) as seen:
        fp8.convert(model, "mxfp8")
    message = " ".join(str(w.message) for w in seen)
    assert "model.layers.0.mlp.experts.gate_up_proj (4x128x32)" in message
    assert "model.layers.0.mlp.experts.down_proj (4x32x64)" in message
    assert "grouped matmul" in message


def test_recipe_fields():
    mx, nv = fp8.get_recipe("mxfp8"), fp8.get_recipe("nvfp4")
    assert (mx.block_size, mx.fp8_format, mx.scale_rounding, mx.stochastic_rounding) == (32, "E4M3", "rceil", False)
    assert (nv.block_size, nv.stochastic_rounding, nv.weight_2d_blocks, nv.scale_rounding) == (16, True, True, None)
    assert fp8.Recipe().fp8_format == "HYBRID" and fp8.Recipe().block_size is None
    assert fp8.Recipe("mxfp8") == mx and hash(fp8.Recipe("nvfp4")) == hash(nv)
    for bad, match in (
        (dict(scaling="mxfp8", scale_rounding="even"), "'floor' or 'rceil'"),
        (dict(scaling="tensorwise", scale_rounding="floor"), "does not apply"),
        (dict(scaling="rowwise", wgrad_with_hp=True), "does not apply"),
        (dict(scaling="mxfp8", stochastic_rounding=True), "does not apply"),
        (dict(scaling="nvfp4", fp8_format="HYBRID"), "must be 'E4M3'"),
        (dict(scaling="mxfp8", round_scales_to_power_of_2=True), "does not apply"),
        (dict(scaling="mxfp4"), "scaling must be one of"),
    ):
        with pytest.raises(ValueError, match=match):
            fp8.Recipe(**bad)


def test_non_finite_block_is_not_saturated_away():
    """An inf in the input makes the output NaN (the step skips), where torchao's FLOOR saturates it to 448."""
    x = torch.randn(4, 64)
    x[1, 3] = torch.inf
    for recipe in ("mxfp8", "nvfp4"):
        y = fp8.fp8_linear(x, torch.randn(32, 64), recipe=recipe)
        assert torch.isnan(y[1]).all() and (recipe == "nvfp4" or torch.isfinite(y[0]).all())


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_compiled_step_trains_and_equals_eager(recipe):
    """A small GPT, every Linear but the first and the last block-scaled: the compiled step (aot_eager,
    ``fullgraph=True``) gives the eager step's parameters, and 3 steps lower the loss. nvfp4 reseeds before
    each step (its stochastic rounding draws from the default generator)."""
    torch.manual_seed(0)
    model = fp8.convert(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)), recipe)
    apply_fn, params = fa.nn.functionalize(model, "p=f32,c=bf16,o=f32", module_policies=fp8.MODULE_POLICIES)
    opt = optim.adam(3e-3)

    def loss_fn(p, batch):
        logits = apply_fn(p, batch[0])
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[1].flatten())

    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 64, (8, 17), generator=gen)
    batch = (tokens[:, :-1], tokens[:, 1:])
    runs = {}
    for compile_ in (False, True):
        torch._dynamo.reset()
        step = fa.make_train_step(loss_fn, opt, compile=compile_, backend="aot_eager")
        state, losses = fa.TrainState.create(params, opt), []
        for i in range(3):
            torch.manual_seed(10 + i)
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        runs[compile_] = (state.params, losses)
    (eager, losses), (compiled, _) = runs[False], runs[True]
    assert losses[-1] < losses[0]
    for k in eager:
        assert torch.allclose(eager[k], compiled[k], rtol=0, atol=1e-6), k


@pytest.mark.parametrize("recipe", [fp8.Recipe("mxfp8"), fp8.Recipe("nvfp4", stochastic_rounding=False)])
def test_inductor_equals_eager(recipe):
    """The forward and both gradients compiled by inductor (fullgraph) equal eager bitwise: the casts are
    integer and power-of-two arithmetic on float32 bits, with no down-and-up cast pair inductor could drop."""
    x, w, g = spanning(64, 64, seed=1, binades=10), spanning(32, 64, seed=2, binades=10), spanning(64, 32, seed=3)

    def run(a, b):
        grads = torch.func.grad(lambda a, b: (fp8.fp8_linear(a, b, recipe=recipe) * g).sum(), argnums=(0, 1))
        return (fp8.fp8_linear(a, b, recipe=recipe), *grads(a, b))

    compiled = torch.compile(run, backend="inductor", fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(compiled(x, w), run(x, w), strict=True))


def test_vmap_per_sample_gradients():
    """``torch.func.vmap`` of the weight gradient equals a loop over the samples, each cast with its own blocks;
    stochastic rounding under vmap asks for ``randomness="different"``. Planted: no ``generate_vmap_rule``
    (vmap refuses the Function)."""
    x, w, g = torch.randn(3, 8, 64), torch.randn(32, 64), torch.randn(3, 8, 32)
    for recipe in ("mxfp8", fp8.Recipe("nvfp4", stochastic_rounding=False)):

        def per_sample(xs, gs, recipe=recipe):
            return torch.func.grad(lambda w: (fp8.fp8_linear(xs, w, recipe=recipe) * gs).sum())(w)

        loop = torch.stack([per_sample(x[i], g[i]) for i in range(3)])
        assert torch.equal(torch.func.vmap(per_sample)(x, g), loop)
    sr = torch.func.vmap(
        lambda xs, gs: torch.func.grad(lambda w: (fp8.fp8_linear(xs, w, recipe="nvfp4") * gs).sum())(w),
        randomness="different",
    )(x, g)
    assert sr.shape == (3, 32, 64) and torch.isfinite(sr).all()


def test_policy_string_memory_report_and_main_job_flag():
    import train_gpt

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    apply_fn, params, buffers = fa.nn.functionalize(GPT(cfg), "p=f32,c=bf16,o=f32,fp8=mxfp8", with_buffers=True)
    assert buffers == {} and apply_fn(params, buffers, torch.zeros(2, 16, dtype=torch.long))[0].shape == (2, 16, 64)
    report = fa.memory.memory_report(fp8.convert(GPT(cfg), "mxfp8"), tokens=32)
    # the largest layer's copies (one at a time, as rowwise): mlp.proj, K = 128: (32 weight + 32 token rows) * 128
    assert report.compute[torch.float8_e4m3fn] == (32 + 32) * 128
    assert report.compute[torch.float8_e8m0fnu] == (32 + 32) * 128 // 32
    assert train_gpt.parse_args(["--fp8", "nvfp4"]).fp8 == "nvfp4"


def test_kernel_path_operands_and_scale_layout():
    """What the MX kernel path (CUDA compute capability 10.0 and up; not run here) would hand
    ``torch._scaled_mm``: the e4m3 elements and e8m0 scales of the emulation's cast, exactly, and the scales in
    torchao's ``to_blocked`` layout (cuBLAS's), padded rows and columns included."""
    utils = pytest.importorskip("torchao.prototype.mx_formats.utils")
    x = spanning(130, 192, seed=19)
    q, scale = blocks.mx_cast(x, "e4m3", "rceil")
    e8m0 = scale.reshape(130, -1).to(torch.float8_e8m0fnu)
    assert torch.equal(q.to(torch.float8_e4m3fn).float(), q)
    assert torch.equal(e8m0.float(), scale.reshape(130, -1))
    got = blocks._to_blocked(e8m0)
    assert got.dtype == torch.float8_e8m0fnu
    assert torch.equal(got.view(torch.uint8), utils.to_blocked(e8m0.view(torch.uint8)))
    assert not blocks.kernel_available(torch.device("cpu"), fp8.get_recipe("mxfp8"))
