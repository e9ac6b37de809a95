"""Gradient transformations: the building blocks that ``chain`` composes into optimizers.

Dtype rule, shared by every transformation here: arithmetic runs in float32 when a gradient (or
moment) is float16 or bfloat16, in float64 when one is float64; each outgoing update is cast back to
the dtype of the incoming update (for gradients, the dtype of their parameter).

Moment rule, shared by every state that accumulates gradients (Adam's ``mu`` and ``nu``, Lion's ``mu``,
the momentum ``trace`` of SGD): moments are stored in ``moment_dtype`` when it is given, and by default
(``None``) in at least float32: float32 for float16 and bfloat16 parameters, the parameter's own dtype
for float32 and float64 ones. A half-precision moment is wrong without any error: the square of a
float16 gradient below 2**-12 flushes to 0 and above 256 overflows, and bfloat16's 8-bit mantissa
stops a moment from moving once ``(1 - beta) * g`` is below half an ulp of it. So Adam on a float16
parameter with the constant gradient 2**-10 gives updates 1.0, 1.414, 3.156, 6.984 at steps 1, 2, 10,
50 with float16 moments, and 0.99999 (the float64 answer) with float32 ones. ``torch.optim`` keeps
the state in the parameter's dtype; pass ``moment_dtype=torch.float16`` (or ``torch.bfloat16``) to
get that, e.g. to halve the state's memory, knowing the above.

The Adam family (``scale_by_adam``, ``adam``, ``adamw``) also stores its moments block-quantized:
``moment_dtype="int8"``, ``"int4"`` or ``torch.float8_e4m3fn`` (torchao's ``AdamW8bit``, ``AdamW4bit``,
``AdamWFp8``: about 0.25x, 0.13x and 0.25x the bytes of float32 moments). The format is static data the
transform reads (:mod:`funcamp.optim._moments`); the state holds a ``QuantizedMoment(codes, scale)`` in
place of each moment tensor of at least 4096 elements whose size the block divides.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from funcamp import _scope, _tree
from funcamp.optim import _flat, _inplace, _moments
from funcamp.optim.base import (
    EmptyState,
    GradientTransformation,
    Params,
    Updates,
    check_beta,
    check_bool,
    check_nonnegative,
    check_positive,
    check_real,
    compute_dtype,
    empty_init,
    zero_count,
)
from funcamp.optim.schedules import Schedule, constant

__all__ = [
    "ScaleByAdamState",
    "ScaleByLearningRateState",
    "ScaleByLionState",
    "TraceState",
    "add_decayed_weights",
    "clip_by_global_norm",
    "learning_rate",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_lion",
    "trace",
]


class ScaleByAdamState(NamedTuple):
    """State of ``scale_by_adam``."""

    count: torch.Tensor  # 0-d int32: number of updates applied so far
    mu: Updates  # tree like params: first moment (EMA of gradients), in moment_dtype or at least float32
    nu: Updates  # tree like params: second moment (EMA of squared gradients), same dtypes as mu


class ScaleByLionState(NamedTuple):
    """State of ``scale_by_lion``."""

    count: torch.Tensor  # 0-d int32: number of updates applied so far
    mu: Updates  # tree like params: momentum (EMA of gradients, rate b2), in moment_dtype or at least float32


class TraceState(NamedTuple):
    """State of ``trace``."""

    trace: Updates  # tree like params: the momentum buffer, in moment_dtype or at least float32


class ScaleByLearningRateState(NamedTuple):
    """State of ``scale_by_learning_rate``."""

    count: torch.Tensor  # 0-d int32: number of updates applied so far (the schedule's input)
    learning_rate: torch.Tensor  # 0-d float32: the rate of the latest update; schedule(0) after init


def _map_n(
    n: int, fn: Callable[..., tuple[Any, ...]], tree: Any, *rest: Any, name: str | None = None, indexed: bool = False
) -> tuple[Any, ...]:
    """Like ``tree_map`` for a ``fn`` returning ``n`` values: returns ``n`` trees of ``tree``'s structure.

    ``indexed``: ``fn(i, *leaves)`` with ``i`` the leaf's position. ``name`` prefixes the structure error.
    """
    fast = _tree.flatten_same(tree, *rest)  # while torch.compile traces: cheaper than optree's polyfill
    if fast is not None:
        (leaves, *rest_leaves), rebuild = fast
        rows = zip(leaves, *rest_leaves, strict=True)
        outs = [fn(i, *xs) for i, xs in enumerate(rows)] if indexed else [fn(*xs) for xs in rows]
        return tuple(rebuild([o[i] for o in outs]) for i in range(n))
    leaves, spec = _tree.tree_flatten(tree)
    rest_leaves = []
    for other in rest:
        other_leaves, other_spec = _tree.tree_flatten(other)
        if not _tree.same_structure(spec, other_spec, len(leaves), len(other_leaves)):
            what = f"{name}: updates, params and state" if name else "updates and optimizer state"
            raise ValueError(
                f"{what} must have the same structure, got {spec} and {other_spec}; "
                "build the state with init(params) on parameters shaped like the gradients"
            )
        rest_leaves.append(other_leaves)
    rows = zip(leaves, *rest_leaves, strict=True)
    outs = [fn(i, *xs) for i, xs in enumerate(rows)] if indexed else [fn(*xs) for xs in rows]
    return tuple(_tree.tree_unflatten(spec, [o[i] for o in outs]) for i in range(n))


def _zeros(params: Params, fmt: _moments.MomentFormat) -> Updates:
    """Zero moments for ``params`` in format ``fmt``: a tensor shaped like each parameter (in ``fmt``'s dtype, or
    by default in at least float32: the moment rule), or a block-quantized :class:`funcamp.optim.QuantizedMoment`.
    Which parameters are quantized is a value per leaf (:func:`funcamp.optim._flat.leaf_values`), as a mask's:
    over flat buffers, each buffer's parameters'."""
    if not fmt.blockwise:
        return _tree.tree_map(fmt.zeros, params)
    leaves, spec = _tree.tree_flatten(params)
    quantized = _flat.leaf_values(fmt, params, lambda: [fmt.quantizes(p.numel()) for p in leaves])
    return _tree.tree_unflatten(spec, [fmt.zeros(p, q) for p, q in zip(leaves, quantized, strict=True)])


def _map_moments(n: int, fn: Callable[..., tuple[Any, ...]], tree: Any, *moments: Any, name: str) -> tuple[Any, ...]:
    """:func:`_map_n` for moment trees that may hold a :class:`funcamp.optim.QuantizedMoment` (a subtree) where
    ``tree`` holds a tensor: each is passed to ``fn`` whole; returns ``n`` trees of ``tree``'s structure."""
    outs: list[tuple[Any, ...]] = []

    def call(*xs: Any) -> int:
        outs.append(fn(*xs))
        return len(outs) - 1

    try:
        index = _tree.tree_map(call, tree, *moments)
    except ValueError as e:
        raise ValueError(
            f"{name}: updates and optimizer state must have the same structure ({e}); build the state with "
            "init(params) on parameters shaped like the gradients"
        ) from None
    fast = _tree.flatten_same(tree)  # while torch.compile traces: one walk for the n trees (outs in leaf order)
    if fast is not None:
        rebuild = fast[1]
        return tuple(rebuild([o[k] for o in outs]) for k in range(n))
    return tuple(_tree.tree_map(lambda i, k=k: outs[i][k], index) for k in range(n))


