"""Process layouts: one interface for what a train step does across processes.

A layout answers the questions a step asks of its processes, and nothing else: which parameters to
differentiate (all-gathered shards, or the parameters as they are), how to reduce the gradients (not at
all, averaged, reduce-scattered), how to agree on one finite verdict and one gradient norm, how to add up
or average a number, and what to do to the new parameters (zero the padding of shards). The stages of
:mod:`funcamp.train` take a layout and never ask which kind it is, as flax's training code takes an axis
name and torchtitan's train loop does not know which parallelisms were applied.

- :class:`SingleProcess`: one process, nothing travels.
- :class:`DataParallel`: every rank holds everything; gradients averaged over a process group in a
  reduce dtype (:func:`funcamp.parallel.mean_gradients`).
- :class:`Sharded`: ZeRO-3 / FSDP2-style, every rank holds its rows of every parameter
  (:mod:`funcamp.sharding`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from funcamp import _at_use, _scope, _tree, parallel, sharding
from funcamp.policy import Policy, get_policy

__all__ = ["DataParallel", "Sharded", "SingleProcess", "layout_from"]


class SingleProcess:
    """One process: the gradients, losses, norms and buffers stay as they are.

    Example:
      >>> import torch
      >>> layout = SingleProcess()
      >>> layout.stats({"w": torch.tensor([3.0, 4.0])}, torch.tensor(1.0))
      (tensor(True), tensor([True]), tensor(5.))
    """

    group: Any = None
    size: int = 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def check_optimizer(self, optimizer: Any) -> None:
        """Build time: refuse an optimizer whose norms are another layout's (``sharding.clip_by_global_norm``)."""
        sharding.check_optimizer(optimizer, self.group, sharded=False)

    def check_state(self, state: Any) -> None:
        """A step's first call, host side: refuse a state that belongs to another layout (shards)."""
        if sharding.is_sharded(state.params):
            raise ValueError(
                "train_step: state.params are shards (from TrainState.create(..., shard=layout) or "
                "funcamp.checkpoint.load_sharded), but this step was built without shard=; build it with "
                "make_train_step(..., data_parallel=group, shard=layout)"
            )

    def gather(self, params: Any) -> Any:
        """The parameters to differentiate: ``params`` themselves."""
        return params

    def around_loss(self, fun: Callable[..., Any], loss_scale: torch.Tensor | None) -> Callable[..., Any]:
        """``fun(params, *rest)`` (the function :func:`funcamp.train.gradients` differentiates) run within this
        layout (:func:`funcamp._scope.within`), given what :meth:`gather` returned; ``loss_scale``: the 0-d
        float32 scale the loss is multiplied by, or None."""
        del loss_scale
        return functools.partial(_scope.within, self, fun)

    def weigh(self, grads: Any, count: torch.Tensor) -> Any:
        """A :class:`funcamp.LossSum` micro-batch's gradients (of its mean) weighted by its ``count`` (0-d)."""
        return _tree.tree_map(lambda g: g * count.to(g.dtype), grads)

    def reduce_gradients(self, grads: Any, loss_scale: torch.Tensor | None) -> Any:
        """This process's float32 gradients as they are (``loss_scale``: the scale, for a narrow wire)."""
        del loss_scale
        return grads

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks: ``x``."""
        return x

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """The mean of ``x`` over the ranks: ``x``."""
        return x

    def stats(self, grads: Any, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(finite, flags, grad_norm)``: every gradient and the loss finite (0-d bool), one flag per floating
        leaf (1-d bool, tree order), the global L2 norm (:func:`funcamp.global_norm`)."""
        flags = _tree.finite_flags(grads)
        return self._agree(flags.all() & torch.isfinite(loss)), flags, _tree.global_norm(grads)

    def _agree(self, finite: torch.Tensor) -> torch.Tensor:
        return finite

    def reduce_buffers(self, buffers: Any) -> Any:
        """The model's new buffers as they are."""
        return buffers

    def finish_params(self, params: Any) -> Any:
        """The new parameters as the optimizer made them."""
        return params

    def distinct(self, grads: Any) -> Any:
        """``grads`` as tensors that share no storage (``torch.cond`` refuses aliased operands)."""
        return grads


