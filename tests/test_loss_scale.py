"""Loss scales: trajectories against jmp (golden) and torch.amp.GradScaler (live), floors, round trips."""

import copy
import io
import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import funcamp as fa
from funcamp import _tree

GOLDEN = json.loads((Path(__file__).parent / "golden" / "jmp_loss_scale.json").read_text())
CASES = {c["name"]: c for c in GOLDEN["cases"]}
TRUE, FALSE = torch.tensor(True), torch.tensor(False)


def _run(loss_scale, flags, adjust=None):
    adjust = adjust or (lambda ls, f: ls.adjust(f))
    scales, counters = [], []
    for flag in flags:
        loss_scale = adjust(loss_scale, TRUE if flag else FALSE)
        scales.append(float(loss_scale.loss_scale))
        counters.append(int(loss_scale.counter))
    return scales, counters


@pytest.mark.parametrize("name", [n for n in CASES if n != "k_initial_below_floor"])
def test_trajectory_equals_jmp(name):
    # Golden data: tests/golden/jmp_loss_scale.json, jmp 0.0.4 DynamicLossScale.adjust run step by step
    # (un-jitted) by tools/make_jmp_golden.py. Defaults differ from jmp only in spelling: factor ->
    # growth_factor, and backoff_factor=None divides by it exactly as jmp does.
    case = CASES[name]
    loss_scale = fa.DynamicLossScale(
        case["initial_scale"],
        period=case["period"],
        growth_factor=float(case["factor"]),
        min_loss_scale=case["min_loss_scale"],
    )
    flags = [c == "1" for c in case["flags"]]
    scales, counters = _run(loss_scale, flags)
    assert scales == case["scales"]
    assert counters == case["counters"]


def test_golden_cases_exercise_growth_backoff_floor_and_saturation():
    saturate = CASES["f_saturate_2pow127"]["scales"]
    assert max(saturate) == 2.0**127 and all(np.isfinite(saturate))
    assert min(CASES["g_backoff_to_floor"]["scales"]) == 1.0
    assert min(CASES["h_tiny_floor"]["scales"]) == 2.0**-10
    assert len(set(CASES["a_defaults_p0.001"]["scales"])) > 1


FLAX = json.loads((Path(__file__).parent / "golden" / "flax_dynamic_scale.json").read_text())
F32_MAX = torch.finfo(torch.float32).max


def _unrle(pairs):
    return [v for v, n in pairs for _ in range(n)]


def _flax_in_funcamp(settings):
    """flax's DynamicScale settings spelled in funcamp's names (the DynamicLossScale docstring's recipe)."""
    return fa.DynamicLossScale(
        settings["scale"],
        period=settings["growth_interval"] + 1,
        growth_factor=settings["growth_factor"],
        backoff_factor=settings["backoff_factor"],
        min_loss_scale=settings["minimum_scale"],
        max_loss_scale=F32_MAX,
    )


@pytest.mark.parametrize("name", list(FLAX["cases"]))
def test_trajectory_equals_flax_dynamic_scale(name):
    """Golden data: tests/golden/flax_dynamic_scale.json, flax 0.12.8's DynamicScale.value_and_grad run step by
    step by tools/make_flax_golden.py; flax's growth_interval=N is period=N + 1, its floor float32's tiny, its
    cap float32's max. Every scale equal, and flax's fin_steps equal to the counter."""
    case = FLAX["cases"][name]
    assert (
        FLAX["flax_version"] == "0.12.8" and case["flax_settings"]["minimum_scale"] == torch.finfo(torch.float32).tiny
    )
    for run in case["runs"]:
        flags = _unrle(run["finite"])
        scales, counters = _run(_flax_in_funcamp(case["flax_settings"]), flags)
        assert scales == _unrle(run["scales"]), (name, run["seed"])
        assert [i for i, c in enumerate(counters) if c == 0] == run["fin_steps_zero_at"], (name, run["seed"])
        assert all(c == 0 or c == prev + 1 for prev, c in zip([0, *counters], counters)), (name, run["seed"])


