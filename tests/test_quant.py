"""funcamp.quant: int8 weight-only storage of frozen matrices (issue 13, item 2).

References: bitsandbytes' ``int8_vectorwise_quant`` (golden values below; compared live when bitsandbytes
is importable), the error bound ``|W - deq(W)| <= step / 2`` (``step = absmax / 127``) and the bound it
implies for ``x @ W.T``
(module docstring of funcamp.quant), a float64 recomputation, and the same model with its weights
replaced by their dequantized values (gradients bitwise equal). GPT-2 124M footprints are checked
against hand arithmetic and against transformers' ``get_memory_footprint`` of the same layout.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import funcamp as fa
from funcamp import optim
from funcamp.memory import memory_footprint, memory_report
from funcamp.nn import functionalize
from funcamp.quant import Int8Weight, Int8WeightOnlyConfig, dequantize_int8, quantize_int8

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
SLACK = 2.0**-16  # float32 round-off of the dequantization (two roundings, 127 * 2**-23 steps), in steps


# --- quantize / dequantize ------------------------------------------------------------------------------


def test_matches_bitsandbytes_golden():
    # Golden: bitsandbytes 0.50.2, bnb.functional.int8_vectorwise_quant(w) on CPU (the same w, float16):
    # CB (int8) and SCB (float32 absmax per row); funcamp stores absmax = SCB.
    w = ((torch.arange(18, dtype=F32).reshape(3, 6) - 7.3) / 3.1).contiguous()
    w[2] *= 1e-3
    w = w.half()
    cb = [[-127, -110, -92, -75, -57, -40], [-45, -10, 24, 58, 93, 127], [62, 75, 88, 101, 114, 127]]
    scb = [2.35546875, 1.193359375, 0.0031299591064453125]
    q = quantize_int8(w)
    assert q.qdata.dtype == torch.int8 and q.qdata.tolist() == cb
    assert q.absmax.dtype == F32 and q.absmax.shape == (3, 1)
    assert torch.equal(q.absmax.flatten(), torch.tensor(scb))


def test_matches_bitsandbytes_live():
    bnb = pytest.importorskip("bitsandbytes")
    for seed in range(3):
        torch.manual_seed(seed)
        w = torch.randn(64, 48).half()
        cb, scb, _ = bnb.functional.int8_vectorwise_quant(w)
        q = quantize_int8(w)
        assert torch.equal(q.qdata, cb)
        assert torch.equal(q.absmax.flatten(), scb)


@pytest.mark.parametrize("dtype", [F16, BF16, F32, torch.float64])
@pytest.mark.parametrize("channel_dim", [0, 1])
def test_elementwise_error_within_half_a_step(dtype, channel_dim):
    torch.manual_seed(0)
    w = (torch.randn(96, 80) * torch.logspace(-3, 2, 80)).to(dtype)  # channels of very different ranges
    q = quantize_int8(w, channel_dim)
    expected_scale_shape = (96, 1) if channel_dim == 0 else (1, 80)
    assert q.absmax.shape == expected_scale_shape and q.qdata.shape == w.shape
    absmax = w.double().abs().amax(dim=1 - channel_dim, keepdim=True)
    torch.testing.assert_close(q.absmax.double(), absmax, rtol=2**-23, atol=0)  # float64: rounded up
    assert (q.absmax.double() >= absmax).all()
    assert int(q.qdata.abs().max()) == 127 and int(q.qdata.min()) >= -127
    err = (w.double() - dequantize_int8(q, F32).double()).abs()
    bound = q.absmax.double() / 127 * (0.5 + SLACK)
    assert (err <= bound).all()
    assert (err / bound).max() > 0.9  # the bound is attained (within round-off): it is the right one


def test_dequantize_rounds_once_into_the_compute_dtype():
    torch.manual_seed(1)
    q = quantize_int8(torch.randn(32, 16))
    full = q.qdata.float() / 127 * q.absmax
    for dtype in (F16, BF16, F32):
        assert torch.equal(dequantize_int8(q, dtype), full.to(dtype))
        assert torch.equal(q.dequantize(dtype), full.to(dtype))
    assert q.shape == (32, 16) and q.device == torch.device("cpu")


def test_zero_channel_and_bad_input():
    q = quantize_int8(torch.tensor([[0.0, 0.0], [3.0, -1.5]]))
    assert q.qdata.tolist() == [[0, 0], [127, -64]] and q.absmax[0].item() == 0.0
    assert torch.isfinite(q.dequantize()).all()
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_int8(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="2-d"):
        quantize_int8(torch.ones(4))
    with pytest.raises(ValueError, match="channel_dim"):
        quantize_int8(torch.ones(2, 2), 2)
    with pytest.raises(TypeError, match="floating-point"):
        quantize_int8(torch.ones(2, 2, dtype=torch.int32))


def test_int8_weight_is_a_pytree_of_two_tensors():
    q = quantize_int8(torch.randn(4, 3))
    assert fa.tree_bytes({"w": q}) == 12 + 4 * 4
    assert copy.deepcopy(q).qdata.tolist() == q.qdata.tolist()
    leaves, spec = torch.utils._pytree.tree_flatten(q)
    assert len(leaves) == 2 and isinstance(torch.utils._pytree.tree_unflatten(leaves, spec), Int8Weight)


# --- tiny, subnormal and zero channels (issue 26, item 2) -------------------------------------------------


@pytest.mark.parametrize("m", [1e-37, 1e-39])  # normal (below 3.7e-37, where 127 / absmax is inf) and subnormal
def test_tiny_channel_gets_the_integers_of_any_other(m):
    # Before: [127, -127, 127, 0]: 127 / absmax overflowed to inf, and the 0 was a NaN (0 * inf) cast to int8.
    w = torch.tensor([[m, -0.5 * m, 0.3 * m, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q = quantize_int8(w)
    assert q.qdata.tolist() == [[127, -64, 38, 0], [0, 0, 0, 0]]  # -63.5 ties to even; 0.3 * 127 = 38.1
    assert q.absmax.flatten().tolist() == [w[0, 0].item(), 0.0]  # finite: the zero row's absmax is 0
    deq = q.dequantize().double()
    step = w[0, 0].double() / 127
    assert deq[1].tolist() == [0.0] * 4
    # Within half a step of the weight (-0.5 * m is exactly half a step from -64), up to float32 round-off
    # (2**-149 where the result is subnormal), and within round-off of the float64 dequantization.
    assert ((w[0].double() - deq[0]).abs() <= step * (0.5 + SLACK) + 2.0**-149).all()
    exact = torch.tensor([127, -64, 38, 0], dtype=torch.float64) / 127 * w[0, 0].double()
    assert ((deq[0] - exact).abs() <= exact.abs() * 2**-23 + 2**-150).all()


#: Channel magnitudes (absmax) of the sweep: zero, float32's smallest subnormal, subnormals, the smallest
#: normal's neighbourhood, 3.7e-37 (where 127 / absmax overflows), ordinary, and close to float32's max.
MAGNITUDES = [0.0, 1e-45, 1e-40, 1e-39, 1e-38, 1e-37, 3.7e-37, 1e-30, 1.0, 1e30, 3e38]


def _channels(m: float, dtype: torch.dtype, channel_dim: int) -> torch.Tensor:
    """Three channels of 16: ``m * [1, -0.5, 0.3, 0, 12 values in (-1, 1)]``, its negation scaled by 0.7,
    and zeros; in ``dtype`` (values it cannot hold round, down to 0)."""
    rest = torch.rand(12, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 2 - 1
    row = torch.cat([torch.tensor([1.0, -0.5, 0.3, 0.0], dtype=torch.float64), rest]) * m
    w = torch.stack([row, -0.7 * row, torch.zeros(16, dtype=torch.float64)]).to(dtype)
    return w if channel_dim == 0 else w.T.contiguous()


def _oracle(w: torch.Tensor, channel_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(absmax as stored, qdata) in float64: absmax exact (float64 weights: rounded up to float32), qdata
    ``round(x / absmax * 127)`` computed in float64 (0 for a zero channel)."""
    x = w.double()
    absmax = x.abs().amax(dim=1 - channel_dim, keepdim=True)
    stored = absmax.float().double()
    stored = torch.where(stored < absmax, torch.nextafter(stored.float(), torch.tensor(math.inf)).double(), stored)
    q = torch.where(stored > 0, torch.round(x / torch.where(stored > 0, stored, 1.0) * 127), 0.0)
    return stored, q


