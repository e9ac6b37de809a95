"""A language model's head and loss in chunks: ``linear_cross_entropy`` never holds the whole logits.

``F.cross_entropy(hidden @ weight.T, targets)`` on GPT-2's vocabulary (50,304) and 2,048 tokens makes
2048 x 50304 logits: 206 MB in bfloat16, 412 MB once made float32 for the softmax, kept for the backward,
and as much again for their gradient. Checkpointing the blocks does not remove them. Here the rows are
taken ``chunk_size`` at a time; each chunk's logits, softmax and logit gradient live only while that chunk
is processed, and the gradients of ``hidden`` and ``weight`` are computed in the forward (at unit loss
scale, in float32 accumulators) and kept for the backward, which only multiplies them by the loss's
gradient (the loss scale): the fused-linear-cross-entropy approach (Liger Kernel's
``LigerFusedLinearCrossEntropyLoss``; Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language
Models", arXiv:2411.09009, do the same without materializing any chunk). Plain torch: usable in a
``torch.nn.Module``, with ``torch.autocast``, under ``torch.func.grad`` and ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from funcamp import _scope

__all__ = ["linear_cross_entropy"]

_REDUCTIONS = ("mean", "sum")
_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the two gradient matmuls run in: the inputs' where it has float32's exponent range; float32 for
    float16, whose range would underflow the unit-scale logit gradients (as small as 1e-8) and could overflow
    a chunk's weight gradient (the loss scale is only applied in the backward)."""
    return torch.float32 if dtype == torch.float16 else dtype


def _chunk(
    h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, ignore_index: int, grads: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The summed loss of one chunk's rows and (``grads``) the gradient of that sum for its logits.

    The logits are ``h @ weight.T`` in the inputs' dtype (as ``F.linear``), the softmax in float32 (float64 for
    float64 inputs). Ignored rows add 0 and get no gradient; a target outside ``[0, vocab)`` makes its row's
    loss and gradient NaN (no host sync: a compiled step sees a non-finite step, never a wrong number).
    """
    acc = torch.promote_types(h.dtype, torch.float32)
    z = (h @ weight.T).to(acc)
    valid = t != ignore_index
    bad = valid & ((t < 0) | (t >= weight.shape[0]))
    safe = torch.where(valid & ~bad, t, 0).unsqueeze(1)
    lse = torch.logsumexp(z, dim=1)
    rows = torch.where(valid, lse - z.gather(1, safe).squeeze(1), 0.0)
    nan = torch.full((), float("nan"), dtype=acc, device=h.device)
    loss = torch.where(bad, nan, rows).sum()
    if not grads:
        return loss, None
    p = torch.exp(z - lse.unsqueeze(1)).scatter_add(1, safe, -valid.to(acc).unsqueeze(1))  # softmax - one_hot
    p = torch.where(valid.unsqueeze(1), p, 0.0)
    return loss, torch.where(bad.unsqueeze(1), nan, p)


@torch.library.custom_op("funcamp::after", mutates_args=())
def _after(done: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` made once all of ``done`` is in memory: an op inductor cannot see into.

    Compiled, inductor would otherwise run every chunk's logit matmul up front and add the chunks' weight
    gradients in one fused kernel at the end, holding every chunk's logits and ``weight``-sized product at once
    (a value made from ``done``, such as its sum, it computes from the chunks' products without writing
    ``done``). An opaque op's inputs are written to memory first, and its output waits for them.
    """
    return x.clone()


