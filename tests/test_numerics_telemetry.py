"""In-graph precision telemetry (funcamp.numerics): the format table against torch's casts, the metrics
against an eager computation on gradients with planted tiny, huge, zero and non-finite elements, and the
compiled step: one graph, no recompiles, work only every N steps, training unchanged."""

from __future__ import annotations

import math

import pytest
import torch

import funcamp as fa
from funcamp import numerics, optim
from funcamp.numerics import FORMATS, Telemetry, telemetry_metrics

CASTABLE = ["float16", "bfloat16", "float8_e5m2"]  # formats whose cast overflows to inf (e4m3fn saturates)


@pytest.mark.parametrize("name", list(FORMATS))
def test_format_table_matches_torch_finfo(name):
    fmt, info = FORMATS[name], torch.finfo(FORMATS[name].dtype)
    assert fmt.max_finite == info.max and fmt.smallest_normal == info.smallest_normal
    assert fmt.smallest_subnormal == info.smallest_normal * info.eps  # the last subnormal: one ulp above 0
    assert 2.0**-fmt.mantissa_bits == info.eps


@pytest.mark.parametrize("name", CASTABLE + ["float8_e4m3fn"])
def test_thresholds_match_what_a_cast_does(name):
    fmt = FORMATS[name]
    half_sub, thr = fmt.smallest_subnormal / 2, fmt.overflow_threshold
    # float32 inputs (the thresholds are exact there), cast as a float32 gradient would be. Not float64:
    # torch casts float64 to float16 through float32, rounding twice (the neighbour of 2**-25 becomes 0).
    t = torch.tensor([half_sub, thr], dtype=torch.float32)
    x = torch.stack(
        [t[0], torch.nextafter(t[0], t[1]), torch.tensor(fmt.max_finite), torch.nextafter(t[1], t[0]), t[1]]
    )
    assert x[0].item() == half_sub and x[4].item() == thr
    y = x.to(fmt.dtype).double()
    assert y[0] == 0 and y[1] > 0  # half the smallest subnormal ties to 0; anything above rounds up
    assert y[2] == fmt.max_finite and y[3] == fmt.max_finite  # just under the threshold rounds to max
    if name == "float8_e4m3fn":
        # No inf in e4m3fn: torch's cast saturates. The threshold is the midpoint between 448 and 480, the
        # next value an e4m3 with one more exponent would have (OCP FP8 v1.0, table 1).
        assert fmt.overflow_threshold == 464.0 and y[4] == 448.0
    else:
        assert torch.isinf(y[4])
    # The telemetry counts exactly the first (underflow) and the last (overflow); three ones make it 8.
    x = torch.cat([x, torch.ones(3)])
    m = telemetry_metrics({"w": x}, {"w": x}, torch.tensor(1.0), Telemetry(formats=(name,)))
    assert m[f"numerics/all/{name}/underflow"].item() == m[f"numerics/all/{name}/overflow"].item() == 1 / 8