def _stored_absmax(q: Int8Weight) -> torch.Tensor:
    return q.absmax


SWEEP_ERR: dict[tuple, tuple[float, float]] = {}  # case -> largest |W - deq(W)| in steps, and / bound


@pytest.mark.parametrize("channel_dim", [0, 1])
@pytest.mark.parametrize("dtype", [F32, BF16, torch.float64])
@pytest.mark.parametrize("m", MAGNITUDES)
def test_sweep_channel_magnitudes_against_float64(m, dtype, channel_dim):
    w = _channels(m, dtype, channel_dim)
    q = quantize_int8(w, channel_dim)
    stored, expected = _oracle(w, channel_dim)
    absmax = _stored_absmax(q)
    assert absmax.dtype == F32 and torch.isfinite(absmax).all()
    assert torch.equal(absmax.double(), stored)
    mismatch = int((q.qdata.double() != expected).sum())
    assert mismatch == 0, f"{mismatch} of {w.numel()} int8 values differ from round(x / absmax * 127) in float64"
    # Dequantized: within half a step plus float32 round-off (2**-149 where the result is subnormal).
    step = stored / 127
    deq = dequantize_int8(q, F32).double()
    err = (w.double() - deq).abs()
    bound = step * (0.5 + SLACK) + 2.0**-149
    assert torch.isfinite(deq).all() and (err <= bound).all()
    # ... and the float64 dequantization rounded to float32, within float32 round-off.
    exact = expected / 127 * stored
    assert ((deq - exact).abs() <= exact.abs() * 2**-23 + 2**-150).all()
    for out in (F16, BF16):  # a compute dtype: the float32 result rounded once
        assert torch.equal(dequantize_int8(q, out), deq.float().to(out))
    nonzero = step > 0
    if nonzero.any():
        in_steps = err / torch.where(nonzero, step, 1.0)
        SWEEP_ERR[(m, dtype, channel_dim)] = (float(in_steps[nonzero.expand_as(err)].max()), float((err / bound).max()))


