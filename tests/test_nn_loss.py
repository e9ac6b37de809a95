"""funcamp.nn.linear_cross_entropy: the chunked LM head and loss against F.cross_entropy(hidden @ weight.T, targets).

Oracle: the unchunked loss in float64 (values and gradients); in bfloat16 / float16, the unchunked loss on the same
low-precision inputs, with bounds that say where they come from. Bitwise equality with the unchunked loss is not
expected: the rows are summed per chunk, then the chunks added.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import funcamp as fa
from funcamp import optim
from funcamp.nn import linear_cross_entropy

N, D, V = 37, 16, 50  # rows (not a multiple of the chunks), width, vocabulary


def _inputs(dtype=torch.float64, seed=0, ignored=(3, 20)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    t[list(ignored)] = -100
    return h, w, t


def _ref(h, w, t, reduction="mean", ignore_index=-100, scale=1.0):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = F.cross_entropy(
        (h @ w.T).to(torch.promote_types(h.dtype, torch.float32)), t, reduction=reduction, ignore_index=ignore_index
    )
    gh, gw = torch.autograd.grad(loss * scale, (h, w))
    return loss.detach(), gh, gw


def _got(h, w, t, scale=1.0, **kw):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = linear_cross_entropy(h, w, t, **kw)
    gh, gw = torch.autograd.grad(loss * scale, (h, w))
    return loss.detach(), gh, gw


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_size", [1, 8, N, 4 * N])
def test_float64_values_and_gradients(reduction, chunk_size):
    """float64: loss and both gradients equal the unchunked ones to float64 round-off of the sums (measured
    max difference relative to the largest value, over these cases: 1.7e-16 loss, 9.0e-16 hidden's gradient,
    5.0e-16 weight's), ignored rows included."""
    h, w, t = _inputs()
    ref, got = _ref(h, w, t, reduction), _got(h, w, t, chunk_size=chunk_size, reduction=reduction)
    assert got[0].dtype == torch.float64 and got[1].dtype == got[2].dtype == torch.float64
    for r, g in zip(ref, got):
        assert torch.allclose(g, r, rtol=1e-13, atol=1e-15), (g - r).abs().max()


def test_leading_dimensions_and_ignore_index():
    """hidden (B, T, D) with targets (B, T); another ignore_index value; rows with it add nothing."""
    h, w, t = _inputs()
    t = torch.where(t == -100, 7, t)  # 7 is now ignored, wherever it is
    h3, t2 = h[:36].reshape(4, 9, D), t[:36].reshape(4, 9)
    ref = _ref(h3.reshape(36, D), w, t2.reshape(36), ignore_index=7)
    loss, gh, gw = _got(h3, w, t2, chunk_size=5, ignore_index=7)
    assert torch.allclose(loss, ref[0], rtol=1e-13) and torch.allclose(gw, ref[2], rtol=1e-12, atol=1e-15)
    assert gh.shape == (4, 9, D) and torch.allclose(gh.reshape(36, D), ref[1], rtol=1e-12, atol=1e-15)
    assert (gh.reshape(36, D)[t[:36] == 7] == 0).all()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_batch_as_torch(reduction):
    """Every target ignored: as F.cross_entropy, the mean is NaN (0 / 0) and the sum 0, with zero gradients."""
    h, w, _ = _inputs()
    t = torch.full((N,), -100)
    ref, got = _ref(h, w, t, reduction), _got(h, w, t, chunk_size=8, reduction=reduction)
    assert torch.equal(ref[0].isnan(), got[0].isnan()) and (reduction == "mean") == bool(got[0].isnan())
    for r, g in zip(ref[1:], got[1:]):
        assert torch.equal(r, g) and not g.any()


def test_tied_weight_embedding_and_head():
    """The head's weight is the token embedding (GPT-2): both gradients add into the one tensor."""
    g = torch.Generator().manual_seed(1)
    table = torch.randn(V, D, generator=g, dtype=torch.float64)
    idx, t = torch.randint(0, V, (N,), generator=g), torch.randint(0, V, (N,), generator=g)
    mix = torch.randn(D, D, generator=g, dtype=torch.float64) / 4

    def ref(table):
        return F.cross_entropy(torch.tanh(table[idx] @ mix) @ table.T, t)

    def got(table):
        return linear_cross_entropy(torch.tanh(table[idx] @ mix), table, t, chunk_size=6)

    expected, value = torch.func.grad_and_value(ref)(table)
    grad, loss = torch.func.grad_and_value(got)(table)
    assert torch.allclose(loss, value, rtol=1e-13) and torch.allclose(grad, expected, rtol=1e-12, atol=1e-15)


@pytest.fixture(scope="module")
def compiled_grad():
    """torch.compile(fullgraph=True) of torch.func.grad_and_value of the loss (aot_eager), shared by the tests."""
    return torch.compile(
        torch.func.grad_and_value(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=8) * 3.0, argnums=(0, 1)),
        fullgraph=True,
        backend="aot_eager",
    )