def _planted(n_tiny=5, n_huge=3, n_zero=7, n=64, seed=0):
    """float32 gradient with planted tiny (2**-30), huge (2**17), zero and one NaN element among N(0, 1)."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    g[:n_tiny] = 2.0**-30
    g[n_tiny : n_tiny + n_huge] = -(2.0**17)
    g[n_tiny + n_huge : n_tiny + n_huge + n_zero] = 0.0
    return g


def _cast_reference(g: torch.Tensor, name: str, scale: float) -> tuple[float, float]:
    """Underflow and overflow fractions by casting (float32 to the format), the definition itself."""
    x = g.float() * scale  # exact: the scales are powers of two
    y = x.to(FORMATS[name].dtype).double()
    under = ((x != 0) & (y == 0)).double().mean().item()
    if name == "float8_e4m3fn":  # saturating cast: count what rounds past 448 (see the threshold test)
        over = (~(x.abs() < 464.0)).double().mean().item()
    else:
        over = (~torch.isfinite(y)).double().mean().item()
    return under, over


ALL_FORMATS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


@pytest.mark.parametrize("scale", [1.0, 2.0**15, 2.0**-8])
def test_planted_gradient_fractions_equal_the_cast_reference(scale):
    g = _planted()
    g[-1] = math.nan
    w = torch.linspace(-3, 2, 64)
    config = Telemetry(group_depth=1, formats=ALL_FORMATS)
    m = telemetry_metrics({"m.w": g}, {"m.w": w}, torch.tensor(scale), config)
    assert bool(m["numerics/active"])
    for name in ALL_FORMATS:
        for suffix, s in (("", 1.0), ("_scaled", scale)):
            under, over = _cast_reference(g, name, s)
            assert m[f"numerics/m/{name}/underflow{suffix}"].item() == pytest.approx(under, abs=1e-7), (name, s)
            assert m[f"numerics/m/{name}/overflow{suffix}"].item() == pytest.approx(over, abs=1e-7), (name, s)
    # Known by construction: 5 of 64 tiny (2**-30 flushes in float16 and fp8, not in bfloat16), 3 huge
    # (2**17 overflows float16 and both fp8 formats), plus the NaN, which counts as an overflow everywhere.
    if scale == 1.0:
        assert m["numerics/m/float16/underflow"].item() == 5 / 64
        assert m["numerics/m/bfloat16/underflow"].item() == 0.0
        assert m["numerics/m/float16/overflow"].item() == 4 / 64
        assert m["numerics/m/bfloat16/overflow"].item() == 1 / 64
    assert m["numerics/m/grad_zeros"].item() == 7 / 64
    assert math.isnan(m["numerics/m/grad_amax"].item())  # a NaN gradient shows in the amax
    assert m["numerics/m/weight_amax"].item() == 3.0


def test_headroom_is_log2_of_max_over_scale_times_amax():
    g = torch.tensor([0.5, -4.0, 0.0])  # amax 4 = 2**2
    m = telemetry_metrics({"w": g}, {"w": torch.ones(3)}, torch.tensor(2.0**10), Telemetry())
    # float16: log2(65504 / (2**10 * 4)) = log2(65504) - 12
    assert m["numerics/root/float16/headroom_log2"].item() == pytest.approx(math.log2(65504) - 12, rel=1e-6)
    assert m["numerics/all/bfloat16/headroom_log2"].item() == pytest.approx(
        math.log2(FORMATS["bfloat16"].max_finite) - 12
    )
    zero = telemetry_metrics({"w": torch.zeros(3)}, {"w": torch.ones(3)}, torch.tensor(1.0), Telemetry())
    assert zero["numerics/all/float16/headroom_log2"].item() == math.inf  # nothing to overflow


def test_histogram_counts_binades_and_leaves_out_zeros_and_non_finite():
    g = torch.tensor([1.0, 1.5, 2.0, 0.25, 2.0**-60, 2.0**20, 0.0, math.inf, math.nan, -3.0])
    hist = telemetry_metrics({"w": g}, {"w": g}, torch.tensor(1.0), Telemetry())["numerics/all/grad_log2_hist"]
    edges = numerics.histogram_edges()
    assert hist.shape == (numerics.HISTOGRAM_BINS,) and len(edges) == numerics.HISTOGRAM_BINS + 1
    expected = torch.zeros(numerics.HISTOGRAM_BINS, dtype=torch.int64)
    for value in (1.0, 1.5, 2.0, 0.25, 2.0**-60, 2.0**20, 3.0):  # bin of [2**k, 2**(k+1)), ends clamped
        k = min(max(math.floor(math.log2(value)), numerics.HISTOGRAM_LOW), numerics.HISTOGRAM_HIGH - 1)
        expected[k - numerics.HISTOGRAM_LOW] += 1
    assert hist.dtype == torch.int64 and torch.equal(hist, expected)  # exact integer counts


def test_groups_by_module_prefix_and_all():
    names = ["wte.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight", "blocks.1.ln1.weight", "bias"]
    params = {n: torch.ones(2) for n in names}
    # optree sorts dict keys: the order is the leaves' order.
    assert numerics.group_names(params, 2) == ["root", "blocks.0", "blocks.0", "blocks.1", "wte"]
    assert numerics.group_names(params, 1) == ["root", "blocks", "blocks", "blocks", "wte"]
    assert numerics.group_names(params, None) == sorted(names)
    grads = {n: torch.full((2,), float(i + 1)) for i, n in enumerate(sorted(names))}
    m = telemetry_metrics(grads, params, torch.tensor(1.0), Telemetry(group_depth=2))
    groups = {k.split("/")[1] for k in m if k != "numerics/active"}
    assert groups == {"all", "root", "blocks.0", "blocks.1", "wte"}
    assert m["numerics/blocks.0/grad_amax"].item() == 3.0 and m["numerics/all/grad_amax"].item() == 5.0
    n_scalars = 3 + 5 * 2  # amaxes and zeros; 4 fractions and a headroom per format; + one histogram
    assert len(m) == 1 + len(groups) * (n_scalars + 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every": 0}, "every must be an int >= 1, got 0"),
        ({"group_depth": 0}, "group_depth must be None or an int >= 1, got 0"),
        ({"formats": ("float8",)}, r"formats must be a tuple of names from \['bfloat16', 'float16'"),
        ({"formats": "float16"}, "formats must be a tuple of names"),
    ],
)
def test_bad_configuration_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Telemetry(**kwargs)


def test_bad_telemetry_argument_is_refused():
    with pytest.raises(TypeError, match="telemetry must be None, an int N .* got 'often'"):
        fa.make_train_step(lambda p, b: p["w"].sum(), optim.sgd(0.1), telemetry="often")
    with pytest.raises(ValueError, match="every must be an int >= 1, got 0"):
        fa.make_train_step(lambda p, b: p["w"].sum(), optim.sgd(0.1), telemetry=0)


# --- in the train step ----------------------------------------------------------------------------------

EVERY = 3


def planted_loss(params, batch):
    """d loss / d w = batch["g"] exactly (float32): the step's gradient is the planted one."""
    return (params["layer.w"] * batch["g"]).sum() + (params["head.b"] * batch["h"]).sum()


