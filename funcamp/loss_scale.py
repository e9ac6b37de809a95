"""Immutable loss scales: ``scale`` the loss, ``unscale`` the gradients, ``adjust`` to a new object.

Each loss scale is a frozen dataclass registered as a pytree in the funcamp namespace: its state is
0-d tensors (children) and its configuration is static (part of the tree structure), so it passes
through ``torch.compile`` as tensors and a changing scale never recompiles.

References:
  Micikevicius et al. 2018, "Mixed Precision Training", arXiv:1710.03740 (loss scaling).
  jmp (google-deepmind/jmp) ``DynamicLossScale``; ``torch.amp.GradScaler`` (``_amp_update_scale_``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import struct
import warnings
from typing import Any, TypeVar

import torch

from funcamp import _scope, _tree

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "loss_scale_from_state_dict",
]

T = TypeVar("T")

# A scale must be a normal float32 so that it and its reciprocal (used by ``unscale``) are finite.
_F32_TINY = torch.finfo(torch.float32).tiny  # 2**-126
_F32_MAX = torch.finfo(torch.float32).max


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _initial_value(x: Any) -> float | None:
    """The value of a Python number, or of a 0-d tensor that can be read without device work; else None.

    A float32 CPU tensor outside tracing and ``torch.func`` transforms is read through NumPy (no ATen op, no
    host sync). Device tensors are checked by :meth:`funcamp.TrainState.create` (one read, at set-up), and
    the tensors a traced or eager step rebuilds the loss scale from (``adjust``, unflatten) are not read.
    """
    if _is_number(x):
        return float(x)
    if (
        type(x) is not torch.Tensor
        or x.device.type != "cpu"
        or x.requires_grad
        or _scope.compiling()
        or torch._C._functorch.is_functorch_wrapped_tensor(x)
        or x.dtype != torch.float32
        or x.ndim != 0
    ):
        return None
    try:
        return float(x.numpy())
    except (RuntimeError, TypeError):  # fake, functional or other tensors without storage
        return None


def _initial_count(x: Any) -> int | None:
    """The value of a Python int, or of a 0-d int32 CPU tensor that can be read without device work; else None."""
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    if (
        type(x) is not torch.Tensor
        or x.device.type != "cpu"
        or _scope.compiling()
        or torch._C._functorch.is_functorch_wrapped_tensor(x)
        or x.dtype != torch.int32
        or x.ndim != 0
    ):
        return None
    try:
        return int(x.numpy())
    except (RuntimeError, TypeError):  # fake, functional or other tensors without storage
        return None


#: Appended to the error of a counter beyond the period, which a positional call in another order gives.
_JMP_ORDER = (
    "; the positional order is jmp's, DynamicLossScale(loss_scale, counter, period, growth_factor, "
    "min_loss_scale), not torch.amp.GradScaler's (init_scale, growth_factor, backoff_factor, growth_interval); "
    "the other fields are keyword-only"
)


def _as_float32(x: float) -> float:
    """``x`` rounded to the nearest float32 on the host: no tensor, so no ATen op a profiler counts as a read."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # beyond float32's range: inf, as a cast gives
        return math.copysign(math.inf, x)


def _scalar_tensor(x: Any, name: str, dtype: torch.dtype) -> Any:
    """A Python number becomes a 0-d tensor of ``dtype``; a tensor is checked (metadata only).

    Anything else (an ``object()`` or ``None`` that a tree utility puts in the leaves' place) is
    returned as is, so that optree can rebuild the object from arbitrary leaves.
    """
    if _is_number(x):
        if not dtype.is_floating_point and not isinstance(x, numbers.Integral):
            raise TypeError(f"{name} must be a {dtype} 0-d tensor or a Python int, got {x!r}")
        return torch.tensor(x, dtype=dtype)
    if isinstance(x, (str, bytes, bool)):
        raise TypeError(f"{name} must be a {dtype} 0-d tensor or a Python number, got {x!r}")
    if isinstance(x, torch.Tensor):
        if x.dtype != dtype:
            raise TypeError(f"{name} must be a {dtype} tensor or a Python number, got a {x.dtype} tensor")
        if x.ndim != 0:
            raise ValueError(f"{name} must be a 0-d tensor, got shape {tuple(x.shape)}")
    return x