def test_torch_func_and_compiled_equal_eager(compiled_grad):
    """The same function under torch.func.grad and compiled (aot_eager, fullgraph): bitwise the eager autograd
    result (the same ops in the same order); the compiled one does not recompile for new values."""
    h, w, t = _inputs()
    loss, gh, gw = _got(h, w, t, scale=3.0, chunk_size=8)
    (fh, fw), fv = torch.func.grad_and_value(
        lambda h, w: linear_cross_entropy(h, w, t, chunk_size=8) * 3.0, argnums=(0, 1)
    )(h, w)
    assert torch.equal(fv, 3.0 * loss) and torch.equal(fh, gh) and torch.equal(fw, gw)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (0, 1):
            h, w, t = _inputs(seed=seed)
            (ch, cw), cv = compiled_grad(h, w, t)
            loss, gh, gw = _got(h, w, t, scale=3.0, chunk_size=8)
            assert torch.equal(cv, 3.0 * loss) and torch.equal(ch, gh) and torch.equal(cw, gw)


def test_no_grad_loss_only_and_autocast():
    """Under torch.no_grad only the loss is computed, bitwise the differentiable call's; under torch.autocast the
    inputs are cast to its dtype first (as F.linear is), bitwise the call on the cast inputs."""
    h, w, t = _inputs(torch.float32)
    with torch.no_grad():
        loss_only = linear_cross_entropy(h, w, t, chunk_size=8)
    assert torch.equal(loss_only, _got(h, w, t, chunk_size=8)[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = linear_cross_entropy(h, w, t, chunk_size=8)
    assert auto.dtype == torch.float32
    assert torch.equal(auto, linear_cross_entropy(h.bfloat16(), w.bfloat16(), t, chunk_size=8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_compute_against_unchunked_and_float64(dtype):
    """Half inputs, through funcamp.grad_and_value with a loss scale. The logits are the same products in the
    same dtype as the unchunked F.linear, so the loss is within float32 summation round-off of the unchunked
    one (bound 1e-6 relative: 37 terms). Gradients: the chunked ones are computed at unit scale (float32 for
    float16, which keeps the tiny softmax terms the unchunked float16 backward flushes to zero) and rounded once
    to the input dtype; their error against the float64 gradients of the same rounded inputs is at most the
    unchunked one's plus one rounding of the dtype (2**-8 bf16, 2**-11 f16) of the largest gradient. Measured,
    relative to the largest exact gradient (hidden, weight): bf16 chunked 6.0e-3, 3.5e-3, unchunked 4.4e-3,
    2.5e-3 (the unit-scale logit gradient is rounded to bf16 before its matmuls); f16 chunked 4.2e-4, 3.1e-4,
    unchunked 5.0e-4, 3.8e-4; loss relative difference 0 (bf16), 9e-8 (f16)."""
    h, w, t = _inputs(dtype)
    scale = fa.StaticLossScale(2.0**12)
    ref_fn = fa.grad_and_value(lambda p: F.cross_entropy((p["h"] @ p["w"].T).float(), t), scale)
    got_fn = fa.grad_and_value(lambda p: linear_cross_entropy(p["h"], p["w"], t, chunk_size=8), scale)
    ref, ref_loss, ref_ok = ref_fn({"h": h, "w": w})
    got, loss, ok = got_fn({"h": h, "w": w})
    assert bool(ok) and bool(ref_ok)
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * float(ref_loss)
    exact = dict(zip(("h", "w"), _ref(h.double(), w.double(), t)[1:]))
    eps = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    for k in ("h", "w"):
        assert got[k].dtype == dtype
        err, ref_err = (got[k].double() - exact[k]).abs().max(), (ref[k].double() - exact[k]).abs().max()
        assert err <= ref_err + eps * exact[k].abs().max(), (k, float(err), float(ref_err))


def test_float16_overflow_is_a_non_finite_step():
    """float16 with a loss scale too large for float16 (2**30: scale / 37 times a gradient of order 0.1 exceeds
    65504): the gradients come back inf, so grad_and_value reports a non-finite step, as for the unchunked loss;
    never clamped or dropped."""
    h, w, t = _inputs(torch.float16)
    scale = fa.StaticLossScale(2.0**30)
    for loss_fn in (
        lambda p: F.cross_entropy((p["h"] @ p["w"].T).float(), t),
        lambda p: linear_cross_entropy(p["h"], p["w"], t, chunk_size=8),
    ):
        grads, loss, finite = fa.grad_and_value(loss_fn, scale)({"h": h, "w": w})
        assert not bool(finite) and torch.isfinite(loss)
        assert not torch.isfinite(grads["w"]).all() and not torch.isfinite(grads["h"]).all()


def test_in_the_compiled_train_step():
    """A tiny GPT whose forward is the chunked loss, functionalize (bf16 compute), the compiled train step
    (aot_eager, fullgraph, donate): 3 SGD steps (lr 0.1: a parameter difference is lr times the gradients'),
    one graph, close to the eager step with the unchunked loss (bf16 round-off of the gradients; measured max
    parameter difference 3.7e-5 after 3 steps, bound 1e-4)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from gpt import GPT, SIZES

    class HeadLoss(torch.nn.Module):
        def __init__(self, gpt):
            super().__init__()
            self.gpt = gpt

        def forward(self, x, y):
            return linear_cross_entropy(self.gpt.hidden_states(x), self.gpt.lm_head.weight, y, chunk_size=48)

    torch.manual_seed(0)
    gpt = GPT(SIZES["tiny"])
    policy = "params=float32,compute=bfloat16,output=float32"
    chunked, p1 = fa.nn.functionalize(HeadLoss(gpt), policy)
    plain, p0 = fa.nn.functionalize(gpt, policy)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(3)]
    opt = optim.sgd(0.1)
    step1 = fa.make_train_step(lambda p, b: chunked(p, b[:, :-1], b[:, 1:]), opt, backend="aot_eager", donate=True)
    step0 = fa.make_train_step(
        lambda p, b: F.cross_entropy(plain(p, b[:, :-1]).flatten(0, 1).float(), b[:, 1:].flatten()),
        opt,
        compile=False,
    )
    s1 = fa.TrainState.create({k: v.clone() for k, v in p1.items()}, opt, loss_scale=fa.DynamicLossScale(2.0**15))
    s0 = fa.TrainState.create(p0, opt, loss_scale=fa.DynamicLossScale(2.0**15))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for b in batches:
            s1, m1 = step1(s1, b)
            s0, m0 = step0(s0, b)
            assert bool(m1["grads_finite"]) and abs(float(m1["loss"]) - float(m0["loss"])) < 1e-2
    diff = max((s1.params["gpt." + k] - s0.params[k]).abs().max().item() for k in s0.params)
    assert 0 < diff < 1e-4, diff


def test_eager_memory_holds_no_whole_logits():
    """Eager forward + backward of N x V = 2048 x 4096 float32 logits (32 MB each): the unchunked loss allocates
    several of them; chunks of 128 rows (2 MB each) allocate a few chunks and the gradients (V x D float32)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_train_step import profiled_step

    g = torch.Generator().manual_seed(0)
    h = torch.randn(2048, 64, generator=g, requires_grad=True)
    w = torch.randn(4096, 64, generator=g, requires_grad=True)
    t = torch.randint(0, 4096, (2048,), generator=g)
    whole = 2048 * 4096 * 4
    ref, _ = profiled_step(lambda: F.cross_entropy(h @ w.T, t).backward())
    got, _ = profiled_step(lambda: linear_cross_entropy(h, w, t, chunk_size=128).backward())
    assert ref >= 2 * whole and got < whole / 2, (ref / whole, got / whole)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hidden": [[1.0]]}, TypeError, "hidden must be a tensor"),
        ({"weight": torch.zeros(V, D, dtype=torch.float32)}, TypeError, "one floating dtype"),
        ({"hidden": torch.zeros(N, D, dtype=torch.int64)}, TypeError, "one floating dtype"),
        ({"weight": torch.zeros(V, D + 1, dtype=torch.float64)}, ValueError, "do not fit"),
        ({"weight": torch.zeros(V, dtype=torch.float64)}, ValueError, "do not fit"),
        ({"targets": torch.zeros(N, dtype=torch.float32)}, ValueError, "int64 or int32"),
        ({"targets": torch.zeros(N - 1, dtype=torch.int64)}, ValueError, r"of shape \(37,\)"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be an int >= 1"),
        ({"chunk_size": 2.0}, ValueError, "chunk_size must be an int >= 1"),
        ({"ignore_index": None}, TypeError, "ignore_index must be an int"),
        ({"reduction": "none"}, ValueError, "'mean' or 'sum'"),
        ({"targets": torch.full((N,), V)}, ValueError, r"target 50 is outside \[0, 50\)"),
        ({"targets": torch.full((N,), -1)}, ValueError, r"target -1 is outside"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, error, match):
    h, w, t = _inputs()
    args = {"hidden": h, "weight": w, "targets": t, **kwargs}
    rest = {k: args.pop(k) for k in ("chunk_size", "ignore_index", "reduction") if k in args}
    with pytest.raises(error, match=match):
        linear_cross_entropy(args["hidden"], args["weight"], args["targets"], **rest)


@pytest.mark.parametrize("bad", [V, V + 3, -1, -101], ids=["vocab", "vocab+3", "minus1", "below_ignore"])
def test_compiled_bad_target_is_nan_not_a_wrong_number(compiled_grad, bad):
    """Compiled, a target outside [0, vocab) cannot raise (no host sync): the loss and gradients are NaN, so a
    train step sees a non-finite step instead of a loss computed from a clamped index. The edges included: a
    target equal to the vocabulary size (planted, the check off by one, ``t > vocab``: the gather read past the
    row) and -1; only the bad row's gradient is NaN, the other rows' are finite."""
    h, w, t = _inputs()
    t[5] = bad
    (gh, gw), loss = compiled_grad(h, w, t)
    assert loss.isnan() and gh[5].isnan().all() and gw.isnan().any()
    assert torch.isfinite(torch.cat([gh[:5], gh[6:]])).all()
