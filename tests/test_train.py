"""The train step: skipping, accumulation, clipping on unscaled grads, metrics, one graph."""

import functools
import math

import pytest
import torch

import funcamp as fa
from funcamp import _tree, optim

POLICY = fa.get_policy("p=f32,c=f16,o=f32")


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(16, 8, generator=g) * 0.3,
        "b1": torch.zeros(16),
        "w2": torch.randn(1, 16, generator=g) * 0.3,
    }


def loss_fn(params, batch):
    """MSE of a two-layer MLP in the policy's compute dtype; ``poison`` (0 on clean steps) multiplies
    into the loss so that inf or NaN reaches every gradient and the loss."""
    p = POLICY.cast_to_compute(params)
    x = POLICY.cast_to_compute(batch["x"])
    h = torch.tanh(x @ p["w1"].T + p["b1"])
    pred = POLICY.cast_to_output(h @ p["w2"].T).squeeze(-1)
    return (pred - batch["y"]).pow(2).mean() + (params["w1"].sum() * batch["poison"]).sum()


def _batch(step, poison=0.0, n=8):
    g = torch.Generator().manual_seed(1000 + step)
    return {"x": torch.randn(n, 8, generator=g), "y": torch.randn(n, generator=g), "poison": torch.tensor(poison)}


def _optimizer():
    return optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.warmup_cosine_decay(1e-2, warmup=3, total=60)))


def _snapshot(tree):
    return [x.clone() for x in _tree.tree_leaves(tree)]


def _assert_bitwise(tree, snapshot):
    leaves = _tree.tree_leaves(tree)
    assert len(leaves) == len(snapshot)
    for a, b in zip(leaves, snapshot):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.fixture(scope="module")
def eager_step():
    return fa.make_train_step(loss_fn, _optimizer(), compile=False, max_consecutive_skips=3)


@pytest.fixture(scope="module")
def compiled_step():
    torch._dynamo.reset()
    return fa.make_train_step(loss_fn, _optimizer(), backend="aot_eager", max_consecutive_skips=3)


def _state(scale=2.0**10, period=4):
    return fa.TrainState.create(_params(), _optimizer(), loss_scale=fa.DynamicLossScale(scale, period=period))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_step_changes_only_loss_scale_and_counters(eager_step, bad):
    state, _ = eager_step(_state(), _batch(0))
    params, opt_state = _snapshot(state.params), _snapshot(state.opt_state)
    new, metrics = eager_step(state, _batch(1, poison=bad))
    assert not metrics["grads_finite"]
    _assert_bitwise(new.params, params)
    _assert_bitwise(new.opt_state, opt_state)  # the optimizer's step count too: schedules do not advance
    _assert_bitwise(state.params, params)  # the input state is not mutated
    assert float(new.loss_scale.loss_scale) == float(state.loss_scale.loss_scale) / 2
    assert int(new.skipped_steps) == 1 and int(new.consecutive_skips) == 1 and int(new.step) == 2
    assert float(optim.learning_rate(new.opt_state)) == float(optim.learning_rate(state.opt_state))


def test_run_with_a_skipped_step_ends_where_the_run_without_it_ends(eager_step):
    # Scale 1.0 with the floor at 1.0: the backoff after the bad step leaves it unchanged.
    base = fa.TrainState.create(_params(), _optimizer(), loss_scale=fa.DynamicLossScale(1.0, period=1000))
    with_skip, clean = base, base
    for batch in [_batch(0), _batch(1, poison=math.inf), _batch(2)]:
        with_skip, _ = eager_step(with_skip, batch)
    for batch in [_batch(0), _batch(2)]:
        clean, _ = eager_step(clean, batch)
    _assert_bitwise(with_skip.params, _snapshot(clean.params))
    _assert_bitwise(with_skip.opt_state, _snapshot(clean.opt_state))