def test_sweep_summary():
    """Print the sweep's largest errors (run with -s): in steps (absmax / 127) and as a fraction of the bound."""
    if not SWEEP_ERR:
        pytest.skip("run with the sweep")
    print()
    for m in sorted({k[0] for k in SWEEP_ERR}):
        steps = max(v[0] for k, v in SWEEP_ERR.items() if k[0] == m)
        of_bound = max(v[1] for k, v in SWEEP_ERR.items() if k[0] == m)
        print(f"int8 sweep, absmax {m:g}: largest |W - deq(W)| {steps:.6f} steps, {of_bound:.4f} of the bound")
    assert max(v[0] for (m, *_), v in SWEEP_ERR.items() if m >= 1e-30) <= 0.5 + SLACK


def test_float64_weights_beyond_float32_are_refused():
    with pytest.raises(ValueError, match="above float32's largest value"):
        quantize_int8(torch.tensor([[1e39, 1.0]], dtype=torch.float64))
    # Rounded up, so that no value exceeds 127 steps: 1 + 2**-30 is not a float32.
    q = quantize_int8(torch.tensor([[1 + 2**-30, -1.0]], dtype=torch.float64))
    assert q.absmax.item() == 1 + 2**-23 and q.qdata.tolist() == [[127, -127]]


@pytest.mark.parametrize("dtype", [F16, BF16, F32, torch.float64])
def test_quantize_leaves_the_weight_alone(dtype):
    w = torch.randn(5, 7).to(dtype)
    before = w.clone()
    quantize_int8(w)
    quantize_int8(w, 1)
    assert torch.equal(w, before)


def test_large_weight_is_quantized_in_blocks(monkeypatch):
    import funcamp.quant as quant

    torch.manual_seed(8)
    w = torch.randn(37, 11) * torch.logspace(-38, 30, 11)
    whole = [quantize_int8(w, d) for d in (0, 1)]
    monkeypatch.setattr(quant, "_BLOCK", 20)  # blocks of one or two channels
    for d in (0, 1):
        q = quantize_int8(w, d)
        assert torch.equal(q.qdata, whole[d].qdata) and torch.equal(q.absmax, whole[d].absmax)
        assert torch.equal(q.qdata.double(), _oracle(w, d)[1])