def _batch(i):
    return {"g": _planted(seed=i) * (i + 1), "h": torch.full((4,), 2.0**-i)}


def _state():
    params = {"layer.w": torch.zeros(64), "head.b": torch.ones(4)}
    return fa.TrainState.create(params, optim.sgd(1e-3), loss_scale=fa.StaticLossScale(2.0**12))


@pytest.fixture(scope="module")
def runs():
    """Eight steps of the compiled step (aot_eager) with telemetry, and of the same step without it."""
    config = Telemetry(every=EVERY, group_depth=1)
    with_t = fa.make_train_step(planted_loss, optim.sgd(1e-3), backend="aot_eager", telemetry=config)
    without = fa.make_train_step(planted_loss, optim.sgd(1e-3), backend="aot_eager")
    out, graphs = {}, {}
    for name, step in (("with", with_t), ("without", without)):
        torch._dynamo.reset()  # the two closures share step's code object: each gets its own cache
        torch._dynamo.utils.counters.clear()
        state, history = _state(), []
        with torch._dynamo.config.patch(error_on_recompile=True):
            for i in range(8):
                state, metrics = step(state, _batch(i))
                history.append(metrics)
        out[name] = (state, history)
        graphs[name] = dict(torch._dynamo.utils.counters["stats"])
    return out, graphs


def test_compiled_step_is_one_graph_with_and_without_telemetry(runs):
    _, graphs = runs
    # One graph each over 8 steps, active or not (and error_on_recompile would have raised on a recompile).
    assert graphs["with"]["unique_graphs"] == graphs["without"]["unique_graphs"] == 1