def test_compiled_step_equals_eager(eager_step, compiled_step):
    a = b = _state()
    for i in range(6):
        poison = math.nan if i == 3 else 0.0
        a, ma = eager_step(a, _batch(i, poison))
        b, mb = compiled_step(b, _batch(i, poison))
        assert bool(ma["grads_finite"]) == bool(mb["grads_finite"]) == (i != 3)
    for x, y in zip(_tree.tree_leaves(a), _tree.tree_leaves(b)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_compiled_step_never_recompiles_over_skips_scale_changes_and_lr(compiled_step):
    state = _state()  # the same static configuration as test_compiled_step_equals_eager: no new compile
    compiled_step(state, _batch(0))
    scales, lrs, finite, injected = set(), set(), [], {3, 4, 5, 30}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(50):
            state, metrics = compiled_step(state, _batch(i, poison=math.inf if i in injected else 0.0))
            scales.add(float(metrics["loss_scale"]))
            lrs.add(float(metrics["learning_rate"]))
            finite.append(bool(metrics["grads_finite"]))
    assert len(scales) > 3 and len(lrs) > 10
    # Every injected step is skipped (a grown scale may also overflow float16 now and then).
    assert all(not finite[i] for i in injected) and finite.count(False) >= len(injected)
    for leaf in _tree.tree_leaves(state):
        if leaf.is_floating_point():
            assert torch.isfinite(leaf).all()


def test_metrics_are_0d_tensors(eager_step):
    _, metrics = eager_step(_state(), _batch(0))
    assert set(metrics) == {
        "loss", "loss_scale", "grads_finite", "grad_norm", "learning_rate", "skipped_steps",
        "consecutive_skips", "nonfinite_leaf", "too_many_skips",
    }  # fmt: skip
    for name, value in metrics.items():
        assert isinstance(value, torch.Tensor) and value.ndim == 0, name
    assert metrics["loss"].dtype == torch.float32 and metrics["loss_scale"].dtype == torch.float32
    assert metrics["grads_finite"].dtype == torch.bool and int(metrics["nonfinite_leaf"]) == -1
    assert float(metrics["loss_scale"]) == 2.0**10  # the scale used by this step, not the next one


def test_nonfinite_leaf_names_the_overflowing_parameter():
    def poison_w2(params, batch):  # only w2's gradient carries the poison
        return loss_fn(params, {**batch, "poison": torch.tensor(0.0)}) + params["w2"].sum() * batch["poison"]

    step = fa.make_train_step(poison_w2, _optimizer(), compile=False)
    _, metrics = step(_state(), _batch(0, poison=math.inf))
    assert int(metrics["nonfinite_leaf"]) == 2  # leaf order: b1, w1, w2
    assert fa.nonfinite_leaf_name(_params(), metrics["nonfinite_leaf"]) == "w2"
    assert fa.nonfinite_leaf_name(_params(), torch.tensor(-1)) is None
    with pytest.raises(IndexError, match="out of range"):
        fa.nonfinite_leaf_name(_params(), 3)


def test_clipping_sees_unscaled_gradients():
    def linear(params, batch):
        return (params["w"] * batch["g"]).sum()  # gradient == batch["g"]

    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(1.0))
    step = fa.make_train_step(linear, opt, compile=False)
    norms = []
    for scale in (1.0, 2.0**10, 2.0**15, 65536.0):
        for g, expected in (([0.3, 0.4], [0.3, 0.4]), ([3.0, 4.0], [0.6, 0.8])):
            state = fa.TrainState.create({"w": torch.zeros(2)}, opt, loss_scale=fa.StaticLossScale(scale))
            new, metrics = step(state, {"g": torch.tensor(g)})
            torch.testing.assert_close(-new.params["w"], torch.tensor(expected), rtol=1e-6, atol=0)
            norms.append((g[0], float(metrics["grad_norm"])))
    assert {n for g, n in norms if g == 3.0} == {5.0}
    assert len({n for g, n in norms if g == 0.3}) == 1


def _accumulated(k, poison_at=None):
    opt = optim.sgd(0.5)
    step = fa.make_train_step(loss_fn, opt, accumulation_steps=k, compile=False)
    state = fa.TrainState.create(_params(), opt, loss_scale=fa.DynamicLossScale(2.0**8, period=3))
    batch = _batch(0, n=12)
    if poison_at is not None:
        batch["poison"] = torch.zeros(12)
        batch["poison"][poison_at] = math.inf
    else:
        batch["poison"] = torch.zeros(12)
    return step(state, batch), state, batch


