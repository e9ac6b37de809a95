"""Ready-made optimizers: ``sgd``, ``adam``, ``adamw`` and ``lion``, each a ``chain`` of transforms.

``sgd``, ``adam`` and ``adamw`` follow ``torch.optim.SGD``, ``Adam`` and ``AdamW`` (their defaults,
their placement of weight decay, Adam's bias correction with the step counted from 1) and match them
to float32 round-off in float32. They differ in two ways, both about precision:

* Arithmetic for float16 and bfloat16 parameters runs in float32 and is rounded once per
  transformation; ``torch.optim`` computes in the parameter dtype.
* Moments are kept in at least float32 by default (``moment_dtype=None``): float32 for float16 and
  bfloat16 parameters, whose squared gradients underflow, overflow or stall in their own dtype;
  ``torch.optim`` keeps state in the parameter dtype. ``moment_dtype`` chooses another dtype (e.g.
  ``torch.bfloat16`` moments to halve their memory), and is then used as given.
"""

from __future__ import annotations

import torch

from funcamp.optim.base import GradientTransformation, chain, check_bool, check_nonnegative
from funcamp.optim.schedules import Schedule
from funcamp.optim.transforms import (
    Mask,
    add_decayed_weights,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    trace,
)

__all__ = ["adam", "adamw", "lion", "sgd"]

LearningRate = float | Schedule


