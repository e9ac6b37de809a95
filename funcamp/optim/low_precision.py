r"""Low-precision master weights that still learn: ``kahan_summation`` and ``stochastic_rounding``.

A bfloat16 parameter near 1 has a spacing of 2**-8 below 1 and 2**-7 above it, so an update smaller
than half of that is lost entirely by round-to-nearest: 100 SGD updates of -6e-4 leave a bfloat16
1.0 at 1.0, where float32 reaches 0.9400020. This is why mixed-precision training keeps float32
master weights (4 bytes per parameter, on top of Adam's 8). Both wrappers here keep the master
weights in bfloat16 and still let small updates add up:

* ``kahan_summation(inner)`` keeps a compensation buffer ``c`` in the parameter's dtype, with the part
  of each update that rounding lost, and adds it back at the next step (Kahan summation as in
  Zamirai et al. and Collage): 2 more bytes per bfloat16 parameter, deterministic.
* ``stochastic_rounding(inner, seed)`` rounds the new value up or down at random with probabilities
  that make it exact in expectation (torchao's ``AdamW(bf16_stochastic_round=True)``, llm.c): no
  buffer, the noise is a counter-based hash of ``(seed, step, the parameter's name, the element's
  index in the whole tensor)``, so a sharded run draws the unsharded run's noise.

How the wrappers fit the optax protocol without changing ``apply_updates``: ``update`` sees the
parameters ``p``, so it computes the exact target ``t = p + u`` (plus ``c``) in float32, chooses the
new parameter ``p'`` in ``p``'s dtype, and returns the float32 update ``u' = p' - p``.
``apply_updates`` computes ``float32(p) + u'`` and rounds to ``p``'s dtype, which gives ``p'`` exactly:

* if ``p' - p`` is exact in float32, ``p + u' = p'`` exactly. It is whenever ``|p'| >= 2**-15 |p|``:
  the two numbers' exponents then differ by at most 15 = 23 minus bfloat16's 8 significand bits, so
  their difference fits in float32's 24 bits;
* if ``|p| << |p'|``, ``p + u'`` is within 2 float32 ulps of ``p'``, which rounds to ``p'``;
* only when the update cancels the parameter beyond that (``|p'| < 2**-15 |p|``) can the
  result differ from ``p'``, by at most ``2**-24 |p|`` (float32's rounding of ``p' - p``).
  ``kahan_summation`` emulates ``apply_updates`` and keeps ``c`` relative to the value actually
  stored, so it loses nothing even then.

The wrappers must be the outermost transformation: a transform chained after them would change
``u'``. Their updates are float32 for bfloat16 parameters (``apply_updates`` takes them); float32
and float64 parameters pass through unchanged, with an empty state leaf; float16 parameters are
refused (bfloat16 takes the same memory with float32's range).

The roundings are integer operations on float32 bit patterns, not ``.to(torch.bfloat16)`` casts that
are cast back: inductor drops such a down-and-up pair by default, and the Kahan compensation would
then silently be zero in a compiled step (a test compiles both wrappers with inductor and compares
with eager bit for bit).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import torch

from funcamp import _scope, _tree
from funcamp.optim import _flat, _inplace
from funcamp.optim.base import GradientTransformation, OptState, Params, Updates, mark_outermost
from funcamp.optim.transforms import _map_n

__all__ = ["KahanSummationState", "StochasticRoundingState", "kahan_summation", "stochastic_rounding"]


class ElementOffsets(Protocol):
    """What :func:`stochastic_rounding` needs of a layout (:class:`funcamp.sharding.ShardLayout` has it)."""

    def element_offsets(self) -> Mapping[str, int]:
        """Each parameter's (dotted name) first element in its whole tensor."""
        ...


class KahanSummationState(NamedTuple):
    """State of ``kahan_summation``."""

    inner_state: OptState  # the wrapped transformation's state
    compensation: Updates  # tree like params: c = exact target - stored param, in the param's dtype for
    # bfloat16 params; an empty (0,) tensor of the param's dtype for float32/float64 ones


class StochasticRoundingState(NamedTuple):
    """State of ``stochastic_rounding``."""

    inner_state: OptState  # the wrapped transformation's state
    count: torch.Tensor  # 0-d int32: number of updates so far (the step of the noise hash)
    seed: torch.Tensor  # 0-d int64: the seed of the noise hash, in [0, 2**63)


def _check_inner(fn: str, inner: Any) -> None:
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"{fn}: inner must be a GradientTransformation (the optimizer to wrap, e.g. optim.adamw(1e-3)), "
            f"got {type(inner).__name__}"
        )


