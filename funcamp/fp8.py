"""fp8 training: scaling recipes as immutable state, and an fp8 linear layer on ``torch._scaled_mm``.

The three matmuls of a linear layer (the output ``y = x W^T``, ``grad_input = g W`` and
``grad_weight = g^T x``) run in 8-bit floating point: each operand is scaled into the format's range,
cast (saturating) to fp8, multiplied by ``torch._scaled_mm`` with float32 accumulation, and the
product is scaled back by the inverse scales. Master weights stay in their own dtype (float32), the
rest of the model in the surrounding compute dtype.

Recipes (:class:`Recipe`, :func:`get_recipe`):

- ``"tensorwise"``: one scale per tensor from its current amax (``scale = fp8_max / amax``), e4m3 for
  inputs and weights, e5m2 for gradients (``HYBRID``); torchao's ``tensorwise`` recipe.
- ``"rowwise"``: one scale per row of the left operand and per column of the right operand of every
  matmul (the contraction dimension is reduced), powers of two, e4m3 for gradients too; torchao's
  ``rowwise`` recipe.
- ``"delayed"``: input and weight scales from a history of past amaxes,
  ``scale = fp8_max / (max(amax_history) * 2**margin)`` (TransformerEngine's ``DelayedScaling``), and
  from the current amax while the history holds none (TransformerEngine casts with scale 1 there); the
  state is a :class:`DelayedScalingState` per tensor, carried as persistent buffers of the layer and
  so returned by :func:`funcamp.nn.functionalize`'s ``apply_fn``, carried, checkpointed and restored on
  skipped steps by :class:`funcamp.TrainState`. Gradients use current (dynamic, tensorwise) scaling:
  a backward pass cannot hand new state out of ``torch.func.grad`` functionally. TransformerEngine
  keeps a delayed history for gradients too; this is where funcamp differs.
- ``"mxfp8"`` and ``"nvfp4"``, block-scaled: every operand of each matmul is cast in blocks along the
  dimension that matmul contracts, 32 e4m3 elements with a power-of-two (e8m0) scale (OCP MX; torchao's
  ``MXFP8TrainingOpConfig``, TransformerEngine's ``MXFP8BlockScaling``), or 16 e2m1 (fp4) elements with an
  e4m3 scale under a float32 scale per tensor, 16 x 16 weight tiles and stochastically rounded gradients
  (TransformerEngine's ``NVFP4BlockScaling``, torchao's ``nvfp4_quantize``). No state. Where the device has
  no kernel for the block scales (every device but CUDA compute capability 10.0 and up, which runs
  ``mxfp8`` on ``torch._scaled_mm``: a path no test here has run) an exact float32 emulation computes the
  same numbers, said once by an :class:`Fp8EmulationWarning`: ``mxfp8`` equals torchao 0.18's emulated
  MX linear bit for bit on the CPU, NVFP4's cast ``NVFP4Tensor.to_nvfp4``'s. See :class:`Recipe` for their
  fields and docs/fp8.md for how they differ from torchao and TransformerEngine.

Non-finite values. A saturating cast would turn an inf into ``fp8_max`` and hide an overflow; instead,
where an amax is inf or NaN the scale is NaN, so that layer's output (or gradient) is NaN and the train
step skips. An inf or NaN amax never enters a delayed history (:func:`update_delayed_state`).

Tiny values. Every scale lies in ``[2**-126, 2**126]``, so that it and the inverse scale
``torch._scaled_mm`` takes are finite normal float32 numbers whatever the amax (zero and subnormal
included): a tensor is cast with its own ``fp8_max / amax`` down to an amax of about 5.3e-36, and
below that with ``2**126``, which keeps every value above ``2**-136`` (e4m3), under float32's normal
range. Each matmul equals the exact emulation within the float32 accumulation bound and one rounding
to the output dtype (float32 stays float32, for rowwise too).

Against torchao 0.18 on the CPU, outputs and gradients of the tensorwise and rowwise recipes are equal
bit for bit (the same scale arithmetic, saturating casts and ``_scaled_mm`` calls) for every amax
from 1e-12 up, rowwise for bfloat16 outputs (its float32 ones, rounded to bfloat16, are torchao's).
Differences: the per-tensor recipes keep the fp8 casts of ``x`` and ``W`` for the backward (torchao
keeps the high-precision tensors and casts them again, to the same values); under
:data:`MODULE_POLICIES` the weight is cast to fp8 from its float32 master; torchao makes rowwise
float32 and float16 outputs in bfloat16 (2**-9 relative off), funcamp in float32; torchao floors
amaxes at 1e-12, so that a tensor whose amax is below about 1e-17 casts to zeros, where funcamp keeps
it (above).

Composition. ``torch.func.grad`` and ``torch.compile(fullgraph=True)`` (aot_eager and inductor) trace
the layer; gradient accumulation passes the delayed state through every micro-batch. Under
``torch.func.vmap`` the dynamic recipes work (torch has no batching rule for ``_scaled_mm`` and loops
over the samples, with a performance warning), each sample with its own scales; so does the delayed
recipe: every sample is cast with the stored (shared) scales, and the new state, one per sample, comes
out of ``apply_fn`` with the batch dimension (the layer reassigns its state buffers rather than
writing into them, which vmap could not do for an unbatched buffer; reduce them, e.g. with a maximum,
if you carry them on). Data parallel:
the dynamic recipes need nothing (weights are equal on every rank, activations are scaled per rank,
as torchao without ``reduce_amax``); for the delayed state the fp8 layers declare
``buffer_reductions`` (a class attribute), which ``funcamp.nn.functionalize`` gives as
``apply_fn.buffer_reductions`` and ``TrainState.create(..., buffer_reductions=apply_fn.buffer_reductions)``
carries to the step, so that :func:`funcamp.parallel.reduce_buffers` (the data-parallel train step's
reduction of the new buffers) takes the maximum of the amax histories and the minimum of the scales over
the ranks (for a state made without them, the same rule by the buffers' names, deprecated: the
table of :func:`funcamp.parallel.register_buffer_reduction`, which starts with these names): every
rank casts with the scale of the largest amax, as
TransformerEngine's amax reduction gives (an average would let a rank whose activations are larger
than the mean saturate).

Use :func:`convert` (as torchao's ``convert_to_float8_training``) to swap the ``nn.Linear`` layers of a
model for :class:`Float8Linear` (Hugging Face ``Conv1D`` for :class:`Float8Conv1D`; layers whose sizes
are not multiples of 16, or of the block, stay as they are, reported once, and so do mixture-of-experts
weights used through grouped matmuls), then ``functionalize`` with
:data:`MODULE_POLICIES` so that each fp8 layer receives its float32 master weight and float32 recipe state:

    model = fp8.convert(GPT(cfg), recipe="tensorwise")    # first and last Linear stay as they are
    apply_fn, params = fa.nn.functionalize(model, "p=f32,c=bf16,o=f32", module_policies=fp8.MODULE_POLICIES)

With ``with_buffers=True`` ``functionalize`` returns ``(apply_fn, params, buffers)`` for every recipe (the
delayed recipe's state in ``buffers``; ``{}`` for the others). :func:`funcamp.nn.functionalize` does both
steps from a policy string with an ``fp8=`` part (the delayed recipe requires ``with_buffers=True``):

    apply_fn, params, buffers = fa.nn.functionalize(GPT(cfg), "p=f32,c=bf16,o=f32,fp8=delayed", with_buffers=True)

(:func:`functionalize` of this module, which did the same, is a deprecated alias.)

References:
  Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv:2209.05433. torchao float8 training
  (``torchao.float8.Float8Linear``, ``convert_to_float8_training``, recipes ``tensorwise`` and
  ``rowwise``, 0.18). NVIDIA TransformerEngine ``recipe.DelayedScaling`` (``margin``,
  ``amax_history_len``, ``amax_compute_algo``, ``Format.HYBRID``), ``MXFP8BlockScaling``,
  ``NVFP4BlockScaling``. OCP Microscaling Formats (MX) Specification v1.0, 2023. torchao 0.18
  ``prototype.moe_training.mxfp8_linear`` and ``prototype.mx_formats`` (``to_mx``, ``NVFP4Tensor``).
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import warnings
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from funcamp import _block_scaling as _blocks
from funcamp import _scope
from funcamp.formats import get_format
from funcamp.policy import keep_in_float32

__all__ = [
    "MODULE_POLICIES",
    "DelayedScalingState",
    "Float8Conv1D",
    "Float8Linear",
    "Fp8EmulationWarning",
    "Fp8FallbackWarning",
    "Recipe",
    "amax_to_scale",
    "auto_filter_small_kn",
    "convert",
    "fp8_linear",
    "get_recipe",
    "init_delayed_state",
    "update_delayed_state",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# Every scale lies in [2**-126, 2**126], so that it and its inverse (what _scaled_mm multiplies by) are finite,
# normal float32 numbers, exact powers of two at the ends: `fp8_max / amax` overflows float32 for amax below
# ~1.3e-36 (e4m3) and is inf for a zero or subnormal amax. torchao floors the amax at 1e-12 instead, which flushes
# a tensor whose amax is below ~1e-17 to zero (448 / 1e-12 times 1e-17 is below e4m3's smallest subnormal).
_SCALE_MIN, _SCALE_MAX = 2.0**-126, 2.0**126
_HIGH = (torch.float32, torch.bfloat16, torch.float16)
_MAX = {dtype: get_format(dtype).max for dtype in (E4M3, E5M2)}  # a plain dict: torch.compile traces it


_ROLES = ("input", "weight")  # the delayed-scaling state of a layer: one per role, buffers named below
#: How a data-parallel step reduces the delayed state over the ranks, so that every rank casts with the scale
#: of the largest amax (TransformerEngine's amax reduction): the fp8 layers' ``buffer_reductions``.
_REDUCTIONS = {
    **{f"fp8_amax_history_{role}": "max" for role in _ROLES},
    **{f"fp8_scale_{role}": "min" for role in _ROLES},
}


class Fp8FallbackWarning(UserWarning):
    """A layer stays in the surrounding dtype: ``torch._scaled_mm`` cannot take its shape."""


class Fp8EmulationWarning(Fp8FallbackWarning):
    """A block-scaled recipe (``mxfp8``, ``nvfp4``) runs its exact float32 emulation: the device has no kernel
    for its block scales (said once per recipe and process)."""


# --- recipes -------------------------------------------------------------------------------------

_BLOCK_SIZES = {"mxfp8": _blocks.MX_BLOCK, "nvfp4": _blocks.NVFP4_BLOCK}
_SCALINGS = ("tensorwise", "rowwise", "delayed", *_BLOCK_SIZES)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How the operands of the fp8 matmuls are scaled (static configuration, hashable).

    Fields left None take the value their scaling implies (shown as resolved once made).

    Attributes:
      scaling: ``"tensorwise"``, ``"rowwise"``, ``"delayed"``, or the block-scaled ``"mxfp8"`` and ``"nvfp4"``
        (see the module docstring).
      fp8_format: ``"HYBRID"`` (e4m3 forward, e5m2 gradients) or ``"E4M3"`` (e4m3 everywhere). None:
        ``"E4M3"`` for ``mxfp8`` (TransformerEngine's ``MXFP8BlockScaling`` and torchao's default) and
        ``nvfp4`` (whose elements are e2m1 everywhere and block scales e4m3: only ``"E4M3"`` is accepted there),
        ``"HYBRID"`` otherwise.
      amax_history_len: past amaxes kept per tensor (``"delayed"`` only; TransformerEngine's default is
        1024, torchao's former delayed recipe used 16, as here).
      margin: scale down by ``2**margin`` more than the amax asks (``"delayed"`` only).
      amax_compute_algo: ``"max"`` (the history's maximum) or ``"most_recent"`` (``"delayed"`` only).
      round_scales_to_power_of_2: round each scale down to a power of two (exact scaling); not for the
        block-scaled recipes (MX scales are powers of two already, NVFP4's are e4m3).
      scale_rounding: ``mxfp8`` only: how a block's e8m0 scale comes from its amax, ``"rceil"`` (the default:
        ``2**ceil(log2(amax / elem_max))``, nothing saturates; the hardware's conversion, torchao's
        ``ScaleCalculationMode.RCEIL`` and TransformerEngine's) or ``"floor"`` (``2**(floor(log2 amax) -
        emax_elem)``, the OCP MX specification's rule and torchao's ``FLOOR``: the largest values of a block
        may saturate).
      wgrad_with_hp: block-scaled recipes only: the weight gradient ``g^T x`` in float32 from the
        high-precision operands (torchao's ``wgrad_with_hp``); the other two matmuls stay block-scaled.
      stochastic_rounding: ``nvfp4`` only (default True there, as TransformerEngine's ``NVFP4BlockScaling``):
        the output gradient's elements are rounded stochastically, drawing from torch's default generator (the
        one dropout draws from), for both backward matmuls.
      weight_2d_blocks: ``nvfp4`` only (default True there, as TransformerEngine): one scale per 16 x 16 tile
        of the weight, so that the forward (blocks along ``in_features``) and the input gradient (along
        ``out_features``) use the same quantized weight; False: 1 x 16 blocks along each matmul's contraction.
      random_hadamard: ``nvfp4`` only (default True there, as TransformerEngine's ``NVFP4BlockScaling``): the
        weight gradient's two operands, ``g^T`` and ``x^T``, are multiplied along their contraction (the tokens),
        each block of 16 by the same orthogonal matrix ``H = hadamard(16) diag(s) / 4`` (``s`` a fixed vector of
        random signs) before they are cast: ``(g^T H)(H^T x) = g^T x``, exact but for rounding, and the casts see
        outliers spread over their block (TransformerEngine's random Hadamard transform). The signs are a
        constant of the recipe (seeded), not a draw: remat and replays see the same ones.
    Raises:
      ValueError: if a field is outside the values above, or set for a scaling it does not apply to.
    """

    scaling: str = "tensorwise"
    fp8_format: str | None = None
    amax_history_len: int = 16
    margin: int = 0
    amax_compute_algo: str = "max"
    round_scales_to_power_of_2: bool = False
    scale_rounding: str | None = None
    wgrad_with_hp: bool = False
    stochastic_rounding: bool | None = None
    weight_2d_blocks: bool | None = None
    random_hadamard: bool | None = None

    def __post_init__(self) -> None:
        if self.scaling not in _SCALINGS:
            raise ValueError(f"Recipe: scaling must be one of {', '.join(map(repr, _SCALINGS))}, got {self.scaling!r}")
        block, nvfp4 = self.scaling in _BLOCK_SIZES, self.scaling == "nvfp4"
        defaults = {
            "fp8_format": "E4M3" if block else "HYBRID",
            "scale_rounding": "rceil" if self.scaling == "mxfp8" else None,
            "stochastic_rounding": nvfp4,
            "weight_2d_blocks": nvfp4,
            "random_hadamard": nvfp4,
        }
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.fp8_format not in ("HYBRID", "E4M3"):
            raise ValueError(f"Recipe: fp8_format must be 'HYBRID' or 'E4M3', got {self.fp8_format!r}")
        if nvfp4 and self.fp8_format != "E4M3":
            raise ValueError(
                "Recipe: nvfp4 has e2m1 elements everywhere and e4m3 block scales: fp8_format must be 'E4M3'"
            )
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"Recipe: amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if not isinstance(self.margin, int) or isinstance(self.margin, bool) or self.margin < 0:
            raise ValueError(f"Recipe: margin must be an int >= 0, got {self.margin!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"Recipe: amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}"
            )
        self._check_block_fields(block, nvfp4)

    def _check_block_fields(self, block: bool, nvfp4: bool) -> None:
        if self.scaling == "mxfp8" and self.scale_rounding not in ("floor", "rceil"):
            raise ValueError(f"Recipe: scale_rounding must be 'floor' or 'rceil', got {self.scale_rounding!r}")
        for name, ok in (
            ("scale_rounding", self.scaling == "mxfp8" or self.scale_rounding is None),
            ("round_scales_to_power_of_2", not block or not self.round_scales_to_power_of_2),
            ("wgrad_with_hp", block or not self.wgrad_with_hp),
            ("stochastic_rounding", nvfp4 or not self.stochastic_rounding),
            ("weight_2d_blocks", nvfp4 or not self.weight_2d_blocks),
            ("random_hadamard", nvfp4 or not self.random_hadamard),
        ):
            if not ok:
                raise ValueError(
                    f"Recipe: {name}={getattr(self, name)!r} does not apply to scaling {self.scaling!r} "
                    "(scale_rounding: mxfp8; wgrad_with_hp: mxfp8 and nvfp4; stochastic_rounding, weight_2d_blocks and "
                    "random_hadamard: nvfp4; round_scales_to_power_of_2: not the block-scaled recipes)"
                )
        for name in (
            "wgrad_with_hp",
            "stochastic_rounding",
            "weight_2d_blocks",
            "random_hadamard",
            "round_scales_to_power_of_2",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Recipe: {name} must be a bool, got {getattr(self, name)!r}")

    @property
    def grad_dtype(self) -> torch.dtype:
        """The format of the gradients: e5m2 for ``HYBRID``, e4m3 for ``E4M3``; ``torch.float4_e2m1fn_x2``
        (fp4, two to a byte) for ``nvfp4``."""
        if self.scaling == "nvfp4":
            return torch.float4_e2m1fn_x2
        return E5M2 if self.fp8_format == "HYBRID" else E4M3

    @property
    def block_size(self) -> int | None:
        """Elements per scale along the contraction dimension: 32 for ``mxfp8``, 16 for ``nvfp4``, else None."""
        return _BLOCK_SIZES.get(self.scaling)


_RECIPES = {
    "tensorwise": Recipe("tensorwise"),
    "rowwise": Recipe("rowwise", fp8_format="E4M3", round_scales_to_power_of_2=True),
    "delayed": Recipe("delayed"),
    "mxfp8": Recipe("mxfp8"),
    "nvfp4": Recipe("nvfp4"),
}


def get_recipe(recipe: Recipe | str) -> Recipe:
    """The :class:`Recipe` for a name: ``"tensorwise"``, ``"rowwise"``, ``"delayed"``, ``"mxfp8"`` or ``"nvfp4"``.

    ``"rowwise"`` is torchao's: e4m3 gradients and power-of-two scales. ``"mxfp8"``: e4m3 elements everywhere,
    32-element blocks, RCEIL e8m0 scales (torchao's ``MXFP8TrainingOpConfig`` and TransformerEngine's
    ``MXFP8BlockScaling``). ``"nvfp4"``: e2m1 elements, 16-element blocks with e4m3 scales and a float32 scale
    per tensor, 16 x 16 weight tiles, stochastic rounding of gradients (TransformerEngine's
    ``NVFP4BlockScaling`` without its random Hadamard transform).

    Raises:
      ValueError: if the name is not one of the five.
      TypeError: if ``recipe`` is neither a Recipe nor a string.
    """
    if isinstance(recipe, Recipe):
        return recipe
    if not isinstance(recipe, str):
        raise TypeError(f"fp8: recipe must be a Recipe or one of {', '.join(_RECIPES)}, got {type(recipe).__name__}")
    if recipe.strip() not in _RECIPES:
        raise ValueError(f"fp8: unknown recipe {recipe!r}; choose one of {', '.join(_RECIPES)} or pass a Recipe")
    return _RECIPES[recipe.strip()]


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, round_scales_to_power_of_2: bool = False) -> torch.Tensor:
    """``fp8_max / amax``, divided in float64, kept within ``[2**-126, 2**126]`` and returned in float32.

    The division is torchao's (float64, then float32), and equal to it bit for bit for every amax from
    1e-12 up. Where ``fp8_max / amax`` is above ``2**126`` (a zero, subnormal or tiny amax: below about
    5.3e-36 for e4m3) the scale is ``2**126``, so that it and its inverse stay finite normal float32
    numbers: a tensor is then cast exactly but for values below ``2**-136`` (e4m3; ``2**-143`` e5m2),
    under float32's normal range, which flush to zero. torchao instead floors the amax at 1e-12, which
    flushes every tensor whose amax is below about 1e-17 to zero.

    Args:
      amax: the largest magnitude (any shape, any floating dtype), >= 0.
      dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
      round_scales_to_power_of_2: round the scale down to a power of two.
    Returns:
      float32 scales of ``amax``'s shape, in ``[2**-126, 2**126]``; an inf amax gives ``2**-126`` and a
      NaN amax NaN (the casts turn both into a NaN scale, see the module docstring).
    """
    scale = (_MAX[dtype] / amax.to(torch.float64)).clamp(_SCALE_MIN, _SCALE_MAX).to(torch.float32)
    return _pow2(scale) if round_scales_to_power_of_2 else scale


