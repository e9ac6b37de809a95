"""Process layouts: one interface for what a train step does across processes.

A layout answers the questions a step asks of its processes, and nothing else: which parameters to
differentiate (all-gathered shards, or the parameters as they are), how to reduce the gradients (not at
all, averaged, reduce-scattered), how to agree on one finite verdict and one gradient norm, how to add up
or average a number, and what to do to the new parameters (zero the padding of shards). The stages run the
loss and the optimizer within the layout (:mod:`funcamp._scope`), so that ``optim.clip_by_global_norm``
asks it for the global norm (:meth:`SingleProcess.scaled_global_norm`) and ``optim.stochastic_rounding``
for each shard's place in its whole tensor (:meth:`SingleProcess.element_offsets`): one optimizer is right
in every layout. A sharded state carries its layout (``TrainState.shard``); :func:`layout_from` builds the
step's layout from it. The stages of
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
import types
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from funcamp import _at_use, _scope, _tree, parallel, sharding
from funcamp.policy import Policy, get_policy

__all__ = ["BuildLayout", "DataParallel", "Sharded", "SingleProcess", "StageLayout", "layout_from", "of_fields"]


@runtime_checkable
class StageLayout(Protocol):
    """What the stages (:mod:`funcamp.train._stages`) and probes ask of a process layout, inside the step: where
    the parameters come from, how gradients, sums, buffers and the verdict are reduced over the ranks.

    ``whole_gradients`` is a capability: whether the gradients the stages see are whole tensors (False where
    each rank holds its shards' only), asked by what reads whole gradients (the telemetry probe) instead of
    asking which class the layout is."""

    size: int
    whole_gradients: bool

    def gather(self, params: Any) -> Any: ...
    def around_loss(self, fun: Callable[..., Any], loss_scale: torch.Tensor | None) -> Callable[..., Any]: ...
    def weigh(self, grads: Any, count: torch.Tensor) -> Any: ...
    def reduce_gradients(self, grads: Any, loss_scale: torch.Tensor | None) -> Any: ...
    def sum(self, x: torch.Tensor) -> torch.Tensor: ...
    def mean(self, x: torch.Tensor) -> torch.Tensor: ...
    def stats(self, grads: Any, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
    def reduce_buffers(self, buffers: Any, reductions: Any = None) -> Any: ...
    def finish_params(self, params: Any) -> Any: ...
    def distinct(self, grads: Any) -> Any: ...


@runtime_checkable
class BuildLayout(Protocol):
    """What ``make_train_step`` asks of a layout on the host, before anything is traced."""

    def check_ranks(self) -> None: ...
    def check_state(self, state: Any) -> None: ...


class SingleProcess:
    """One process: the gradients, losses, norms and buffers stay as they are.

    The layout interface, split by caller into runtime-checkable Protocols, the checked contract:
    :class:`StageLayout` (the stages and probes, inside the step), :class:`BuildLayout` (``make_train_step``, on
    the host) and :class:`funcamp._scope.StepLayout` (the optimizer's transforms, through
    :func:`funcamp._scope.current`, which checks it); :class:`Sharded` adds :class:`funcamp._scope.GathersAtUse`
    (``funcamp.nn``'s parameter uses ask ``isinstance(layout, GathersAtUse)``). This class has the first three.

    Example:
      >>> import torch
      >>> layout = SingleProcess()
      >>> layout.stats({"w": torch.tensor([3.0, 4.0])}, torch.tensor(1.0))
      (tensor(True), tensor([True]), tensor(5.))
    """

    group: Any = None
    size: int = 1
    whole_gradients: bool = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def check_ranks(self) -> None:
        """Host side: check that every rank runs this layout (nothing to check for one process)."""

    def check_state(self, state: Any) -> None:
        """A step's first call, host side: nothing to check for one process."""
        del state

    def gather(self, params: Any) -> Any:
        """The parameters to differentiate: ``params`` themselves."""
        return params

    def around_loss(self, fun: Callable[..., Any], loss_scale: torch.Tensor | None) -> Callable[..., Any]:
        """The function :func:`funcamp.train.gradients` differentiates, ``fun(params, *rest)`` given what
        :meth:`gather` returned (``loss_scale``: the 0-d float32 scale the loss is multiplied by, or None):
        ``fun`` itself."""
        del loss_scale
        return fun

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
        norm = _tree.norm_of_scaled(*self.scaled_global_norm(grads))
        return self.agree(flags.all() & torch.isfinite(loss)), flags, norm

    def agree(self, finite: torch.Tensor) -> torch.Tensor:
        """``finite`` as every process agrees on it (one process: as it is)."""
        return finite

    def scaled_global_norm(self, tree: Any, fn: str = "global_norm") -> tuple[torch.Tensor, torch.Tensor]:
        """``(t, s)``, the global L2 norm of ``tree`` being ``t / s``: :func:`funcamp._tree.scaled_global_norm`
        of this process's tensors (float32, float64 if a leaf is; ``s`` a power of two).

        ``funcamp.optim.clip_by_global_norm`` asks the layout of the step it runs in (``funcamp._scope``). The
        finite check's norm and a clip's of the same gradients are the same expression over the same tensors:
        the compiled step computes it once (the ``cse`` graph pass, :mod:`funcamp.passes.cse`; AOTAutograd merges
        common subexpressions only in training graphs, and the step is an inference graph).
        """
        return _tree.scaled_global_norm(tree, fn)

    def global_norm(self, tree: Any) -> torch.Tensor:
        """The global L2 norm of ``tree`` (:func:`funcamp.global_norm`: this process's tensors are the whole)."""
        return _tree.global_norm(tree)

    def element_offsets(self) -> dict[str, int] | None:
        """Where each parameter's first element lies in its whole tensor: None, the tensors are whole
        (``funcamp.optim.stochastic_rounding`` hashes each element's index from there)."""
        return None

    def reduce_buffers(self, buffers: Any, reductions: Any = None) -> Any:
        """The model's new buffers as they are (``reductions``: see :class:`DataParallel`)."""
        del reductions
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
        """Refuse parameters that differ between ranks (one ``all_gather_object`` of float64 checksums); warn
        when a buffer's reduction comes from the deprecated name table, not the state."""
        sharding.check_same_params(state.params, self.group, "train_step")
        if state.buffers is not None:
            parallel.warn_undeclared_reductions(state.buffers, state.buffer_reductions, "train_step")

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

    def agree(self, finite: torch.Tensor) -> torch.Tensor:
        """``finite`` and every other rank's (one ``all_reduce``)."""
        return parallel.all_ranks_true(finite, self.group)

    def reduce_buffers(self, buffers: Any, reductions: Any = None) -> Any:
        """Running statistics averaged, fp8 amax histories max-reduced and scales min-reduced, so that ranks
        stay identical (:func:`funcamp.parallel.reduce_buffers`; ``reductions``, the state's
        ``buffer_reductions``, maps a buffer's dotted name to ``"max"`` or ``"min"``)."""
        if not _tree.tree_leaves(buffers):
            return buffers
        return parallel.reduce_buffers(buffers, self.group, reductions=reductions)

    def distinct(self, grads: Any) -> Any:
        """Averaged over ranks, the gradients are views of one reduced buffer: copies."""
        return _tree.tree_map(torch.clone, grads)


def _per_use() -> bool:
    """Whether a sharded step gathers each shard where it is used and reduce-scatters its gradient in the
    backward (a compiled step, :func:`funcamp._scope.compiling`: the graph schedules the gathers, and funcamp's
    pass drops the dead up-front ones), rather than one gather up front and one reduce-scatter per dtype (eager:
    autograd keeps each gathered weight to the backward anyway, so gathering at each use would save nothing)."""
    return _scope.compiling()


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

    whole_gradients = False  # each rank's gradients are its shards'

    def __repr__(self) -> str:
        return f"Sharded({self.shard.world_size} ranks, reduce_dtype={self.reduce_dtype})"

    def check_ranks(self) -> None:
        """Host side, one ``all_gather_object``: every rank has this layout (for its own rank) and the same
        policy (:func:`funcamp.sharding.check_consistent`)."""
        if self.group is not None:
            sharding.check_consistent(self.shard, self.group, policy=self._policy)

    def check_state(self, state: Any) -> None:
        """``TrainState.create(shard=)`` checked the whole parameters where it had them; the buffers'
        reductions as :class:`DataParallel`."""
        if self.group is not None and state.buffers is not None:
            parallel.warn_undeclared_reductions(state.buffers, state.buffer_reductions, "train_step")

    def gather(self, params: Any) -> Any:
        """The parameters to differentiate: compiling, the shards themselves (gathered inside the differentiated
        function, :meth:`around_loss`); eager, the whole parameters, all-gathered once (not differentiated)."""
        if _per_use():
            return params
        return sharding.all_gather_params(params, self.shard, self.group)

    def around_loss(self, fun: Callable[..., Any], loss_scale: torch.Tensor | None) -> Callable[..., Any]:
        """Compiling: ``fun`` differentiated with respect to the shards, which it sees as whole parameters.

        Each shard gets a reduce point and an up-front gather (:class:`funcamp._at_use.Uses`) that the loss
        is handed; :meth:`param_at_use` (``funcamp.nn.functionalize``'s hook) gathers a parameter again where
        its module uses it, so the up-front gather is dead code in the compiled graph wherever every use goes
        through it, and :class:`funcamp.passes.RematPass` drops it. Each gradient is reduce-scattered once,
        in its backward. A :class:`funcamp.LossSum`'s micro-batch mean is differentiated times its count
        (each rank's own weight must be applied before the reduction). Eager: as the other layouts.
        """
        if not _per_use():
            return super().around_loss(fun, loss_scale)

        def inner(shards: Any, *rest: Any) -> Any:
            leaves = _tree.tree_leaves(shards)
            uses = _at_use.Uses(leaves, self._specs(leaves), loss_scale)
            whole = _tree.tree_unflatten(_tree.tree_structure(shards), uses.whole)
            value, (new_buffers, aux, record) = _at_use.within(uses, fun, whole, *rest)
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
        return grads if _per_use() else super().weigh(grads, count)

    def reduce_gradients(self, grads: Any, loss_scale: torch.Tensor | None) -> Any:
        """This rank's rows of the mean over ranks, by the same rule as ``mean_gradients`` (compiling: already
        reduce-scattered in the backward, :mod:`funcamp._at_use`; eager: one ``reduce_scatter`` per dtype)."""
        if _per_use():
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

    def scaled_global_norm(self, tree: Any, fn: str = "global_norm") -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm, 1.0)``, both float64: the norm over every rank's shards (:meth:`global_norm`)."""
        del fn
        norm = self.global_norm(tree)
        return norm, torch.ones_like(norm)

    def global_norm(self, tree: Any) -> torch.Tensor:
        """The L2 norm of the whole tensors ``tree``'s shards are split from: every rank's float64 sum of
        squares (padding excluded), summed by one float64 ``all_reduce`` (:func:`funcamp.sharding.global_norm`);
        0-d float64, the same on every rank."""
        return sharding.global_norm(tree, self.shard, self.group)

    def element_offsets(self) -> dict[str, int]:
        """Each parameter's name -> the index in the whole tensor of this rank's first element
        (:meth:`funcamp.sharding.ShardLayout.element_offsets`)."""
        return self.shard.element_offsets()

    def reduce_buffers(self, buffers: Any, reductions: Any = None) -> Any:
        """As :class:`DataParallel` (``buffers`` as they are for a one-rank layout)."""
        return buffers if self.group is None else super().reduce_buffers(buffers, reductions)

    def finish_params(self, params: Any) -> Any:
        """Padding stays exactly zero, whatever the optimizer does there."""
        return sharding.zero_padding(params, self.shard)


def layout_from(
    data_parallel: Any = None,
    shard: Any = None,
    policy: Policy | str | None = None,
    *,
    carried: Any = None,
    state: Any = None,
) -> SingleProcess:
    """The layout that ``data_parallel``, ``shard`` and ``policy`` (``make_train_step``'s deprecated arguments)
    and what ``state`` carries (``TrainState.create``'s ``shard``, ``data_parallel`` and ``policy``) describe;
    ``carried``: a shard layout carried some other way (None: take ``state.shard``).

    The layout is given once: a state made with ``TrainState.create(params, optimizer, shard=layout)``
    carries it (and ``layout.group``, the group ``shard_layout`` was given), so a step built without
    ``shard=`` and ``data_parallel=`` trains it sharded. Arguments given to the step as well must agree.

    Raises:
      TypeError: if ``data_parallel`` is not None, a bool or a ProcessGroup, or ``shard`` not a ShardLayout.
      RuntimeError: if ``data_parallel`` asks for a group and torch.distributed is not initialized.
      ValueError: if ``shard`` and ``carried`` are both given and differ, or ``data_parallel``'s group is
        not the ranks of ``carried.group`` or of the state's group, or ``policy`` is not the state's; as
        :class:`Sharded`.
    """
    policy = None if policy is None else get_policy(policy)
    group = parallel.resolve_group(data_parallel)  # None: one process
    if state is not None:
        carried = state.shard if carried is None else carried
        held = None if state.data_parallel is None else state.data_parallel.group
        if held is not None and data_parallel is not None and (group is None or not _same_ranks(group, held)):
            raise ValueError(
                "train_step: data_parallel= is another group than the state's (TrainState.create(data_parallel=)); "
                "build the step without data_parallel= (it takes the state's)"
            )
        if state.policy is not None and policy is not None and policy != state.policy:
            raise ValueError(
                f"train_step: policy={policy} differs from the state's ({state.policy}, TrainState.create(policy=)); "
                "build the step without policy= (it takes the state's)"
            )
        group = held if group is None else group
        policy = state.policy if policy is None else policy
    reduce_dtype = None if policy is None else policy.reduce_dtype
    if carried is not None:
        if shard is not None and isinstance(shard, sharding.ShardLayout) and shard != carried:
            raise ValueError(
                f"train_step: the step was built with shard={shard!r}, but the state carries another layout, "
                f"{carried!r} (TrainState.create(..., shard=) or funcamp.checkpoint.load_sharded); build the step "
                "without shard= (it takes the state's layout), or with the state's"
            )
        if group is not None and carried.group is not None and not _same_ranks(group, carried.group):
            raise ValueError(
                "train_step: data_parallel= is another group than the one the state's shard layout was made for "
                "(shard_layout(params, group)); build the step without data_parallel= (it takes the layout's group)"
            )
        shard = carried if shard is None else shard
        group = carried.group if group is None else group
    if shard is not None:
        return Sharded(shard, group, reduce_dtype, policy)
    if group is not None:
        return DataParallel(group, reduce_dtype)
    return SingleProcess()


def _same_ranks(a: Any, b: Any) -> bool:
    import torch.distributed as dist

    return a is b or dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


def of_fields(shard: Any, data_parallel: Any, policy: Policy | None) -> SingleProcess:
    """The layout a state's static fields describe (``TrainState.shard``, ``data_parallel``, ``policy``): one object
    per distinct set of fields in a process, so that every state of a run carries the same one (host side).

    Raises:
      As :func:`layout_from`.
    """
    return _of_fields(shard, None if shard is None else id(shard.group), data_parallel, policy)


@functools.lru_cache(maxsize=64)
def _of_fields(shard: Any, group_id: Any, data_parallel: Any, policy: Policy | None) -> SingleProcess:
    del group_id  # in the key only: a ShardLayout compares equal whatever its group
    fields = types.SimpleNamespace(shard=shard, data_parallel=data_parallel, policy=policy)
    return layout_from(state=fields)