def _check_grads_finite(grads_finite: Any) -> None:
    if not isinstance(grads_finite, torch.Tensor) or grads_finite.dtype != torch.bool:
        got = grads_finite.dtype if isinstance(grads_finite, torch.Tensor) else type(grads_finite).__name__
        raise TypeError(
            f"adjust: grads_finite must be a 0-d torch.bool tensor (e.g. funcamp.all_finite(grads)), got {got}"
        )
    if grads_finite.ndim != 0:
        raise ValueError(f"adjust: grads_finite must be 0-d, got shape {tuple(grads_finite.shape)}")


def _full_precision(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or float64 if it is float64 (a narrower sparse tensor coalesced first: ``_tree.widened``)."""
    return _tree.widened(x, torch.promote_types(x.dtype, torch.float32))


class LossScale:
    """Interface shared by the loss scales: ``loss_scale``, ``scale``, ``unscale``, ``adjust``, ``to``."""

    loss_scale: torch.Tensor

    def scale(self, tree: T) -> T:
        """Multiply the floating leaves of ``tree`` by the loss scale, in float32 (float64 stays float64).

        Floating leaves come back in float32 (or float64) whatever their dtype, like jmp, where a
        float16 array times a float32 scale promotes; non-floating leaves are returned as is.
        """
        scale = self.loss_scale
        return _tree.tree_map(lambda x: _full_precision(x) * scale if _tree.is_floating(x) else x, tree)

    def unscale(self, tree: T) -> T:
        """Divide the floating leaves of ``tree`` by the loss scale, in float32 (float64 stays float64).

        The reciprocal is computed in float64 and cast to float32 (as ``torch.amp.GradScaler``).
        Floating leaves come back in float32 (or float64) whatever their dtype, so a float16 gradient
        that was finite before unscaling stays exact; non-floating leaves are returned as is.
        """
        inv = torch.reciprocal(self.loss_scale.double()).float()
        return _tree.tree_map(lambda x: _full_precision(x) * inv.to(x.device) if _tree.is_floating(x) else x, tree)

    def adjust(self, grads_finite: torch.Tensor) -> LossScale:
        """The next loss scale given whether this step's gradients were finite (a new object)."""
        raise NotImplementedError

    def _check_initial_scale(self, value: float | None) -> None:
        """Raise ``ValueError`` if ``value``, the scale read on the host (None: unknown), is out of range."""

    def check_on_host(self) -> None:
        """Check the scale's value once, reading it on the host (one device sync for a device tensor).

        Construction checks a Python number or a float32 CPU tensor; :meth:`funcamp.TrainState.create`
        calls this for a scale held on a device. Not for the compiled step.

        Raises:
          ValueError: if the scale is out of the range its class accepts (see the class docstring).
        """
        scale = self.loss_scale
        if isinstance(scale, torch.Tensor) and scale.ndim == 0 and _initial_value(scale) is None:
            self._check_initial_scale(float(scale))

    def to(self, device: str | torch.device) -> LossScale:
        """A copy with every state tensor on ``device``."""
        return _tree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, self)

    def state_dict(self) -> dict[str, Any]:
        """Every field by name (tensors and Python numbers) plus ``"type"``.

        Loadable with ``torch.load(weights_only=True)``; rebuild with :func:`loss_scale_from_state_dict`.
        """
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        return {"type": type(self).__name__, **state}