def _pow2(scale: torch.Tensor) -> torch.Tensor:
    """The power of two at or below ``scale`` (torchao's rounding); stays in ``[2**-126, 2**126]``."""
    return torch.exp2(torch.floor(torch.log2(scale)))


def _delayed_scale(amax: torch.Tensor, recipe: Recipe, dtype: torch.dtype) -> torch.Tensor:
    """``fp8_max / amax / 2**margin`` in float32 (TransformerEngine's ``_default_sf_compute``), kept within
    ``[2**-126, 2**126]`` as :func:`amax_to_scale` (in float32 a subnormal amax gives inf), then rounded
    down to a power of two if the recipe asks. A zero amax gives ``2**126``. The division is a true one,
    correctly rounded (``float / tensor`` would multiply by a rounded reciprocal: one more rounding)."""
    amax = amax.to(torch.float32)
    scale = (torch.full_like(amax, _MAX[dtype]) / amax / 2.0**recipe.margin).clamp(_SCALE_MIN, _SCALE_MAX)
    return _pow2(scale) if recipe.round_scales_to_power_of_2 else scale


def _holds_amax(history: torch.Tensor) -> torch.Tensor:
    """0-d bool: ``history`` holds a finite amax above 0 (a fresh history holds zeros only)."""
    return ((history > 0) & torch.isfinite(history)).any()


