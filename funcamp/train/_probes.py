"""Probes: metrics that observe a train step without touching its arithmetic.

A probe is a callable ``probe(record) -> dict`` of a :class:`funcamp.train.StepRecord`; the step adds what it
returns to its metrics, in order. :func:`funcamp.make_train_step` builds them from its keywords
(``max_consecutive_skips``, ``has_aux``, ``telemetry``); a custom step built from the stages lists its own.
Also here: the host-side helpers of the skip limit (:func:`check_skips`, :func:`nonfinite_leaf_name`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from funcamp import _tree, numerics, optim
from funcamp.train._layout import StageLayout
from funcamp.train._stages import StepRecord

__all__ = ["SkippedStepsError", "aux_probe", "check_skips", "nonfinite_leaf_name", "skip_limit", "telemetry_probe"]

Probe = Callable[[StepRecord], dict]


def skip_limit(max_consecutive_skips: int) -> Probe:
    """``metrics["too_many_skips"]``: True once ``max_consecutive_skips`` steps in a row were skipped.

    Raises:
      ValueError: if ``max_consecutive_skips`` is not an int >= 1.
    """
    if not isinstance(max_consecutive_skips, int) or max_consecutive_skips < 1:
        raise ValueError(
            f"make_train_step: max_consecutive_skips must be None or an int >= 1, got {max_consecutive_skips!r}"
        )

    def probe(record: StepRecord) -> dict:
        return {"too_many_skips": record.new_state.consecutive_skips >= max_consecutive_skips}

    return probe


def aux_probe(record: StepRecord) -> dict:
    """``metrics["aux"]``: the last micro-batch's aux."""
    return {"aux": record.aux}


def telemetry_probe(telemetry: numerics.Telemetry, layout: StageLayout | None = None) -> Probe:
    """The ``numerics/...`` metrics of :mod:`funcamp.numerics`, every ``telemetry.every``-th step.

    Computed inside the same graph (``torch.cond`` on the step count): zeros and ``numerics/active`` False on
    the other steps. Over the step's layout (the record's); ``layout``, when given, is checked now.

    Raises:
      ValueError: under a layout without whole gradients (:class:`funcamp.train.Sharded`: telemetry reads them).
    """
    if layout is not None and not layout.whole_gradients:
        raise ValueError("make_train_step: telemetry= is not supported with shard= (it reads whole gradients)")

    def probe(record: StepRecord) -> dict:
        state = record.state
        active = (state.step + 1) % telemetry.every == 0
        loss_scale = record.metrics["loss_scale"]
        storage = state.storage
        held, params_of = storage.held(state.params)  # a flat state's buffers: views made inside torch.cond
        applied = None
        if telemetry.lost_updates and record.updates is not None:  # the lost-update meter (funcamp.numerics)
            carry, carry_of = _carry(state.opt_state, record.new_state.opt_state, state.params, storage)
            # Copies where the gradients are views of one buffer (data parallel): an update passed through
            # unchanged is one of them, and torch.cond refuses operands that share storage.
            updates, updates_of = storage.held(record.updates)
            new_params, new_of = storage.held(record.new_state.params)
            applied = numerics.AppliedUpdate(
                record.layout.distinct(updates),
                new_params,
                record.verdict.finite,
                carry,
                (updates_of, new_of, carry_of),
            )
        grads = record.layout.distinct(record.grads)
        return numerics.telemetry_metrics(grads, held, loss_scale, telemetry, active, applied, params_of=params_of)

    return probe


def _carry(opt_state: Any, new_opt_state: Any, params: Any, storage: Any) -> tuple[Any, Any]:
    """``(carry, carry_of)``: what the lost-update meter reads of a bfloat16 master-weight wrapper that is the whole
    optimizer: the compensations before and after the step (``kahan_summation``, held as the storage holds them;
    ``carry_of`` makes the parameters' tree of them), ``"stochastic"`` (``stochastic_rounding``), or None (another
    optimizer, or a wrapper inside a group: not measured)."""
    if isinstance(opt_state, optim.KahanSummationState):
        old, carry_of = storage.held(opt_state.compensation)
        new, _ = storage.held(new_opt_state.compensation)
        if _tree.tree_structure(carry_of(old)) == _tree.tree_structure(storage.tree(params)):
            return (old, new), carry_of
    if isinstance(opt_state, optim.StochasticRoundingState):
        return "stochastic", None
    return None, None


