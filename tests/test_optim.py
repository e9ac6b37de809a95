"""Tests for funcamp.optim: torch.optim parity, dtypes, clipping, schedules, Lion, compile, errors."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from funcamp import _tree, optim

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SHAPES = {"w": (5, 7), "b": (7,), "s": ()}
STEPS = 100
EPS32 = torch.finfo(torch.float32).eps


def _params(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen).to(dtype) for k, s in SHAPES.items()}


def _grad_sequence(n: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(s, generator=gen).to(dtype) for k, s in SHAPES.items()} for _ in range(n)]


def _run(opt: optim.GradientTransformation, params: dict, grads: list[dict]) -> tuple[dict, object]:
    state = opt.init(params)
    for g in grads:
        updates, state = opt.update(g, state, params)
        params = optim.apply_updates(params, updates)
    return params, state


def _run_torch(cls: type, kwargs: dict, params: dict, grads: list[dict]) -> dict:
    tensors = {k: v.clone().requires_grad_() for k, v in params.items()}
    torch_opt = cls(list(tensors.values()), **kwargs)
    for g in grads:
        for k, t in tensors.items():
            t.grad = g[k].clone()
        torch_opt.step()
    return {k: v.detach() for k, v in tensors.items()}


# --- parity with torch.optim -------------------------------------------------------------------------

# torch.optim.AdamW multiplies p by 1 - lr*wd rounded to float32, which misstates the decay by up to
# half an ulp of 1 per step (relative error 2**-24 / (lr*wd)); funcamp adds -lr*wd*p exactly. Where
# lr*wd is not a power of two the two can drift apart by up to STEPS * 2**-24 * |p|.
_ADAMW_DRIFT = STEPS * 2.0**-24 * 4.0

PARITY = [
    ("sgd", optim.sgd(0.05), torch.optim.SGD, dict(lr=0.05), 1e-6),
    ("sgd-momentum", optim.sgd(0.01, 0.9), torch.optim.SGD, dict(lr=0.01, momentum=0.9), 1e-6),
    (
        "sgd-nesterov-wd",
        optim.sgd(0.01, 0.8, nesterov=True, weight_decay=0.1),
        torch.optim.SGD,
        dict(lr=0.01, momentum=0.8, nesterov=True, weight_decay=0.1),
        1e-6,
    ),
    (
        "sgd-momentum-wd",
        optim.sgd(0.02, 0.5, weight_decay=1e-3),
        torch.optim.SGD,
        dict(lr=0.02, momentum=0.5, weight_decay=1e-3),
        1e-6,
    ),
    ("adam", optim.adam(1e-3), torch.optim.Adam, dict(lr=1e-3), 1e-6),
    (
        "adam-betas-eps-wd",
        optim.adam(1e-2, 0.8, 0.99, 1e-6, weight_decay=0.1),
        torch.optim.Adam,
        dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        1e-6,
    ),
    (
        "adam-b1-zero",
        optim.adam(3e-3, 0.0, 0.9, 1e-3),
        torch.optim.Adam,
        dict(lr=3e-3, betas=(0.0, 0.9), eps=1e-3),
        1e-6,
    ),
    ("adamw-default", optim.adamw(1e-3), torch.optim.AdamW, dict(lr=1e-3), _ADAMW_DRIFT),
    (
        "adamw-exact-decay",
        optim.adamw(2**-7, 0.85, 0.995, 1e-7, weight_decay=2**-3),
        torch.optim.AdamW,
        dict(lr=2**-7, betas=(0.85, 0.995), eps=1e-7, weight_decay=2**-3),
        3e-6,
    ),
    (
        "adamw-large-decay",
        optim.adamw(1e-2, 0.9, 0.9, 1e-3, weight_decay=0.5),
        torch.optim.AdamW,
        dict(lr=1e-2, betas=(0.9, 0.9), eps=1e-3, weight_decay=0.5),
        _ADAMW_DRIFT,
    ),
]


@pytest.mark.parametrize("name,ours,cls,kwargs,atol", PARITY, ids=[c[0] for c in PARITY])
def test_matches_torch_optim_over_100_steps(name, ours, cls, kwargs, atol):
    params, grads = _params(), _grad_sequence(STEPS)
    mine, _ = _run(ours, params, grads)
    theirs = _run_torch(cls, kwargs, params, grads)
    moved = max((theirs[k] - params[k]).abs().max().item() for k in params)
    assert moved > 100 * atol, "the reference must move the parameters far beyond the tolerance"
    for k in params:
        assert mine[k].dtype == torch.float32
        torch.testing.assert_close(mine[k] - params[k], theirs[k] - params[k], rtol=1e-5, atol=atol)


def test_adam_bias_correction_counts_from_one():
    # First Adam step moves every coordinate by lr * g / (|g| + eps / sqrt(1 - b2)) ~ lr * sign(g).
    opt = optim.adam(0.1)
    params = {"w": torch.zeros(3)}
    updates, state = opt.update({"w": torch.tensor([2.0, -0.5, 1e-3])}, opt.init(params), params)
    torch.testing.assert_close(updates["w"], torch.tensor([-0.1, 0.1, -0.1]), rtol=1e-4, atol=0)
    assert state[1].count.dtype == torch.int32 and state[1].count.item() == 1


# --- dtypes ------------------------------------------------------------------------------------------

TRANSFORMS = {
    "scale": lambda: optim.scale(0.5),
    "scale_by_adam": lambda: optim.scale_by_adam(eps_root=1e-8),
    "scale_by_lion": optim.scale_by_lion,
    "trace": lambda: optim.trace(0.9),
    "trace-nesterov": lambda: optim.trace(0.9, nesterov=True),
    "add_decayed_weights": lambda: optim.add_decayed_weights(0.1),
    "clip_by_global_norm": lambda: optim.clip_by_global_norm(0.5),
    "scale_by_learning_rate": lambda: optim.scale_by_learning_rate(optim.cosine_decay(0.1, 10)),
    "identity": optim.identity,
    "sgd": lambda: optim.sgd(0.1, 0.9, weight_decay=0.01),
    "adam": lambda: optim.adam(1e-2, weight_decay=0.01),
    "adamw": lambda: optim.adamw(1e-2),
    "lion": lambda: optim.lion(1e-3, weight_decay=0.1),
    "chain": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.linear_warmup(0, 1e-2, 5))),
}


def _state_tensors(state) -> list[torch.Tensor]:
    return [x for x in _tree.tree_leaves(state) if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_every_transform_keeps_every_dtype(name, dtype):
    opt = TRANSFORMS[name]()
    params = _params(dtype)
    state = opt.init(params)
    for g in _grad_sequence(3, dtype):
        updates, state = opt.update(g, state, params)
        for k in params:
            assert updates[k].dtype == dtype, k
            assert torch.isfinite(updates[k].float()).all(), k
        params = optim.apply_updates(params, updates)
        assert {k: v.dtype for k, v in params.items()} == dict.fromkeys(SHAPES, dtype)
    moment_dtype = torch.promote_types(dtype, torch.float32)  # the default: at least float32
    for x in _state_tensors(state):  # moments at least float32; counts int32; rates float32
        assert x.dtype in (moment_dtype, torch.int32) or (x.dtype == torch.float32 and x.ndim == 0)
        if x.ndim > 0:
            assert x.dtype == moment_dtype


MOMENT_OPTS = {
    "scale_by_adam": lambda md: optim.scale_by_adam(moment_dtype=md),
    "scale_by_lion": lambda md: optim.scale_by_lion(moment_dtype=md),
    "trace": lambda md: optim.trace(0.9, moment_dtype=md),
    "sgd": lambda md: optim.sgd(0.1, 0.9, moment_dtype=md),
    "adam": lambda md: optim.adam(1e-2, moment_dtype=md),
    "adamw": lambda md: optim.adamw(1e-2, moment_dtype=md),
    "lion": lambda md: optim.lion(1e-3, moment_dtype=md),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", sorted(MOMENT_OPTS))
def test_bfloat16_moments(name, dtype):
    params, grads = _params(dtype), _grad_sequence(5, dtype)
    opt = MOMENT_OPTS[name](torch.bfloat16)
    state = opt.init(params)
    moments = [x for x in _state_tensors(state) if x.ndim > 0]
    assert moments and all(x.dtype == torch.bfloat16 for x in moments)
    for g in grads:
        updates, state = opt.update(g, state, params)
        assert all(updates[k].dtype == dtype for k in params)
        params = optim.apply_updates(params, updates)
        assert all(params[k].dtype == dtype for k in params)
    assert all(x.dtype == torch.bfloat16 for x in _state_tensors(state) if x.ndim > 0)
    if dtype != torch.float16:  # bf16 moments track full-precision ones to bf16 accuracy
        full, _ = _run(MOMENT_OPTS[name](None), _params(dtype), grads)
        for k in params:
            torch.testing.assert_close(params[k], full[k], rtol=0.0, atol=5e-2 * (1 + full[k].abs().max().item()))


def test_apply_updates_rounds_once_in_float32():
    p = {"w": torch.tensor([1.0, 256.0, -3.0], dtype=torch.bfloat16)}
    u = {"w": torch.tensor([2.0**-9 + 2.0**-12, 1.0, 1e-3], dtype=torch.float32)}
    out = optim.apply_updates(p, u)
    assert out["w"].dtype == torch.bfloat16
    assert torch.equal(out["w"], (p["w"].float() + u["w"]).to(torch.bfloat16))
    assert torch.equal(p["w"], torch.tensor([1.0, 256.0, -3.0], dtype=torch.bfloat16))  # input untouched


# --- clipping ----------------------------------------------------------------------------------------


def test_clip_by_global_norm_examples():
    clip = optim.clip_by_global_norm(1.0)
    state = clip.init({})
    out, _ = clip.update({"g": torch.tensor([3.0, 4.0])}, state)
    torch.testing.assert_close(out["g"], torch.tensor([0.6, 0.8]))
    small = torch.tensor([0.3, 0.4])
    assert torch.equal(clip.update({"g": small}, state)[0]["g"], small)
    split, _ = clip.update({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]], dtype=torch.bfloat16)}, state)
    torch.testing.assert_close(split["a"], torch.tensor([0.6]))
    assert split["b"].dtype == torch.bfloat16 and split["b"].item() == pytest.approx(0.8, abs=4e-3)
    exact = torch.tensor([0.6, 0.8])  # norm exactly max_norm (to float32): unchanged
    assert torch.equal(optim.clip_by_global_norm(5.0).update({"g": exact * 5}, state)[0]["g"], exact * 5)


@settings(max_examples=30, deadline=None)
@given(
    values=st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=8),
    max_norm=st.floats(1e-3, 1e3),
)
def test_clip_by_global_norm_bounds_norm_and_keeps_direction(values, max_norm):
    g = torch.tensor(values)
    out = optim.clip_by_global_norm(max_norm).update({"g": g}, optim.EmptyState())[0]["g"]
    norm = torch.linalg.vector_norm(g)
    if norm <= max_norm:
        assert torch.equal(out, g)
    else:
        assert torch.linalg.vector_norm(out) <= max_norm * (1 + 1e-5)
        torch.testing.assert_close(out * (norm / max_norm), g, rtol=1e-5, atol=1e-6)


# --- schedules ---------------------------------------------------------------------------------------


def _value(schedule, t: int) -> float:
    out = schedule(torch.tensor(t, dtype=torch.int32))
    assert out.dtype == torch.float32 and out.ndim == 0
    return out.item()


def test_warmup_cosine_decay_closed_form():
    peak, warmup, total, init, end = 3e-4, 100, 5000, 1e-5, 1e-6
    schedule = optim.warmup_cosine_decay(peak, warmup, total, init_value=init, end_value=end)

    def expected(t: int) -> float:
        if t < warmup:
            return init + (peak - init) * t / warmup
        frac = min(t - warmup, total - warmup) / (total - warmup)
        return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * frac))

    for t in (0, 1, 50, 99, 100, 101, 2550, 4999, 5000, 7000):
        assert _value(schedule, t) == pytest.approx(expected(t), rel=1e-5, abs=1e-12), t
    assert _value(schedule, 2550) == pytest.approx((peak + end) / 2, rel=1e-5)  # decay midpoint
    assert _value(schedule, 5000) == pytest.approx(end, rel=1e-5)


def test_warmup_cosine_decay_positional_and_no_warmup():
    schedule = optim.warmup_cosine_decay(3e-4, warmup=100, total=5000)
    assert [_value(schedule, t) for t in (0, 100, 5000)] == pytest.approx([0.0, 3e-4, 0.0], abs=1e-10)
    no_warmup = optim.warmup_cosine_decay(1.0, 0, 10)
    assert [_value(no_warmup, t) for t in (0, 5, 10, 11)] == pytest.approx([1.0, 0.5, 0.0, 0.0], abs=1e-6)


def test_linear_schedules_and_cosine_decay_closed_form():
    lin = optim.linear_schedule(2.0, 0.5, 30)
    assert [_value(lin, t) for t in (0, 15, 30, 100)] == pytest.approx([2.0, 1.25, 0.5, 0.5])
    warm = optim.linear_warmup(0.0, 1e-3, 8)
    assert [_value(warm, t) for t in (0, 2, 8, 9)] == pytest.approx([0.0, 2.5e-4, 1e-3, 1e-3])
    cos = optim.cosine_decay(0.1, 40, alpha=0.2)

    def expected(t: int) -> float:
        return 0.1 * (0.8 * 0.5 * (1 + math.cos(math.pi * min(t, 40) / 40)) + 0.2)

    for t in (0, 10, 20, 40, 41, 1000):
        assert _value(cos, t) == pytest.approx(expected(t), rel=1e-6), t
    assert _value(cos, 20) == pytest.approx(0.06) and _value(cos, 1000) == pytest.approx(0.02)
    assert _value(optim.constant(0.25), 12345) == 0.25


def test_learning_rate_recorded_in_state():
    schedule = optim.linear_schedule(1.0, 0.0, 10)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(schedule, 0.9))
    params = {"w": torch.ones(2)}
    state = opt.init(params)
    assert optim.learning_rate(state).item() == 1.0  # schedule(0) before any update
    for n in range(1, 4):
        _, state = opt.update({"w": torch.ones(2)}, state, params)
        lr = optim.learning_rate(state)
        assert lr.dtype == torch.float32 and lr.item() == pytest.approx(1.0 - (n - 1) / 10)
    lr_state = state[1][-1]
    assert isinstance(lr_state, optim.ScaleByLearningRateState) and lr_state.count.dtype == torch.int32
    assert lr_state.count.item() == 3
    no_rate = optim.learning_rate((optim.EmptyState(), {"a": optim.TraceState(trace={"w": torch.ones(1)})}))
    assert torch.isnan(no_rate) and no_rate.dtype == torch.float32 and no_rate.ndim == 0


# --- Lion --------------------------------------------------------------------------------------------


def test_lion_matches_hand_written_reference():
    lr, b1, b2, wd = 1e-2, 0.9, 0.99, 0.3
    params, grads = _params(), _grad_sequence(30)
    mine, state = _run(optim.lion(lr, b1, b2, weight_decay=wd), params, grads)
    ref, m = dict(params), {k: torch.zeros_like(v) for k, v in params.items()}
    for g in grads:
        for k in ref:
            direction = torch.sign(b1 * m[k] + (1 - b1) * g[k])
            ref[k] = ref[k] - lr * (direction + wd * ref[k])
            m[k] = b2 * m[k] + (1 - b2) * g[k]
    for k in params:
        torch.testing.assert_close(mine[k] - params[k], ref[k] - params[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state[0].mu[k], m[k], rtol=1e-5, atol=1e-7)
    assert state[0].count.item() == 30


# --- masks, chain, state round trips -----------------------------------------------------------------


@pytest.mark.parametrize("mask", [{"b": False, "s": True, "w": True}, lambda p: {k: v.ndim > 0 for k, v in p.items()}])
def test_adamw_mask_skips_decay(mask):
    params = _params()
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}  # Adam step of a zero gradient is zero
    opt = optim.adamw(0.1, weight_decay=0.5, mask=mask)
    updates, _ = opt.update(zeros, opt.init(params), params)
    decayed = {"b": False, "s": True, "w": True} if isinstance(mask, dict) else {"b": True, "s": False, "w": True}
    for k, v in params.items():
        torch.testing.assert_close(updates[k], -0.05 * v if decayed[k] else torch.zeros_like(v))


def test_chain_state_and_type_errors():
    opt = optim.chain(optim.scale(2.0), optim.trace(0.5), optim.scale_by_adam())
    state = opt.init({"w": torch.zeros(2)})
    assert isinstance(state, tuple) and len(state) == 3
    assert isinstance(state[0], optim.EmptyState) and isinstance(state[1], optim.TraceState)
    assert isinstance(state[2], optim.ScaleByAdamState)
    with pytest.raises(TypeError, match="argument 1 must be a GradientTransformation"):
        optim.chain(optim.scale(1.0), lambda g: g)
    with pytest.raises(ValueError, match="state has 2 entries but the chain has 3"):
        opt.update({"w": torch.zeros(2)}, state[:2])


def test_empty_tree():
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
    updates, state = opt.update({}, opt.init({}), {})
    assert updates == {} and optim.apply_updates({}, updates) == {}
    assert state[1][0].count.item() == 1


def test_state_round_trips():
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.cosine_decay(1e-3, 10)))
    params = _params()
    _, state = _run(opt, params, _grad_sequence(2))
    leaves, spec = _tree.tree_flatten(state)
    for other in (_tree.tree_unflatten(spec, leaves), copy.deepcopy(state), pickle.loads(pickle.dumps(state))):
        other_leaves, other_spec = _tree.tree_flatten(other)
        assert other_spec == spec and type(other[1][0]) is optim.ScaleByAdamState
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(leaves, other_leaves, strict=True))


# --- torch.compile -----------------------------------------------------------------------------------


def test_compiled_chain_equals_eager_without_recompiles():
    schedule = optim.warmup_cosine_decay(1e-2, warmup=3, total=10)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(schedule, weight_decay=0.1))

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state, optim.learning_rate(state)

    params = {"w": _params()["w"], "b": _params()["b"].to(torch.bfloat16)}
    grads = [{"w": g["w"], "b": g["b"].to(torch.bfloat16)} for g in _grad_sequence(11)]
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_p, eager_s = params, opt.init(params)
    comp_p, comp_s, _ = compiled(params, eager_s, grads[0])
    eager_p, eager_s, _ = step(eager_p, eager_s, grads[0])
    rates = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for g in grads[1:]:
            comp_p, comp_s, comp_lr = compiled(comp_p, comp_s, g)
            eager_p, eager_s, eager_lr = step(eager_p, eager_s, g)
            rates.append(comp_lr.item())
            assert torch.equal(comp_lr, eager_lr)
            for k in params:
                assert comp_p[k].dtype == params[k].dtype
                torch.testing.assert_close(comp_p[k], eager_p[k], rtol=1e-6, atol=1e-7)
    assert len(set(rates)) == len(rates) and rates[-1] == 0.0  # the rate changed every step
    torch.testing.assert_close(comp_s[1][0].nu["w"], eager_s[1][0].nu["w"], rtol=1e-6, atol=1e-9)


# --- bad inputs --------------------------------------------------------------------------------------


def test_apply_updates_mismatched_trees():
    with pytest.raises(ValueError, match=r"same tree structure.*params PyTreeSpec.*'a'.*updates PyTreeSpec.*'c'"):
        optim.apply_updates({"a": torch.ones(1), "b": torch.ones(1)}, {"a": torch.ones(1), "c": torch.ones(1)})
    with pytest.raises(ValueError, match="same tree structure"):
        optim.apply_updates([torch.ones(1)], (torch.ones(1),))
    with pytest.raises(TypeError, match="every param leaf must be a floating-point tensor, got torch.int64"):
        optim.apply_updates({"a": torch.ones(1, dtype=torch.long)}, {"a": torch.ones(1)})


BAD_ARGS = [
    (lambda: optim.sgd(-0.1), "learning_rate must be >= 0, got -0.1"),
    (lambda: optim.adam(-1e-3), "learning_rate must be >= 0"),
    (lambda: optim.adamw(float("nan")), "learning_rate must be a finite real number"),
    (lambda: optim.lion(-1.0), "learning_rate must be >= 0"),
    (lambda: optim.adam(1e-3, eps=-1e-8), "eps must be >= 0, got -1e-08"),
    (lambda: optim.scale_by_adam(eps_root=-1.0), "eps_root must be >= 0"),
    (lambda: optim.adam(1e-3, b1=1.0), r"b1 must be in \[0, 1\), got 1.0"),
    (lambda: optim.adamw(1e-3, b2=1.5), r"b2 must be in \[0, 1\), got 1.5"),
    (lambda: optim.adamw(1e-3, b1=-0.1), r"b1 must be in \[0, 1\)"),
    (lambda: optim.lion(1e-3, b2=1.0), r"b2 must be in \[0, 1\)"),
    (lambda: optim.sgd(0.1, momentum=-0.9), "momentum must be >= 0"),
    (lambda: optim.sgd(0.1, nesterov=True), "nesterov=True needs momentum > 0"),
    (lambda: optim.adamw(1e-3, weight_decay=-0.1), "weight_decay must be >= 0"),
    (lambda: optim.adam(1e-3, moment_dtype=torch.int32), "moment_dtype must be None or a floating torch.dtype"),
    (lambda: optim.clip_by_global_norm(0.0), "max_norm must be > 0, got 0.0"),
    (lambda: optim.linear_schedule(1.0, 0.0, -5), "transition_steps must be an integer >= 1, got -5"),
    (lambda: optim.linear_warmup(0.0, 1.0, 0), "warmup_steps must be an integer >= 1, got 0"),
    (lambda: optim.cosine_decay(1.0, 0), "decay_steps must be an integer >= 1"),
    (lambda: optim.cosine_decay(1.0, 10, alpha=1.5), r"alpha must be in \[0, 1\]"),
    (lambda: optim.warmup_cosine_decay(1e-3, warmup=-1, total=10), "warmup must be an integer >= 0, got -1"),
    (lambda: optim.warmup_cosine_decay(1e-3, warmup=10, total=10), "total must be greater than warmup"),
    (lambda: optim.warmup_cosine_decay(1e-3, warmup=1, total=2.5), "total must be an integer >= 1, got 2.5"),
]


@pytest.mark.parametrize("make,message", BAD_ARGS, ids=[m for _, m in BAD_ARGS])
def test_bad_arguments_raise_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_types_and_missing_params():
    with pytest.raises(TypeError, match="learning_rate must be a float >= 0 or a schedule"):
        optim.sgd("0.1")
    opt = optim.add_decayed_weights(0.1)
    with pytest.raises(ValueError, match=r"needs the parameters: call update\(updates, state, params\)"):
        opt.update({"w": torch.ones(1)}, opt.init({}))
    masked = optim.add_decayed_weights(0.1, mask={"w": torch.tensor(True)})
    with pytest.raises(TypeError, match="mask leaves must be Python bools"):
        masked.update({"w": torch.ones(1)}, optim.EmptyState(), {"w": torch.ones(1)})
    adam = optim.scale_by_adam()
    with pytest.raises(ValueError, match="updates and optimizer state must have the same structure"):
        adam.update({"v": torch.ones(1)}, adam.init({"w": torch.ones(1)}))


def test_adam_adds_nothing_under_the_root_without_eps_root():
    """``eps_root=0`` (the default) adds no ``0 * bc2`` under the square root: the same bits (``v >= +0``) and one
    graph node fewer per leaf, or per flat buffer of a compiled step (62 in GPT-2 124M's). Planted: the add kept
    for ``eps_root=0``, the counts are equal and this fails."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def adds(eps_root: float) -> int:
        opt = optim.scale_by_adam(eps_root=eps_root)
        state = opt.init({"w": torch.zeros(4)})
        graph = make_fx(lambda g, s: opt.update(g, s))({"w": torch.ones(4)}, state).graph
        return sum(node.target is torch.ops.aten.add.Tensor for node in graph.nodes)

    assert adds(0.0) == adds(1e-8) - 1