def test_metrics_only_every_n_steps_and_equal_to_the_reference(runs):
    (_, history) = runs[0]["with"]
    keys = set(history[0])
    for i, m in enumerate(history):
        assert set(m) == keys  # the same structure on every step
        active = (i + 1) % EVERY == 0  # steps 3 and 6 of a loop counting from 1
        assert bool(m["numerics/active"]) is active
        if not active:
            assert all(
                float(v.abs().sum()) == 0 for k, v in m.items() if k.startswith("numerics/") and k != "numerics/active"
            )
            continue
        g, scale = _batch(i)["g"], 2.0**12
        for name in ("float16", "bfloat16"):
            for suffix, s in (("", 1.0), ("_scaled", scale)):
                under, over = _cast_reference(g, name, s)
                assert m[f"numerics/layer/{name}/underflow{suffix}"].item() == pytest.approx(under, abs=1e-7)
                assert m[f"numerics/layer/{name}/overflow{suffix}"].item() == pytest.approx(over, abs=1e-7)
        assert m["numerics/layer/grad_amax"].item() == g.abs().max().item()
        assert m["numerics/head/grad_amax"].item() == 2.0**-i
        assert m["numerics/all/grad_zeros"].item() == pytest.approx(7 / 68, rel=1e-7)  # float32 division
        # The weights this step used: 1 - 1e-3 * (2**0 + ... + 2**-(i-1)) after i SGD steps on 2**-j.
        assert m["numerics/head/weight_amax"].item() == pytest.approx(1 - 1e-3 * sum(2.0**-j for j in range(i)))
        expected = math.log2(65504) - 12 - math.log2(g.abs().max().item())
        assert m["numerics/layer/float16/headroom_log2"].item() == pytest.approx(expected, rel=1e-6)


def test_telemetry_does_not_change_training(runs):
    (a, ha), (b, hb) = runs[0]["with"], runs[0]["without"]
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), name
    for ma, mb in zip(ha, hb):
        assert set(mb) <= set(ma)
        for k in mb:
            assert torch.equal(ma[k], mb[k]), k


def test_eager_step_gives_the_compiled_metrics(runs):
    (_, compiled) = runs[0]["with"]
    step = fa.make_train_step(planted_loss, optim.sgd(1e-3), compile=False, telemetry=Telemetry(EVERY, 1))
    state = _state()
    for i in range(EVERY):
        state, m = step(state, _batch(i))
    for k, v in m.items():
        torch.testing.assert_close(v, compiled[EVERY - 1][k], rtol=0, atol=0, equal_nan=True, msg=k)


# --- exact counts at any size (issue 26, item 3) ---------------------------------------------------------


def _bin(value: float) -> int:
    """The histogram bin of a finite nonzero value, from its float64 exponent (math.frexp: exact)."""
    k = math.frexp(abs(value))[1] - 1  # floor(log2 |value|)
    return min(max(k, numerics.HISTOGRAM_LOW), numerics.HISTOGRAM_HIGH - 1) - numerics.HISTOGRAM_LOW


def test_twenty_million_gradient_elements_are_all_counted():
    # Before: torch.histc per leaf counted in float32, so bin 0 read 16,777,216 (2**24) instead of
    # 19,000,000 and the bins summed to 17,777,216.
    g = torch.full((20_000_000,), 1.5)  # 19,000,000 in [1, 2): bin 0
    g[19_000_000:19_500_000] = 2.0**-30  # 500,000: bin -30, flushed by float16
    g[19_500_000:19_800_000] = 2.0**17  # 300,000: the last bin (2**16 and above), overflow in float16
    g[19_800_000:] = 3.0  # 200,000: bin 1
    m = telemetry_metrics({"w": g}, {"w": g}, torch.tensor(1.0), Telemetry(formats=("float16",)))
    hist = m["numerics/all/grad_log2_hist"]
    assert hist.dtype == torch.int64
    expected = torch.zeros(numerics.HISTOGRAM_BINS, dtype=torch.int64)
    for value, count in ((1.5, 19_000_000), (2.0**-30, 500_000), (2.0**17, 300_000), (3.0, 200_000)):
        expected[_bin(value)] += count
    assert hist.tolist() == expected.tolist() and int(hist.sum()) == 20_000_000
    assert hist[_bin(1.5)].item() == 19_000_000
    assert m["numerics/all/float16/underflow"].item() == torch.tensor(500_000 / 20_000_000).item()
    assert m["numerics/all/float16/overflow"].item() == torch.tensor(300_000 / 20_000_000).item()
    assert m["numerics/all/grad_zeros"].item() == 0.0


