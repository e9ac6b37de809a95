"""tune_policy: the measured choice follows the times, refuses inaccurate candidates, caches, and trains.

Machine-independent: no test asserts which dtype a real measurement picks (float32 on an AVX2-only CPU,
possibly bfloat16 on an AMX CPU or a GPU); they assert that the choice follows the measured times, and
use a scripted ``timer`` (or a module that sleeps in half precision) where a particular winner is needed.

choose_compute_dtype (one dtype for the whole step, the main job's ``--policy auto``): the CPU facts are
faked (``hardware._cpu_facts``) so that every machine measures, or not, as the test needs, and a scripted
per-round timer drives the decision: spread against difference, paired rounds, cache hits that build and
time nothing, ``retune``, the capability facts that time nothing.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcamp as fa
from funcamp import hardware, optim
from funcamp.nn import functionalize
from funcamp.tune import (
    DEFAULT_RTOL,
    ComputeDtypeChoice,
    TuneResult,
    choose_compute_dtype,
    default_cache_dir,
    tune_policy,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, config_for  # noqa: E402

HALF = (torch.bfloat16, torch.float16)


def scripted(times: dict[torch.dtype, float], calls: list | None = None):
    """A timer that reports ``times[dtype]`` for the candidate it is given (running it once)."""

    def timer(fn) -> float:
        fn()
        if calls is not None:
            calls.append((fn.module, fn.dtype))
        return times[fn.dtype]

    return timer


def tiny_gpt() -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(config_for("tiny"))
    return model, torch.randint(256, (4, model.config.block_size))


@pytest.fixture(scope="module")
def measured() -> TuneResult:
    """The tiny GPT tuned with the real timer (``median_seconds``) on this machine."""
    model, x = tiny_gpt()
    return tune_policy(model, (x,), cache=False)


# --- the choice follows the measured times ------------------------------------------------------------


def test_choice_follows_measured_times(measured: TuneResult) -> None:
    assert measured.table, "no rows"
    for row in measured.table:
        safe = [c for c in row.candidates if not c.refused]
        fastest = min(safe, key=lambda c: c.seconds)
        f32 = next(c for c in row.candidates if c.dtype == torch.float32)
        expected = torch.float32 if f32.seconds <= 1.05 * fastest.seconds else fastest.dtype
        assert row.choice == expected, row
        for name in row.modules:
            assert measured.module_policies[name].compute_dtype == row.choice
            assert measured.module_policies[name].output_dtype == row.choice
            assert measured.module_policies[name].param_dtype == torch.float32


def test_groups_units_and_leaves_norms_to_functionalize(measured: TuneResult) -> None:
    # depth 2 of the tiny GPT: embeddings, the attention and MLP of both blocks (one group each), lm_head;
    # LayerNorms keep functionalize's float32 default (no entry).
    assert [row.modules for row in measured.table] == [
        ("wte",),
        ("wpe",),
        ("blocks.0.attn", "blocks.1.attn"),
        ("blocks.0.mlp", "blocks.1.mlp"),
        ("lm_head",),
    ]
    assert not any("ln" in name for name in measured.module_policies)
    assert [row.kind for row in measured.table] == ["Embedding", "Embedding", "CausalSelfAttention", "MLP", "Linear"]


def test_healthy_gpt_candidates_are_accurate(measured: TuneResult) -> None:
    # Rounding alone: every half candidate of a healthy model within 4 units of roundoff (measured on the
    # AVX2 EPYC: at most 1.2 units), far inside the default bound of 16. Above 0 for every unit, the
    # embeddings too: each unit is measured in the candidate dtype even where functionalize has a float32
    # default for its type, as the map's entry makes it run in the whole model.
    for row in measured.table:
        assert [c.dtype for c in row.candidates] == [torch.float32, torch.bfloat16, torch.float16]
        for c in row.candidates:
            if c.dtype == torch.float32:
                assert c.output_error == 0 and c.grad_error == 0 and c.bound == 0
                continue
            unit = torch.finfo(c.dtype).eps / 2
            assert 0 < c.output_error <= 4 * unit and 0 < c.grad_error <= 4 * unit, (row.modules, c)
            assert c.bound == DEFAULT_RTOL[c.dtype] == 16 * unit
            assert c.refused == "" and c.seconds > 0


def test_table_prints_every_group_candidate_and_choice(measured: TuneResult) -> None:
    text = str(measured)
    assert "blocks.{0,1}.attn" in text and "blocks.{0,1}.mlp" in text and "lm_head" in text
    assert text.count("CHOSEN") == len(measured.table)
    assert text.count("bfloat16") >= len(measured.table) and "fwd+bwd ms" in text and "bound" in text
    assert measured.machine in text


class SleepyInHalf(nn.Module):
    """A linear layer that sleeps 20 ms whenever it computes in a half dtype: half is artificially slow."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in HALF:
            time.sleep(0.02)
        return self.lin(x)


def test_artificially_slow_half_loses_with_the_real_timer() -> None:
    model = nn.Sequential(SleepyInHalf(), nn.GELU())
    result = tune_policy(model, (torch.randn(8, 16),), cache=False, depth=1)
    row = result.table[0]
    assert row.modules == ("0",) and row.choice == torch.float32
    times = {c.dtype: c.seconds for c in row.candidates}
    assert all(times[d] >= 0.02 > times[torch.float32] for d in HALF), times
    assert result.module_policies["0"].compute_dtype == torch.float32


@pytest.mark.parametrize(
    ("times", "expected"),
    [
        ({torch.float32: 1.0, torch.bfloat16: 0.5, torch.float16: 0.7}, torch.bfloat16),  # half faster: chosen
        ({torch.float32: 1.0, torch.bfloat16: 0.97, torch.float16: 2.0}, torch.float32),  # within 5%: float32
        ({torch.float32: 1.0, torch.bfloat16: 30.0, torch.float16: 40.0}, torch.float32),  # half slow (AVX2)
        ({torch.float32: 1.0, torch.bfloat16: 0.9, torch.float16: 0.8}, torch.float16),  # fastest of two
    ],
)
def test_choice_rule_on_scripted_times(times: dict, expected: torch.dtype) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    result = tune_policy(model, (torch.randn(4, 8),), cache=False, timer=scripted(times))
    assert [row.choice for row in result.table] == [expected, expected]
    assert {str(p) for p in result.module_policies.values()} == {
        f"params=float32,compute={str(expected).removeprefix('torch.')},output={str(expected).removeprefix('torch.')}"
    }


def test_margin_is_an_option() -> None:
    times = {torch.float32: 1.0, torch.bfloat16: 0.8, torch.float16: 2.0}
    model = nn.Sequential(nn.Linear(8, 8))
    args = (torch.randn(4, 8),)
    assert tune_policy(model, args, cache=False, timer=scripted(times)).table[0].choice == torch.bfloat16
    result = tune_policy(model, args, cache=False, timer=scripted(times), margin=0.3)
    assert result.table[0].choice == torch.float32


# --- refused candidates -------------------------------------------------------------------------------------


