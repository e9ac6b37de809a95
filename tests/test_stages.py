"""The train step assembled from stages equals the step before the redesign, bitwise (issue 23, item 1).

``tests/_reference_step.py`` is a frozen copy of ``make_train_step`` as it was (one closure with a branch per
feature). Each case here trains the same model with both for a few steps, from the same state, in one
process, and compares every state leaf and every metric with ``torch.equal`` (dtypes too), eager and compiled
(``aot_eager``). The 2-rank data-parallel and sharded cases run in tests/_loss_worker.py and are compared in
tests/test_loss_sum.py. Also: the stages compose into a step of another shape (two losses, a loss scale each).
"""

from __future__ import annotations

import dataclasses

import _reference_step as reference
import pytest
import torch

import funcamp as fa
from funcamp import _tree, optim
from funcamp.train import _stages

STEPS = 4
POISON_STEP = 1


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(6, 8, generator=g) / 6**0.5,
        "b1": torch.zeros(8),
        "w2": torch.randn(8, 3, generator=g) / 8**0.5,
    }


def _batches(overflow: bool) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(STEPS):
        labels = torch.randint(0, 3, (8,), generator=g)
        labels[: i % 3] = -100  # uneven padding for the LossSum case
        poison = torch.full((8,), 1e37 if overflow and i == POISON_STEP else 0.0)
        out.append({"x": torch.randn(8, 6, generator=g), "y": labels, "poison": poison})
    return out


def _logits(params, batch, dtype):
    p = {k: v.to(dtype) for k, v in params.items()}
    h = torch.tanh(batch["x"].to(dtype) @ p["w1"] + p["b1"])
    return (h @ p["w2"]).float()


def _trap(params, batch, dtype):
    """Zero, unless poisoned: then d/d(b1) = poison * loss scale overflows the half-precision backward."""
    return (params["b1"].to(dtype).sum() * batch["poison"].mean().to(dtype)).float()


def mean_loss(dtype):
    def loss_fn(params, batch):
        loss = torch.nn.functional.cross_entropy(_logits(params, batch, dtype), batch["y"].clamp(min=0))
        return loss + _trap(params, batch, dtype)

    return loss_fn


def buffers_sum_loss(dtype):
    """((LossSum, aux), new_buffers): a running mean of the logits as a buffer, the token count as aux."""

    def loss_fn(params, buffers, batch):
        logits = _logits(params, batch, dtype)
        total = torch.nn.functional.cross_entropy(logits, batch["y"], reduction="sum") + _trap(params, batch, dtype)
        count = (batch["y"] != -100).sum()
        new = {"mean": 0.9 * buffers["mean"] + 0.1 * logits.detach().mean(0), "calls": buffers["calls"] + 1}
        return (fa.LossSum(total, count), {"count": count}), new

    return loss_fn


CASES = {
    # float32, clip + AdamW, a growing dynamic scale
    "f32": dict(loss=mean_loss(torch.float32), k=1, overflow=False, opts={}),
    # bfloat16 compute, an overflow at step 1 (skip, back off), 2 micro-batches, the skip limit, telemetry
    "bf16_overflow": dict(
        loss=mean_loss(torch.bfloat16), k=2, overflow=True, opts=dict(max_consecutive_skips=1, telemetry=2)
    ),
    # buffers with aux, a LossSum over 2 micro-batches
    "buffers_aux_losssum": dict(loss=buffers_sum_loss(torch.bfloat16), k=2, overflow=True, opts=dict(has_aux=True)),
}


def _optimizer() -> optim.GradientTransformation:
    return optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.linear_warmup(0.0, 1e-2, 2), weight_decay=0.1))


def _state(with_buffers: bool) -> fa.TrainState:
    buffers = {"mean": torch.zeros(3), "calls": torch.zeros((), dtype=torch.int32)} if with_buffers else None
    return fa.TrainState.create(
        _params(), _optimizer(), loss_scale=fa.DynamicLossScale(2.0**12, period=2), buffers=buffers
    )


def _assert_bitwise(a, b, where):
    if isinstance(a, fa.TrainState):  # a flat state against one kept leaf by leaf: the same values, other storage
        a, b = (dataclasses.replace(x, storage=fa.train.PerLeaf()) for x in (a, b))
    la, sa = _tree.tree_flatten(a)
    lb, sb = _tree.tree_flatten(b)
    assert sa == sb, where
    for i, (x, y) in enumerate(zip(la, lb)):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), (where, i)
        else:
            assert x == y, (where, i)


