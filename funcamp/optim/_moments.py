r"""Moment formats: how an optimizer stores its moments, as static data the transform reads.

A :class:`MomentFormat` says how one moment leaf is kept between steps: as a tensor of a floating dtype (the
default rule, or ``torch.bfloat16`` moments), or block-quantized as a :class:`QuantizedMoment` (``codes`` and
per-block ``scale``, two plain tensors). The transform (``scale_by_adam``) reads every moment with
:meth:`MomentFormat.read` into float32 (float64 with float64 gradients), updates it in that precision, and
stores it with :meth:`MomentFormat.write`: one code path, whatever the format. The formats:

* ``"int8"``: 8-bit codes in blocks of 256 consecutive elements (the row-major flattening of the tensor),
  each block scaled by its largest magnitude and mapped to the nearest entry of a *dynamic quantization map*
  (Dettmers 2015): 256 values whose decimal exponent runs from 1e-6 to 1 with fewer fraction steps the
  smaller they are; a signed map for the first moment, an unsigned one for the second.
  torchao's ``AdamW8bit`` (bitsandbytes' 8-bit Adam, Dettmers et al. 2022).
* ``"int4"``: 4-bit codes, two per byte (the even element in the high nibble), blocks of 128; the first
  moment on a 16-entry signed dynamic map (exponents 1e-2 to 1), the second on the linear map
  ``1/16, 2/16, ..., 1`` (no zero: Li et al. 2023). torchao's ``AdamW4bit``.
* ``torch.float8_e4m3fn``: each block of 256 divided by ``amax / 448`` and cast to float8_e4m3fn (round to
  nearest even), the codes kept as their uint8 bit patterns. torchao's ``AdamWFp8``.

Quantization, for a block ``x`` of ``B`` float32 values: ``s = max(max|x|, 1e-12)`` (fp8: ``s / 448``),
``y = x / s``, and the code of ``y`` is the entry ``q[c]`` of the map with ``q[c] <= y < q[c + 1]`` (the first
entry below ``q[0]``), moved up to ``c + 1`` when ``y - q[c] >= (q[c + 1] - q[c]) * 0.5`` (float32 arithmetic,
ties up). Decoding is ``q[code] * s``. These are torchao 0.18's numbers, bitwise
(``tests/test_optim_lowbit.py``).

torchao's rule for small tensors, kept: a moment is quantized only when its tensor has at least
:attr:`MomentFormat.min_numel` (4096) elements and the block size divides its element count; any other
moment is a float32 tensor shaped like the parameter (float64 for float64 parameters). torchao keeps those
in the parameter's dtype; funcamp in at least float32, as its default rule.

The state stays a plain pytree of tensors: a quantized moment is a ``QuantizedMoment(codes, scale)``
NamedTuple where a float moment is a tensor, so ``optimizer.init`` on a shard quantizes that shard in whole
blocks (its own element count decides, as torchao's rule does on a DTensor's local shard), and the state is
selected, donated, copied and checkpointed as any other. The map itself is static configuration: it is not in
the state (torchao keeps a copy per tensor), and is made once per device (:func:`keep_maps`), so that a compiled
update reads it as an input of its graph rather than making it as a constant.

**Flat buffers.** A quantized format is not elementwise (a block's scale is a reduction over 256 elements),
but it is blockwise, and a flat storage layout (:mod:`funcamp.train._flat`) runs it over one buffer per group
exactly: the decision of each parameter (quantized or float32, :meth:`MomentFormat.quantizes`) is a value the
layout records as it records a mask's (:func:`funcamp.optim._flat.leaf_values`), so quantized and float32
parameters are in different buffers; in a quantized buffer every parameter starts at a multiple of
``block_size`` elements (:meth:`MomentFormat.flat_block_size`) and the padding after it is zeros that never
change, so no block holds elements of two parameters and each parameter's blocks, codes and scales are its
own. The codes of a buffer are one 1-D uint8 tensor, the scales one float32 tensor of
``buffer_numel / block_size``, and the update one loop per buffer.

References:
  Dettmers 2015, "8-Bit Approximations for Parallelism in Deep Learning", arXiv:1511.04561.
  Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", arXiv:2110.02861.
  Li et al. 2023, "Memory Efficient Optimizers with 4-bit States", arXiv:2309.01507.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import torch

from funcamp.optim import _inplace

__all__ = ["FlatRequirement", "MomentFormat", "QuantizedMoment", "flat_requirement", "mark_blockwise", "moment_format"]


class QuantizedMoment(NamedTuple):
    """One block-quantized moment (a state leaf where a float moment would be a tensor)."""

    codes: torch.Tensor  # 1-d uint8: one code per element (int8, fp8 bit patterns) or two per byte (int4),
    # in the row-major order of the parameter's elements
    scale: torch.Tensor  # 1-d float32, numel / block_size: each block's scale (largest magnitude; fp8: / 448)


class FlatRequirement(NamedTuple):
    """What a flat storage layout must give a blockwise format to run it over one buffer (see the module)."""

    block_size: int  # every quantized leaf starts at a multiple of this many elements; zero padding after it
    min_numel: int  # leaves with fewer elements (or not a multiple of block_size) keep float32 moments, apart


def _midpoints(n: int, decade: float) -> list[float]:
    """``decade`` times the ``n`` midpoints of ``n`` equal steps from 0.1 to 1, all in float32 (as the map is built)."""
    edges = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float32)
    return (((edges[:-1] + edges[1:]) / 2.0) * decade).tolist()


def dynamic_map(signed: bool, exponent_bits: int, bits: int) -> tuple[float, ...]:
    """The dynamic quantization map of ``2**bits`` sorted values in [-1, 1] (signed) or [0, 1].

    Decade ``k`` (``k = 0 .. exponent_bits - 1``) holds the midpoints of ``2**k`` (signed; ``2**(k+1)``
    unsigned) equal steps of [0.1, 1], times ``10**(k - exponent_bits + 1)``, and their negatives when signed;
    then 0 and 1. (Dettmers 2015's dynamic tree with no linear part: ``bits - 1 == exponent_bits`` here.)
    """
    values: list[float] = []
    for k in range(exponent_bits):
        steps = 2 ** (k + bits - 1 - exponent_bits) if signed else 2 ** (k + bits - exponent_bits)
        decade = 10 ** (k - exponent_bits + 1)
        values += _midpoints(steps, decade)
        if signed:
            values += _midpoints(steps, -decade)
    values += [0.0, 1.0]
    if len(values) != 2**bits:
        raise AssertionError(f"dynamic_map: {len(values)} values for {bits} bits")
    return tuple(sorted(values))


def _linear_map(n: int) -> tuple[float, ...]:
    """``1/n, 2/n, ..., 1`` (a float32 ``linspace`` from 0 to 1 without its 0)."""
    return tuple(torch.linspace(0.0, 1.0, n + 1, dtype=torch.float32)[1:].tolist())


@dataclasses.dataclass(frozen=True)
class MomentFormat:
    """How a transform stores one moment between steps: static configuration (see the module docstring).

    Fields: ``name`` (``"float"`` for a dtype, ``"int8"``, ``"int4"``, ``"float8_e4m3fn"``); ``dtype`` (a
    float format's storage dtype, None: the default rule, at least float32); ``kind`` (``"float"``,
    ``"map"`` for a quantization map, ``"fp8"``); ``bits`` (code width); ``block_size``; ``min_numel``;
    ``signed_map`` and ``unsigned_map`` (the quantization maps of ``"map"`` formats, float32 values).
    """

    name: str
    dtype: torch.dtype | None = None
    kind: str = "float"
    bits: int = 0
    block_size: int = 0
    min_numel: int = 0
    signed_map: tuple[float, ...] = ()
    unsigned_map: tuple[float, ...] = ()

    @property
    def blockwise(self) -> bool:
        """Whether moments are block-quantized (not elementwise: see :meth:`flat_requirement`)."""
        return self.kind != "float"

    def flat_requirement(self) -> FlatRequirement | None:
        """What a flat layout must give this format (None for a float format: it is elementwise)."""
        return FlatRequirement(self.block_size, self.min_numel) if self.blockwise else None

    def quantizes(self, numel: int) -> bool:
        """Whether a moment of ``numel`` elements is quantized (torchao's rule), not kept in float32."""
        return self.blockwise and numel >= self.min_numel and numel % self.block_size == 0

    def second_moment(self, v: torch.Tensor, g: torch.Tensor, b2: float) -> torch.Tensor:
        """``b2 * v + (1 - b2) * g**2`` in the arithmetic of this format's reference, in ``v``'s dtype.

        Float formats: ``torch.optim.Adam``'s ``v * b2 + (1 - b2) * g * g`` (``mul``, ``addcmul``); quantized ones:
        torchao's ``v.lerp(g**2, 1 - b2)``. The two differ in the last bit, and a last bit decides a code at a
        rounding boundary: to follow torchao's trajectory the codes must be its codes.
        """
        if self.blockwise:
            return v.lerp(g * g, 1.0 - b2)
        return v.mul(b2).addcmul(g, g, value=1.0 - b2)

    # --- state leaves ------------------------------------------------------------------------------------

    def zeros(self, p: torch.Tensor, quantized: bool | None = None) -> torch.Tensor | QuantizedMoment:
        """The initial (zero) moment of parameter ``p``: a tensor, or a :class:`QuantizedMoment` (``quantized``:
        the decision :meth:`quantizes` makes, given where a flat buffer holds several parameters)."""
        if not (self.quantizes(p.numel()) if quantized is None else quantized):
            return torch.zeros_like(p, dtype=self.dtype or _at_least_float32(p.dtype))
        n = p.numel()
        if self.kind == "map":
            keep_maps(p.device)
        codes = p.new_zeros(n * self.bits // 8, dtype=torch.uint8)  # made from p: optax-style placeholders follow
        return QuantizedMoment(codes, p.new_zeros(n // self.block_size, dtype=torch.float32))

    def flat_block_size(self, quantized: Any) -> int:
        """The element alignment a flat buffer of parameters gives this format's moments (``quantized``: the
        value :meth:`quantizes` gave its parameters): the block size, so that no block holds two parameters.
        (Implied where a buffer holds quantized parameters only, each a whole number of blocks; stated here as the
        contract a layout keeps.)"""
        return self.block_size if quantized is True else 1

    def read(self, m: Any, like: torch.Tensor, signed: bool) -> torch.Tensor:
        """Moment leaf ``m`` as values shaped like ``like`` (a float moment as stored; quantized: float32)."""
        if not isinstance(m, QuantizedMoment):
            return m
        return self._decode(m, signed).reshape(like.shape)

    def write(self, m: Any, value: torch.Tensor, signed: bool) -> Any:
        """The next leaf of moment ``m`` holding ``value`` (written into ``m`` in a donating eager step)."""
        if not isinstance(m, QuantizedMoment):
            return _inplace.write(m, value.to(m.dtype))
        codes, scale = self._encode(value, signed)
        return QuantizedMoment(_inplace.write(m.codes, codes), _inplace.write(m.scale, scale))

    # --- quantization --------------------------------------------------------------------------------------

    def _map(self, signed: bool, device: torch.device) -> torch.Tensor:
        """The quantization map on ``device``: the tensor :func:`keep_maps` made there (a compiled step reads it as
        an input of its graph, as it reads a parameter), or a new one where none was made (a constant of the graph)."""
        made = _MAPS.get((self.name, signed, str(device)))
        if made is not None:
            return made
        return torch.tensor(self.signed_map if signed else self.unsigned_map, dtype=torch.float32, device=device)

    def _encode(self, value: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = value.to(torch.float32).reshape(-1, self.block_size)
        amax = blocks.abs().amax(-1).clamp_min(1e-12)
        if self.kind == "fp8":
            scale = amax / torch.finfo(torch.float8_e4m3fn).max
            codes = (blocks / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1)
            return codes, scale
        qmap = self._map(signed, value.device)
        codes = _nearest(qmap, (blocks / amax[:, None]).reshape(-1))
        if self.bits == 4:
            codes = (codes[0::2] << 4) | codes[1::2]
        return codes, amax

    def _decode(self, m: QuantizedMoment, signed: bool) -> torch.Tensor:
        if self.kind == "fp8":
            values = m.codes.view(torch.float8_e4m3fn).to(torch.float32)
        else:
            codes = m.codes
            if self.bits == 4:
                codes = torch.stack([codes >> 4, codes & 0xF], dim=-1).reshape(-1)
            values = self._map(signed, codes.device)[codes.to(torch.int64)]
        return (values.reshape(-1, self.block_size) * m.scale[:, None]).reshape(-1)


def _nearest(qmap: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """uint8 codes of ``y`` on the sorted map ``qmap``: the entry at or below, or the next one from halfway up."""
    top = qmap.numel() - 1
    below = (torch.bucketize(y, qmap, right=True) - 1).clamp(0, top)  # largest c with qmap[c] <= y (else 0)
    above = (below + 1).clamp(max=top)
    low, high = qmap[below], qmap[above]
    up = (y - low) >= (high - low) * 0.5
    return torch.where(up, above, below).to(torch.uint8)


# The quantization maps of the int8 and int4 formats by (format name, signed, device), made on a device once by
# :func:`keep_maps` and never written. A map made inside a compiled region (the flat update compiled once per kind
# of buffer) is a constant torch 2.13's inductor leaves unset in the region's generated code ("non-tensor input");
# a kept one is an input of the graph, as a parameter is.
_MAPS: dict[tuple[str, bool, str], torch.Tensor] = {}


def keep_maps(device: torch.device | str) -> None:
    """Make the int8 and int4 formats' quantization maps on ``device`` (once; host side, eager): what
    :meth:`MomentFormat.zeros` does for the moment it makes, and a layout that compiles one buffer's update alone
    for the device of its buffers. Nothing on the ``meta`` device, and nothing while a step is traced."""
    device = torch.device(device)
    if device.type == "meta" or torch.compiler.is_compiling() or ("int8", True, str(device)) in _MAPS:
        return
    for fmt in (_quantized("int8"), _quantized("int4")):
        for signed in (True, False):
            _MAPS[(fmt.name, signed, str(device))] = fmt._map(signed, device)  # none kept yet: a new one


_BLOCKWISE = "_funcamp_blockwise"


def mark_blockwise(transform: Any, fmt: MomentFormat) -> Any:
    """Declare on ``transform`` (not marked elementwise) the :class:`FlatRequirement` of its format; returns it.

    The declaration a flat storage layout reads (:func:`flat_requirement`) to lay out a group's buffer so that
    the transform runs over it exactly: not wired yet, so such a transform runs leaf by leaf.
    """
    setattr(transform.update, _BLOCKWISE, fmt.flat_requirement())
    return transform


def flat_requirement(transform: Any) -> FlatRequirement | None:
    """The :class:`FlatRequirement` declared on ``transform`` by :func:`mark_blockwise`, or None."""
    return getattr(getattr(transform, "update", None), _BLOCKWISE, None)


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@functools.cache
def _quantized(name: str) -> MomentFormat:
    if name == "int8":
        return MomentFormat(
            "int8", kind="map", bits=8, block_size=256, min_numel=4096,
            signed_map=dynamic_map(True, 7, 8), unsigned_map=dynamic_map(False, 7, 8),
        )  # fmt: skip
    if name == "int4":
        return MomentFormat(
            "int4", kind="map", bits=4, block_size=128, min_numel=4096,
            signed_map=dynamic_map(True, 3, 4), unsigned_map=_linear_map(16),
        )  # fmt: skip
    return MomentFormat("float8_e4m3fn", kind="fp8", bits=8, block_size=256, min_numel=4096)


#: The names a quantized ``moment_dtype`` may be given as.
QUANTIZED = ("int8", "int4", "float8_e4m3fn")


def moment_format(fn: str, moment_dtype: Any, *, quantized: bool = True) -> MomentFormat:
    """The :class:`MomentFormat` of a transform's ``moment_dtype`` argument (checked).

    ``None``: the default rule (at least float32); a floating ``torch.dtype``: that dtype, except
    ``torch.float8_e4m3fn`` (block-scaled, as the string ``"float8_e4m3fn"``); ``"int8"``, ``"int4"``:
    block-quantized. ``quantized=False`` (a transform whose moments are not the Adam family's) refuses the
    quantized formats.

    Raises:
      ValueError: if ``moment_dtype`` is none of these, a float8 dtype other than float8_e4m3fn, or a
        quantized format where ``quantized`` is False.
    """
    name = moment_dtype
    if moment_dtype is torch.float8_e4m3fn:
        name = "float8_e4m3fn"
    if isinstance(name, str) and name in QUANTIZED:
        if not quantized:
            raise ValueError(
                f"{fn}: moment_dtype={moment_dtype!r} (block-quantized moments) is supported by the Adam family "
                "only (scale_by_adam, adam, adamw); use None, torch.float32 or torch.bfloat16 here"
            )
        return _quantized(name)
    if moment_dtype is None or (
        isinstance(moment_dtype, torch.dtype) and moment_dtype.is_floating_point and moment_dtype.itemsize > 1
    ):
        return MomentFormat("float", dtype=moment_dtype)
    accepted = "None or a floating torch.dtype of 16 bits or more (e.g. torch.bfloat16)"
    if quantized:
        accepted += ', or "int8", "int4", torch.float8_e4m3fn (block-quantized)'
    raise ValueError(f"{fn}: moment_dtype must be {accepted}, got {moment_dtype!r}")
