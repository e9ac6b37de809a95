"""Fault-injection soak: non-finite values at random steps never reach the train state.

A tiny MLP (float32 master parameters, float16 or bfloat16 compute, AdamW, a BatchNorm-like running
mean as a buffer, a dynamic loss scale) is trained for ``STEPS`` steps. At about ``RATE`` of the steps,
chosen from a fixed seed, one fault is injected through the batch (the step computes gradients
itself, so faults ride in on data):

- ``grad``: +inf, -inf or NaN added to the gradient of random elements of one random parameter, with a
  forward pass that stays finite (``_AddToGrad``: identity forward, ``grad + poison`` backward);
- ``loss``: +inf, -inf or NaN added to the loss (the gradients stay finite; the loss check catches it);
- ``activation``: a real overflow in the forward pass. The hidden layer carries a constant bias unit of
  2.0 and is multiplied by a batch-supplied ``gain`` (1.0 on clean steps). The injected gain is
  33123 in float16, so the bias unit becomes 2 * 33123 = 66246 > 65504 (float16's largest value), and
  2**127 in bfloat16 (2**128 > bfloat16's largest value, about 3.39e38).

Checked step by step: nothing in the state (parameters, AdamW moments and count, buffers, loss scale)
is ever non-finite; every injected step is reported (``grads_finite`` False, ``skipped_steps`` + 1) and
leaves parameters, buffers and optimizer state bitwise unchanged; every clean step is applied; the
loss-scale trajectory equals a pure-Python model of ``DynamicLossScale.adjust`` fed the injection flags.
Finally the run equals, bitwise, a run over the clean batches only (see ``soak`` for the loss scale
that run uses).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
import torch
from _reference import reference_adjust

import funcamp as fa
from funcamp import optim

# Dynamo instantiates autograd.Function subclasses while tracing them (torch 2.13), which torch itself
# deprecates; not ours, and nothing is instantiated in eager mode.
pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated:DeprecationWarning"
)

STEPS = 2000  # per dtype, compiled (aot_eager)
EAGER_STEPS = 200  # per dtype, compile=False
RATE = 0.05
KEYS = ("b1", "b2", "w1", "w2")  # optree's leaf order (sorted dict keys): nonfinite_leaf indexes this
SHAPES = {"b1": (8,), "b2": (1,), "w1": (4, 8), "w2": (9, 1)}
VALUES = (math.inf, -math.inf, math.nan)
# A gain that overflows the constant bias unit (2.0) of the hidden layer in the compute dtype.
OVERFLOW_GAIN = {torch.float16: 33123.0, torch.bfloat16: 2.0**127}
# float16: defaults (every fault halves the scale); bfloat16: hysteresis 2 (a lone fault only spends it,
# two in a row divide the scale by 8).
LOSS_SCALE = {
    torch.float16: dict(loss_scale=2.0**10, period=25, min_loss_scale=2.0**4, max_loss_scale=2.0**12),
    torch.bfloat16: dict(
        loss_scale=2.0**10, period=25, min_loss_scale=2.0**4, max_loss_scale=2.0**12, hysteresis=2, backoff_factor=0.125
    ),
}


class _AddToGrad(torch.autograd.Function):
    """``forward(*xs, *poisons) = xs``; ``backward`` adds each poison to the matching gradient."""

    @staticmethod
    def forward(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(args) // 2
        return tuple(x.view_as(x) for x in args[:n])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, ...], output: Any) -> None:
        ctx.save_for_backward(*inputs[len(inputs) // 2 :])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        poisons = ctx.saved_tensors
        return tuple(g + p.to(g.dtype) for g, p in zip(grads, poisons)) + (None,) * len(poisons)


def make_loss_fn(dtype: torch.dtype):
    def loss_fn(params: dict, buffers: dict, batch: dict) -> tuple[torch.Tensor, dict]:
        cast = [params[k].to(dtype) for k in KEYS]
        p = dict(zip(KEYS, _AddToGrad.apply(*cast, *(batch["poison"][k] for k in KEYS))))
        h = torch.tanh(batch["x"].to(dtype) @ p["w1"] + p["b1"])
        act = torch.cat([h, torch.full_like(h[:, :1], 2.0)], dim=-1) * batch["gain"].to(dtype)
        out = act @ p["w2"] + p["b2"]
        loss = ((out.float() - batch["y"]) ** 2).mean() + batch["loss_poison"]
        return loss, {"mean": 0.9 * buffers["mean"] + 0.1 * act.float().mean(0)}

    return loss_fn


@dataclasses.dataclass
class Fault:
    kind: str  # "grad", "loss" or "activation"
    leaf: str | None = None
    value: float | None = None


def make_schedule(seed: int, steps: int, dtype: torch.dtype) -> tuple[list[dict], list[Fault | None]]:
    """Batches and faults for ``steps`` steps, all drawn from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    batches, faults = [], []
    for _ in range(steps):
        batch = {
            "x": torch.randn(16, 4, generator=gen),
            "y": torch.randn(16, 1, generator=gen),
            "poison": {k: torch.zeros(s) for k, s in SHAPES.items()},
            "gain": torch.ones(()),
            "loss_poison": torch.zeros(()),
        }
        fault = None
        if rng.random() < RATE:
            fault = Fault(str(rng.choice(["grad", "loss", "activation"])))
            if fault.kind == "grad":
                fault.leaf, fault.value = str(rng.choice(KEYS)), float(rng.choice(VALUES))
                poison = batch["poison"][fault.leaf].view(-1)
                where = rng.choice(poison.numel(), size=int(rng.integers(1, poison.numel() + 1)), replace=False)
                poison[torch.from_numpy(where)] = fault.value
            elif fault.kind == "loss":
                fault.value = float(rng.choice(VALUES))
                batch["loss_poison"] = torch.tensor(fault.value)
            else:
                batch["gain"] = torch.tensor(OVERFLOW_GAIN[dtype])
        batches.append(batch)
        faults.append(fault)
    return batches, faults