# --- the bound for y = x @ W.T, and a model's output within it --------------------------------------------


def test_linear_output_within_the_implied_bound():
    """|y_i - y_deq_i| <= step_i / 2 * ||x||_1 (float64, exact up to the per-element slack)."""
    torch.manual_seed(2)
    w, x = torch.randn(48, 64), torch.randn(20, 64) * 3
    q = quantize_int8(w)
    y, y_deq = x.double() @ w.double().T, x.double() @ q.dequantize().double().T
    bound = q.absmax.double().T / 127 * (0.5 + SLACK) * x.double().abs().sum(-1, keepdim=True)
    assert ((y - y_deq).abs() <= bound).all()


def _hf_conv1d():
    transformers = pytest.importorskip("transformers")
    return transformers.pytorch_utils.Conv1D


def test_conv1d_output_channel_is_dim_1():
    conv1d = _hf_conv1d()
    torch.manual_seed(3)
    layer = conv1d(24, 16)  # nf=24 outputs, nx=16 inputs; weight [16, 24]
    nn.init.normal_(layer.weight)
    linear = nn.Linear(16, 24)
    linear.weight.data = layer.weight.data.T.contiguous()
    (name, dim), *_ = Int8WeightOnlyConfig(targets=conv1d).select(layer).items()
    assert (name, dim) == ("weight", 1)
    q = quantize_int8(layer.weight, dim)
    assert q.absmax.shape == (1, 24)  # one scale per output channel (column)
    assert torch.equal(q.qdata.T, quantize_int8(linear.weight, 0).qdata)


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for p in model.parameters():
        nn.init.normal_(p)
    return model


def test_model_output_within_the_composed_bound(mlp):
    """Linear -> ReLU -> Linear in float32: |dy_k| <= sum_j |W2_deq[k, j]| e1_j + step2_k / 2 * ||h||_1."""
    model = copy.deepcopy(mlp).requires_grad_(False)
    apply_fn, params = functionalize(model, "float32", quantize=Int8WeightOnlyConfig())
    assert params == {} and sorted(apply_fn.frozen) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    q1, q2 = apply_fn.frozen["0.weight"], apply_fn.frozen["2.weight"]
    x = torch.randn(10, 16)
    out = apply_fn(params, x)
    xd, (w1, b1, w2, b2) = x.double(), (p.double() for p in mlp.parameters())
    h = torch.relu(xd @ w1.T + b1)
    y = h @ w2.T + b2
    e1 = q1.absmax.double().T / 127 * (0.5 + SLACK) * xd.abs().sum(-1, keepdim=True)
    half_step2 = q2.absmax.double().T / 127 * (0.5 + SLACK)
    bound = e1 @ q2.dequantize().double().abs().T + half_step2 * h.abs().sum(-1, keepdim=True)
    # float32 arithmetic of the forward itself: a few units of float32 times the magnitudes involved
    roundoff = 64 * 2**-24 * ((xd.abs() @ w1.abs().T + b1.abs()) @ w2.abs().T + b2.abs()).max()
    err = (out.double() - y).abs()
    assert (err <= bound + roundoff).all()
    assert err.max() > roundoff  # the quantization error is visible above round-off: the test can fail


@pytest.mark.parametrize("policy", ["float32", "params=float32,compute=bfloat16,output=float32"])
def test_gradients_equal_the_dequantized_model_bitwise(mlp, policy):
    """Trainable biases get the gradients of the same model whose frozen weights are the dequantized ones."""
    trainable = ["*.bias"]
    apply_fn, params = functionalize(mlp, policy, trainable=trainable, quantize=Int8WeightOnlyConfig())
    reference = copy.deepcopy(mlp)
    with torch.no_grad():
        for name in ("0.weight", "2.weight"):
            reference.get_parameter(name).copy_(apply_fn.frozen[name].dequantize(F32))
    ref_fn, ref_params = functionalize(reference, policy, trainable=trainable)
    compute = fa.get_policy(policy).compute_dtype
    assert torch.equal(ref_fn.frozen["0.weight"], apply_fn.frozen["0.weight"].dequantize(compute))
    x = torch.randn(6, 16)

    def loss(fn):
        return lambda p: fn(p, x).square().mean()

    grads, value = torch.func.grad_and_value(loss(apply_fn))(params)
    ref_grads, ref_value = torch.func.grad_and_value(loss(ref_fn))(ref_params)
    assert torch.equal(value, ref_value)
    assert grads.keys() == {"0.bias", "2.bias"}
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name
        assert grads[name].abs().sum() > 0


