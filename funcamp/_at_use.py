"""Per-parameter all-gather at its use and reduce-scatter of its gradient as it is made (the sharded step's core).

A sharded train step differentiates this rank's shards. Inside the differentiated function each shard ``s``
(rows ``[r c, (r + 1) c)`` of a parameter of whole shape ``(d0, *rest)``, zero-padded) becomes:

- a *reduce point* ``h = _ReducePoint.apply(s, loss_scale, spec)``: a whole-shaped zero-stride tensor (one
  element of storage) that carries no value. Every use of the parameter sends its whole gradient to ``h``,
  where autograd adds them up in the parameter's dtype (float32 masters: float32, whatever the gather
  dtype), as the unsharded step adds the gradients of a tied weight or of a module called twice. ``h``'s
  backward turns the sum into this rank's rows of the mean over the ranks, with one ``reduce_scatter``
  (:func:`_reduce`) waited for at once (compiled too: a wait left to the result's first use, the optimizer at
  the end of the step, kept every whole gradient alive until then), and hands them to ``s``. So a gradient
  is reduced once per parameter and call of the differentiated function, however many times the parameter
  is used, in backward order: as soon as its last use's backward has made it, and the whole gradient is
  freed then.
- *gathers* ``w = _Gather.apply(s, h, spec)``, one per use: one ``all_gather`` of every rank's shard in the
  gather dtype, padding cut, the whole shape. Its backward gives the incoming gradient to ``h`` (and nothing
  to ``s``). Gathered per use, a parameter's whole tensor lives from its gather to its module's last forward
  op; in the compiled step :class:`funcamp.passes.RematPass` gathers it again for the backward (the
  nodes are tagged by :func:`funcamp.passes.gather_region`) and drops gathers nothing uses.

The arithmetic of the reduction is that of :func:`funcamp.sharding.reduce_scatter_gradients` applied to the
scaled gradient, so that the step's unscale after ``torch.func.grad`` (``* 1 / loss_scale`` in float32)
finishes it: where the wire is narrower than the gradient, each rank sends ``((g / scale) * scale) / N``
(exactly the operations of ``mean_gradients``) and the unscale is the last multiplication of both; where
it is not, each rank sends ``g / N`` of the *scaled* gradient and the unscale follows the sum (DDP and
``torch.amp.GradScaler``'s order), which equals the unscaled order bitwise when the scale is a power of two
(every :class:`funcamp.DynamicLossScale` scale from a power-of-two start) and no scaled gradient is
subnormal or near the float32 maximum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from funcamp import _scope
from funcamp.parallel import _wait

R = TypeVar("R")

__all__ = ["Spec", "Uses", "current", "gather", "reduce_point", "within"]


@dataclasses.dataclass(frozen=True)
class Spec:
    """Static facts about one parameter's shard (hashable: a constant of the traced graph).

    Attributes:
      shape: the whole shape; ``rows``: ``c``, the rows each rank holds; ``world``: ``N``.
      gather_dtype: the dtype the shards are gathered in (the gradients of the uses add up in the shard's own).
      wire: the dtype the gradient is reduce-scattered in; None: the gradient's own (float32 at least).
      group: the process group, or None for one rank (no communication). Not compared or hashed.
    """

    shape: tuple[int, ...]
    rows: int
    world: int
    gather_dtype: torch.dtype
    wire: torch.dtype | None
    group: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    @property
    def d0(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def rest(self) -> tuple[int, ...]:
        return tuple(self.shape[1:])


def _funcol() -> Any:
    from torch.distributed import _functional_collectives as funcol

    return funcol


def _all_gather(shard: torch.Tensor, spec: Spec) -> torch.Tensor:
    flat = shard.detach().to(spec.gather_dtype).reshape(-1)  # the collective is not differentiated
    if spec.group is None:
        rows = flat
    else:
        fn = getattr(_funcol(), "all_gather_single", None) or _funcol().all_gather_tensor
        rows = _wait(fn(flat, 0, spec.group))
    whole = rows.view(spec.world * spec.rows, *spec.rest)
    return whole[: spec.d0].reshape(spec.shape)


def _reduce(g: torch.Tensor, loss_scale: torch.Tensor | None, spec: Spec, out_dtype: torch.dtype) -> torch.Tensor:
    """This rank's rows of the sum over ranks of ``g / N`` (``g`` the scaled whole gradient), see the module."""
    g = g if g.dtype.itemsize >= 4 else g.float()  # the float32 the unsharded step unscales into
    wire = spec.wire or g.dtype
    # Padded first, with zero rows (zero through every operation below): compiled, the padding, the casts and
    # the division are one kernel writing the wire buffer, where a cat after them made a second copy of it.
    g = torch.nn.functional.pad(g.reshape(spec.d0, -1), (0, 0, 0, spec.world * spec.rows - spec.d0))
    if loss_scale is not None and wire.itemsize < g.dtype.itemsize:
        inv = torch.reciprocal(loss_scale.double()).float()
        g = (g * inv) * loss_scale  # the unscaled gradient, scaled again for the wire, as mean_gradients
    flat = (g / spec.world).to(wire).reshape(-1).detach()  # not differentiated again (the collective's own)
    if spec.group is None:
        mine = flat
    else:
        fn = getattr(_funcol(), "reduce_scatter_single", None) or _funcol().reduce_scatter_tensor
        # Waited for here, compiled too: traced without it, the wait lands at the result's first use, where the
        # cast and the unscale are fused into the optimizer's kernels at the end of the step, and until a
        # collective is waited for its input lives (and gloo's copy of it): every whole gradient, at once.
        mine = _funcol().wait_tensor(fn(flat, "sum", 0, spec.group))
    return mine.view(spec.rows, *spec.rest).to(out_dtype)  # the unscale (* 1 / scale) follows torch.func.grad


class _ReducePoint(torch.autograd.Function):
    """``shard -> h``: a whole-shaped, zero-stride float of no value; the gradient sum over uses arrives here."""

    @staticmethod
    def forward(shard: torch.Tensor, loss_scale: torch.Tensor | None, spec: Spec) -> torch.Tensor:
        return shard.new_zeros(()).expand(spec.shape)  # the parameter's dtype: the uses' gradients add up in it

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        shard, loss_scale, spec = inputs
        ctx.spec, ctx.out_dtype = spec, (shard.dtype if shard.dtype.itemsize >= 4 else torch.float32)
        ctx.save_for_backward(loss_scale)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (loss_scale,) = ctx.saved_tensors
        return _reduce(g, loss_scale, ctx.spec, ctx.out_dtype), None, None


class _Gather(torch.autograd.Function):
    """``(shard, h) -> whole``: every rank's shard all-gathered; the gradient goes to ``h``, none to ``shard``."""

    @staticmethod
    def forward(shard: torch.Tensor, point: torch.Tensor, spec: Spec) -> torch.Tensor:
        return _all_gather(shard, spec)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.point_dtype = inputs[1].dtype

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        return None, g.to(ctx.point_dtype), None


def reduce_point(shard: torch.Tensor, loss_scale: torch.Tensor | None, spec: Spec) -> torch.Tensor:
    """The reduce point of ``shard`` (see the module); ``loss_scale`` the 0-d float32 scale, or None."""
    return _ReducePoint.apply(shard, loss_scale, spec)


def gather(shard: torch.Tensor, point: torch.Tensor, spec: Spec) -> torch.Tensor:
    """The whole parameter from every rank's ``shard``, in ``spec.gather_dtype``; its gradient goes to ``point``."""
    from funcamp import passes

    with passes.gather_region():  # compiling: tagged, so that the backward gathers it again
        return _Gather.apply(shard, point, spec)


class Uses:
    """One differentiated call's shards, reduce points and up-front tensors, for ``param_at_use``.

    ``whole`` are the parameters the loss is handed: gathered tensors (correct for a loss that uses them
    directly); :meth:`at_use` recognises one of them (by identity) and gathers it again where its module
    uses it, so that in the compiled graph an up-front gather nothing else uses is dead code, removed.
    """

    def __init__(self, shards: list[torch.Tensor], specs: list[Spec], loss_scale: torch.Tensor | None) -> None:
        # A view: Dynamo sees the differentiated inputs of torch.func.grad as not requiring grad and would then
        # inline the Functions' forwards (their custom backwards lost); an op on them makes it see they do.
        self.shards = [s.view(s.shape) for s in shards]
        shards = self.shards
        self.specs = specs
        self.points = [reduce_point(s, loss_scale, spec) for s, spec in zip(shards, specs)]
        self.whole = [gather(s, h, spec) for s, h, spec in zip(shards, self.points, specs)]
        self.used_at_use = [0] * len(shards)

    def at_use(self, stored: Any) -> Any:
        """A fresh gather of the parameter ``stored`` is (one of :attr:`whole`), or ``stored`` itself."""
        for i, w in enumerate(self.whole):
            if stored is w:
                self.used_at_use[i] += 1
                return gather(self.shards[i], self.points[i], self.specs[i])
        return stored


_USES = _scope.Scope()


def within(uses: Uses, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> R:
    """``fn(*args, **kwargs)`` with ``uses`` as :func:`current` (a :class:`funcamp._scope.Scope` of its own)."""
    return _USES.within(uses, fn, *args, **kwargs)


def current() -> Uses | None:
    """The :class:`Uses` of the innermost :func:`within`, or None."""
    return _USES.current()