@_tree.dataclass
class NoOpLossScale(LossScale):
    """No loss scaling: ``scale`` and ``unscale`` return the tree unchanged; the scale reads 1.0.

    Use it for float32 or bfloat16 compute, where gradients do not underflow.

    Example:
      >>> NoOpLossScale().loss_scale
      tensor(1.)
    """

    @property
    def loss_scale(self) -> torch.Tensor:  # type: ignore[override]
        """A 0-d float32 tensor holding 1.0 (on the CPU)."""
        return torch.ones((), dtype=torch.float32)

    def scale(self, tree: T) -> T:
        """Return ``tree`` unchanged."""
        return tree

    def unscale(self, tree: T) -> T:
        """Return ``tree`` unchanged."""
        return tree

    def adjust(self, grads_finite: torch.Tensor) -> NoOpLossScale:
        """Return ``self`` (after checking that ``grads_finite`` is a 0-d bool tensor)."""
        _check_grads_finite(grads_finite)
        return self


@_tree.dataclass
class StaticLossScale(LossScale):
    """A fixed loss scale.

    Args:
      loss_scale: a Python number in [2**-126, float32 max] or a 0-d float32 tensor.
    Raises:
      TypeError: if ``loss_scale`` is a tensor of another dtype than float32.
      ValueError: if ``loss_scale`` is not 0-d, or (a Python number, or a float32 CPU tensor; a device
        tensor at ``TrainState.create``) not positive and finite.

    Example:
      >>> StaticLossScale(128.0).scale(torch.tensor(0.5, dtype=torch.float16))
      tensor(64.)
    """

    loss_scale: torch.Tensor

    def __post_init__(self) -> None:
        self._check_initial_scale(_initial_value(self.loss_scale))
        scale = _scalar_tensor(self.loss_scale, f"{type(self).__name__}: loss_scale", torch.float32)
        object.__setattr__(self, "loss_scale", scale)

    def _check_initial_scale(self, value: float | None) -> None:
        """Raise ``ValueError`` unless ``value`` (None: unknown) is a normal, finite float32 (see DynamicLossScale)."""
        if value is not None and not (_F32_TINY <= value <= _F32_MAX):
            raise ValueError(
                f"StaticLossScale: loss_scale must be positive and finite in float32 (between 2**-126 and "
                f"{_F32_MAX}), got {value}"
            )

    def adjust(self, grads_finite: torch.Tensor) -> StaticLossScale:
        """Return ``self`` (after checking that ``grads_finite`` is a 0-d bool tensor)."""
        _check_grads_finite(grads_finite)
        return self