def test_autocast_mode_dequantizes_into_the_compute_dtype(mlp):
    policy = "params=float32,compute=bfloat16,output=float32"
    apply_fn, params = functionalize(mlp, policy, autocast=True, trainable="*.bias", quantize=Int8WeightOnlyConfig())
    assert apply_fn.forward_dtypes["0.weight"] == BF16
    out = apply_fn(params, torch.randn(3, 16))
    assert out.dtype == F32 and torch.isfinite(out).all()


class _Checkpointed(nn.Module):
    def __init__(self, remat: bool) -> None:
        super().__init__()
        self.inp, self.block, self.remat = nn.Linear(16, 32), nn.Sequential(nn.Linear(32, 32), nn.GELU()), remat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False) if self.remat else self.block(h)


def test_activation_checkpointing_recomputes_with_the_dequantized_weights():
    torch.manual_seed(5)
    plain = _Checkpointed(remat=False)
    remat = copy.deepcopy(plain)
    remat.remat = True
    policy, x = "params=float32,compute=bfloat16,output=float32", torch.randn(4, 16)
    calls = []
    remat.block.register_forward_pre_hook(lambda module, args: calls.append(1))  # copied by functionalize
    grads = []
    for model in (plain, remat):
        apply_fn, params = functionalize(model, policy, trainable="*.bias", quantize=Int8WeightOnlyConfig())
        loss_fn = lambda p, batch, f=apply_fn: f(p, batch).square().sum()  # noqa: E731
        g, _, finite = fa.grad_and_value(loss_fn, fa.NoOpLossScale())(params, x)  # eager: recomputes
        assert bool(finite)
        grads.append(g)
    assert len(calls) == 2  # the checkpointed block ran again in the backward pass
    assert grads[0].keys() == {"inp.bias", "block.0.bias"}
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


# --- what gets quantized, and the errors --------------------------------------------------------------------


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.proj(self.wte(idx))))


def test_default_targets_leave_a_head_tied_to_the_embedding():
    model = _Tied()
    assert Int8WeightOnlyConfig().select(model) == {"proj.weight": 0}
    both = Int8WeightOnlyConfig(targets=[nn.Embedding, nn.Linear])
    assert both.select(model) == {"wte.weight": 0, "proj.weight": 0}  # rows: tokens for both uses
    with pytest.raises(ValueError, match="'wte.weight' is tied"):
        Int8WeightOnlyConfig(targets=["head", "proj"]).select(model)
    assert Int8WeightOnlyConfig(targets=nn.Linear, exclude=["head"]).select(model) == {"proj.weight": 0}


def test_tied_int8_embedding_and_head_run(mlp):
    model = _Tied().requires_grad_(False)
    model.ln.requires_grad_(True)
    apply_fn, params = functionalize(model, "float32", quantize=Int8WeightOnlyConfig(targets=[nn.Embedding, nn.Linear]))
    assert sorted(params) == ["ln.bias", "ln.weight"] and isinstance(apply_fn.frozen["wte.weight"], Int8Weight)
    idx = torch.tensor([[1, 2, 3]])
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name in ("wte.weight", "proj.weight"):
            reference.get_parameter(name).copy_(apply_fn.frozen[name].dequantize())
    assert torch.equal(apply_fn(params, idx), reference(idx))


