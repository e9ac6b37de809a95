"""``make_train_step(..., donate=True)``: the next state written into the given state's tensors (issue 21, item 1).

Every case trains from the same start with a donating and a pure step and compares every state leaf and metric
bitwise (``torch.equal``, dtypes too), eager and compiled; the donated state's tensors are the returned state's
tensors; the donated state is refused afterwards wherever funcamp meets it; tensors that must not be written
into are refused at the first call. The 2-rank data-parallel and sharded cases run in tests/_loss_worker.py.
"""

from __future__ import annotations

import pytest
import test_stages as S
import torch

import funcamp as fa
from funcamp import _tree, checkpoint, optim
from funcamp.train import DonatedStateError


def _history(step, state, batches):
    out = []
    for batch in batches:
        state, metrics = step(state, batch)
        out.append((_tree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state), metrics))
    return out, state


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("name", list(S.CASES))
def test_donated_equals_pure_bitwise(name, mode):
    if mode == "compiled" and name == "f32":
        pytest.skip("covered eagerly; compiling costs time on 2 cores")
    case = S.CASES[name]
    backend = None if mode == "eager" else "aot_eager"
    runs = []
    for donate in (False, True):
        torch._dynamo.reset()
        step = fa.make_train_step(
            case["loss"],
            S._optimizer(),
            accumulation_steps=case["k"],
            compile=backend is not None,
            backend=backend,
            donate=donate,
            **case["opts"],
        )
        runs.append(_history(step, S._state(name == "buffers_aux_losssum"), S._batches(case["overflow"]))[0])
    for i, ((s1, m1), (s2, m2)) in enumerate(zip(*runs)):
        S._assert_bitwise(s1, s2, f"{name} step {i} state")
        S._assert_bitwise(m1, m2, f"{name} step {i} metrics")


def _bf16_params():
    return {k: v.to(torch.bfloat16) for k, v in S._params().items()}