def test_accumulation_gives_the_gradient_of_the_mean_loss():
    (new, metrics), state, batch = _accumulated(3)
    # Reference: the mean of the three micro-batch losses, differentiated with plain autograd.
    params = {k: v.clone().requires_grad_(True) for k, v in state.params.items()}
    chunks = [{k: v.chunk(3)[i] for k, v in batch.items()} for i in range(3)]
    mean_loss = sum(loss_fn(params, c) for c in chunks) / 3
    mean_loss.backward()
    for name, p in params.items():
        # float16 compute: the scaled and the unscaled backward round differently (relative ~1e-3).
        torch.testing.assert_close(new.params[name], state.params[name] - 0.5 * p.grad, rtol=2e-3, atol=1e-4)
    torch.testing.assert_close(metrics["loss"], mean_loss.detach(), rtol=1e-6, atol=1e-6)
    assert int(new.loss_scale.counter) == 1  # one adjust per step, not one per micro-batch


def test_overflow_in_one_micro_batch_skips_the_window_and_backs_off_once():
    (new, metrics), state, _ = _accumulated(3, poison_at=7)  # micro-batch 1 of 0..2
    assert not metrics["grads_finite"]
    _assert_bitwise(new.params, _snapshot(state.params))
    assert float(new.loss_scale.loss_scale) == 2.0**7 and int(new.skipped_steps) == 1


def test_accumulation_rejects_batches_that_do_not_split():
    step = fa.make_train_step(loss_fn, optim.sgd(0.1), accumulation_steps=3, compile=False)
    with pytest.raises(ValueError, match="divisible by 3"):
        step(fa.TrainState.create(_params(), optim.sgd(0.1)), _batch(0, n=8))


def test_skip_accounting_and_max_consecutive_skips(eager_step):
    state = _state()
    flags = []
    for i, poison in enumerate([0, math.inf, math.inf, 0, math.nan, math.nan, math.nan]):
        state, metrics = eager_step(state, _batch(i, poison))
        flags.append(
            (int(metrics["skipped_steps"]), int(metrics["consecutive_skips"]), bool(metrics["too_many_skips"]))
        )
    assert flags == [
        (0, 0, False),
        (1, 1, False),
        (2, 2, False),
        (2, 0, False),
        (3, 1, False),
        (4, 2, False),
        (5, 3, True),
    ]
    with pytest.raises(fa.SkippedStepsError, match="3 consecutive steps skipped") as info:
        fa.check_skips(metrics, state.params)
    assert "loss itself" in str(info.value) or "first non-finite gradient" in str(info.value)
    state, metrics = eager_step(state, _batch(9))
    fa.check_skips(metrics)  # a finite step clears it
    with pytest.raises(KeyError, match="max_consecutive_skips"):
        fa.check_skips({"loss": torch.tensor(1.0)})


def test_twenty_nan_losses_drive_the_scale_to_the_floor_then_training_resumes():
    opt = optim.adamw(1e-2)
    step = fa.make_train_step(loss_fn, opt, compile=False)
    state = fa.TrainState.create(_params(), opt, loss_scale=fa.DynamicLossScale(2.0**15))
    params = _snapshot(state.params)
    for i in range(20):
        state, metrics = step(state, _batch(i, poison=math.nan))
        assert not metrics["grads_finite"]
    assert float(state.loss_scale.loss_scale) == 1.0
    _assert_bitwise(state.params, params)
    assert int(state.opt_state[0].count) == 0  # the optimizer never counted a skipped step
    state, metrics = step(state, _batch(20))
    assert int(state.opt_state[0].count) == 1
    assert metrics["grads_finite"] and int(state.skipped_steps) == 20 and int(state.consecutive_skips) == 0
    assert not torch.equal(state.params["w1"], params[_tree.tree_paths(_params()).index("w1")])