def test_each_tied_use_is_dequantized_into_its_own_compute_dtype():
    model = _Tied().requires_grad_(False)
    model.ln.requires_grad_(True)
    seen = {}
    model.head.register_forward_hook(lambda module, args, out: seen.update(head=module.weight))  # copied along
    model.wte.register_forward_hook(lambda module, args, out: seen.update(wte=module.weight))
    policy = "params=float32,compute=bfloat16,output=float32"
    config = Int8WeightOnlyConfig(targets=[nn.Embedding, nn.Linear])
    # By default the embedding looks up in float32 (funcamp.nn.float32_lookup), the head computes in bf16.
    apply_fn, params = functionalize(model, policy, quantize=config)
    apply_fn(params, torch.tensor([[1, 2, 3]]))
    q = apply_fn.frozen["wte.weight"]
    assert torch.equal(seen["wte"], q.dequantize(F32)) and torch.equal(seen["head"], q.dequantize(BF16))
    assert apply_fn.forward_dtypes["wte.weight"] == F32 and apply_fn.forward_dtypes["head.weight"] == BF16
    report = memory_report(params, apply_fn=apply_fn)
    assert report.compute == {F32: 80 * 4, BF16: (64 + 80) * 2}  # the wte use in f32; proj and the head in bf16
    # The other way round (the embedding in bf16, the head in f32): the head's float32 copy comes from
    # int8 directly, not through the bfloat16 one.
    apply_fn, params = functionalize(
        model, policy, module_policies={nn.Embedding: None, "head": "float32"}, quantize=config
    )
    apply_fn(params, torch.tensor([[1, 2, 3]]))
    q = apply_fn.frozen["wte.weight"]
    assert torch.equal(seen["wte"], q.dequantize(BF16))
    assert torch.equal(seen["head"], q.dequantize(F32))
    assert not torch.equal(seen["head"], q.dequantize(BF16).float())
    assert apply_fn.forward_dtypes["head.weight"] == F32
    report = memory_report(params, apply_fn=apply_fn)
    assert report.compute == {BF16: (80 + 64) * 2, F32: 80 * 4}  # wte and proj in bf16; the head's use in f32


def test_targets_by_pattern_and_predicate(mlp):
    assert Int8WeightOnlyConfig(targets="2").select(mlp) == {"2.weight": 0}
    assert Int8WeightOnlyConfig(targets=lambda name, m: m.out_features > 8).select(mlp) == {"0.weight": 0}


def test_errors(mlp):
    with pytest.raises(TypeError, match="LayerNorm weights cannot be stored in int8"):
        Int8WeightOnlyConfig(targets=nn.LayerNorm)
    with pytest.raises(TypeError, match="not an nn.Module subclass"):
        Int8WeightOnlyConfig(targets=int)
    with pytest.raises(TypeError, match="targets must be"):
        Int8WeightOnlyConfig(targets=3)
    with pytest.raises(TypeError, match="exclude must be"):
        Int8WeightOnlyConfig(exclude=[nn.Linear])
    with pytest.raises(ValueError, match="matches no module"):
        Int8WeightOnlyConfig(targets="*.c_attn").select(mlp)
    with pytest.raises(ValueError, match="exclude pattern 'x' matches no module"):
        Int8WeightOnlyConfig(exclude="x").select(mlp)
    with pytest.raises(TypeError, match=r"matches only modules that cannot be stored in int8 \(ReLU\)"):
        Int8WeightOnlyConfig(targets="1").select(mlp)
    with pytest.raises(ValueError, match="predicate selected none"):
        Int8WeightOnlyConfig(targets=lambda name, m: False).select(mlp)
    with pytest.raises(TypeError, match="must return a bool"):
        Int8WeightOnlyConfig(targets=lambda name, m: 1).select(mlp)
    with pytest.raises(ValueError, match="has no Embedding"):
        Int8WeightOnlyConfig(targets=nn.Embedding).select(mlp)
    with pytest.raises(ValueError, match="no weight left"):
        Int8WeightOnlyConfig(exclude="*").select(mlp)
    # quantized and trained: every parameter of mlp requires grad, so the weights would be both
    with pytest.raises(ValueError, match=r"\['0.weight', '2.weight'\] \(2 tensors\) would be stored in int8"):
        functionalize(mlp, "float32", quantize=Int8WeightOnlyConfig())
    with pytest.raises(ValueError, match="stored in int8 and trained"):
        functionalize(mlp, "float32", trainable="2", quantize=Int8WeightOnlyConfig())
    with pytest.raises(TypeError, match="quantize must be None or a funcamp.quant.Int8WeightOnlyConfig"):
        functionalize(mlp, "float32", trainable="*.bias", quantize="int8")