class Cancels(nn.Module):
    """``lin(x) + 1000 - 1000``: exact in float32, catastrophic cancellation in a half dtype (bfloat16
    spacing at 1000 is 4, float16's 0.5: errors of order 1 against values of order 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + 1000.0 - 1000.0


class ExpOfLarge(nn.Module):
    """``exp(x + 12)``: overflows float16 (e^11.1 > 65504), fine in bfloat16 (float32's range)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x + 12.0)


class NoHalfKernel(nn.Module):
    """Raises in half precision, as oneDNN's LSTM does under bfloat16 on an AVX2-only CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in HALF:
            raise RuntimeError("could not create a primitive descriptor (scripted)")
        return self.lin(x)


HALF_FASTEST = {torch.float32: 1.0, torch.bfloat16: 0.1, torch.float16: 0.05}


def test_candidate_above_the_bound_is_refused_even_when_fastest() -> None:
    model = nn.Sequential(Cancels())
    result = tune_policy(model, (torch.randn(8, 16),), cache=False, timer=scripted(HALF_FASTEST), depth=1)
    row = result.table[0]
    assert row.choice == torch.float32
    for c in row.candidates[1:]:
        assert c.refused.startswith("error ") and "> bound" in c.refused, c
        assert max(c.output_error, c.grad_error) > 100 * torch.finfo(c.dtype).eps / 2  # far past 16 units
    assert "refused: error" in str(result)


def test_overflow_refuses_float16_only() -> None:
    model = nn.Sequential(ExpOfLarge())
    result = tune_policy(model, (torch.randn(64),), cache=False, timer=scripted(HALF_FASTEST))
    row = result.table[0]
    by = {c.dtype: c for c in row.candidates}
    assert by[torch.float16].refused == "non-finite" and math.isinf(by[torch.float16].output_error)
    assert by[torch.bfloat16].refused == "" and by[torch.bfloat16].output_error < DEFAULT_RTOL[torch.bfloat16]
    assert row.choice == torch.bfloat16  # the fastest candidate that is safe


def test_a_tighter_bound_refuses_more() -> None:
    model = nn.Sequential(nn.Linear(16, 16))
    args = (torch.randn(8, 16),)
    loose = tune_policy(model, args, cache=False, timer=scripted(HALF_FASTEST))
    assert loose.table[0].choice == torch.float16
    tight = tune_policy(model, args, cache=False, timer=scripted(HALF_FASTEST), rtol={"float16": 1e-9})
    by = {c.dtype: c for c in tight.table[0].candidates}
    assert by[torch.float16].refused.startswith("error") and by[torch.float16].bound == 1e-9
    assert tight.table[0].choice == torch.bfloat16


def test_candidate_that_raises_is_refused_and_float32_kept() -> None:
    model = nn.Sequential(NoHalfKernel())
    result = tune_policy(model, (torch.randn(8, 16),), cache=False, timer=scripted(HALF_FASTEST), depth=1)
    row = result.table[0]
    assert row.choice == torch.float32
    for c in row.candidates[1:]:
        assert c.refused.startswith("raised: could not create a primitive descriptor") and c.seconds is None


class Reciprocal(nn.Module):
    """``1 / x``: on [1e-3, 2e-3] the output (500-1000) is accurate in float16, the gradient ``-1/x^2``
    (about -1e6) is beyond float16's 65504."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1 / x


def test_gradient_overflow_alone_refuses_float16() -> None:  # issue 26 item 14, its values
    x = 1e-3 + 1e-3 * torch.rand(64, generator=torch.Generator().manual_seed(0))
    assert float((1 / x.double() ** 2).min()) > torch.finfo(torch.float16).max  # the oracle: it must overflow
    result = tune_policy(nn.Sequential(Reciprocal()), (x,), cache=False, timer=scripted(HALF_FASTEST))
    by = {c.dtype: c for c in result.table[0].candidates}
    f16 = by[torch.float16]
    # The forward alone would pass: 0.7 units of roundoff (measured 3.3e-4), far inside the bound.
    assert f16.output_error <= 2 * torch.finfo(torch.float16).eps / 2 < f16.bound
    assert math.isinf(f16.grad_error) and f16.refused == "non-finite"
    assert by[torch.bfloat16].refused == "" and result.table[0].choice == torch.bfloat16


class InfInFloat32(nn.Module):
    """Non-finite in float32 only (a scripted fault): there is no reference to judge a half candidate by."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * math.inf if x.dtype == torch.float32 else x


def test_no_finite_reference_accepts_no_half_candidate() -> None:
    # Before: the error against an infinite reference was NaN, which max() dropped: float16 was chosen.
    result = tune_policy(nn.Sequential(InfInFloat32()), (torch.randn(8),), cache=False, timer=scripted(HALF_FASTEST))
    row = result.table[0]
    assert [c.refused for c in row.candidates[1:]] == ["non-finite", "non-finite"]
    assert row.choice == torch.float32


# --- the cache -------------------------------------------------------------------------------------------------


def test_second_call_reads_the_cache_and_measures_nothing(tmp_path: Path) -> None:
    model, x = tiny_gpt()
    calls: list = []
    times = {torch.float32: 1.0, torch.bfloat16: 0.5, torch.float16: 2.0}
    first = tune_policy(model, (x,), cache=tmp_path, timer=scripted(times, calls))
    assert len(calls) == 3 * 3 * len(first.table) and not first.from_cache  # 3 rounds x 3 dtypes
    assert first.cache_path is not None and first.cache_path.parent == tmp_path and first.cache_path.exists()
    calls.clear()
    second = tune_policy(model, (x,), cache=tmp_path, timer=scripted(times, calls))
    assert calls == [] and second.from_cache and second.cache_path == first.cache_path
    assert second.module_policies == first.module_policies and second.table == first.table
    # Another input shape is another key: measured again.
    tune_policy(model, (x[:, :16],), cache=tmp_path, timer=scripted(times, calls))
    assert len(calls) == 3 * 3 * len(first.table)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_cache_key_includes_the_parameter_shapes_and_options(tmp_path: Path) -> None:
    calls: list = []
    timer = scripted({torch.float32: 1.0, torch.bfloat16: 1.0, torch.float16: 1.0}, calls)
    x = torch.randn(4, 8)
    tune_policy(nn.Sequential(nn.Linear(8, 8)), (x,), cache=tmp_path, timer=timer)
    tune_policy(nn.Sequential(nn.Linear(8, 4)), (x,), cache=tmp_path, timer=timer)  # other shapes
    tune_policy(nn.Sequential(nn.Linear(8, 8)), (x,), cache=tmp_path, timer=timer, margin=0.2)  # other option
    assert len(calls) == 27
    tune_policy(nn.Sequential(nn.Linear(8, 8)), (x,), cache=tmp_path, timer=timer)  # other weights, same key
    assert len(calls) == 27


def test_cache_dir_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUNCAMP_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path / "tune"
    result = tune_policy(nn.Sequential(nn.Linear(8, 8)), (torch.randn(4, 8),), timer=scripted(HALF_FASTEST))
    assert result.cache_path is not None and result.cache_path.parent == tmp_path / "tune"
    doc = json.loads(result.cache_path.read_text())
    assert doc["key"]["torch"] == torch.__version__ and doc["rows"][0]["choice"] == "float16"
    monkeypatch.delenv("FUNCAMP_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "funcamp" / "tune"


def test_public_classes_keep_their_module_for_pickles_and_checkpoints(tmp_path: Path) -> None:
    """``funcamp.tune`` is a package of rooms, but its public classes are ``funcamp.tune.X`` as when it was one
    file: a pickle and a checkpoint name them so, and load. (Planted: ``StepTiming`` left at its room's module,
    ``funcamp.tune._timing``: fails.)"""
    import pickle

    from funcamp import checkpoint, tune

    for name in tune.__all__:
        obj = getattr(tune, name)
        if isinstance(obj, type):
            assert obj.__module__ == "funcamp.tune", name
    timing = tune.StepTiming(torch.bfloat16, (0.5, 0.25), 0.375, 0.9, 0.8, 1.0, 2.0)
    assert b"funcamp.tune._" not in pickle.dumps(timing) and pickle.loads(pickle.dumps(timing)) == timing
    checkpoint.save(tmp_path / "t.pt", {"timing": timing})
    raw = torch.load(tmp_path / "t.pt", weights_only=True)
    assert raw["tree"]["items"][0][1]["type"] == "funcamp.tune.StepTiming"
    assert checkpoint.load(tmp_path / "t.pt") == {"timing": timing}


def test_unreadable_cache_file_warns_and_measures_again(tmp_path: Path) -> None:
    model, args = nn.Sequential(nn.Linear(8, 8)), (torch.randn(4, 8),)
    calls: list = []
    first = tune_policy(model, args, cache=tmp_path, timer=scripted(HALF_FASTEST, calls))
    first.cache_path.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable cache file"):
        again = tune_policy(model, args, cache=tmp_path, timer=scripted(HALF_FASTEST, calls))
    assert len(calls) == 18 and not again.from_cache
    assert json.loads(first.cache_path.read_text())["rows"]  # rewritten


class ExpLinear(nn.Module):
    """``exp(Linear(x))``, the Linear the identity: float16 overflows where ``x > ln(65520) = 11.09``."""

    def __init__(self, n: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        with torch.no_grad():
            self.lin.weight.copy_(torch.eye(n))
            self.lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.lin(x))


def test_cache_hit_checks_numerics_on_the_batch_at_hand(tmp_path: Path) -> None:  # issue 26 item 4
    model = nn.Sequential(ExpLinear())
    g = torch.Generator().manual_seed(0)
    small, large = torch.rand(8, 16, generator=g), 3 + 10 * torch.rand(8, 16, generator=g)  # values 3-13
    calls: list = []
    first = tune_policy(model, (small,), cache=tmp_path, timer=scripted(HALF_FASTEST, calls), depth=1)
    assert first.table[0].choice == torch.float16 and not first.from_cache and len(calls) == 9
    second = tune_policy(model, (large,), cache=tmp_path, timer=scripted(HALF_FASTEST, calls), depth=1)
    assert len(calls) == 9 and second.from_cache and second.cache_path == first.cache_path  # times reused
    assert [c.seconds for c in second.table[0].candidates] == [c.seconds for c in first.table[0].candidates]
    by = {c.dtype: c for c in second.table[0].candidates}
    assert by[torch.float16].refused == "non-finite" and math.isinf(by[torch.float16].output_error)
    assert second.table[0].choice == torch.bfloat16  # before: float16, from the cache
    # The cached answer on this batch: 24 of 128 outputs inf (the float64 oracle counts the same: exp(x) of
    # the float16 input at or above 65520 rounds to inf); the answer now is finite and within its bound.
    oracle = torch.exp(large.half().double())
    for result, infs in ((first, int((oracle >= 65520).sum())), (second, 0)):
        apply_fn, params = functionalize(model, result.policy, module_policies=result.module_policies)
        out = apply_fn(params, large)
        assert int(torch.isinf(out).sum()) == infs
    assert infs == 0 and int((oracle >= 65520).sum()) == 24
    assert (
        float(torch.linalg.vector_norm(out.double() - oracle) / torch.linalg.vector_norm(oracle))
        < (DEFAULT_RTOL[torch.bfloat16])
    )
    # The cache file is unchanged: back on small values, float16 again, still from the cache.
    third = tune_policy(model, (small,), cache=tmp_path, timer=scripted(HALF_FASTEST, calls), depth=1)
    assert len(calls) == 9 and third.from_cache and third.table == first.table


def test_cache_hit_times_a_candidate_that_raised_when_measured(tmp_path: Path) -> None:
    class RaisesOnLarge(nn.Module):  # no half kernel for large values (scripted): no timing in the cache
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dtype in HALF and x.abs().max() > 100:
                raise RuntimeError("no kernel (scripted)")
            return 2 * x

    model, calls = nn.Sequential(RaisesOnLarge()), []
    first = tune_policy(model, (torch.full((4,), 1e3),), cache=tmp_path, timer=scripted(HALF_FASTEST, calls))
    assert first.table[0].choice == torch.float32 and len(calls) == 3
    second = tune_policy(model, (torch.ones(4),), cache=tmp_path, timer=scripted(HALF_FASTEST, calls))
    assert not second.from_cache and len(calls) == 12 and second.table[0].choice == torch.float16
    third = tune_policy(model, (torch.full((4,), 1e3),), cache=tmp_path, timer=scripted(HALF_FASTEST, calls))
    assert third.from_cache and len(calls) == 12 and third.table[0].choice == torch.float32
    assert [c.seconds for c in third.table[0].candidates] == [1.0, None, None]


# --- the verdict on the batch at hand, output and gradients (issue 26 items 4 and 14) -------------------------


class Scale(nn.Module):
    """``x * w``, ``w = 1e-3``: on ``x`` near 3000 and 2048 rows the output (near 3) and the input
    gradient (``1e-3 * g``) fit float16, the parameter gradient ``sum_b x_b g_b`` (about 1.4e5) does not."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((16,), 1e-3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class Atan(nn.Module):
    """``atan(x)``: near 3e4 the output is near pi/2, the gradient ``1 / (1 + x^2)`` flushes to 0 in
    float16 (``x * x`` overflows)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.atan(x)


class TwoReciprocals(nn.Module):
    """One group of two members; only the second one's input makes float16's gradient overflow."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Reciprocal(), Reciprocal()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(y)


class ShiftByReciprocal(nn.Module):
    def forward(self, x: torch.Tensor, *, y: torch.Tensor) -> torch.Tensor:
        return x + 1 / y


class KeywordInput(nn.Module):
    """The unit takes ``y`` as a keyword; only ``y``'s gradient overflows float16."""

    def __init__(self) -> None:
        super().__init__()
        self.unit = ShiftByReciprocal()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.unit(x, y=y)


def _u(lo: float, hi: float, *shape: int, seed: int = 0) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


# (model, depth, a batch where float16 is safe, one of the same shapes where it is not, what breaks there)
VERDICT_CASES = {
    "output overflows": (lambda: nn.Sequential(ExpLinear()), 1, (_u(0, 1, 8, 16),), (_u(3, 13, 8, 16),)),
    "input gradient overflows": (lambda: nn.Sequential(Reciprocal()), 1, (_u(0.5, 1, 64),), (_u(1e-3, 2e-3, 64),)),
    "parameter gradient overflows": (
        lambda: nn.Sequential(Scale()),
        1,
        (_u(-1, 1, 2048, 16),),
        (_u(2900, 3100, 2048, 16),),
    ),
    "input gradient flushes to 0": (lambda: nn.Sequential(Atan()), 1, (_u(-1, 1, 64),), (_u(3e4, 3.1e4, 64),)),
    "second member's gradient": (
        TwoReciprocals,
        1,
        (_u(0.5, 1, 64), _u(0.5, 1, 64, seed=1)),
        (_u(0.5, 1, 64), _u(1e-3, 2e-3, 64, seed=1)),
    ),
    "keyword input's gradient": (
        KeywordInput,
        1,
        (_u(0.5, 1, 64), _u(0.5, 1, 64, seed=1)),
        (_u(0.5, 1, 64), _u(1e-3, 2e-3, 64, seed=1)),
    ),
}


def _model_error(model: nn.Module, result: TuneResult, args: tuple) -> float:
    """The worst normwise error of the output and of every gradient of the model under the tuned map, on
    ``args``, against the float64 model (the same cotangent, a fixed normal draw)."""

    def run(apply_fn, params: dict, xs: tuple) -> list[torch.Tensor]:
        params = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        xs = tuple(x.detach().requires_grad_(True) for x in xs)
        out = apply_fn(params, *xs)
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        grads = torch.autograd.grad((out.double() * cot).sum(), [*params.values(), *xs])
        return [out.detach(), *grads]

    got = run(*functionalize(model, result.policy, module_policies=result.module_policies), args)
    ref64 = copy.deepcopy(model).double()
    ref = run(*functionalize(ref64, "params=float64,compute=float64,output=float64"), tuple(a.double() for a in args))
    errors = [float(torch.linalg.vector_norm(a.double() - b) / torch.linalg.vector_norm(b)) for a, b in zip(got, ref)]
    return max(math.inf if math.isnan(e) else e for e in errors)


@pytest.mark.parametrize("mode", ["fresh", "cache hit"])
@pytest.mark.parametrize("case", list(VERDICT_CASES))
def test_verdict_on_output_and_gradients_of_the_batch_at_hand(case: str, mode: str, tmp_path: Path) -> None:
    make, depth, safe, unsafe = VERDICT_CASES[case]
    model = make()
    cache = tmp_path if mode == "cache hit" else False
    kw = {"cache": cache, "timer": scripted(HALF_FASTEST), "depth": depth}
    assert tune_policy(model, safe, **kw).table[0].choice == torch.float16  # safe here, and fastest
    result = tune_policy(model, unsafe, **kw)
    assert result.from_cache == (mode == "cache hit")
    (row,) = result.table
    by = {c.dtype: c for c in row.candidates}
    assert by[torch.float16].refused, (case, by[torch.float16])
    assert by[torch.float16].output_error <= DEFAULT_RTOL[torch.float16] or case == "output overflows"
    assert row.choice == torch.bfloat16
    # The oracle: the whole model under the map, output and every gradient, against float64.
    assert _model_error(model, result, unsafe) <= DEFAULT_RTOL[torch.bfloat16], case


# --- the map in use --------------------------------------------------------------------------------------------


def test_tuned_map_trains_with_functionalize() -> None:
    model, x = tiny_gpt()

    def timer(fn) -> float:  # scripted: bfloat16 wins for the MLPs only, so the map mixes dtypes
        fn()
        if fn.dtype == torch.bfloat16 and fn.module.endswith("mlp"):
            return 0.5
        return 1.0 if fn.dtype == torch.float32 else 2.0

    result = tune_policy(model, (x,), cache=False, timer=timer)
    assert result.module_policies["blocks.0.mlp"].compute_dtype == torch.bfloat16
    assert result.module_policies["blocks.0.attn"].compute_dtype == torch.float32
    apply_fn, params = functionalize(model, result.policy, module_policies=result.module_policies)
    seen: dict[str, torch.dtype] = {}

    def loss_fn(params, batch):
        logits = apply_fn(params, batch[:, :-1])
        seen["logits"] = logits.dtype
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    opt = optim.adamw(1e-3)
    state = fa.TrainState.create(params, opt)
    step = fa.make_train_step(loss_fn, opt, compile=False)
    new_state, metrics = step(state, x)
    assert torch.isfinite(metrics["loss"]) and bool(metrics["grads_finite"])
    assert seen["logits"] == torch.float32
    changed = [k for k in params if not torch.equal(params[k], new_state.params[k])]
    assert sorted(changed) == sorted(params)
    assert all(new_state.params[k].dtype == torch.float32 for k in params)


def test_mlp_runs_in_the_chosen_dtype() -> None:
    model, x = tiny_gpt()
    policies = {"blocks.0.mlp": fa.get_policy("params=float32,compute=bfloat16,output=bfloat16")}
    apply_fn, params = functionalize(model, "params=float32,compute=float32,output=float32", module_policies=policies)
    dtypes: dict[str, torch.dtype] = {}

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            weight = args[1] if func is F.linear and len(args) > 1 else None
            if weight is not None and weight.shape[1] == 4 * weight.shape[0]:  # an MLP's proj, after the GELU
                dtypes.setdefault("proj", []).append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    with Watch():
        apply_fn(params, x)
    assert dtypes["proj"] == [torch.bfloat16, torch.float32]  # block 0's MLP in bf16, block 1's in float32


def test_model_is_left_unchanged() -> None:
    model, x = tiny_gpt()
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tune_policy(model, (x,), cache=False, timer=scripted(HALF_FASTEST))
    assert not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


# --- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"example_args": torch.randn(4, 8)}, TypeError, r"example_args must be a tuple.*\(x,\)"),
        ({"candidates": ["float8"]}, ValueError, "candidate 'float8'"),
        ({"candidates": torch.bfloat16}, TypeError, "candidates must be a list"),
        ({"depth": 0}, ValueError, "depth must be an int >= 1"),
        ({"rounds": 0}, ValueError, "rounds must be an int >= 1"),
        ({"margin": -0.1}, ValueError, "margin must be a number >= 0"),
        ({"rtol": "loose"}, TypeError, "rtol must be None"),
        ({"rtol": {"float64": 0.1}}, TypeError, "rtol must map bfloat16/float16"),
        ({"rtol": -1.0}, ValueError, "rtol must be >= 0"),
        ({"device": "meta"}, ValueError, "meta device"),
        ({"cache": 3}, TypeError, "cache must be True, False or a directory"),
        ({"policy": "compute=float33"}, ValueError, "float33"),
    ],
)
def test_bad_input_is_refused_clearly(kwargs: dict, error: type, match: str) -> None:
    args = {"example_args": (torch.randn(4, 8),), "cache": False, "timer": scripted(HALF_FASTEST)}
    with pytest.raises(error, match=match):
        tune_policy(nn.Sequential(nn.Linear(8, 8)), **{**args, **kwargs})


