"""Property tests (hypothesis): loss-scale adjustment, ``all_finite`` and policy casting.

- ``DynamicLossScale.adjust`` against a few-line pure-Python model of the rule in its docstring
  (numpy float32 arithmetic), for random options and random sequences of finite / non-finite flags,
  including growth up to the largest float32 power of two and backoff to the floor.
- ``all_finite`` over random trees whose non-finite values sit at positions the test chose, so the
  expected answer does not come from ``torch.isfinite``.
- Policy casts over random trees mixing tensors of every dtype with Python objects.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from _reference import reference_adjust
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import funcamp as fa
from funcamp import _tree

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal float32
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
OTHERS = (torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64)


# --- DynamicLossScale.adjust against a reference model ----------------------------------------------


def _powers(lo: int, hi: int) -> st.SearchStrategy[float]:
    return st.integers(lo, hi).map(lambda k: 2.0**k)


@st.composite
def loss_scale_options(draw: st.DrawFn) -> dict[str, Any]:
    """Options that ``DynamicLossScale`` accepts, with the initial scale, as keyword arguments."""
    opts: dict[str, Any] = {
        "period": draw(st.integers(1, 6) | st.integers(7, 3000)),
        "hysteresis": draw(st.integers(1, 4)),
        "growth_factor": draw(_powers(1, 4) | st.floats(1.0, 1e6, exclude_min=True)),
        "backoff_factor": draw(st.none() | _powers(-6, -1) | st.floats(0.0, 1.0, exclude_min=True, exclude_max=True)),
        "min_loss_scale": draw(_powers(-126, 20) | st.floats(F32_TINY, 1e6)),
    }
    lo = opts["min_loss_scale"]
    # the powers of two from lo's up (log2 rounds: just above 2**-126 it gave -126.0 and a power below lo)
    finite_max = st.floats(lo, F32_MAX) | _powers(math.ceil(math.log2(lo)), 127).filter(lambda v: v >= lo)
    opts["max_loss_scale"] = draw(st.none() | st.just(math.inf) | finite_max)
    hi = min(opts["max_loss_scale"] or F32_MAX, F32_MAX)
    opts["loss_scale"] = draw(st.floats(lo, hi) | st.sampled_from([lo, hi]))
    return opts


FLAGS = st.lists(st.booleans(), max_size=100) | st.lists(
    st.sampled_from([True] * 19 + [False]), min_size=50, max_size=300
)


def _check_trajectory(opts: dict[str, Any], flags: list[bool]) -> list[float]:
    ls = fa.DynamicLossScale(**opts)
    ref = (np.float32(opts["loss_scale"]), 0, opts.get("hysteresis", 1))
    scales = []
    for i, finite in enumerate(flags):
        ls = ls.adjust(torch.tensor(finite))
        ref = reference_adjust(ref, finite, opts)
        got = (ls.loss_scale.item(), int(ls.counter), int(ls.hysteresis_left))
        assert got == (float(ref[0]), ref[1], ref[2]), f"step {i} ({finite}): {got} != {ref}"
        assert ls.loss_scale.dtype == torch.float32 and ls.counter.dtype == torch.int32
        assert ls.hysteresis_left.dtype == torch.int32
        assert math.isfinite(got[0]) and got[0] >= np.float32(opts.get("min_loss_scale", 1.0)) > 0
        scales.append(got[0])
    return scales


@SETTINGS
@given(opts=loss_scale_options(), flags=FLAGS)
@example(  # growth to the largest float32 power of two, then no further (2**128 is inf)
    opts=dict(
        loss_scale=2.0**120,
        period=1,
        hysteresis=1,
        growth_factor=2.0,
        backoff_factor=None,
        min_loss_scale=1.0,
        max_loss_scale=None,
    ),
    flags=[True] * 12,
)
@example(  # backoff to the floor and stay there
    opts=dict(
        loss_scale=2.0**10,
        period=5,
        hysteresis=1,
        growth_factor=2.0,
        backoff_factor=None,
        min_loss_scale=2.0**4,
        max_loss_scale=None,
    ),
    flags=[False] * 10,
)
@example(  # hysteresis 3: two faults are tolerated, the third and every consecutive one back off
    opts=dict(
        loss_scale=2.0**10,
        period=2,
        hysteresis=3,
        growth_factor=2.0,
        backoff_factor=0.25,
        min_loss_scale=1.0,
        max_loss_scale=2.0**11,
    ),
    flags=[False, False, False, False, True, False, False, True, True, True, True],
)
def test_adjust_matches_reference(opts, flags):
    scales = _check_trajectory(opts, flags)
    event("reached the floor", str(np.float32(opts["min_loss_scale"]) in scales))
    event("reached a finite cap", str(np.float32(opts["max_loss_scale"] or F32_MAX) in scales))
    event("grew", str(any(b > a for a, b in zip([opts["loss_scale"]] + scales, scales))))


def test_named_trajectories():
    # Hand-checked outcomes of the @example cases above, so they cannot pass by a shared mistake.
    grow = dict(loss_scale=2.0**120, period=1, hysteresis=1, growth_factor=2.0, min_loss_scale=1.0)
    assert _check_trajectory(grow, [True] * 12) == [2.0**k for k in range(121, 128)] + [2.0**127] * 5
    floor = dict(loss_scale=2.0**10, period=5, hysteresis=1, growth_factor=2.0, min_loss_scale=2.0**4)
    assert _check_trajectory(floor, [False] * 10) == [2.0**k for k in range(9, 3, -1)] + [2.0**4] * 4
    hyst = dict(loss_scale=2.0**10, period=2, hysteresis=3, backoff_factor=0.25, max_loss_scale=2.0**11)
    flags = [False, False, False, False, True, False, False, True, True, True, True]
    expected = [2.0**10, 2.0**10, 2.0**8, 2.0**6, 2.0**6, 2.0**6, 2.0**6, 2.0**6, 2.0**7, 2.0**7, 2.0**8]
    assert _check_trajectory(dict(hyst, growth_factor=2.0), flags) == expected


# --- all_finite ---------------------------------------------------------------------------------------


class Pair(NamedTuple):
    first: Any
    second: Any


def _finite_values(dtype: torch.dtype) -> list[float]:
    info = torch.finfo(dtype)
    return [0.0, -0.0, 1.0, -2.5, info.max, -info.max, info.tiny, info.tiny * info.eps]


@st.composite
def tensors(draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = FLOATS + OTHERS) -> torch.Tensor:
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    n = math.prod(shape)
    if dtype.is_floating_point:
        values = draw(st.lists(st.sampled_from(_finite_values(dtype)), min_size=n, max_size=n))
        return torch.tensor(values, dtype=torch.float64).to(dtype).reshape(shape)
    if dtype.is_complex:  # never cast by a policy; checked by all_finite (both parts)
        return torch.full(shape, complex(1.0, -2.0), dtype=dtype)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype)
    return torch.arange(n, dtype=dtype).reshape(shape)


PY_LEAVES = st.sampled_from([None, 0, 3, math.nan, math.inf, -math.inf, 1.5, True, "nan", b"x", 2j]) | st.builds(object)
LEAVES = tensors() | PY_LEAVES
# What all_finite can check, all finite: tensors of every dtype, None, Python ints, bools, finite floats and complex.
CHECKABLE = tensors() | st.sampled_from([None, 0, 3, 1.5, True, 2j])
# Leaves all_finite must refuse by name rather than skip (issue 11, item 5).
UNCHECKABLE = st.sampled_from(["nan", b"x"]) | st.builds(object)


def trees(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaves,
        lambda kids: (
            st.dictionaries(st.text("abcxyz", min_size=1, max_size=3), kids, max_size=4)
            | st.lists(kids, max_size=4)
            | st.lists(kids, max_size=4).map(tuple)
            | st.builds(Pair, kids, kids)
        ),
        max_leaves=12,
    )


@SETTINGS
@given(tree=trees(CHECKABLE), data=st.data())
def test_all_finite_finds_injected_values(tree, data):
    floating = [
        x
        for x in _tree.tree_leaves(tree)
        if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) and x.numel() > 0
    ]
    assert fa.all_finite(tree).item() is True  # only finite values anywhere
    n_bad = data.draw(st.integers(0, min(3, len(floating))), label="n_bad")
    for leaf in data.draw(st.permutations(floating), label="poisoned")[:n_bad]:
        flat = leaf.view(-1)
        where = data.draw(st.integers(0, flat.numel() - 1), label="position")
        value = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]), label="value")
        if leaf.is_complex():  # a non-finite real or imaginary part alone makes the element non-finite
            value = data.draw(st.sampled_from([complex(value, 0.0), complex(0.0, value)]), label="part")
        flat[where] = value
    result = fa.all_finite(tree)
    assert result.dtype == torch.bool and result.shape == () and result.device.type == "cpu"
    assert result.item() is (n_bad == 0)


@SETTINGS
@given(tree=trees(CHECKABLE), bad=UNCHECKABLE, value=st.sampled_from([math.nan, math.inf, -math.inf]))
def test_all_finite_refuses_what_it_cannot_check_and_sees_python_floats(tree, bad, value):
    with pytest.raises(TypeError, match="all_finite"):
        fa.all_finite({"tree": tree, "bad": bad})
    assert fa.all_finite({"tree": tree, "x": value}).item() is False


@pytest.mark.parametrize("tree", [{}, [], (), None, {"a": None, "b": [], "c": ()}, [None, {}, ((),)], Pair(None, [])])
def test_all_finite_empty_trees(tree):
    assert fa.all_finite(tree).item() is True


@SETTINGS
@given(dtype=st.sampled_from(FLOATS), value=st.sampled_from([math.nan, math.inf, -math.inf]), n=st.integers(1, 70))
def test_all_finite_nested_in_empty_subtrees(dtype, value, n):
    bad = torch.zeros(n, dtype=dtype)
    bad[n // 2] = value
    tree = {"empty": {}, "none": None, "ids": torch.arange(3), "deep": [(), [None, {"x": bad}]]}
    assert fa.all_finite(tree).item() is False


# --- policy casts -----------------------------------------------------------------------------------

POLICIES = st.builds(fa.Policy, *[st.sampled_from(FLOATS)] * 4)


@SETTINGS
@given(policy=POLICIES, tree=trees(LEAVES))
def test_policy_casts(policy, tree):
    before = [
        (x, x.dtype, x.clone()) if isinstance(x, torch.Tensor) else (x, None, None) for x in _tree.tree_leaves(tree)
    ]
    for method, dtype in [
        (policy.cast_to_param, policy.param_dtype),
        (policy.cast_to_compute, policy.compute_dtype),
        (policy.cast_to_output, policy.output_dtype),
        (policy.cast_to_reduce, policy.reduce_dtype),
    ]:
        out = method(tree)
        assert _tree.tree_structure(out) == _tree.tree_structure(tree)
        for (x, _, _), y in zip(before, _tree.tree_leaves(out)):
            if _tree.is_floating(x):
                assert y.dtype == dtype and y.shape == x.shape
                assert torch.equal(y, x.to(dtype))  # finite values: NaN-free comparison is exact
                if x.dtype == dtype:
                    assert y is x
            else:
                assert y is x  # ints, bools, complex, Python objects: the same object
    for x, dtype, copy in before:  # inputs untouched
        if dtype is not None:
            assert x.dtype == dtype
            torch.testing.assert_close(x, copy, rtol=0, atol=0, equal_nan=True)


@SETTINGS
@given(policy=POLICIES)
def test_policy_str_round_trip(policy):
    assert fa.get_policy(str(policy)) == policy
    assert fa.get_policy(f"  {str(policy).upper()}  ") == policy
    assert fa.Policy.from_state_dict(policy.state_dict()) == policy