# --- the compiled train step ------------------------------------------------------------------------------


def test_compiled_train_step_trains_around_frozen_int8(mlp):
    torch._dynamo.reset()
    apply_fn, params = functionalize(
        mlp, "params=float32,compute=bfloat16,output=float32", trainable="*.bias", quantize=Int8WeightOnlyConfig()
    )
    qdata = apply_fn.frozen["0.weight"].qdata.clone()
    x, target = torch.randn(32, 16), torch.randn(32, 4)

    def loss_fn(p, batch):
        return (apply_fn(p, batch[0]) - batch[1]).square().mean()

    optimizer = optim.adamw(5e-2)
    state = fa.TrainState.create(params, optimizer, loss_scale=fa.NoOpLossScale())
    step = fa.make_train_step(loss_fn, optimizer, backend="aot_eager")
    losses = []
    counters = torch._dynamo.utils.counters
    frames = counters["stats"]["unique_graphs"]
    for _ in range(20):
        state, metrics = step(state, (x, target))
        losses.append(float(metrics["loss"]))
    assert counters["stats"]["unique_graphs"] - frames == 1  # one graph, no recompiles
    assert losses[-1] < 0.8 * losses[0]
    assert torch.equal(apply_fn.frozen["0.weight"].qdata, qdata)  # never written
    assert sorted(state.params) == ["0.bias", "2.bias"]


# --- footprints: GPT-2 124M -------------------------------------------------------------------------------

MIB = 2**20


@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config()).requires_grad_(False)


def _gpt2_bytes(ln_bytes: int, rest_bytes: int, scales: bool) -> int:
    """GPT-2 124M with c_attn, c_proj, c_fc (both c_proj) in int8, by hand (GPT2Config(): d=768, 12 layers).

    Per layer: int8 matrices 768*2304 + 768*768 + 768*3072 + 3072*768 = 7,077,888 bytes; biases (and
    scales: one per output channel) 2304 + 768 + 3072 + 768 = 6,912 values; LayerNorms 4 * 768 = 3,072.
    Embeddings: wte 50,257 * 768 = 38,597,376, wpe 1,024 * 768 = 786,432; ln_f 2 * 768; the LM head is
    tied to wte. The 124,439,808 parameters add up: 39,383,808 + 12 * (7,077,888 + 6,912 + 3,072) + 1,536.
    """
    d, layers = 768, 12
    int8_matrices = d * 3 * d + d * d + d * 4 * d + 4 * d * d
    channels = 3 * d + d + 4 * d + d
    embeddings = 50257 * d + 1024 * d
    assert embeddings + layers * (int8_matrices + channels + 4 * d) + 2 * d == 124_439_808
    per_layer = int8_matrices + channels * rest_bytes + 4 * d * ln_bytes + (channels * 4 if scales else 0)
    return embeddings * rest_bytes + layers * per_layer + 2 * d * ln_bytes


def test_gpt2_int8_footprint_by_hand(gpt2):
    # The note's load_in_8bit layout: matrices int8, embeddings and biases float16, LayerNorms float32.
    apply_fn, params = functionalize(
        gpt2, "params=float16,compute=float16,output=float32", quantize=Int8WeightOnlyConfig()
    )
    assert params == {}
    frozen = apply_fn.frozen
    assert frozen["transformer.wte.weight"].dtype == F16 and frozen["transformer.h.0.attn.c_attn.bias"].dtype == F16
    assert frozen["transformer.h.0.ln_1.weight"].dtype == F32 and frozen["transformer.ln_f.weight"].dtype == F32
    for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        q = frozen[f"transformer.h.3.{name}.weight"]
        assert isinstance(q, Int8Weight) and q.qdata.dtype == torch.int8 and q.absmax.shape == (1, q.shape[1])
    expected = _gpt2_bytes(ln_bytes=4, rest_bytes=2, scales=True)
    assert expected == 164_353_536
    assert memory_footprint(params, apply_fn=apply_fn) == expected
    report = memory_report(params, apply_fn=apply_fn)
    assert report.stored_bytes == expected
    assert report.stored[torch.int8] == 12 * 7_077_888 and report.stored[F32] == 12 * (6912 + 3072) * 4 + 1536 * 4
    # During a call: the dequantized matrices in float16, and the float16 tables wte and wpe cast to
    # float32 for their lookups (funcamp.nn.float32_lookup; the "embedding" op rule made the same cast
    # before, uncounted), (38,597,376 + 786,432) * 4 = 157,535,232 bytes. The LM head uses wte in
    # float16, as stored: no copy.
    assert report.compute == {F16: 12 * 7_077_888 * 2, F32: (50257 * 768 + 1024 * 768) * 4}
    assert report.compute[F32] == 157_535_232