class DelayedScalingState(NamedTuple):
    """The delayed-scaling state of one tensor (an immutable pytree, as optax states).

    Attributes:
      amax_history: ``(amax_history_len,)`` float32, newest first; zeros before the first step.
      scale: ``()`` float32, the multiplier of the next cast to fp8, in ``[2**-126, 2**126]`` (1 before
        any amax was seen; a layer whose history holds no amax above 0 casts with its current amax instead).
    """

    amax_history: torch.Tensor
    scale: torch.Tensor


def init_delayed_state(
    recipe: Recipe | str = "delayed", device: torch.device | str | None = None
) -> DelayedScalingState:
    """A fresh state: a zero history and scale 1 (TransformerEngine's start).

    Unlike TransformerEngine, an fp8 layer does not cast with that scale 1: while its history holds no
    amax above 0 it scales from the current amax (see :class:`Float8Linear`).
    """
    r = get_recipe(recipe)
    return DelayedScalingState(
        torch.zeros(r.amax_history_len, dtype=torch.float32, device=device),
        torch.ones((), dtype=torch.float32, device=device),
    )


def update_delayed_state(
    state: DelayedScalingState, amax: torch.Tensor, recipe: Recipe | str = "delayed", dtype: torch.dtype = E4M3
) -> DelayedScalingState:
    """Record a new amax and compute the next scale (pure; traceable, no host sync).

    The history rolls by one and ``amax`` enters at index 0; the scale becomes
    ``fp8_max / (a * 2**margin)`` with ``a`` the history's maximum (``amax_compute_algo="max"``) or
    ``amax`` itself (``"most_recent"``), in float32 (TransformerEngine's ``_default_sf_compute``), kept
    within ``[2**-126, 2**126]`` (a subnormal or tiny ``a`` would give inf, as in TransformerEngine).
    Where ``a`` is 0 the scale stays as it was. A non-finite ``amax`` (inf, NaN) changes nothing: the old
    state is returned, so one overflow cannot poison the history (TransformerEngine lets it in and
    keeps only the scale).

    Args:
      state: the current state.
      amax: 0-d, the largest magnitude of the tensor just cast (any floating dtype).
      recipe: a delayed :class:`Recipe` (its ``margin`` and ``amax_compute_algo``).
      dtype: the fp8 format the scale is for.
    Returns:
      The new :class:`DelayedScalingState` (new tensors; ``state`` is not changed).

    Example:
      >>> recipe = Recipe("delayed", amax_history_len=2)
      >>> state = update_delayed_state(init_delayed_state(recipe), torch.tensor(2.0), recipe)
      >>> state.amax_history, state.scale
      (tensor([2., 0.]), tensor(224.))
      >>> update_delayed_state(state, torch.tensor(float("inf")), recipe).scale  # kept
      tensor(224.)
    """
    r = get_recipe(recipe)
    amax = amax.detach().to(torch.float32)
    finite = torch.isfinite(amax)
    history = torch.cat([amax.reshape(1), state.amax_history[:-1]])
    a = history.max() if r.amax_compute_algo == "max" else amax
    scale = torch.where(a > 0, _delayed_scale(a, r, dtype), state.scale)
    return DelayedScalingState(
        torch.where(finite, history, state.amax_history), torch.where(finite, scale, state.scale)
    )