def _refuse_float16(fn: str, params: Params) -> None:
    for path, p in zip(_tree.tree_paths(params), _tree.tree_leaves(params)):
        if isinstance(p, torch.Tensor) and p.dtype == torch.float16:
            raise TypeError(
                f"{fn}: parameter {path!r} is float16; only bfloat16 parameters are supported (float32 and "
                "float64 ones pass through). Store the parameters in bfloat16 (same memory, float32's range)."
            )


def _need_params(fn: str, params: Params) -> None:
    if params is None:
        raise ValueError(f"{fn}: update needs the parameters: call update(updates, state, params)")


def _map_leaves(fn: str, n: int, leaf_fn: Any, updates: Updates, *trees: Any) -> tuple[Any, ...]:
    """Map ``leaf_fn(i, u, *xs) -> n values`` over the leaves (``i`` the leaf's position); ``n`` trees."""
    return _map_n(n, leaf_fn, updates, *trees, name=fn, indexed=True)


def kahan_summation(inner: GradientTransformation) -> GradientTransformation:
    r"""Wrap ``inner`` so that bfloat16 parameters keep the low-order bits their updates lose.

    For each bfloat16 parameter ``p`` with compensation ``c`` (same dtype, zero at first) and
    the update ``u`` of ``inner``, in float32:

    .. math::
       t = p + (u + c), \qquad p' = \mathrm{round}(t), \qquad c' = \mathrm{round}(t - p')

    with round-to-nearest-even into bfloat16; the returned update is ``u' = p' - p`` in float32,
    which ``apply_updates`` turns into ``p'`` (see the module docstring). ``p' + c'`` carries about 16
    significant bits for bfloat16, so an update of 6e-4 on 1.0 is no longer lost: 100 of them reach
    0.94140625 (the bfloat16 nearest 0.9400020; ``p + c`` is 0.9402) instead of staying at 1.0.
    Deterministic. Float32 and float64 parameters are updated by ``inner`` alone.

    Memory: one more bfloat16 tensor per bfloat16 parameter (2 bytes per element). AdamW on
    bfloat16 parameters with this wrapper and ``moment_dtype=torch.bfloat16`` holds 8 bytes per
    parameter (weight, compensation, two moments) against 12 for float32 masters with float32
    moments; with the default float32 moments, 12.

    Unlike the references, which fuse the compensation into their optimizer's update, this wraps any
    optax-style transformation; ``c`` is stored after rounding ``t - p'`` to the parameter's dtype
    (Collage's "light" variant; ``t - p'`` itself is exact in float32).

    Args:
      inner: the optimizer whose updates are applied (e.g. ``optim.adamw(1e-3)``); must return
        updates shaped like the parameters.
    Returns:
      A ``GradientTransformation`` with a ``KahanSummationState``; its updates are float32 for
      bfloat16 parameters and ``update`` needs ``params``. Must be the outermost transform.
    Raises:
      TypeError: if ``inner`` is not a ``GradientTransformation``.
      TypeError: (from ``init``) if a parameter is float16.
      ValueError: (from ``update``) if ``params`` is ``None``, or the trees' structures differ.
    References:
      Kahan 1965, "Further remarks on reducing truncation errors", CACM 8(1).
      Zamirai et al. 2020, "Revisiting BFloat16 Training", arXiv:2010.06192.
      Yu et al. 2024, "Collage: Light-Weight Low-Precision Strategy for LLM Training", arXiv:2405.03637.

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> opt = optim.kahan_summation(optim.sgd(1.0))
      >>> params = {"w": torch.ones(1, dtype=torch.bfloat16)}
      >>> state = opt.init(params)
      >>> for _ in range(100):
      ...     updates, state = opt.update({"w": torch.full((1,), 6e-4, dtype=torch.bfloat16)}, state, params)
      ...     params = optim.apply_updates(params, updates)
      >>> params["w"], params["w"].float() + state.compensation["w"].float()
      (tensor([0.9414], dtype=torch.bfloat16), tensor([0.9402]))
    """
    fn = "kahan_summation"
    _check_inner(fn, inner)

    def init(params: Params) -> KahanSummationState:
        def zeros(p: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(p) if p.dtype == torch.bfloat16 else p.new_zeros((0,))

        _refuse_float16(fn, params)
        return KahanSummationState(inner_state=inner.init(params), compensation=_tree.tree_map(zeros, params))

    def update(
        updates: Updates, state: KahanSummationState, params: Params = None
    ) -> tuple[Updates, KahanSummationState]:
        _need_params(fn, params)
        updates, inner_state = _inplace.call(inner, updates, state.inner_state, params)

        def leaf(i: int, u: torch.Tensor, p: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            del i
            if p.dtype != torch.bfloat16:
                return u, c
            p32 = p.to(torch.float32)
            t = p32 + (u.to(torch.float32) + c.to(torch.float32))
            new_u = _round_bf16(t) - p32
            new_c = (t - _round_bf16(p32 + new_u)).to(c.dtype)  # relative to what apply_updates stores
            return _inplace.reuse(u, new_u), _inplace.write(c, new_c)

        new_updates, compensation = _map_leaves(fn, 2, leaf, updates, params, state.compensation)
        return new_updates, KahanSummationState(inner_state=inner_state, compensation=compensation)

    result = _flat.elementwise(_inplace.in_place(GradientTransformation(init, update)), inner)
    return mark_outermost(result, "kahan_summation")


def stochastic_rounding(
    inner: GradientTransformation, seed: int = 0, *, layout: ElementOffsets | None = None
) -> GradientTransformation:
    r"""Wrap ``inner`` so that bfloat16 parameters are rounded stochastically, exact in expectation.

    For each bfloat16 parameter ``p`` and the update ``u`` of ``inner``, the target ``t = p + u`` is
    computed in float32 and rounded to one of its two bfloat16 neighbours, up with probability
    ``(t - lo) / (hi - lo)``: a random 16-bit integer is added to the low 16 bits of ``t``'s float32
    bit pattern (sign and magnitude apart) and those bits are cut off, as torchao's
    ``_fp32_to_bf16_sr`` and llm.c do. So ``E[p'] = t`` and small updates add up on average: 100
    updates of -6e-4 on 1.0 give 0.9401 in expectation (``1 - 100 * bf16(6e-4)``); the mean of the
    4096 elements of the example below is 0.94056 (within 3 standard errors of it).
    Non-finite targets are rounded to nearest; a finite target above the largest bfloat16 rounds to
    ``inf`` with the probability of rounding up. The returned update is ``u' = p' - p`` in float32,
    which ``apply_updates`` turns into ``p'`` (module docstring).

    The noise is a counter-based hash (two rounds of the ``lowbias32`` integer mixer, C. Wellons) of
    the seed, the update count, the parameter's dotted name (``"blocks.0.attn.weight"``, a 64-bit
    BLAKE2b digest) and the element's row-major index in the whole tensor, computed in int64
    arithmetic that never overflows: no generator state, no host sync, traceable with
    ``torch.compile(fullgraph=True)``, and the same bits in eager, ``aot_eager`` and inductor. So a
    run is deterministic given the seed, and resuming from a checkpointed state continues bitwise. A
    skipped step (``TrainState`` keeps the optimizer state) reuses the same count, hence the same noise.
    Keyed by name, not by position: two parameters never share noise, also when each sits in its own
    ``multi_transform`` group or ``masked`` subtree wrapped by its own ``stochastic_rounding`` with the
    same seed (both would see their leaf at position 0).

    Sharded (a state made with ``TrainState.create(..., shard=layout)``): each rank updates only its
    rows; inside the train step the wrapper takes the step's layout (``funcamp._scope.current()``) and
    the element index is ``layout.element_offsets()[name]`` (the whole-tensor index of the shard's
    first element) plus the index in the shard, so that shards never share noise and the sharded run
    rounds exactly as the unsharded one with the same seed, on any number of ranks (padding rows get
    noise of indices past the tensor, and are zeroed by the step). Nothing is passed for it.

    No state per parameter: AdamW on bfloat16 parameters holds 10 bytes per parameter with float32
    moments and 6 with ``moment_dtype=torch.bfloat16`` (against 12 for float32 masters). Float32 and
    float64 parameters are updated by ``inner`` alone.

    Args:
      inner: the optimizer whose updates are applied (e.g. ``optim.adamw(1e-3)``).
      seed: an int in ``[0, 2**63)``; different seeds give independent noise.
      layout: None (default: inside a train step its layout, outside one whole tensors), or a
        :class:`funcamp.sharding.ShardLayout` whose ``element_offsets()`` places each shard in its whole
        tensor: for updating shards outside a step (inside one it must agree with the step's layout).
    Returns:
      A ``GradientTransformation`` with a ``StochasticRoundingState``; its updates are float32 for
      bfloat16 parameters and ``update`` needs ``params``. Must be the outermost transform.
    Raises:
      TypeError: if ``inner`` is not a ``GradientTransformation``.
      ValueError: if ``seed`` is not an int in ``[0, 2**63)``.
      TypeError: if ``layout`` is not None and has no ``element_offsets()`` giving a dict of names to
        ints >= 0 (a ``ShardLayout`` has).
      TypeError: (from ``init``) if a parameter is float16.
      ValueError: (from ``update``) if ``params`` is ``None``, or the trees' structures differ.
      ValueError: (from ``update``, with ``layout``) if a bfloat16 parameter's name is not in the layout, or,
        inside a train step, if ``layout`` places a parameter elsewhere than the step's layout.
    References:
      Gupta et al. 2015, "Deep Learning with Limited Numerical Precision", arXiv:1502.02551.
      Zamirai et al. 2020, "Revisiting BFloat16 Training", arXiv:2010.06192.
      torchao ``torchao.optim.AdamW(bf16_stochastic_round=True)``; llm.c ``stochastic_rounding``.

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> opt = optim.stochastic_rounding(optim.sgd(1.0), seed=0)
      >>> params = {"w": torch.ones(4096, dtype=torch.bfloat16)}
      >>> state = opt.init(params)
      >>> for _ in range(100):
      ...     updates, state = opt.update({"w": torch.full((4096,), 6e-4, dtype=torch.bfloat16)}, state, params)
      ...     params = optim.apply_updates(params, updates)
      >>> round(params["w"].float().mean().item(), 2)
      0.94
    """
    fn = "stochastic_rounding"
    _check_inner(fn, inner)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"{fn}: seed must be an int in [0, 2**63), got {seed!r}")
    given = _element_offsets(fn, layout)

    def init(params: Params) -> StochasticRoundingState:
        _refuse_float16(fn, params)
        device = _tree.tree_device(params)
        return StochasticRoundingState(
            inner_state=inner.init(params),
            count=torch.zeros((), dtype=torch.int32, device=device),
            seed=torch.tensor(seed, dtype=torch.int64, device=device),
        )

    def update(
        updates: Updates, state: StochasticRoundingState, params: Params = None
    ) -> tuple[Updates, StochasticRoundingState]:
        _need_params(fn, params)
        updates, inner_state = _inplace.call(inner, updates, state.inner_state, params)
        step_key = _step_key(state.seed, state.count)
        names = _tree.tree_paths(updates)  # static: the leaves' names, in _map_leaves' order
        offsets = _step_offsets(fn, layout, given)  # the step's layout (its shards' places), or layout=

        def leaf(i: int, u: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor]:
            if p.dtype != torch.bfloat16:
                return (u,)
            p32 = p.to(torch.float32)
            t = p32 + u.to(torch.float32)
            noise = _leaf_noise(step_key, _leaf_id(names[i]), t.shape, _offset(fn, offsets, names[i]))
            return (_inplace.reuse(u, _bf16_stochastic_round(t, noise) - p32),)

        (new_updates,) = _map_leaves(fn, 1, leaf, updates, params)
        return new_updates, StochasticRoundingState(inner_state=inner_state, count=state.count + 1, seed=state.seed)

    return mark_outermost(_inplace.in_place(GradientTransformation(init, update)), "stochastic_rounding")


def _element_offsets(fn: str, layout: Any) -> Mapping[str, int] | None:
    """``layout.element_offsets()``, checked (None for no layout)."""
    if layout is None:
        return None
    offsets = getattr(layout, "element_offsets", None)
    offsets = offsets() if callable(offsets) else None
    if not isinstance(offsets, Mapping) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in offsets.items()
    ):
        raise TypeError(
            f"{fn}: layout must be None or a funcamp.sharding.ShardLayout (the layout of the sharded step, "
            f"funcamp.sharding.shard_layout(params, group)), got {type(layout).__name__}"
        )
    return offsets


