"""In-graph precision telemetry: what the gradients look like to a low-precision format, every N steps.

:func:`funcamp.make_train_step` with ``telemetry=N`` (or a :class:`Telemetry`) adds to its metrics, for
each module group of parameters (the parameter name's module prefix, cut at ``group_depth`` parts)
and for ``all`` of them, computed inside the compiled step with no host sync:

- ``grad_amax``, ``weight_amax``: the largest ``|g|`` and ``|w|`` (float32, rounded from the tensor's
  own dtype; NaN if a gradient is NaN);
- ``grad_zeros``: the fraction of gradient elements that are exactly zero;
- per number format ``F`` (default ``float16`` and ``bfloat16``; fp8 ``float8_e4m3fn``/``float8_e5m2``
  on request), the fraction of gradient elements that would flush to zero (``F/underflow``) and that
  would overflow (``F/overflow``) in ``F``, before loss scaling (the unscaled gradient ``g``) and after
  it (``F/underflow_scaled``, ``F/overflow_scaled``: ``g * loss_scale``, what a half-precision backward
  holds), and the loss scale's headroom ``F/headroom_log2 = log2(max_finite / (loss_scale * grad_amax))``
  (how many doublings the scale may still grow before the largest gradient overflows: jmp's rule of
  thumb as a number, computed in float64 as ``log2(max_finite) - log2(loss_scale) - log2(grad_amax)``:
  finite for every finite nonzero amax, subnormal ones included; +inf for an all-zero gradient);
- ``grad_log2_hist``: an int64 histogram of ``log2|g|`` over :data:`HISTOGRAM_BINS` bins of one binade
  each, ``[2**k, 2**(k+1))`` for ``k`` from :data:`HISTOGRAM_LOW` (values below go to the first bin, at or
  above ``2**HISTOGRAM_HIGH`` to the last); zeros and non-finite elements are left out (``grad_zeros`` and
  ``overflow`` count them). The binade is the exponent ``torch.frexp`` returns (exact: a float32
  ``floor(log2(x))`` puts values just below ``2**k`` in bin ``k``), and the counts are exact integers at
  any size (``torch.histc`` on at most 2**24 elements at a time, whose float32 counts are exact, summed
  in int64; one ``histc`` over a whole leaf stopped counting at 2**24 = 16,777,216).

- ``lost_updates`` (the lost-update meter, with :attr:`Telemetry.lost_updates`): the fraction of the
  group's elements with a nonzero update ``u`` (what the optimizer returned, what ``apply_updates`` adds)
  whose stored parameter did not change, ``#(u != 0 and p' == p) / #(u != 0)`` (0 when no update is
  nonzero, and at a skipped step, which applies none). Rounding to the parameter's dtype threw these
  updates away: an update below half the spacing of the numbers around ``p`` (``|p| * 2**-9`` in bfloat16,
  ``|p| * 2**-25`` in float32) is lost. bfloat16 parameters near 1 under SGD steps of 1e-5 read 1.0, float32
  ones 0. With ``kahan_summation`` or ``stochastic_rounding`` (the whole optimizer) the update is the wrapper's
  landing ``p' - p``, never lost, so the meter reads 0 and ``carried_updates`` says what the wrapper kept:
  among the elements of bfloat16 parameters with a nonzero gradient, the fraction whose parameter did not
  change but whose update was carried, by the compensation buffer (Kahan: it changed) or in expectation
  (stochastic rounding: the parameter moves a whole spacing with probability ``|u| / spacing``; every element
  that kept its value counts). Exact int64 counts, as the others.

Keys are ``numerics/<group>/<name>`` (``numerics/blocks.0/float16/underflow_scaled``), plus
``numerics/active`` (0-d bool): whether this step computed them. They are computed when the new step
count ``state.step + 1`` is a multiple of ``every`` (so at steps N, 2N, ... of a loop that counts from 1,
where a logger with ``log_every=N`` writes), decided in the graph by :func:`torch.cond`: no recompile and
no work on the other steps, where every value is 0 (``numerics/active`` False). The keys, shapes and
dtypes are the same on every step, so the compiled step is one graph.

Definitions (round to nearest even, as a cast does): an element *underflows* in ``F`` if it is not
zero and ``|x| <= smallest_subnormal / 2`` (it would round to zero); it *overflows* if
``|x| >= max_finite + ulp(max_finite) / 2`` (it would round past the largest finite value: to inf in
float16, bfloat16 and float8_e5m2; float8_e4m3fn has no inf, torch's cast saturates it to 448) or it is
not finite. Every count is an exact int64 (a sum of bools); a fraction is that count divided by the
group's element count in float64, rounded once to float32. The comparisons of ``g * loss_scale`` are
exact: ``|g|`` is compared with the threshold divided by the scale, rounded the safe way on ``|g|``'s own
grid (a float32 product ``|g| * loss_scale`` flushed tiny gradients to 0 under a scale below 1 and
rounded others across a threshold). The gradients seen are the step's
unscaled gradients in the parameters' dtype, averaged over micro-batches and ranks, before clipping;
elements a half-precision backward already flushed are zeros here (``grad_zeros``).

The quantities follow TransformerEngine's debug features (``underflows%``, ``overflows%``,
``dynamic_range``, per-tensor ``amax``); TransformerEngine computes them in separate kernels and
recommends logging every few steps; here they are a branch of the one compiled step. jmp, optax and
torch.amp have nothing like it. :class:`funcamp.TensorBoardLogger` writes them as scalars under
``numerics/...`` and the histograms as TensorBoard histograms.

The format table :data:`FORMATS` gives each format's range; the values are those of ``torch.finfo``
(IEEE 754 binary16; bfloat16; OCP 8-bit floating point specification v1.0 for the fp8 pair).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch

from funcamp import _scope, _tree, formats

__all__ = [
    "FORMATS",
    "AppliedUpdate",
    "HISTOGRAM_BINS",
    "HISTOGRAM_HIGH",
    "HISTOGRAM_LOW",
    "NumberFormat",
    "Telemetry",
    "group_names",
    "histogram_edges",
    "telemetry_metrics",
]


class NumberFormat(NamedTuple):
    """A floating-point format's range (Python floats, exact powers of two or sums of them).

    Fields: ``dtype`` (the torch dtype); ``max_finite``; ``smallest_normal``; ``smallest_subnormal``;
    ``mantissa_bits`` (explicit fraction bits); ``overflow_threshold`` (``max_finite`` plus half an ulp
    at ``max_finite``: the smallest magnitude that rounds past ``max_finite``).
    """

    dtype: torch.dtype
    max_finite: float
    smallest_normal: float
    smallest_subnormal: float
    mantissa_bits: int
    overflow_threshold: float


def _format(dtype: torch.dtype, max_finite: float, emin: int, mantissa_bits: int) -> NumberFormat:
    ulp_at_max = 2.0 ** (math.frexp(max_finite)[1] - 1 - mantissa_bits)
    return NumberFormat(
        dtype=dtype,
        max_finite=max_finite,
        smallest_normal=2.0**emin,
        smallest_subnormal=2.0 ** (emin - mantissa_bits),
        mantissa_bits=mantissa_bits,
        overflow_threshold=max_finite + ulp_at_max / 2,
    )


#: The formats telemetry knows, by torch dtype name: the floating formats of :data:`funcamp.formats.FORMATS`
#: (float16: max 65504, subnormals down to 2**-24; bfloat16: max (2 - 2**-7) * 2**127, down to 2**-133;
#: float8_e4m3fn: max 448, down to 2**-9, no inf; float8_e5m2: max 57344, down to 2**-16; float32 for
#: comparison), with the overflow threshold telemetry counts against.
FORMATS: dict[str, NumberFormat] = {
    name: _format(f.dtype, f.max, f.min_exponent, f.mantissa_bits)
    for name, f in formats.FORMATS.items()
    if not f.is_integer and f.signed and not f.packed  # not the block-scaling formats e8m0 (scales) and e2m1
}

#: The histogram of ``log2|g|``: bin ``i`` counts ``2**(HISTOGRAM_LOW + i) <= |g| < 2**(HISTOGRAM_LOW + i + 1)``;
#: the first and last bins also take everything below and above the range.
HISTOGRAM_LOW = -48
HISTOGRAM_HIGH = 16
HISTOGRAM_BINS = HISTOGRAM_HIGH - HISTOGRAM_LOW


def histogram_edges() -> list[float]:
    """The ``HISTOGRAM_BINS + 1`` bin edges of ``grad_log2_hist``, in log2 units (``-48.0 ... 16.0``)."""
    return [float(k) for k in range(HISTOGRAM_LOW, HISTOGRAM_HIGH + 1)]


@dataclasses.dataclass(frozen=True)
class Telemetry:
    """What :func:`funcamp.make_train_step` measures with ``telemetry=``; static configuration.

    Args:
      every: compute the metrics at every ``every``-th step (an int >= 1); 1: every step.
      group_depth: how many leading parts of a parameter's module path name its group
        (``blocks.0.attn.qkv.weight`` -> ``blocks.0`` at depth 2, ``blocks`` at 1); ``None``: one
        group per parameter (its full name). Parameters without a module path go to ``root``.
      formats: names of :data:`FORMATS` to measure underflow, overflow and headroom in.
      histogram: whether to add ``grad_log2_hist`` per group.
      lost_updates: whether to add the lost-update meter (``lost_updates``, and ``carried_updates`` under
        ``kahan_summation`` or ``stochastic_rounding``) per group.
    Raises:
      ValueError: if ``every`` is not an int >= 1, ``group_depth`` not None or an int >= 1, or a
        format is not in :data:`FORMATS`.
    """

    every: int = 10
    group_depth: int | None = 2
    formats: tuple[str, ...] = ("float16", "bfloat16")
    histogram: bool = True
    lost_updates: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"Telemetry: every must be an int >= 1, got {self.every!r}")
        depth = self.group_depth
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
            raise ValueError(f"Telemetry: group_depth must be None or an int >= 1, got {depth!r}")
        if isinstance(self.formats, str) or not all(f in FORMATS for f in self.formats):
            raise ValueError(
                f"Telemetry: formats must be a tuple of names from {sorted(FORMATS)}, got {self.formats!r}"
            )
        object.__setattr__(self, "formats", tuple(self.formats))


def as_telemetry(telemetry: Telemetry | int | None) -> Telemetry | None:
    """``make_train_step``'s ``telemetry=`` argument as a :class:`Telemetry` (an int N: every N steps)."""
    if telemetry is None or telemetry is False:
        return None
    if isinstance(telemetry, Telemetry):
        return telemetry
    if isinstance(telemetry, int) and not isinstance(telemetry, bool):
        return Telemetry(every=telemetry)
    raise TypeError(
        f"make_train_step: telemetry must be None, an int N (every N steps) or a funcamp.numerics.Telemetry, "
        f"got {telemetry!r}"
    )