# --- the fp8 matmuls -------------------------------------------------------------------------------


def _amax(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    a = t.detach().abs()
    return a.amax() if dim is None else a.amax(dim=dim, keepdim=True)


def _cast(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 tensor, inverse scale)``: ``t * scale`` in float32, saturated and cast to ``dtype`` (torchao's
    ``to_fp8_saturated``); the inverse scale is ``1 / scale`` in float32, what ``torch._scaled_mm`` takes."""
    top = _MAX[dtype]
    scaled = (t.detach().to(torch.float32) * scale).clamp(-top, top)
    # Row-major whatever ``t``'s layout (Conv1D's transposed weight): _scaled_mm would copy it again.
    return scaled.to(dtype, memory_format=torch.contiguous_format), scale.reciprocal()


def _dynamic(t: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast with the current amax: over the whole tensor (``dim=None``) or reduced along ``dim``.

    Saturation would turn an inf into ``fp8_max``: where the amax is not finite the scale is NaN, so the
    product (hence the loss or the gradient) is NaN and the step is skipped, never silently wrong.
    """
    amax = _amax(t, dim)
    return _cast(t, _poison(amax_to_scale(amax, dtype, pow2), amax), dtype)


def _poison(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(amax), scale, torch.nan)


def _scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype, fast: bool
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` in ``out_dtype`` by ``torch._scaled_mm``, rounded once to ``out_dtype``.

    ``a`` is made row-major and ``b`` column-major (CUDA's rule); ``scale_*`` are the inverse scales, 0-d,
    or ``(M, 1)`` and ``(1, N)`` (rowwise). A rowwise product runs CUDA's rowwise kernel only where it
    serves, with fast accumulation into a bfloat16 output; otherwise (without fast accumulation, where
    CUDA's rowwise kernel is slow, or for a float32 or float16 output, which it cannot make,
    pytorch#156771) it runs the per-tensor kernel with unit scales into float32 and multiplies by
    ``scale_a`` and then ``scale_b`` in float32 (exact for the powers of two of torchao's rowwise
    recipe), before the one rounding to ``out_dtype``. torchao (``addmm_float8_unwrapped``) makes the
    float32 and float16 outputs in bfloat16 and scales the bfloat16 product: 2**-9 relative off a
    float32 result, where this is within the float32 accumulation bound.
    """
    if scale_a.ndim == 2 and not (fast and out_dtype == torch.bfloat16):
        one = scale_a.new_ones(())
        out = torch._scaled_mm(
            a.contiguous(),
            b.t().contiguous().t(),
            scale_a=one,
            scale_b=one,
            out_dtype=torch.float32,
            use_fast_accum=fast,
        )
        return (out * scale_a * scale_b).to(out_dtype)
    out = torch._scaled_mm(
        a.contiguous(),
        b.t().contiguous().t(),
        scale_a=scale_a.contiguous(),
        scale_b=scale_b.contiguous(),
        out_dtype=out_dtype,
        use_fast_accum=fast,
    )
    return out


def _pad_rows(t: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """Zero rows up to a multiple of 16: ``grad_weight`` contracts the token dimension, and CUDA's
    ``_scaled_mm`` needs contracted sizes divisible by 16. Zero rows change no amax and no sum."""
    extra = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, extra)) if extra else t


def _forward_casts(
    x: torch.Tensor, w: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None, recipe: Recipe
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The e4m3 casts of ``x`` (M, K) and ``w`` (N, K) with their inverse scales, tensorwise or per row."""
    if scales is not None:  # delayed: the given (already poisoned) multipliers
        return _cast(x, scales[0], E4M3), _cast(w, scales[1], E4M3)
    dim = -1 if recipe.scaling == "rowwise" else None  # rowwise: per row of x, per output feature of w
    pow2 = recipe.round_scales_to_power_of_2
    return _dynamic(x, E4M3, dim, pow2), _dynamic(w, E4M3, dim, pow2)


@torch._dynamo.allow_in_graph
class _Fp8Matmul(torch.autograd.Function):
    """``y = x @ w.T`` with all three matmuls in fp8; ``x`` (M, K), ``w`` (N, K), ``y`` (M, N).

    ``x_scale`` and ``w_scale``: the delayed recipe's float32 multipliers, else None. The per-tensor
    recipes keep the fp8 casts of ``x`` and ``w`` for the backward (1 byte per element; torchao keeps
    the high-precision tensors and casts them again, to the same values); rowwise casts the
    high-precision ones again along the other dimension. The forward returns those casts as extra,
    non-differentiable outputs (``setup_context`` sees no intermediate values). ``vmap`` comes from
    ``generate_vmap_rule``: the forward and backward run per sample, scales included.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: torch.Tensor,
        w: torch.Tensor,
        x_scale: torch.Tensor | None,
        w_scale: torch.Tensor | None,
        recipe: Recipe,
        out_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, ...]:
        scales = None if x_scale is None or w_scale is None else (x_scale, w_scale)
        (x8, sx), (w8, sw) = _forward_casts(x, w, scales, recipe)
        if recipe.scaling == "rowwise":  # (N, 1) -> (1, N): one scale per column of w.T, unit strides
            return (_scaled_mm(x8, w8.t(), sx, sw.flatten().unsqueeze(0), out_dtype, fast=True),)
        return _scaled_mm(x8, w8.t(), sx, sw, out_dtype, fast=True), x8, w8, sx, sw

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], outputs: tuple[torch.Tensor, ...]) -> None:
        x, w, _, _, recipe, _ = inputs
        ctx.recipe, ctx.dtypes = recipe, (x.dtype, w.dtype)
        ctx.set_materialize_grads(False)  # the fp8 outputs get no gradient: no zero tensors of their size
        if recipe.scaling == "rowwise":
            ctx.save_for_backward(x, w)
        else:
            ctx.mark_non_differentiable(*outputs[1:])
            ctx.save_for_backward(*outputs[1:])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, *unused: Any) -> tuple[torch.Tensor | None, ...]:
        recipe: Recipe = ctx.recipe
        x_dtype, w_dtype = ctx.dtypes
        gd, pow2, m = recipe.grad_dtype, recipe.round_scales_to_power_of_2, g.shape[0]
        grad_x = grad_w = None
        if recipe.scaling == "rowwise":  # each operand scaled along the dimension its matmul contracts
            x, w = ctx.saved_tensors
            if ctx.needs_input_grad[0]:  # g (M, N) per row, w (N, K) per column
                (g8, sg), (w8, sw) = _dynamic(g, gd, -1, pow2), _dynamic(w, E4M3, 0, pow2)
                grad_x = _scaled_mm(g8, w8, sg, sw, x_dtype, fast=False)
            if ctx.needs_input_grad[1]:  # g.T (N, M) per row, x (M, K) per column
                (g8, sg), (x8, sx) = _dynamic(_pad_rows(g), gd, 0, pow2), _dynamic(_pad_rows(x), E4M3, 0, pow2)
                grad_w = _scaled_mm(g8.t(), x8, sg.flatten().unsqueeze(1), sx, w_dtype, fast=False)
            return grad_x, grad_w, None, None, None, None
        x8, w8, sx, sw = ctx.saved_tensors
        g8, sg = _dynamic(_pad_rows(g), gd, None, pow2)  # gradients: current scaling in every per-tensor recipe
        if ctx.needs_input_grad[0]:
            grad_x = _scaled_mm(g8[:m], w8, sg, sw, x_dtype, fast=False)
        if ctx.needs_input_grad[1]:
            x8 = _pad_rows(x8.view(torch.uint8)).view(x8.dtype)  # F.pad has no float8 kernel; zeros are zeros
            grad_w = _scaled_mm(g8.t(), x8, sg, sx, w_dtype, fast=False)
        return grad_x, grad_w, None, None, None, None


# --- the block-scaled matmuls (mxfp8, nvfp4) ---------------------------------------------------------

_announced: set[str] = set()  # the recipes whose emulation was announced (once per process)


def _announce_emulation(recipe: Recipe, device: torch.device) -> None:
    """Say once per recipe and process that ``recipe`` runs its float32 emulation on ``device``. Not while
    compiling (it runs at ``convert`` and at the first eager call)."""
    if _scope.compiling() or recipe.scaling in _announced:  # traced: constant True, the set unread
        return
    _announced.add(recipe.scaling)
    if recipe.scaling == "nvfp4":
        why = "funcamp routes no NVFP4 matmul to a kernel yet"
    elif recipe.fp8_format != "E4M3":
        why = "MX kernels take e4m3 elements only, and this recipe's gradients are e5m2"
    else:
        why = "torch._scaled_mm takes MX block scales only on CUDA devices of compute capability 10.0 and up"
    warnings.warn(
        f"fp8: the {recipe.scaling} recipe runs its exact float32 emulation on {device} ({why}): the numbers of "
        "the block-scaled matmuls, not their speed",
        Fp8EmulationWarning,
        stacklevel=3,
    )


def _block_values(t: torch.Tensor, recipe: Recipe, role: str) -> torch.Tensor:
    """The float32 values the block cast of ``t`` ``(R, C)`` (blocks along C) stands for, by role: ``"input"``,
    ``"weight"`` (nvfp4: 16 x 16 tiles with ``weight_2d_blocks``), ``"grad"`` (e5m2 elements for a ``HYBRID``
    mxfp8 recipe; nvfp4: stochastic rounding with ``stochastic_rounding``, from the default generator)."""
    t = t.detach()
    if recipe.scaling == "mxfp8":
        elem = "e5m2" if role == "grad" and recipe.fp8_format == "HYBRID" else "e4m3"
        return _blocks.mx_values(t, elem, recipe.scale_rounding)
    noise = None
    if role == "grad" and recipe.stochastic_rounding:
        noise = torch.rand(t.shape, dtype=torch.float32, device=t.device)
    tile = role == "weight" and recipe.weight_2d_blocks
    return _blocks.nvfp4_values(t, _blocks.nvfp4_tensor_scale(t), tile=tile, noise=noise)


def _block_mm(
    a: torch.Tensor, b: torch.Tensor, recipe: Recipe, roles: tuple[str, str], out_dtype: torch.dtype
) -> torch.Tensor:
    """``a @ b.T`` with ``a`` ``(M, K)`` and ``b`` ``(N, K)`` block-cast along K, rounded once to ``out_dtype``:
    the kernel where the device has one (mxfp8, e4m3, compute capability 10.0 and up; UNTESTED here), else the
    float32 product of the cast values."""
    if _blocks.kernel_available(a.device, recipe):
        return _blocks.mx_kernel_mm(a, b, recipe.scale_rounding, out_dtype)
    return (_block_values(a, recipe, roles[0]) @ _block_values(b, recipe, roles[1]).t()).to(out_dtype)


@torch._dynamo.allow_in_graph
class _BlockMatmul(torch.autograd.Function):
    """``y = x @ w.T`` with its three matmuls block-scaled (mxfp8, nvfp4); ``x`` (M, K), ``w`` (N, K).

    Every operand is cast along the contraction dimension of its matmul: ``x`` and ``w`` along K for ``y``;
    ``g`` along N and ``w`` along N (its transpose's rows) for ``grad_input``; ``g`` and ``x`` along M (their
    transposes' rows, M zero-padded to a whole block) for ``grad_weight``, or that one in float32 from the
    high-precision operands (``wgrad_with_hp``). The high-precision ``x`` and ``w`` are saved and cast again in
    the backward (as torchao's MX linear does); nvfp4's tiled weight casts to the same values both ways.
    ``vmap`` comes from ``generate_vmap_rule``: each sample is cast with its own blocks (stochastic rounding
    under vmap needs ``randomness="different"`` or ``"same"``).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, recipe: Recipe, out_dtype: torch.dtype) -> torch.Tensor:
        return _block_mm(x, w, recipe, ("input", "weight"), out_dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, w, recipe, _ = inputs
        ctx.recipe, ctx.dtypes = recipe, (x.dtype, w.dtype)
        ctx.save_for_backward(x, w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        recipe: Recipe = ctx.recipe
        x, w = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # g (M, N) along N; w.T (K, N) along N
            if recipe.scaling == "nvfp4" and recipe.weight_2d_blocks:  # the forward's tiles: the same values
                grad_x = (_block_values(g, recipe, "grad") @ _block_values(w, recipe, "weight")).to(x_dtype)
            else:
                grad_x = _block_mm(g, w.t().contiguous(), recipe, ("grad", "weight"), x_dtype)
        if ctx.needs_input_grad[1]:  # g.T (N, M) along M; x.T (K, M) along M
            if recipe.wgrad_with_hp:
                grad_w = (g.t().to(torch.float32) @ x.to(torch.float32)).to(w_dtype)
            else:
                block = recipe.block_size
                gt = _blocks.pad_rows(g, block).t().contiguous()
                xt = _blocks.pad_rows(x, block).t().contiguous()
                if recipe.random_hadamard:  # (g^T H)(x^T H)^T = g^T x: each block of 16 tokens rotated alike
                    gt, xt = _blocks.hadamard_rows(gt), _blocks.hadamard_rows(xt)
                grad_w = _block_mm(gt, xt, recipe, ("grad", "input"), w_dtype)
        return grad_x, grad_w, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    recipe: Recipe | str = "tensorwise",
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``F.linear`` with its three matmuls in fp8 (``y = x W^T + b``), differentiable.

    Args:
      x: ``(..., K)`` float32, bfloat16 or float16.
      weight: ``(N, K)``, any of those dtypes; ``K`` and ``N`` multiples of 16 on CUDA, and of the block
        size for ``mxfp8`` (32) and ``nvfp4`` (16) on every device. The rows of ``x`` (``M``, contracted by
        the weight gradient) may be any number: a block recipe pads them with zeros to a whole block there
        (zeros change no block's scale), where torchao refuses.
      bias: ``(N,)`` or None; added in the output dtype after the fp8 matmul, as torchao.
      recipe: a :class:`Recipe` or its name.
      scales: for the delayed recipe, the float32 0-d multipliers of ``x`` and ``weight``, finite and in
        ``[2**-126, 2**126]`` as the layer's state holds them (so that their inverses are exact normal
        float32 numbers; not checked, which would need a host sync).
    Returns:
      ``(..., N)`` in ``x``'s dtype (the autocast dtype under ``torch.autocast``); the gradients of ``x``
      and ``weight`` come back in their own dtypes. Each of the three products equals the exact
      product of the fp8 operands within the float32 accumulation bound and one rounding to its dtype.
      The block recipes' emulation (every device but CUDA compute capability 10.0 and up with ``mxfp8``;
      said once by an :class:`Fp8EmulationWarning`) multiplies the cast values in float32.
    Raises:
      TypeError: if ``x`` or ``weight`` is not float32, bfloat16 or float16.
      ValueError: if the last dimension of ``x`` is not ``weight``'s second, or ``scales`` is given for
        a dynamic recipe or missing for the delayed one.
      ValueError: for ``mxfp8`` and ``nvfp4``, if ``K`` or ``N`` is not a multiple of the block size.
    """
    r = get_recipe(recipe)
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in _HIGH:
            raise TypeError(
                f"fp8_linear: {name} must be float32, bfloat16 or float16 (cast to fp8 inside), got {t.dtype}"
            )
    if weight.ndim != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit x @ weight.T")
    if (scales is None) != (r.scaling != "delayed"):
        raise ValueError(f"fp8_linear: scales are required by the delayed recipe and only by it (recipe {r.scaling!r})")
    out_dtype = x.dtype
    device_type = x.device.type  # autocast knows no meta device (funcamp.capture's stand-in)
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        out_dtype = torch.get_autocast_dtype(device_type)
    x2 = x.reshape(-1, x.shape[-1])
    if r.block_size is not None:
        problem = _check_fp8_shape(weight.shape[1], weight.shape[0], r)
        if problem:
            raise ValueError(f"fp8_linear: {problem}")
        if not _blocks.kernel_available(x.device, r):
            _announce_emulation(r, x.device)
        y = _BlockMatmul.apply(x2, weight, r, out_dtype)
        y = y.reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias.to(y.dtype)
    sx, sw = scales if scales is not None else (None, None)
    y = _Fp8Matmul.apply(x2, weight, sx, sw, r, out_dtype)[0]
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


# --- the module swap ------------------------------------------------------------------------------


def _check_fp8_shape(in_features: int, out_features: int, recipe: Recipe | None = None) -> str | None:
    block = recipe.block_size if recipe is not None else None
    if block is not None and (in_features % block or out_features % block):
        return (
            f"in_features={in_features} and out_features={out_features} must both be multiples of {block}, the "
            f"{recipe.scaling} block size (the forward contracts in_features, the input gradient out_features)"
        )
    if in_features % 16 or out_features % 16:
        return (
            f"in_features={in_features} and out_features={out_features} must both be multiples of 16 "
            "(torch._scaled_mm's rule on CUDA)"
        )
    return None


def _block_copy_bytes(recipe: Recipe, elements: int, with_input: bool) -> dict[torch.dtype, int]:
    """The bytes of the block-scaled copies of ``elements`` values (weight, and input with ``with_input``)."""
    if recipe.scaling == "mxfp8":
        return {E4M3: elements, torch.float8_e8m0fnu: elements // _blocks.MX_BLOCK}
    tensors = 2 if with_input else 1
    return {
        torch.float4_e2m1fn_x2: elements // 2,
        E4M3: elements // _blocks.NVFP4_BLOCK,
        torch.float32: 4 * tensors,
    }


class _Float8Layer(nn.Module):
    """What the fp8 layers share: the recipe, the delayed state in buffers, the fp8 forward.

    ``buffer_reductions`` (class attribute) says how a data-parallel step reduces the delayed state over the
    ranks: amax histories by their maximum, scales by their minimum; ``funcamp.nn.functionalize`` reads it
    into ``apply_fn.buffer_reductions``.
    """

    recipe: Recipe
    name: str
    buffer_reductions: Mapping[str, str] = MappingProxyType(_REDUCTIONS)

    def _init_fp8(self, recipe: Recipe | str, name: str, device: Any) -> None:
        self.recipe = get_recipe(recipe)
        self.name = name
        if self.recipe.scaling == "delayed":
            for role in _ROLES:
                history, scale = init_delayed_state(self.recipe, device)
                self.register_buffer(f"fp8_amax_history_{role}", history)
                self.register_buffer(f"fp8_scale_{role}", scale)

    def _sizes(self) -> tuple[int, int]:
        """``(K, N)``: the contracted and the output size of the layer's matmul."""
        raise NotImplementedError

    @property
    def keeps_fp8_copies(self) -> bool:
        """Whether a call keeps its fp8 copies until the backward: True for the per-tensor recipes
        (``tensorwise``, ``delayed``), False for ``rowwise``, which keeps the high-precision input and
        weight instead and casts them again along the other dimension in the backward, and so do the
        block-scaled recipes (``mxfp8``, ``nvfp4``), as torchao's MX linear."""
        return self.recipe.scaling not in ("rowwise", *_BLOCK_SIZES)

    def fp8_copy_bytes(self, tokens: int | None = None) -> dict[torch.dtype, int]:
        """Bytes of the fp8 copies one call of the layer makes in its forward, by dtype.

        The float8_e4m3fn weight ``(N, K)`` and its float32 inverse scale (one; ``N`` for rowwise);
        with ``tokens`` (``M``, the rows of the input: batch times sequence) also the float8_e4m3fn
        input ``(M, K)`` and its inverse scale (one; ``M`` for rowwise). These are the forward's only
        fp8 tensors (each cast is one allocation, made row-major, which ``torch._scaled_mm`` takes as
        it is). Not counted: the float32 temporaries of a cast in eager mode (``t * scale``, clamped;
        torch.compile fuses them away), the output, and the backward's own casts of the gradient and
        transposed copies, which live for one layer's backward at a time.

        Args:
          tokens: the number of rows of the input, or None to count the weight's copy only.
        Returns:
          ``{torch.float8_e4m3fn: bytes, torch.float32: bytes}``. The block-scaled recipes' copies as their
          kernels hold them: ``mxfp8`` ``{torch.float8_e4m3fn: elements, torch.float8_e8m0fnu: elements / 32}``;
          ``nvfp4`` ``{torch.float4_e2m1fn_x2: elements / 2, torch.float8_e4m3fn: elements / 16,
          torch.float32: 4 per tensor}`` (the emulation makes float32 values instead).
        Raises:
          ValueError: if ``tokens`` is not None or an int >= 1.
        """
        if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1):
            raise ValueError(f"fp8_copy_bytes: tokens must be None or an int >= 1 (batch x sequence), got {tokens!r}")
        k, n = self._sizes()
        if self.recipe.block_size is not None:
            return _block_copy_bytes(self.recipe, n * k + (tokens or 0) * k, tokens is not None)
        rowwise = self.recipe.scaling == "rowwise"
        fp8, scales = n * k, (n if rowwise else 1)
        if tokens is not None:
            fp8, scales = fp8 + tokens * k, scales + (tokens if rowwise else 1)
        return {E4M3: fp8, torch.float32: 4 * scales}

    def delayed_state(self, role: str) -> DelayedScalingState:
        """The current :class:`DelayedScalingState` of ``"input"`` or ``"weight"`` (delayed recipe only)."""
        return DelayedScalingState(getattr(self, f"fp8_amax_history_{role}"), getattr(self, f"fp8_scale_{role}"))

    def _check_state(self) -> None:
        for role in _ROLES:
            history, scale = self.delayed_state(role)
            if history.dtype != torch.float32 or scale.dtype != torch.float32:
                raise ValueError(
                    f"{type(self).__name__} {self.name!r}: the delayed-scaling state must be float32, got "
                    f"fp8_amax_history_{role} {history.dtype} and fp8_scale_{role} {scale.dtype}; functionalize "
                    "the model with module_policies=funcamp.fp8.MODULE_POLICIES (a bfloat16 policy would round "
                    "the amaxes), and do not call .to(bfloat16) on the module"
                )
            if history.shape != (self.recipe.amax_history_len,) or scale.shape != ():
                raise ValueError(
                    f"{type(self).__name__} {self.name!r}: fp8_amax_history_{role} has shape "
                    f"{tuple(history.shape)} and fp8_scale_{role} {tuple(scale.shape)}; the recipe needs "
                    f"({self.recipe.amax_history_len},) and (): the state comes from another model or recipe"
                )

    def _fp8(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``fp8_linear(x, weight, bias)``, ``weight`` ``(out, in)``; delayed: cast with the stored scales
        (with the current amax's while the history holds no amax), then reassign the buffers to the updated
        state (new tensors, never written in place)."""
        if self.recipe.scaling != "delayed":
            return fp8_linear(x, weight, bias, self.recipe)
        self._check_state()
        scales = []
        for role, t in (("input", x), ("weight", weight)):
            state = self.delayed_state(role)
            amax = _amax(t, None)
            # The stored scale once the history holds an amax; before (the first call, or only zero inputs so
            # far) the scale update_delayed_state gives for the current amax: scale 1 would saturate every value
            # above 448 and flush those below 2**-10. A select, not a branch: one graph for both.
            scale = torch.where(_holds_amax(state.amax_history), state.scale, _delayed_scale(amax, self.recipe, E4M3))
            scales.append(_poison(scale, amax))
            new = update_delayed_state(state, amax, self.recipe, E4M3)
            # Reassigned, not written in place: functional_call hands the new tensors out, and under vmap they
            # are per sample (an in-place write of a batched value into an unbatched buffer is refused).
            setattr(self, f"fp8_amax_history_{role}", new.amax_history)
            setattr(self, f"fp8_scale_{role}", new.scale)
        return fp8_linear(x, weight, bias, self.recipe, scales=(scales[0], scales[1]))


class Float8Linear(nn.Linear, _Float8Layer):
    """An ``nn.Linear`` whose three matmuls run in fp8 (:func:`fp8_linear`), as torchao's ``Float8Linear``.

    Parameters are those of ``nn.Linear`` (``weight`` ``(out_features, in_features)``, ``bias``) in
    their own dtype; they are cast to fp8 at every call, never stored in fp8. With the delayed recipe
    the layer has four persistent float32 buffers, the :class:`DelayedScalingState` of its input and
    of its weight: ``fp8_amax_history_input`` and ``fp8_amax_history_weight``
    ``(amax_history_len,)``, ``fp8_scale_input`` and ``fp8_scale_weight`` ``()``. Each call casts with
    the stored scales and then reassigns the four buffers to the updated state (new tensors; the old
    ones are not written, unlike BatchNorm's running statistics, so ``torch.func.vmap`` works):
    :func:`funcamp.nn.functionalize` hands them out as ``new_buffers``, and a skipped step keeps the
    old ones. While a history holds no amax above 0 (the first call, or only all-zero tensors so far)
    that tensor is cast with the scale of its current amax (``fp8_max / (amax * 2**margin)``, as
    :func:`update_delayed_state` computes it), within the tensorwise recipe's error; TransformerEngine casts with the
    initial scale 1 there, which saturates values above 448 and flushes those below ``2**-10``. The
    choice is a ``torch.where``, so the first and later calls are one compiled graph. A layer called
    several times in one forward (shared, or in a block applied twice) advances its state at each
    call; under ``functionalize(..., remat=...)`` the recompute of each call casts with the scales that
    call used (:mod:`funcamp.nn._remat`), as TransformerEngine's activation recompute does.

    Unlike torchao, the input is cast from the dtype it arrives in; under
    ``functionalize(..., module_policies=MODULE_POLICIES)`` that is float32, so the weight is cast
    from its float32 master once (no bfloat16 step in between).

    Raises:
      ValueError: at construction, if ``in_features`` or ``out_features`` is not a multiple of 16 (of 32
        for ``mxfp8``).
      ValueError: at call time (delayed), if the buffers are not float32 or not of the recipe's
        history length (a recipe state from another model or recipe), naming the layer.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: Recipe | str = "tensorwise",
        name: str = "",
    ) -> None:
        problem = _check_fp8_shape(in_features, out_features, get_recipe(recipe))
        if problem:
            raise ValueError(f"Float8Linear {name!r}: {problem}; fp8.convert leaves such layers as they are")
        super().__init__(in_features, out_features, bias, device, dtype)
        self._init_fp8(recipe, name, device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe | str = "tensorwise", name: str = "") -> Float8Linear:
        """A Float8Linear holding ``linear``'s own parameter objects (shared, so weight tying survives).

        Raises:
          ValueError: if the shape is not a multiple of 16 (see the class).
        """
        has_bias = linear.bias is not None
        new = cls(linear.in_features, linear.out_features, has_bias, device="meta", recipe=recipe, name=name)
        new.weight, new.bias = linear.weight, linear.bias
        new.train(linear.training)
        new._init_fp8(recipe, name, linear.weight.device)  # real state buffers, on the weight's device
        return new

    def _sizes(self) -> tuple[int, int]:
        return self.in_features, self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fp8(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.scaling}"


class Float8Conv1D(_Float8Layer):
    """Hugging Face's ``Conv1D`` (GPT-2's linear layer, ``y = x @ weight + bias``, ``weight`` ``(nx, nf)``)
    with its three matmuls in fp8; the same recipes, state buffers and rules as :class:`Float8Linear`.

    Made by :func:`convert` from a ``transformers.pytorch_utils.Conv1D``, sharing its parameters (names
    and shapes unchanged, so checkpoints and ``functionalize``'s names stay valid).

    Raises:
      ValueError: if ``nx`` or ``nf`` is not a multiple of 16 (of 32 for ``mxfp8``).
    """

    def __init__(self, conv: nn.Module, recipe: Recipe | str = "tensorwise", name: str = "") -> None:
        problem = _check_fp8_shape(conv.nx, conv.nf, get_recipe(recipe))
        if problem:
            raise ValueError(f"Float8Conv1D {name!r}: {problem}; fp8.convert leaves such layers as they are")
        super().__init__()
        self.nf, self.nx = conv.nf, conv.nx
        self.weight, self.bias = conv.weight, conv.bias
        self.train(conv.training)
        self._init_fp8(recipe, name, conv.weight.device)

    def _sizes(self) -> tuple[int, int]:
        return self.nx, self.nf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fp8(x, self.weight.t(), self.bias)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, recipe={self.recipe.scaling}"


def _is_hf_conv1d(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers") and hasattr(module, "nf")


#: ``module_policies`` for :func:`funcamp.nn.functionalize`: fp8 layers receive float32 weights, inputs
#: and recipe state (cast to fp8 inside), and return the surrounding compute dtype
#: (:func:`funcamp.nn.keep_in_float32`). Merge with your own: ``{**fp8.MODULE_POLICIES, **yours}``.
MODULE_POLICIES: Mapping[type, Any] = MappingProxyType({Float8Linear: keep_in_float32, Float8Conv1D: keep_in_float32})

#: A value of ``filter`` in :func:`convert`.
Filter = Callable[[nn.Module, str], bool] | str | Iterable[str] | None


def _selector(filter: Filter, linears: list[str]) -> Callable[[nn.Module, str], bool]:
    if filter is None:  # the field's default: first and last layers stay in high precision
        keep = set(linears[1:-1])
        return lambda module, name: name in keep
    if callable(filter):
        return filter
    patterns = [filter] if isinstance(filter, str) else filter
    if isinstance(patterns, Iterable) and not isinstance(patterns, (bytes, Mapping)):
        patterns = list(patterns)
        if patterns and all(isinstance(p, str) for p in patterns):
            return lambda module, name: any(fnmatch.fnmatchcase(name, p) for p in patterns)
    raise TypeError(
        "fp8.convert: filter must be None (every Linear but the first and the last), a predicate "
        f"(module, name) -> bool (torchao's module_filter_fn), or fnmatch name patterns; got {filter!r}"
    )


def _gemm_sizes(module: nn.Module) -> tuple[int, int] | None:
    """``(K, N)`` of a candidate layer: ``nn.Linear`` ``(in_features, out_features)``, Conv1D ``(nx, nf)``."""
    if type(module) is nn.Linear:
        return module.in_features, module.out_features
    if _is_hf_conv1d(module):
        return module.nx, module.nf
    return None


def _small_kn(scaling: str, k: int, n: int) -> bool:
    if scaling in ("tensorwise", "delayed"):
        return k <= 4096 and n <= 1024
    if scaling == "rowwise":
        return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)
    return k <= 1024 and n <= 1024


def auto_filter_small_kn(
    recipe: Recipe | str = "tensorwise", exclude: Iterable[str] = ()
) -> Callable[[nn.Module, str], bool]:
    """A ``filter`` for :func:`convert` that skips the layers too small to gain from low precision.

    torchtitan's ``filter_fqns=["auto_filter_small_kn"]`` (torchao's ``_auto_filter_for_recipe``): a layer
    ``y = x W^T`` with ``K`` inputs and ``N`` outputs is converted unless its name contains one of ``exclude``,
    a size is not a multiple of 16 (of the block size for ``mxfp8``, ``nvfp4``), or its GEMM is small:

    - ``tensorwise``, ``delayed``: ``K <= 4096 and N <= 1024``;
    - ``rowwise``: ``N <= 2048``, or ``K <= 1024``, or ``N <= 4096 and K <= 2048``;
    - ``mxfp8``, ``nvfp4``: ``K <= 1024 and N <= 1024``.

    The first two are torchao's thresholds, measured on H100 for the training step; the last is torchao
    0.18's rule for NVFP4 (``_auto_filter_for_nfp4``), taken for MXFP8 too, for which torchao publishes none:
    re-measure on your device. Unlike :func:`convert`'s default, this filter does not keep the first and last
    layers by position: name them in ``exclude`` (``["lm_head"]``) if they should stay.

    Args:
      recipe: the recipe the layers will run (its thresholds and block size).
      exclude: substrings of qualified layer names never converted (torchao's ``filter_fqns``).
    Returns:
      A predicate ``(module, qualified_name) -> bool``.
    Raises:
      ValueError: if the recipe is unknown.
      TypeError: if ``exclude`` is a string or holds a non-string (a list of strings is expected).

    Example:
      >>> model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 64), nn.Linear(64, 64))
      >>> keep = auto_filter_small_kn("mxfp8")  # small: K <= 1024 and N <= 1024
      >>> [keep(m, name) for name, m in model.named_children()]
      [True, True, False]
    """
    r = get_recipe(recipe)
    names = () if isinstance(exclude, str) else tuple(exclude)
    if isinstance(exclude, str) or not all(isinstance(e, str) for e in names):
        raise TypeError(f"auto_filter_small_kn: exclude must be a list of name substrings, got {exclude!r}")

    def keep(module: nn.Module, name: str) -> bool:
        sizes = _gemm_sizes(module)
        if sizes is None or any(e in name for e in names) or _check_fp8_shape(*sizes, r):
            return False
        return not _small_kn(r.scaling, *sizes)

    return keep


def _grouped_weights(model: nn.Module) -> list[str]:
    """The 3-D floating parameters outside convolutions: the experts of mixture-of-experts layers, used
    through a grouped (batched) matmul, which :func:`convert` does not convert."""
    found = []
    for module_name, module in model.named_modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.ndim == 3 and p.is_floating_point():
                shape = "x".join(map(str, p.shape))
                found.append(f"{module_name + '.' if module_name else ''}{name} ({shape})")
    return found


def convert(model: nn.Module, recipe: Recipe | str = "tensorwise", *, filter: Filter = None) -> nn.Module:
    """A copy of ``model`` with its linear layers swapped for fp8 ones (torchao's ``convert_to_float8_training``).

    Candidates: modules whose type is exactly ``nn.Linear`` (a subclass may have a forward of its own),
    made :class:`Float8Linear`, and Hugging Face ``Conv1D`` layers (GPT-2), made :class:`Float8Conv1D`.
    ``filter`` chooses among them; by default every one but the first and the last in
    ``named_modules()`` order (the embedding-side and output layers stay in the surrounding dtype, as
    torchao's and TransformerEngine's guides advise, and torchtitan's NVFP4 runs keep the last blocks in
    bfloat16); :func:`auto_filter_small_kn` chooses by GEMM size. A chosen layer whose sizes are not
    multiples of 16 (of the block size, 32, for ``mxfp8``) stays as it is, and so do the 3-D weights of
    mixture-of-experts layers, used through a grouped matmul (Hugging Face Mixtral's
    ``experts.gate_up_proj`` and ``experts.down_proj``): one :class:`Fp8FallbackWarning` names them all.
    Parameters are copied with the model, and a weight tied between a converted layer and another module
    stays tied. A block-scaled recipe on a device without its kernel (every device but CUDA compute
    capability 10.0 and up for ``mxfp8``) runs its exact float32 emulation, said once by an
    :class:`Fp8EmulationWarning`.

    Args:
      model: any ``nn.Module``; not changed.
      recipe: a :class:`Recipe` or ``"tensorwise"``, ``"rowwise"``, ``"delayed"``, ``"mxfp8"``, ``"nvfp4"``.
      filter: None (the default above), a predicate ``filter(module, qualified_name) -> bool`` (such as
        :func:`auto_filter_small_kn`'s), or a name pattern or list of them (fnmatch: ``"blocks.*.mlp.*"``).
    Returns:
      The converted copy (train/eval flags kept).
    Raises:
      TypeError: if ``model`` is not an ``nn.Module`` or ``filter`` not one of the forms above.
      ValueError: if the recipe is unknown, or ``filter`` selects no candidate.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fp8.convert: expected a torch.nn.Module, got {type(model).__name__}")
    r = get_recipe(recipe)
    model = copy.deepcopy(model)
    linears = [name for name, m in model.named_modules() if _gemm_sizes(m) is not None]
    select = _selector(filter, linears)
    chosen = [name for name in linears if select(model.get_submodule(name), name)]
    if not chosen:
        raise ValueError(
            f"fp8.convert: the filter selected none of the {len(linears)} nn.Linear/Conv1D layers "
            f"({', '.join(linears[:6])}{', ...' if len(linears) > 6 else ''}); the default keeps the first and last"
        )
    swapped: dict[int, nn.Module] = {}
    fallback = []
    for name in chosen:
        old = model.get_submodule(name)
        sizes = _gemm_sizes(old)
        if _check_fp8_shape(*sizes, r):
            fallback.append(f"{name} ({sizes[0]}->{sizes[1]})")
            continue
        if id(old) not in swapped:
            swapped[id(old)] = (
                Float8Linear.from_linear(old, r, name) if isinstance(old, nn.Linear) else Float8Conv1D(old, r, name)
            )
    for _, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent.named_children()):
            if id(child) in swapped:
                setattr(parent, child_name, swapped[id(child)])
    _warn_fallback(fallback, _grouped_weights(model), r)
    if r.block_size is not None and swapped:
        device = next(iter(swapped.values())).weight.device
        if not _blocks.kernel_available(device, r):
            _announce_emulation(r, device)
    return model


def _warn_fallback(layers: list[str], grouped: list[str], recipe: Recipe) -> None:
    parts = []
    if layers:
        multiple = recipe.block_size if recipe.block_size is not None and recipe.block_size > 16 else 16
        parts.append(
            f"{len(layers)} layer(s) stay in the surrounding dtype, their sizes are not multiples of {multiple}: "
            f"{', '.join(layers)}"
        )
    if grouped:
        parts.append(
            f"{len(grouped)} 3-D weight(s) of mixture-of-experts layers, used through a grouped matmul, stay in the "
            f"surrounding dtype (fp8.convert converts nn.Linear and Conv1D layers only): {', '.join(grouped)}"
        )
    if parts:
        warnings.warn(f"fp8.convert: {'; '.join(parts)}", Fp8FallbackWarning, stacklevel=3)
