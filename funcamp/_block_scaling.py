"""Block-scaled casts (MXFP8, NVFP4) and the matmuls of their linear layers, emulated exactly in float32.

A block-scaled tensor holds low-precision elements and one scale per block of consecutive elements along the
contraction dimension of the matmul it enters: MXFP8 (OCP Microscaling) 32 float8 elements and a power-of-two
scale (e8m0) per block; NVFP4 16 fp4 (e2m1) elements, a float8_e4m3fn scale per block and a float32 scale per
tensor. Here each cast returns the *values* it stands for, in float32: the elements are rounded with integer
and power-of-two arithmetic on float32 bit patterns (exact, and the same under torch.compile: no down-and-up
cast pair that inductor could drop), and multiplied by their scales, which is exact for MX (a power of two)
and, for NVFP4, the rounding torchao's ``NVFP4Tensor.dequantize`` does. A product of two such operands is a
float32 matmul of these values: what torchao's emulated kernels compute, and what the hardware's block-scaled
matmul computes up to its float32 accumulation order.

On a CUDA device of compute capability 10.0 and up ``torch._scaled_mm`` takes e8m0 block scales: the MXFP8
recipe with e4m3 elements routes its matmuls there (:func:`_mx_kernel_mm`). That path has never run in this
project's tests (no such device here); everything else, NVFP4 included, runs the emulation.

Nothing here reads a tensor's values on the host: the casts are traceable with ``fullgraph=True``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclasses.dataclass(frozen=True)
class _Elem:
    """An element format, for the float32 rounding: explicit mantissa bits, the exponent of the smallest
    normal, the largest value and the exponent of the largest power of two (OCP MX's ``emax_elem``)."""

    mantissa_bits: int
    min_exponent: int
    max: float
    emax: int


ELEMENTS = {
    "e4m3": _Elem(3, -6, 448.0, 8),
    "e5m2": _Elem(2, -14, 57344.0, 15),
    "e2m1": _Elem(1, 0, 6.0, 2),
}
NVFP4_BLOCK, MX_BLOCK = 16, 32
_E4M3_TINY = 2.0**-6  # torchao's floor for NVFP4 block scales: the smallest normal e4m3 value
_NVFP4_RANGE = 448.0 * 6.0  # e4m3 max times e2m1 max: the per-tensor scale maps the amax there


def floor_log2(t: torch.Tensor) -> torch.Tensor:
    """``floor(log2 |t|)`` of float32 ``t`` from its exponent bits, int32: exact; -127 for zero and for
    subnormals (their exponent field is 0), 128 for inf and NaN."""
    return ((t.view(torch.int32) >> 23) & 0xFF) - 127


def pow2(e: torch.Tensor) -> torch.Tensor:
    """``2**e`` in float32 for int32 ``e`` in ``[-127, 127]``, exactly (``2**-127`` is a subnormal), built from bits."""
    bits = torch.where(e > -127, (e + 127) << 23, torch.full_like(e, 1 << 22))
    return bits.view(torch.float32)


def round_elements(v: torch.Tensor, elem: _Elem, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round float32 ``v``, already within ``[-elem.max, elem.max]``, to the element format; float32 result.

    ``noise=None``: to nearest, ties to even (``torch.round`` of the value in units of its ulp, a division by
    a power of two, exact). Else ``noise`` holds uniform float32 values in ``[0, 1)``: the magnitude rounds up
    with probability equal to its distance from the value below, in ulps (stochastic rounding; exact in
    expectation up to float32's rounding of ``units + noise``). Subnormals of the format are kept; NaN stays
    NaN; the sign of zero is kept.
    """
    a = v.abs()
    e = floor_log2(a).clamp(elem.min_exponent, 127) - elem.mantissa_bits
    ulp = pow2(e)
    units = a / ulp
    units = torch.round(units) if noise is None else torch.floor(units + noise)
    return (units * ulp).copysign(v)


def _poison(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """NaN where ``amax`` is inf or NaN: a saturating cast would hide the overflow; NaN makes the step skip."""
    return torch.where(torch.isfinite(amax), scale, torch.nan)


def _blocks(t: torch.Tensor, block: int) -> torch.Tensor:
    """``t`` ``(R, C)`` as float32 ``(R, C // block, block)``."""
    r, c = t.shape
    return t.to(torch.float32).reshape(r, c // block, block)


def mx_cast(
    t: torch.Tensor, elem: str = "e4m3", rounding: str = "floor", block: int = MX_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """An MX cast of ``t`` ``(R, C)``, blocks of ``block`` along the last dimension: ``(elements, scales)``.

    Per block: the amax; the e8m0 scale ``2**e``, ``e`` clamped to ``[-127, 127]``, from it:
    ``"floor"`` ``e = floor(log2 amax) - emax_elem`` (OCP MX's rule, torchao's ``FLOOR``: values whose scaled
    magnitude passes the element's max saturate), ``"rceil"`` ``e = ceil(log2(amax / elem_max))`` with the
    quotient rounded to float32 first (the hardware's ``cvt.rp`` to e8m0, TransformerEngine's and torchao's
    ``RCEIL``: nothing saturates). The elements: ``t / 2**e``, saturated and rounded to nearest even. A block
    whose amax is inf or NaN has a NaN scale.

    Returns:
      ``elements`` float32 ``(R, C)`` (values of the element format) and ``scales`` float32
      ``(R, C // block, 1)`` (powers of two in ``[2**-127, 2**127]``, or NaN).
    """
    f = ELEMENTS[elem]
    b = _blocks(t, block)
    amax = b.abs().amax(-1, keepdim=True)
    if rounding == "floor":
        e = floor_log2(amax) - f.emax
    else:
        d = amax / f.max
        bits = d.view(torch.int32)
        mantissa, exp_field = bits & 0x7FFFFF, (bits >> 23) & 0xFF
        # normal: its exponent, one more unless a power of two; subnormal or zero: 2**-127 covers up to 2**-127
        up = (mantissa != 0).to(torch.int32)
        e = torch.where(exp_field > 0, exp_field - 127 + up, -127 + (mantissa > 1 << 22).to(torch.int32))
    scale = _poison(pow2(e.clamp(-127, 127)), amax)
    q = round_elements((b / scale).clamp(-f.max, f.max), f)
    return q.reshape(t.shape), scale


def mx_values(t: torch.Tensor, elem: str = "e4m3", rounding: str = "floor", block: int = MX_BLOCK) -> torch.Tensor:
    """The values :func:`mx_cast` stands for (elements times their block's scale, exact), float32, ``t``'s shape."""
    q, scale = mx_cast(t, elem, rounding, block)
    return (_blocks(q, block) * scale).reshape(t.shape)


def nvfp4_tensor_scale(t: torch.Tensor) -> torch.Tensor:
    """NVFP4's float32 per-tensor scale, ``amax / (448 * 6)`` (torchao's ``per_tensor_amax_to_scale``), 0-d.

    1 for an all-zero tensor (torchao's 0 would make every block scale NaN); NaN where the amax is inf or NaN.
    """
    amax = t.detach().abs().amax().to(torch.float32)
    scale = torch.where(amax > 0, amax / _NVFP4_RANGE, torch.ones_like(amax))
    return _poison(scale, amax)


def nvfp4_values(
    t: torch.Tensor, tensor_scale: torch.Tensor | None, tile: bool = False, noise: torch.Tensor | None = None
) -> torch.Tensor:
    """The values an NVFP4 cast of ``t`` ``(R, C)`` stands for, blocks of 16 along the last dimension.

    torchao's ``nvfp4_quantize`` step by step, in float32: per block the amax over 6; divided by the
    per-tensor scale (None: 1), clamped to ``[2**-6, 448]`` and rounded to e4m3 (the block scale ``s``); the
    elements ``t * ((1 / tensor_scale) / s)`` clamped to 6 and rounded to e2m1 (to nearest even, or
    stochastically with ``noise``, uniform in ``[0, 1)`` of ``t``'s shape); then torchao's dequantization,
    ``q * (tensor_scale * s)``. ``tile=True``: one scale per 16 x 16 tile (``R`` a multiple of 16 too), so that
    the cast of ``t.T`` gives the same values (NVFP4's 2-D weight blocks). float32, shape of ``t``.
    """
    r, c = t.shape
    x = t.to(torch.float32)
    if tile:
        tiles = x.reshape(r // NVFP4_BLOCK, NVFP4_BLOCK, c // NVFP4_BLOCK, NVFP4_BLOCK)
        amax = tiles.abs().amax(dim=(1, 3), keepdim=True).expand(-1, NVFP4_BLOCK, -1, 1).reshape(r, -1, 1)
    else:
        amax = _blocks(x, NVFP4_BLOCK).abs().amax(-1, keepdim=True)
    b = _blocks(x, NVFP4_BLOCK)
    block_scale = amax / 6.0
    if tensor_scale is None:
        s = round_elements(block_scale.clamp(_E4M3_TINY, 448.0), ELEMENTS["e4m3"])
        recip, dequant = 1.0 / s, s
    else:
        s = round_elements((block_scale / tensor_scale).clamp(_E4M3_TINY, 448.0), ELEMENTS["e4m3"])
        recip, dequant = (1.0 / tensor_scale) / s, tensor_scale * s
    scaled = (b * recip).clamp(-6.0, 6.0)
    if noise is not None:
        noise = noise.reshape(b.shape)
    q = round_elements(scaled, ELEMENTS["e2m1"], noise)
    return (q * dequant).reshape(t.shape)


# --- the three matmuls -----------------------------------------------------------------------------


def pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows up to a multiple of the block: the weight gradient contracts the token dimension, whatever
    its size. Zeros change no block's amax and add nothing to a product."""
    extra = -t.shape[0] % multiple
    return torch.nn.functional.pad(t, (0, 0, 0, extra)) if extra else t


def kernel_available(device: torch.device, recipe: Any) -> bool:
    """Whether ``torch._scaled_mm`` takes this recipe's block scales on ``device``: MXFP8 with e4m3 elements on
    CUDA compute capability 10.0 and up. Static (no tensor is read)."""
    if device.type != "cuda" or recipe.scaling != "mxfp8" or recipe.fp8_format != "E4M3":
        return False
    return torch.cuda.get_device_capability(device) >= (10, 0)


def _to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """``(R, C)`` e8m0 scales in cuBLAS's block-scaling-factor layout (128 x 4 tiles, each as 32 x 16), flattened,
    zero-padded to whole tiles; moved as bytes (torch has no pad or copy kernels for every float8 dtype).
    UNTESTED here (no device of compute capability 10.0)."""
    r, c = scales.shape
    pr, pc = -(-r // 128) * 128, -(-c // 4) * 4
    padded = torch.nn.functional.pad(scales.view(torch.uint8), (0, pc - c, 0, pr - r))
    tiles = padded.reshape(pr // 128, 128, pc // 4, 4).permute(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten().view(scales.dtype)


def mx_kernel_mm(a: torch.Tensor, b: torch.Tensor, rounding: str, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` (``a`` ``(M, K)``, ``b`` ``(N, K)``, e4m3 MX casts along K) by ``torch._scaled_mm`` with e8m0
    block scales, as torchao's MX kernels call it. UNTESTED here: no device of compute capability 10.0 ran it;
    the tests check the emulation, which casts the same elements and scales."""
    (qa, sa), (qb, sb) = mx_cast(a, "e4m3", rounding), mx_cast(b, "e4m3", rounding)
    sa, sb = (s.reshape(s.shape[0], -1).to(torch.float8_e8m0fnu) for s in (sa, sb))
    return torch._scaled_mm(qa.to(E4M3), qb.to(E4M3).t(), _to_blocked(sa), _to_blocked(sb), out_dtype=out_dtype)