@_after.register_fake
def _(done: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch._dynamo.allow_in_graph
class _LinearCrossEntropy(torch.autograd.Function):
    """``(loss, grad_hidden, grad_weight, factor)``: the chunked loss and the gradients of the summed loss,
    ``factor`` (1 / count for the mean, 1 for the sum) to apply with the loss's gradient. ``hidden`` (N, D),
    ``weight`` (V, D), ``targets`` (N,)."""

    @staticmethod
    def forward(
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_size: int,
        ignore_index: int,
        mean: bool,
    ) -> tuple[torch.Tensor, ...]:
        acc = torch.promote_types(hidden.dtype, torch.float32)
        gd = _grad_dtype(hidden.dtype)
        w = weight.to(gd)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=hidden.device)
        grad_h = []
        for start in range(0, hidden.shape[0], chunk_size):
            h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
            if start and grad_w.numel():
                h = _after(grad_w, h)
            loss, dz = _chunk(h, weight, t, ignore_index, grads=True)
            total = total + loss
            dz = dz.to(gd)
            grad_h.append((dz @ w).to(acc))
            grad_w = grad_w + (dz.T @ h.to(gd)).to(acc)
        count = (targets != ignore_index).sum().to(acc)
        factor = 1.0 / count.clamp(min=1.0) if mean else torch.ones((), dtype=acc, device=hidden.device)
        loss = total / count if mean else total
        grad_h = torch.cat(grad_h) if grad_h else torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
        return loss, grad_h, grad_w, factor

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], outputs: tuple[torch.Tensor, ...]) -> None:
        ctx.dtypes = (inputs[0].dtype, inputs[1].dtype)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*outputs[1:])
        ctx.save_for_backward(*outputs[1:])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor | None, *unused: Any) -> tuple[torch.Tensor | None, ...]:
        if g is None:
            return None, None, None, None, None, None
        grad_h, grad_w, factor = ctx.saved_tensors
        s = g.to(factor.dtype) * factor  # the loss scale times 1 / count: float32, one product per element
        h_dtype, w_dtype = ctx.dtypes
        return (grad_h * s).to(h_dtype), (grad_w * s).to(w_dtype), None, None, None, None


def _check(hidden: Any, weight: Any, targets: Any, chunk_size: Any, ignore_index: Any, reduction: Any) -> None:
    for name, x in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"linear_cross_entropy: {name} must be a tensor, got {type(x).__name__}")
    if hidden.dtype not in _FLOATING or weight.dtype != hidden.dtype:
        raise TypeError(
            "linear_cross_entropy: hidden and weight must have one floating dtype (float16, bfloat16, float32 or "
            f"float64; under torch.autocast both are cast to its dtype), got {hidden.dtype} and {weight.dtype}"
        )
    if weight.ndim != 2 or hidden.ndim < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not fit "
            "hidden @ weight.T (hidden (..., D), weight (vocab, D))"
        )
    if targets.dtype not in (torch.int64, torch.int32) or targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"linear_cross_entropy: targets must be int64 or int32 class indices of shape {tuple(hidden.shape[:-1])} "
            f"(hidden's without its last dimension), got {targets.dtype} {tuple(targets.shape)}"
        )
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be an int >= 1 (rows per chunk), got {chunk_size!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"linear_cross_entropy: ignore_index must be an int, got {ignore_index!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r} ('none' would need the "
            "logits again in the backward, which this function exists to avoid: use F.cross_entropy)"
        )