def test_flax_golden_cases_grow_after_interval_plus_one_and_reach_the_floor_and_the_cap():
    """The trajectories exercise each spelling: growth after growth_interval + 1 finite steps (period=N, as
    GradScaler's growth_interval=N would suggest, gives another trajectory), the float32-tiny floor (it is
    reached: another floor gives another trajectory), the cap at float32's max (without max_loss_scale funcamp
    keeps 2**127)."""

    def case(name, i):
        c = FLAX["cases"][name]
        return c["flax_settings"], _unrle(c["runs"][i]["finite"]), _unrle(c["runs"][i]["scales"])

    assert FLAX["flax_defaults"]["growth_interval"] == 2000 and FLAX["flax_defaults"]["scale"] == 2.0**16
    assert FLAX["cases"]["defaults"]["runs"][0]["scales"] == [
        [65536.0, 2000],
        [131072.0, 100],
    ]  # all finite: 2001st grows
    settings, flags, scales = case("interval_3_factor_3_backoff_0.25", 0)  # all finite
    assert scales[:5] == [1000.0] * 3 + [3000.0] * 2
    period_n = dict(settings, growth_interval=settings["growth_interval"] - 1)
    assert _run(_flax_in_funcamp(period_n), flags)[0] != scales
    settings, flags, scales = case("interval_2_near_the_floor", 0)
    assert min(scales) == 2.0**-126
    assert _run(_flax_in_funcamp(dict(settings, minimum_scale=2.0**-125)), flags)[0] != scales  # (1 is above its start)
    settings, flags, scales = case("interval_0_near_the_top", 1)
    assert max(scales) == F32_MAX
    no_cap = fa.DynamicLossScale(settings["scale"], period=1, backoff_factor=0.5, min_loss_scale=2.0**-126)
    assert max(_run(no_cap, flags)[0]) == 2.0**127


def test_initial_scale_below_floor_is_refused():
    # jmp accepts it and its first backoff *raises* the scale to the floor (golden case k); funcamp refuses.
    case = CASES["k_initial_below_floor"]
    assert case["scales"][case["flags"].index("0")] == 1.0
    with pytest.raises(ValueError, match="min_loss_scale"):
        fa.DynamicLossScale(0.5)


def test_initial_scale_above_cap_is_refused():
    # Issue 11.8: accepted before, and the first growth step *shrank* it to the cap (2**20 -> 1024).
    with pytest.raises(ValueError, match="max_loss_scale"):
        fa.DynamicLossScale(2.0**20, period=1, max_loss_scale=2.0**10)
    at_cap = fa.DynamicLossScale(2.0**10, period=1, max_loss_scale=2.0**10)
    assert at_cap.adjust(torch.tensor(True)).loss_scale.item() == 2.0**10
    assert fa.DynamicLossScale(2.0**20, max_loss_scale=math.inf).loss_scale.item() == 2.0**20


def _grad_scaler_trajectory(init, interval, flags):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=interval)
    scales, counters = [], []
    for flag in flags:
        scaler.scale((param * 0).sum())  # what a training loop scales; sets up the scaler's state
        param.grad = torch.ones(1) if flag else torch.full((1,), float("inf"))
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        counters.append(int(scaler._growth_tracker))
    return scales, counters


@pytest.mark.parametrize(
    "init, period, p_nonfinite, seed",
    [(2.0**15, 1, 0.5, 0), (2.0**15, 2, 0.3, 1), (2.0**10, 5, 0.1, 2), (2.0**15, 2000, 0.0005, 3), (1.0, 3, 0.2, 4)],
)
def test_trajectory_equals_torch_amp_grad_scaler(init, period, p_nonfinite, seed):
    # GradScaler has no floor and multiplies by backoff_factor=0.5: funcamp with those options matches.
    flags = (np.random.RandomState(seed).random_sample(2500) >= p_nonfinite).tolist()
    expected = _grad_scaler_trajectory(init, period, flags)
    ours = fa.DynamicLossScale(init, period=period, growth_factor=2.0, backoff_factor=0.5, min_loss_scale=2.0**-126)
    assert _run(ours, flags) == expected
    assert len(set(expected[0])) >= 2  # the scale really moved


def _overflow_loss(params):
    """Loss 1000 (finite in float16) whose gradient, 100000, overflows float16 at any scale >= 1 but not at 0.5."""
    h = params["w"].half() * torch.tensor(250.0, dtype=torch.float16)
    return (h * torch.tensor(400.0, dtype=torch.float16)).sum()


PARAMS = {"w": torch.full((1,), 0.01)}


def _overflowing_grad(scale_value, min_loss_scale=1.0):
    loss_scale = fa.DynamicLossScale(scale_value, period=2000, min_loss_scale=min_loss_scale)
    return fa.grad_and_value(_overflow_loss, loss_scale)(PARAMS), loss_scale


