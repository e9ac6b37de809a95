"""grad_and_value: scaled gradients equal plain autograd of the same casted computation."""

import pytest
import torch
from torch import nn

import funcamp as fa

POLICIES = ["p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32"]


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))


def _convnet():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 3 * 3, 3),
    )


MODELS = {"mlp": (_mlp, (16, 12)), "conv": (_convnet, (4, 3, 8, 8))}


def _setup(model_name, policy_text):
    make, shape = MODELS[model_name]
    model = make()
    policy = fa.get_policy(policy_text)
    params = {k: v.detach() for k, v in model.named_parameters()}
    torch.manual_seed(1)
    x, y = torch.randn(*shape), torch.randint(0, 3, (shape[0],))

    def loss_fn(params, x, y):
        out = torch.func.functional_call(model, policy.cast_to_compute(params), (policy.cast_to_compute(x),))
        return nn.functional.cross_entropy(policy.cast_to_output(out), y)

    return model, policy, params, x, y, loss_fn


def _plain_autograd(model, policy, x, y):
    """The same casted computation with ordinary autograd, no scaling (float32 master weights)."""
    master = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}
    casted = {k: v.to(policy.compute_dtype) for k, v in master.items()}
    out = torch.func.functional_call(model, casted, (x.to(policy.compute_dtype),))
    loss = nn.functional.cross_entropy(out.float(), y)
    loss.backward()
    return {k: v.grad for k, v in master.items()}, loss.detach()


@pytest.mark.parametrize("policy_text", POLICIES)
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("scale", [1.0, 2.0**8])
def test_grads_equal_plain_autograd_of_the_casted_computation(model_name, policy_text, scale):
    model, policy, params, x, y, loss_fn = _setup(model_name, policy_text)
    out = fa.grad_and_value(loss_fn, fa.StaticLossScale(scale))(params, x, y)
    expected, expected_loss = _plain_autograd(model, policy, x, y)
    assert out.grads_finite
    assert out.value.dtype == torch.float32 and torch.equal(out.value, expected_loss)
    # Power-of-two scales commute with rounding (barring underflow), so the match is tight, not only to
    # the compute dtype's tolerance.
    eps = torch.finfo(policy.compute_dtype).eps
    for name, g in out.grads.items():
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, expected[name], rtol=4 * eps, atol=4 * eps * expected[name].abs().max().item())


@pytest.mark.parametrize("policy_text", POLICIES)
def test_outer_autocast_changes_nothing(policy_text):
    _, _, params, x, y, loss_fn = _setup("conv", policy_text)
    grad_fn = fa.grad_and_value(loss_fn, fa.StaticLossScale(64.0))
    plain = grad_fn(params, x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = grad_fn(params, x, y)
        assert torch.is_autocast_enabled("cpu")  # restored for the caller
    assert torch.equal(plain.value, inside.value)
    for name in params:
        assert torch.equal(plain.grads[name], inside.grads[name]), name


def test_compiled_over_functional_call_with_buffers_and_frozen_params_equals_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).eval()
    policy = fa.get_policy("p=f32,c=bf16,o=f32")
    named = {k: v.detach() for k, v in model.named_parameters()}
    frozen = {k: v for k, v in named.items() if k.startswith("0.")}
    trainable = {k: v for k, v in named.items() if k not in frozen}
    buffers = {k: v.float() if v.is_floating_point() else v for k, v in model.named_buffers()}
    x = torch.randn(5, 6)

    def loss_fn(trainable, frozen, buffers, x):
        tensors = policy.cast_to_compute({**frozen, **trainable, **buffers})
        return torch.func.functional_call(model, tensors, (policy.cast_to_compute(x),)).float().pow(2).mean()

    def run(trainable, frozen, buffers, x, loss_scale):
        return fa.grad_and_value(loss_fn, loss_scale)(trainable, frozen, buffers, x)

    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    for scale in (1.0, 256.0):
        loss_scale = fa.DynamicLossScale(scale)
        eager, comp = (
            run(trainable, frozen, buffers, x, loss_scale),
            compiled(trainable, frozen, buffers, x, loss_scale),
        )
        assert set(comp.grads) == set(trainable)
        assert torch.equal(eager.value, comp.value) and bool(comp.grads_finite)
        for name in trainable:
            torch.testing.assert_close(comp.grads[name], eager.grads[name], rtol=1e-6, atol=1e-7)


