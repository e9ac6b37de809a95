"""funcamp.formats: format constants against torch.finfo/iinfo, and quantize_to bitwise against torch's casts.

torch implements the casts (``x.to(torch.float8_e4m3fn)`` saturates, inf included, since torch 2.12;
``float8_e5m2``, ``float16``, ``bfloat16`` overflow to inf), so every comparison here is bit for bit on
float32 values, NaN compared as NaN. The non-saturating e4m3fn mode is checked against ml_dtypes (the
OCP casts JAX uses) where it is installed, and against its definition otherwise.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from funcamp.formats import FORMATS, Format, get_format, quantize_to

FLOATS = ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]
# torch's cast from float32: saturating (e4m3fn) or overflowing to inf (the others).
TORCH_SATURATES = {"float8_e4m3fn": True, "float8_e5m2": False, "float16": False, "bfloat16": False, "float32": False}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """a and b are float32 with equal bits, any NaN equal to any NaN; report the first differences."""
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b)), "NaN positions differ"
    diff = (a.view(torch.int32) != b.view(torch.int32)) & ~nan
    if diff.any():
        i = diff.nonzero()[:5].flatten()
        n = int(diff.sum())
        raise AssertionError(f"{n} values differ, e.g. at {i.tolist()}: {a[i].tolist()} vs {b[i].tolist()}")


def all_values(fmt: Format) -> torch.Tensor:
    """Every value of a 8- or 16-bit format, as float32 (NaN patterns included)."""
    bits = torch.arange(2 ** (8 * fmt.dtype.itemsize), dtype=torch.int32)
    storage = torch.uint8 if fmt.dtype.itemsize == 1 else torch.int16
    return bits.to(storage).view(fmt.dtype).float()


def sweep(fmt: Format) -> torch.Tensor:
    """Float32 inputs that probe every rounding decision of ``fmt``.

    The format's values, the midpoints between neighbours and the float32 numbers just either side of
    each midpoint, the same past the largest value (the overflow threshold), zeros, infinities, NaN,
    and 200k random float32 bit patterns (every exponent).
    """
    gen = torch.Generator().manual_seed(0)
    randbits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=gen, dtype=torch.int32).view(torch.float32)
    specials = torch.tensor([0.0, -0.0, torch.inf, -torch.inf, torch.nan, 3.4e38, -3.4e38, 1e-45, -1e-45])
    if fmt.name == "float32":
        return torch.cat([randbits, specials])
    values = all_values(fmt)
    finite = values[torch.isfinite(values) & (values >= 0)].unique()  # sorted, +0 once
    beyond = finite[-1] + (finite[-1] - finite[-2])  # the next value the exponent range would hold
    grid = torch.cat([finite.double(), beyond.double().reshape(1)])
    mids = ((grid[1:] + grid[:-1]) / 2).float()  # exact in float32 (one more bit than the format)
    up, down = torch.nextafter(mids, torch.tensor(torch.inf)), torch.nextafter(mids, torch.tensor(-torch.inf))
    positive = torch.cat([values, mids, up, down, beyond.reshape(1) * torch.tensor([1.0, 1.5, 4.0])])
    return torch.cat([positive, -positive, specials, randbits])


@pytest.mark.parametrize("name", FLOATS)
def test_constants_match_torch_finfo(name: str) -> None:
    f, info = FORMATS[name], torch.finfo(FORMATS[name].dtype)
    assert (f.max, f.min, f.eps, f.smallest_normal) == (info.max, info.min, info.eps, info.tiny)
    assert f.smallest_subnormal == info.smallest_normal * info.eps  # 2**(emin - mantissa bits)
    assert f.has_inf == (name != "float8_e4m3fn")
    # the smallest subnormal is a value of the format and half of it is not (it rounds to zero)
    assert torch.tensor(f.smallest_subnormal).to(f.dtype).item() == f.smallest_subnormal
    assert torch.tensor(f.smallest_subnormal / 2).to(f.dtype).item() == 0.0


def test_int8_constants() -> None:
    f, info = FORMATS["int8"], torch.iinfo(torch.int8)
    assert (f.max, f.min, f.smallest_subnormal, f.is_integer, f.has_nan) == (info.max, info.min, 1.0, True, False)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "bfloat16", "float16"])
def test_every_value_is_kept(name: str) -> None:
    values = all_values(FORMATS[name])
    same_bits(quantize_to(values, name, saturate=False), values)


@pytest.mark.parametrize("name", FLOATS)
def test_bitwise_equal_to_torch_cast(name: str) -> None:
    f = FORMATS[name]
    x = sweep(f)
    same_bits(quantize_to(x, f, saturate=TORCH_SATURATES[name]), x.to(f.dtype).float())


@pytest.mark.parametrize("name", ["float8_e5m2", "float16", "bfloat16"])
def test_saturating_mode_is_torch_cast_clamped(name: str) -> None:
    """saturate=True: torch's overflowing cast with +-inf replaced by +-max (finite values never become inf)."""
    f = FORMATS[name]
    x = sweep(f)
    same_bits(quantize_to(x, f, saturate=True), x.to(f.dtype).float().clamp(f.min, f.max))