def _init_state(dtype: torch.dtype, opt: optim.GradientTransformation) -> fa.TrainState:
    gen = torch.Generator().manual_seed(1234)
    params = {k: torch.randn(s, generator=gen) * 0.5 for k, s in SHAPES.items()}
    loss_scale = fa.DynamicLossScale(**LOSS_SCALE[dtype])
    return fa.TrainState.create(params, opt, loss_scale=loss_scale, buffers={"mean": torch.zeros(9)})


def _equal_trees(a: Any, b: Any) -> bool:
    la, lb = fa._tree.tree_leaves(a), fa._tree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


def _adam_count(state: fa.TrainState) -> int:
    return int(next(s.count for s in state.opt_state if isinstance(s, optim.ScaleByAdamState)))


def soak(dtype: torch.dtype, steps: int, compile: bool, seed: int) -> dict:
    """Run the injected schedule, checking every step; then the run without the injected steps."""
    opt = optim.adamw(1e-2, weight_decay=0.01)
    kwargs = dict(backend="aot_eager") if compile else dict(compile=False)
    step = fa.make_train_step(make_loss_fn(dtype), opt, **kwargs)
    batches, faults = make_schedule(seed, steps, dtype)
    state = _init_state(dtype, opt)
    opts = LOSS_SCALE[dtype]
    ref = (np.float32(opts["loss_scale"]), 0, opts.get("hysteresis", 1))
    rec = dict(
        dtype=dtype, opts=opts, faults=faults, finite=[], scales=[], ref_scales=[], n_clean=0, n_injected=0, problems=[]
    )
    for i, (batch, fault) in enumerate(zip(batches, faults)):
        new, m = step(state, batch)
        finite = bool(m["grads_finite"])
        rec["finite"].append(finite)
        rec["scales"].append(float(m["loss_scale"]))
        rec["ref_scales"].append(float(ref[0]))
        if not bool(fa.all_finite(new)):
            rec["problems"].append(f"step {i}: non-finite value in the state after {fault}")
        if not float(new.loss_scale.loss_scale) > 0:
            rec["problems"].append(f"step {i}: loss scale {float(new.loss_scale.loss_scale)} is not > 0")
        kept = [_equal_trees(getattr(new, f), getattr(state, f)) for f in ("params", "opt_state", "buffers")]
        if fault is not None:
            rec["n_injected"] += 1
            expected_leaf = KEYS.index(fault.leaf) if fault.kind == "grad" else None
            if finite or not all(kept) or int(new.skipped_steps) != int(state.skipped_steps) + 1:
                rec["problems"].append(f"step {i}: injected {fault} was not skipped and counted")
            if expected_leaf is not None and int(m["nonfinite_leaf"]) != expected_leaf:
                rec["problems"].append(f"step {i}: nonfinite_leaf {int(m['nonfinite_leaf'])} for {fault}")
        else:
            rec["n_clean"] += 1
            applied = (
                finite
                and not kept[0]
                and not kept[2]
                and _adam_count(new) == _adam_count(state) + 1
                and int(new.skipped_steps) == int(state.skipped_steps)
            )
            if not applied:
                rec["problems"].append(f"step {i}: clean step was not applied (grads_finite={finite})")
        ref = reference_adjust(ref, fault is None, opts)
        state = new
    rec["final"] = state
    rec["final_ref_scale"] = float(ref[0])

    # The same steps with the injected ones left out. In bfloat16 (float32's exponent range) scaling by
    # a power of two is exact, so the clean run keeps its own loss scale (it never backs off) and still
    # matches bitwise. In float16 a gradient rounds differently at another scale (subnormals below
    # 6.1e-5), so there each clean step runs at the loss scale the soak used for it.
    omitted = _init_state(dtype, opt)
    for batch, fault, scale in zip(batches, faults, rec["scales"]):
        if fault is None:
            if dtype == torch.float16:
                ls = dataclasses.replace(omitted.loss_scale, loss_scale=torch.tensor(scale))
                omitted = omitted.replace(loss_scale=ls)
            omitted, _ = step(omitted, batch)
    rec["omitted"] = omitted
    return rec


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny tensors: one thread is faster and keeps the run short on 2 cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def run(request) -> dict:
    seed = {torch.float16: 16, torch.bfloat16: 116}[request.param]
    return soak(request.param, STEPS, compile=True, seed=seed)