def test_low_precision_params_get_grads_in_their_own_dtype():
    params = {
        "h": torch.ones(3, dtype=torch.float16),
        "b": torch.ones(3, dtype=torch.bfloat16),
        "d": torch.ones(3, dtype=torch.float64),
    }

    def loss_fn(p):
        return (p["h"].float() * 2).sum() + (p["b"].float() * 3).sum() + (p["d"] * 4).sum()

    out = fa.grad_and_value(loss_fn, fa.StaticLossScale(1024.0))(params)
    assert {k: g.dtype for k, g in out.grads.items()} == {k: p.dtype for k, p in params.items()}
    assert (
        out.grads["h"].tolist() == [2.0] * 3
        and out.grads["b"].tolist() == [3.0] * 3
        and out.grads["d"].tolist() == [4.0] * 3
    )


def test_overflow_is_reported_not_raised():
    params = {"w": torch.ones(2)}

    def loss_fn(p):  # gradient 3.0 per element, scaled by 2**15 in float16: inf
        return (p["w"].half() * torch.tensor(3.0, dtype=torch.float16)).sum()

    out = fa.grad_and_value(loss_fn, fa.StaticLossScale(2.0**15))(params)
    assert not out.grads_finite and out.grads_finite.ndim == 0
    assert fa.grad_and_value(loss_fn, fa.StaticLossScale(2.0**10))(params).grads_finite


def test_nan_loss_is_not_finite_even_with_finite_grads():
    out = fa.grad_and_value(lambda p: p["w"].sum() + torch.tensor(float("nan")), fa.NoOpLossScale())(
        {"w": torch.ones(2)}
    )
    assert torch.isfinite(out.grads["w"]).all() and not out.grads_finite


def test_has_aux_and_argnums_mirror_torch_func():
    def loss_fn(a, b, k):
        loss = (a["w"] * b * k).sum()
        return loss, {"twice": loss * 2}

    a, b = {"w": torch.tensor([1.0, 2.0])}, torch.tensor([3.0, 4.0])
    out = fa.grad_and_value(loss_fn, fa.StaticLossScale(8.0), argnums=(0, 1), has_aux=True)(a, b, 2.0)
    ref_grads, ref_value = torch.func.grad_and_value(loss_fn, argnums=(0, 1), has_aux=True)(a, b, 2.0)
    assert isinstance(out.grads, tuple) and len(out.grads) == 2
    assert torch.equal(out.grads[0]["w"], ref_grads[0]["w"]) and torch.equal(out.grads[1], ref_grads[1])
    loss, aux = out.value
    assert loss.item() == 22.0 and aux["twice"].item() == 44.0 and torch.equal(loss, ref_value[0])


@pytest.mark.parametrize(
    "fun, params, error, fragment",
    [
        (lambda p: p["w"] * 2, {"w": torch.ones(3)}, ValueError, "must be 0-d"),
        (lambda p: (p["w"] * 2).sum().long(), {"w": torch.ones(3)}, TypeError, "floating tensor"),
        (lambda p: 3.0, {"w": torch.ones(3)}, TypeError, "got float"),
        (lambda p: p["w"].sum(), {"w": torch.ones(3), "step": torch.tensor(1)}, TypeError, "leaf 'step'"),
    ],
)
def test_bad_losses_and_params(fun, params, error, fragment):
    with pytest.raises(error, match="grad_and_value") as info:
        fa.grad_and_value(fun, fa.StaticLossScale(2.0))(params)
    assert fragment in str(info.value)


def test_has_aux_requires_a_pair():
    with pytest.raises(TypeError, match=r"\(loss, aux\)"):
        fa.grad_and_value(lambda p: p["w"].sum(), fa.NoOpLossScale(), has_aux=True)({"w": torch.ones(1)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_input_the_loss_ignores_gets_zeros_of_its_shape(dtype):
    """Eager grad_and_value (plain autograd, as torch.func would): a parameter the loss does not use gets zeros of
    its own shape and dtype, in the tree where torch.func.grad puts them; a second argument differentiated with
    ``argnums`` and ignored too."""
    params = {"w": torch.ones(3, dtype=dtype), "unused": torch.ones(2, 4, dtype=dtype)}
    other = torch.ones(5, 1, dtype=dtype)
    grads, _, finite = fa.grad_and_value(lambda p, q: (p["w"].float() * 2).sum(), fa.NoOpLossScale(), argnums=(0, 1))(
        params, other
    )
    expected = torch.func.grad(lambda p, q: (p["w"].float() * 2).sum(), argnums=(0, 1))(params, other)
    for got, want in [(grads[0]["unused"], expected[0]["unused"]), (grads[1], expected[1])]:
        assert got.shape == want.shape and got.dtype == dtype and not got.any()
    assert torch.equal(grads[0]["w"], torch.full((3,), 2.0, dtype=dtype)) and bool(finite)