def nonfinite_leaf_name(params: Any, index: int | torch.Tensor) -> str | None:
    """The name of the parameter that ``metrics["nonfinite_leaf"]`` points at (host side).

    Args:
      params: the parameters (``state.params``), to read the names from.
      index: ``metrics["nonfinite_leaf"]`` (reads it from the device: call it outside the step).
    Returns:
      The parameter's dotted name (``"blocks.0.attn.weight"``), or None for -1 (all finite).
    Raises:
      IndexError: if ``index`` is out of range for ``params``.
    """
    i = int(index)
    if i < 0:
        return None
    names = _tree.finite_flag_paths(params)  # the leaves metrics["nonfinite_leaf"] indexes, in its order
    if i >= len(names):
        raise IndexError(f"nonfinite_leaf_name: index {i} out of range for {len(names)} floating parameters")
    return names[i]


class SkippedStepsError(RuntimeError):
    """Raised by :func:`check_skips` when too many consecutive steps were skipped."""


def check_skips(metrics: dict[str, Any], params: Any = None, *, replay: Callable[[], Any] | None = None) -> None:
    """Raise if the step reported ``too_many_skips`` (host side: reads device tensors).

    Call it outside the compiled step, at your logging interval.

    ``replay`` says *why* the steps were skipped: a callable of no arguments, called only when
    raising, whose result's ``str`` ends the error message. The usual one replays the last step
    eagerly and names the first op that made a NaN or inf,
    ``functools.partial(funcamp.debug.locate_from_state, loss_fn, prev_state, batch)`` with the state
    *before* that step (``make_train_step`` never mutates it, so keeping a reference costs nothing).
    This module does not import :mod:`funcamp.debug`; anything that describes the failure will do.
    If ``replay`` itself raises, the message says so and ``SkippedStepsError`` is raised all the same,
    from that exception.

    Args:
      metrics: the metrics of a step built with ``max_consecutive_skips``.
      params: optional, to name the first parameter whose gradient was not finite.
      replay: optional, ``replay() -> report``; see above. Not called when nothing is raised.
    Raises:
      TypeError: if ``replay`` is neither None nor callable.
      KeyError: if ``metrics`` has no ``too_many_skips`` (the step was built without
        ``max_consecutive_skips``).
      SkippedStepsError: if ``too_many_skips`` is true.
    """
    if replay is not None and not callable(replay):
        raise TypeError(
            f"check_skips: replay must be a callable of no arguments or None, got {type(replay).__name__}; "
            "e.g. functools.partial(funcamp.debug.locate_from_state, loss_fn, prev_state, batch)"
        )
    if "too_many_skips" not in metrics:
        raise KeyError("check_skips: metrics has no 'too_many_skips'; build the step with max_consecutive_skips=N")
    if bool(metrics["too_many_skips"]):
        where = ""
        if params is not None:
            name = nonfinite_leaf_name(params, metrics["nonfinite_leaf"])
            where = f"; first non-finite gradient: {name}" if name else "; the loss itself was not finite"
        message = (
            f"{int(metrics['consecutive_skips'])} consecutive steps skipped for non-finite gradients at loss "
            f"scale {float(metrics['loss_scale']):g}{where}. Lower the learning rate, check the data, or "
            "compute in bfloat16/float32."
        )
        cause = None
        if replay is not None:
            try:
                report = str(replay())
            except Exception as e:  # a failing diagnosis must not hide the failure it diagnoses
                cause, report = e, f"(the replay failed: {type(e).__name__}: {e})"
            message = f"{message}\n{report}"
        raise SkippedStepsError(message) from cause
