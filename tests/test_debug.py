"""funcamp.debug: the first non-finite locator on planted faults, and the dtype lint on risky patterns."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcamp as fa
from funcamp import optim
from funcamp.debug import LintFinding, LintReport, NonFiniteReport, find_first_nonfinite, lint, locate_from_state

F16 = "params=float32,compute=float16,output=float32"
BF16 = "params=float32,compute=bfloat16,output=float32"


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
    """The common case: the forward is finite, the loss scale makes the attention's backward overflow.

    The first op to overflow is the backward of ``softmax(scores) @ v`` (the gradient of the softmax's
    output), in float16; softmax's own backward, ``y * (g - sum(y * g))``, is at most max|g| / 2 in
    magnitude, so it cannot be the first.
    """
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
    assert "the loss scale 1024 (2**10) pushed the backward past float16's range" in str(report)
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
    assert report.op == "aten._softmax" and report.module.startswith("outside modules") and report.output_nan == 2


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


# --- lint ----------------------------------------------------------------------------------------


def _kinds(report):
    return {(f.kind, f.module, f.op) for f in report}


class Scatter(nn.Module):
    """Sums 4096 rows into 4 with index_add: about 1024 terms per output row."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return torch.zeros(4, 8, dtype=x.dtype).index_add(0, index, self.fc(x))


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scatter = Scatter()

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.scatter(x, index)


def test_lint_half_accumulation_index_add_and_embedding_backward():
    torch.manual_seed(0)
    apply_fn, params = fa.nn.functionalize(Pool(), BF16, op_policies={"index_add": None})  # no float32 rule
    index = torch.arange(4096) % 4
    report = lint(lambda p, b: apply_fn(p, b[0], b[1]).mean(), params, (torch.randn(4096, 8), index), BF16)
    (finding,) = [f for f in report if f.kind == "half-accumulation"]
    assert (finding.module, finding.op, finding.dtype, finding.size) == ("scatter", "aten.index_add", "bfloat16", 1024)
    assert "op_policies={'index_add': torch.float32}" in finding.suggestion
    # With the suggested override (funcamp's default) the accumulation runs in float32: no finding.
    apply32, params = fa.nn.functionalize(Pool(), BF16, op_policies={"index_add": torch.float32})
    assert not [
        f
        for f in lint(lambda p, b: apply32(p, b[0], b[1]).mean(), params, (torch.randn(4096, 8), index))
        if f.kind == "half-accumulation"
    ]
    # Below the bfloat16 threshold (256 terms per row) nothing is flagged: 512 rows into 4 is 128 terms.
    # (The bias gradient, a bfloat16 sum over 512 rows, is not flagged: torch reduces in float32.)
    small = (torch.randn(512, 8), torch.arange(512) % 4)
    assert not [
        f for f in lint(lambda p, b: apply_fn(p, b[0], b[1]).mean(), params, small) if f.kind.startswith("half")
    ]


def test_lint_embedding_backward_in_bfloat16():
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 1))
    ids = torch.zeros(4096, dtype=torch.long)  # one row used 4096 times: its gradient sums 4096 terms
    # Both defaults off: the table in bfloat16 (its module's compute dtype) and no float32 op rule.
    apply_fn, params = fa.nn.functionalize(
        model, BF16, module_policies={nn.Embedding: None}, op_policies={"embedding": None}
    )
    report = lint(lambda p, x: apply_fn(p, x).mean(), params, ids, BF16)
    flagged = [f for f in report if f.kind == "half-accumulation"]
    assert [(f.module, f.op, f.size) for f in flagged] == [
        ("0", "aten.embedding_dense_backward (EmbeddingBackward0)", 4096)
    ]
    # Either of funcamp's defaults runs it in float32 (the embedding's float32 lookup,
    # funcamp.nn.float32_lookup; the op rule of FLOAT32_ACCUMULATION): not flagged.
    for options in ({}, {"op_policies": {"embedding": None}}, {"module_policies": {nn.Embedding: None}}):
        apply_fn, params = fa.nn.functionalize(model, BF16, **options)
        report = lint(lambda p, x, fn=apply_fn: fn(p, x).mean(), params, ids, BF16)
        assert not [f for f in report if f.kind == "half-accumulation"], options