def _run(build, name: str, compile_backend: str | None, monkeypatch=None):
    """The steps of ``build``; with ``monkeypatch``, over states kept leaf by leaf (the reference step knows no
    other storage)."""
    case = CASES[name]
    if monkeypatch is not None:
        monkeypatch.setenv("FUNCAMP_FLAT", "off")
    step = build(
        case["loss"],
        _optimizer(),
        accumulation_steps=case["k"],
        compile=compile_backend is not None,
        backend=compile_backend,
        **case["opts"],
    )
    state = _state(name == "buffers_aux_losssum")
    history = []
    for batch in _batches(case["overflow"]):
        state, metrics = step(state, batch)
        history.append((state, metrics))
    return history


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("name", list(CASES))
def test_assembled_step_equals_the_reference_bitwise(name, mode, monkeypatch):
    if mode == "compiled" and name == "f32":
        pytest.skip("the float32 case is covered eagerly; compiling costs time on 2 cores")
    backend = None if mode == "eager" else "aot_eager"
    torch._dynamo.reset()
    # compiled: over per-leaf states as the reference (a flat state's norm is summed per row of the buffers:
    # tests/test_flat.py)
    new = _run(fa.make_train_step, name, backend, monkeypatch if mode == "compiled" else None)
    old = _run(reference.make_train_step, name, backend, monkeypatch)
    for i, ((s1, m1), (s2, m2)) in enumerate(zip(new, old)):
        assert list(m1) == list(m2), i  # the same metrics, in the same order
        _assert_bitwise(s1, s2, f"{name} step {i} state")
        _assert_bitwise(m1, m2, f"{name} step {i} metrics")
    skipped = int(new[-1][0].skipped_steps)
    assert skipped == (1 if CASES[name]["overflow"] else 0)  # the poisoned step was skipped, the others applied


def test_stages_compose_into_a_step_with_two_loss_scales():
    """Two losses on one model's two halves, each with its own optimizer and loss scale, from the stages."""

    def head_loss(params, batch):
        return mean_loss(torch.float16)(params, batch)

    opt = optim.sgd(0.1)
    states = {
        "a": fa.TrainState.create(_params(), opt, loss_scale=fa.DynamicLossScale(2.0**10, period=1)),
        "b": fa.TrainState.create(_params(), opt, loss_scale=fa.DynamicLossScale(2.0**4, period=1)),
    }

    def two_step(states, batch):
        out, metrics = {}, {}
        for name, state in states.items():
            record = _stages.run(head_loss, opt, state, batch)
            out[name], metrics[name] = record.new_state, record.metrics
        return out, metrics

    batches = _batches(overflow=True)
    eager_states, compiled_states = states, states
    compiled = torch.compile(two_step, fullgraph=True, backend="aot_eager")
    for batch in batches:
        eager_states, me = two_step(eager_states, batch)
        compiled_states, mc = compiled(compiled_states, batch)
    _assert_bitwise(eager_states, compiled_states, "two scales")
    # each scale followed its own trajectory: grew every finite step, backed off once at the overflow
    assert float(eager_states["a"].loss_scale.loss_scale) == 2.0 ** (10 + STEPS - 2)
    assert float(eager_states["b"].loss_scale.loss_scale) == 2.0 ** (4 + STEPS - 2)
    reference_step = fa.make_train_step(head_loss, opt, compile=False)
    single, _ = states["a"], None
    for batch in batches:
        single, _ = reference_step(single, batch)
    _assert_bitwise(single, eager_states["a"], "one of the two equals make_train_step's")


def test_the_stages_check_their_arguments_as_make_train_step_does() -> None:
    """A stage called by hand gets make_train_step's errors, and swapped opt_state/params are named."""
    params = {"w": torch.ones(3)}
    grads = {"w": torch.full((3,), 0.5)}
    opt = optim.adam(0.1)
    opt_state = opt.init(params)
    scale = fa.NoOpLossScale()
    with pytest.raises(TypeError, match="gradients: loss_fn must be callable, got int"):
        _stages.gradients(3, scale, params, torch.ones(2))
    with pytest.raises(TypeError, match="gradients: loss_scale must be a funcamp LossScale"):
        _stages.gradients(lambda p, x: p["w"].sum(), 2.0, params, torch.ones(2))
    with pytest.raises(ValueError, match="gradients: accumulation_steps must be an int >= 1, got 0"):
        _stages.gradients(lambda p, x: p["w"].sum(), scale, params, torch.ones(2), accumulation_steps=0)
    with pytest.raises(TypeError, match="update: optimizer must be a funcamp.optim.GradientTransformation"):
        _stages.update(torch.optim.SGD, grads, opt_state, params)
    with pytest.raises(TypeError, match=r"params must have the structure of grads; the order is update\("):
        _stages.update(opt, grads, opt_state, opt_state)
    sgd = optim.sgd(0.1, momentum=0.9)
    sgd_state = sgd.init(params)
    with pytest.raises(TypeError, match="opt_state and params look swapped"):
        _stages.update(sgd, grads, params, sgd_state)
    new_params, _ = _stages.update(sgd, grads, sgd_state, params)  # the right order works
    assert torch.equal(new_params["w"], torch.full((3,), 0.95))