#: What one element of the count sweep is: its value, and the counts it adds (float16, before and after a
#: loss scale of 2**-8). "tiny" underflows both ways, "huge" overflows both ways (2**17 * 2**-8 = 2**9
#: does not overflow: 2**25 is used), "ordinary" neither.
KINDS = {"zero": 0.0, "tiny": 2.0**-30, "huge": 2.0**25, "ordinary": 1.5}


def _count_case(kind: str, n: int) -> tuple[dict, dict, int]:
    """Two leaves: ``a.w`` of ``n - 1000`` elements and ``b.w`` of 1000; each holds three of every other
    kind and ``kind`` elsewhere. Returns the metrics, the exact counts of each kind, and ``n``."""
    leaves, counts = {}, dict.fromkeys(KINDS, 0)
    for name, size in (("a.w", n - 1000), ("b.w", 1000)):
        g = torch.full((size,), KINDS[kind])
        others = [k for k in KINDS if k != kind]
        for i, other in enumerate(others):
            g[3 * i : 3 * i + 3] = KINDS[other]
            counts[other] += 3
        counts[kind] += size - 3 * len(others)
        leaves[name] = g
    config = Telemetry(group_depth=1, formats=("float16",))
    m = telemetry_metrics(
        leaves, {k: torch.ones(1).expand_as(v) for k, v in leaves.items()}, torch.tensor(2.0**-8), config
    )
    return m, counts, n


@pytest.fixture(scope="module", params=[2**24 + 10, 20_000_010], ids=["2**24+10", "20M"])
def count_cases(request):
    """The sweep's metrics for every dominant kind at one size (the gradients are freed after each)."""
    return {kind: _count_case(kind, request.param) for kind in KINDS}


COUNT_SITES = ["grad_log2_hist", "grad_zeros", "underflow", "overflow", "underflow_scaled", "overflow_scaled"]


