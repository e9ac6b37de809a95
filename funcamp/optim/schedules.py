"""Learning-rate schedules: ``count -> rate``, built from tensor ops only.

Each schedule maps a 0-d integer step count (the number of updates already applied, starting at 0)
to a 0-d float32 tensor on the count's device. They use ``torch.where``, ``clamp`` and ``torch.cos``,
never Python branches on tensor values or ``.item()``, so a compiled train step does not recompile as
the count advances. A Python ``int`` count is accepted too (handy in tests and plots).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from funcamp.optim.base import check_positive, check_real, check_steps

__all__ = ["Schedule", "constant", "cosine_decay", "linear_schedule", "linear_warmup", "warmup_cosine_decay"]

Schedule = Callable[[torch.Tensor], torch.Tensor]


def _float_count(count: torch.Tensor | int) -> torch.Tensor:
    return torch.as_tensor(count).to(torch.float32)


def constant(value: float) -> Schedule:
    """Return the schedule that is ``value`` at every step.

    Args:
      value: the rate, a finite real number.
    Returns:
      ``schedule(count) -> 0-d float32 tensor`` on the count's device.
    Raises:
      ValueError: if ``value`` is not a finite real number.

    Example:
      >>> import torch
      >>> from funcamp.optim import constant
      >>> constant(0.5)(torch.tensor(7))
      tensor(0.5000)
    """
    value = check_real("constant", "value", value)

    def schedule(count: torch.Tensor | int) -> torch.Tensor:
        return torch.full_like(_float_count(count), value)

    return schedule


def linear_schedule(init_value: float, end_value: float, transition_steps: int) -> Schedule:
    r"""Return a schedule that moves linearly from ``init_value`` to ``end_value``, then stays.

    .. math:: \eta(t) = \eta_0 + (\eta_1 - \eta_0)\,\mathrm{clamp}(t / T, 0, 1)

    Args:
      init_value: the rate at step 0.
      end_value: the rate at step ``transition_steps`` and after.
      transition_steps: ``T``, an integer >= 1.
    Returns:
      ``schedule(count) -> 0-d float32 tensor``.
    Raises:
      ValueError: if ``init_value`` or ``end_value`` is not a finite real number.
      ValueError: if ``transition_steps`` is not an integer >= 1 (optax instead returns
        ``init_value`` forever for ``T <= 0``).

    Example:
      >>> from funcamp.optim import linear_schedule
      >>> linear_schedule(1.0, 0.0, 4)(1)
      tensor(0.7500)
    """
    fn = "linear_schedule"
    init_value = check_real(fn, "init_value", init_value)
    end_value = check_real(fn, "end_value", end_value)
    steps = check_steps(fn, "transition_steps", transition_steps, 1)

    def schedule(count: torch.Tensor | int) -> torch.Tensor:
        frac = (_float_count(count) / steps).clamp(0.0, 1.0)
        return init_value + (end_value - init_value) * frac

    return schedule


def linear_warmup(init_value: float, peak_value: float, warmup_steps: int) -> Schedule:
    """Return a linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then flat.

    The same as ``linear_schedule(init_value, peak_value, warmup_steps)``.

    Args:
      init_value: the rate at step 0.
      peak_value: the rate at step ``warmup_steps`` and after.
      warmup_steps: an integer >= 1.
    Returns:
      ``schedule(count) -> 0-d float32 tensor``.
    Raises:
      ValueError: if a value is not a finite real number, or ``warmup_steps`` is not an integer >= 1.

    Example:
      >>> from funcamp.optim import linear_warmup
      >>> linear_warmup(0.0, 1e-3, 10)(5)
      tensor(0.0005)
    """
    fn = "linear_warmup"
    check_steps(fn, "warmup_steps", warmup_steps, 1)
    check_real(fn, "init_value", init_value)
    check_real(fn, "peak_value", peak_value)
    return linear_schedule(init_value, peak_value, warmup_steps)


def cosine_decay(init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0) -> Schedule:
    r"""Return a cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``.

    .. math:: \eta(t) = \eta_0 \left((1 - \alpha)\left[\tfrac12\left(1 + \cos(\pi \min(t, T) / T)\right)
       \right]^p + \alpha\right)

    As optax's ``cosine_decay_schedule(init_value, decay_steps, alpha, exponent)``, same positional order.

    Args:
      init_value: the rate at step 0.
      decay_steps: ``T``, an integer >= 1; the rate stays at ``alpha * init_value`` after it.
      alpha: the final rate as a fraction of ``init_value``, in [0, 1].
      exponent: ``p``, a finite number > 0 (default 1: the plain cosine); > 1 decays faster at first.
    Returns:
      ``schedule(count) -> 0-d float32 tensor``.
    Raises:
      ValueError: if ``init_value`` is not a finite real number.
      ValueError: if ``decay_steps`` is not an integer >= 1.
      ValueError: if ``alpha`` is not in [0, 1].
      ValueError: if ``exponent`` is not a finite number > 0 (optax accepts any: ``p = 0`` is a constant rate,
        ``p < 0`` is infinite at step ``T``).
    References:
      Loshchilov & Hutter 2017, "SGDR: Stochastic Gradient Descent with Warm Restarts",
      arXiv:1608.03983.

    Example:
      >>> from funcamp.optim import cosine_decay
      >>> cosine_decay(1.0, 10)(5)
      tensor(0.5000)
    """
    fn = "cosine_decay"
    init_value = check_real(fn, "init_value", init_value)
    steps = check_steps(fn, "decay_steps", decay_steps, 1)
    if not 0.0 <= check_real(fn, "alpha", alpha) <= 1.0:
        raise ValueError(f"{fn}: alpha must be in [0, 1], got {alpha!r}")
    alpha = float(alpha)
    exponent = check_positive(fn, "exponent", exponent)

    def schedule(count: torch.Tensor | int) -> torch.Tensor:
        frac = (_float_count(count) / steps).clamp(0.0, 1.0)
        cosine = _power(0.5 * (1.0 + torch.cos(math.pi * frac)), exponent)
        return init_value * ((1.0 - alpha) * cosine + alpha)

    return schedule


def warmup_cosine_decay(
    peak_value: float,
    warmup: int,
    total: int,
    *,
    init_value: float = 0.0,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    r"""Return a linear warmup to ``peak_value`` followed by a cosine decay to ``end_value``.

    With ``W = warmup``, ``D = total - warmup`` and ``p = exponent``:

    .. math:: \eta(t) = \begin{cases}
       \eta_0 + (\eta_p - \eta_0)\, t / W & t < W \\
       \eta_e + (\eta_p - \eta_e)\left[\tfrac12\left(1 + \cos(\pi \min(t - W, D) / D)\right)\right]^p
       & t \ge W
       \end{cases}

    This is optax's ``warmup_cosine_decay_schedule(init_value, peak_value, warmup_steps, decay_steps,
    end_value, exponent)`` with ``decay_steps = total``: ``total`` counts the warmup steps, as optax's
    ``decay_steps`` does, and the rate is ``end_value`` from step ``total`` on. ``init_value``,
    ``end_value`` and ``exponent`` are keyword-only: optax's function takes ``init_value`` first, so a call
    in its order is refused rather than read as another schedule.

    A ``peak_value`` of 0 with ``end_value`` 0 is 0 from step ``W`` on (and during warmup the line from
    ``init_value`` to 0), as optax's. A ``peak_value`` of 0 with another ``end_value`` is refused: optax
    then drops ``end_value`` (its decay is ``peak * ((1 - alpha) c + alpha)`` with ``alpha = end / peak``,
    which it sets to 0 for a zero peak) and is 0 after warmup, where the formula above would rise to
    ``end_value``; neither answer is what such a call means, so say which you want.

    Args:
      peak_value: the rate at the end of warmup.
      warmup: ``W``, the number of warmup steps, an integer >= 0 (0: start at ``peak_value``).
      total: the step at which the decay ends, an integer > ``warmup``.
      init_value: keyword-only, the rate at step 0 (default 0).
      end_value: keyword-only, the rate at step ``total`` and after (default 0).
      exponent: keyword-only, ``p``, a finite number > 0 (default 1: the plain cosine), as optax's.
    Returns:
      ``schedule(count) -> 0-d float32 tensor``.
    Raises:
      ValueError: if ``peak_value``, ``init_value`` or ``end_value`` is not a finite real number.
      ValueError: if ``warmup`` is not an integer >= 0.
      ValueError: if ``total`` is not an integer > ``warmup``.
      ValueError: if ``exponent`` is not a finite number > 0.
      ValueError: if ``peak_value`` is 0 and ``end_value`` is not (see above).

    Example:
      >>> from funcamp.optim import warmup_cosine_decay
      >>> schedule = warmup_cosine_decay(3e-4, warmup=100, total=5000)
      >>> [round(schedule(t).item(), 7) for t in (0, 50, 100, 5000)]
      [0.0, 0.00015, 0.0003, 0.0]
    """
    fn = "warmup_cosine_decay"
    peak_value = check_real(fn, "peak_value", peak_value)
    init_value = check_real(fn, "init_value", init_value)
    end_value = check_real(fn, "end_value", end_value)
    warmup = check_steps(fn, "warmup", warmup, 0)
    total = check_steps(fn, "total", total, 1)
    if total <= warmup:
        raise ValueError(
            f"{fn}: total must be greater than warmup (it counts the warmup steps), got "
            f"total={total} and warmup={warmup}"
        )
    exponent = check_positive(fn, "exponent", exponent)
    if peak_value == 0.0 and end_value != 0.0:
        raise ValueError(
            f"{fn}: peak_value=0 with end_value={end_value!r} is refused: optax's warmup_cosine_decay_schedule "
            "drops end_value when the peak is 0 (its rate is 0 after warmup), while this schedule would rise "
            f"from 0 to {end_value!r}. Pass end_value=0 for optax's numbers (0 after warmup), or write the rise "
            "as a schedule of your own (any function count -> 0-d float32 tensor)"
        )
    decay = total - warmup

    def schedule(count: torch.Tensor | int) -> torch.Tensor:
        t = _float_count(count)
        if warmup > 0:
            warm = init_value + (peak_value - init_value) * (t / warmup).clamp(0.0, 1.0)
        else:
            warm = torch.full_like(t, peak_value)
        frac = ((t - warmup) / decay).clamp(0.0, 1.0)
        cosine = _power(0.5 * (1.0 + torch.cos(math.pi * frac)), exponent)
        cool = end_value + (peak_value - end_value) * cosine
        return torch.where(t < warmup, warm, cool)

    return schedule


def _power(cosine: torch.Tensor, exponent: float) -> torch.Tensor:
    """``cosine ** exponent``; the plain cosine, untouched, for the default exponent 1 (``cosine >= 0``)."""
    return cosine if exponent == 1.0 else cosine.pow(exponent)
