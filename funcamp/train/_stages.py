"""The stages of a train step: small pure functions that :func:`funcamp.make_train_step` assembles.

Each stage does one thing and takes a process layout (:mod:`funcamp.train._layout`) where processes
matter; none of them branches on a feature. In order:

1. :func:`gradients`: split the batch into micro-batches, differentiate the scaled loss of each, unscale in
   float32, weight and sum them (the mean of micro-batch means, or a :class:`funcamp.LossSum`'s item mean),
   and reduce them over the layout's ranks.
2. :func:`cast_like`: the float32 gradients in each parameter's dtype.
3. :func:`check`: one finite verdict (every gradient and the loss), per-leaf flags and the gradient norm.
4. :func:`update`: the optimizer and ``apply_updates``.
5. :func:`commit`: keep the old state where the verdict is False (``select_tree``), adjust the loss scale
   once, count the step and the skips.
6. :func:`metrics`: the step's 0-d metrics.

:func:`run` runs them all and returns a :class:`StepRecord` for probes (:mod:`funcamp.train._probes`) to
read. A step with two models, two optimizers and a loss scale for each loss composes them directly
(``examples/gan.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from funcamp import _dynamo_autograd, _scope, _tree
from funcamp._tree import _fast
from funcamp.grad import _Route, scaled_grad_and_value
from funcamp.loss_scale import LossScale, NoOpLossScale
from funcamp.optim import GradientTransformation, _inplace, apply_updates, learning_rate
from funcamp.train import _loss
from funcamp.train._layout import SingleProcess
from funcamp.train._state import TrainState

__all__ = [
    "Gradients",
    "StepRecord",
    "Verdict",
    "cast_like",
    "check",
    "commit",
    "gradients",
    "metrics",
    "run",
    "update",
]

_ONE_PROCESS = SingleProcess()


class Gradients(NamedTuple):
    """What :func:`gradients` returns.

    Attributes:
      grads: the unscaled gradients of the batch loss, float32 (float64 stays float64), reduced over the
        layout's ranks (this rank's shards for :class:`funcamp.train.Sharded`); structure of the parameters.
      loss: 0-d float32, the batch loss over all ranks (the mean of the micro-batch means, or the item mean of
        a :class:`funcamp.LossSum`).
      buffers: the model's new buffers (reduced over the ranks), or None when it has none.
      aux: the last micro-batch's aux (``()`` without ``has_aux``).
    """

    grads: Any
    loss: torch.Tensor
    buffers: Any
    aux: Any


class Verdict(NamedTuple):
    """What :func:`check` returns: ``finite`` (0-d bool, the same on every rank), ``flags`` (1-d bool, one per
    floating gradient leaf in tree order) and ``grad_norm`` (0-d, the global L2 norm, float32 or float64)."""

    finite: torch.Tensor
    flags: torch.Tensor
    grad_norm: torch.Tensor


_UNSET: Any = object()


def check_args(
    fn: str,
    loss_fn: Any = _UNSET,
    optimizer: Any = _UNSET,
    accumulation_steps: Any = 1,
    *,
    loss_scale: Any = _UNSET,
) -> None:
    """Build time (host side): the arguments :func:`funcamp.make_train_step` and the stages share.

    Raises:
      TypeError: if ``loss_fn`` is given and not callable, ``optimizer`` is given and not a
        ``GradientTransformation``, or ``loss_scale`` is given and not a :class:`funcamp.LossScale`.
      ValueError: if ``accumulation_steps`` is not an int >= 1.
    """
    if loss_fn is not _UNSET and not callable(loss_fn):
        raise TypeError(f"{fn}: loss_fn must be callable, got {type(loss_fn).__name__}")
    if optimizer is not _UNSET and not isinstance(optimizer, GradientTransformation):
        raise TypeError(
            f"{fn}: optimizer must be a funcamp.optim.GradientTransformation, got {type(optimizer).__name__}"
        )
    if loss_scale is not _UNSET and not isinstance(loss_scale, LossScale):
        raise TypeError(
            f"{fn}: loss_scale must be a funcamp LossScale (NoOpLossScale, StaticLossScale, DynamicLossScale), "
            f"got {type(loss_scale).__name__}"
        )
    if not isinstance(accumulation_steps, int) or isinstance(accumulation_steps, bool) or accumulation_steps < 1:
        raise ValueError(f"{fn}: accumulation_steps must be an int >= 1, got {accumulation_steps!r}")


def _check_update_args(optimizer: Any, grads: Any, opt_state: Any, params: Any) -> None:
    check_args("update", optimizer=optimizer)
    if not _tree.structures_equal(grads, params):
        swapped = " (opt_state and params look swapped)" if _tree.structures_equal(grads, opt_state) else ""
        raise TypeError(
            f"update: params must have the structure of grads{swapped}; the order is update(optimizer, grads, "
            "opt_state, params)"
        )


def gradients(
    loss_fn: Callable[..., Any],
    loss_scale: LossScale,
    params: Any,
    batch: Any,
    *,
    buffers: Any = None,
    has_aux: bool = False,
    accumulation_steps: int = 1,
    layout: SingleProcess = _ONE_PROCESS,
    buffer_reductions: Any = None,
    route: _Route | None = None,
) -> Gradients:
    """The gradients of ``loss_fn`` on ``batch``, scaled by ``loss_scale``, unscaled in float32, over ``layout``.

    ``batch`` is split into ``accumulation_steps`` micro-batches along dim 0; each is differentiated with the
    loss scale applied (:func:`funcamp.grad.scaled_grad_and_value`) and its float32 gradients summed. A plain
    loss gives the mean of the micro-batch means; a :class:`funcamp.LossSum` weights each micro-batch by its
    count and divides by the count over all micro-batches and ranks. The layout gathers the parameters first
    (shards) and reduces the gradients, the loss and the buffers after; ``loss_fn`` runs within the layout
    (:func:`funcamp._scope.within`), so that what it calls can ask :func:`funcamp._scope.current` for it.

    Args:
      loss_fn: as for :func:`funcamp.make_train_step` (the buffers form when ``buffers`` is not None).
      loss_scale: the :class:`funcamp.LossScale` to differentiate with.
      params: the parameters (this rank's shards under :class:`funcamp.train.Sharded`).
      batch: this rank's batch.
      buffers: the model's buffers, or None.
      has_aux: whether the loss comes with aux data.
      accumulation_steps: micro-batches (>= 1).
      layout: the process layout (default one process).
      buffer_reductions: the buffers' reductions over ranks (``TrainState.buffer_reductions``: a buffer's
        dotted name -> ``"max"`` or ``"min"``; the others are averaged), or None.
      route: how to differentiate (:data:`funcamp.grad._Route`). Default: in the body of a compiled step built by
        :func:`funcamp.train.assemble`, :data:`funcamp._dynamo_autograd.route` (``torch.autograd.grad`` traced
        by Dynamo, which keeps every custom Function's backward), elsewhere ``torch.func``'s semantics.
    Returns:
      A :class:`Gradients`.
    Raises:
      ValueError: if a batch leaf cannot be split into ``accumulation_steps`` micro-batches.
      TypeError: if ``loss_fn`` returns the wrong form (see :func:`funcamp.make_train_step`).
    """
    check_args("gradients", loss_fn, accumulation_steps=accumulation_steps, loss_scale=loss_scale)
    if route is None and getattr(_scope.step_plan(), "compiled", False):
        route = _dynamo_autograd.route  # the assembly traces torch.autograd.grad (trace_autograd_ops)
    with_buffers = buffers is not None
    scale = None if isinstance(loss_scale, NoOpLossScale) else loss_scale.loss_scale
    fun = _loss.as_differentiable(loss_fn, has_aux=has_aux, with_buffers=with_buffers)
    grad_fn = scaled_grad_and_value(layout.around_loss(fun, scale), loss_scale, has_aux=True, route=route)
    whole = layout.gather(params)
    new_buffers, total, losses, sums, aux = (buffers if with_buffers else ()), None, [], [], ()
    for mb in _loss.micro_batches(batch, accumulation_steps):
        grads32, (loss, (new_buffers, aux, record)) = _scope.within(layout, grad_fn, whole, new_buffers, mb)
        if record:  # a LossSum: the gradient of this micro-batch's mean, weighted by its count
            grads32 = layout.weigh(grads32, record[1])
            sums.append(torch.stack(record))
        total = grads32 if total is None else _tree.tree_map(torch.add, total, grads32)
        losses.append(loss.float())
    if sums:  # sum(total) / sum(count) over micro-batches and ranks: one float64 all_reduce of two numbers
        summed = layout.sum(sum(sums[1:], sums[0]))
        # The layout's reduction below divides by the ranks again.
        count = torch.where(summed[1] > 0, summed[1], torch.full_like(summed[1], float("nan")))  # no mean: skip
        total = _tree.tree_map(lambda g: g * (layout.size / count).to(g.dtype), total)
        loss = (summed[0] / count).float()
    elif accumulation_steps > 1:  # the mean of the micro-batch means (then of the rank means, below)
        total = _tree.tree_map(lambda g: g / accumulation_steps, total)
    total = layout.reduce_gradients(total, scale)
    if not sums:
        loss = layout.mean(torch.stack(losses).mean() if accumulation_steps > 1 else losses[0])
    new_buffers = layout.reduce_buffers(new_buffers, buffer_reductions) if with_buffers else None
    return Gradients(total, loss, new_buffers, aux)


def cast_like(grads: Any, params: Any) -> Any:
    """``grads`` cast to the dtypes of ``params`` (the same structure), leaf by leaf; a gradient already in its
    parameter's dtype is itself (no ``to`` call: nothing for a compiled step's graph to hold)."""
    flat = _tree.flatten_same(grads, params)  # while traced: the dtypes compared as tuples, no frame per leaf
    if flat is not None:
        kinds = _fast.dtypes(flat[0][0])
        if kinds is not None and kinds == _fast.dtypes(flat[0][1]):
            return grads
    return _tree.tree_map(lambda g, p: g if g.dtype == p.dtype else g.to(p.dtype), grads, params)


def check(grads: Any, loss: torch.Tensor, layout: SingleProcess = _ONE_PROCESS) -> Verdict:
    """Whether every gradient element and the loss are finite, on every rank, and the gradient norm.

    Args:
      grads: the gradients in the parameters' dtypes (this rank's shards when sharded).
      loss: the 0-d loss.
      layout: the process layout.
    Returns:
      A :class:`Verdict`.
    """
    return Verdict(*layout.stats(grads, loss))


def update(
    optimizer: GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    layout: SingleProcess = _ONE_PROCESS,
    finite: torch.Tensor | None = None,
) -> tuple[Any, Any]:
    """``(new_params, new_opt_state)``: one optimizer update applied with :func:`funcamp.optim.apply_updates`.

    Computed whatever the verdict; :func:`commit` decides whether it is kept. ``optimizer.update`` runs within
    ``layout`` (:func:`funcamp._scope.within`): ``optim.clip_by_global_norm`` takes the layout's global norm
    (over all shards when sharded) and ``optim.stochastic_rounding`` its element offsets.

    Inside an eager donating step (``make_train_step(donate=True, compile=False)``) and given the verdict
    ``finite`` (0-d bool), the update runs in place (:mod:`funcamp.optim._inplace`): funcamp's transforms and
    ``apply_updates`` write ``where(finite, new, old)`` into the donated ``params`` and ``opt_state`` leaf by
    leaf, and carry the updates in the buffers of ``grads``, which must not be read after. The values returned
    are the same, bit for bit. Elsewhere ``finite`` is not used.
    """
    new_params, new_opt_state, _ = _update(optimizer, grads, opt_state, params, layout, finite)
    return new_params, new_opt_state


def _update(
    optimizer: GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    layout: SingleProcess,
    finite: torch.Tensor | None,
) -> tuple[Any, Any, Any]:
    """:func:`update`, and the updates it applied (for :class:`StepRecord`: the lost-update meter reads them)."""
    _check_update_args(optimizer, grads, opt_state, params)
    donation = _inplace.bound(finite, grads)  # None outside a donating eager step: pure
    updates, new_opt_state = _scope.within(
        layout, _inplace.within, donation, _inplace.call, optimizer, grads, opt_state, params
    )
    new_params = _inplace.within(donation, apply_updates, params, updates)
    return layout.finish_params(new_params), new_opt_state, updates


def commit(state: TrainState, finite: torch.Tensor, params: Any, opt_state: Any, buffers: Any = None) -> TrainState:
    """The next state: the new ``params``, ``opt_state`` and ``buffers`` where ``finite``, else the old ones.

    The step count always advances; the loss scale is adjusted once (``state.loss_scale.adjust(finite)``);
    ``skipped_steps`` and ``consecutive_skips`` count the skipped steps. ``torch.where``, no host sync.

    Parameters the optimizer stage returned ``committed`` (a compiled flat step's update, written already selected
    by this verdict into new buffers: :meth:`funcamp.train._flat.Flat.update`) are kept as they are, with the
    optimizer state's buffers; only its 0-d leaves are selected.
    """
    skipped = state.skipped_steps + (~finite).to(torch.int32)
    consecutive = torch.where(finite, torch.zeros_like(state.consecutive_skips), state.consecutive_skips + 1)
    step = state.step + 1
    if getattr(params, "committed", False):
        params, opt_state = params.storage.commit(finite, params, opt_state, state.opt_state)
    else:
        params = _tree.select_tree(finite, params, state.params)
        opt_state = _tree.select_tree(finite, opt_state, state.opt_state)
    return state.replace(
        step=step,
        params=params,
        opt_state=opt_state,
        loss_scale=state.loss_scale.adjust(finite),
        buffers=_tree.select_tree(finite, buffers, state.buffers) if state.buffers is not None else None,
        skipped_steps=skipped,
        consecutive_skips=consecutive,
    )


def metrics(state: TrainState, new_state: TrainState, loss: torch.Tensor, verdict: Verdict, opt_state: Any) -> dict:
    """The step's metrics (0-d tensors on the parameters' device); see :func:`funcamp.make_train_step`.

    ``opt_state`` is the optimizer's new state before :func:`commit` (the learning rate this step used or
    would have used).
    """
    flags = verdict.flags
    first_bad = torch.argmax((~flags).to(torch.int32)) if flags.numel() else torch.zeros((), dtype=torch.long)
    device = state.step.device
    return {
        "loss": loss,
        # Made on the parameters' device (state.step lives there), not copied from the host: NoOpLossScale has
        # no tensor to carry a device, and a stateless optimizer's state has none to place its NaN rate. A CPU
        # constant copied in would be baked into a CUDA graph (funcamp.capture.check finds it).
        "loss_scale": _scale_on(state.loss_scale, device),
        "grads_finite": verdict.finite,
        "grad_norm": verdict.grad_norm,
        "learning_rate": learning_rate(opt_state, device=device).to(device),
        "skipped_steps": new_state.skipped_steps,
        "consecutive_skips": new_state.consecutive_skips,
        "nonfinite_leaf": torch.where(flags.all(), -1, first_bad.to(torch.int32)),
    }


def _scale_on(loss_scale: LossScale, device: torch.device) -> torch.Tensor:
    """The loss scale's 0-d float32 value on ``device`` (NoOpLossScale's 1.0 made there)."""
    if isinstance(loss_scale, NoOpLossScale):
        return torch.ones((), dtype=torch.float32, device=device)
    return loss_scale.loss_scale.to(device)


class StepRecord(NamedTuple):
    """One step as :func:`run` ran it, for probes: the state before and after, the gradients (parameters'
    dtypes), the :class:`Verdict`, the last micro-batch's aux, the layout, the metrics so far, and the updates
    the optimizer returned (held as the parameters are: ``state.storage.held(record.updates)`` gives the
    tensors and the function that makes the parameters' tree of them)."""

    state: TrainState
    new_state: TrainState
    grads: Any
    verdict: Verdict
    aux: Any
    layout: SingleProcess
    metrics: dict
    updates: Any = None


def run(
    loss_fn: Callable[..., Any],
    optimizer: GradientTransformation,
    state: TrainState,
    batch: Any,
    *,
    has_aux: bool = False,
    accumulation_steps: int = 1,
    layout: SingleProcess | None = None,
    route: _Route | None = None,
) -> StepRecord:
    """One whole train step from the stages: gradients, cast, check, update, commit, metrics.

    ``layout``: the process layout (default the one the state carries, ``state.layout``); ``route``:
    :func:`gradients`'. The parameters the loss sees and the optimizer stage are the state's storage's
    (``state.storage``: flat buffers or leaf by leaf).

    Returns:
      A :class:`StepRecord`; ``record.new_state`` and ``record.metrics`` are what the train step returns
      (before probes add theirs).
    """
    storage, layout = state.storage, state.layout if layout is None else layout
    whole = storage.tree(state.params)
    g = gradients(
        loss_fn,
        state.loss_scale,
        whole,
        batch,
        buffers=state.buffers,
        has_aux=has_aux,
        accumulation_steps=accumulation_steps,
        layout=layout,
        buffer_reductions=state.buffer_reductions,
        route=route,
    )
    per_leaf = cast_like(g.grads, whole)
    # Flat (compiled): the gradients written into their buffers once; the check reads each member's view of them.
    # The record keeps the per-leaf gradients: probes may hand them to torch.cond, whose operands must not alias.
    grads = storage.gradients(per_leaf, state.params)
    verdict = storage.check(check, grads, g.loss, layout)
    new_params, new_opt_state, updates = storage.update(
        _update, optimizer, grads, state.opt_state, state.params, layout, verdict.finite
    )
    new_state = commit(state, verdict.finite, new_params, new_opt_state, g.buffers)
    step_metrics = metrics(state, new_state, g.loss, verdict, new_opt_state)
    return StepRecord(state, new_state, per_leaf, verdict, g.aux, layout, step_metrics, updates)