def test_not_a_module_and_nothing_to_tune() -> None:
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        tune_policy(lambda x: x, (torch.ones(1),))
    with pytest.raises(ValueError, match="no unit .* was called"):
        tune_policy(nn.Sequential(nn.LayerNorm(8)), (torch.randn(4, 8),), cache=False)


def test_rounds_are_interleaved_and_the_median_is_kept() -> None:
    calls: list = []
    spikes = iter([5.0, 1.0, 1.0, 1.0, 0.5, 5.0, 1.0, 0.5, 0.5])  # a neighbour's load hits one sample each

    def timer(fn) -> float:
        calls.append(fn.dtype)
        return next(spikes)

    result = tune_policy(nn.Sequential(nn.Linear(8, 8)), (torch.randn(4, 8),), cache=False, timer=timer)
    assert calls == [torch.float32, torch.bfloat16, torch.float16] * 3
    by = {c.dtype: c.seconds for c in result.table[0].candidates}
    assert by == {torch.float32: 1.0, torch.bfloat16: 0.5, torch.float16: 1.0}  # one spike each, dropped
    assert result.table[0].choice == torch.bfloat16


# --- choose_compute_dtype: one compute dtype for the whole step, timed on the step ---------------------------

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# bfloat16 and float16 both measured: float16 is a candidate on a CPU with AMX-FP16 tiles only
AVX512_BOTH = {"capability": "AVX512", "mkldnn_bf16": True, "mkldnn_fp16": True, "amx": False, "amx_fp16": True}
AVX512_BF16 = {"capability": "AVX512", "mkldnn_bf16": True, "mkldnn_fp16": False, "amx": False}
AVX2 = {"capability": "AVX2", "mkldnn_bf16": False, "mkldnn_fp16": False, "amx": False}