def _check_targets(targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Eagerly (a host sync): a target outside ``[0, vocab)`` that is not ``ignore_index`` raises, as
    ``F.cross_entropy`` does on the CPU. Compiled, such rows make the loss and the gradients NaN instead."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        first = targets[bad][0].item()
        raise ValueError(
            f"linear_cross_entropy: target {first} is outside [0, {vocab}) (weight has {vocab} rows) and is not "
            f"ignore_index={ignore_index}"
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int = 256,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, targets)`` computed ``chunk_size`` rows at a time, without the logits.

    The logits of ``chunk_size`` rows at a time are ``hidden @ weight.T`` in the inputs' dtype (as an LM head's
    ``F.linear``), their log-softmax in float32 (float64 for float64 inputs). With gradients enabled, the
    gradients of ``hidden`` and ``weight`` are computed in the forward, chunk by chunk, at unit loss scale, in
    the inputs' dtype (float32 for float16 inputs) accumulated in float32, and kept for the backward, which
    multiplies them by the loss's gradient (the loss scale times 1 / count) in float32 and casts each to its
    input's dtype: a float16 gradient too large for float16 comes back as inf (a non-finite step), never
    clamped. Memory: a few ``chunk_size x vocab`` float32 buffers at once, and the gradients (``weight``'s shape
    in float32, ``hidden``'s shape in float32) from the forward to the backward, instead of ``N x vocab``
    logits in float32 and their gradient. A tied weight (the token embedding) works: its two gradients add.
    Under ``torch.no_grad()`` only the loss is computed.
    Compiled, inductor already fuses the unchunked loss (it keeps the logits in the compute dtype only), and
    this function keeps the weight's float32 gradient from the forward to the backward: on GPT-2 124M in
    funcamp's compiled step with ``remat=`` it saved nothing (754 vs 684 MB, docs/memory.md); eagerly, with
    ``torch.utils.checkpoint``, it took 1334 -> 945 MB.

    The result differs from the unchunked loss by summation order only: the per-row terms are the same, their
    sum is taken per chunk and the chunks added (float32 round-off of the sum, a few ulps of the loss); the
    weight's gradient is a sum over chunks of per-chunk products rounded to the gradient dtype (bfloat16:
    its round-off per chunk, as the unchunked product's single rounding).

    Args:
      hidden: ``(..., D)`` float16, bfloat16, float32 or float64 (under ``torch.autocast``: cast to its dtype,
        as ``F.linear`` is).
      weight: ``(vocab, D)``, the same dtype (the head's weight; for a tied head, the token embedding).
      targets: ``hidden.shape[:-1]`` int64 or int32 class indices in ``[0, vocab)`` or ``ignore_index``.
      chunk_size: rows per chunk (default 256: 51 MB per float32 buffer at GPT-2's 50,304 tokens). Compiled,
        the loop is unrolled: ``N / chunk_size`` chunks in the graph.
      ignore_index: a target value that adds nothing to the loss, the count or the gradients.
      reduction: ``"mean"`` (over the rows not ignored; all ignored: NaN loss and zero gradients, as
        ``F.cross_entropy``) or ``"sum"``.
    Returns:
      A 0-d tensor, float32 (float64 for float64 inputs), on ``hidden``'s device.
    Raises:
      TypeError: if an argument is not a tensor, ``hidden`` and ``weight`` do not share one floating dtype, or
        ``ignore_index`` is not an int.
      ValueError: if the shapes do not fit ``hidden @ weight.T``, ``targets`` is not integer of shape
        ``hidden.shape[:-1]``, ``chunk_size`` is not an int >= 1, ``reduction`` is not ``"mean"`` or ``"sum"``,
        or (eagerly; compiled the loss is NaN instead) a target is outside ``[0, vocab)`` and not
        ``ignore_index``.
    References:
      Liger Kernel, ``LigerFusedLinearCrossEntropyLoss`` (Hsu et al. 2024, arXiv:2410.10989).
    """
    device = hidden.device.type if isinstance(hidden, torch.Tensor) else "cpu"
    if (
        isinstance(hidden, torch.Tensor)
        and torch.amp.is_autocast_available(device)
        and torch.is_autocast_enabled(device)
    ):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype) if isinstance(weight, torch.Tensor) else weight
    _check(hidden, weight, targets, chunk_size, ignore_index, reduction)
    if not _scope.compiling():  # a host read: eager only
        _check_targets(targets, weight.shape[0], ignore_index)
    # reshape: torch ops outside the Function, where a tensor subclass such as funcamp.nn's parameter placeholder (a
    # tied head's weight read without calling its module) becomes its tensor with its autograd history; inside, the
    # Function would see the placeholder and the weight's gradient would be lost
    h2, w, t1 = hidden.reshape(-1, hidden.shape[-1]), weight.reshape(weight.shape), targets.reshape(-1)
    off = torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else contextlib.nullcontext()
    with off:  # (a device autocast does not know, funcamp.capture's meta stand-in: none to switch off)
        if not torch.is_grad_enabled():
            return _loss_only(h2, w, t1, chunk_size, ignore_index, reduction == "mean")
        return _LinearCrossEntropy.apply(h2, w, t1, chunk_size, ignore_index, reduction == "mean")[0]


def _loss_only(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int, ignore_index: int, mean: bool
) -> torch.Tensor:
    acc = torch.promote_types(hidden.dtype, torch.float32)
    total = torch.zeros((), dtype=acc, device=hidden.device)
    for s in range(0, hidden.shape[0], chunk_size):
        total = total + _chunk(hidden[s : s + chunk_size], weight, targets[s : s + chunk_size], ignore_index, False)[0]
    return total / (targets != ignore_index).sum().to(acc) if mean else total