def test_lint_cumsum_and_half_reduction():
    x = torch.randn(4, 4096, dtype=torch.float16)
    params = {"w": torch.ones(4096, dtype=torch.float16)}
    report = lint(lambda p, x: (x * p["w"]).sum(-1).float().mean() + (x * p["w"]).cumsum(-1).float().mean(), params, x)
    got = {(f.kind, f.op) for f in report}
    assert ("half-reduction", "aten.sum") in got  # 4096 terms per output element in float16
    assert ("half-accumulation", "aten.cumsum") in got
    (red,) = [f for f in report if (f.kind, f.op) == ("half-reduction", "aten.sum")]
    assert red.size == 4096 and red.dtype == "float16" and red.module.startswith("outside modules")
    # In float32 none of this is flagged.
    report32 = lint(
        lambda p, x: (x * p["w"]).sum(-1).mean() + (x * p["w"]).cumsum(-1).mean(), {"w": params["w"].float()}, x.float()
    )
    assert not [f for f in report32 if f.kind.startswith("half")]


class ExpHead(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x) + torch.log_softmax(x, dim=-1)


class ExpModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = ExpHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(x))


def test_lint_float16_range_ops():
    apply_fn, params = fa.nn.functionalize(ExpModel(), F16, op_policies={"log_softmax": None})
    report = lint(lambda p, x: apply_fn(p, x).mean(), params, torch.randn(4, 8), F16)
    ops = {f.op for f in report if f.kind == "float16-range" and f.module == "head"}
    assert {"aten.exp", "aten._log_softmax", "aten._log_softmax_backward_data (LogSoftmaxBackward0)"} <= ops, ops
    assert all("bfloat16" in f.suggestion for f in report if f.kind == "float16-range")
    # bfloat16 has float32's range: nothing to flag.
    apply_fn, params = fa.nn.functionalize(ExpModel(), BF16, op_policies={"log_softmax": None})
    assert not [
        f
        for f in lint(lambda p, x: apply_fn(p, x).mean(), params, torch.randn(4, 8), BF16)
        if f.kind == "float16-range"
    ]


class RoundTrip(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().to(x.dtype) * 2  # a float32 copy, cast straight back


class RoundTripModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.trip = RoundTrip()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trip(self.fc(x))


def test_lint_half_float32_round_trip_counts_bytes():
    apply_fn, params = fa.nn.functionalize(RoundTripModel(), BF16)
    report = lint(lambda p, x: apply_fn(p, x).mean(), params, torch.randn(16, 64), BF16)
    (trip,) = [f for f in report if f.kind == "round-trip" and f.module == "trip"]
    # Forward: 16 x 64 elements, read 2 + write 4 bytes up, read 4 + write 2 down = 12 bytes each = 12 KiB.
    # The backward's gradient takes the same two casts in reverse order: another 12 KiB.
    assert trip.dtype == "float32" and trip.count == 2 and trip.size == 2 * 16 * 64 * 12
    assert "bfloat16 -> float32 -> bfloat16: 24.0 KiB moved for nothing" in trip.detail

    # A float32 op in between is not a round trip.
    class Exp(nn.Module):
        def forward(self, x):
            return x.float().exp().to(x.dtype)

    apply_fn, params = fa.nn.functionalize(nn.Sequential(nn.Linear(64, 64), Exp(), nn.Linear(64, 1)), BF16)
    assert not [f for f in lint(lambda p, x: apply_fn(p, x).mean(), params, torch.randn(16, 64)) if f.module == "1"]


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(256, 256)
        self.big = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(self.small(x))


def test_lint_float32_matmul_inside_a_half_policy():
    apply_fn, params = fa.nn.functionalize(TwoLinears(), BF16, module_policies={"big": "float32"})
    report = lint(lambda p, x: apply_fn(p, x).mean(), params, torch.randn(64, 256), BF16)
    flagged = [f for f in report if f.kind == "float32-matmul"]
    assert {f.module for f in flagged} == {"big"}
    # Forward addmm and the two backward mms: 2 * 64 * 256 * 256 FLOPs each.
    assert max(f.size for f in flagged) == 2 * 64 * 256 * 256 and sum(f.count for f in flagged) == 3
    assert "8.39 MFLOP per call in float32 while the policy computes in bfloat16" in flagged[0].detail
    # Without the policy given, the run counts as bfloat16: a matmul ran in bfloat16.
    assert {
        f.module
        for f in lint(lambda p, x: apply_fn(p, x).mean(), params, torch.randn(64, 256))
        if f.kind == "float32-matmul"
    } == {"big"}
    # A float32 policy runs everything in float32: nothing is slow for it.
    apply_fn, params = fa.nn.functionalize(TwoLinears(), "float32")
    assert not lint(lambda p, x: apply_fn(p, x).mean(), params, torch.randn(64, 256), "float32")


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.dead = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)
        with torch.no_grad():
            self.dead.bias.fill_(-100.0)  # relu(dead(x)) == 0: no gradient reaches dead

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x) + torch.relu(self.dead(x))