def sgd(
    learning_rate: LearningRate,
    momentum: float | None = 0.0,
    nesterov: bool = False,
    *,
    weight_decay: float = 0.0,
    moment_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Stochastic gradient descent with optional (Nesterov) momentum and L2 weight decay.

    .. math::
       g \leftarrow g + \lambda p, \qquad b_t = \mu b_{t-1} + g, \qquad
       p \leftarrow p - \eta\, (b_t \ \text{or}\ g + \mu b_t)

    As ``torch.optim.SGD(lr, momentum, nesterov=..., weight_decay=..., dampening=0)``; torch's
    ``dampening`` and ``maximize`` have no counterpart (chain ``scale(-1.0)`` first to maximize).
    Positional arguments are optax's (``learning_rate, momentum, nesterov``); ``weight_decay`` and
    ``moment_dtype`` are keyword-only (optax's fourth is its ``accumulator_dtype``).

    Args:
      learning_rate: ``eta``, a float >= 0 or a schedule ``count -> 0-d float32 tensor``.
      momentum: ``mu``, >= 0 (0 or None, as optax: no momentum buffer is kept).
      nesterov: a bool, use Nesterov momentum (needs ``momentum > 0``).
      weight_decay: ``lambda``, >= 0, added to the gradient (coupled, as in torch).
      moment_dtype: dtype of the momentum buffer; ``None`` (default): float32 for float16 and bfloat16
        parameters, else the parameter's dtype (see ``funcamp.optim.transforms``).
    Returns:
      ``chain(add_decayed_weights, trace, scale_by_learning_rate)`` (the ``trace`` only when
      ``momentum > 0``).
    Raises:
      ValueError: if ``learning_rate``, ``momentum`` or ``weight_decay`` is negative or not finite.
      TypeError: if ``nesterov`` is not a bool (torch's third positional argument is ``dampening``).
      ValueError: if ``nesterov`` is set and ``momentum`` is 0.
      ValueError: if ``moment_dtype`` is not ``None`` or a floating dtype of 16 bits or more (block-quantized
        moments are the Adam family's).

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> opt = optim.sgd(0.1, momentum=0.9)
      >>> params = {"w": torch.ones(2)}
      >>> updates, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
      >>> optim.apply_updates(params, updates)["w"]
      tensor([0.9000, 0.9000])
    """
    momentum = check_nonnegative("sgd", "momentum", 0.0 if momentum is None else momentum)
    nesterov = check_bool("sgd", "nesterov", nesterov)
    if nesterov and momentum == 0.0:
        raise ValueError("sgd: nesterov=True needs momentum > 0, got momentum=0")
    transforms = [add_decayed_weights(weight_decay)]
    if momentum > 0.0:
        transforms.append(trace(momentum, nesterov, moment_dtype=moment_dtype))
    transforms.append(scale_by_learning_rate(learning_rate))
    return chain(*transforms)


def adam(
    learning_rate: LearningRate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    moment_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Adam, with optional L2 weight decay added to the gradient (as ``torch.optim.Adam``).

    .. math:: g \leftarrow g + \lambda p, \qquad p \leftarrow p - \eta\, \mathrm{adam}(g)

    where ``adam`` is ``scale_by_adam`` (bias-corrected moments, step counted from 1). As
    ``torch.optim.Adam`` without ``amsgrad``; unlike optax's ``adam``, which has no weight decay.
    Positional arguments are optax's (``learning_rate, b1, b2, eps, eps_root``); the others are
    keyword-only (optax's sixth positional argument is its ``mu_dtype``, which sets the first moment only;
    ``moment_dtype`` sets both). ``nesterov=True`` is optax's ``adam(nesterov=True)``, i.e. ``optax.nadam``
    (not ``torch.optim.NAdam``: see ``scale_by_adam``).

    Args:
      learning_rate: ``eta``, a float >= 0 or a schedule ``count -> 0-d float32 tensor``.
      b1: decay of the first moment, in [0, 1).
      b2: decay of the second moment, in [0, 1).
      eps: added to the denominator, >= 0.
      eps_root: added inside the square root of the denominator, >= 0 (optax's ``eps_root``; torch has none).
      nesterov: keyword-only, a bool: Nesterov momentum (NAdam in optax's form, see ``scale_by_adam``).
      weight_decay: ``lambda``, >= 0, coupled (L2); use ``adamw`` for decoupled decay.
      moment_dtype: the format of both moments (see ``scale_by_adam``): a floating dtype; ``None``
        (default): float32 for float16 and bfloat16 parameters, else the parameter's dtype; or
        block-quantized, ``"int8"``, ``"int4"`` or ``torch.float8_e4m3fn`` (torchao's low-bit Adam).
    Returns:
      ``chain(add_decayed_weights, scale_by_adam, scale_by_learning_rate)``.
    Raises:
      ValueError: if ``b1`` or ``b2`` is not in [0, 1).
      ValueError: if ``learning_rate``, ``eps``, ``eps_root`` or ``weight_decay`` is negative or not finite.
      TypeError: if ``nesterov`` is not a bool.
      ValueError: if ``moment_dtype`` is not ``None``, a floating dtype of 16 bits or more,
        ``torch.float8_e4m3fn``, ``"int8"`` or ``"int4"``.
    References:
      Kingma & Ba 2015, "Adam: A Method for Stochastic Optimization", arXiv:1412.6980.
      Dozat 2016, "Incorporating Nesterov Momentum into Adam", ICLR workshop.

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> opt = optim.adam(0.1)
      >>> params = {"w": torch.ones(2)}
      >>> updates, state = opt.update({"w": torch.tensor([1.0, -1.0])}, opt.init(params), params)
      >>> optim.apply_updates(params, updates)["w"]
      tensor([0.9000, 1.1000])
    """
    return chain(
        add_decayed_weights(weight_decay),
        scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov, moment_dtype=moment_dtype),
        scale_by_learning_rate(learning_rate),
    )


def adamw(
    learning_rate: LearningRate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    weight_decay: float = 0.01,
    mask: Mask | None = None,
    nesterov: bool = False,
    moment_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""AdamW: Adam with weight decay decoupled from the gradient.

    .. math:: p \leftarrow p - \eta\, (\mathrm{adam}(g) + \lambda p)

    As ``torch.optim.AdamW``, including its default ``weight_decay=0.01`` (optax's ``adamw``
    defaults to 1e-4). The decay is scaled by the learning rate, so it follows a schedule.
    Positional arguments are ``learning_rate, b1, b2, eps, eps_root`` (optax's order; torch's first four);
    the others are keyword-only (optax's sixth positional argument is its ``mu_dtype``, and torch's fifth is
    ``weight_decay``). ``nesterov=True`` is optax's ``adamw(nesterov=True)`` (``optax.nadamw``).

    Warning: ``torch.optim.AdamW`` multiplies the parameters by ``1 - lr * weight_decay`` rounded
    to float32, which misstates a small decay (by 0.13% at ``lr * weight_decay = 1e-5``); funcamp
    adds ``-lr * weight_decay * p`` instead. The two drift apart by up to about ``2**-24 * |p|`` per
    step (measured: 1e-5 after 100 steps at the defaults with ``lr=1e-3`` and ``|p| < 4``, against 1e-7 for
    ``adam``); they agree to float32 round-off when ``lr * weight_decay`` is a power of two.

    Args:
      learning_rate: ``eta``, a float >= 0 or a schedule ``count -> 0-d float32 tensor``.
      b1: decay of the first moment, in [0, 1).
      b2: decay of the second moment, in [0, 1).
      eps: added to the denominator, >= 0.
      eps_root: added inside the square root of the denominator, >= 0 (optax's ``eps_root``; torch has none).
      weight_decay: ``lambda``, >= 0.
      mask: which leaves to decay (see ``add_decayed_weights``); e.g. a tree that is ``False`` for
        biases and norm scales, or a prefix of the parameters' tree (one bool for a whole subtree).
      nesterov: keyword-only, a bool: Nesterov momentum (NAdam in optax's form, see ``scale_by_adam``).
      moment_dtype: the format of both moments (see ``scale_by_adam``): a floating dtype; ``None``
        (default): float32 for float16 and bfloat16 parameters, else the parameter's dtype; or
        block-quantized, ``"int8"``, ``"int4"`` or ``torch.float8_e4m3fn``: torchao's ``AdamW8bit``,
        ``AdamW4bit``, ``AdamWFp8`` (the same moment codes, bit for bit; the weight decay is added as
        funcamp's, see the warning above). A 1024 x 512 float32 parameter's moments take 1.06 MB with
        ``"int8"`` (0.254x) and 0.56 MB with ``"int4"`` (0.133x), against 4.19 MB in float32.
    Returns:
      ``chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate)``.
    Raises:
      ValueError: if ``b1`` or ``b2`` is not in [0, 1).
      ValueError: if ``learning_rate``, ``eps``, ``eps_root`` or ``weight_decay`` is negative or not finite.
      TypeError: if ``nesterov`` is not a bool.
      ValueError: if ``moment_dtype`` is not ``None``, a floating dtype of 16 bits or more,
        ``torch.float8_e4m3fn``, ``"int8"`` or ``"int4"``.
    References:
      Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization", arXiv:1711.05101.
      Dozat 2016, "Incorporating Nesterov Momentum into Adam", ICLR workshop.

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> opt = optim.adamw(0.1, weight_decay=0.5)
      >>> params = {"w": torch.ones(2)}
      >>> updates, state = opt.update({"w": torch.tensor([1.0, -1.0])}, opt.init(params), params)
      >>> optim.apply_updates(params, updates)["w"]
      tensor([0.8500, 1.0500])
    """
    return chain(
        scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov, moment_dtype=moment_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


def lion(
    learning_rate: LearningRate,
    b1: float = 0.9,
    b2: float = 0.99,
    *,
    weight_decay: float = 0.0,
    mask: Mask | None = None,
    moment_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Lion: sign of an interpolated momentum, with decoupled weight decay.

    .. math::
       p \leftarrow p - \eta\,(\mathrm{sign}(\beta_1 m + (1 - \beta_1) g) + \lambda p), \qquad
       m \leftarrow \beta_2 m + (1 - \beta_2) g

    There is no ``torch.optim`` counterpart; ``b1`` and ``b2`` default to the paper's values, and
    ``weight_decay`` to 0 (optax's ``lion`` defaults to 1e-3). Positional arguments are ``learning_rate,
    b1, b2``; the others are keyword-only (optax's fourth positional argument is its ``mu_dtype``).

    Args:
      learning_rate: ``eta``, a float >= 0 or a schedule ``count -> 0-d float32 tensor``.
      b1: interpolation rate for the update, in [0, 1).
      b2: decay of the momentum, in [0, 1).
      weight_decay: ``lambda``, >= 0, decoupled (scaled by the learning rate).
      mask: which leaves to decay (see ``add_decayed_weights``).
      moment_dtype: dtype of the momentum; ``None`` (default): float32 for float16 and bfloat16
        parameters, else the parameter's dtype (see ``funcamp.optim.transforms``).
    Returns:
      ``chain(scale_by_lion, add_decayed_weights, scale_by_learning_rate)``.
    Raises:
      ValueError: if ``b1`` or ``b2`` is not in [0, 1).
      ValueError: if ``learning_rate`` or ``weight_decay`` is negative or not finite.
      ValueError: if ``moment_dtype`` is not ``None`` or a floating dtype of 16 bits or more (block-quantized
        moments are the Adam family's).
    References:
      Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", arXiv:2302.06675.

    Example:
      >>> import torch
      >>> from funcamp import optim
      >>> opt = optim.lion(0.1)
      >>> params = {"w": torch.ones(2)}
      >>> updates, state = opt.update({"w": torch.tensor([3.0, -0.5])}, opt.init(params), params)
      >>> optim.apply_updates(params, updates)["w"]
      tensor([0.9000, 1.1000])
    """
    return chain(
        scale_by_lion(b1, b2, moment_dtype=moment_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