def test_gpt2_int8_footprint_against_transformers(gpt2):
    """transformers + bitsandbytes (``load_in_8bit=True, dtype=float16``) report 163,944,960 bytes.

    Measured with bitsandbytes 0.50.2 and transformers 5.24 on CPU (GPT2Config(), random weights saved and
    reloaded with ``BitsAndBytesConfig(load_in_8bit=True)``): LayerNorms in float16 there, and bitsandbytes'
    scales (SCB) are not parameters, so not counted. funcamp with LayerNorms in float16 too counts the
    same bytes plus the scales.
    """
    transformers_bytes = _gpt2_bytes(ln_bytes=2, rest_bytes=2, scales=False)
    assert transformers_bytes == 163_944_960
    apply_fn, params = functionalize(
        gpt2,
        "params=float16,compute=float16,output=float32",
        module_policies={nn.LayerNorm: None},
        quantize=Int8WeightOnlyConfig(),
    )
    scales = 12 * 6912 * 4
    assert memory_footprint(params, apply_fn=apply_fn) == transformers_bytes + scales
    # and the float16 model transformers counts (2 bytes per parameter, no buffers), less what int8 saves:
    assert gpt2.get_memory_footprint() // 2 - 12 * 7_077_888 == transformers_bytes


# --- the example -------------------------------------------------------------------------------------------


def test_finetune_int8_example_runs(tmp_path):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import finetune_int8

    threads = torch.get_num_threads()
    try:  # one thread: 2 threads on a loaded 2-core machine spin-wait (10x slower)
        results = finetune_int8.main(
            ["--steps", "30", "--batch-size", "8", "--block-size", "32", "--no-compile", "--logdir", str(tmp_path)]
            + ["--log-every", "10", "--no-footprint-124m", "--quiet", "--threads", "1"]
        )
    finally:
        torch.set_num_threads(threads)
    losses = [v for _, v in results["history"]["train_loss"]]
    # uniform over bytes at initialisation is log(256) = 5.55; the first interval's mean is below it
    assert losses[0] < math.log(256) + 0.3 and losses[-1] < losses[0] - 0.5
    assert results["val_loss"] < math.log(256) - 1.0
    assert results["int8_tensors"] == 8  # c_attn, c_proj, c_fc, c_proj of 2 layers
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "train/loss" in tags and "memory/stored_bytes" in tags


def test_finetune_int8_one_step_prints_no_nan(tmp_path, capsys):
    """One step (the first, which compiles, is not timed): every rate and ratio says it was not measured, not nan
    (issue 33, item 10's kind); zero steps are refused."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import finetune_int8

    argv = ["--batch-size", "2", "--block-size", "16", "--no-compile", "--logdir", str(tmp_path), "--quiet"]
    argv += ["--no-footprint-124m", "--threads", "1", "--baseline", "--torch-amp", "--timing-rounds", "0"]
    threads = torch.get_num_threads()
    try:
        results = finetune_int8.main(["--steps", "1", *argv])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "nan" not in out.lower(), out
    assert out.count("steps/s not measured") == 3 and out.count("not measured (run 2 steps or more)") == 2, out
    assert results["steps_per_second"] is None and results["baseline"]["steps_per_second"] is None
    with pytest.raises(SystemExit):
        finetune_int8.parse_args(["--steps", "0"])
