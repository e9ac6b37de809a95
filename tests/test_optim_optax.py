"""funcamp's optimizers against optax's own numbers: the arguments optax users pass and the trees they write.

Golden data: ``tests/golden/optax_trajectories.json``, optax 0.2.8 run by ``tools/make_optax_golden.py``
(its ``init``/``update``/``apply_updates`` from fixed parameters and gradients, float32 and float64, and its
schedules step by step). Each optimizer case is built here the way its ``funcamp`` entry in the file says.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from funcamp import optim

GOLDEN = json.loads((Path(__file__).parent / "golden" / "optax_trajectories.json").read_text())
DTYPES = {"float32": torch.float32, "float64": torch.float64}

# What each optax case is in funcamp (the golden file's "funcamp" entries say the same).
LABELS = {"enc": "slow", "dec": {"w": "fast", "b": "frozen"}}
OPTIMIZERS = {
    "adam_eps_root": lambda: optim.adam(0.05, 0.9, 0.999, 1e-8, 1e-3),
    "adam_nesterov": lambda: optim.adam(0.05, nesterov=True),
    "nadam": lambda: optim.adam(0.05, 0.8, 0.99, nesterov=True),
    "adamw_nesterov_eps_root": lambda: optim.adamw(0.05, 0.9, 0.99, 1e-6, 1e-4, weight_decay=0.1, nesterov=True),
    "adamw_prefix_mask": lambda: optim.adamw(0.1, weight_decay=0.5, mask={"enc": False, "dec": True}),
    "masked_prefix": lambda: optim.masked(optim.sgd(0.1, momentum=0.9), {"enc": True, "dec": {"w": False, "b": True}}),
    "masked_prefix_extra_args_false": lambda: optim.masked(
        optim.adam(0.1), {"enc": False, "dec": True}, mask_compatible_extra_args=False
    ),
    "multi_transform_prefix": lambda: optim.multi_transform(
        {"slow": optim.adam(0.01), "fast": optim.sgd(0.1), "frozen": optim.set_to_zero()}, LABELS
    ),
    "adamw_warmup_cosine_exponent": lambda: optim.adamw(
        optim.warmup_cosine_decay(0.1, 3, 10, end_value=0.01, exponent=2.0), weight_decay=0.1
    ),
}
SCHEDULES = {
    "wcd_exponent_2": lambda: optim.warmup_cosine_decay(1.0, 5, 25, end_value=0.1, exponent=2.0),
    "wcd_exponent_0.5": lambda: optim.warmup_cosine_decay(1.0, 5, 25, init_value=0.2, exponent=0.5),
    "wcd_peak_0": lambda: optim.warmup_cosine_decay(0.0, 5, 25),
    "wcd_peak_0_init_0.1": lambda: optim.warmup_cosine_decay(0.0, 5, 25, init_value=0.1),
    "wcd_no_warmup_exponent_3": lambda: optim.warmup_cosine_decay(2.0, 0, 20, end_value=0.5, exponent=3.0),
    "cosine_exponent_2": lambda: optim.cosine_decay(1.0, 20, 0.1, 2.0),
}
# The parameters move by up to 1.5 over the 10 steps. float32: optax rounds 1 - b2**t in float32 (1 - 0.999 is off
# by 1.3e-5 relatively; funcamp computes -expm1(t log b2), see scale_by_adam): 4.4e-6 apart at most, measured.
# float64: funcamp's bias corrections are float32 tensors (one float32 ulp, 6e-8 relatively): 2.7e-8 at most.
TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "float64": dict(rtol=1e-6, atol=1e-7)}


def _tensors(tree, dtype):
    return {g: {n: torch.tensor(v, dtype=dtype) for n, v in d.items()} for g, d in tree.items()}


def _leaves(tree):
    return {f"{g}.{n}": v for g, d in tree.items() for n, v in d.items()}


def test_the_golden_file_has_every_case_and_only_those():
    for dtype in DTYPES:
        assert set(GOLDEN[dtype]["cases"]) == set(OPTIMIZERS), dtype
        assert set(GOLDEN[dtype]["schedules"]) == {*SCHEDULES, "wcd_peak_0_end_0.1"}, dtype
    assert GOLDEN["optax_version"] == "0.2.8" and GOLDEN["steps"] == 10


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_trajectory_matches_optax(name, dtype):
    """10 steps on a nested dict of parameters; the change from the initial parameters is compared, so that a
    parameter that must not move (a masked-out or frozen group) is checked exactly."""
    torch_dtype = DTYPES[dtype]
    p0 = _tensors(GOLDEN["params"], torch_dtype)
    opt = OPTIMIZERS[name]()
    params, state = p0, opt.init(p0)
    for step, (g, expected) in enumerate(zip(GOLDEN["grads"], GOLDEN[dtype]["cases"][name]["params_after_each_step"])):
        updates, state = opt.update(_tensors(g, torch_dtype), state, params)
        params = optim.apply_updates(params, updates)
        want, start = _leaves(_tensors(expected, torch_dtype)), _leaves(p0)
        for key, p in _leaves(params).items():
            assert p.dtype == torch_dtype
            moved, want_moved = p - start[key], want[key] - start[key]
            torch.testing.assert_close(moved, want_moved, **TOL[dtype], msg=f"{name} {key} {step}")


def test_the_cases_move_and_differ_from_their_plain_forms():
    """The golden trajectories are not what the plain optimizer gives: eps_root, nesterov and the exponent change
    the numbers (so the parity above tests them), and the prefix trees reach the leaves below them."""
    p0 = _tensors(GOLDEN["params"], torch.float64)
    last = {
        k: _leaves(_tensors(c["params_after_each_step"][-1], torch.float64))
        for k, c in GOLDEN["float64"]["cases"].items()
    }
    plain = {
        "adam_eps_root": optim.adam(0.05),
        "adam_nesterov": optim.adam(0.05),
        "adamw_nesterov_eps_root": optim.adamw(0.05, 0.9, 0.99, 1e-6, weight_decay=0.1),
        "adamw_warmup_cosine_exponent": optim.adamw(
            optim.warmup_cosine_decay(0.1, 3, 10, end_value=0.01), weight_decay=0.1
        ),
    }
    for name, opt in plain.items():
        params, state = p0, opt.init(p0)
        for g in GOLDEN["grads"]:
            updates, state = opt.update(_tensors(g, torch.float64), state, params)
            params = optim.apply_updates(params, updates)
        gap = max((last[name][k] - v).abs().max().item() for k, v in _leaves(params).items())
        assert gap > 1e-4, (name, gap)
    # optax's masked passes the masked-out updates through: dec.w moves by the raw gradients, in float64 exactly
    start, passed = _leaves(p0), _leaves(p0)["dec.w"]
    for g in GOLDEN["grads"]:
        passed = passed + torch.tensor(g["dec"]["w"], dtype=torch.float64)
    assert torch.equal(last["masked_prefix"]["dec.w"], passed)
    for key in start:  # set_to_zero's group stays still
        assert torch.equal(last["multi_transform_prefix"][key], start[key]) == (key == "dec.b"), key


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_matches_optax(name):
    schedule = SCHEDULES[name]()
    for dtype, rtol in (("float32", 1e-6), ("float64", 1e-6)):
        want = torch.tensor(GOLDEN[dtype]["schedules"][name]["values_at_steps_0_to_29"], dtype=torch.float64)
        got = torch.stack([schedule(torch.tensor(t, dtype=torch.int32)) for t in range(30)]).double()
        torch.testing.assert_close(got, want, rtol=rtol, atol=1e-7, msg=f"{name} against optax's {dtype} values")


def test_peak_zero_is_zero_after_warmup_as_optax_and_a_nonzero_end_is_refused():
    """optax's warmup_cosine_decay_schedule(peak_value=0) is 0 from the warmup's end on, whatever end_value says
    (golden: wcd_peak_0_end_0.1 is all zeros); funcamp gives those numbers for end_value=0 and refuses the rest."""
    optax_values = GOLDEN["float32"]["schedules"]["wcd_peak_0_end_0.1"]["values_at_steps_0_to_29"]
    assert optax_values == [0.0] * 30
    zero = optim.warmup_cosine_decay(0.0, 5, 25)
    assert all(float(zero(t)) == 0.0 for t in range(30))
    with pytest.raises(ValueError, match=r"peak_value=0 with end_value=0.1 is refused: optax's .* drops end_value"):
        optim.warmup_cosine_decay(0.0, 5, 25, end_value=0.1)
    assert float(optim.warmup_cosine_decay(0.0, 5, 25, init_value=0.1)(2)) == pytest.approx(0.06)  # the warmup line


def test_exponent_is_refused_where_it_is_not_a_positive_number():
    for bad in (0.0, -1.0, float("inf"), float("nan"), "2"):
        with pytest.raises(ValueError, match=r"exponent must be"):
            optim.warmup_cosine_decay(1.0, 1, 10, exponent=bad)
        with pytest.raises(ValueError, match=r"exponent must be"):
            optim.cosine_decay(1.0, 10, 0.0, bad)


def test_exponent_one_is_the_plain_cosine_bitwise():
    for t in range(25):
        assert torch.equal(
            optim.warmup_cosine_decay(1.0, 3, 20, exponent=1.0)(t), optim.warmup_cosine_decay(1.0, 3, 20)(t)
        )


def test_nesterov_and_eps_root_arguments():
    with pytest.raises(TypeError, match=r"scale_by_adam: nesterov must be a bool"):
        optim.adam(0.1, nesterov=1)
    with pytest.raises(ValueError, match=r"eps_root must be >= 0"):
        optim.adamw(0.1, 0.9, 0.999, 1e-8, -1e-3)
    # optax's sixth positional argument is mu_dtype: refused, not read as another argument
    with pytest.raises(TypeError, match=r"takes from 1 to 5 positional arguments but 6 were given"):
        optim.adam(0.1, 0.9, 0.999, 1e-8, 0.0, None)


def test_nesterov_compiles_without_recompiling_as_the_count_advances():
    opt = optim.adam(0.1, nesterov=True, eps_root=1e-8)
    params = {"w": torch.tensor([1.0, -2.0])}

    def step(params, state, g):
        updates, state = opt.update(g, state, params)
        return optim.apply_updates(params, updates), state

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    p_e, s_e = params, opt.init(params)
    p_c, s_c = params, opt.init(params)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for g in ([0.5, 1.0], [-1.0, 0.25], [2.0, -3.0]):
            g = {"w": torch.tensor(g)}
            p_e, s_e = step(p_e, s_e, g)
            p_c, s_c = compiled(p_c, s_c, g)
    assert torch.equal(p_e["w"], p_c["w"])


# --- mask_compatible_extra_args: funcamp's update takes no extra arguments ---------------------------------


def test_mask_compatible_extra_args_true_is_refused_and_extra_update_arguments_too():
    inner = optim.sgd(0.1)
    for build in (
        lambda flag: optim.masked(inner, {"w": True}, mask_compatible_extra_args=flag),
        lambda flag: optim.multi_transform({"a": inner}, {"w": "a"}, mask_compatible_extra_args=flag),
    ):
        with pytest.raises(ValueError, match=r"mask_compatible_extra_args=True has nothing to mask: .* no extra"):
            build(True)
        with pytest.raises(TypeError, match=r"mask_compatible_extra_args must be a bool"):
            build(1)
        opt = build(False)
        params = {"w": torch.ones(2)}
        with pytest.raises(TypeError, match=r"update takes \(updates, state, params\) and no extra arguments.*'value'"):
            opt.update({"w": torch.ones(2)}, opt.init(params), params, value=torch.tensor(1.0))