def test_buffers_flow_through_and_are_kept_on_skip():
    def with_buffers(params, buffers, batch):
        loss = loss_fn(params, batch)
        return loss, {"count": buffers["count"] + 1, "mean": 0.9 * buffers["mean"] + 0.1 * batch["x"].mean()}

    opt = optim.sgd(0.1)
    step = fa.make_train_step(with_buffers, opt, compile=False)
    buffers = {"count": torch.tensor(0), "mean": torch.tensor(0.0)}
    state = fa.TrainState.create(_params(), opt, buffers=buffers)
    state, _ = step(state, _batch(0))
    assert int(state.buffers["count"]) == 1 and state.buffers["count"].dtype == torch.int64
    kept = _snapshot(state.buffers)
    state, metrics = step(state, _batch(1, poison=math.inf))
    assert not metrics["grads_finite"]
    _assert_bitwise(state.buffers, kept)
    assert int(buffers["count"]) == 0  # the caller's buffers are not mutated


def test_has_aux_reaches_metrics():
    def with_aux(params, batch):
        loss = loss_fn(params, batch)
        return loss, {"double": loss * 2}

    step = fa.make_train_step(with_aux, optim.sgd(0.1), has_aux=True, compile=False)
    _, metrics = step(fa.TrainState.create(_params(), optim.sgd(0.1)), _batch(0))
    torch.testing.assert_close(metrics["aux"]["double"], metrics["loss"] * 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_params_keep_their_dtype(dtype):
    params = {k: v.to(dtype) for k, v in _params().items()}

    def loss(p, batch):
        return loss_fn({k: v.float() for k, v in p.items()}, batch)

    opt = optim.adam(1e-3)
    step = fa.make_train_step(loss, opt, compile=False)
    state, _ = step(fa.TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(2.0**4)), _batch(0))
    assert {k: v.dtype for k, v in state.params.items()} == {k: dtype for k in params}


def test_create_and_make_train_step_validate():
    with pytest.raises(TypeError, match="GradientTransformation"):
        fa.TrainState.create(_params(), torch.optim.SGD)
    with pytest.raises(TypeError, match="loss_scale"):
        fa.TrainState.create(_params(), optim.sgd(0.1), loss_scale=2.0**15)
    with pytest.raises(TypeError, match="'step'"):
        fa.TrainState.create({**_params(), "step": torch.tensor(1)}, optim.sgd(0.1))
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="accumulation_steps"):
            fa.make_train_step(loss_fn, optim.sgd(0.1), accumulation_steps=bad)
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        fa.make_train_step(loss_fn, optim.sgd(0.1), max_consecutive_skips=0)
    with pytest.raises(TypeError, match="loss_fn"):
        fa.make_train_step(None, optim.sgd(0.1))


def test_train_state_round_trips_through_optree():
    state = _state()
    leaves, spec = _tree.tree_flatten(state)
    again = _tree.tree_unflatten(spec, leaves)
    assert type(again) is fa.TrainState and type(again.loss_scale) is fa.DynamicLossScale
    _assert_bitwise(again, _snapshot(state))


@pytest.mark.slow
def test_inductor_compiled_step_matches_eager_for_twenty_steps(eager_step):
    torch._dynamo.reset()
    step = fa.make_train_step(loss_fn, _optimizer(), max_consecutive_skips=3)  # inductor, the default backend
    a = b = _state()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(20):
            poison = math.inf if i in (4, 5) else 0.0
            a, ma = eager_step(a, _batch(i, poison))
            b, mb = step(b, _batch(i, poison))
            assert bool(ma["grads_finite"]) == bool(mb["grads_finite"])
    # Inductor computes float16 elementwise chains in float32 inside its fused kernels, so the two
    # runs agree to float16 tolerance, not bitwise.
    for x, y in zip(_tree.tree_leaves(a), _tree.tree_leaves(b)):
        torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-3)


def test_create_points_a_module_to_functionalize():
    with pytest.raises(TypeError, match="funcamp.nn.functionalize"):
        fa.TrainState.create(torch.nn.Linear(2, 2), optim.sgd(0.1))