def test_lint_zero_and_missing_gradients():
    apply_fn, params = fa.nn.functionalize(Unused(), "float32")
    report = lint(lambda p, x: apply_fn(p, x).mean(), params, torch.randn(3, 4), "float32")
    zero = {f.module: f.detail for f in report if f.kind == "zero-gradient" and f.op == "gradient"}
    assert zero == {
        "dead.weight": "gradient is 0 everywhere",
        "dead.bias": "gradient is 0 everywhere",
        "spare.weight": "the loss does not use this parameter",
        "spare.bias": "the loss does not use this parameter",
    }
    # Parameters of repeated blocks fold into one finding with a count.
    blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    apply_fn, params = fa.nn.functionalize(nn.ModuleDict({"used": nn.Linear(4, 1), "blocks": blocks}), "float32")
    report = lint(lambda p, x: (x @ p["used.weight"].T).sum(), params, torch.randn(3, 4))
    assert {(f.module, f.count) for f in report} == {("used.bias", 1), ("blocks.*.weight", 3), ("blocks.*.bias", 3)}


def test_lint_zero_gradient_from_float16_underflow_suggests_a_loss_scale():
    params = {"w": torch.ones(8)}
    loss_fn = lambda p, x: (p["w"].half() * x).float().mean() * 1e-6  # noqa: E731  d/dw = 1.25e-7 < 6e-8 * 2
    x = torch.full((8,), 1e-3, dtype=torch.float16)  # 1e-3 * 1e-6 / 8 is below float16's smallest subnormal
    (finding,) = [f for f in lint(loss_fn, params, x) if f.kind == "zero-gradient"]
    assert finding.module == "w" and "underflows" in finding.detail and "loss scale" in finding.suggestion
    # A loss scale of 2**20 keeps it: no finding.
    assert not [
        f for f in lint(loss_fn, params, x, loss_scale=fa.StaticLossScale(2.0**20)) if f.kind == "zero-gradient"
    ]


# The main job's model (examples/gpt.py), tiny size, shared by the two policies.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


@pytest.fixture(scope="module")
def gpt_batch():
    from gpt import GPT, config_for

    torch.manual_seed(0)
    model = GPT(config_for("tiny"))
    return model, torch.randint(0, 256, (4, model.config.block_size + 1))


