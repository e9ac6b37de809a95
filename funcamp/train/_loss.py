"""The ``loss_fn`` calling convention, defined once for the train step, its stages and :mod:`funcamp.debug`.

``loss_fn(params, batch) -> loss`` when the state has no buffers, ``loss_fn(params, buffers, batch) ->
(loss, new_buffers)`` when it has; with ``has_aux`` the loss is ``(loss, aux)``. ``loss`` is a mean (a 0-d
tensor) or a :class:`LossSum` (a sum over counted items).

A plain loss is the mean over its own micro-batch, and the step trains on the mean of micro-batch means
(and of rank means). A :class:`LossSum` says how many items (tokens, say) the sum covers, so the step
can divide the sum over all micro-batches and ranks by the total count: every item weighs the same,
however the padding falls (transformers #24725; torchtune's token-normalised loss).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from funcamp import _tree

__all__ = ["LossSum", "micro_batches"]


class LossSum(NamedTuple):
    """A loss returned as a sum over ``count`` items, so the step can average over the whole batch.

    Return ``fa.LossSum(total, count)`` from a ``loss_fn`` instead of a mean, e.g.
    ``LossSum(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"), (labels != -100).sum())``.
    :func:`funcamp.make_train_step` then divides the sum of ``total`` over every micro-batch and every
    rank by the sum of ``count`` (one more ``all_reduce`` of two float64 scalars under data parallelism
    and sharding), so the step trains on the exact item mean of the global batch, and ``metrics["loss"]``
    is that mean. A plain loss (a 0-d tensor) keeps its meaning: the mean of micro-batch (and rank) means,
    which weighs items unequally when micro-batches hold different numbers of them.

    Each micro-batch is differentiated as ``total / count`` (``total`` where the count is 0: the magnitude
    of a mean, so the loss scale fits as it does for a mean loss); its float32 gradient is then weighted by
    ``count``. Counts may be fractional (a weighted mean: ``LossSum((w * l).sum(), w.sum())``). A batch
    whose total count is not positive (0: nothing but padding; negative) has no mean: its loss and
    gradients are NaN and the step is skipped like an overflow (a dynamic loss scale backs off).

    Attributes:
      total: 0-d floating tensor, the sum of the per-item losses (any floating dtype; summed in float64).
      count: 0-d integer or floating tensor (or a Python int), the number of items ``total`` sums over;
        it is not differentiated.
    """

    total: torch.Tensor
    count: torch.Tensor


def check_loss_sum(loss: LossSum, fn: str) -> None:
    """Raise ``TypeError`` unless ``loss.total`` is a 0-d floating tensor and ``loss.count`` a 0-d real count."""
    total, count = loss
    if not (isinstance(total, torch.Tensor) and total.ndim == 0 and total.is_floating_point()):
        got = f"a {total.dtype} tensor of shape {tuple(total.shape)}" if isinstance(total, torch.Tensor) else total
        raise TypeError(f"{fn}: LossSum.total must be a 0-d floating tensor (the summed loss), got {got!r}")
    if isinstance(count, int) and not isinstance(count, bool):
        return
    if not (
        isinstance(count, torch.Tensor) and count.ndim == 0 and not count.is_complex() and count.dtype != torch.bool
    ):
        got = f"a {count.dtype} tensor of shape {tuple(count.shape)}" if isinstance(count, torch.Tensor) else count
        raise TypeError(
            f"{fn}: LossSum.count must be a 0-d integer or floating tensor (or an int), the number of items, "
            f"got {got!r}"
        )


def differentiated(loss: Any, fn: str) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """``(value to differentiate, record)``: a plain loss and ``()``, or ``total / count`` (``total`` where the
    count is 0; float32 at least) and ``(total, count)`` as float64 0-d tensors."""
    if not isinstance(loss, LossSum):
        return loss, ()
    total, count = _full_precision(loss, fn)
    mean = total / torch.where(count > 0, count, torch.ones_like(count))  # weighted by count after
    return mean, (total.detach().double(), count.detach().double())


def as_mean(loss: Any, fn: str) -> Any:
    """A plain loss as it is; a :class:`LossSum` as ``total / count`` (for host-side tools such as debug)."""
    if not isinstance(loss, LossSum):
        return loss
    total, count = _full_precision(loss, fn)
    return total / count


def _full_precision(loss: LossSum, fn: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``loss`` checked, its total and count as tensors of the total's dtype, at least float32, on its device."""
    check_loss_sum(loss, fn)
    total, count = loss
    full = torch.promote_types(total.dtype, torch.float32)
    return total.to(full), torch.as_tensor(count, device=total.device).to(full)


def call(loss_fn: Callable[..., Any], params: Any, buffers: Any, batch: Any, *, has_aux: bool) -> tuple[Any, Any, Any]:
    """``(loss, new_buffers, aux)`` of one call of ``loss_fn`` (``buffers`` None: the model has none).

    ``new_buffers`` is None without buffers, ``aux`` is ``()`` without ``has_aux``.

    Raises:
      TypeError: if ``loss_fn`` with buffers does not return a pair ``(loss, new_buffers)``.
    """
    if buffers is None:
        out, new_buffers = loss_fn(params, batch), None
    else:
        returned = loss_fn(params, buffers, batch)
        if not (isinstance(returned, tuple) and len(returned) == 2):
            got = f"a tuple of {len(returned)}" if isinstance(returned, tuple) else type(returned).__name__
            form = "((loss, aux), new_buffers)" if has_aux else "(loss, new_buffers)"
            raise TypeError(
                f"make_train_step: with state.buffers, loss_fn(params, buffers, batch) must return {form}; got {got}"
            )
        out, new_buffers = returned
    if has_aux and (isinstance(out, LossSum) or not (isinstance(out, tuple) and len(out) == 2)):
        got = "a LossSum alone" if isinstance(out, LossSum) else type(out).__name__
        raise TypeError(
            f"make_train_step: with has_aux=True, loss_fn must return (loss, aux), got {got}; return "
            "(loss, aux) with loss a 0-d tensor or a funcamp.LossSum, or build the step with has_aux=False"
        )
    loss, aux = out if has_aux else (out, ())
    return loss, new_buffers, aux


def as_differentiable(loss_fn: Callable[..., Any], *, has_aux: bool, with_buffers: bool) -> Callable[..., Any]:
    """``fun(params, buffers, batch) -> (value, (new_buffers, aux, record))`` for ``scaled_grad_and_value``.

    ``value`` is what is differentiated (a LossSum's micro-batch mean), ``record`` ``()`` or the LossSum's
    float64 ``(total, count)``; ``buffers``, ``new_buffers`` and ``aux`` are ``()`` where there are none
    (torch.func wants tensors or empty containers in aux).
    """

    def fun(params: Any, buffers: Any, batch: Any) -> Any:
        loss, new_buffers, aux = call(loss_fn, params, buffers if with_buffers else None, batch, has_aux=has_aux)
        value, record = differentiated(loss, "make_train_step")
        return value, (new_buffers if with_buffers else (), aux, record)

    return fun


def micro_batches(batch: Any, k: int, fn: str = "make_train_step") -> list[Any]:
    """``batch`` split into ``k`` micro-batches along dim 0 of every leaf (``[batch]`` itself for ``k == 1``).

    Raises:
      ValueError: if a leaf is not a tensor whose first dimension is divisible by ``k`` (named by its path).
    """
    if k == 1:
        return [batch]
    leaves, spec = _tree.tree_flatten(batch)
    chunks = []
    for path, leaf in zip(_tree.tree_paths(batch), leaves):
        if not isinstance(leaf, torch.Tensor) or leaf.ndim == 0 or leaf.shape[0] % k:
            shape = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise ValueError(
                f"{fn}: with accumulation_steps={k}, every batch leaf must be a tensor whose first "
                f"dimension is divisible by {k}; leaf {path!r} is {shape}"
            )
        chunks.append(leaf.chunk(k))
    return [_tree.tree_unflatten(spec, [c[i] for c in chunks]) for i in range(k)]


def arity_error(loss_fn: Callable[..., Any], with_buffers: bool) -> str | None:
    """Why ``loss_fn`` cannot take the arguments the step passes it, or None (also when it cannot tell)."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # builtins and some C callables have no signature: let the call decide
        return None
    args = ("params", "buffers", "batch") if with_buffers else ("params", "batch")
    try:
        signature.bind(*args)
    except TypeError:
        pass
    else:
        return None
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    if with_buffers:
        return (
            f"train_step: state.buffers is not None (the model has buffers: BatchNorm statistics, fp8 recipe "
            f"state), so loss_fn is called as loss_fn(params, buffers, batch) and must return "
            f"(loss, new_buffers), but {name}{signature} does not take three arguments; write "
            "loss_fn(params, buffers, batch), or build the state without buffers"
        )
    return (
        f"train_step: state.buffers is None, so loss_fn is called as loss_fn(params, batch), but "
        f"{name}{signature} does not take two arguments; if the model has buffers, pass "
        "TrainState.create(..., buffers=buffers) and write loss_fn(params, buffers, batch)"
    )