def test_check_skips_replay_ends_the_message_and_runs_only_when_raising(eager_step):
    calls = []

    def replay():
        calls.append(1)
        return "REPLAY REPORT: the culprit op"

    state = _state()
    state, metrics = eager_step(state, _batch(0))
    fa.check_skips(metrics, state.params, replay=replay)  # finite: nothing raised, replay not called
    assert calls == []
    prev = state
    for i in range(3):
        prev = state
        state, metrics = eager_step(state, _batch(i + 1, math.inf))
    with pytest.raises(fa.SkippedStepsError, match="3 consecutive steps skipped") as info:
        fa.check_skips(metrics, state.params, replay=replay)
    assert calls == [1] and str(info.value).endswith("\nREPLAY REPORT: the culprit op")

    # The replay the main job passes: funcamp.debug's locator on the state before the last step and its batch.
    from funcamp.debug import locate_from_state

    with pytest.raises(fa.SkippedStepsError) as info:
        fa.check_skips(metrics, replay=functools.partial(locate_from_state, loss_fn, prev, _batch(3, math.inf)))
    report = str(locate_from_state(loss_fn, prev, _batch(3, math.inf)))
    assert "poison" in report and str(info.value).endswith(report)

    def broken():
        raise RuntimeError("replay exploded")

    with pytest.raises(fa.SkippedStepsError, match=r"the replay failed: RuntimeError: replay exploded") as info:
        fa.check_skips(metrics, replay=broken)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(TypeError, match="replay must be a callable"):
        fa.check_skips(metrics, replay="locate")


def test_compiled_step_with_empty_buffers():
    """``functionalize(..., with_buffers=True)`` on a model without buffers gives ``{}``: the compiled step
    must take it (Dynamo cannot flatten an empty dict made in the graph; failed before the fix)."""
    model = torch.nn.Linear(4, 4)
    apply_fn, params, buffers = fa.nn.functionalize(model, "float32", with_buffers=True)
    assert buffers == {}

    def loss_fn(p, b, x):
        out, new = apply_fn(p, b, x)
        return out.square().mean(), new

    opt = optim.sgd(0.1)
    state = fa.TrainState.create(params, opt, buffers=buffers)
    step = fa.make_train_step(loss_fn, opt, backend="aot_eager")
    eager = fa.make_train_step(loss_fn, opt, compile=False)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    new, _ = step(state, x)
    ref, _ = eager(state, x)
    assert new.buffers == {}
    assert all(torch.equal(new.params[k], ref.params[k]) for k in ref.params)
    assert not torch.equal(new.params["weight"], state.params["weight"])


def test_loss_fn_with_buffers_returning_three_values_is_named():
    """A loss_fn with buffers must return (loss, new_buffers); three values used to give Python's bare
    'too many values to unpack'."""
    model = torch.nn.BatchNorm1d(4)
    apply_fn, params, buffers = fa.nn.functionalize(model, "float32", with_buffers=True)

    def loss_fn(p, b, x):
        out, new = apply_fn(p, b, x)
        return out.square().mean(), out, new

    opt = optim.sgd(0.1)
    state = fa.TrainState.create(params, opt, buffers=buffers)
    step = fa.make_train_step(loss_fn, opt, compile=False)
    with pytest.raises(TypeError, match=r"must return \(loss, new_buffers\); got a tuple of 3"):
        step(state, torch.randn(3, 4))


@pytest.mark.parametrize("with_buffers", [True, False])
def test_loss_fn_that_cannot_take_the_steps_arguments_is_named(with_buffers):
    """A model with buffers calls loss_fn(params, buffers, batch); a two-argument loss_fn gave Python's bare
    '<lambda>() takes 2 positional arguments but 3 were given' (and the reverse)."""
    model = torch.nn.BatchNorm1d(4) if with_buffers else torch.nn.Linear(4, 4)
    out = fa.nn.functionalize(model, "float32", with_buffers=with_buffers)
    apply_fn, params = out[:2]
    buffers = out[2] if with_buffers else None
    if with_buffers:
        loss_fn = lambda p, x: apply_fn(p, buffers, x)[0].square().mean()  # noqa: E731
        match = r"loss_fn is called as loss_fn\(params, buffers, batch\).*does not take three arguments"
    else:
        loss_fn = lambda p, b, x: (apply_fn(p, x).square().mean(), b)  # noqa: E731
        match = r"state.buffers is None, so loss_fn is called as loss_fn\(params, batch\).*two arguments"
    opt = optim.sgd(0.1)
    state = fa.TrainState.create(params, opt, buffers=buffers)
    for compile in (False, True):
        step = fa.make_train_step(loss_fn, opt, compile=compile, backend="aot_eager")
        with pytest.raises(TypeError, match=match):
            step(state, torch.randn(3, 4))