@pytest.fixture
def cpu_facts(monkeypatch: pytest.MonkeyPatch):
    """Replace what torch reports about this CPU, so that a measurement happens (or not) on every machine."""

    def install(facts: dict) -> None:
        monkeypatch.setattr(hardware, "_cpu_facts", lambda: dict(facts))

    install(AVX512_BOTH)
    return install


class FakeStep:
    """``make_step`` for the tests: records what was built and how often each run was called."""

    def __init__(self, raises: dict | None = None) -> None:
        self.built: list[torch.dtype] = []
        self.calls: list[torch.dtype] = []
        self.raises = raises or {}

    def __call__(self, dtype: torch.dtype):
        self.built.append(dtype)
        if dtype in self.raises:
            raise self.raises[dtype]

        def run() -> None:
            self.calls.append(dtype)

        return run


def per_round(times: dict[torch.dtype, list[float] | float]):
    """A timer: ``times[dtype][r]`` on a candidate's ``r``-th timed call (or a constant); records the order."""
    seen: dict[torch.dtype, int] = {}
    order: list[torch.dtype] = []

    def timer(run) -> float:
        run()
        r = seen.get(run.dtype, 0)
        seen[run.dtype] = r + 1
        order.append(run.dtype)
        t = times[run.dtype]
        return t if isinstance(t, float) else t[r]

    timer.order = order  # type: ignore[attr-defined]
    return timer


def toy() -> tuple[nn.Module, torch.Tensor]:
    return nn.Sequential(nn.Linear(8, 8)), torch.randn(4, 8)


def choose(step=None, timer=None, model_batch=None, **kw) -> ComputeDtypeChoice:
    model, batch = model_batch or toy()
    return choose_compute_dtype(step or FakeStep(), model, batch, timer=timer, **kw)