OPTIMIZERS = {
    "groups": lambda: optim.multi_transform(
        {"w": optim.adamw(1e-2), "b": optim.sgd(1e-2, momentum=0.9)}, {"w1": "w", "w2": "w", "b1": "b"}
    ),
    "masked": lambda: optim.chain(
        optim.masked(optim.add_decayed_weights(0.1), {"w1": True, "w2": True, "b1": False}), optim.adam(1e-2)
    ),
    "kahan": lambda: optim.kahan_summation(optim.adamw(1e-2)),
    "stochastic_rounding": lambda: optim.stochastic_rounding(optim.adamw(1e-2), seed=3),
    "lion": lambda: optim.lion(1e-3),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_donated_equals_pure(name):
    """Groups, masked, the bfloat16 master-weight wrappers (bfloat16 parameters), Lion; eager, one skipped step."""
    params = _bf16_params() if name in ("kahan", "stochastic_rounding") else S._params()
    batches = S._batches(overflow=True)
    runs = []
    for donate in (False, True):
        opt = OPTIMIZERS[name]()
        state = fa.TrainState.create(
            {k: v.clone() for k, v in params.items()}, opt, loss_scale=fa.DynamicLossScale(2.0**12, period=2)
        )
        step = fa.make_train_step(S.mean_loss(torch.bfloat16), opt, compile=False, donate=donate)
        runs.append(_history(step, state, batches)[0])
    for i, ((s1, m1), (s2, m2)) in enumerate(zip(*runs)):
        S._assert_bitwise(s1, s2, f"{name} step {i}")
        S._assert_bitwise(m1, m2, f"{name} step {i} metrics")
    assert int(runs[1][-1][0].skipped_steps) == 1


@pytest.fixture(scope="module")
def compiled_donating():
    """One donating step compiled with aot_eager (bfloat16, overflow at step 1), and its graph counter."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    step = fa.make_train_step(S.mean_loss(torch.bfloat16), S._optimizer(), backend=counter, donate=True)
    return step, counter


def test_writes_into_the_given_tensors_one_graph(compiled_donating):
    step, counter = compiled_donating
    state = S._state(False)
    kept = {k: v for k, v in state.params.items()}  # the caller's references
    mu = state.opt_state[1][0].mu["w1"]
    before = {k: v.clone() for k, v in kept.items()}
    for i, batch in enumerate(S._batches(overflow=True)):
        scale_before = state.loss_scale.loss_scale.clone()
        new, metrics = step(state, batch)
        assert all(new.params[k] is kept[k] for k in kept)  # the same tensors, written in place
        assert new.opt_state[1][0].mu["w1"] is mu
        assert torch.equal(metrics["loss_scale"], scale_before)  # the scale this step used, not the next one
        if i == S.POISON_STEP:  # a skipped step leaves every value as it was
            assert not bool(metrics["grads_finite"])
            assert all(torch.equal(kept[k], before[k]) for k in kept)
        before = {k: v.clone() for k, v in kept.items()}
        state = new
    assert counter.frame_count == 1  # no recompile as the scale and the learning rate move


def test_donated_state_is_consumed(tmp_path):
    step = fa.make_train_step(S.mean_loss(torch.float32), S._optimizer(), compile=False, donate=True)
    state = S._state(False)
    new, _ = step(state, S._batches(False)[0])
    for use in (
        lambda: step(state, S._batches(False)[1]),
        lambda: fa.make_train_step(S.mean_loss(torch.float32), S._optimizer(), compile=False)(
            state, S._batches(False)[1]
        ),
        lambda: state.replace(step=state.step),
        lambda: checkpoint.save(tmp_path / "c.pt", {"state": state}),
    ):
        with pytest.raises(DonatedStateError, match="donated to a train step built with donate=True"):
            use()
    new, _ = step(new, S._batches(False)[1])  # the returned state goes on
    checkpoint.save(tmp_path / "c.pt", {"state": new})
    assert int(checkpoint.load(tmp_path / "c.pt")["state"].step) == 2


def test_resume_from_checkpoint_stays_bitwise(tmp_path):
    """Save a donated run's state, load it, go on donating: equal to an uninterrupted pure run."""
    batches = S._batches(overflow=True)
    pure, _ = _history(
        fa.make_train_step(S.mean_loss(torch.bfloat16), S._optimizer(), compile=False), S._state(False), batches
    )
    step = fa.make_train_step(S.mean_loss(torch.bfloat16), S._optimizer(), compile=False, donate=True)
    state = S._state(False)
    for batch in batches[:2]:
        state, _ = step(state, batch)
    checkpoint.save(tmp_path / "c.pt", {"state": state})
    state = checkpoint.load(tmp_path / "c.pt", like={"state": S._state(False)})["state"]
    for batch in batches[2:]:
        state, _ = step(state, batch)
    S._assert_bitwise(state, pure[-1][0], "resumed")


def test_tensors_that_must_not_be_written_are_refused():
    step = fa.make_train_step(S.mean_loss(torch.float32), optim.sgd(0.1), compile=False, donate=True)
    w = torch.randn(6, 8)
    params = {"w1": w, "b1": torch.zeros(8), "w2": torch.randn(8, 3)}
    twice = fa.TrainState.create(dict(params, w2=w[:, :3]), optim.sgd(0.1))  # a view of w1
    with pytest.raises(ValueError, match=r"state leaves .*'params.w1'.* and .*'params.w2'.* share storage"):
        step(twice, S._batches(False)[0])
    module = torch.nn.Linear(6, 8)
    owned = fa.TrainState.create(dict(params, w1=module.weight.T, b1=module.bias), optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"'params.b1' is an nn.Parameter"):
        step(owned, S._batches(False)[0])
    assert torch.equal(params["w1"], w)  # nothing was written


def test_every_call_checks_its_state():
    """Found by a newcomer: only the first call was checked, so a later state holding one tensor twice was
    written twice, silently. Each call is checked now."""
    step = fa.make_train_step(S.mean_loss(torch.float32), optim.sgd(0.1), compile=False, donate=True)
    step(fa.TrainState.create(S._params(), optim.sgd(0.1)), S._batches(False)[0])  # the first call passes
    w = torch.randn(6, 8)
    twice = fa.TrainState.create(dict(S._params(), w1=w, b1=w[0]), optim.sgd(0.1))
    with pytest.raises(ValueError, match="share storage"):
        step(twice, S._batches(False)[1])


def test_state_of_another_optimizer_is_named():
    """Found by a newcomer: a state made by chain(clip, adamw) stepped with sgd failed deep inside torch."""
    state = S._state(False)  # chain(clip_by_global_norm, adamw)
    step = fa.make_train_step(S.mean_loss(torch.float32), optim.sgd(0.1), compile=False)
    with pytest.raises(TypeError, match="state.opt_state was not made by this step's optimizer"):
        step(state, S._batches(False)[0])