def _step_offsets(fn: str, layout: Any, given: Mapping[str, int] | None) -> Mapping[str, int] | None:
    """The element offsets of the train step's layout (``funcamp._scope.current()``), or of ``layout=``
    outside a step. Inside a step a ``layout=`` must place every parameter where the step's layout does
    (host side, at trace time): its offsets and the step's agree, a missing one counting as 0."""
    step = _scope.current()
    if step is None:
        return given
    offsets = step.element_offsets()
    if given is not None:
        mine, theirs = dict(given), dict(offsets or {})
        differ = sorted(n for n in {*mine, *theirs} if mine.get(n, 0) != theirs.get(n, 0))
        if differ:
            raise ValueError(
                f"{fn}: layout= (rank {getattr(layout, 'rank', 0)}) places parameter {differ[0]!r} "
                f"elsewhere than the train step's layout, {step!r} (element offset {mine.get(differ[0], 0)} vs "
                f"{theirs.get(differ[0], 0)}); drop layout=: inside a train step the wrapper takes the step's layout"
            )
    return offsets


def _offset(fn: str, offsets: Mapping[str, int] | None, name: str) -> int:
    """The whole-tensor index of the first element of leaf ``name`` (0 without a layout)."""
    if offsets is None:
        return 0
    if name not in offsets:
        raise ValueError(
            f"{fn}: parameter {name!r} is not in the layout given as layout= (its parameters: {sorted(offsets)}); "
            "pass the layout of the parameters this optimizer updates, the one given to TrainState.create(shard=)"
        )
    return offsets[name]