def test_a_clearly_faster_half_dtype_is_chosen_from_the_step_times(cpu_facts, tmp_path: Path) -> None:
    step, timer = FakeStep(), per_round({F32: 1.0, BF16: 0.8, F16: 0.7})
    c = choose(step, timer, cache=tmp_path)
    assert (c.dtype, c.source) == (F16, "measured")
    assert step.built == [F32, BF16, F16]
    t = {x.dtype: x for x in c.timings}
    assert t[F16].ratio == pytest.approx(0.7) and t[F16].low == pytest.approx(0.7) == t[F16].high
    assert t[F16].seconds == pytest.approx(0.7) and len(t[F16].samples) == 9 and t[F16].refused == ""
    assert t[BF16].refused == "slower than float16" and t[F32].ratio == 1.0
    assert "faster by 30.0%, more than the spread (0.0%) and the margin (2%)" in c.reason
    line = c.explain()
    assert line.startswith("float16 compute on CPU (AVX512)") and "measured now (9 interleaved rounds" in line
    assert "float32 1000 ms, bfloat16 800 ms (median per-round ratio 0.8x), float16 700 ms (median" in line
    assert f"saved to {c.cache_path}" in line and c.cache_path.name.startswith("compute-dtype-")


def test_spread_wider_than_the_difference_refuses_the_half_dtype(cpu_facts) -> None:
    # bfloat16's per-round ratios: median 0.95 (5% faster), quartiles 0.8-1.1 (inclusive method): spread 0.3.
    noisy = [0.7, 1.2, 0.8, 1.1, 0.9, 1.05, 0.75, 1.15, 0.95]
    cpu_facts(AVX512_BF16)
    c = choose(timer=per_round({F32: 1.0, BF16: noisy}), cache=False)
    assert c.dtype == F32 and c.source == "measured"
    bf = c.timings[1]
    assert (bf.ratio, bf.low, bf.high) == pytest.approx((0.95, 0.8, 1.1))
    assert c.reason.startswith("float32: no half dtype on a measurement this noisy")
    assert "the spread of the rounds' ratios (0.8-1.1: 0.3) is wider than the difference (0.05)" in c.reason
    # The same gain measured steadily is taken.
    assert choose(timer=per_round({F32: 1.0, BF16: 0.95}), cache=False).dtype == BF16


def test_ratios_are_paired_per_round_so_a_load_on_both_cancels(cpu_facts) -> None:
    # The machine's load changes 3x between rounds; bfloat16 is 0.8x float32 in every round.
    load = [1.0, 3.0, 1.5, 2.5, 1.0, 2.0, 3.0, 1.2, 1.8]
    cpu_facts(AVX512_BF16)
    c = choose(timer=per_round({F32: load, BF16: [0.8 * x for x in load]}), cache=False)
    assert c.dtype == BF16 and c.timings[1].high - c.timings[1].low == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    "bf16, why",
    [(1.3, "slower: its step takes 1.3x float32's"), (0.99, "faster by less than the margin (2%)")],
)
def test_slower_or_marginal_half_dtype_keeps_float32(cpu_facts, bf16: float, why: str) -> None:
    cpu_facts(AVX512_BF16)
    c = choose(timer=per_round({F32: 1.0, BF16: bf16}), cache=False)
    assert c.dtype == F32 and why in c.reason and c.reason.startswith("float32: no half dtype is faster")


def test_candidates_are_warmed_up_then_timed_interleaved(cpu_facts) -> None:
    step = FakeStep()
    timer = per_round({F32: 1.0, BF16: 1.0, F16: 1.0})
    choose(step, timer, cache=False, rounds=4, warmup=2)
    # warm-up: two untimed calls each (the first compiles), then rounds with the order rotated each round
    assert step.calls[:6] == [F32, F32, BF16, BF16, F16, F16]
    assert timer.order == [F32, BF16, F16, BF16, F16, F32, F16, F32, BF16, F32, BF16, F16]


def test_cache_hit_decides_without_building_or_timing(cpu_facts, tmp_path: Path) -> None:
    first = choose(timer=per_round({F32: 1.0, BF16: 0.8, F16: 1.2}), cache=tmp_path)
    step = FakeStep()

    def no_timer(run) -> float:
        raise AssertionError("timed on a cache hit")

    model, batch = toy()  # other weights, same structure and shapes: the same key
    hit = choose_compute_dtype(step, model, batch, timer=no_timer, cache=tmp_path)
    assert (hit.dtype, hit.source, hit.cache_path) == (BF16, "cache", first.cache_path) and step.built == []
    assert hit.timings == first.timings and hit.reason == first.reason and hit.measured_at == first.measured_at
    assert hit.explain().startswith("bfloat16 compute on CPU (AVX512), ")
    assert f": from the cache file {first.cache_path} (measured {first.measured_at}, 9 interleaved" in hit.explain()


def test_retune_measures_again_and_overwrites_the_decision(cpu_facts, tmp_path: Path) -> None:
    choose(timer=per_round({F32: 1.0, BF16: 0.8, F16: 1.2}), cache=tmp_path)
    step = FakeStep()
    again = choose(step, per_round({F32: 1.0, BF16: 1.3, F16: 1.2}), cache=tmp_path, retune=True)
    assert (again.dtype, again.source) == (F32, "measured") and step.built == [F32, BF16, F16]
    assert choose(FakeStep(), per_round({}), cache=tmp_path).dtype == F32  # the new decision is the cached one


def test_cache_key_covers_shapes_model_key_and_options(cpu_facts, tmp_path: Path) -> None:
    times = {F32: 1.0, BF16: 0.5, F16: 2.0}
    base = choose(timer=per_round(times), cache=tmp_path, key={"backend": "inductor"})
    others = [
        choose(timer=per_round(times), cache=tmp_path, key={"backend": "aot_eager"}),
        choose(
            timer=per_round(times),
            cache=tmp_path,
            key={"backend": "inductor"},
            model_batch=(toy()[0], torch.ones(2, 8)),
        ),
        choose(
            timer=per_round(times),
            cache=tmp_path,
            key={"backend": "inductor"},
            model_batch=(nn.Sequential(nn.Linear(8, 4)), torch.ones(4, 8)),
        ),
        choose(timer=per_round(times), cache=tmp_path, key={"backend": "inductor"}, margin=0.1),
    ]
    assert all(c.source == "measured" for c in others)
    assert len({base.cache_path, *(c.cache_path for c in others)}) == 5
    doc = json.loads(base.cache_path.read_text())
    assert doc["key"]["torch"] == torch.__version__ and doc["key"]["key"] == {"backend": "inductor"}
    assert "AVX512" in doc["key"]["machine"] and f"{torch.get_num_threads()} threads" in doc["key"]["machine"]
    assert doc["choice"] == "bfloat16" and doc["key"]["candidates"] == ["float32", "bfloat16", "float16"]


def test_no_half_kernels_decides_float32_without_timing(cpu_facts, tmp_path: Path) -> None:
    cpu_facts(AVX2)
    step = FakeStep()
    c = choose(step, per_round({}), cache=tmp_path)
    assert (c.dtype, c.source, c.cache_path, c.timings) == (F32, "capability", None, ())
    assert step.built == [] and not any(tmp_path.iterdir())
    assert c.explain().startswith("float32 compute on CPU (AVX2)")
    assert "oneDNN has no bfloat16 or float16 kernels for this CPU (AVX2) (torch's report decides; nothing timed)" in (
        c.explain()
    )


def test_a_half_dtype_without_kernels_is_not_timed(cpu_facts) -> None:
    cpu_facts(AVX512_BF16)
    step = FakeStep()
    c = choose(step, per_round({F32: 1.0, BF16: 1.0}), cache=False)
    assert step.built == [F32, BF16] and [t.dtype for t in c.timings] == [F32, BF16]
    asked = choose(FakeStep(), per_round({}), cache=False, candidates=["float16"])
    assert (asked.dtype, asked.source) == (F32, "capability") and "asked for: float16" in asked.reason


@pytest.mark.parametrize("cc, expected", [((9, 0), BF16), ((7, 5), F16), ((6, 1), F32)])
def test_cuda_compute_capability_decides_without_timing(monkeypatch: pytest.MonkeyPatch, cc, expected) -> None:
    monkeypatch.setattr(hardware, "_probe", lambda device: hardware._probe_cuda(device, "GPU", cc))
    step = FakeStep()
    c = choose(step, per_round({}), device="cuda:0", cache=False)
    assert (c.dtype, c.source) == (expected, "capability") and step.built == []
    assert f"compute capability {cc[0]}.{cc[1]}" in c.explain()


