"""The train state: everything a run carries from step to step, an immutable pytree of tensors."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from funcamp import _scope, _tree, parallel, sharding
from funcamp.loss_scale import LossScale, NoOpLossScale
from funcamp.optim import GradientTransformation
from funcamp.policy import Policy, get_policy
from funcamp.train import _layout, _storage

__all__ = ["TrainState"]


def _zero_int(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int32, device=device)


#: Field metadata of the state's static facts (the layout, the buffers' reductions): part of the pytree
#: structure, not leaves, and not written by ``funcamp.checkpoint`` (a loaded state takes them from ``like``).
STATIC = {"funcamp.static": True}


def _buffer_reductions(reductions: Any, buffers: Any) -> tuple[tuple[str, str], ...]:
    """``reductions`` (a mapping of buffer names to ``"max"``/``"min"``) as sorted pairs, checked."""
    if reductions is None:
        return ()
    if not isinstance(reductions, Mapping):
        raise TypeError(
            f"TrainState.create: buffer_reductions must be None or a mapping of buffer names to 'max' or 'min' "
            f"(apply_fn.buffer_reductions from funcamp.nn.functionalize), got {type(reductions).__name__}"
        )
    names = set(_tree.tree_paths(buffers)) if buffers is not None else set()
    for name, how in reductions.items():
        if how not in ("max", "min"):
            raise ValueError(f"TrainState.create: buffer_reductions[{name!r}] must be 'max' or 'min', got {how!r}")
        if name not in names:
            raise ValueError(
                f"TrainState.create: buffer_reductions names {name!r}, which is not one of the buffers "
                f"({sorted(names)[:8]}{' ...' if len(names) > 8 else ''}); pass the buffers functionalize returned "
                "with its apply_fn.buffer_reductions"
            )
    return tuple(sorted(reductions.items()))


def _stacked_runs(scan: Any, params: Any) -> tuple[str, ...]:
    """``create``'s ``scan`` as a tuple of run names, each checked to name at least two layers of ``params``."""
    runs = (scan,) if isinstance(scan, str) else scan
    if not isinstance(runs, (tuple, list)) or not all(isinstance(r, str) for r in runs):
        raise TypeError(
            f"TrainState.create: scan must be a str or a sequence of str (apply_fn.scan), got {type(scan).__name__}"
        )
    runs = tuple(dict.fromkeys(runs))  # each run once
    from funcamp.train._flat import _in_run  # a layer of a run as the flat layout reads it

    names = [".".join(str(k) for k in path) for path in _tree.tree_flatten_with_path(params)[0]]
    for run in runs:
        if len({found[0] for found in map(_in_run, names, [run] * len(names)) if found is not None}) < 2:
            raise ValueError(
                f"TrainState.create: scan={run!r} names no two layers of params (parameters named {run}.<i>.*); "
                "pass apply_fn.scan of the functionalize call that made params"
            )
    return tuple(runs)


def _owned(x: Any) -> Any:
    """A new tensor of ``x``'s values (not ``x``), else ``x``: what a state holds of an object the user keeps."""
    return x.clone() if isinstance(x, torch.Tensor) else x


def _detached(x: Any) -> Any:
    """``x.detach()`` for a parameter or a tensor that requires grad (the same memory, no history), else ``x``."""
    if isinstance(x, torch.Tensor) and (x.requires_grad or isinstance(x, torch.nn.Parameter)):
        return x.detach()
    return x


class _Group:
    """The data-parallel process group a state carries: itself under ``copy.deepcopy``, and pickled without the
    group (a handle of this process, not picklable), as :class:`funcamp.sharding.ShardLayout` keeps its own."""

    __slots__ = ("group",)

    def __init__(self, group: Any) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict[int, Any]) -> _Group:
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _Group, (None,)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Group) and other.group is self.group

    def __hash__(self) -> int:
        return id(self.group)

    def __repr__(self) -> str:
        return "_Group(None)" if self.group is None else f"_Group(size {self.group.size()})"