# --- stochastic rounding and its counter-based noise ------------------------------------------------

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: separates consecutive keys


def _mulmod32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``(h * c) mod 2**32`` for int64 ``h`` in [0, 2**32): in two 16-bit halves of ``c``, never above 2**49."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & _M32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """The ``lowbias32`` integer hash (C. Wellons, "Prospecting for hash functions"), a bijection of [0, 2**32)."""
    h = h ^ (h >> 16)
    h = _mulmod32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mulmod32(h, 0x846CA68B)
    return h ^ (h >> 16)


def _step_key(seed: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 key in [0, 2**32) from the seed (both 32-bit halves) and the update count."""
    key = _mix32(seed & _M32)
    key = _mix32(key ^ ((seed >> 32) & _M32))
    return _mix32(key ^ (count.to(torch.int64) & _M32))


@torch.compiler.assume_constant_result  # traced as the constant it returns: Dynamo cannot trace hashlib
def _leaf_id(name: str) -> int:
    """A 64-bit integer for a parameter's dotted name: its BLAKE2b digest (the same in every process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def _leaf_noise(step_key: torch.Tensor, leaf_id: int, shape: torch.Size, offset: int = 0) -> torch.Tensor:
    """16 uniform random bits per element (int32 in [0, 2**16)) from the key, the leaf and the index.

    ``leaf_id``: a 64-bit int naming the leaf (:func:`_leaf_id`); ``offset``: the index in the whole
    tensor of this tensor's first element (a shard's place), so element ``j`` hashes index ``offset + j``.
    """
    key = _mix32((step_key + (leaf_id & _M32)) & _M32)
    key = _mix32(key ^ (leaf_id >> 32))
    n = 1
    for s in shape:
        n *= s
    idx = torch.arange(offset, offset + n, dtype=torch.int64, device=step_key.device)
    h = _mix32((idx & _M32) ^ key)
    if offset + n > 2**32:  # static: the high half of the index enters (it is 0 below 2**32, so no change there)
        h = h ^ _mulmod32(idx >> 32, _GOLDEN)
    h = _mix32((h + key) & _M32)
    return (h >> 16).to(torch.int32).reshape(shape)


def _round_bf16(x: torch.Tensor, noise: torch.Tensor | int | None = None) -> torch.Tensor:
    """Round float32 ``x`` to bfloat16 with integer operations on its bits; the result stays float32.

    ``noise=None``: round to nearest, ties to even (as ``x.to(torch.bfloat16)``). Else ``noise`` holds
    int32 values in [0, 2**16): the magnitude's bit pattern plus ``noise``, its low 16 bits cut, rounds up
    (in magnitude) with probability (low 16 bits of ``x``) / 2**16. Non-finite ``x`` is returned as is.

    Integer operations, not ``x.to(torch.bfloat16).to(torch.float32)``: inductor drops such a
    down-and-up cast pair (``torch._inductor.config.emulate_precision_casts`` is off by default), which
    would silently skip the rounding these wrappers exist for.
    """
    bits = x.view(torch.int32)
    sign = bits & -0x80000000
    magnitude = bits & 0x7FFFFFFF  # below 0x7F800000 when finite, so + 0xFFFF stays below 2**31
    if noise is None:
        noise = 0x7FFF + ((magnitude >> 16) & 1)  # half an ulp, one more when the kept part is odd: ties to even
    rounded = ((magnitude + noise) & -0x10000) | sign
    return torch.where(torch.isfinite(x), rounded.view(torch.float32), x)


def _bf16_stochastic_round(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of float32 ``x`` to bfloat16 values (kept in float32): ``_round_bf16`` with noise."""
    return _round_bf16(x, noise)