def _gpt_lint(model, batch, policy, **kwargs):
    apply_fn, params = fa.nn.functionalize(model, policy, **kwargs)

    def loss_fn(p, b):
        return F.cross_entropy(apply_fn(p, b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())

    return lint(loss_fn, params, batch, policy)


def test_lint_gpt_float32_has_no_findings(gpt_batch):
    report = _gpt_lint(*gpt_batch, "float32")
    assert list(report) == [] and str(report) == "funcamp lint: no findings"


def test_lint_gpt_bfloat16_is_short_and_explained(gpt_batch):
    # Nothing in the bfloat16 GPT is risky or slow by these rules: the embeddings look up in float32 from
    # their float32 masters (funcamp.nn.float32_lookup), so their tables are not cast at all.
    report = _gpt_lint(*gpt_batch, BF16)
    assert list(report) == [] and str(report) == "funcamp lint: no findings"
    # With the embedding default off, the token and position embeddings' weights are cast to bfloat16
    # (their module's compute dtype) and back to float32 by funcamp.ops.FLOAT32_ACCUMULATION's embedding
    # rule, forward and backward: the round trips the lint reports, and nothing else.
    old = _gpt_lint(*gpt_batch, BF16, module_policies={nn.Embedding: None})
    assert len(str(old).splitlines()) <= 20
    assert {(f.kind, f.module, f.count) for f in old} == {("round-trip", "wte", 2), ("round-trip", "wpe", 2)}
    (wte,) = [f for f in old if f.module == "wte"]
    assert "module_policies={'wte': 'params=float32,compute=float32,output=bfloat16'}" in wte.suggestion
    # The suggested module policy removes them (a name entry wins over the type entry: first match).
    fixed = _gpt_lint(
        *gpt_batch,
        BF16,
        module_policies={
            "wte": "params=float32,compute=float32,output=bfloat16",
            "wpe": "params=float32,compute=float32,output=bfloat16",
            nn.Embedding: None,
        },
    )
    assert list(fixed) == []


def test_lint_report_folds_blocks_and_stays_short():
    findings = [LintFinding("round-trip", "aten._to_copy", f"m{i}", "float32", "d", "s") for i in range(30)]
    text = str(LintReport(findings))
    assert len(text.splitlines()) == 20 and text.splitlines()[-1].startswith("... and 12 more")
    # Repeated blocks fold into one finding with a count.
    model = nn.Sequential(*[RoundTrip() for _ in range(5)])
    apply_fn, params = fa.nn.functionalize(nn.Sequential(nn.Linear(8, 8), model), BF16)
    report = lint(lambda p, x: apply_fn(p, x).mean(), params, torch.randn(2, 8))
    (trip,) = [f for f in report if f.kind == "round-trip"]
    assert trip.module == "1.*" and trip.count == 10


def test_lint_bad_arguments():
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        lint(None, {}, None)
    with pytest.raises(ValueError, match="min_terms must be a positive int"):
        lint(lambda p, b: p["w"].sum(), {"w": torch.ones(1)}, None, min_terms=0)
    with pytest.raises(ValueError):
        lint(lambda p, b: p["w"].sum(), {"w": torch.ones(1)}, None, policy="compute=float17")


def test_locator_with_buffers_and_aux():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), LogHead())
    apply_fn, params, buffers = fa.nn.functionalize(model, "float32", with_buffers=True)

    def loss_fn(p, b, x):
        out, new_b = apply_fn(p, b, x)
        return (out.mean(), {"out": out.detach()}), new_b

    x = torch.randn(8, 4)
    report = find_first_nonfinite(loss_fn, params, x, buffers=buffers, has_aux=True)
    # BatchNorm makes each column zero-mean: about half the entries are <= 0, their log is -inf or NaN.
    assert (report.op, report.module, report.phase) == ("aten.log", "2", "forward")
    bad = {**buffers, "1.running_var": torch.full((4,), math.nan)}
    report = find_first_nonfinite(loss_fn, params, x, buffers=bad, has_aux=True)
    assert (report.kind, report.leaf) == ("buffer", "1.running_var")


def test_gpt_float16_with_a_too_large_loss_scale(gpt_batch):
    """The main job's model in float16: the forward is finite, loss scale 2**26 overflows the backward."""
    model, batch = gpt_batch
    apply_fn, params = fa.nn.functionalize(model, F16)

    def loss_fn(p, b):
        return F.cross_entropy(apply_fn(p, b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())

    report = find_first_nonfinite(loss_fn, params, batch, loss_scale=fa.StaticLossScale(2.0**26))
    assert report.phase == "backward" and report.loss_finite and not report.grads_finite
    assert report.finite_without_scale is True and report.output_dtypes == ("float16",)
    assert "2**26" in str(report)


def test_in_place_overflow_of_a_tensor_checked_before():
    """A tensor found finite, then written in place: the write is checked again (the finite cache is dropped)."""

    def loss_fn(p, x):
        y = p["w"] * x  # finite, remembered as such
        z = y.view(-1)  # a view of a finite tensor: finite without a check
        z.mul_(1e30)  # in place: 3e10 * 1e30 = 3e40 overflows float32 (max 3.4e38)
        return y.sum()

    report = find_first_nonfinite(loss_fn, {"w": torch.full((2, 2), 3e10)}, torch.ones(2, 2))
    assert (report.op, report.phase, report.output_inf) == ("aten.mul_", "forward", 4)
    assert report.input_amax[0] == pytest.approx(3e10)  # read before the op wrote it