@pytest.mark.parametrize("site", COUNT_SITES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_sweep_counts_past_2_24_are_exact(count_cases, kind, site):
    m, counts, n = count_cases[kind]
    key = "numerics/all/" + (site if site.startswith("grad") else f"float16/{site}")
    got = m[key]
    if site == "grad_log2_hist":
        expected = torch.zeros(numerics.HISTOGRAM_BINS, dtype=torch.int64)
        for k, value in KINDS.items():
            if value != 0:
                expected[_bin(value)] += counts[k]
        assert got.tolist() == expected.tolist()
        assert int(got.sum()) == n - counts["zero"] and got.dtype == torch.int64
        return
    count = {"grad_zeros": counts["zero"], "underflow": counts["tiny"], "overflow": counts["huge"]}
    count["underflow_scaled"], count["overflow_scaled"] = count["underflow"], count["overflow"]
    # The fraction of an exact count, rounded once (float64 division, then float32).
    assert got.item() == torch.tensor(count[site] / n, dtype=torch.float64).float().item(), (count[site], n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_sweep_histogram_bins_at_every_power_of_two(dtype):
    """2**k and the largest value below it, for every k the dtype holds, go to the bins of their exact
    exponent (before: float32 floor(log2(x)) put the value below 2**k in bin k for most k)."""
    info = torch.finfo(dtype)
    lo, hi = math.frexp(info.smallest_normal * info.eps)[1] - 1, math.frexp(info.max)[1] - 1
    powers = torch.tensor([2.0**k for k in range(lo, hi + 1)], dtype=torch.float64).to(dtype)
    below = torch.nextafter(powers[1:], torch.zeros_like(powers[1:]))
    extremes = [1e-300, 1e300] if dtype == torch.float64 else []  # beyond float32: still finite, still counted
    g = torch.cat([powers, below, -below, torch.tensor(extremes, dtype=dtype)])
    m = telemetry_metrics({"w": g}, {"w": g}, torch.tensor(1.0), Telemetry(formats=("float16",)))
    hist = m["numerics/all/grad_log2_hist"]
    expected = torch.zeros(numerics.HISTOGRAM_BINS, dtype=torch.int64)
    for value in g.double().tolist():
        expected[_bin(value)] += 1
    assert hist.tolist() == expected.tolist()


# --- tiny, subnormal and zero amax, and any loss scale (issue 26, item 2) ---------------------------------

MAGNITUDES = [0.0, 1e-45, 1e-40, 1e-39, 1e-38, 1e-37, 3.7e-37, 1e-30, 1.0, 1e30, 3e38]
SCALES = [1.0, 2.0**15, 2.0**-20, 3.0, 1000.0]  # powers of two, and scales whose products round


def _exact_fractions(g: torch.Tensor, scale: float, name: str) -> dict[str, float]:
    """Underflow/overflow fractions from exact rational arithmetic (fractions.Fraction) on every element."""
    from fractions import Fraction

    fmt = FORMATS[name]
    half_sub, thr = Fraction(fmt.smallest_subnormal) / 2, Fraction(fmt.overflow_threshold)
    out = dict.fromkeys(("underflow", "overflow", "underflow_scaled", "overflow_scaled"), 0)
    for v in g.double().tolist():
        for suffix, s in (("", Fraction(1)), ("_scaled", Fraction(scale))):
            if not math.isfinite(v):
                out[f"overflow{suffix}"] += 1
                continue
            x = abs(Fraction(v)) * s
            out[f"underflow{suffix}"] += 0 < x <= half_sub
            out[f"overflow{suffix}"] += x >= thr
    return {k: torch.tensor(c / g.numel(), dtype=torch.float64).float().item() for k, c in out.items()}


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("m", MAGNITUDES)
def test_sweep_magnitudes_against_exact_arithmetic(m, dtype, scale):
    """Every site that divides by an amax or a scale: the headroom ``log2(max / (scale * amax))``, and the
    underflow/overflow counts of ``g * scale`` (compared as ``|g|`` against the threshold over the scale)."""
    rest = torch.rand(12, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 2 - 1
    g = (torch.cat([torch.tensor([1.0, -0.5, 0.3, 0.0], dtype=torch.float64), rest]) * m).to(dtype)
    m_ = telemetry_metrics({"w": g}, {"w": g}, torch.tensor(scale), Telemetry(formats=ALL_FORMATS))
    amax = g.double().abs().max().item()
    assert m_["numerics/all/grad_amax"].item() == torch.tensor(amax).float().item()
    for name in ALL_FORMATS:
        for key, value in _exact_fractions(g, scale, name).items():
            assert m_[f"numerics/all/{name}/{key}"].item() == value, (name, key)
        head = m_[f"numerics/all/{name}/headroom_log2"].item()
        if amax == 0:
            assert head == math.inf
            continue
        expected = math.log2(FORMATS[name].max_finite) - math.log2(scale) - math.log2(amax)  # float64
        assert math.isfinite(head) and abs(head - expected) <= abs(expected) * 2**-24 + 1e-12, (name, head, expected)


@pytest.mark.parametrize("scale", [3.0, 1000.0, 2.0**-20 * 3])
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_scaled_counts_at_the_threshold_over_the_scale(name, scale):
    """The float32 neighbours of ``half_sub / scale`` and ``threshold / scale`` are counted as their exact
    products say (before: the float32 product g * scale rounded some across the threshold)."""
    fmt = FORMATS[name]
    points = []
    for t in (fmt.smallest_subnormal / 2, fmt.overflow_threshold):
        x = torch.tensor(t / scale, dtype=torch.float32)
        for _ in range(3):
            x = torch.nextafter(x, torch.tensor(0.0))
        for _ in range(7):
            points.append(x.item())
            x = torch.nextafter(x, torch.tensor(math.inf))
    g = torch.tensor(points)
    m = telemetry_metrics({"w": g}, {"w": g}, torch.tensor(scale), Telemetry(formats=(name,)))
    for key, value in _exact_fractions(g, scale, name).items():
        assert m[f"numerics/all/{name}/{key}"].item() == value, key


def test_no_formats_gives_amaxes_zeros_and_the_histogram():
    # Before: torch.stack of the empty list of headrooms raised.
    g = torch.tensor([0.0, 1.0, -3.0])
    m = telemetry_metrics({"w": g}, {"w": g}, torch.tensor(1.0), Telemetry(formats=()))
    assert sorted(k.rsplit("/", 1)[1] for k in m if k.startswith("numerics/all/")) == [
        "grad_amax",
        "grad_log2_hist",
        "grad_zeros",
        "weight_amax",
    ]
    assert m["numerics/all/grad_zeros"].item() == pytest.approx(1 / 3) and m["numerics/all/grad_amax"].item() == 3.0


# --- the lost-update meter (issue 49, item 3) ----------------------------------------------------------------


def _sum_loss(params, batch):
    """d loss / d p = batch[name] (float32): the step's gradient is the batch."""
    return sum((params[k].float() * batch[k]).sum() for k in params)


def _meter_run(dtype, opt, *, compile=True, steps=2, batch=None, config=None):
    """``steps`` steps of SGD-like updates on parameters in [1, 1.5) (4096 in ``a``, 64 in ``b``); the last
    step's metrics."""
    g = torch.Generator().manual_seed(0)
    params = {"a.w": 1 + 0.5 * torch.rand(4096, generator=g), "b.w": 1 + 0.5 * torch.rand(64, generator=g)}
    params = {k: v.to(dtype) for k, v in params.items()}
    config = config or Telemetry(every=1, group_depth=1)
    kwargs = {"backend": "aot_eager"} if compile else {"compile": False}
    step = fa.make_train_step(_sum_loss, opt, telemetry=config, **kwargs)
    state = fa.TrainState.create(params, opt)
    batch = batch or {k: torch.ones(v.shape) for k, v in params.items()}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(steps):
            state, m = step(state, batch)
    return m


@pytest.fixture(scope="module")
def meter_runs():
    """The meter over SGD steps of 1e-5 on parameters near 1, compiled (aot_eager) and eager."""
    torch._dynamo.reset()
    cases = {
        "bfloat16": (torch.bfloat16, optim.sgd(1e-5)),
        "float32": (torch.float32, optim.sgd(1e-5)),
        "kahan": (torch.bfloat16, optim.kahan_summation(optim.sgd(1e-5))),
        "stochastic": (torch.bfloat16, optim.stochastic_rounding(optim.sgd(1e-5))),
        # b's update is its gradient itself (passed through): an operand of the cond twice, refused if not deduped
        "masked": (torch.bfloat16, optim.masked(optim.sgd(1e-5), {"a.w": True, "b.w": False})),
    }
    compiled = ("bfloat16", "kahan", "masked")  # the others eager only (each compile costs seconds)
    return {
        (name, compile): _meter_run(dtype, opt, compile=compile)
        for name, (dtype, opt) in cases.items()
        for compile in (True, False)
        if compile is False or name in compiled
    }


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
def test_lost_updates_bfloat16_near_one_and_float32(meter_runs, compile):
    bf16, f32 = meter_runs[("bfloat16", compile)], meter_runs[("float32", False)]
    for group in ("all", "a", "b"):
        # Half a bfloat16 spacing at [1, 1.5) is 2**-8 = 0.0039: every step of 1e-5 is lost. float32: none.
        assert bf16[f"numerics/{group}/lost_updates"].item() >= 0.9  # measured: 1.0
        assert f32[f"numerics/{group}/lost_updates"].item() <= 0.01  # measured: 0.0
    assert "numerics/all/carried_updates" not in bf16


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
def test_lost_updates_under_kahan_and_stochastic_rounding_are_carried(meter_runs, compile):
    kahan, sr = meter_runs[("kahan", compile)], meter_runs[("stochastic", False)]
    for m in (kahan, sr):
        assert m["numerics/all/lost_updates"].item() == 0.0  # the wrappers' updates land exactly
    # Kahan: the parameter stayed, the compensation took every update. Stochastic rounding: a parameter moves
    # a whole spacing with probability 1e-5 / 2**-7 per step (0.13%), every other one kept its value.
    assert kahan["numerics/all/carried_updates"].item() == 1.0
    assert 0.99 <= sr["numerics/all/carried_updates"].item() < 1.0  # measured: 0.9986


def test_lost_updates_count_only_applied_nonzero_updates(meter_runs):
    m = meter_runs[("masked", True)]
    # a.w (4096): SGD's 1e-5, lost; b.w (64): passed through unmasked, the gradient 1.0 itself, applied.
    assert m["numerics/a/lost_updates"].item() == 1.0 and m["numerics/b/lost_updates"].item() == 0.0
    assert m["numerics/all/lost_updates"].item() == pytest.approx(4096 / 4160, rel=1e-7)
    frozen = _meter_run(torch.bfloat16, optim.multi_transform(
        {"t": optim.sgd(1e-5), "f": optim.set_to_zero()}, {"a.w": "t", "b.w": "f"}), compile=False)  # fmt: skip
    assert frozen["numerics/b/lost_updates"].item() == 0.0  # zero updates: not counted, not lost
    assert frozen["numerics/all/lost_updates"].item() == 1.0  # of the 4096 nonzero ones, all lost


def test_eager_meter_equals_compiled(meter_runs):
    for name in ("bfloat16", "kahan", "masked"):
        compiled, eager = meter_runs[(name, True)], meter_runs[(name, False)]
        for k, v in compiled.items():
            if "lost" in k or "carried" in k:
                assert torch.equal(v, eager[k]), (name, k)


def test_lost_updates_are_zero_on_a_skipped_step_and_off_when_asked():
    batch = {"a.w": torch.ones(4096), "b.w": torch.ones(64)}
    batch["b.w"][0] = math.inf
    m = _meter_run(torch.bfloat16, optim.sgd(1e-5), steps=1, batch=batch, compile=False)
    assert not bool(m["grads_finite"]) and m["numerics/all/lost_updates"].item() == 0.0
    off = _meter_run(torch.bfloat16, optim.sgd(1e-5), steps=1, config=Telemetry(1, lost_updates=False), compile=False)
    assert not any("lost" in k for k in off)


def test_meter_matches_a_direct_count():
    """``telemetry_metrics`` on hand-made trees: the definition, element by element."""
    p = {"w": torch.tensor([1.0, 1.0, 1.0, 2.0, 0.0], dtype=torch.bfloat16)}
    u = {"w": torch.tensor([1e-5, 0.0, 0.1, -1e-3, 1e-30])}
    new = {"w": (p["w"].float() + u["w"]).to(torch.bfloat16)}  # kept, kept (zero update), moved, kept, moved
    applied = numerics.AppliedUpdate(u, new, torch.tensor(True))
    m = telemetry_metrics(u, p, torch.tensor(1.0), Telemetry(), applied=applied)
    assert m["numerics/all/lost_updates"].item() == pytest.approx(2 / 4)  # 4 nonzero updates, 2 lost