@_tree.dataclass
class DynamicLossScale(LossScale):
    """A loss scale that grows while gradients stay finite and backs off when they overflow.

    ``adjust(grads_finite)`` returns the next state:

    - finite step: ``counter = (counter + 1) % period``; when the counter wraps (``period``
      consecutive finite steps, as jmp and ``torch.amp.GradScaler``: not ``period + 1``) the scale is
      multiplied by ``growth_factor``, capped at ``max_loss_scale``, and kept as it was if the grown
      value is not finite in float32. ``hysteresis_left`` is reset to ``hysteresis``.
    - non-finite step: ``counter = 0``; if ``hysteresis_left <= 1`` the scale backs off to
      ``max(min_loss_scale, scale * backoff_factor)`` (or ``scale / growth_factor`` when
      ``backoff_factor`` is None, exactly as jmp), otherwise ``hysteresis_left`` drops by one and the
      scale is kept (DeepSpeed's consecutive hysteresis: once it has backed off, every further
      consecutive non-finite step backs off again).

    With the defaults the trajectory equals jmp's ``DynamicLossScale``; with ``growth_factor=2,
    backoff_factor=0.5`` and a tiny ``min_loss_scale`` it equals ``torch.amp.GradScaler``'s, which has
    no floor. Unlike jmp, ``min_loss_scale`` survives flattening, and a float16 scale is refused.

    The first five arguments may be given by position, in jmp's order (``loss_scale, counter, period,
    factor, min_loss_scale``: jmp's ``factor`` is ``growth_factor`` here, with the default backoff
    dividing by it as jmp does); the other four are keyword-only.

    flax's names: ``flax.training.dynamic_scale.DynamicScale(growth_interval=N)`` grows on the finite step
    that finds ``fin_steps == N``, i.e. after ``N + 1`` consecutive finite steps, so it is ``period=N + 1``
    here (``torch.amp.GradScaler(growth_interval=N)`` is ``period=N``: the same name, one step apart).
    flax's floor (``minimum_scale``) defaults to float32's tiny, 2**-126, where ``min_loss_scale`` defaults
    to 1; its backoff is ``backoff_factor`` (default 0.5) whatever ``growth_factor`` is; it starts at
    ``scale=65536.0`` (2**16, here 2**15); and it caps a grown scale at float32's max (3.4e38, not a power of
    two) where this class keeps the old scale unless ``max_loss_scale`` is set. Spelled out, flax's
    ``DynamicScale(growth_factor=g, backoff_factor=b, growth_interval=N, scale=s)`` is
    ``DynamicLossScale(s, period=N + 1, growth_factor=g, backoff_factor=b, min_loss_scale=2.0**-126,
    max_loss_scale=<float32 max>)``, and its ``fin_steps`` is ``counter``: the same trajectories, step by step
    (``tests/test_loss_scale.py``, against flax 0.12.8's own, ``tools/make_flax_golden.py``).

    Args:
      loss_scale: initial scale, a Python number or a 0-d float32 tensor (default ``2**15``).
      counter: consecutive finite steps since the last change, a Python int or 0-d int32 tensor in
        [0, ``period``) (default 0).
      period: finite steps between two growths, an int >= 1 (default 2000).
      growth_factor: a float > 1 (default 2.0).
      min_loss_scale: the floor, a float in [2**-126, float32 max], so that the scale and its
        reciprocal stay finite float32 (default 1.0).
      hysteresis_left: keyword-only; non-finite steps still tolerated before backing off, a Python int or
        0-d int32 tensor in [0, ``hysteresis``] (default ``hysteresis``; 0 acts as 1).
      backoff_factor: keyword-only; a float in (0, 1), or None to divide by ``growth_factor`` (default None).
      max_loss_scale: keyword-only; the cap, None (default), inf, or a float in [``min_loss_scale``,
        float32 max].
      hysteresis: keyword-only; consecutive non-finite steps before a backoff, an int >= 1 (default 1).
    Raises:
      TypeError: if a state field is a tensor of the wrong dtype or a counter a Python float, an option has
        the wrong type, or more than five arguments are given by position.
      ValueError: if a state tensor is not 0-d, or an option is out of the range above, or the
        initial scale (a Python number, or a float32 CPU tensor; a device tensor at
        ``TrainState.create``) is below ``min_loss_scale``, above ``max_loss_scale`` or not finite, or
        ``counter`` or ``hysteresis_left`` (a Python int, or a CPU tensor) is out of its range.
    Warns:
      UserWarning: if ``counter`` is a Python int above 0 (``DynamicLossScale(65536.0, 2)``: GradScaler's
        growth factor in jmp's counter place); a counter given as a tensor is taken silently.

    Example:
      >>> ls = DynamicLossScale(2.0**15, period=1)
      >>> ls.adjust(torch.tensor(True)).loss_scale
      tensor(65536.)
      >>> ls.adjust(torch.tensor(False)).loss_scale
      tensor(16384.)

      flax's ``DynamicScale(growth_interval=2)``, whose scales on these steps are 65536, 65536, 131072,
      131072, 65536, 65536, 65536, 131072 (flax 0.12.8: ``tests/golden/flax_dynamic_scale.json``,
      ``docs_example``):

      >>> tiny, f32_max = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
      >>> ls = DynamicLossScale(65536.0, period=3, backoff_factor=0.5, min_loss_scale=tiny, max_loss_scale=f32_max)
      >>> scales = []
      >>> for finite in [True, True, True, True, False, True, True, True]:
      ...     ls = ls.adjust(torch.tensor(finite))
      ...     scales.append(int(ls.loss_scale))
      >>> scales
      [65536, 65536, 131072, 131072, 65536, 65536, 65536, 131072]
    """

    # jmp's positional order (loss_scale, counter, period, factor, min_loss_scale); funcamp's additions are
    # keyword-only, so that jmp's DynamicLossScale(scale, counter, 2000, 2) means here what it means there.
    loss_scale: torch.Tensor = 2.0**15  # type: ignore[assignment]
    counter: torch.Tensor = 0  # type: ignore[assignment]
    period: int = _tree.field(default=2000, pytree_node=False)
    growth_factor: float = _tree.field(default=2.0, pytree_node=False)
    min_loss_scale: float = _tree.field(default=1.0, pytree_node=False)
    _: dataclasses.KW_ONLY
    hysteresis_left: torch.Tensor | None = None
    backoff_factor: float | None = _tree.field(default=None, pytree_node=False)
    max_loss_scale: float | None = _tree.field(default=None, pytree_node=False)
    hysteresis: int = _tree.field(default=1, pytree_node=False)

    def __post_init__(self) -> None:
        self._check_options()
        self._check_initial_scale(_initial_value(self.loss_scale))
        if self.hysteresis_left is None:
            object.__setattr__(self, "hysteresis_left", self.hysteresis)
        self._check_counters()
        scale = _scalar_tensor(self.loss_scale, f"{type(self).__name__}: loss_scale", torch.float32)
        object.__setattr__(self, "loss_scale", scale)
        object.__setattr__(self, "counter", _scalar_tensor(self.counter, "DynamicLossScale: counter", torch.int32))
        left = _scalar_tensor(self.hysteresis_left, "DynamicLossScale: hysteresis_left", torch.int32)
        object.__setattr__(self, "hysteresis_left", left)

    def _check_initial_scale(self, value: float | None) -> None:
        """Raise ``ValueError`` unless ``value`` (None: unknown) lies in [``min_loss_scale``, the cap].

        Called on construction with the scale's value where it is known without device work (a Python
        number, or a CPU tensor outside tracing), and by :meth:`funcamp.TrainState.create` for a device tensor.
        """
        cap = _F32_MAX if self.max_loss_scale is None else min(self.max_loss_scale, _F32_MAX)
        # Compared as float32, the scale's dtype: adjust clamps to the float32 nearest the cap or floor, which
        # may lie just outside the Python number (the cap 25422235.0 is 25422236.0 in float32), and a Python
        # number is stored as its nearest float32.
        if value is not None and not (_as_float32(self.min_loss_scale) <= _as_float32(value) <= _as_float32(cap)):
            upper = f"<= max_loss_scale={self.max_loss_scale}" if cap < _F32_MAX else f"finite in float32 (<= {cap})"
            raise ValueError(
                f"DynamicLossScale: loss_scale must be >= min_loss_scale={self.min_loss_scale} and {upper}, got {value}"
            )

    def _check_counters(self) -> None:
        """Raise ``ValueError`` if ``counter`` is outside [0, period) or ``hysteresis_left`` outside [0, hysteresis].

        Checked where the value is known without device work (a Python int, or a CPU tensor outside tracing);
        ``adjust`` keeps both in range.
        """
        bounds = (("counter", self.period - 1, "period - 1"), ("hysteresis_left", self.hysteresis, "hysteresis"))
        for name, high, high_name in bounds:
            value = _initial_count(getattr(self, name))
            if value is not None and not 0 <= value <= high:
                raise ValueError(
                    f"DynamicLossScale: {name} must be an int in [0, {high_name}={high}], got {value}"
                    + (_JMP_ORDER if name == "counter" and value > high else "")
                )
        counter = self.counter
        if _is_number(counter) and not isinstance(counter, numbers.Integral):  # (65536.0, 2.0): a growth factor
            raise TypeError(
                f"DynamicLossScale: counter must be a torch.int32 0-d tensor or a Python int, got "
                f"{counter!r}{_JMP_ORDER}"
            )
        if isinstance(counter, int) and not isinstance(counter, bool) and counter > 0:
            # (65536.0, 2): GradScaler's growth_factor in jmp's counter place, in range, so taken as a counter
            warnings.warn(
                f"DynamicLossScale: counter={counter} starts the growth count mid-period{_JMP_ORDER}. For a growth "
                f"factor write growth_factor={counter}; to start mid-period on purpose, pass the counter as a tensor "
                f"(torch.tensor({counter}, dtype=torch.int32))",
                UserWarning,
                stacklevel=4,  # _check_counters, __post_init__, the dataclass's __init__, the caller
            )

    def _check_options(self) -> None:
        def fail(name: str, accepted: str) -> None:
            raise ValueError(f"DynamicLossScale: {name} must be {accepted}, got {getattr(self, name)!r}")

        for name in ("period", "hysteresis"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"DynamicLossScale: {name} must be an int >= 1, got {value!r}")
            if value < 1:
                fail(name, "an int >= 1")
        for name in ("growth_factor", "backoff_factor", "min_loss_scale", "max_loss_scale"):
            value = getattr(self, name)
            if value is not None and not _is_number(value):
                raise TypeError(f"DynamicLossScale: {name} must be a Python float, got {value!r}")
        if not 1 < self.growth_factor < math.inf:
            fail("growth_factor", "a finite float > 1")
        if self.backoff_factor is not None and not 0 < self.backoff_factor < 1:
            fail("backoff_factor", "a float in (0, 1) or None (divide by growth_factor)")
        if not _F32_TINY <= self.min_loss_scale <= _F32_MAX:
            fail("min_loss_scale", f"a float between 2**-126 (the smallest normal float32) and {_F32_MAX}")
        max_scale = self.max_loss_scale
        if max_scale is not None and not (self.min_loss_scale <= max_scale <= _F32_MAX or max_scale == math.inf):
            fail(
                "max_loss_scale",
                f"None, inf, or a float >= min_loss_scale={self.min_loss_scale} and <= {_F32_MAX} (float32's max)",
            )

    def adjust(self, grads_finite: torch.Tensor) -> DynamicLossScale:
        """The next loss scale (a new object); see the class docstring for the rule.

        Traceable: tensor ops only, no host sync, no Python branch on tensor values; the new state
        tensors keep their dtypes (float32 scale, int32 counters) and device.

        Args:
          grads_finite: a 0-d bool tensor, True when every gradient was finite this step.
        Raises:
          TypeError: if ``grads_finite`` is not a bool tensor.
          ValueError: if ``grads_finite`` is not 0-d.
        """
        _check_grads_finite(grads_finite)
        scale, counter, left = self.loss_scale, self.counter, self.hysteresis_left
        grown = scale * self.growth_factor
        if self.max_loss_scale is not None:
            grown = torch.clamp(grown, max=self.max_loss_scale)
        grown = torch.where(torch.isfinite(grown), grown, scale)
        if self.backoff_factor is None:
            backed_off = scale / self.growth_factor
        else:
            backed_off = scale * self.backoff_factor
        backed_off = torch.clamp(backed_off, min=self.min_loss_scale)
        back_off_now = left <= 1
        if_finite = torch.where(counter == self.period - 1, grown, scale)
        if_nonfinite = torch.where(back_off_now, backed_off, scale)
        full = torch.full_like(left, self.hysteresis)
        return dataclasses.replace(
            self,
            loss_scale=torch.where(grads_finite, if_finite, if_nonfinite),
            counter=torch.where(grads_finite, (counter + 1) % self.period, torch.zeros_like(counter)),
            hysteresis_left=torch.where(grads_finite, full, torch.clamp(left - 1, min=1)),
        )


_TYPES = {cls.__name__: cls for cls in (NoOpLossScale, StaticLossScale, DynamicLossScale)}


def loss_scale_from_state_dict(state: dict[str, Any]) -> LossScale:
    """Rebuild a loss scale from ``LossScale.state_dict()`` output.

    Raises:
      ValueError: if ``state["type"]`` is not a funcamp loss scale, or a field is missing or unknown.
    """
    state = dict(state)
    kind = state.pop("type", None)
    if kind not in _TYPES:
        raise ValueError(f"loss_scale_from_state_dict: unknown type {kind!r}; expected one of {sorted(_TYPES)}")
    try:
        return _TYPES[kind](**state)
    except TypeError as e:
        raise ValueError(f"loss_scale_from_state_dict: bad fields for {kind}: {e}") from e