@_tree.dataclass
class TrainState:
    """Everything a training run carries from step to step; immutable, a pytree of tensors.

    Build it with :meth:`create`; :meth:`replace` returns a modified copy.

    Attributes:
      step: 0-d int32, the number of train-step calls so far (applied and skipped).
      params: the master parameters (a dict of tensors, usually float32).
      opt_state: the optimizer state (NamedTuples of tensors).
      loss_scale: the current :class:`funcamp.LossScale`.
      buffers: model buffers that change in training (BatchNorm statistics), or None.
      skipped_steps: 0-d int32, steps skipped for non-finite gradients since the start.
      consecutive_skips: 0-d int32, skipped steps since the last applied one.
      shard: static, the :class:`funcamp.sharding.ShardLayout` ``params`` are shards of (and, in
        ``shard.group``, the process group), or None for whole tensors. A train step takes its layout from
        here: the layout is given once, to :meth:`create`.
      buffer_reductions: static, ``(name, "max" | "min")`` pairs: how a data-parallel step reduces those
        buffers over the ranks (the others are averaged); declared by the modules that own them
        (``funcamp.fp8``'s delayed-scaling state) and read by ``funcamp.nn.functionalize``
        (``apply_fn.buffer_reductions``).
      data_parallel: static, the process group a data-parallel step averages over (held in a small
        wrapper: ``state.data_parallel.group``), or None.
      policy: static, the :class:`funcamp.Policy` whose ``reduce_dtype`` the step reduces gradients in,
        or None (each gradient's own dtype).
      storage: static, how this process holds ``params`` and ``opt_state`` (:class:`funcamp.train.ParamStorage`):
        flat buffers (``storage.kind == "flat"``: every tensor of ``params`` and of the optimizer state shaped
        like them is a view of one buffer per group) or leaf by leaf (``"per leaf"``, with ``storage.reason``).
        Chosen by :meth:`create`.
      layout: static, the process layout a step runs this state under (:class:`funcamp.train.SingleProcess`,
        ``DataParallel``, ``Sharded``), made from ``shard``, ``data_parallel`` and ``policy`` when the state is.

    The static fields are part of the pytree structure, not leaves (as a flax ``TrainState``'s
    ``struct.field(pytree_node=False)``), and ``funcamp.checkpoint`` does not write them: a loaded state
    takes them from ``like``, so checkpoints saved before they existed load unchanged.
    """

    step: torch.Tensor
    params: Any
    opt_state: Any
    loss_scale: LossScale
    buffers: Any = None
    skipped_steps: torch.Tensor | None = None
    consecutive_skips: torch.Tensor | None = None
    shard: sharding.ShardLayout | None = _tree.field(default=None, pytree_node=False, metadata=STATIC)
    buffer_reductions: tuple[tuple[str, str], ...] = _tree.field(default=(), pytree_node=False, metadata=STATIC)
    data_parallel: _Group | None = _tree.field(default=None, pytree_node=False, metadata=STATIC)
    policy: Policy | None = _tree.field(default=None, pytree_node=False, metadata=STATIC)
    storage: _storage.ParamStorage = _tree.field(default=_storage.PerLeaf(), pytree_node=False, metadata=STATIC)
    layout: _layout.SingleProcess | None = _tree.field(default=None, pytree_node=False, metadata=STATIC)

    def __post_init__(self) -> None:
        if self.layout is None:  # a state built by hand or loaded without ``like``: the layout its fields describe
            object.__setattr__(self, "layout", _layout.of_fields(self.shard, self.data_parallel, self.policy))
        on_host = _scope.step_plan() is None and not _scope.compiling()  # not in a step body, not traced
        if on_host and self.params is not None:  # a flat state holds its views
            try:
                adopted = self.storage.adopt(self.params, self.opt_state)
            except TypeError as e:  # trees of another structure, shape or dtype than its buffers: kept leaf by leaf
                object.__setattr__(
                    self, "storage", _storage.PerLeaf(f"replaced with trees the flat layout cannot hold: {e}")
                )
                return
            if adopted is not None:  # tensors given in other memory (loaded, replaced): copied into new buffers
                object.__setattr__(self, "params", adopted[0])
                object.__setattr__(self, "opt_state", adopted[1])

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the process layout (it may hold a process group; unpickling makes it again), a flat
        state as its buffers (each once: pickling a view writes its whole storage)."""
        fields = {**self.__dict__, "layout": None}
        if self.params is not None:
            fields["params"], fields["opt_state"] = self.storage.compact(self.params, self.opt_state)
        return fields

    def __setstate__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)
        try:
            layout = _layout.of_fields(self.shard, self.data_parallel, self.policy)
        except ValueError:  # a sharded state unpickled without its process group: stepping it says so
            layout = None
        object.__setattr__(self, "layout", layout)
        if self.params is not None:
            params, opt_state = self.storage.expand(self.params, self.opt_state)
            object.__setattr__(self, "params", params)
            object.__setattr__(self, "opt_state", opt_state)

    def param_tree(self) -> Any:
        """The parameter tree the loss sees: ``params`` itself, or, for a flat state inside a compiled step (where
        ``params`` holds the buffers, :class:`funcamp.train.ParamStorage`), per-leaf views of its buffers. A step
        body (:func:`funcamp.train.assemble`) that calls a model itself reads its parameters here."""
        return self.storage.tree(self.params)

    @property
    def plan(self) -> str:
        """The static decisions this state carries, in one line: its process layout and its storage."""
        return f"{self.layout!r}; storage {self.storage.describe()}"

    @classmethod
    def create(
        cls,
        params: Any,
        optimizer: GradientTransformation,
        *,
        loss_scale: LossScale | None = None,
        buffers: Any = None,
        shard: sharding.ShardLayout | None = None,
        buffer_reductions: Mapping[str, str] | None = None,
        data_parallel: Any = None,
        policy: Policy | str | None = None,
        scan: str | Sequence[str] = (),
    ) -> TrainState:
        """A fresh state: ``optimizer.init(params)``, counters at 0, the loss scale on the params' device.

        The storage is chosen here, once (:mod:`funcamp.train._storage`): where every transformation of
        ``optimizer`` is elementwise (funcamp's own are) and the parameters are plain dense floating tensors,
        the state lays out one flat buffer per (device, dtype, optimizer group), copies ``params`` into it and
        holds views of it, with your names and shapes (``state.storage.kind == "flat"``); the tensors you pass
        are then not the state's, and no step writes into them. Otherwise (or with ``FUNCAMP_FLAT=off`` in the
        environment) the state holds the tensors you pass, leaf by leaf, and ``state.storage.reason`` says why.

        The state carries no autograd history: an ``nn.Parameter`` or a tensor that requires grad, in ``params`` or
        ``buffers`` (``dict(model.named_parameters())``), is taken as ``tensor.detach()`` (the same memory).

        With ``shard`` (a :class:`funcamp.sharding.ShardLayout`, from
        ``funcamp.sharding.shard_layout(params, group)``), ``params`` are the whole parameters, the same
        on every rank (:func:`funcamp.parallel.broadcast_params`), and the state holds this rank's
        shards of them (rows ``[r*c, (r+1)*c)`` along dim 0, zero-padded) and the optimizer state
        built from those shards: about ``1 / N`` of the unsharded state. The state carries the layout
        (:attr:`shard`, with its group): ``make_train_step(loss_fn, optimizer)`` trains it sharded, and
        ``funcamp.optim.clip_by_global_norm`` and ``optim.stochastic_rounding`` in its optimizer see all
        shards, with nothing given again.

        Args:
          params: the master parameters, a pytree (usually a dict) of floating tensors.
          optimizer: a :class:`funcamp.optim.GradientTransformation`.
          loss_scale: default :class:`funcamp.NoOpLossScale`. The state holds copies of its tensors: a donating
            step writes the next scale into them, never into the object you pass (two states made from one
            object share nothing).
          buffers: model buffers (``funcamp.nn.functionalize`` returns them), or None.
          shard: None (every rank holds everything), or the layout to shard the parameters with.
          buffer_reductions: None, or a mapping of buffer names to ``"max"`` or ``"min"``: how a
            data-parallel step reduces them over the ranks (``apply_fn.buffer_reductions`` of
            ``funcamp.nn.functionalize``: fp8 amax histories ``"max"``, scales ``"min"``); other floating
            buffers are averaged.
          data_parallel: None or False (one process), True (the default process group) or a process
            group: ``make_train_step(loss_fn, optimizer)`` averages the gradients over its ranks and agrees
            one ``grads_finite`` (:mod:`funcamp.parallel`). A sharded state takes ``shard.group``.
          policy: the policy (or string) whose ``reduce_dtype`` a data-parallel or sharded step reduces the
            gradients in; default: each gradient's own dtype.
          scan: the runs the step's model scans (``apply_fn.scan`` of ``funcamp.nn.functionalize(scan=...)``:
            qualified names of ``ModuleList`` / ``Sequential`` runs whose parameters are named
            ``<run>.<i>.<name>``). In flat storage each such run is laid out name-major: a parameter name's
            layers end to end in one buffer, so that the scan reads their stack as one view of it and writes
            their stacked gradient whole (the compiled step's largest kernels otherwise: one loop per layer and
            name). Names, shapes and values are the same; only the buffers differ (``state.storage`` says which
            runs are laid out so, and why a run whose layers the optimizer's masks tell apart is not). For a
            donating step (``make_train_step(donate=True)``, the main job's): GPT-2 124M's scanned body compiled
            its first step in about 0.6x the time and a step added 26% less memory, the steady step level. A pure
            step makes each name's new buffers whole every step (up to 113 MB each on GPT-2): 1.1-1.4x the steady
            step and 20% more memory; its plan line says so (docs/benchmarks.md). Default none: each layer in
            buffers of its own, which an unrolled run's kernels want.
        Raises:
          TypeError: if ``optimizer`` is not a GradientTransformation, ``loss_scale`` not a LossScale,
            ``params`` an ``nn.Module`` or an iterator (``model.parameters()``), or a parameter leaf is
            not a floating tensor, or ``shard`` is not None or a ShardLayout, or ``buffer_reductions`` not
            None or a mapping.
          ValueError: if the loss scale's value is out of its range (below ``min_loss_scale``, above
            ``max_loss_scale``, not finite), or ``params``' names or shapes differ from ``shard``'s; with a
            ``shard`` made by
            ``shard_layout(params, group)``: if this process is not the layout's rank of its world size
            in that group, or the parameters differ between the group's ranks (a float64 checksum per
            leaf, one ``all_gather_object``; the error names the first differing parameter); if
            ``buffer_reductions`` names a buffer that is not in ``buffers`` or a reduction other than
            ``"max"`` and ``"min"``; if ``policy`` does not parse.
          TypeError, RuntimeError: if ``data_parallel`` is not None, a bool or a ProcessGroup, or asks for a
            group while torch.distributed is not initialized.
          TypeError: if ``scan`` is not a str or a sequence of str.
          ValueError: if a ``scan`` run names no two layers of ``params`` (``<run>.<i>.*``).
        """
        if not isinstance(optimizer, GradientTransformation):
            raise TypeError(
                f"TrainState.create: optimizer must be a funcamp.optim.GradientTransformation, "
                f"got {type(optimizer).__name__}"
            )
        loss_scale = NoOpLossScale() if loss_scale is None else loss_scale
        if not isinstance(loss_scale, LossScale):
            raise TypeError(
                f"TrainState.create: loss_scale must be a funcamp loss scale (NoOpLossScale, StaticLossScale, "
                f"DynamicLossScale), got {type(loss_scale).__name__}; e.g. funcamp.DynamicLossScale(2.0**15)"
            )
        loss_scale.check_on_host()  # a scale on a device: its value read once, here
        if isinstance(params, torch.nn.Module):
            raise TypeError(
                "TrainState.create: params must be a pytree (dict) of tensors, got an nn.Module; "
                "use `apply_fn, params = funcamp.nn.functionalize(model, policy)` and pass those params"
            )
        if isinstance(params, (types.GeneratorType, Iterator)):
            raise TypeError(
                f"TrainState.create: params must be a pytree (dict) of tensors, got a {type(params).__name__} "
                "(model.parameters()?), which has no names and can be read only once; use "
                "`apply_fn, params = funcamp.nn.functionalize(model, policy)`, or "
                "`{name: p.detach() for name, p in model.named_parameters()}`"
            )
        bad = _tree.first_non_floating(params)
        if bad is not None:
            raise TypeError(
                f"TrainState.create: every parameter must be a floating tensor; {bad[0]!r} is {bad[1]}. "
                "Keep integer state in buffers."
            )
        params, buffers = _tree.tree_map(_detached, params), _tree.tree_map(_detached, buffers)
        reductions = _buffer_reductions(buffer_reductions, buffers)
        group = parallel.resolve_group(data_parallel)
        policy = None if policy is None else get_policy(policy)
        if shard is not None:
            if not isinstance(shard, sharding.ShardLayout):
                raise TypeError(
                    f"TrainState.create: shard must be None or a funcamp.sharding.ShardLayout "
                    f"(funcamp.sharding.shard_layout(params, group)), got {type(shard).__name__}"
                )
            if shard.group is not None:  # a layout from shard_layout(params, group): one all_gather_object
                sharding.check_same_params(params, shard.group, "TrainState.create", layout=shard)
            params = sharding.shard_params(params, shard)
        device = _tree.tree_device(params)
        stacked = _stacked_runs(scan, params)
        storage = _storage.choose(params, optimizer, sharded=shard is not None, stacked=stacked)
        params, opt_state = storage.lay_out(params, optimizer)
        state = cls(
            step=_zero_int(device),
            params=params,
            opt_state=opt_state,
            loss_scale=_tree.tree_map(_owned, loss_scale.to(device)),  # its own tensors: a donating step writes them
            buffers=buffers,
            skipped_steps=_zero_int(device),
            consecutive_skips=_zero_int(device),
            shard=shard,
            buffer_reductions=reductions,
            data_parallel=None if group is None else _Group(group),
            policy=policy,
            storage=storage,
        )
        state.layout.check_ranks()  # every rank runs this layout (sharded: one all_gather_object)
        state.layout.check_state(state)  # data parallel: the same parameters on every rank
        return state

    def replace(self, **changes: Any) -> TrainState:
        """A copy with the given fields replaced.

        A new ``shard``, ``data_parallel`` or ``policy`` makes the process layout again (``layout``).

        Raises:
          funcamp.train.DonatedStateError: if this state was given to a step built with ``donate=True``.
          ValueError: as :meth:`create`, if the new fields describe no layout (a shard layout over more ranks
            than its group).
        """
        from funcamp.train._donate import check_not_donated  # the package imports this module first

        check_not_donated(self, "TrainState.replace")
        if {"shard", "data_parallel", "policy"} & changes.keys() and "layout" not in changes:
            changes["layout"] = None  # made again from the new fields
        return dataclasses.replace(self, **changes)


TrainState.__module__ = "funcamp.train"  # the name checkpoints record (funcamp.train.TrainState), as before