def test_floor_below_one_lets_an_overflowing_model_recover():
    out, loss_scale = _overflowing_grad(1.0, min_loss_scale=2.0**-10)
    assert not out.grads_finite
    loss_scale = loss_scale.adjust(out.grads_finite)
    assert float(loss_scale.loss_scale) == 0.5
    out = fa.grad_and_value(_overflow_loss, loss_scale)(PARAMS)
    assert out.grads_finite
    # 0.5 * 400 * 250 = 50000 rounds to 49984 in float16 (spacing 32 there); unscaled: 99968.
    assert out.grads["w"].item() == 99968.0 and torch.isfinite(out.value)


def test_default_floor_keeps_overflowing_forever():
    out, loss_scale = _overflowing_grad(1.0)
    for _ in range(5):
        assert not out.grads_finite
        loss_scale = loss_scale.adjust(out.grads_finite)
        assert float(loss_scale.loss_scale) == 1.0


def test_unscale_happens_in_float32():
    loss_scale = fa.StaticLossScale(2.0**15)
    scaled = (torch.tensor(0.003, dtype=torch.float16) * 2**15).to(torch.float16)
    unscaled = loss_scale.unscale({"g": scaled})["g"]
    assert unscaled.dtype == torch.float32
    assert abs(unscaled.item() - 0.0030003) < 1e-7
    assert fa.all_finite(unscaled)
    overflowed = (torch.tensor(3.0, dtype=torch.float16) * 2**15).to(torch.float16)
    assert torch.isinf(overflowed)
    assert not fa.all_finite(loss_scale.unscale(overflowed))


def test_scale_is_float32_even_where_float16_cannot_hold_it():
    loss_scale = fa.DynamicLossScale(2.0**16)
    assert loss_scale.loss_scale.dtype == torch.float32 and loss_scale.loss_scale.ndim == 0
    assert torch.isinf(torch.tensor(2.0**16, dtype=torch.float16))
    assert loss_scale.scale(torch.tensor(1.0, dtype=torch.float16)).item() == 2.0**16
    with pytest.raises(TypeError, match="float32"):
        fa.DynamicLossScale(torch.tensor(2.0**15, dtype=torch.float16))


def test_float64_leaves_stay_float64_and_ints_pass_through():
    loss_scale = fa.StaticLossScale(4.0)
    tree = {"a": torch.tensor(1.0, dtype=torch.float64), "n": torch.tensor(3), "s": "x"}
    scaled = loss_scale.scale(tree)
    assert scaled["a"].dtype == torch.float64 and scaled["a"].item() == 4.0
    assert scaled["n"] is tree["n"] and scaled["s"] == "x"
    assert loss_scale.unscale(scaled)["a"].item() == 1.0


def test_noop_and_static_never_change():
    for loss_scale in (fa.NoOpLossScale(), fa.StaticLossScale(128.0)):
        assert loss_scale.adjust(FALSE) is loss_scale
        assert loss_scale.adjust(TRUE) is loss_scale
    noop = fa.NoOpLossScale()
    x = torch.ones(2, dtype=torch.float16)
    assert noop.scale(x) is x and noop.unscale(x) is x
    assert noop.loss_scale.dtype == torch.float32 and noop.loss_scale.item() == 1.0


def test_growth_capped_by_max_loss_scale():
    loss_scale = fa.DynamicLossScale(2.0**14, period=1, max_loss_scale=2.0**15)
    scales, _ = _run(loss_scale, [True] * 4)
    assert scales == [2.0**15] * 4


def test_backoff_factor_and_growth_factor():
    loss_scale = fa.DynamicLossScale(1024.0, period=2, growth_factor=4.0, backoff_factor=0.25)
    scales, counters = _run(loss_scale, [True, True, False, True])
    assert scales == [1024.0, 4096.0, 1024.0, 1024.0]
    assert counters == [1, 0, 0, 1]


def test_hysteresis_tolerates_consecutive_overflows():
    loss_scale = fa.DynamicLossScale(1024.0, period=100, hysteresis=3)
    flags = [False, False, True, False, False, False, False, True, False]
    scales, counters = _run(loss_scale, flags)
    # Two overflows tolerated; a finite step resets; the third in a row backs off, and so does each next one.
    assert scales == [1024.0, 1024.0, 1024.0, 1024.0, 1024.0, 512.0, 256.0, 256.0, 256.0]
    assert counters == [0, 0, 1, 0, 0, 0, 0, 1, 0]