class AppliedUpdate(NamedTuple):
    """What the lost-update meter reads of one step (:func:`telemetry_metrics`' ``applied``).

    Fields: ``updates`` (the optimizer's updates, what ``apply_updates`` added; the structure of the
    parameters); ``new_params`` (the parameters after the step: the old ones where the step was skipped);
    ``finite`` (0-d bool: whether the step was applied); ``carry``: None, ``"stochastic"`` (the optimizer is
    ``stochastic_rounding(...)``) or ``(old, new)``, the compensation trees of ``kahan_summation(...)`` before
    and after the step (a tensor shaped like each bfloat16 parameter, an empty one for the others);
    ``trees_of``: None, or ``(updates_of, new_params_of)`` where ``updates`` and ``new_params`` are held
    otherwise (a flat state's buffers, a plain dict): each makes the parameters' tree of its held tensors,
    inside ``torch.cond`` (which refuses operands that share memory, as views of one buffer do).
    """

    updates: Any
    new_params: Any
    finite: torch.Tensor
    carry: Any = None
    trees_of: Any = None  # (updates_of, new_params_of): for trees held otherwise (a flat state's buffers)


def group_names(params: Any, depth: int | None) -> list[str]:
    """The group of each floating leaf of ``params``, in leaf order (see :class:`Telemetry`)."""
    names = [n for n, leaf in zip(_tree.tree_paths(params), _tree.tree_leaves(params)) if _is_float(leaf)]
    if depth is None:
        return names
    return [".".join(n.split(".")[:-1][:depth]) or "root" for n in names]


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


