"""Sharded data parallelism (ZeRO-3 / FSDP2 layout): parameters, gradients and optimizer state split over ranks.

Every floating master parameter of shape ``(d0, *rest)`` (a 0-d one counts as ``(1,)``) is split along
dim 0 as FSDP2's ``fully_shard`` splits it: with ``N`` ranks and ``c = ceil(d0 / N)`` rows per rank,
rank ``r`` holds rows ``[r * c, (r + 1) * c)`` of the tensor zero-padded to ``N * c`` rows. The
optimizer state is built from these shards (``optimizer.init(shards)``), so it is split the same way,
and each rank stores about ``1 / N`` of the parameters and of the optimizer state.

Inside the train step (``make_train_step(loss_fn, optimizer)`` on a state made with ``shard=layout``),
compiled (the default):

1. The differentiated function takes the shards (:mod:`funcamp._at_use`): each parameter is all-gathered
   (one functional ``all_gather_single``, in ``layout.gather_dtype`` or its own dtype, padding cut) where
   the loss uses it: ``funcamp.nn.functionalize`` asks the step's layout for each parameter at its
   module's use (``param_at_use``), a module called twice gathers twice. The loss is also handed every
   parameter gathered up front, so that a loss that uses ``params`` directly sees whole tensors; in the
   compiled graph an up-front gather nothing uses is dead code, and funcamp's inductor pass drops it.
2. Each parameter's gradient is reduce-scattered once, in its backward (as soon as its last use's backward
   made it), in the policy's ``reduce_dtype`` with the loss scale on a narrower wire: the operations of
   :func:`funcamp.parallel.mean_gradients` on a ``reduce_scatter_single``, each rank receiving its rows
   (:func:`reduce_scatter_gradients` documents the arithmetic). With inductor, each backward use of a
   parameter gathers it again (:class:`funcamp.passes.RematPass`), so a rank holds at once only the
   whole parameters and whole gradients of the modules at work, never all of them (FSDP2's
   ``reshard_after_forward=True``); a cast or view of a gathered parameter (its compute-dtype copy, a
   Linear's transposed weight) is recomputed with its gather for the backward, not kept
   (:mod:`funcamp.passes.sharded_gathers`).
3. :func:`global_stats`: one float64 ``all_reduce`` gives the global gradient norm (the sum of squares
   over all shards) and the per-parameter finite flags (padding rows excluded), so that every rank
   agrees on one ``grads_finite`` and the metrics are those of the unsharded step.
4. The optimizer updates the local shards only; padding rows are set back to exactly zero; a
   non-finite step keeps the old shards and optimizer state (``select_tree``).

Eager (``compile=False``) the step gathers all parameters once, up front (:func:`all_gather_params`, one
collective per dtype, not differentiated), differentiates the whole parameters and reduce-scatters the
float32 gradients after all micro-batches (:func:`reduce_scatter_gradients`): it holds the whole
parameters and gradients during the step, as an unsharded process does.

Where the two differ: the compiled step reduces per micro-batch (``accumulation_steps > 1``: the sum over
ranks and micro-batches is added in another order, float32 round-off) and weights a
:class:`funcamp.LossSum`'s micro-batch by its count before the reduction (``count * mean`` is
differentiated); with a wire as wide as the gradients it reduces the scaled gradients and unscales after
(DDP + ``GradScaler``'s order: bitwise the same for power-of-two loss scales); with ``gather_dtype``
narrower than the masters it adds the gradients of a parameter's uses in the masters' dtype (as the
unsharded step does), the eager step in the gather dtype. With one micro-batch and a power-of-two (or no)
loss scale both are bitwise the unsharded data-parallel step on 2 ranks.

No host sync and no Python branch on tensor values: ``torch.compile(fullgraph=True)`` traces the step
into one graph.

Shards of a 0-d parameter are 1-d (one row); an optimizer mask computed from the shards (``mask=``
as a callable) sees that shape.

Differences from FSDP2: no module wrapper, no DTensor (plain tensors and a static :class:`ShardLayout`;
``torch.func`` differentiates the gathered parameters, never the collectives), one bucket per dtype,
and the float32 gradient mean is reduced in the policy's ``reduce_dtype`` with the loss scale protecting
it on a 16-bit wire (FSDP2 reduces what autograd produced, without knowing the loss scale).

The layout is given once: ``TrainState.create(params, optimizer, shard=layout)`` and the state carries it
(``state.shard``, with the group :func:`shard_layout` was given), so ``make_train_step(loss_fn, optimizer)``
and ``funcamp.checkpoint.save_sharded(path, tree)`` take it from there. The step runs the loss and
``optimizer.update`` within its layout (``funcamp._scope``): ``funcamp.optim.clip_by_global_norm`` then
takes :func:`global_norm` (the norm over all ranks' shards, one float64 ``all_reduce``), and
``funcamp.optim.stochastic_rounding`` each shard's first element index in its whole tensor
(:meth:`ShardLayout.element_offsets`), so its noise is the unsharded run's on any number of ranks. The
same optimizer is right with and without sharding; this module's :func:`clip_by_global_norm` is a
deprecated alias.

Every rank must start from the same parameters: ``TrainState.create(params, optimizer, shard=layout)``
checks it (float64 sum and sum of squares of each parameter, one ``all_gather_object`` over the
layout's group) and names the first parameter that differs; a sharded step started from different
parameters would train a patchwork of the ranks' rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from funcamp import _tree
from funcamp._deprecated import check_optimizer, clip_by_global_norm
from funcamp.optim.base import GradientTransformation
from funcamp.parallel import _check_wire_args, _share, _wait

__all__ = [
    "ShardLayout",
    "all_gather_params",
    "check_consistent",
    "check_optimizer",
    "check_rank",
    "check_same_params",
    "clip_by_global_norm",
    "global_norm",
    "global_stats",
    "reduce_scatter_gradients",
    "shard_layout",
    "shard_params",
    "state_bytes",
    "unshard_params",
    "wire_bytes",
    "zero_padding",
]


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How a parameter tree is split over the ranks (static, host side; build it with :func:`shard_layout`).

    Attributes:
      world_size: ``N``, the number of ranks.
      rank: this process's rank in the group (0 ... N - 1).
      names: the parameters' dotted paths, in tree order (optree's: dict keys sorted).
      shapes: each parameter's whole (unsharded) shape, in the same order.
      gather_dtype: the dtype the parameters are gathered in for the forward and backward; None
        (default) gathers each in its own dtype (exact).
      group: the ``ProcessGroup`` :func:`shard_layout` was given (None: one process, or a layout built
        by hand). Not compared, hashed, shown or pickled; the train step takes it from a state that
        carries the layout, and ``TrainState.create(shard=)`` and
        ``funcamp.checkpoint.save_sharded`` use it to check that this process is ``rank`` of
        ``world_size`` and that every rank starts from the same parameters.
    """

    world_size: int
    rank: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    gather_dtype: torch.dtype | None = None
    group: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled without the process group (a handle of this process, not picklable): it unpickles with
        ``group=None``. A ``TrainState`` that carries the layout pickles so (``torch.save``)."""
        return type(self), (self.world_size, self.rank, self.names, self.shapes, self.gather_dtype)

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardLayout:
        """Itself: immutable, and its process group is this process's handle (``copy.deepcopy`` of a state)."""
        return self

    def rows(self, i: int) -> int:
        """``c``: the rows of parameter ``i`` each rank holds, ``ceil(d0 / N)`` (a 0-d parameter has ``d0 = 1``)."""
        return -(-_dim0(self.shapes[i]) // self.world_size)

    def valid_rows(self, i: int, rank: int | None = None) -> int:
        """How many of ``rank``'s (default: this rank's) ``c`` rows of parameter ``i`` are real, not padding."""
        r = self.rank if rank is None else rank
        return max(0, min(self.rows(i), _dim0(self.shapes[i]) - r * self.rows(i)))

    def shard_shape(self, i: int) -> tuple[int, ...]:
        """The shape of every rank's shard of parameter ``i``: ``(c, *rest)``."""
        return (self.rows(i), *_rest(self.shapes[i]))

    def for_rank(self, rank: int) -> ShardLayout:
        """The same layout as rank ``rank`` sees it."""
        return dataclasses.replace(self, rank=rank)

    def element_offsets(self) -> dict[str, int]:
        """Each parameter's name -> the row-major index, in the whole tensor, of this rank's first element.

        Rank ``r``'s shard of a ``(d0, *rest)`` parameter starts at row ``r * c``, so element ``j`` of the
        flattened shard is element ``r * c * prod(rest) + j`` of the flattened whole tensor (past its
        end for padding). ``optim.stochastic_rounding(..., layout=layout)`` hashes that index, so that
        the shards draw the noise of the whole tensor.

        Example:
          >>> lay = ShardLayout(world_size=2, rank=1, names=("w", "s"), shapes=((5, 3), ()))
          >>> lay.element_offsets()  # w: rows 3..5 of 5 (one of padding); s: rank 1 holds only padding
          {'w': 9, 's': 1}
        """
        return {name: self.rank * self.rows(i) * _numel(_rest(self.shapes[i])) for i, name in enumerate(self.names)}


def _dim0(shape: tuple[int, ...]) -> int:
    return shape[0] if shape else 1


def _rest(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(shape[1:])


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _group_size_rank(group: Any) -> tuple[int, int]:
    if group is None:
        return 1, 0
    from funcamp import parallel

    pg = parallel.resolve_group(group)
    return pg.size(), pg.rank()


def shard_layout(params: Any, group: Any = True, *, gather_dtype: torch.dtype | None = None) -> ShardLayout:
    """The layout that splits ``params`` along dim 0 over the ranks of ``group`` (host side, no communication).

    Args:
      params: the whole parameters, a pytree (dict) of floating tensors (shapes and dtypes are read).
      group: True (the default process group), a ``torch.distributed.ProcessGroup``, or None (one
        process: every shard is the whole tensor; for evaluation and for loading a sharded
        checkpoint into one process).
      gather_dtype: None (default): parameters are gathered in their own dtype, exact. A floating
        dtype (e.g. the policy's compute dtype, as FSDP2's ``param_dtype``): gathered already cast,
        which halves the gather bytes for a 16-bit dtype; exact only when the loss casts every
        parameter to that dtype before using it (``policy.cast_to_compute`` on all of them; not with
        ``funcamp.nn.functionalize``'s float32 norms, which are then rounded to it). In the compiled
        step a cast after the gather is recomputed with the gather for the backward, as the gathered
        tensor is (:mod:`funcamp.passes.sharded_gathers`); ``gather_dtype`` saves the gather's bytes and
        the whole tensor in the parameter's own dtype at each use.
    Returns:
      A :class:`ShardLayout`.
    Raises:
      TypeError: if a leaf of ``params`` is not a floating tensor, ``gather_dtype`` is not None or a
        floating dtype, or ``group`` is not True, None or a ProcessGroup.
      RuntimeError: if a group is asked for and torch.distributed is not initialized.

    Example:
      >>> lay = shard_layout({"w": torch.zeros(5, 3), "s": torch.zeros(())}, None)
      >>> lay.names, lay.shard_shape(0), lay.shard_shape(1)  # one process: each shard is the whole tensor
      (('s', 'w'), (1,), (5, 3))
    """
    bad = _tree.first_non_floating(params)
    if bad is not None:
        raise TypeError(f"shard_layout: every parameter must be a floating tensor; {bad[0]!r} is {bad[1]}")
    if gather_dtype is not None and not (isinstance(gather_dtype, torch.dtype) and gather_dtype.is_floating_point):
        raise TypeError(f"shard_layout: gather_dtype must be None or a floating torch.dtype, got {gather_dtype!r}")
    world, rank = _group_size_rank(group)
    leaves = _tree.tree_leaves(params)
    return ShardLayout(
        world_size=world,
        rank=rank,
        names=tuple(_tree.tree_paths(params)),
        shapes=tuple(tuple(x.shape) for x in leaves),
        gather_dtype=gather_dtype,
        group=_resolve(group),
    )


def _check_tree(tree: Any, layout: ShardLayout, fn: str, *, sharded: bool) -> list[torch.Tensor]:
    """The leaves of ``tree``, checked against ``layout`` (names and whole or shard shapes)."""
    if not isinstance(layout, ShardLayout):
        raise TypeError(f"{fn}: layout must be a funcamp.sharding.ShardLayout (shard_layout(...)), got {layout!r}")
    names, leaves = tuple(_tree.tree_paths(tree)), _tree.tree_leaves(tree)
    if names != layout.names:
        missing = sorted(set(layout.names) - set(names))
        extra = sorted(set(names) - set(layout.names))
        raise ValueError(f"{fn}: the tree's parameters differ from the layout's: missing {missing}, unexpected {extra}")
    for i, (name, x) in enumerate(zip(names, leaves)):
        want = layout.shard_shape(i) if sharded else layout.shapes[i]
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            kind = f"shard on rank {layout.rank} of {layout.world_size}" if sharded else "whole tensor"
            raise ValueError(f"{fn}: parameter {name!r} has shape {got}, but its {kind} has shape {want}")
    return leaves


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` viewed as ``(d0, *rest)`` with zero rows appended up to ``rows``."""
    x = x.reshape(_dim0(tuple(x.shape)), *_rest(tuple(x.shape)))
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def shard_params(params: Any, layout: ShardLayout) -> Any:
    """This rank's shards of the whole ``params`` (host side, no communication): rows ``[r*c, (r+1)*c)``, zero-padded.

    Every rank must pass the same values (start from :func:`funcamp.parallel.broadcast_params`).
    The shards are new tensors (the whole ones can be freed), on the parameters' devices, in their dtypes.

    Raises:
      TypeError: if ``layout`` is not a :class:`ShardLayout`.
      ValueError: if ``params``' names or shapes differ from the layout's.

    Example:
      >>> lay = shard_layout({"w": torch.arange(5.0)}, None).for_rank(1)
      >>> shard_params({"w": torch.arange(5.0)}, dataclasses.replace(lay, world_size=2))["w"]
      tensor([3., 4., 0.])
    """
    leaves = _check_tree(params, layout, "shard_params", sharded=False)
    out = []
    for i, x in enumerate(leaves):
        c = layout.rows(i)
        rows = x.reshape(_dim0(tuple(x.shape)), -1)[layout.rank * c : (layout.rank + 1) * c]
        out.append(_pad_rows(rows, c).reshape(layout.shard_shape(i)).clone())
    return _tree.tree_unflatten(_tree.tree_structure(params), out)


def _collective(funcol: Any, name: str) -> Any:
    """``funcol.<name>_single`` (torch >= 2.12), else its older name ``<name>_tensor`` (same arguments)."""
    return getattr(funcol, f"{name}_single", None) or getattr(funcol, f"{name}_tensor")


def _buckets(dtypes: list[torch.dtype]) -> dict[torch.dtype, list[int]]:
    out: dict[torch.dtype, list[int]] = {}
    for i, d in enumerate(dtypes):
        out.setdefault(d, []).append(i)
    return out


def all_gather_params(shards: Any, layout: ShardLayout, group: Any) -> Any:
    """The whole parameters from every rank's shards: one functional ``all_gather_single`` per dtype.

    Each leaf is gathered in ``layout.gather_dtype`` (None: its own dtype) and returned with its whole
    shape, padding removed. Traceable by ``torch.compile`` (no graph break, no host sync); eager, it
    waits for the result. Every rank must call it with shards of the same layout. Also usable outside
    the step, e.g. to evaluate or export the whole parameters.

    Args:
      shards: this rank's shards (``state.params`` of a sharded state).
      layout: the :class:`ShardLayout` they were made with.
      group: the process group (a ``ProcessGroup``, or True for the default one); None for one process.
    Returns:
      A tree like the whole parameters: whole shapes, dtype ``gather_dtype`` or the shards' own.
    Raises:
      ValueError: if the shards' names or shapes differ from the layout's.
    """
    leaves = _check_tree(shards, layout, "all_gather_params", sharded=True)
    dtypes = [layout.gather_dtype or x.dtype for x in leaves]
    out: list[torch.Tensor] = [None] * len(leaves)  # type: ignore[list-item]
    world = layout.world_size
    pg = _group_for(layout, group, "all_gather_params")
    for dtype, idx in _buckets(dtypes).items():
        flat = torch.cat([leaves[i].to(dtype).reshape(-1) for i in idx])
        if pg is None:
            rows = flat.view(1, -1)
        else:
            from torch.distributed import _functional_collectives as funcol

            rows = _wait(_collective(funcol, "all_gather")(flat, 0, pg)).view(world, -1)
        sizes = [_numel(layout.shard_shape(i)) for i in idx]
        for i, part in zip(idx, rows.split(sizes, dim=1)):
            full = part.reshape(world * layout.rows(i), *_rest(layout.shapes[i]))
            out[i] = full[: _dim0(layout.shapes[i])].reshape(layout.shapes[i])
    return _tree.tree_unflatten(_tree.tree_structure(shards), out)


def unshard_params(shards: Any, layout: ShardLayout, group: Any) -> Any:
    """The whole parameters in their own dtypes: :func:`all_gather_params` with ``gather_dtype=None``."""
    return all_gather_params(shards, dataclasses.replace(layout, gather_dtype=None), group)


def _resolve(group: Any) -> Any:
    """None (one process), or the ProcessGroup that ``group`` (True or a ProcessGroup) names."""
    if group is None:
        return None
    from funcamp import parallel

    pg = parallel.resolve_group(group) if group is True else group
    if not (dist.is_available() and isinstance(pg, dist.ProcessGroup)):
        raise TypeError(f"sharding: group must be True, None or a torch.distributed.ProcessGroup, got {group!r}")
    return pg


def _group_for(layout: ShardLayout, group: Any, fn: str) -> Any:
    """The group of ``layout.world_size`` ranks to communicate over, or None for a one-rank layout."""
    pg = _resolve(group)
    size = 1 if pg is None else pg.size()
    if size != layout.world_size:
        raise ValueError(
            f"{fn}: the layout splits over {layout.world_size} ranks but the group has {size}; pass the group the "
            "layout was made for (shard_layout(params, group))"
        )
    return pg


def reduce_scatter_gradients(
    grads: Any,
    layout: ShardLayout,
    group: Any,
    reduce_dtype: torch.dtype | None = None,
    *,
    loss_scale: torch.Tensor | None = None,
) -> Any:
    """This rank's rows of the mean of ``grads`` over the ranks, communicated in ``reduce_dtype``.

    The operations of :func:`funcamp.parallel.mean_gradients` leaf for leaf (each rank sends ``(g *
    loss_scale) / N`` computed in ``g``'s dtype and cast to ``reduce_dtype`` where that is narrower
    and a loss scale is given, else ``g / N`` cast to it; the sum is cast back and multiplied by ``1 /
    loss_scale``, the reciprocal computed in float64 and cast to float32), with a functional
    ``reduce_scatter_single`` per wire dtype in place of the ``all_reduce``: each rank receives only
    its ``c`` rows of each leaf. Padding rows are zero on every rank, so they stay exactly zero.
    On two ranks the sum of two terms does not depend on their order, so the result is bitwise the
    unsharded mean's rows; on more ranks gloo's (and NCCL's) ring sums each element in an order that
    depends on its position in the buffer, which differs from ``mean_gradients``' bucket: the
    results agree to float32 round-off of the sum (``tests/test_sharding.py`` measures it).

    Args:
      grads: the whole float32 (or float64) gradients, shaped like the whole parameters.
      layout: the :class:`ShardLayout`.
      group: the process group (or True); None for one process (the mean of one rank: ``grads`` rows).
      reduce_dtype: the wire dtype (``Policy.reduce_dtype``); None keeps each leaf's dtype.
      loss_scale: the 0-d float32 loss scale the gradients were computed with, or None.
    Returns:
      A tree like the shards: shapes ``(c, *rest)``, the gradients' dtypes.
    Raises:
      TypeError: if ``reduce_dtype`` is not None or a floating dtype, or ``loss_scale`` not a 0-d
        float32 tensor.
      ValueError: if ``grads``' names or shapes differ from the layout's whole shapes.
    """
    _check_wire_args("reduce_scatter_gradients", reduce_dtype, loss_scale)
    leaves = _check_tree(grads, layout, "reduce_scatter_gradients", sharded=False)
    world = layout.world_size
    pg = _group_for(layout, group, "reduce_scatter_gradients")
    inv = None if loss_scale is None else torch.reciprocal(loss_scale.double()).float()
    out: list[torch.Tensor] = [None] * len(leaves)  # type: ignore[list-item]
    for wire, idx in _buckets([reduce_dtype or g.dtype for g in leaves]).items():
        scaled = [loss_scale is not None and wire.itemsize < leaves[i].dtype.itemsize for i in idx]
        parts = []
        for i, s in zip(idx, scaled):
            share = _share(leaves[i], loss_scale if s else None, world, wire)
            rows = _pad_rows(share.view(_dim0(layout.shapes[i]), -1), world * layout.rows(i))
            parts.append(rows.view(world, -1))
        flat = torch.cat(parts, dim=1).reshape(-1)
        if pg is None:
            mine = flat
        else:
            from torch.distributed import _functional_collectives as funcol

            mine = _wait(_collective(funcol, "reduce_scatter")(flat, "sum", 0, pg))
        sizes = [_numel(layout.shard_shape(i)) for i in idx]
        for i, s, part in zip(idx, scaled, mine.split(sizes)):
            mean = part.view(layout.shard_shape(i)).to(leaves[i].dtype)
            out[i] = mean * inv if s else mean
    return _tree.tree_unflatten(_tree.tree_structure(grads), out)


def _valid(x: torch.Tensor, layout: ShardLayout, i: int) -> torch.Tensor:
    v = layout.valid_rows(i)
    return x if v == layout.rows(i) else x[:v]


def global_stats(
    grad_shards: Any, layout: ShardLayout, group: Any, loss: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(finite, flags, grad_norm)`` over all ranks' gradient shards, from one float64 ``all_reduce``.

    Each rank puts into one float64 vector the sum of squares of its shards' real rows (padding
    excluded), the number of non-finite elements of each leaf's real rows, and whether its ``loss``
    is not finite; the sum over the ranks gives the global norm ``sqrt(sum of squares)`` (float64
    cannot overflow or underflow on squares of float32 values, so no scaling is needed; the
    unsharded step's ``funcamp._tree.global_norm`` sums float32 squares per leaf, so the two agree to
    float32 round-off, not bitwise) and one verdict shared by every rank.

    Returns:
      ``finite``: 0-d bool, every gradient element and every rank's loss finite; ``flags``: 1-d bool,
      one per floating leaf in tree order, that leaf finite on every rank (the unsharded step's
      ``finite_flags`` of the mean gradients); ``grad_norm``: 0-d float32 (float64 if a gradient is
      float64), NaN or inf when an element is.
    """
    leaves = _check_tree(grad_shards, layout, "global_stats", sharded=True)
    device = loss.device
    valid = [_valid(g, layout, i) for i, g in enumerate(leaves)]
    sumsq = [torch.sum(torch.square(g.double())) for g in valid if g.numel()]
    bad = [
        (~torch.isfinite(g)).sum().double() if g.numel() else torch.zeros((), dtype=torch.float64, device=device)
        for g in valid
    ]
    vec = torch.stack(
        [sum(sumsq, torch.zeros((), dtype=torch.float64, device=device)), *bad, (~torch.isfinite(loss)).double()]
    )
    pg = _group_for(layout, group, "global_stats")
    if pg is not None:
        from torch.distributed import _functional_collectives as funcol

        vec = _wait(funcol.all_reduce(vec, "sum", pg))
    out_dtype = torch.float64 if any(g.dtype == torch.float64 for g in leaves) else torch.float32
    flags = vec[1:-1] == 0
    finite = (vec[1:] == 0).all()
    return finite, flags, torch.sqrt(vec[0]).to(out_dtype)


def zero_padding(shards: Any, layout: ShardLayout) -> Any:
    """``shards`` with their padding rows set to exactly zero (static slices; traceable).

    The train step applies it to the new parameters, so that padding stays invisible whatever the
    optimizer does with a zero gradient on a zero parameter.
    """
    leaves = _tree.tree_leaves(shards)
    out = []
    for i, x in enumerate(leaves):
        v = layout.valid_rows(i)
        out.append(x if v == layout.rows(i) else torch.cat([x[:v], torch.zeros_like(x[v:])]))
    return _tree.tree_unflatten(_tree.tree_structure(shards), out)


def global_norm(shards: Any, layout: ShardLayout, group: Any) -> torch.Tensor:
    """The L2 norm of the whole tensors a tree of shards is split from: one float64 ``all_reduce``.

    Each rank sums, in float64, the squares of its floating leaves (a leaf named like a parameter of
    ``layout``, with that parameter's shard shape, counts its real rows only: padding rows are taken as
    zero), and the sum over the ranks gives ``sqrt(sum of squares)``. float64 cannot overflow or underflow
    on squares of float32 values, so no scaling is needed. Every rank must call it with a tree of the
    same structure (it communicates). ``Sharded.global_norm`` of a train step, and so
    ``funcamp.optim.clip_by_global_norm`` in a sharded step, take their norm here.

    Args:
      shards: a tree of this rank's shards (the gradients or updates of a sharded step, or a subtree of
        them, as a ``multi_transform`` group sees it).
      layout: the :class:`ShardLayout`.
      group: the process group (or True); None for one process.
    Returns:
      A 0-d float64 tensor on the device of the first floating leaf (CPU for none), the same on every
      rank; NaN or inf when an element is.
    Raises:
      ValueError: if the group's size is not the layout's world size.
    """
    index = {name: i for i, name in enumerate(layout.names)}
    leaves = []
    for name, u in zip(_tree.tree_paths(shards), _tree.tree_leaves(shards)):
        if not _tree.is_floating(u):
            continue
        i = index.get(name)
        if i is not None and tuple(u.shape) == layout.shard_shape(i) and layout.valid_rows(i) < layout.rows(i):
            v = layout.valid_rows(i)
            u = torch.cat([u[:v], torch.zeros_like(u[v:])])  # the padding rows, whatever an inner transform did
        leaves.append(u)
    device = leaves[0].device if leaves else torch.device("cpu")
    sumsq = sum(
        (torch.sum(torch.square(u.double())) for u in leaves), torch.zeros((), dtype=torch.float64, device=device)
    )
    pg = _group_for(layout, group, "global_norm")
    if pg is not None:
        from torch.distributed import _functional_collectives as funcol

        sumsq = _wait(funcol.all_reduce(sumsq, "sum", pg))
    return torch.sqrt(sumsq)


def check_consistent(layout: ShardLayout, group: Any, *, optimizer: Any = None, **config: Any) -> None:
    """Check (host side, one ``all_gather_object``) that every rank has the same layout and configuration.

    The sharded train step calls it (``Sharded.check_ranks``) with the policy, so that ranks built with
    other policies fail before they exchange mismatched buffers. ``optimizer`` is deprecated and ignored
    (``optim.stochastic_rounding`` takes its layout from the step).

    Raises:
      ValueError: if rank ``r``'s layout is not for rank ``r`` of the group's size, saying which rank it is
        for (every rank raises alike).
      ValueError: naming the first rank whose layout (a parameter's name or shape, the world size,
        the gather dtype) or configuration differs from rank 0's, and what differs.
    """
    if optimizer is not None:
        import warnings

        warnings.warn(
            "funcamp.sharding.check_consistent: optimizer= is deprecated and ignored (optim.stochastic_rounding "
            "takes its element offsets from the train step's layout)",
            DeprecationWarning,
            stacklevel=2,
        )
    pg = _resolve(group)
    if pg is None:
        return
    mine = {
        "layout": (layout.world_size, layout.names, layout.shapes, str(layout.gather_dtype)),
        **{k: str(v) for k, v in config.items()},
    }
    everyone: list[Any] = [None] * pg.size()
    dist.all_gather_object(everyone, (mine, (layout.rank, layout.world_size)), group=pg)
    _check_claims([claim for _, claim in everyone], "sharding")
    everyone = [m for m, _ in everyone]
    ref = everyone[0]
    for r, other in enumerate(everyone):
        if other == ref:
            continue
        for key in ref:
            if other.get(key) != ref[key]:
                what = _first_difference(key, ref[key], other.get(key))
                raise ValueError(
                    f"sharding: rank {r} differs from rank 0 in {what}; every rank must build the sharded step "
                    "with the same parameters, policy and layout"
                )


def check_rank(layout: ShardLayout, group: Any, fn: str) -> None:
    """Refuse a layout made for another rank or world size than this process's in ``group`` (host side).

    ``group`` is a ProcessGroup, True, or None (one process: the layout must be of one rank).

    Raises:
      ValueError: saying which rank of how many the layout is for, and which this process is.
    """
    pg = _resolve(group)
    size, rank = (1, 0) if pg is None else (pg.size(), pg.rank())
    if layout.rank != rank or layout.world_size != size:
        raise ValueError(
            f"{fn}: the layout is for rank {layout.rank} of {layout.world_size}, but this process is rank "
            f"{rank} of {size} in the group; build it with shard_layout(params, group)"
        )


def _check_claims(claims: list[tuple[int, int]], fn: str) -> None:
    """Refuse, on every rank alike, when rank ``r``'s layout is not for rank ``r`` of ``len(claims)``."""
    for r, (rank, world) in enumerate(claims):
        if (rank, world) != (r, len(claims)):
            raise ValueError(
                f"{fn}: on rank {r} of {len(claims)} in the group, the layout is for rank {rank} of {world}; build it "
                "with shard_layout(params, group) on every rank"
            )


def _checksums(params: Any) -> list[tuple[float, float]]:
    """``(sum, sum of squares)`` of each leaf in float64: one host transfer."""
    leaves = [x for x in _tree.tree_leaves(params) if isinstance(x, torch.Tensor)]
    if not leaves:
        return []
    sums = torch.stack([torch.stack([x.double().sum(), x.double().square().sum()]) for x in leaves]).cpu()
    return [tuple(row) for row in sums.tolist()]


def _equal_sums(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def check_same_params(params: Any, group: Any, fn: str, layout: ShardLayout | None = None) -> None:
    """Check (host side, one ``all_gather_object`` of two float64 numbers per leaf) that every rank of
    ``group`` holds the same parameters.

    Each rank sends the float64 sum and sum of squares of each leaf; a leaf whose numbers differ from
    rank 0's is refused. A cheap checksum, not a bitwise comparison: two different tensors with equal
    sums and sums of squares (a permutation of the same values) pass. Nothing is checked for ``None``
    (one process). With ``layout``, the same collective also checks that each rank's layout is for
    that rank of the group's size (every rank raises alike, none is left waiting in a collective).

    Raises:
      ValueError: if a rank's ``layout`` is not for its rank and world size; naming the first
        differing parameter (tree order) and the ranks whose copy differs from rank 0's, and saying to
        start from ``funcamp.parallel.broadcast_params``.
    """
    pg = _resolve(group)
    if pg is None:
        return
    claim = None if layout is None else (layout.rank, layout.world_size)
    mine = (tuple(_tree.tree_paths(params)), _checksums(params), claim)
    everyone: list[Any] = [None] * pg.size()
    dist.all_gather_object(everyone, mine, group=pg)
    if layout is not None:
        _check_claims([c for _, _, c in everyone], fn)
    names, ref, _ = everyone[0]
    for i, name in enumerate(names):
        bad = [
            r
            for r, (n, sums, _) in enumerate(everyone)
            if n != names or len(sums) != len(ref) or not _equal_sums(sums[i], ref[i])
        ]
        if bad:
            raise ValueError(
                f"{fn}: the parameters differ between ranks: {name!r} on rank(s) {bad} differs from rank 0's "
                "(float64 sum and sum of squares); start every rank from the same parameters with "
                "params = funcamp.parallel.broadcast_params(params)"
            )


def _first_difference(key: str, a: Any, b: Any) -> str:
    if key != "layout" or b is None:
        return f"{key}: rank 0 has {a!r}, it has {b!r}"
    (wa, na, sa, ga), (wb, nb, sb, gb) = a, b
    if wa != wb:
        return f"the world size: {wa} vs {wb}"
    if na != nb:
        return f"the parameter names: {sorted(set(na) ^ set(nb))}"
    for name, x, y in zip(na, sa, sb):
        if x != y:
            return f"the shape of parameter {name!r}: {x} vs {y}"
    return f"the gather dtype: {ga} vs {gb}"


# --- memory and wire --------------------------------------------------------------------------------


def _meta(shapes: Any) -> Any:
    return _tree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta"), shapes)


def state_bytes(params: Any, optimizer: GradientTransformation, world_size: int = 1) -> dict[str, int]:
    """Bytes one rank stores for the train state, computed from shapes (no allocation: ``meta`` tensors).

    ``params`` (the whole parameters; real or ``meta`` tensors) are split as :func:`shard_layout`
    would over ``world_size`` ranks (1: unsharded, DDP-style), and ``optimizer.init`` runs on meta
    shards of rank 0 (the largest: every rank's shard has ``c`` rows, padding included).

    Returns:
      ``{"params": ..., "optimizer": ..., "grads": ..., "total": ...}``: bytes of the parameter
      shards, of the optimizer state, of one set of gradient shards in the parameters' dtypes (what
      the step hands the optimizer), and their sum; padding counted.
    """
    leaves, spec = _tree.tree_flatten(params)
    shapes = [tuple(x.shape) for x in leaves]
    shards = [
        torch.empty((-(-_dim0(s) // world_size), *_rest(s)), dtype=x.dtype, device="meta")
        if world_size > 1
        else torch.empty(s, dtype=x.dtype, device="meta")
        for s, x in zip(shapes, leaves)
    ]
    tree = _tree.tree_unflatten(spec, shards)
    p = _tree.tree_bytes(tree)
    o = _tree.tree_bytes(optimizer.init(tree))
    return {"params": p, "optimizer": o, "grads": p, "total": p + o + p}


def wire_bytes(
    params: Any, world_size: int, *, reduce_dtype: torch.dtype | None = None, gather_dtype: torch.dtype | None = None
) -> dict[str, int]:
    """Bytes one rank sends per step for the gradients and parameters (ring algorithms), from shapes.

    A ring ``all_reduce`` of ``B`` bytes sends ``2 (N - 1) / N * B`` per rank; a ring ``all_gather``
    or ``reduce_scatter`` of a ``B``-byte result sends ``(N - 1) / N * B``. The small collectives
    (finite flags, loss, norm) are left out.

    Returns:
      ``{"ddp": ..., "sharded": ..., "all_gather": ..., "reduce_scatter": ...}``: DDP-style data
      parallelism (:func:`funcamp.parallel.mean_gradients`: one all-reduce of the gradients in
      ``reduce_dtype``) and the sharded step (an all-gather of the parameters in ``gather_dtype`` and
      a reduce-scatter of the gradients in ``reduce_dtype``, padding included), and its two parts.
    """
    leaves = _tree.tree_leaves(params)
    n = world_size
    pad = [n * -(-_dim0(tuple(x.shape)) // n) * _numel(_rest(tuple(x.shape))) for x in leaves]
    exact = [x.numel() for x in leaves]
    grad = sum(e * (reduce_dtype or x.dtype).itemsize for e, x in zip(exact, leaves))
    gather = sum(p * (gather_dtype or x.dtype).itemsize for p, x in zip(pad, leaves))
    scatter = sum(p * (reduce_dtype or x.dtype).itemsize for p, x in zip(pad, leaves))
    part = (n - 1) / n
    ag, rs = round(part * gather), round(part * scatter)
    return {"ddp": round(2 * part * grad), "sharded": ag + rs, "all_gather": ag, "reduce_scatter": rs}