def test_e4m3fn_non_saturating() -> None:
    """Overflow and inf become NaN: 464 (a tie with 448 and 480) rounds to even 448, anything above is NaN."""
    f = FORMATS["float8_e4m3fn"]
    x = sweep(f)
    got = quantize_to(x, f, saturate=False)
    rounded = x.to(f.dtype).float()  # torch saturates; the finite in-range results are the same
    overflow = torch.isinf(x) | (x.abs() > 464)
    expected = torch.where(overflow, torch.nan, rounded)
    same_bits(got, expected)
    ties = quantize_to(torch.tensor([464.0, -464.0, 464.0001]), f, saturate=False)
    same_bits(ties, torch.tensor([448, -448, torch.nan]))


def test_against_ml_dtypes() -> None:
    """The OCP casts of ml_dtypes (non-saturating for both fp8 formats), on the same sweeps."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    np = pytest.importorskip("numpy")
    for name, ml in (("float8_e4m3fn", ml_dtypes.float8_e4m3fn), ("float8_e5m2", ml_dtypes.float8_e5m2)):
        x = sweep(FORMATS[name])
        with np.errstate(invalid="ignore", over="ignore"):  # numpy warns on the NaN results it is asked for
            expected = torch.from_numpy(x.numpy().astype(ml).astype(np.float32))
        same_bits(quantize_to(x, name, saturate=False), expected)


def test_float64_input_rounds_once() -> None:
    """1 + 2**-4 + 2**-30 lies just above the e4m3 midpoint between 1 and 1.125: it rounds up. Through
    float32 first it would become the midpoint 1.0625 and round to even, 1.0 (double rounding)."""
    x = torch.tensor([1 + 2**-4 + 2**-30], dtype=torch.float64)
    assert quantize_to(x, "e4m3").item() == 1.125
    assert quantize_to(x.float(), "e4m3").item() == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(dtype: torch.dtype) -> None:
    x = all_values(FORMATS[str(dtype).removeprefix("torch.")]).to(dtype)
    for name in ("float8_e4m3fn", "float8_e5m2"):
        same_bits(quantize_to(x, name, saturate=TORCH_SATURATES[name]), x.to(FORMATS[name].dtype).float())


def test_int8_against_torch_quantize() -> None:
    """Round half to even and clamp, as torch.quantize_per_tensor(scale=1, zero_point=0, qint8)."""
    gen = torch.Generator().manual_seed(1)
    halves = torch.arange(-260, 261, dtype=torch.float32) / 2
    x = torch.cat([halves, torch.randn(10_000, generator=gen) * 100, torch.tensor([1e9, -1e9])])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensor creation is deprecated in torch 2.13
        expected = torch.quantize_per_tensor(x, 1.0, 0, torch.qint8).int_repr().float()
    same_bits(quantize_to(x, "int8"), expected)
    assert torch.isnan(quantize_to(torch.tensor([torch.nan]), "int8")).all()


def test_shape_device_dtype_kept() -> None:
    x = torch.randn(3, 4, 5, dtype=torch.bfloat16)
    y = quantize_to(x, torch.float8_e5m2)
    assert y.shape == x.shape and y.dtype == torch.float32 and y.device == x.device


def test_get_format_names() -> None:
    assert get_format("e4m3") is get_format(torch.float8_e4m3fn) is FORMATS["float8_e4m3fn"]
    assert get_format(" bf16 ") is get_format("torch.bfloat16") is FORMATS["bfloat16"]
    assert get_format(FORMATS["int8"]) is FORMATS["int8"]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: get_format("e3m4"), ValueError, "unknown format 'e3m4'; known formats are float32"),
        (lambda: get_format(torch.float64), ValueError, "unknown format"),
        (lambda: get_format(8), TypeError, "expected a Format, torch.dtype or name, got int"),
        (lambda: quantize_to(torch.ones(2, dtype=torch.int32), "e4m3"), TypeError, "floating tensor, got torch.int32"),
        (lambda: quantize_to([1.0], "e4m3"), TypeError, "got list"),
        (lambda: quantize_to(torch.ones(2), "int8", saturate=False), ValueError, "only saturate=True"),
    ],
)
def test_bad_input(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call()


# --- amax magnitudes (issue 26, item 2): tiny, subnormal and zero inputs, rounded exactly -------------------

#: The magnitudes of the int8 and telemetry sweeps: zero, float32's smallest subnormal, subnormals, around
#: the smallest normal, 3.7e-37 (where 127 / amax overflows in float32), ordinary, close to float32's max.
MAGNITUDES = [0.0, 1e-45, 1e-40, 1e-39, 1e-38, 1e-37, 3.7e-37, 1e-30, 1.0, 1e30, 3e38]


def nearest_value(x: float, fmt: Format, saturate: bool) -> float:
    """The float64 oracle: the nearest value of ``fmt`` by search over all its values (ties to the even bit
    pattern), overflow past ``max + ulp(max) / 2``, zeros keeping the sign of ``x``."""
    if fmt.is_integer:
        return float(min(max(round(x), -128), 127)) + 0.0  # Python's round: half to even, in float64
    if fmt.name == "float32":
        np = pytest.importorskip("numpy")
        with np.errstate(over="ignore"):
            y = float(np.float32(x))  # IEEE round to nearest even from float64
        return max(min(y, fmt.max), fmt.min) if saturate else y
    bits = torch.arange(2 ** (8 * fmt.dtype.itemsize), dtype=torch.int32)
    values = all_values(fmt).double()
    keep = torch.isfinite(values) & (values >= 0)
    values, bits = values[keep], bits[keep]
    top = values.max().item()
    ulp_top = 2.0 ** (math.frexp(top)[1] - 1 - fmt.mantissa_bits)
    if abs(x) >= top + ulp_top / 2:
        if saturate:
            return math.copysign(top, x)
        return math.copysign(math.inf, x) if fmt.has_inf else math.nan
    dist = (values - abs(x)).abs()
    best = dist.min()
    ties = (dist == best).nonzero().flatten()
    pick = ties[(bits[ties] % 2 == 0).nonzero().flatten()[0]] if len(ties) > 1 else ties[0]
    return math.copysign(values[pick].item(), x)


@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("name", [*FLOATS, "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_amax_magnitudes_round_as_the_float64_oracle(dtype, name, saturate) -> None:
    fmt = FORMATS[name]
    if fmt.is_integer and not saturate:
        pytest.skip("int8 has only the saturating mode")
    rest = torch.rand(12, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 2 - 1
    pattern = torch.cat([torch.tensor([1.0, -0.5, 0.3, 0.0], dtype=torch.float64), rest])
    x = torch.cat([pattern * m for m in MAGNITUDES]).to(dtype)
    got = quantize_to(x, fmt, saturate=saturate)
    expected = torch.tensor([nearest_value(v, fmt, saturate) for v in x.double().tolist()], dtype=torch.float32)
    same_bits(got, expected)


# --- the block-scaling formats (issue 49): e2m1 elements, e8m0 scales -------------------------------------

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_sweep() -> torch.Tensor:
    """The fp4 values, their midpoints and the float32 numbers either side of each, past 6, both signs."""
    grid = torch.tensor([*E2M1, 8.0])
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = torch.nextafter(mids, torch.tensor(torch.inf)), torch.nextafter(mids, torch.tensor(-torch.inf))
    positive = torch.cat([grid, mids, up, down, torch.tensor([1e-45, 100.0, 3e38])])
    return torch.cat([positive, -positive, torch.tensor([torch.inf, -torch.inf])])


def test_e2m1_rounds_as_torchao() -> None:
    """Nearest, ties to even (1.25 -> 1, 1.75 -> 2, 5 -> 4), saturating at 6, bitwise torchao's fp4 cast
    (``f32_to_f4_unpacked``, then back); NaN stays NaN; saturate=False refused (no inf, no NaN)."""
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    x = e2m1_sweep()
    expected = kernels.f4_unpacked_to_f32(kernels.f32_to_f4_unpacked(x.clamp(-6.0, 6.0)))
    same_bits(quantize_to(x, "e2m1"), expected)
    assert quantize_to(torch.tensor([1.25, 1.75, 5.0, 0.25, 0.75]), "fp4").tolist() == [1.0, 2.0, 4.0, 0.0, 1.0]
    assert torch.isnan(quantize_to(torch.tensor([torch.nan]), "e2m1")).all()
    with pytest.raises(ValueError, match="float4_e2m1fn has no overflow value"):
        quantize_to(x, "e2m1", saturate=False)


def test_e8m0_rounds_as_torch_cast() -> None:
    """Powers of two: nearest with ties up (1.5 * 2**e -> 2**(e + 1)), ``[0, 2**-127]`` to ``2**-127``, past
    ``2**127`` NaN (saturate=False) or ``2**127``; bitwise torch's cast for zero and normal float32 inputs; negative
    NaN. A float32 subnormal just below ``1.5 * 2**-127`` rounds down here, up by torch's cast (which reads its
    bits as a normal number's)."""
    p = torch.exp2(torch.arange(-126, 128, dtype=torch.float64))
    x = torch.cat([p, p * 1.5, p * 1.4999, p * 1.5001, torch.tensor([0.0, 2.0**-127, 2.0**-128, torch.inf])]).float()
    same_bits(quantize_to(x, "e8m0", saturate=False), x.to(torch.float8_e8m0fnu).float())
    assert quantize_to(torch.tensor([1.4999 * 2.0**-127, 1e-45]), "e8m0").tolist() == [2.0**-127, 2.0**-127]
    top = quantize_to(torch.tensor([2.0**127 * 1.6, torch.inf]), "e8m0")
    assert top.tolist() == [2.0**127, 2.0**127]
    assert torch.isnan(quantize_to(torch.tensor([-2.0, -0.0 - 1e-30]), "e8m0")).all()
    f = get_format("e8m0")
    assert (f.max, f.min, f.signed, f.has_inf, f.mantissa_bits) == (2.0**127, 2.0**-127, False, False, 0)
    assert get_format(torch.float4_e2m1fn_x2) is get_format("e2m1") is FORMATS["float4_e2m1fn"]