class DataParallel(SingleProcess):
    """Every rank holds the whole state; the gradients are averaged over ``group``.

    Gradients travel in ``reduce_dtype`` (None: each gradient's own dtype), with the loss scale on a narrower
    wire (:func:`funcamp.parallel.mean_gradients`); one finite verdict is agreed for all ranks; losses are
    averaged; floating buffers are reduced by :func:`funcamp.parallel.reduce_buffers`.

    Args:
      group: a ``torch.distributed`` process group.
      reduce_dtype: the wire dtype, or None.
    """

    def __init__(self, group: Any, reduce_dtype: torch.dtype | None = None) -> None:
        self.group, self.reduce_dtype = group, reduce_dtype
        self.size = group.size()

    def __repr__(self) -> str:
        return f"DataParallel(group of {self.size}, reduce_dtype={self.reduce_dtype})"

    def check_state(self, state: Any) -> None:
        """Also refuse parameters that differ between ranks (one ``all_gather_object`` of float64 checksums)."""
        super().check_state(state)
        sharding.check_same_params(state.params, self.group, "train_step")

    def reduce_gradients(self, grads: Any, loss_scale: torch.Tensor | None) -> Any:
        """The mean over the ranks (float32 in, float32 out); on a narrower wire the gradients travel scaled
        and are unscaled after the sum, as DDP + GradScaler: an overflow there makes them non-finite on every
        rank (skip, back off)."""
        return parallel.mean_gradients(grads, self.group, self.reduce_dtype, loss_scale=loss_scale)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of the floating tensor ``x`` over the ranks (one ``all_reduce``)."""
        return parallel.sum_over_ranks(x, self.group)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """The mean of the floating tensor ``x`` over the ranks (one ``all_reduce``)."""
        return parallel.mean_over_ranks(x, self.group)

    def _agree(self, finite: torch.Tensor) -> torch.Tensor:
        return parallel.all_ranks_true(finite, self.group)

    def reduce_buffers(self, buffers: Any) -> Any:
        """Running statistics averaged, fp8 amax histories max-reduced and scales min-reduced, so that ranks
        stay identical (:func:`funcamp.parallel.reduce_buffers`)."""
        return parallel.reduce_buffers(buffers, self.group) if _tree.tree_leaves(buffers) else buffers

    def distinct(self, grads: Any) -> Any:
        """Averaged over ranks, the gradients are views of one reduced buffer: copies."""
        return _tree.tree_map(torch.clone, grads)


class Sharded(DataParallel):
    """ZeRO-3 / FSDP2-style: the state holds this rank's rows of every parameter (``shard``'s layout).

    Compiled, the step differentiates the shards: each parameter is all-gathered (in ``shard.gather_dtype``)
    where the loss uses it (:meth:`param_at_use`) and its gradient reduce-scattered once, in its backward, in
    ``reduce_dtype`` (loss scale on a narrower wire; :mod:`funcamp._at_use`). Eager, it differentiates the
    parameters all-gathered once and reduce-scatters the mean gradient after all micro-batches
    (:mod:`funcamp.sharding` says where the two differ). Both take the finite verdict and the norm over all
    shards (one float64 ``all_reduce``, padding excluded) and keep padding rows exactly zero.

    Args:
      shard: a :class:`funcamp.sharding.ShardLayout` (``funcamp.sharding.shard_layout(params, group)``).
      group: the process group the layout was made for, or None for a one-rank layout.
      reduce_dtype: the wire dtype, or None.
      policy: the step's policy, compared between ranks with the layout (one ``all_gather_object``).
    Raises:
      TypeError: if ``shard`` is not a ShardLayout.
      ValueError: if ``group`` is None and the layout is over more than one rank; if the layout's world size
        or rank is not the group's, or ranks differ in layout or policy.
    """

    def __init__(
        self, shard: Any, group: Any, reduce_dtype: torch.dtype | None = None, policy: Policy | None = None
    ) -> None:
        if not isinstance(shard, sharding.ShardLayout):
            raise TypeError(
                f"make_train_step: shard must be None or a funcamp.sharding.ShardLayout "
                f"(funcamp.sharding.shard_layout(params, group)), got {type(shard).__name__}"
            )
        if group is None and shard.world_size != 1:
            raise ValueError(
                f"make_train_step: shard= is a layout over {shard.world_size} ranks; pass data_parallel=True (or "
                "the group it was made for)"
            )
        self.shard, self.group, self.reduce_dtype = shard, group, reduce_dtype
        self.size = 1 if group is None else group.size()
        self._policy = policy

    def __repr__(self) -> str:
        return f"Sharded({self.shard.world_size} ranks, reduce_dtype={self.reduce_dtype})"

    def check_optimizer(self, optimizer: Any) -> None:
        """Build time: refuse per-shard norms and a ``stochastic_rounding`` without this layout, and check that
        every rank has the same layout, policy and rounding layout."""
        sharding.check_optimizer(optimizer, self.group, sharded=True, layout=self.shard)
        if self.group is not None:
            sharding.check_consistent(self.shard, self.group, optimizer=optimizer, policy=self._policy)

    def check_state(self, state: Any) -> None:
        """Nothing more: ``TrainState.create(shard=)`` checked the whole parameters where it had them."""
        del state

    def gather(self, params: Any) -> Any:
        """The parameters to differentiate: compiling, the shards themselves (gathered inside the differentiated
        function, :meth:`around_loss`); eager, the whole parameters, all-gathered once (not differentiated)."""
        if torch.compiler.is_compiling():
            return params
        return sharding.all_gather_params(params, self.shard, self.group)

    def around_loss(self, fun: Callable[..., Any], loss_scale: torch.Tensor | None) -> Callable[..., Any]:
        """Compiling: ``fun`` differentiated with respect to the shards, which it sees as whole parameters.

        Each shard gets a reduce point and an up-front gather (:class:`funcamp._at_use.Uses`) that the loss
        is handed; :meth:`param_at_use` (``funcamp.nn.functionalize``'s hook) gathers a parameter again where
        its module uses it, so the up-front gather is dead code in the compiled graph wherever every use goes
        through it, and :class:`funcamp._regions.RematPass` drops it. Each gradient is reduce-scattered once,
        in its backward. A :class:`funcamp.LossSum`'s micro-batch mean is differentiated times its count
        (each rank's own weight must be applied before the reduction). Eager: as the other layouts.
        """
        if not torch.compiler.is_compiling():
            return super().around_loss(fun, loss_scale)

        def inner(shards: Any, *rest: Any) -> Any:
            leaves = _tree.tree_leaves(shards)
            uses = _at_use.Uses(leaves, self._specs(leaves), loss_scale)
            whole = _tree.tree_unflatten(_tree.tree_structure(shards), uses.whole)
            value, (new_buffers, aux, record) = _at_use.within(uses, _scope.within, self, fun, whole, *rest)
            if record:  # the gradient of count * mean: weighted on this rank, before the reduction
                value = value * record[1].to(value.dtype)
            return value, (new_buffers, aux, record)

        return inner

    def param_at_use(self, name: str, stored: Any) -> Any:
        """The whole parameter ``stored`` (a tensor the loss was handed) gathered again for this use, in the
        compiled step; ``stored`` itself elsewhere (eager, or a tensor that is not one of the parameters).
        ``name`` (the module's name for it) is not needed: the tensor is recognised by identity."""
        del name
        uses = _at_use.current()
        return stored if uses is None else uses.at_use(stored)

    def weigh(self, grads: Any, count: torch.Tensor) -> Any:
        """Compiling: ``grads`` as they are (weighted in :meth:`around_loss`); eager: as the other layouts."""
        return grads if torch.compiler.is_compiling() else super().weigh(grads, count)

    def reduce_gradients(self, grads: Any, loss_scale: torch.Tensor | None) -> Any:
        """This rank's rows of the mean over ranks, by the same rule as ``mean_gradients`` (compiling: already
        reduce-scattered in the backward, :mod:`funcamp._at_use`; eager: one ``reduce_scatter`` per dtype)."""
        if torch.compiler.is_compiling():
            return grads
        return sharding.reduce_scatter_gradients(
            grads, self.shard, self.group, self.reduce_dtype, loss_scale=loss_scale
        )

    def _specs(self, shards: list[torch.Tensor]) -> list[_at_use.Spec]:
        lay, group = self.shard, sharding._resolve(self.group) if self.shard.world_size > 1 else None
        wire = self.reduce_dtype
        return [
            _at_use.Spec(lay.shapes[i], lay.rows(i), lay.world_size, lay.gather_dtype or x.dtype, wire, group)
            for i, x in enumerate(shards)
        ]

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (``x`` itself for a one-rank layout)."""
        return x if self.group is None else super().sum(x)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """The mean of ``x`` over the ranks (``x`` itself for a one-rank layout)."""
        return x if self.group is None else super().mean(x)

    def stats(self, grads: Any, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Over all shards (padding rows excluded) and every rank's loss: one float64 ``all_reduce``."""
        return sharding.global_stats(grads, self.shard, self.group, loss)

    def reduce_buffers(self, buffers: Any) -> Any:
        """As :class:`DataParallel` (``buffers`` as they are for a one-rank layout)."""
        return buffers if self.group is None else super().reduce_buffers(buffers)

    def finish_params(self, params: Any) -> Any:
        """Padding stays exactly zero, whatever the optimizer does there."""
        return sharding.zero_padding(params, self.shard)


def layout_from(data_parallel: Any = None, shard: Any = None, policy: Policy | str | None = None) -> SingleProcess:
    """The layout ``make_train_step``'s ``data_parallel``, ``shard`` and ``policy`` arguments describe.

    Raises:
      TypeError: if ``data_parallel`` is not None, a bool or a ProcessGroup, or ``shard`` not a ShardLayout.
      RuntimeError: if ``data_parallel`` asks for a group and torch.distributed is not initialized.
      ValueError: as :class:`Sharded`.
    """
    policy = None if policy is None else get_policy(policy)
    reduce_dtype = None if policy is None else policy.reduce_dtype
    group = parallel.resolve_group(data_parallel)  # None: one process
    if shard is not None:
        return Sharded(shard, group, reduce_dtype, policy)
    if group is not None:
        return DataParallel(group, reduce_dtype)
    return SingleProcess()