def test_a_half_dtype_whose_step_raises_is_refused_float32_raises(cpu_facts) -> None:
    step = FakeStep(raises={F16: RuntimeError('"addmm" not implemented for Half\nmore')})
    c = choose(step, per_round({F32: 1.0, BF16: 1.5}), cache=False)
    assert c.dtype == F32 and c.timings[2].refused == 'raised: "addmm" not implemented for Half'
    assert c.timings[2].seconds is None and 'float16 raised: "addmm" not implemented for Half' in c.explain()
    with pytest.raises(RuntimeError, match="broken float32"):
        choose(FakeStep(raises={F32: RuntimeError("broken float32")}), per_round({}), cache=False)


def test_unreadable_choice_cache_warns_and_measures_again(cpu_facts, tmp_path: Path) -> None:
    first = choose(timer=per_round({F32: 1.0, BF16: 0.8, F16: 1.2}), cache=tmp_path)
    first.cache_path.write_text("{not json")
    step = FakeStep()
    with pytest.warns(UserWarning, match="choose_compute_dtype: ignoring the unreadable cache file"):
        again = choose(step, per_round({F32: 1.0, BF16: 0.8, F16: 1.2}), cache=tmp_path)
    assert again.source == "measured" and step.built == [F32, BF16, F16]
    assert json.loads(first.cache_path.read_text())["choice"] == "bfloat16"  # rewritten


@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"make_step": 3}, TypeError, "make_step must be a function dtype -> run, got int"),
        ({"model": "gpt"}, TypeError, "model must be a torch.nn.Module, got str"),
        ({"key": ["inductor"]}, TypeError, "key must be a mapping"),
        ({"key": {"x": object()}}, TypeError, "key must hold JSON values only"),
        ({"rounds": 2}, ValueError, "rounds must be an int >= 3, got 2"),
        ({"warmup": 0}, ValueError, "warmup must be an int >= 1, got 0"),
        ({"margin": -0.1}, ValueError, "margin must be a number >= 0, got -0.1"),
        ({"device": "meta"}, ValueError, "nothing can be timed on the meta device"),
        ({"candidates": ["int8"]}, ValueError, "candidate 'int8' is not a compute dtype funcamp tunes"),
        ({"candidates": "bfloat16"}, TypeError, "candidates must be a list of dtypes"),
        ({"cache": 3}, TypeError, "cache must be True, False or a directory, got 3"),
        ({"make_step": lambda dtype: 3}, TypeError, r"make_step\(float32\) must return a function of no arguments"),
        ({"timer": lambda run: 0.0}, ValueError, "the timer returned 0.0 seconds; it must be > 0"),
    ],
)
def test_choose_compute_dtype_bad_input(cpu_facts, kw: dict, error: type, match: str) -> None:
    model, batch = toy()
    args = {"make_step": FakeStep(), "model": model, "example_batch": batch, "cache": False, "timer": lambda r: 1.0}
    args.update(kw)
    with pytest.raises(error, match=match):
        choose_compute_dtype(args.pop("make_step"), args.pop("model"), args.pop("example_batch"), **args)


def test_real_timing_of_a_small_step() -> None:
    """The default timer on this machine: a tiny float32 / half MLP step (no fake facts: AVX2 decides at once)."""
    model, batch = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)), torch.randn(16, 32)

    def make_step(dtype):
        m, x = copy.deepcopy(model).to(dtype), batch.to(dtype)
        return lambda: torch.autograd.grad(m(x).float().square().sum(), list(m.parameters()))

    c = choose_compute_dtype(make_step, model, batch, cache=False, rounds=3)
    assert c.dtype in (F32, BF16, F16)
    if c.source == "measured":
        assert all(t.seconds > 0 and len(t.samples) == 3 for t in c.timings if t.seconds is not None)
        assert c.timings[0].first_s > 0
    else:
        assert c.source == "capability" and c.timings == ()


# --- the key covers what changes the compute and the measurement (issue 33 item 3, T6) ---------------------------


@pytest.mark.parametrize("option", [{"rounds": 5}, {"warmup": 3}], ids=["rounds", "warmup"])
def test_choice_cache_key_covers_rounds_and_warmup(cpu_facts, tmp_path: Path, option: dict) -> None:
    """A decision measured with other rounds or warm-up calls is not this call's: it measures again."""
    times = {F32: 1.0, BF16: 0.5, F16: 2.0}
    first = choose(timer=per_round(times), cache=tmp_path)
    step = FakeStep()
    other = choose(step, per_round({F32: 1.0, BF16: 2.0, F16: 2.0}), cache=tmp_path, **option)
    assert (other.source, other.dtype, step.built) == ("measured", F32, [F32, BF16, F16])
    assert other.cache_path != first.cache_path and len(list(tmp_path.iterdir())) == 2
    again = choose(FakeStep(), per_round({}), cache=tmp_path, **option)  # the same options: its own decision
    assert (again.source, again.dtype, again.cache_path) == ("cache", F32, other.cache_path)


class Scaled(nn.Module):
    """A user module whose setting is a plain attribute (no extra_repr)."""

    def __init__(self, scale: float = 2.0, act=F.gelu) -> None:
        super().__init__()
        self.lin, self.scale, self.act = nn.Linear(8, 8), scale, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x)) * self.scale


