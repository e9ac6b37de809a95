"""How a train step reads the loss: a mean (0-d tensor) or :class:`LossSum` (a sum over counted items).

A plain loss is the mean over its own micro-batch, and the step trains on the mean of micro-batch means
(and of rank means). A :class:`LossSum` says how many items (tokens, say) the sum covers, so the step
can divide the sum over all micro-batches and ranks by the total count: every item weighs the same,
however the padding falls (transformers #24725; torchtune's token-normalised loss).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["LossSum"]


class LossSum(NamedTuple):
    """A loss returned as a sum over ``count`` items, so the step can average over the whole batch.

    Return ``fa.LossSum(total, count)`` from a ``loss_fn`` instead of a mean, e.g.
    ``LossSum(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"), (labels != -100).sum())``.
    :func:`funcamp.make_train_step` then divides the sum of ``total`` over every micro-batch and every
    rank by the sum of ``count`` (one more ``all_reduce`` of two float64 scalars under data parallelism
    and sharding), so the step trains on the exact item mean of the global batch, and ``metrics["loss"]``
    is that mean. A plain loss (a 0-d tensor) keeps its meaning: the mean of micro-batch (and rank) means,
    which weighs items unequally when micro-batches hold different numbers of them.

    Each micro-batch is differentiated as ``total / max(count, 1)`` (the magnitude of a mean, so the loss
    scale fits as it does for a mean loss); its float32 gradient is then weighted by ``count``. A batch
    whose total count is 0 has no mean: its loss is NaN and the step is skipped.

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
    """``(value to differentiate, record)``: a plain loss and ``()``, or ``total / max(count, 1)`` (float32
    at least) and ``(total, count)`` as float64 0-d tensors."""
    if not isinstance(loss, LossSum):
        return loss, ()
    check_loss_sum(loss, fn)
    total, count = loss
    count = torch.as_tensor(count, device=total.device)
    full = torch.promote_types(total.dtype, torch.float32)
    mean = total.to(full) / torch.clamp(count.to(full), min=1)
    return mean, (total.detach().double(), count.detach().double())


def as_mean(loss: Any, fn: str) -> Any:
    """A plain loss as it is; a :class:`LossSum` as ``total / count`` (for host-side tools such as debug)."""
    if not isinstance(loss, LossSum):
        return loss
    check_loss_sum(loss, fn)
    total, count = loss
    return total / torch.as_tensor(count, device=total.device).to(torch.promote_types(total.dtype, torch.float32))