# Per leaf: amaxes (float64) [grad, weight] and counts (int64) [zeros, then 4 per format].
def _leaf_stats(g: torch.Tensor, w: torch.Tensor, limits: list[torch.Tensor]) -> Any:
    a = _magnitude(g)
    amax = torch.stack([_amax(a), _amax(w)])
    counts = [(a == 0).sum()]
    for low, high in zip(limits[::2], limits[1::2]):  # per format: unscaled, then scaled
        counts.append(((a > 0) & (a <= low)).sum())
        counts.append((~(a < high)).sum())
    return amax, torch.stack(counts)


def _update_counts(u: torch.Tensor, w: torch.Tensor, w_new: torch.Tensor, g: torch.Tensor, carry: Any) -> torch.Tensor:
    """int64 ``[#(u != 0), #(u != 0 and w' == w)]``, and with ``carry`` ``[#(g != 0), #carried]`` (see the module)."""
    kept = w_new == w  # the stored value did not change (NaN counts as changed)
    nonzero = u != 0
    counts = [nonzero.sum(), (nonzero & kept).sum()]
    if carry is None:
        return torch.stack(counts)
    zero = counts[0] * 0
    if carry == "stochastic":
        carried = None if w.dtype != torch.bfloat16 else kept
    else:  # (old, new) compensation of this leaf: an empty placeholder for a parameter it does not compensate
        c_old, c_new = carry
        carried = None if c_old.shape != w.shape else kept & (c_new != c_old)
    if carried is None:
        return torch.stack([*counts, zero, zero])
    moving = g != 0
    return torch.stack([*counts, moving.sum(), (moving & carried).sum()])