class Holder(nn.Module):
    """Holds a module in a plain list (outside ``_modules``: not in ``named_modules``)."""

    def __init__(self, out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.extra = [nn.Linear(8, out)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Doubled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Tripled(nn.Module):  # the same name and module as Doubled below: only its forward's code differs
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3


Tripled.__qualname__ = Tripled.__name__ = "Doubled"


def _lin(*tail: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), *tail)


# Pairs of models with one class structure and equal parameter shapes where possible, one setting apart.
SETTINGS = {
    "GELU approximate": (lambda: _lin(nn.GELU()), lambda: _lin(nn.GELU(approximate="tanh"))),
    "LayerNorm eps": (lambda: _lin(nn.LayerNorm(8)), lambda: _lin(nn.LayerNorm(8, eps=1e-3))),
    "LayerNorm affine": (lambda: _lin(nn.LayerNorm(8)), lambda: _lin(nn.LayerNorm(8, elementwise_affine=False))),
    "Linear bias": (lambda: _lin(nn.Linear(8, 8)), lambda: _lin(nn.Linear(8, 8, bias=False))),
    "Dropout p": (lambda: _lin(nn.Dropout(0.1)), lambda: _lin(nn.Dropout(0.2))),
    "training or eval": (lambda: _lin(nn.Dropout(0.1)), lambda: _lin(nn.Dropout(0.1)).eval()),
    "LeakyReLU slope": (lambda: _lin(nn.LeakyReLU(0.01)), lambda: _lin(nn.LeakyReLU(0.2))),
    "Softmax dim": (lambda: _lin(nn.Softmax(dim=-1)), lambda: _lin(nn.Softmax(dim=0))),
    "a plain attribute": (lambda: _lin(Scaled(2.0)), lambda: _lin(Scaled(3.0))),
    "a function attribute": (lambda: _lin(Scaled(act=F.gelu)), lambda: _lin(Scaled(act=F.silu))),
    "a partial": (
        lambda: _lin(Scaled(act=functools.partial(F.gelu, approximate="none"))),
        lambda: _lin(Scaled(act=functools.partial(F.gelu, approximate="tanh"))),
    ),
    "a module in a plain list": (lambda: _lin(Holder(8)), lambda: _lin(Holder(4))),
    "the forward's code": (lambda: _lin(Doubled()), lambda: _lin(Tripled())),
    "a GPT config": (
        lambda: GPT(config_for("tiny")),
        lambda: GPT(config_for("tiny", dropout=0.1)),
    ),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_choice_cache_key_covers_each_constructor_setting(cpu_facts, tmp_path: Path, setting: str) -> None:
    """Two models one setting apart never share a decision: the second measures its own (33 item 3)."""
    make_a, make_b = SETTINGS[setting]
    batch = torch.randn(4, 8)
    first = choose(timer=per_round({F32: 1.0, BF16: 0.5, F16: 2.0}), model_batch=(make_a(), batch), cache=tmp_path)
    assert first.dtype == BF16
    step = FakeStep()
    second = choose(step, per_round({F32: 1.0, BF16: 2.0, F16: 2.0}), model_batch=(make_b(), batch), cache=tmp_path)
    assert (second.source, second.dtype, step.built) == ("measured", F32, [F32, BF16, F16]), setting
    assert second.cache_path != first.cache_path
    # The same settings built again (new weights, new function objects): the same key, a cache hit.
    hit = choose(FakeStep(), per_round({}), model_batch=(make_a(), batch), cache=tmp_path)
    assert (hit.source, hit.dtype, hit.cache_path) == ("cache", BF16, first.cache_path), setting


def test_choice_cache_key_is_the_same_in_every_process(cpu_facts, tmp_path: Path) -> None:
    """No memory address (a lambda's, an object's default repr) reaches the key: it would never hit again."""

    class Opaque:  # default repr: "<...Opaque object at 0x...>"
        pass

    model = _lin(Scaled(act=lambda x: x.relu()))
    model[1].opaque = Opaque()
    c = choose(timer=per_round({F32: 1.0, BF16: 0.5, F16: 2.0}), model_batch=(model, torch.randn(4, 8)), cache=tmp_path)
    text = json.dumps(json.loads(c.cache_path.read_text())["key"])
    assert " at 0x" not in text and "Opaque object" in text and "<lambda>" in text


def test_tune_policy_cache_key_and_groups_cover_settings(tmp_path: Path) -> None:
    """tune_policy keys its timings and groups its units by the same signature: settings included."""
    x = torch.randn(4, 8)
    timer = scripted({F32: 1.0, BF16: 0.5, F16: 2.0})
    a = tune_policy(SETTINGS["GELU approximate"][0](), (x,), cache=tmp_path, timer=timer, depth=1)
    b = tune_policy(SETTINGS["GELU approximate"][1](), (x,), cache=tmp_path, timer=timer, depth=1)
    assert a.cache_path != b.cache_path and not b.from_cache
    two = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(approximate="tanh"))
    rows = tune_policy(two, (x,), cache=False, timer=timer, depth=1).table
    assert sorted(r.modules for r in rows) == [("0", "2"), ("1",), ("3",)]  # the GELUs are not one group


# --- block_probe: one repeated block's kernels instead of a compile per candidate (issue 35 item 4) ---------------


@pytest.fixture(scope="module")
def gpt_probe():
    """The tiny GPT's probe, its float32 and bfloat16 runs (recorded once for the module's tests)."""
    model, x = tiny_gpt()
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    probe = fa.tune.block_probe(model, (x,))
    assert calls == []  # building the probe runs nothing: a cache hit costs no forward
    runs = {dtype: probe(dtype) for dtype in (F32, BF16)}
    assert calls == [1]  # one forward captured the block's input, for every dtype
    return probe, runs, model, x


def _names(run) -> list[str]:
    return [func.overloadpacket.__name__ for func, _, _ in run.kernels]


def test_block_probe_finds_the_repeated_block_and_records_its_kernels(gpt_probe) -> None:
    probe, runs, _, _ = gpt_probe
    assert (probe.name, probe.members, probe.kind) == ("blocks.0", ("blocks.0", "blocks.1"), "Block")
    assert probe.what == "blocks.0 (Block, one of 2)'s forward+backward kernels"
    names = _names(runs[F32])
    # forward: qkv, proj, fc, proj (addmm or mm) and attention; backward: two mm per linear and attention's
    assert names.count("_scaled_dot_product_flash_attention_for_cpu") == 1
    assert names.count("_scaled_dot_product_flash_attention_for_cpu_backward") == 1
    assert sum(n in ("mm", "addmm") for n in names) == 4 * 3 and probe.kernels == len(names) == 14
    assert _names(runs[BF16]) == names
    # Each dtype's kernels get that dtype's operands, as the policy's step computes them (attention's
    # logsumexp stays float32 in both).
    for dtype, run in runs.items():
        for func, args, _ in run.kernels:
            operands = [a for a in args if isinstance(a, torch.Tensor) and a.ndim >= 2]
            operands = operands if "mm" in func.overloadpacket.__name__ else operands[:3]
            assert operands and all(a.dtype == dtype for a in operands), (dtype, func)
    assert 1 <= probe.repeat <= 256 // probe.kernels and runs[F32].repeat == runs[BF16].repeat == probe.repeat
    assert probe.key["block"] == "blocks.0" and probe.key["members"] == 2


def test_block_probe_decides_with_the_rounds_and_caches_without_running(cpu_facts, gpt_probe, tmp_path) -> None:
    cpu_facts(AVX512_BF16)
    probe, _, model, x = gpt_probe
    timer = per_round({F32: 1.0, BF16: 0.6})
    c = choose_compute_dtype(probe, model, x, cache=tmp_path, timer=timer, what=probe.what, key={"m": probe.key})
    assert (c.dtype, c.source) == (BF16, "measured") and timer.order[:2] == [F32, BF16]
    assert "9 interleaved rounds of blocks.0 (Block, one of 2)'s forward+backward kernels, medians:" in c.explain()
    fresh = fa.tune.block_probe(model, (x,))
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        hit = choose_compute_dtype(fresh, model, x, cache=tmp_path, timer=timer, what=fresh.what, key={"m": fresh.key})
    finally:
        handle.remove()
    assert (hit.dtype, hit.source, calls, fresh.repeat) == (BF16, "cache", [], 0)  # nothing ran
    assert hit.what == c.what and "(Block, one of 2)'s forward+backward kernels" in hit.explain()


def test_block_probe_key_holds_the_module_policies(cpu_facts, tmp_path) -> None:
    """Two probes of one model that differ only in ``module_policies`` (entries that keep some modules off the
    candidate dtype, as fp8's do) time other kernels: their keys differ, so ``choose_compute_dtype`` keeps a
    decision for each; the same entries give the same key. (Issue 40 T12; planted: the key without
    ``module_policies``: fails.)"""
    cpu_facts(AVX512_BF16)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2)))
    x = torch.randn(4, 16)
    plain = fa.tune.block_probe(model, (x,))
    kept = fa.tune.block_probe(model, (x,), module_policies={nn.Linear: "float32"})
    again = fa.tune.block_probe(model, (x,), module_policies={nn.Linear: "float32"})
    assert plain.name == kept.name == "0" and plain.key != kept.key and kept.key == again.key
    first = choose_compute_dtype(
        plain, model, x, cache=tmp_path, timer=per_round({F32: 1.0, BF16: 0.6}), what=plain.what, key={"m": plain.key}
    )
    other = choose_compute_dtype(
        kept, model, x, cache=tmp_path, timer=per_round({F32: 1.0, BF16: 1.0}), what=kept.what, key={"m": kept.key}
    )
    assert (first.dtype, first.source, other.dtype, other.source) == (BF16, "measured", F32, "measured")
    assert first.cache_path != other.cache_path


def test_block_probe_real_decision_is_cheap(gpt_probe) -> None:
    """One real run of the default timer on this machine: every candidate's kernels timed, no compile."""
    probe, _, model, x = gpt_probe
    start = time.perf_counter()
    c = choose_compute_dtype(probe, model, x, cache=False, rounds=3, what=probe.what)
    assert c.dtype in (F32, BF16, F16) and time.perf_counter() - start < 120
    if c.source == "measured":
        assert all(t.seconds > 0 and len(t.samples) == 3 for t in c.timings if t.seconds is not None)


def test_block_probe_without_a_repeated_block_times_the_whole_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    probe = fa.tune.block_probe(model, (torch.randn(4, 8),))
    assert (probe.name, probe.members) == ("", ("",)) and probe.what.startswith("the whole Sequential's")
    # forward two addmm; backward two mm per Linear (the input's gradient is taken too, as in the step's blocks)
    assert sum(n in ("mm", "addmm") for n in _names(probe(F32))) == 2 + 4