def test_round_trips_keep_every_field():
    states = [
        fa.NoOpLossScale(),
        fa.StaticLossScale(512.0),
        fa.DynamicLossScale(
            1024.0,
            period=7,
            growth_factor=3.0,
            backoff_factor=0.25,
            min_loss_scale=2.0**-10,
            max_loss_scale=2.0**20,
            hysteresis=2,
        ).adjust(TRUE),
    ]
    for state in states:
        leaves, spec = _tree.tree_flatten(state)
        for other in (
            _tree.tree_unflatten(spec, leaves),
            copy.deepcopy(state),
            pickle.loads(pickle.dumps(state)),
            _tree.tree_map(lambda x: x.clone(), state),
        ):
            _assert_same(other, state)
        buffer = io.BytesIO()
        torch.save(state.state_dict(), buffer)
        buffer.seek(0)
        _assert_same(fa.loss_scale_from_state_dict(torch.load(buffer, weights_only=True)), state)


def _assert_same(a, b):
    assert type(a) is type(b)
    for name in vars(b):
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(y, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), name
        else:
            assert x == y and type(x) is type(y), name


def test_checkpoint_at_1024_counter_1_resumes_exactly():
    loss_scale = fa.DynamicLossScale(1024.0, period=2).adjust(TRUE)
    assert (float(loss_scale.loss_scale), int(loss_scale.counter)) == (1024.0, 1)
    buffer = io.BytesIO()
    torch.save(loss_scale.state_dict(), buffer)
    buffer.seek(0)
    loaded = fa.loss_scale_from_state_dict(torch.load(buffer, weights_only=True))
    assert (float(loaded.loss_scale), int(loaded.counter), loaded.period) == (1024.0, 1, 2)
    nxt = loaded.adjust(TRUE)
    assert (float(nxt.loss_scale), int(nxt.counter)) == (2048.0, 0)


def test_state_dict_errors():
    with pytest.raises(ValueError, match="unknown type"):
        fa.loss_scale_from_state_dict({"type": "GradScaler"})
    with pytest.raises(ValueError, match="bad fields"):
        fa.loss_scale_from_state_dict({"type": "DynamicLossScale", "scale": torch.tensor(1.0)})