def _scale_leaf(u: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    return _inplace.reuse(u, (u.to(compute_dtype(u.dtype)) * factor).to(u.dtype))


def scale(factor: float) -> GradientTransformation:
    """Multiply every update by the constant ``factor`` (computed in float32 for low precision).

    Args:
      factor: a finite real number (use ``scale_by_learning_rate`` for a schedule).
    Returns:
      A ``GradientTransformation`` with an ``EmptyState``.
    Raises:
      ValueError: if ``factor`` is not a finite real number.

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> optim.scale(-2.0).update({"w": torch.ones(2)}, optim.EmptyState())[0]["w"]
      tensor([-2., -2.])
    """
    factor = check_real("scale", "factor", factor)

    def update(updates: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        del params
        return _tree.tree_map(lambda u: _scale_leaf(u, factor), updates), state

    return _flat.elementwise(_inplace.in_place(GradientTransformation(empty_init, update)))


def _bias_correction(beta: float, t: torch.Tensor) -> torch.Tensor:
    # 1 - beta**t as -expm1(t * log(beta)): accurate to float32 round-off even for beta near 1,
    # where 1 - float32(beta) loses digits (1 - 0.999 in float32 is off by 1.3e-5 relatively).
    if beta == 0.0:
        return torch.ones_like(t)
    return -torch.expm1(t * math.log(beta))


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    nesterov: bool = False,
    moment_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Rescale updates by Adam's bias-corrected moment estimates.

    With step ``t`` counted from 1 (as ``torch.optim.Adam``) and gradient ``g``:

    .. math::
       m_t = \beta_1 m_{t-1} + (1 - \beta_1) g, \qquad v_t = \beta_2 v_{t-1} + (1 - \beta_2) g^2,

       u = \frac{\hat m_t}{\sqrt{v_t / (1 - \beta_2^t) + \epsilon_{root}} + \epsilon}, \qquad
       \hat m_t = m_t / (1 - \beta_1^t)

    and with ``nesterov=True`` (NAdam, Dozat 2016, in optax's form):
    ``\hat m_t = \beta_1 m_t / (1 - \beta_1^{t+1}) + (1 - \beta_1) g / (1 - \beta_1^t)``, without
    Dozat's extra factor ``\beta_2`` on ``v``. That is ``optax.scale_by_adam(nesterov=True)`` (``optax.nadam``),
    not ``torch.optim.NAdam``, whose momentum decays on a schedule (``momentum_decay``).

    The bias corrections are 0-d float32 tensors computed from the step count, so a compiled step
    does not recompile as it advances.

    Args:
      b1: ``beta_1``, the decay of the first moment, in [0, 1).
      b2: ``beta_2``, the decay of the second moment, in [0, 1).
      eps: added to the denominator outside the square root, >= 0.
      eps_root: added inside the square root, >= 0 (useful when differentiating through the update), as
        optax's ``eps_root``: ``sqrt(v_hat + eps_root)``, with ``v_hat`` the bias-corrected second moment.
      nesterov: keyword-only (as optax's), a bool: Nesterov momentum (NAdam), above.
      moment_dtype: the format of both moments. A floating dtype (e.g. ``torch.bfloat16`` to halve their
        memory); ``None`` (default): float32 for float16 and bfloat16 parameters, else the parameter's dtype
        (see the moment rule in the module docstring: a float16 ``v`` flushes ``g**2`` to 0 for
        ``|g| < 2**-12``). optax's ``mu_dtype`` only sets the first moment. Block-quantized, as torchao's
        low-bit AdamW: ``"int8"`` (blocks of 256, a dynamic quantization map), ``"int4"`` (blocks of 128,
        two codes a byte) or ``torch.float8_e4m3fn`` (blocks of 256 scaled by ``amax / 448``); a parameter
        with fewer than 4096 elements, or a size the block does not divide, keeps float32 moments (torchao's
        rule; torchao keeps them in the parameter's dtype). Quantized moments are updated in float32 from
        their decoded values, ``v`` as torchao's ``lerp``, and the update uses the new moments before they
        are quantized: torchao's order, with its codes bit for bit. Blockwise: over flat buffers each
        parameter's blocks stay its own (:mod:`funcamp.optim._moments`).
    Returns:
      A ``GradientTransformation`` with a ``ScaleByAdamState``; the updates are the ascent direction
      (chain with ``scale_by_learning_rate`` to descend).
    Raises:
      ValueError: if ``b1`` or ``b2`` is not in [0, 1).
      ValueError: if ``eps`` or ``eps_root`` is negative or not finite.
      TypeError: if ``nesterov`` is not a bool.
      ValueError: if ``moment_dtype`` is not ``None``, a floating dtype of 16 bits or more,
        ``torch.float8_e4m3fn``, ``"int8"`` or ``"int4"``.
      ValueError: (from ``update``) if the updates and the state differ in structure.
    References:
      Kingma & Ba 2015, "Adam: A Method for Stochastic Optimization", arXiv:1412.6980.
      Dozat 2016, "Incorporating Nesterov Momentum into Adam", ICLR workshop.
      Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", arXiv:2110.02861.
      Li et al. 2023, "Memory Efficient Optimizers with 4-bit States", arXiv:2309.01507.

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> opt = optim.scale_by_adam()
      >>> params = {"w": torch.zeros(2)}
      >>> updates, state = opt.update({"w": torch.tensor([0.1, -3.0])}, opt.init(params))
      >>> updates["w"], state.count
      (tensor([ 1.0000, -1.0000]), tensor(1, dtype=torch.int32))
    """
    fn = "scale_by_adam"
    b1, b2 = check_beta(fn, "b1", b1), check_beta(fn, "b2", b2)
    eps, eps_root = check_nonnegative(fn, "eps", eps), check_nonnegative(fn, "eps_root", eps_root)
    nesterov = check_bool(fn, "nesterov", nesterov)
    fmt = _moments.moment_format(fn, moment_dtype)

    def init(params: Params) -> ScaleByAdamState:
        return ScaleByAdamState(count=zero_count(params), mu=_zeros(params, fmt), nu=_zeros(params, fmt))

    def update(updates: Updates, state: ScaleByAdamState, params: Params = None) -> tuple[Updates, ScaleByAdamState]:
        del params
        count = state.count + 1
        t = count.to(torch.float32)
        bc1, bc2 = _bias_correction(b1, t), _bias_correction(b2, t)
        bc2_sqrt = bc2.sqrt()
        bc1_next = _bias_correction(b1, t + 1.0) if nesterov else bc1

        def leaf(g: torch.Tensor, m: Any, v: Any) -> tuple[Any, ...]:
            m_in, v_in = fmt.read(m, g, signed=True), fmt.read(v, g, signed=False)  # quantized: decoded, float32
            c = compute_dtype(g.dtype, m_in.dtype)
            g_c = g.to(c)
            m_c = m_in.to(c).lerp(g_c, 1.0 - b1)
            v_c = fmt.second_moment(v_in.to(c), g_c, b2)  # torch.optim's arithmetic, or torchao's
            # sqrt(v / bc2 + eps_root), written as torch.optim writes it when eps_root == 0 (then no add of
            # 0 * bc2 either: the same bits, v >= +0, and one graph node fewer per leaf or flat buffer).
            v_root = v_c + eps_root * bc2 if eps_root else v_c
            denom = v_root.sqrt() / bc2_sqrt + eps
            # NAdam (optax's form): b1 * m / (1 - b1**(t+1)) + (1 - b1) * g / (1 - b1**t).
            m_hat = (m_c / bc1_next) * b1 + (g_c / bc1) * (1.0 - b1) if nesterov else m_c / bc1
            u = (m_hat / denom).to(g.dtype)
            # In a donating eager step: u into g's buffer, the moments into the donated ones (funcamp.optim._inplace).
            # The moments stored in their format (quantized: new codes and scales).
            return _inplace.reuse(g, u), fmt.write(m, m_c, signed=True), fmt.write(v, v_c, signed=False)

        u, mu, nu = _map_moments(3, leaf, updates, state.mu, state.nu, name=fn)
        return u, ScaleByAdamState(count=count, mu=mu, nu=nu)

    result = _inplace.in_place(GradientTransformation(init, update))
    if fmt.blockwise:  # blockwise: exact over flat buffers that keep each parameter's blocks its own
        _moments.mark_blockwise(result, fmt)
    return _flat.elementwise(result)


def scale_by_lion(
    b1: float = 0.9, b2: float = 0.99, *, moment_dtype: torch.dtype | None = None
) -> GradientTransformation:
    r"""Replace updates by the sign of Lion's interpolated momentum.

    .. math::
       u = \mathrm{sign}(\beta_1 m_{t-1} + (1 - \beta_1) g), \qquad m_t = \beta_2 m_{t-1} + (1 - \beta_2) g

    Every element of the update is -1, 0 or +1, so Lion wants a learning rate 3-10x smaller than
    AdamW's and a weight decay 3-10x larger (Chen et al.).

    Args:
      b1: the interpolation rate used for the update, in [0, 1).
      b2: the decay of the momentum, in [0, 1).
      moment_dtype: dtype of the momentum; ``None`` (default): float32 for float16 and bfloat16
        parameters, else the parameter's dtype (the moment rule in the module docstring).
    Returns:
      A ``GradientTransformation`` with a ``ScaleByLionState``.
    Raises:
      ValueError: if ``b1`` or ``b2`` is not in [0, 1).
      ValueError: if ``moment_dtype`` is not ``None`` or a floating dtype of 16 bits or more (block-quantized
        moments are the Adam family's).
    References:
      Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", arXiv:2302.06675.

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> opt = optim.scale_by_lion()
      >>> params = {"w": torch.zeros(3)}
      >>> opt.update({"w": torch.tensor([0.2, 0.0, -5.0])}, opt.init(params))[0]["w"]
      tensor([ 1.,  0., -1.])
    """
    fn = "scale_by_lion"
    b1, b2 = check_beta(fn, "b1", b1), check_beta(fn, "b2", b2)
    fmt = _moments.moment_format(fn, moment_dtype, quantized=False)

    def init(params: Params) -> ScaleByLionState:
        return ScaleByLionState(count=zero_count(params), mu=_zeros(params, fmt))

    def update(updates: Updates, state: ScaleByLionState, params: Params = None) -> tuple[Updates, ScaleByLionState]:
        del params

        def leaf(g: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            c = compute_dtype(g.dtype, m.dtype)
            g_c, m_c = g.to(c), m.to(c)
            u, new_m = torch.sign(m_c.lerp(g_c, 1.0 - b1)).to(g.dtype), m_c.lerp(g_c, 1.0 - b2).to(m.dtype)
            return _inplace.reuse(g, u), _inplace.write(m, new_m)  # both made before either is written

        u, mu = _map_n(2, leaf, updates, state.mu)
        return u, ScaleByLionState(count=state.count + 1, mu=mu)

    return _flat.elementwise(_inplace.in_place(GradientTransformation(init, update)))


def trace(decay: float, nesterov: bool = False, *, moment_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Accumulate a momentum trace of the updates (heavy ball, or Nesterov).

    .. math::
       b_t = \mu\, b_{t-1} + g, \qquad u = b_t \ \text{or, with Nesterov,}\ u = g + \mu\, b_t

    With ``b_0 = 0`` the first trace is ``g``, as ``torch.optim.SGD`` with ``dampening=0``.

    Args:
      decay: the momentum ``mu``, >= 0.
      nesterov: use Nesterov momentum.
      moment_dtype: dtype of the trace; ``None`` (default): float32 for float16 and bfloat16
        parameters, else the parameter's dtype (the moment rule in the module docstring).
    Returns:
      A ``GradientTransformation`` with a ``TraceState``.
    Raises:
      ValueError: if ``decay`` is negative or not finite.
      TypeError: if ``nesterov`` is not a bool.
      ValueError: if ``moment_dtype`` is not ``None`` or a floating dtype of 16 bits or more (block-quantized
        moments are the Adam family's).

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> opt = optim.trace(0.5)
      >>> params = {"w": torch.zeros(1)}
      >>> u, state = opt.update({"w": torch.ones(1)}, opt.init(params))
      >>> opt.update({"w": torch.ones(1)}, state)[0]["w"]
      tensor([1.5000])
    """
    decay = check_nonnegative("trace", "decay", decay)
    nesterov = check_bool("trace", "nesterov", nesterov)
    fmt = _moments.moment_format("trace", moment_dtype, quantized=False)

    def init(params: Params) -> TraceState:
        return TraceState(trace=_zeros(params, fmt))

    def update(updates: Updates, state: TraceState, params: Params = None) -> tuple[Updates, TraceState]:
        del params

        def leaf(g: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            c = compute_dtype(g.dtype, b.dtype)
            g_c = g.to(c)
            b_c = b.to(c).mul(decay).add(g_c)
            u = g_c.add(b_c, alpha=decay) if nesterov else b_c
            return _inplace.reuse(g, u.to(g.dtype)), _inplace.write(b, b_c.to(b.dtype))

        u, new_trace = _map_n(2, leaf, updates, state.trace)
        return u, TraceState(trace=new_trace)

    return _flat.elementwise(_inplace.in_place(GradientTransformation(init, update)))


Mask = Any  # a tree of Python bools shaped like params, or a callable params -> such a tree


def add_decayed_weights(weight_decay: float, mask: Mask | None = None) -> GradientTransformation:
    r"""Add ``weight_decay * param`` to each update (L2 decay, or decoupled decay when chained late).

    .. math:: u \leftarrow u + \lambda\, p

    Placed before an adaptive scaling (as in ``adam``) this is L2 regularisation, like
    ``torch.optim.Adam(weight_decay=...)``; placed after it and before ``scale_by_learning_rate``
    (as in ``adamw``) it is decoupled weight decay, ``p <- p - lr * wd * p``.

    Args:
      weight_decay: ``lambda``, >= 0.
      mask: ``None`` (decay every leaf), or a tree of Python bools with the structure of params or a prefix
        of it (one bool for a whole subtree, as optax's; dict keys matched whole, not as dotted prefixes: see
        ``funcamp.optim.groups``), or a callable ``params -> such a tree``; leaves marked ``False`` are passed
        through.
    Returns:
      A ``GradientTransformation`` with an ``EmptyState``; ``update`` needs ``params``.
    Raises:
      ValueError: if ``weight_decay`` is negative or not finite.
      ValueError: (from ``update``) if ``params`` is ``None`` and ``weight_decay > 0``.
      TypeError: (from ``update``) if a mask leaf is not a Python bool.
      ValueError: (from ``update``) if the mask is neither the structure of params nor a prefix of it.

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> params = {"b": torch.ones(1), "w": torch.ones(1)}
      >>> opt = optim.add_decayed_weights(0.1, mask={"b": False, "w": True})
      >>> opt.update({"b": torch.zeros(1), "w": torch.zeros(1)}, opt.init(params), params)[0]
      {'b': tensor([0.]), 'w': tensor([0.1000])}
    """
    weight_decay = check_nonnegative("add_decayed_weights", "weight_decay", weight_decay)

    def decay(u: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        c = compute_dtype(u.dtype, p.dtype)
        return _inplace.reuse(u, u.to(c).add(p.to(c), alpha=weight_decay).to(u.dtype))

    def masked(u: torch.Tensor, p: torch.Tensor, keep: Any) -> torch.Tensor:
        if not isinstance(keep, bool):
            raise TypeError(f"add_decayed_weights: mask leaves must be Python bools, got {type(keep).__name__}")
        return decay(u, p) if keep else u

    def update(updates: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        if weight_decay == 0.0:
            return updates, state
        if params is None:
            raise ValueError("add_decayed_weights: update needs the parameters: call update(updates, state, params)")
        if mask is None:
            return _tree.tree_map(decay, updates, params), state

        def evaluate() -> list[Any]:  # one value per leaf of params (over flat buffers: theirs, _flat)
            tree_mask = mask(params) if callable(mask) else mask
            return _tree.prefix_leaves(tree_mask, params, "add_decayed_weights", "mask")  # optax's prefix trees

        keep = _flat.leaf_values(mask, params, evaluate)
        (out,) = _map_n(1, lambda i, u, p: (masked(u, p, keep[i]),), updates, params, indexed=True)
        return out, state

    return _flat.elementwise(_inplace.in_place(GradientTransformation(empty_init, update)))


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    r"""Scale all updates down together so that their global L2 norm is at most ``max_norm``.

    .. math:: u \leftarrow u \cdot \frac{c}{\lVert u \rVert} \ \text{if}\ \lVert u \rVert > c
       \ \text{else}\ u

    The norm is that of ``_tree.global_norm``: over all floating and complex leaves, in float32
    (float64 if a leaf is float64), scaled by a power of two so that finite updates always have a
    finite norm (finite updates are never multiplied by 0 because their squares overflowed). The factor
    ``c / norm`` is computed from the scaled norm and rounded once; where it would be subnormal (a norm
    above ``c * 2**126`` in float32, even one beyond float32's range) it is applied as two factors
    instead, the exact power of two first, so that the clipped updates keep full precision. The
    multiplication runs in float32 (float64 if any leaf is float64) and rounds once to each update's
    dtype. Updates whose norm is at most ``max_norm`` are returned unchanged
    (bit for bit), and so are updates with a NaN or inf element (a skipped step still sees its
    non-finite gradients). ``torch.nn.utils.clip_grad_norm_`` instead always multiplies by
    ``min(1, c / (norm + 1e-6))``, with a norm that overflows to inf for large finite gradients.

    Cost: that of the norm (one extra read of each bfloat16, float32 and float64 leaf, see
    ``_tree.scaled_global_norm``) and a second multiplication by a 0-d factor, fused when compiled.

    In every process layout: inside a train step the norm is the step's layout's
    (``funcamp._scope.current().scaled_global_norm``, the state's layout): in a sharded step the norm
    over every rank's shards (a float64 sum of squares, padding excluded, one ``all_reduce``; the factor
    ``c / norm`` computed in float64 and rounded once to float32), under plain data parallelism and in one
    process the local norm above (data-parallel gradients are already averaged, the same on every rank).
    Outside a step, the norm of the updates given. So one clip is right everywhere; never pass a group.

    Args:
      max_norm: ``c``, > 0.
    Returns:
      A ``GradientTransformation`` with an ``EmptyState``.
    Raises:
      ValueError: if ``max_norm`` is not a finite number > 0.
      TypeError: (from ``update``) if an update leaf is not a tensor (the message names it).

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> clip = optim.clip_by_global_norm(1.0)
      >>> clip.update({"w": torch.tensor([3.0, 4.0])}, optim.EmptyState())[0]["w"]
      tensor([0.6000, 0.8000])
      >>> clip.update({"w": torch.tensor([3e30, 4e30])}, optim.EmptyState())[0]["w"]  # squares overflow float32
      tensor([0.6000, 0.8000])
    """
    max_norm = check_positive("clip_by_global_norm", "max_norm", max_norm)

    def update(updates: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        del params
        layout = _scope.current()  # the train step's layout, or None outside a step (this process's tensors)
        if layout is None:
            t, s = _tree.scaled_global_norm(updates, "clip_by_global_norm")
        else:  # over all ranks' shards in a sharded step (float64, s = 1), else as above
            t, s = layout.scaled_global_norm(updates, "clip_by_global_norm")  # norm == t / s, s a power of two
        clip = torch.isfinite(t) & (t / s > max_norm)  # t / s is inf (not NaN) past the dtype's range
        ratio = max_norm / t  # c / norm == ratio * s, rounded once, wherever that is a normal number
        factor = ratio * s
        normal = factor >= torch.finfo(t.dtype).tiny
        one = torch.ones_like(t)
        # The factors in the updates' accumulation dtype (float64 if a leaf is): a no-op for a norm of this
        # process's tensors, which is in that dtype; a sharded norm (float64) is rounded to it once.
        acc = _tree.norm_dtype(updates, "clip_by_global_norm")
        first = torch.where(clip, torch.where(normal, factor, s), one).to(acc)
        second = torch.where(clip & ~normal, ratio, one).to(acc)  # 1 (exact) unless c / norm is subnormal

        def leaf(u: torch.Tensor) -> torch.Tensor:
            c = torch.promote_types(compute_dtype(u.dtype), acc)
            return _inplace.reuse(u, (u.to(c) * first * second).to(u.dtype))

        return _tree.tree_map(leaf, updates), state

    return _flat.elementwise(_inplace.in_place(GradientTransformation(empty_init, update)))


def scale_by_learning_rate(learning_rate: float | Schedule, *, flip_sign: bool = True) -> GradientTransformation:
    r"""Multiply updates by ``-learning_rate`` (a constant or a schedule of the step count).

    .. math:: u \leftarrow -\eta(t)\, u, \qquad t = \text{number of updates applied before this one}

    The rate is a 0-d float32 tensor (a float is turned into ``constant(learning_rate)``), so a
    compiled step does not recompile as a schedule changes; the state records the rate used by the
    latest update for logging (see ``learning_rate``).

    Args:
      learning_rate: a float >= 0, or ``schedule(count) -> 0-d float32 tensor``.
      flip_sign: multiply by ``-learning_rate`` (descent, the default) rather than ``+learning_rate``.
    Returns:
      A ``GradientTransformation`` with a ``ScaleByLearningRateState``.
    Raises:
      ValueError: if ``learning_rate`` is a number that is negative or not finite.
      TypeError: if ``learning_rate`` is neither a real number nor callable.

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> opt = optim.scale_by_learning_rate(optim.linear_schedule(1.0, 0.0, 4))
      >>> params = {"w": torch.zeros(1)}
      >>> state = opt.init(params)
      >>> u, state = opt.update({"w": torch.ones(1)}, state)
      >>> u, state = opt.update({"w": torch.ones(1)}, state)
      >>> u["w"], optim.learning_rate(state)
      (tensor([-0.7500]), tensor(0.7500))
    """
    if callable(learning_rate):
        schedule = learning_rate
    elif isinstance(learning_rate, (int, float)) and not isinstance(learning_rate, bool):
        schedule = constant(check_nonnegative("scale_by_learning_rate", "learning_rate", learning_rate))
    else:
        raise TypeError(
            "scale_by_learning_rate: learning_rate must be a float >= 0 or a schedule "
            f"count -> 0-d tensor, got {type(learning_rate).__name__}"
        )
    sign = -1.0 if flip_sign else 1.0

    def rate(count: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(schedule(count), dtype=torch.float32, device=count.device)

    def init(params: Params) -> ScaleByLearningRateState:
        count = zero_count(params)
        return ScaleByLearningRateState(count=count, learning_rate=rate(count))

    def update(
        updates: Updates, state: ScaleByLearningRateState, params: Params = None
    ) -> tuple[Updates, ScaleByLearningRateState]:
        del params
        lr = rate(state.count)
        factor = sign * lr
        new_updates = _tree.tree_map(lambda u: _scale_leaf(u, factor.to(compute_dtype(u.dtype))), updates)
        return new_updates, ScaleByLearningRateState(count=state.count + 1, learning_rate=lr)

    return _flat.elementwise(_inplace.in_place(GradientTransformation(init, update)))


def learning_rate(opt_state: Any, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Return the learning rate of the latest update recorded in an optimizer state.

    Searches ``opt_state`` (a state, or nested tuples, lists and dicts of states, as ``chain``
    builds) for the first ``ScaleByLearningRateState`` and returns its ``learning_rate`` field. No
    host sync: the result is the device tensor itself.

    Args:
      opt_state: an optimizer state.
      device: where the NaN of a state without a rate is made (default: the device of the state's first
        tensor; the CPU if it has none). A train step passes its parameters' device, so that nothing in
        it is a host tensor.
    Returns:
      A 0-d float32 tensor: the rate used by the latest update (``schedule(0)`` before any update),
      or NaN if the state holds no ``ScaleByLearningRateState`` (on ``device``, else the device of the
      state's first tensor; CPU if it has none).

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> opt = optim.adamw(1e-3)
      >>> optim.learning_rate(opt.init({"w": torch.zeros(2)}))
      tensor(0.0010)
      >>> optim.learning_rate(optim.EmptyState())
      tensor(nan)
    """
    found = _find_lr_state(opt_state)
    if found is None:
        if device is None:
            tensors = [x for x in _tree.tree_leaves(opt_state) if isinstance(x, torch.Tensor)]
            device = tensors[0].device if tensors else None
        return torch.full((), math.nan, dtype=torch.float32, device=device)
    return found.learning_rate


def _find_lr_state(state: Any) -> ScaleByLearningRateState | None:
    if isinstance(state, ScaleByLearningRateState):
        return state
    children = state.values() if isinstance(state, dict) else state if isinstance(state, (tuple, list)) else ()
    for child in children:
        if isinstance(child, torch.Tensor):  # a moment or a count: no state below it (and no call traced per leaf)
            continue
        found = _find_lr_state(child)
        if found is not None:
            return found
    return None