def test_block_probe_refuses_blocks_it_cannot_time() -> None:
    norms = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.LayerNorm(8))  # repeated, but no kernel in it
    probe = fa.tune.block_probe(norms, (torch.randn(4, 8),))
    assert probe.name == "1"
    with pytest.raises(ValueError, match=r"block_probe: 1 \(LayerNorm\) calls no matmul, convolution or attention"):
        probe(F32)

    class Skips(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(8, 8), nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    skips = Skips()
    skips.used = nn.Linear(8, 4)  # the repeated Linear(8, 8)s are never called
    with pytest.raises(ValueError, match=r"block_probe: unused.0 \(Linear\) was not called by Skips's forward"):
        fa.tune.block_probe(skips, (torch.randn(4, 8),))(F32)
    with pytest.raises(ValueError, match="min_run_time must be a number of seconds > 0, got 0"):
        fa.tune.block_probe(norms, (torch.randn(4, 8),), min_run_time=0)
    with pytest.raises(TypeError, match=r"example_args must be a tuple .* \(write \(x,\) for one tensor\)"):
        fa.tune.block_probe(norms, torch.randn(4, 8))


def test_block_probe_leaves_the_models_buffers_as_they_were() -> None:
    """Capturing the block's input runs the model in training mode: BatchNorm's statistics (as fp8 amax
    histories) must come back unchanged, the same tensors, for the step that trains next."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(2)))
    before = {n: (b, b.clone()) for n, b in model.named_buffers()}
    probe = fa.tune.block_probe(model, (torch.randn(16, 8) + 3,))
    probe(F32)
    assert probe.name == "0" and model[0][1].num_batches_tracked is before["0.1.num_batches_tracked"][0]
    for name, b in model.named_buffers():
        assert b is before[name][0] and torch.equal(b, before[name][1]), name


def test_block_probe_measures_a_unit_the_user_keeps_in_float32_in_float32() -> None:
    """The probe's unit follows the candidate dtype unless the user's ``module_policies`` keep it off it: a model
    of Linear blocks with ``{nn.Linear: "float32"}`` (the unit itself a Linear) runs its kernels in float32 under
    every candidate, as the step would. (Issue 47; planted: the runner's map merged as ``{"": candidate, **user}``,
    the candidate's entry first: the bfloat16 probe records bfloat16 matmuls.)"""
    torch.manual_seed(0)
    model, x = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3))), torch.randn(4, 16)
    for module_policies, want in ((None, BF16), ({nn.Linear: "float32"}, F32)):
        probe = fa.tune.block_probe(model, (x,), module_policies=module_policies)
        run = probe(BF16)
        assert probe.name == "0" and run.kernels
        for func, args, _ in run.kernels:
            operands = [a for a in args if isinstance(a, torch.Tensor) and a.ndim >= 2]
            assert operands and all(a.dtype == want for a in operands), (module_policies, func, want)


# --- choose_op_dtypes: which ops of a half step run faster in float32 (attention on a CPU without AMX) ----------


def op_timer(with_rule: float, without: float = 1.0):
    """A timer: ``with_rule`` seconds for a run whose op rules were added (``run.op_policies``), else ``without``;
    records each run's rules in order."""
    order: list[dict] = []

    def timer(run) -> float:
        run()
        order.append(dict(run.op_policies))
        return with_rule if run.op_policies else without

    timer.order = order  # type: ignore[attr-defined]
    return timer


def test_choose_op_dtypes_keeps_attention_in_float32_where_it_is_faster_and_caches(gpt_probe, tmp_path) -> None:
    """The rule is kept on a clear gain, its candidate replays attention's kernels in float32 and the matmuls in
    bfloat16 (what ``OpPolicies`` runs), the rounds interleave, and a second call reads the cache without running
    anything. (Planted: the rule's replay recorded without the rule: its attention operands are bfloat16: fails.)"""
    probe, _, model, x = gpt_probe
    timer = op_timer(0.6)
    c = fa.tune.choose_op_dtypes(probe, BF16, cache=tmp_path, timer=timer, rounds=5)
    assert (dict(c.op_policies), c.source, c.rounds) == ({"scaled_dot_product_attention": F32}, "measured", 5)
    (t,) = c.timings
    assert t.kept and t.ratio == pytest.approx(0.6) and t.low == t.high == pytest.approx(0.6)
    assert [bool(r) for r in timer.order[:4]] == [False, True, True, False]  # rotated each round
    assert "scaled_dot_product_attention in float32 in a bfloat16 step: measured now (5 interleaved" in c.explain()
    trial = probe.run_with(BF16, {"scaled_dot_product_attention": F32})
    for func, args, _ in trial.kernels:
        operands = [a for a in args if isinstance(a, torch.Tensor) and a.ndim >= 2]
        name = func.overloadpacket.__name__
        want = F32 if "attention" in name else BF16
        assert all(a.dtype == want for a in (operands[:3] if "attention" in name else operands)), name
    assert probe.run_with(BF16, {"scaled_dot_product_attention": F32}) is trial  # recorded once, not per call
    assert trial.repeat == probe(BF16).repeat and [f for f, _, _ in trial.kernels] == [
        f for f, _, _ in probe(BF16).kernels
    ]
    fresh = fa.tune.block_probe(model, (x,))
    hit = fa.tune.choose_op_dtypes(fresh, BF16, cache=tmp_path, timer=op_timer(2.0), rounds=5)
    assert (dict(hit.op_policies), hit.source, fresh.repeat) == ({"scaled_dot_product_attention": F32}, "cache", 0)
    assert "from the cache file" in hit.explain() and hit.timings == c.timings


@pytest.mark.parametrize(
    ("times", "why"),
    [
        ([1.0] * 5, "not faster in float32"),  # equal
        ([0.99] * 5, "within the margin"),  # 1% < the 2% margin
        ([0.5, 1.2, 0.6, 1.3, 0.7], "within the spread"),  # faster on the median, noisier than the gain
    ],
)
def test_choose_op_dtypes_refuses_a_rule_that_does_not_clearly_pay(gpt_probe, times, why) -> None:
    probe = gpt_probe[0]
    seen = iter(times)

    def timer(run) -> float:
        return next(seen) if run.op_policies else 1.0

    c = fa.tune.choose_op_dtypes(probe, BF16, cache=False, timer=timer, rounds=5)
    assert dict(c.op_policies) == {} and not c.timings[0].kept and why in c.timings[0].why, c.timings
    assert c.explain().startswith("no per-op rule in a bfloat16 step: measured now")


def test_choose_op_dtypes_measures_nothing_for_float32_or_an_op_the_block_does_not_call(cpu_facts) -> None:
    cpu_facts(AVX512_BF16)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))
    probe = fa.tune.block_probe(model, (torch.randn(4, 16),))

    def never(run) -> float:
        raise AssertionError("timed")

    skipped = fa.tune.choose_op_dtypes(probe, F32, cache=False, timer=never)
    assert (dict(skipped.op_policies), skipped.source, probe.repeat) == ({}, "skipped", 0)
    assert "float32 compute" in skipped.explain()
    c = fa.tune.choose_op_dtypes(probe, BF16, cache=False, timer=never)  # Linear blocks: no attention to time
    assert dict(c.op_policies) == {} and c.timings[0].ratio is None and "does not call it" in c.timings[0].why


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"probe": "blocks.0"}, TypeError, "probe must be a funcamp.tune.BlockProbe"),
        ({"dtype": torch.int8}, TypeError, "dtype must be the step's floating compute dtype"),
        ({"ops": "scaled_dot_product_attention"}, TypeError, "ops must be a sequence of op names"),
        ({"ops": ("",)}, TypeError, "ops must be a sequence of op names"),
        ({"rounds": 2}, ValueError, "rounds"),
        ({"margin": -0.1}, ValueError, "margin"),
        ({"key": {"a": object()}}, TypeError, "key must hold JSON values only"),
        ({"timer": lambda run: 0.0}, ValueError, r"the timer returned 0.0 seconds"),
    ],
)
def test_choose_op_dtypes_bad_input(gpt_probe, kw: dict, error: type, match: str) -> None:
    args = {"probe": gpt_probe[0], "dtype": BF16, "cache": False, **kw}
    with pytest.raises(error, match=match):
        fa.tune.choose_op_dtypes(args.pop("probe"), args.pop("dtype"), **args)