def test_adjust_is_immutable():
    loss_scale = fa.DynamicLossScale(8.0, period=1)
    before = loss_scale.loss_scale.clone()
    grown = loss_scale.adjust(TRUE)
    assert grown is not loss_scale and float(grown.loss_scale) == 16.0
    assert torch.equal(loss_scale.loss_scale, before)
    with pytest.raises(AttributeError):
        loss_scale.loss_scale = torch.tensor(1.0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_adjust_compiles_without_recompiling(backend):
    torch._dynamo.reset()
    adjust = torch.compile(lambda ls, f: ls.adjust(f), fullgraph=True, backend=backend)
    case = CASES["c_period2_p0.3"]
    flags = [c == "1" for c in case["flags"][:40]]
    loss_scale = fa.DynamicLossScale(case["initial_scale"], period=2)
    with torch._dynamo.config.patch(error_on_recompile=True):
        scales, counters = _run(loss_scale, flags, adjust)
    assert scales == case["scales"][:40] and counters == case["counters"][:40]


def test_to_moves_state():
    loss_scale = fa.DynamicLossScale(4.0).to("cpu")
    assert loss_scale.loss_scale.device.type == "cpu" and loss_scale.counter.dtype == torch.int32


@pytest.mark.parametrize("bad", ["1024", b"2", True])
def test_strings_and_bools_are_not_scales(bad):
    with pytest.raises(TypeError, match="loss_scale must be"):
        fa.StaticLossScale(bad)
    with pytest.raises(TypeError, match="loss_scale must be"):
        fa.DynamicLossScale(bad)


# Issue 26, item 5: the initial scale's range held for tensors as for Python numbers. On the code before,
# every tensor case of this sweep was accepted (12 of 24 cases failed); a tensor scale above the cap was
# then *shrunk* to it by the first growth step.
_OUT_OF_RANGE = {
    "dynamic": (dict(max_loss_scale=2.0**20), [2.0**21, 0.5, 0.0, -4.0, math.inf, math.nan]),
    "static": (dict(), [0.0, -1.0, 2.0**-127, math.inf, -math.inf, math.nan]),
}


@pytest.mark.parametrize("as_tensor", [False, True], ids=["number", "tensor"])
@pytest.mark.parametrize("kind", list(_OUT_OF_RANGE))
def test_initial_scale_out_of_range_is_refused(kind, as_tensor):
    options, values = _OUT_OF_RANGE[kind]
    cls = fa.DynamicLossScale if kind == "dynamic" else fa.StaticLossScale
    for value in values:
        scale = torch.tensor(value, dtype=torch.float32) if as_tensor else value
        with pytest.raises(ValueError, match="loss_scale must be"):
            cls(scale, **options)


def test_handed_tensor_scale_above_cap():
    """``DynamicLossScale(torch.tensor(2.0**21), max_loss_scale=2.0**20)``: refused, like the number 2**21."""
    with pytest.raises(ValueError, match=r"<= max_loss_scale=1048576.0, got 2097152.0"):
        fa.DynamicLossScale(torch.tensor(2.0**21), max_loss_scale=2.0**20)
    at_cap = fa.DynamicLossScale(torch.tensor(2.0**20), max_loss_scale=2.0**20, period=1)
    assert float(at_cap.adjust(TRUE).loss_scale) == 2.0**20  # growth never lowers the scale


def test_device_scale_checked_once_by_train_state(monkeypatch):
    """A scale the constructor cannot read for free (a device tensor) is read once by TrainState.create."""
    from funcamp import loss_scale as ls_module
    from funcamp import optim

    monkeypatch.setattr(ls_module, "_initial_value", lambda x: None)  # as for a CUDA tensor
    unchecked = fa.DynamicLossScale(torch.tensor(2.0**21), max_loss_scale=2.0**20)
    with pytest.raises(ValueError, match="max_loss_scale"):
        fa.TrainState.create({"w": torch.zeros(2)}, optim.sgd(0.1), loss_scale=unchecked)
    with pytest.raises(ValueError, match="positive and finite"):
        fa.TrainState.create({"w": torch.zeros(2)}, optim.sgd(0.1), loss_scale=fa.StaticLossScale(torch.tensor(0.0)))
    fa.TrainState.create({"w": torch.zeros(2)}, optim.sgd(0.1), loss_scale=fa.DynamicLossScale(torch.tensor(8.0)))


def test_rebuilt_scales_are_not_read_in_the_traced_step():
    """adjust and unflatten inside torch.compile rebuild the scale from traced tensors: nothing read, one graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    adjust = torch.compile(lambda ls, f: ls.adjust(f), fullgraph=True, backend=counter)
    ls = fa.DynamicLossScale(torch.tensor(2.0**10), period=1, max_loss_scale=2.0**12)
    for flag in (TRUE, TRUE, TRUE, torch.tensor(False)):
        ls = adjust(ls, flag)
    assert counter.frame_count == 1 and float(ls.loss_scale) == 2.0**11


def test_a_grad_scaler_growth_factor_in_the_counter_place_gets_the_order_hint():
    """``DynamicLossScale(65536.0, 2)``, a GradScaler user's growth factor as the second positional argument, is
    jmp's counter there and in range: it warns with the positional-order hint that ``(65536.0, 2000)`` raises with;
    ``(65536.0, 2.0)`` raises with it. A counter given as a tensor (jmp's tests, checkpoints, ``adjust``, pickling)
    or 0 is taken silently. (Issue 47 item 6.)"""
    import copy
    import pickle
    import warnings

    hint = r"the positional order is jmp's, DynamicLossScale\(loss_scale, counter, period, growth_factor"
    with pytest.warns(UserWarning, match=hint + r".*For a growth factor write growth_factor=2"):
        scale = fa.DynamicLossScale(65536.0, 2)
    assert int(scale.counter) == 2 and scale.growth_factor == 2.0
    with pytest.raises(TypeError, match=r"counter must be .* got 2.0; " + hint):
        fa.DynamicLossScale(65536.0, 2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mid = fa.DynamicLossScale(65536.0, torch.tensor(2, dtype=torch.int32))
        fa.DynamicLossScale(65536.0, 0)
        for again in (mid.adjust(torch.tensor(True)), copy.deepcopy(mid), pickle.loads(pickle.dumps(mid))):
            assert int(again.counter) in (2, 3)
        leaves, spec = _tree.tree_flatten(mid)
        assert int(_tree.tree_unflatten(spec, leaves).counter) == 2
