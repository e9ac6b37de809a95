"""The number formats funcamp knows, and an exact emulation of rounding to each.

A :class:`Format` describes one storage format: its range (largest finite value, smallest normal and
subnormal), its precision (explicit mantissa bits) and its special values (whether it has an infinity).
:func:`quantize_to` rounds real numbers to a format the way hardware casts do (round to nearest, ties
to even, with subnormals), saturating or overflowing as asked, and returns the result as float32 values,
so that any low-precision result can be checked against an exact emulation on any device.

Known formats (:data:`FORMATS`, by name): ``float32``, ``bfloat16``, ``float16``, ``float8_e4m3fn``
(weights and activations in fp8 training), ``float8_e5m2`` (gradients), ``int8`` (integers in
[-128, 127]), and the two formats of block-scaled training (OCP Microscaling, MX): ``float8_e8m0fnu``
(``e8m0``: the power-of-two scale of an MX block, ``2**-127`` to ``2**127``, unsigned, no zero, no inf)
and ``float4_e2m1fn`` (``e2m1``, fp4: the element of NVFP4 and MXFP4, the values 0, 0.5, 1, 1.5, 2, 3, 4, 6
and their negatives, no inf, no NaN; torch stores it two to a byte, ``torch.float4_e2m1fn_x2``). The
field's names for the fp8 pair: OCP 8-bit floating point (OFP8) E4M3 and E5M2; NVIDIA TransformerEngine
calls E4M3 forward with E5M2 backward ``HYBRID``.

References:
  Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv:2209.05433 (E4M3 has no infinity,
  one NaN mantissa pattern; E5M2 follows IEEE 754 rules). OCP 8-bit Floating Point Specification
  (OFP8) rev. 1.0, 2023 (saturating and non-saturating conversion). OCP Microscaling Formats (MX)
  Specification v1.0, 2023 (E8M0 scales, FP4 E2M1 elements).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

import torch

__all__ = ["FORMATS", "Format", "get_format", "quantize_to"]


@dataclasses.dataclass(frozen=True)
class Format:
    """A number format: range, precision and special values.

    Attributes:
      name: the torch dtype's name (``"float8_e4m3fn"``); ``"float4_e2m1fn"`` for fp4, whose torch dtype
        packs two values to a byte.
      dtype: the torch dtype that stores it (``torch.float4_e2m1fn_x2`` for ``float4_e2m1fn``).
      mantissa_bits: explicit fraction bits (e4m3: 3, e5m2: 2, bf16: 7, f16: 10, f32: 23; int8: 0,
        since integers are spaced by 1).
      min_exponent: exponent of the smallest normal number, ``smallest_normal == 2**min_exponent``
        (int8: 0, its step is 1).
      max: the largest finite value (e4m3fn 448, e5m2 57344, f16 65504; int8 127).
      min: the most negative finite value (``-max`` for the floating formats; int8 -128); for the
        unsigned ``float8_e8m0fnu`` its smallest value, ``2**-127``.
      smallest_normal: ``2**min_exponent`` (int8: 1).
      smallest_subnormal: ``2**(min_exponent - mantissa_bits)`` (int8: 1).
      has_inf: whether the format can store +-inf (e4m3fn, e8m0, e2m1 and int8 cannot).
      has_nan: whether it can store NaN (int8 and e2m1 cannot).
      is_integer: True for int8.
      signed: False for ``float8_e8m0fnu`` (positive powers of two only: no sign, no zero).
      packed: True for ``float4_e2m1fn``: torch stores two values in a byte, so ``.to(fmt.dtype)`` is not
        a cast of one value (pack the 4-bit codes yourself).
    """

    name: str
    dtype: torch.dtype
    mantissa_bits: int
    min_exponent: int
    max: float
    min: float
    has_inf: bool
    has_nan: bool
    is_integer: bool = False
    signed: bool = True
    packed: bool = False

    @property
    def smallest_normal(self) -> float:
        return float(2.0**self.min_exponent)

    @property
    def smallest_subnormal(self) -> float:
        return float(2.0 ** (self.min_exponent - self.mantissa_bits))

    @property
    def eps(self) -> float:
        """The gap between 1 and the next larger value, ``2**-mantissa_bits`` (``torch.finfo(dtype).eps``)."""
        return float(2.0**-self.mantissa_bits)


def _float(dtype: torch.dtype, mantissa_bits: int, min_exponent: int, has_inf: bool) -> Format:
    top = torch.finfo(dtype).max
    return Format(str(dtype).removeprefix("torch."), dtype, mantissa_bits, min_exponent, top, -top, has_inf, True)


#: The formats by name; :func:`get_format` also accepts their dtypes and short names.
FORMATS: Mapping[str, Format] = MappingProxyType(
    {
        f.name: f
        for f in (
            _float(torch.float32, 23, -126, True),
            _float(torch.bfloat16, 7, -126, True),
            _float(torch.float16, 10, -14, True),
            _float(torch.float8_e4m3fn, 3, -6, False),
            _float(torch.float8_e5m2, 2, -14, True),
            Format("int8", torch.int8, 0, 0, 127.0, -128.0, has_inf=False, has_nan=False, is_integer=True),
            Format("float8_e8m0fnu", torch.float8_e8m0fnu, 0, -127, 2.0**127, 2.0**-127, False, True, signed=False),
            Format("float4_e2m1fn", torch.float4_e2m1fn_x2, 1, 0, 6.0, -6.0, False, False, packed=True),
        )
    }
)

_ALIASES = {
    "f32": "float32",
    "fp32": "float32",
    "bf16": "bfloat16",
    "f16": "float16",
    "fp16": "float16",
    "e4m3": "float8_e4m3fn",
    "e4m3fn": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "fp8_e5m2": "float8_e5m2",
    "e8m0": "float8_e8m0fnu",
    "fp8_e8m0": "float8_e8m0fnu",
    "e2m1": "float4_e2m1fn",
    "fp4": "float4_e2m1fn",
    "fp4_e2m1": "float4_e2m1fn",
    "float4_e2m1fn_x2": "float4_e2m1fn",
}


def get_format(fmt: Format | torch.dtype | str) -> Format:
    """The :class:`Format` for a format, a torch dtype or a name (``"e4m3"``, ``"bf16"``, ``"int8"``, ``"e8m0"``,
    ``"e2m1"``; ``torch.float4_e2m1fn_x2`` gives ``float4_e2m1fn``).

    Raises:
      ValueError: if the name or dtype is not one of :data:`FORMATS`.
      TypeError: if ``fmt`` is neither a Format, a torch.dtype nor a string.
    """
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        name = str(fmt).removeprefix("torch.")
        name = _ALIASES.get(name, name)
    elif isinstance(fmt, str):
        name = fmt.strip().removeprefix("torch.")
        name = _ALIASES.get(name, name)
    else:
        raise TypeError(f"get_format: expected a Format, torch.dtype or name, got {type(fmt).__name__}")
    if name not in FORMATS:
        raise ValueError(
            f"get_format: unknown format {fmt!r}; known formats are {', '.join(FORMATS)} "
            f"(also {', '.join(sorted(_ALIASES))})"
        )
    return FORMATS[name]


def quantize_to(x: torch.Tensor, fmt: Format | torch.dtype | str, *, saturate: bool = True) -> torch.Tensor:
    """Round ``x`` to the nearest value of ``fmt`` (ties to even), exactly, and return it as float32.

    The rounding is done in float64 (exact: a power-of-two scaling and an integer rounding), from the
    input's own values, so a float64 input is rounded once, not through float32. Subnormals of the
    format are kept; values below half the smallest subnormal become a zero of the same sign.
    Values whose rounded magnitude exceeds ``fmt.max``:

    - ``saturate=True``: become ``+-fmt.max``, and so do +-inf (CUDA's ``satfinite`` conversion, and
      torch's own cast to ``float8_e4m3fn`` since torch 2.12);
    - ``saturate=False``: become +-inf where the format has one, NaN otherwise (e4m3fn; OCP's
      non-saturating mode, ml_dtypes' casts); torch's casts to ``float8_e5m2``, ``float16``,
      ``bfloat16`` and ``float32`` behave this way.

    NaN stays NaN. For ``int8`` the values are rounded to integers (ties to even) and clamped to
    [-128, 127] (zero is +0); ``saturate`` must be True (torch's float-to-int8 cast wraps around instead), and NaN
    stays NaN in the float32 result.

    The block-scaling formats: ``float4_e2m1fn`` (fp4) rounds to nearest, ties to even, and always
    saturates at +-6 (it has neither inf nor NaN, as OCP MX's conversion; ``saturate`` must be True; NaN
    stays NaN in the float32 result). ``float8_e8m0fnu`` rounds a positive value to the nearest power of
    two, a tie ``1.5 * 2**e`` going up (even, as torch's cast); values in ``[0, 2**-127]`` become
    ``2**-127`` (it has no zero; torch's cast does the same, but rounds a float32 subnormal as if its bits
    were a normal number's: just below ``1.5 * 2**-127`` it gives ``2**-126``); past ``2**127`` it saturates or, with
    ``saturate=False``, gives NaN (it has no inf; torch's cast gives NaN); negative values give NaN (it has
    no sign; torch's cast drops the sign instead).

    Args:
      x: a real floating tensor (float16, bfloat16, float32, float64, or a float8 dtype), any shape and
        device with float64 support.
      fmt: the target format: a :class:`Format`, a dtype or a name (see :func:`get_format`).
      saturate: what overflow does, see above.
    Returns:
      A float32 tensor of ``x``'s shape and device whose values are all representable in ``fmt``
      (``quantize_to(x, fmt).to(fmt.dtype)`` is exact).
    Raises:
      TypeError: if ``x`` is not a real floating tensor.
      ValueError: if ``fmt`` is unknown, or ``saturate=False`` with ``int8`` or ``float4_e2m1fn``.

    Example:
      >>> quantize_to(torch.tensor([1.0625, 1.1875, 300.0, 500.0]), "e4m3")
      tensor([  1.0000,   1.2500, 288.0000, 448.0000])
      >>> quantize_to(torch.tensor([500.0, float("inf")]), "e4m3", saturate=False)
      tensor([nan, nan])
    """
    f = get_format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"quantize_to: x must be a real floating tensor, got {what}")
    if (f.is_integer or not (f.has_inf or f.has_nan)) and not saturate:
        raise ValueError(
            f"quantize_to: {f.name} has no overflow value (no inf, no NaN): only saturate=True is accepted"
        )
    y = x.to(torch.float64)
    if not f.signed:  # e8m0: no sign, no zero; negatives are NaN, [0, 2**-127] the smallest value
        y = torch.where(y < 0, torch.nan, y.clamp(min=f.min))
    if f.name == "float32":  # torch's cast is round-to-nearest-even with IEEE overflow
        out = y.to(torch.float32)
        return out.clamp(f.min, f.max) if saturate else out
    if f.is_integer:
        return (torch.round(y).clamp(f.min, f.max) + 0.0).to(torch.float32)  # + 0.0: integers have no -0
    _, exponent = torch.frexp(y)  # |y| = m * 2**exponent, m in [0.5, 1): floor(log2|y|) = exponent - 1
    ulp_exponent = torch.clamp(exponent - 1, min=f.min_exponent) - f.mantissa_bits
    ulp = torch.pow(2.0, ulp_exponent.to(torch.float64))  # exact powers of two, in float64's range
    rounded = torch.round(y / ulp) * ulp  # both steps exact: y / ulp has at most mantissa_bits + 1 bits
    if saturate:
        return rounded.clamp(f.min, f.max).to(torch.float32)
    big = torch.full_like(y, torch.inf if f.has_inf else torch.nan).copysign(y)
    return torch.where(rounded.abs() > f.max, big, rounded).to(torch.float32)
