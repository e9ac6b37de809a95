"""funcamp.debug: the first non-finite locator on planted faults, and the dtype lint on risky patterns."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import funcamp as fa
from funcamp import optim
from funcamp.debug import NonFiniteReport, find_first_nonfinite, locate_from_state

F16 = "params=float32,compute=float16,output=float32"


class Wide(nn.Module):
    """A float16 Linear whose output passes 65504 (float16's largest finite value) for large inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.head = nn.Linear(4, 1)
        with torch.no_grad():
            self.fc.weight.fill_(100.0)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(x)))


class Attention(nn.Module):
    """Single-head self-attention with the softmax in the model's dtype (float16 under F16)."""

    def __init__(self, d: int = 16, mask: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if self.mask:
            t = x.shape[-2]
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(causal, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


class AttnModel(nn.Module):
    def __init__(self, mask: bool = False) -> None:
        super().__init__()
        self.attn = Attention(mask=mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


class ZeroNorm(nn.Module):
    """A hand-written norm, ``x / ||x||``: a zero row divides 0 by 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)


class NormModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)
        self.norm = ZeroNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


class LogHead(nn.Module):
    """``log(relu(x))``: the log of an exact zero is -inf."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.relu(x))


class LogModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = LogHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(x))


def _mean_loss(apply_fn):
    return lambda params, x: apply_fn(params, x).float().mean()


# --- planted faults ------------------------------------------------------------------------------


def test_activation_overflow_in_float16_linear():
    apply_fn, params = fa.nn.functionalize(Wide(), F16)
    x = torch.full((2, 8), 100.0)  # 8 * 100 * 100 = 80000 > 65504
    report = find_first_nonfinite(_mean_loss(apply_fn), params, x)
    assert (report.kind, report.phase, report.module) == ("op", "forward", "fc")
    assert report.op == "aten.addmm"
    assert report.input_dtypes == ("float16", "float16", "float16")
    assert max(report.input_amax) == 100.0 and report.output_amax == (math.inf,)
    assert report.output_inf == 8 and report.output_nan == 0
    assert not report.loss_finite and not report.grads_finite
    text = str(report)
    assert "forward op aten.addmm in fc" in text and "float16's range (max 65504)" in text
    # The same model in float32 is finite: the locator reports nothing.
    apply32, params32 = fa.nn.functionalize(Wide(), "float32")
    assert find_first_nonfinite(_mean_loss(apply32), params32, x).kind == "none"


def test_scaled_backward_of_float16_attention_overflows():
    """The common case: the forward is finite, the loss scale makes the attention's backward overflow."""
    torch.manual_seed(0)
    model = AttnModel()
    with torch.no_grad():
        model.attn.v.weight.fill_(1.0)  # v ~ 16 * |x| per element; grad of softmax's output = g @ v^T
    apply_fn, params = fa.nn.functionalize(model, F16, op_policies={"softmax": None})  # softmax in float16
    loss_fn = lambda p, x: apply_fn(p, x).float().sum()  # noqa: E731
    x = torch.ones(1, 8, 16)
    # dL/dout = 1; the gradient of the softmax output is sum_d(1 * v) = 16 * 17 = 272 at scale 1: finite.
    # At scale 1024 it is 278528 > 65504.
    report = find_first_nonfinite(loss_fn, params, x, loss_scale=fa.StaticLossScale(1024.0))
    assert (report.kind, report.phase, report.module) == ("op", "backward", "attn")
    assert report.op.startswith("aten.bmm") or report.op.startswith("aten.mm"), report.op
    assert "float16" in report.output_dtypes and report.output_inf > 0
    assert report.loss_finite and not report.grads_finite
    assert report.loss_scale == 1024.0 and report.finite_without_scale is True
    assert "the loss scale 1024 pushed the backward past float16's range" in str(report)
    # At scale 1 the whole step is finite.
    assert find_first_nonfinite(loss_fn, params, x).kind == "none"


def test_inf_in_the_data():
    apply_fn, params = fa.nn.functionalize(Wide(), "float32")
    x = torch.zeros(2, 8)
    x[1, 3] = math.inf
    report = find_first_nonfinite(lambda p, b: apply_fn(p, b["x"]).mean(), params, {"x": x, "y": torch.ones(2)})
    assert report.kind == "data" and "x" in report.leaf and report.op is None
    assert "the data itself is non-finite" in str(report)


def test_nonfinite_parameter_is_named():
    apply_fn, params = fa.nn.functionalize(Wide(), "float32")
    params = {**params, "head.bias": torch.tensor([math.nan])}
    report = find_first_nonfinite(_mean_loss(apply_fn), params, torch.ones(2, 8))
    assert report.kind == "parameter" and report.leaf == "head.bias"


def test_log_of_zero():
    model = LogModel()
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.copy_(torch.tensor([1.0, 0.0, 2.0, 3.0]))  # relu(0) = 0 in column 1
    apply_fn, params = fa.nn.functionalize(model, "float32")
    report = find_first_nonfinite(_mean_loss(apply_fn), params, torch.ones(3, 4))
    assert (report.kind, report.op, report.phase, report.module) == ("op", "aten.log", "forward", "head")
    assert report.input_dtypes == ("float32",) and report.input_amax == (3.0,)
    assert report.output_inf == 3 and report.output_nan == 0


def test_division_by_zero_in_a_custom_norm():
    model = NormModel()
    apply_fn, params = fa.nn.functionalize(model, "float32")
    x = torch.randn(3, 4)
    x[1] = 0.0  # fc(0) = 0 (no bias): a zero row, 0 / 0
    report = find_first_nonfinite(_mean_loss(apply_fn), params, x)
    assert (report.kind, report.op, report.phase, report.module) == ("op", "aten.div", "forward", "norm")
    assert report.output_nan == 4 and report.output_inf == 0
    assert report.input_amax[1] > 0  # the norms of the other rows


def test_masked_attention_is_not_a_finding():
    """-inf written on purpose from a -inf scalar (a causal mask) is not a non-finite source."""
    apply_fn, params = fa.nn.functionalize(AttnModel(mask=True), "float32")
    report = find_first_nonfinite(_mean_loss(apply_fn), params, torch.randn(2, 8, 16))
    assert report.kind == "none" and report.step_finite


def test_fully_masked_row_makes_a_nan_in_softmax():
    """A NaN made from -inf inputs (softmax of a row masked entirely) is still found."""

    def loss_fn(params, x):
        scores = x @ params["w"]
        scores = scores.masked_fill(torch.tensor([[True, True], [False, True]]), float("-inf"))
        return torch.softmax(scores, dim=-1).sum()

    report = find_first_nonfinite(loss_fn, {"w": torch.eye(2)}, torch.ones(2, 2))
    assert report.op == "aten._softmax" and report.module.startswith("loss_fn") and report.output_nan == 2


def test_locate_from_state_replays_a_skipped_step():
    model = AttnModel()
    with torch.no_grad():
        model.attn.v.weight.fill_(1.0)
    apply_fn, params = fa.nn.functionalize(model, F16, op_policies={"softmax": None})

    def loss_fn(p, batch):
        return apply_fn(p, batch["x"]).float().sum()

    opt = optim.sgd(1e-3)
    state = fa.TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(1024.0))
    step = fa.make_train_step(loss_fn, opt, compile=False, max_consecutive_skips=1)
    batch = {"x": torch.ones(2, 8, 16)}
    new_state, metrics = step(state, batch)
    assert not bool(metrics["grads_finite"])
    with pytest.raises(fa.SkippedStepsError):
        fa.check_skips(metrics)
    report = locate_from_state(loss_fn, state, batch, accumulation_steps=2)
    assert (report.phase, report.module, report.finite_without_scale) == ("backward", "attn", True)
    assert report.loss_scale == 1024.0
    # After the back-off the same batch is fine at 512? The scale halves to 512: still 139264 > 65504.
    assert float(new_state.loss_scale.loss_scale) == 512.0


def test_locate_from_state_names_the_micro_batch():
    apply_fn, params = fa.nn.functionalize(Wide(), "float32")
    state = fa.TrainState.create(params, optim.sgd(0.1))
    x = torch.zeros(4, 8)
    x[3, 0] = math.nan
    report = locate_from_state(lambda p, b: apply_fn(p, b).mean(), state, x, accumulation_steps=2)
    assert report.kind == "data" and report.leaf.startswith("micro-batch 1")


def test_overflow_in_the_cast_back_to_a_float16_parameter():
    """Every op finite in float32; the gradient overflows where autograd casts it to the float16 parameter."""
    params = {"w": torch.ones(2, dtype=torch.float16)}
    loss_fn = lambda p, x: (p["w"].float() * x).sum()  # noqa: E731
    report = find_first_nonfinite(loss_fn, params, torch.full((2,), 1e5))
    assert (report.op, report.phase) == ("aten._to_copy (ToCopyBackward0)", "backward")
    assert report.input_dtypes == ("float32",) and report.output_dtypes == ("float16",)
    assert report.input_amax == (1e5,) and report.loss_finite and not report.grads_finite


def test_bad_arguments():
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        find_first_nonfinite(None, {}, None)
    with pytest.raises(TypeError, match="funcamp loss scale"):
        find_first_nonfinite(lambda p, b: p["w"].sum(), {"w": torch.ones(1)}, None, loss_scale=2.0)
    with pytest.raises(TypeError, match="0-d floating tensor"):
        find_first_nonfinite(lambda p, b: p["w"], {"w": torch.ones(2)}, None)
    with pytest.raises(TypeError, match="TrainState"):
        locate_from_state(lambda p, b: p["w"].sum(), {"w": torch.ones(1)}, None)
    assert isinstance(find_first_nonfinite(lambda p, b: p["w"].sum(), {"w": torch.ones(1)}, None), NonFiniteReport)