def _limits(formats: tuple[str, ...], scale: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """Per format, unscaled then scaled: the largest ``|g|`` of ``dtype`` that underflows and the smallest
    that overflows, so that ``|g|`` is compared exactly (``|g| * s <= half_sub`` iff ``|g| <= low``), with
    no product ``|g| * s`` rounded to ``dtype`` (a float32 product flushed tiny ones to 0)."""
    one, out = torch.ones_like(scale), []
    for name in formats:
        fmt = FORMATS[name]
        for s in (one, scale):
            out += [
                _largest_at_most(fmt.smallest_subnormal / 2, s, dtype),
                _smallest_at_least(fmt.overflow_threshold, s, dtype),
            ]
    return out


def _magnitude(g: torch.Tensor) -> torch.Tensor:
    """``|g|`` in float32, or float64 for a float64 gradient (its thresholds stay exact)."""
    return g.detach().abs().to(_magnitude_dtype(g))


def _magnitude_dtype(g: torch.Tensor) -> torch.dtype:
    return torch.float64 if g.dtype == torch.float64 else torch.float32


def _amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as a 0-d float64 tensor (exact for every floating dtype; 0 for an empty tensor)."""
    x = x.detach()
    return x.abs().amax().double() if x.numel() else torch.zeros((), dtype=torch.float64, device=x.device)


def _largest_at_most(bound: float, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest ``f`` of ``dtype`` with ``f * scale <= bound``, a 0-d tensor (``scale``: 0-d float64 > 0).

    ``bound / scale`` is rounded to ``dtype`` and corrected by one step either way, checking ``f * scale``
    in float64: exact for float32 ``f`` and ``scale`` (24 + 24 bits), to float64 round-off for float64.
    """
    f = (bound / scale).to(dtype)
    up, down = torch.nextafter(f, torch.full_like(f, math.inf)), torch.nextafter(f, torch.full_like(f, -math.inf))
    ok = [c.double() * scale <= bound for c in (up, f)]
    return torch.where(ok[0], up, torch.where(ok[1], f, down))


def _smallest_at_least(bound: float, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest ``f`` of ``dtype`` (inf included) with ``f * scale >= bound``; see :func:`_largest_at_most`."""
    f = (bound / scale).to(dtype)
    up, down = torch.nextafter(f, torch.full_like(f, math.inf)), torch.nextafter(f, torch.full_like(f, -math.inf))
    ok = [c.double() * scale >= bound for c in (down, f)]
    return torch.where(ok[0], down, torch.where(ok[1], f, up))


#: ``torch.histc`` counts in float32 (exact up to 2**24): each call sees at most this many elements.
_HISTC_CHUNK = 2**24


def _log2_hist(g: torch.Tensor) -> torch.Tensor:
    """int64 counts of ``floor(log2|g|)`` per bin, exact at any size (see the module docstring)."""
    return torch.stack([_log2_hist_chunk(c) for c in _magnitude(g).flatten().split(_HISTC_CHUNK)]).sum(0)


def _log2_hist_chunk(a: torch.Tensor) -> torch.Tensor:
    _, exponent = torch.frexp(a)  # a = m * 2**exponent, m in [0.5, 1): floor(log2 a) = exponent - 1, exactly
    e = (exponent - 1).clamp_(HISTOGRAM_LOW, HISTOGRAM_HIGH - 1).float().add_(0.5)  # bin centres, exact
    e = torch.where((a > 0) & torch.isfinite(a), e, HISTOGRAM_LOW - 8.0)  # zeros, inf, NaN: not counted
    return torch.histc(e, bins=HISTOGRAM_BINS, min=HISTOGRAM_LOW, max=HISTOGRAM_HIGH).long()  # <= 2**24: exact


def _compute(
    grads: list[torch.Tensor],
    weights: list[torch.Tensor],
    scale: torch.Tensor,
    config: Telemetry,
    groups: list[str],
    applied: tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, list[Any]] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Per group (in ``_group_order`` order): a float32 vector of the scalars, and its int64 histogram.

    ``applied``: ``(updates, new weights, finite, carry per leaf)`` for the lost-update meter, or None.
    """
    scale = scale.double()
    limits = {dtype: _limits(config.formats, scale, dtype) for dtype in dict.fromkeys(map(_magnitude_dtype, grads))}
    per_leaf = [_leaf_stats(g, w, limits[_magnitude_dtype(g)]) for g, w in zip(grads, weights)]
    hists = [_log2_hist(g) for g in grads] if config.histogram else []
    if applied is not None:
        updates, new_weights, finite, carry = applied
        moved = [_update_counts(*xs) for xs in zip(updates, weights, new_weights, grads, carry)]
    out = []
    for members in _group_members(groups).values():
        amax = torch.stack([per_leaf[i][0] for i in members]).amax(0)
        counts = torch.stack([per_leaf[i][1] for i in members]).sum(0)
        n = sum(grads[i].numel() for i in members)
        fractions = counts.double() / max(n, 1)  # exact int64 counts, one rounding to float32 below
        # log2(max_finite / (scale * amax)) in float64: finite for every finite amax > 0 (subnormal too)
        heads = [math.log2(FORMATS[f].max_finite) - torch.log2(scale) - torch.log2(amax[0]) for f in config.formats]
        if applied is not None:  # of / out of: lost of the nonzero updates (and carried of the moving elements)
            c = torch.stack([moved[i] for i in members]).sum(0).double()
            meter = torch.where(finite, c[1::2] / c[0::2].clamp_min(1), 0.0)  # exact counts, one division
            heads.append(meter)
        out.append(torch.cat([amax, fractions, *(h.reshape(-1) for h in heads)]).float())
        if config.histogram:
            out.append(torch.stack([hists[i] for i in members]).sum(0))
    return tuple(out)


def _group_members(groups: list[str]) -> dict[str, list[int]]:
    members: dict[str, list[int]] = {"all": list(range(len(groups)))}
    for i, g in enumerate(groups):
        members.setdefault(g if g != "all" else "all_", []).append(i)
    return members


def _scalar_names(config: Telemetry, meter: tuple[str, ...] = ()) -> list[str]:
    names = ["grad_amax", "weight_amax", "grad_zeros"]
    for f in config.formats:
        names += [f"{f}/underflow", f"{f}/overflow", f"{f}/underflow_scaled", f"{f}/overflow_scaled"]
    return names + [f"{f}/headroom_log2" for f in config.formats] + list(meter)


def _meter_names(applied: AppliedUpdate | None) -> tuple[str, ...]:
    if applied is None:
        return ()
    return ("lost_updates",) if applied.carry is None else ("lost_updates", "carried_updates")


def _unpack(
    values: tuple[torch.Tensor, ...], groups: list[str], config: Telemetry, meter: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    names, it, out = _scalar_names(config, meter), iter(values), {}
    for group in _group_members(groups):
        vector = next(it)
        out.update({f"numerics/{group}/{name}": vector[j] for j, name in enumerate(names)})
        if config.histogram:
            out[f"numerics/{group}/grad_log2_hist"] = next(it)
    return out


def telemetry_metrics(
    grads: Any,
    params: Any,
    loss_scale: torch.Tensor,
    config: Telemetry,
    active: torch.Tensor | None = None,
    applied: AppliedUpdate | None = None,
    params_of: Any = None,
) -> dict[str, torch.Tensor]:
    """The telemetry metrics of one step's gradients (traceable; no host sync when compiled).

    Args:
      grads: the unscaled gradients, a pytree with the structure of ``params``.
      params: the parameters (their names give the groups; ``weight_amax`` reads them).
      loss_scale: the loss scale the step used, a 0-d float32 tensor > 0 (1.0 for none).
      config: a :class:`Telemetry`.
      active: a 0-d bool tensor: compute now (True) or return zeros (False), with :func:`torch.cond`
        when compiling (eagerly: a Python branch, one host read); ``None``: always compute.
      applied: the step's :class:`AppliedUpdate`, for the lost-update meter (``lost_updates``, and
        ``carried_updates`` with a ``carry``); None: no meter. Its trees have the structure of ``params``.
      params_of: ``params_of(params) -> the parameter tree``, for ``params`` held otherwise (a flat state's
        buffers, a plain dict: :meth:`funcamp.train.ParamStorage.held`): the buffers go into ``torch.cond``,
        which refuses aliased operands (views of one buffer), and the views are made inside it. Default:
        ``params`` is the tree.
    Returns:
      ``{"numerics/active": 0-d bool, "numerics/<group>/<name>": 0-d float32 or, for
      ``grad_log2_hist``, an int64 vector of :data:`HISTOGRAM_BINS` counts}``, on the gradients'
      device; the names are listed in the module docstring.
    Raises:
      ValueError: if ``grads`` and ``params`` have different numbers of floating leaves, or the trees of
        ``applied`` another number than ``params``.

    Example:
      >>> g = {"w": torch.tensor([1e-8, 1.0, 7e4, 0.0])}  # below 2**-25, ordinary, above 65520, zero
      >>> m = telemetry_metrics(g, {"w": torch.ones(4)}, torch.tensor(1.0), Telemetry(formats=("float16",)))
      >>> [m[f"numerics/all/{k}"].item() for k in ("float16/underflow", "float16/overflow", "grad_zeros")]
      [0.25, 0.25, 0.25]
    """
    held, params_of = params, params_of or (lambda tree: tree)
    params = params_of(held)
    g_leaves = [x for x in _tree.tree_leaves(grads) if _is_float(x)]
    w_leaves = [x for x in _tree.tree_leaves(params) if _is_float(x)]
    if len(g_leaves) != len(w_leaves):
        raise ValueError(
            f"telemetry_metrics: grads has {len(g_leaves)} floating leaves, params {len(w_leaves)}; "
            "they must have the same structure"
        )
    if not g_leaves:  # nothing to measure: only the flag
        return {"numerics/active": torch.ones((), dtype=torch.bool) if active is None else active}
    groups = group_names(params, config.group_depth)
    scale = loss_scale.detach().float().to(g_leaves[0].device)
    meter = _meter_names(applied)
    n = len(g_leaves)
    if applied is not None and applied.trees_of is not None:  # rebuilt inside the cond, without optree
        updates_of, new_of, carry_of = applied.trees_of
        rebuilders = [(updates_of, _tree.rebuilder(applied.updates)), (new_of, _tree.rebuilder(applied.new_params))]
        if isinstance(applied.carry, tuple):
            rebuilders += [(carry_of, _tree.rebuilder(applied.carry[0])), (carry_of, _tree.rebuilder(applied.carry[1]))]
        applied = applied._replace(trees_of=tuple(rebuilders))
    rebuild = _tree.rebuilder(held)  # made here: traced inside torch.cond without optree's polyfill
    held_leaves = _tree.tree_leaves(held)
    h = len(held_leaves)
    operands = (*g_leaves, *held_leaves, scale, *_applied_leaves(applied, n))  # one tensor may come twice: allowed

    def compute(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        g, held_w, s, rest = ts[:n], list(ts[n : n + h]), ts[n + h], ts[n + h + 1 :]
        w = [x for x in _tree.tree_leaves(params_of(rebuild(held_w))) if _is_float(x)]
        return _compute(g, w, s, config, groups, _applied_args(applied, rest, n))

    def skip(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _zeros_like_compute(config, groups, scale.device, meter)

    if active is None:
        values, flag = compute(*operands), torch.ones((), dtype=torch.bool, device=scale.device)
    elif _scope.compiling():  # one graph whatever the step
        values, flag = torch.cond(active, compute, skip, operands), active
    else:
        values, flag = (compute(*operands) if bool(active) else skip(*operands)), active
    return {"numerics/active": flag, **_unpack(values, groups, config, meter)}


def _applied_leaves(applied: AppliedUpdate | None, n: int) -> list[torch.Tensor]:
    """The tensors of ``applied`` in order: updates, new parameters (as held), finite, then the compensations."""
    if applied is None:
        return []
    trees = [applied.updates, applied.new_params]
    if isinstance(applied.carry, tuple):
        trees += list(applied.carry)
    leaves = []
    for i, tree in enumerate(trees):
        xs = [x for x in _tree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
        if applied.trees_of is None:  # held otherwise: made into the parameters' leaves inside the cond
            if len(xs) != n:
                raise ValueError(
                    f"telemetry_metrics: applied's tree {i} has {len(xs)} tensor leaves, params {n} floating ones; "
                    "they must have the structure of the parameters"
                )
        leaves.append(xs)
    return [*leaves[0], *leaves[1], applied.finite, *(x for xs in leaves[2:] for x in xs)]


def _applied_args(applied: AppliedUpdate | None, rest: list[torch.Tensor], n: int) -> Any:
    """``_compute``'s ``applied`` from the operands after the scale (see :func:`_applied_leaves`); trees held
    otherwise (``applied.trees_of``) made into the parameters' leaves here."""
    if applied is None:
        return None
    trees = [applied.updates, applied.new_params, *(applied.carry if isinstance(applied.carry, tuple) else ())]
    sizes = [len(_tree.tree_leaves(t)) for t in trees]
    parts, at = [], 0
    for k, size in enumerate(sizes):
        parts.append(list(rest[at : at + size]))
        at += size + (1 if k == 1 else 0)  # finite sits after the new parameters
    finite = rest[sizes[0] + sizes[1]]
    if applied.trees_of is not None:  # the rebuilders were made outside the cond (telemetry_metrics)
        parts = [_tree.tree_leaves(of(rebuild(p))) for (of, rebuild), p in zip(applied.trees_of, parts, strict=False)]
    updates, new_weights = parts[0], parts[1]
    if applied.carry is None:
        carry: list[Any] = [None] * n
    elif applied.carry == "stochastic":
        carry = ["stochastic"] * n
    else:
        carry = list(zip(parts[2], parts[3]))
    return updates, new_weights, finite, carry


def _zeros_like_compute(
    config: Telemetry, groups: list[str], device: torch.device, meter: tuple[str, ...] = ()
) -> tuple[torch.Tensor, ...]:
    n = len(_scalar_names(config, meter))
    out = []
    for _ in _group_members(groups):
        out.append(torch.zeros(n, dtype=torch.float32, device=device))
        if config.histogram:
            out.append(torch.zeros(HISTOGRAM_BINS, dtype=torch.int64, device=device))
    return tuple(out)