def test_schedule_injects_every_kind_and_value(run):
    faults = [f for f in run["faults"] if f is not None]
    assert 0.03 * STEPS < len(faults) < 0.07 * STEPS
    assert {f.kind for f in faults} == {"grad", "loss", "activation"}
    assert {f.leaf for f in faults if f.kind == "grad"} == set(KEYS)
    for kind in ("grad", "loss"):
        values = {str(f.value) for f in faults if f.kind == kind}
        assert values == {"inf", "-inf", "nan"}, kind


def test_no_problem_at_any_step(run):
    assert run["problems"] == []


def test_counts(run):
    injected = sum(f is not None for f in run["faults"])
    final = run["final"]
    assert run["n_injected"] == injected == int(final.skipped_steps) == run["finite"].count(False)
    assert run["n_clean"] == STEPS - injected == run["finite"].count(True)
    assert int(final.step) == STEPS
    assert _adam_count(final) == STEPS - injected


def test_loss_scale_trajectory_matches_reference(run):
    assert run["scales"] == run["ref_scales"]
    assert float(run["final"].loss_scale.loss_scale) == run["final_ref_scale"]
    # The soak exercised every branch: growth, backoff, the floor, the cap, and hysteresis.
    opts, scales = run["opts"], run["scales"]
    assert any(b > a for a, b in zip(scales, scales[1:]))
    assert any(b < a for a, b in zip(scales, scales[1:]))
    assert opts["min_loss_scale"] in scales and opts["max_loss_scale"] in scales
    floor = opts["min_loss_scale"]
    kept_on_fault = [b == a > floor for a, b, f in zip(scales, scales[1:], run["faults"]) if f is not None]
    assert any(kept_on_fault) == (opts.get("hysteresis", 1) > 1)


def test_equals_run_without_injected_steps(run):
    final, omitted = run["final"], run["omitted"]
    for field in ("params", "opt_state", "buffers"):
        assert _equal_trees(getattr(final, field), getattr(omitted, field)), field
    assert int(omitted.skipped_steps) == 0 and int(omitted.step) == STEPS - run["n_injected"]
    if run["dtype"] == torch.bfloat16:
        # The bfloat16 run without faults grew its own scale, undisturbed, to the cap.
        assert float(omitted.loss_scale.loss_scale) == run["opts"]["max_loss_scale"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_eager_soak(dtype):
    rec = soak(dtype, EAGER_STEPS, compile=False, seed=7)
    assert rec["problems"] == []
    assert rec["n_injected"] == rec["finite"].count(False) == int(rec["final"].skipped_steps) > 0
    assert rec["scales"] == rec["ref_scales"]
    for field in ("params", "opt_state", "buffers"):
        assert _equal_trees(getattr(rec["final"], field), getattr(rec["omitted"], field)), field
