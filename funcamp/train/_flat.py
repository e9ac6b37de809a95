"""Flat storage: a state's parameters and optimizer state as one contiguous buffer per group, from birth.

Inductor lowers a tensor operation once per tensor, and on the CPU it has no grouped lowering for lists of
tensors, so an optimizer written leaf by leaf costs compile time in proportion to the number of parameter
tensors. A state with flat storage (:class:`Flat`, chosen by ``TrainState.create``) holds its parameters, and
every optimizer-state tree shaped like them (Adam's moments, a momentum trace, Kahan compensations), in one 1-D
buffer per *group*: the parameters of one device and dtype to which every mask and label of the optimizer gives
the same values (:mod:`funcamp.optim._flat`). ``TrainState.create`` lays the buffers out once (llm.c's
``malloc_and_point_parameters``) and hands out per-leaf views with the user's names and shapes:
``state.params["w"]`` is a view of its buffer, as is ``state.opt_state[...].mu["w"]``.

Inside the compiled step the loss reads each parameter as a view of its buffer (:meth:`Flat.tree`); the
gradients are concatenated once per group and the optimizer (clip, AdamW, masks, schedule), the select that
keeps a skipped step's state and the donation's writes run once per buffer (:meth:`Flat.update`). Elementwise
results are bitwise those of the leaf-by-leaf update; the finite check and a global norm read the gradient buffers
as rows of :data:`NORM_ROW` elements, on which every member starts (one 2-d reduction per buffer; each member's
finite flag exact, the norm within round-off of the per-leaf one: DESIGN's float64-oracle bound, held by
``tests/test_flat.py``). An eager step runs the optimizer leaf by leaf over the views.

Host boundary of the compiled step: :meth:`Flat.enter` hands it the buffers the state's views are of (one
attribute read per leaf, no copy); for a state whose tensors are not those views (leaves the user replaced, a
state loaded or built elsewhere) it copies them into new buffers, and a donating step then writes the results
back into the given tensors after the call. Nothing is ever re-pointed (``Tensor.set_``): a tensor the user, a
module or a closure holds keeps its memory. :meth:`Flat.leave` makes a pure step's result per-leaf views again.

Which optimizer-state leaves belong to which parameter is found as optax's ``tree_map_params`` does: ``init``
runs on placeholders (meta tensors, each parameter tagged, the tags following every tensor made from a tagged
one), once per leaf and once over the buffers; a state leaf made from parameter ``i`` (or from group ``g``'s
buffer) is that parameter's (that buffer's). Where the two states do not correspond leaf for leaf, the state is
kept leaf by leaf and says why.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from fractions import Fraction
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as torch_pytree
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from funcamp import _scope, _tree
from funcamp.optim import GradientTransformation
from funcamp.optim import _flat as _flat_opt
from funcamp.passes import tags
from funcamp.train import _flat_regions
from funcamp.train._layout import SingleProcess

__all__ = ["Flat", "FlatParams", "layout"]

#: Every leaf starts at a multiple of this many bytes of its buffer (a cache line; 16-byte vector loads on GPUs).
ALIGN_BYTES = 64
#: Every leaf also starts at a multiple of this many elements of its buffer, and every buffer's length is one: the
#: compiled step's finite check and global norm read a gradient buffer as rows of this length (one 2-d reduction
#: per buffer, :func:`funcamp._tree.scaled_row_sums`), a row never holds elements of two leaves, and a leaf's
#: finite flag is read from its rows. The cost: at most ``NORM_ROW - 1`` elements of padding per leaf (GPT-2 124M:
#: 148 leaves, 0.02% of its elements; 1,000 one-element parameters: 256,000 elements, 3 MB with AdamW's moments,
#: where rows pay least). Measured on GPT-2 124M's body (50 buffers of 148 leaves, a 2-core Xeon):
#: the check and norm compiled alone in 6.8 s beyond a compile's fixed cost where a reduction per leaf took 17.6 s.
NORM_ROW = 256
_ABSENT = object()  # the value of a mask a leaf was never given (it sits outside that mask's subtree)


class Group(NamedTuple):
    """One flat buffer: the parameters (leaf indices, in leaf order) it holds and where each starts."""

    key: str  # the buffer's key in the flat trees: "flat0000", "flat0001", ... (sorted as the groups)
    device: torch.device
    dtype: torch.dtype
    members: tuple[int, ...]  # parameter leaf indices
    offsets: tuple[int, ...]  # each member's first element in the buffer (aligned to ALIGN_BYTES)
    numel: int  # the buffer's length, padding included
    split: bool = False  # one of several buffers of the same device, dtype and mask values (BUFFER_BYTES)
    block: str = ""  # the block of a run of alike blocks whose parameters it holds (_segments), or ""


@_tree.dataclass
class FlatParams:
    """The parameters inside a compiled step of a flat state: ``buffers`` (``{group key: 1-D tensor}``).

    Held as the gradients (:meth:`Flat.gradients`), it also holds ``rows``, the buffers' row sums
    (:meth:`Flat.row_sums`: ``(sums, s)``, or None where rows do not apply), which the finite check's norm and flags
    and a clip of the gradients all read: one reduction per buffer, traced once. None for parameters and updates.
    """

    buffers: dict[str, torch.Tensor]
    storage: Flat = _tree.field(pytree_node=False)
    rows: tuple[torch.Tensor, torch.Tensor] | None = None
    #: The new parameters of a step's update that wrote them, and the optimizer state's buffers, already selected by
    #: the verdict (:meth:`Flat.update`'s regions without donation): ``commit`` keeps them (:meth:`Flat.commit`).
    committed: bool = _tree.field(pytree_node=False, default=False)


class _StateMap(NamedTuple):
    """How the per-leaf optimizer state and the flat one correspond, leaf by leaf.

    ``flat_sources[j]`` makes flat leaf ``j``: ``("same", t)`` (per-leaf leaf ``t``, a count or rate) or
    ``("group", g, ts, dtype)`` (group ``g``'s buffer of ``dtype`` from per-leaf leaves ``ts``, one per member) or
    ``("empty", t)`` (a group's empty placeholder, as ``kahan_summation`` keeps for float32 parameters).
    ``leaf_sources[t]`` makes per-leaf leaf ``t``: ``("same", j)``, ``("view", j, i)`` (parameter ``i``'s view of
    flat leaf ``j``) or ``("empty", j)``.
    """

    leaf_spec: Any
    flat_spec: Any
    flat_sources: list[tuple[Any, ...]]
    leaf_sources: list[tuple[Any, ...]]


class Flat:
    """The flat storage of a state's parameters and optimizer state (built by :func:`layout`).

    Static: the groups (device, dtype, members, offsets), the mask values of each buffer (:class:`Replay`) and
    the correspondence of the per-leaf and flat optimizer states. Carried by the state (``state.storage``),
    compared by identity: the states of one ``TrainState.create`` and their successors share it.
    """

    kind = "flat"
    reason = None
    #: ``==`` compares host-made constants, cheap for Dynamo to trace (funcamp._tree._fast's walk of static fields).
    _funcamp_static_eq = True

    def __init__(
        self,
        params: Any,
        groups: list[Group],
        replay: _flat_opt.Replay,
        state_map: _StateMap,
        optimizer: Any,
        stacked: tuple[str, ...] = (),
        unstacked: dict[str, str] | None = None,
    ) -> None:
        leaves = _tree.tree_leaves(params)
        #: The scanned runs laid out name-major (:func:`layout`'s ``stacked``), and why each other one asked for
        #: is laid out per layer.
        self.stacked, self.unstacked = stacked, dict(unstacked or {})
        self.params_spec = _tree.tree_structure(params)
        self.shapes = [tuple(x.shape) for x in leaves]
        self.numels = [x.numel() for x in leaves]
        self.groups = groups
        self.replay = replay
        self.state_map = state_map
        self._rebuild = _tree.rebuilder(params)
        self._group_of = {i: (g, j) for g in groups for j, i in enumerate(g.members)}
        self._stand_ins = _tree.tree_map(_stand_in, params)
        self._admitted = [optimizer]  # the optimizers whose masks this layout's replay answers for
        # per admitted optimizer, by id: (it, its update's regions (one compiled per kind of buffer) or why it has
        # none); a dict read by one key while traced, so that a later admit (another optimizer) guards nothing away
        self._regions: dict[int, tuple[Any, _flat_regions.Regions | str]] = {}
        # each leaf's first row and the row past its last in the rows of the non-empty buffers, in group order
        # (row_flags): leaf i holds rows [bounds[i], bounds[n + i])
        first, past, base = [0] * len(leaves), [0] * len(leaves), 0
        for g in groups:
            for i, off in zip(g.members, g.offsets, strict=True):
                first[i] = base + off // NORM_ROW
                past[i] = base + -(-(off + self.numels[i]) // NORM_ROW)
            base += g.numel // NORM_ROW
        self._row_bounds = first + past
        self._plan_views()
        # Equality by host-made text (the optree specs' reprs among it): Dynamo traces a comparison of two strings,
        # and cannot trace the C comparison of optree's specs (select_tree between two states created alike).
        self._identity = repr(self._key())

    def __repr__(self) -> str:
        return f"Flat({self.describe()})"

    def _key(self) -> tuple[Any, ...]:
        s = self.state_map
        return (
            self.params_spec,
            tuple(self.shapes),
            tuple(self.groups),
            s.leaf_spec,
            s.flat_spec,
            repr(s.flat_sources),
        )

    def __eq__(self, other: object) -> bool:
        """Two layouts of the same parameters, groups and optimizer-state correspondence (two states created
        alike) are equal: a step compiled for one runs the other."""
        return isinstance(other, Flat) and (other is self or other._identity == self._identity)

    def __hash__(self) -> int:
        return hash((self.params_spec, tuple(self.shapes), tuple(self.groups)))

    def admit(self, optimizer: GradientTransformation) -> None:
        """Host side, before a step runs ``optimizer`` over this storage: check that ``optimizer`` lays the
        parameters out as the one the state was created with (the same groups: its masks and labels give the
        same values), so that its masks can be answered from the buffers; once per optimizer object.

        Raises:
          TypeError: if ``optimizer`` groups the parameters otherwise (another mask or label), or cannot run
            over flat buffers; the message says to build the state with the step's optimizer.
          TypeError: if the state was pickled by a funcamp that laid buffers out otherwise (members not on rows of
            :data:`NORM_ROW` elements); the message says how to carry it over.
        """
        if not hasattr(self, "_row_bounds"):
            raise TypeError(
                "train_step: the state's flat storage was laid out by an earlier funcamp (its members do not start on "
                f"rows of {NORM_ROW} elements); save it with funcamp.checkpoint.save(path, state) and load it with "
                "funcamp.checkpoint.load(path, like=TrainState.create(params, optimizer)), which lays it out anew"
            )
        if any(optimizer is known for known in self._admitted):
            self._plan_regions(optimizer)
            return
        devices = [self._group_of[i][0].device for i in range(len(self.shapes))]
        # By the rule this layout was made by: a layout pickled before the per-block rule has no group of a block
        # (its blocks packed), nor has one of parameters without alike blocks, which both rules lay out alike.
        blocks = any(g.block for g in self.groups)
        built = layout(
            self._stand_ins,
            optimizer,
            devices=devices,
            blocks=blocks,
            stacked=(*self.stacked, *self.unstacked),
        )
        if isinstance(built, str) or built._key() != self._key():
            why = built if isinstance(built, str) else "its masks or labels group the parameters otherwise"
            raise TypeError(
                "train_step: the state's flat storage was laid out (TrainState.create) for another optimizer than "
                f"the step's ({why}); build the state with the optimizer given to the step"
            )
        self.replay.values.update(built.replay.values)
        self.replay.specs.extend(built.replay.specs)
        self._admitted.append(optimizer)
        self._plan_regions(optimizer)

    def _plan_regions(self, optimizer: GradientTransformation) -> None:
        """Host side, once per admitted optimizer: its update's regions (:func:`funcamp.train._flat_regions.plan`)."""
        if id(optimizer) not in self._regions:
            self._regions[id(optimizer)] = (optimizer, _flat_regions.plan(self, optimizer, _tagged_init))

    def regions(self, optimizer: GradientTransformation) -> _flat_regions.Regions | str | None:
        """The regions of ``optimizer``'s update over these buffers (a compiled donating step's, one compiled per
        kind of buffer: :mod:`funcamp.train._flat_regions`), why it has none, or None before it is admitted."""
        entry = self._regions.get(id(optimizer))
        return entry[1] if entry is not None and entry[0] is optimizer else None

    def describe(self) -> str:
        """One line for the step's plan: the buffers and their sizes (each buffer's dtype, members and elements;
        past :data:`_LISTED` buffers, per dtype: the count, the elements in all and the smallest and largest)."""
        if len(self.groups) <= _LISTED:
            sizes = ", ".join(f"{g.dtype} x {len(g.members)} ({g.numel:,})" for g in self.groups)
        else:
            by_dtype: dict[torch.dtype, list[Group]] = {}
            for g in self.groups:
                by_dtype.setdefault(g.dtype, []).append(g)
            sizes = ", ".join(
                f"{dtype}: {len(gs)} buffers, {sum(g.numel for g in gs):,} elements "
                f"({min(g.numel for g in gs):,} to {max(g.numel for g in gs):,} each)"
                for dtype, gs in by_dtype.items()
            )
        cap = f" (split at {BUFFER_BYTES >> 20} MiB)" if any(g.split for g in self.groups) else ""
        n = len(self.groups)
        planned = next(iter(self._regions.values()))[1] if self._regions else None
        kinds = (
            f"; a compiled step's update compiled once per kind of buffer ({planned.kinds} kinds)"
            if isinstance(planned, _flat_regions.Regions)
            else ""
        )
        stacks = "".join(
            [f"; run {run!r} name-major (each name's layers end to end)" for run in self.stacked]
            + [f"; run {run!r} per layer ({why})" for run, why in self.unstacked.items()]
        )
        return f"flat: {len(self.shapes)} parameters in {n} buffer{'s' if n != 1 else ''}{cap}: {sizes}{kinds}{stacks}"

    # --- inside the step ---------------------------------------------------------------------------------

    def tree(self, params: Any) -> Any:
        """The parameter tree the loss sees: ``params`` as they are (per-leaf views, eager), or for
        :class:`FlatParams` (compiled) each leaf a view of its buffer (a narrow and a view per leaf, which
        funcamp's graph passes read as a parameter's forward tensor, as they read a graph input)."""
        if not isinstance(params, FlatParams):
            return params
        return self._rebuild(self._views(params.buffers))

    def held(self, params: Any) -> tuple[Any, Any]:
        """``(tensors, tree_of)``: for :class:`FlatParams`, the buffers (a plain dict) and the function that makes
        the per-leaf views of them (operands that share no memory, as ``torch.cond`` requires); else ``params``."""
        if isinstance(params, FlatParams):
            return params.buffers, lambda buffers: self._rebuild(self._views(buffers))
        if isinstance(params, dict) and params.keys() == {g.key for g in self.groups}:  # a flat state-tree (moments)
            return params, lambda buffers: self._rebuild(self._views(buffers))
        return params, lambda tree: tree

    def gradients(self, grads: Any, params: Any) -> Any:
        """The gradients as the update reads them: for :class:`FlatParams` (compiled), the gradients written into
        one buffer per group (:meth:`flat`), held as :class:`FlatParams`, so that the finite check reads each
        member's view of the buffer (:meth:`tree`) rather than the gradients, which then die as they are
        written (funcamp.passes.flat_gradients), with their row sums (:meth:`row_sums`) for the check's and a clip's
        norm; ``grads`` as they are otherwise."""
        if not isinstance(params, FlatParams):
            return grads
        buffers = self.flat(grads)
        return FlatParams(buffers, self, self.row_sums(buffers))

    def _plan_views(self) -> None:
        """Host-made constants of :meth:`_views` and :meth:`flat`, per group (beside ``self.groups``): its members'
        sizes and shapes and whether they lie end to end from 0; and where each leaf's view comes in the views made
        group by group. With them the two make their views and parts with ``map`` over a group
        (which Dynamo runs itself) instead of a traced loop per member: 4,617 fewer bytecode instructions in
        GPT-2 124M's unrolled step (148 parameters, 62 buffers)."""
        plan, order, at = [], [0] * len(self.shapes), 0
        for g in self.groups:
            numels = tuple(self.numels[i] for i in g.members)
            ends = tuple(off + n for off, n in zip(g.offsets, numels, strict=True))
            packed = g.offsets == (0, *ends[:-1])
            plan.append((numels, tuple(self.shapes[i] for i in g.members), packed))
            for i in g.members:
                order[i], at = at, at + 1
        self._view_plan, self._leaf_order = plan, tuple(order)

    def _views(self, buffers: dict[str, torch.Tensor]) -> list[Any]:
        views: list[Any] = []
        for g, (numels, shapes, _) in zip(self.groups, self._view_plan, strict=True):
            buffer = buffers[g.key]
            if buffer.numel() == 0:  # an empty placeholder (Kahan's) stays one
                views.extend([buffer] * len(g.members))
                continue
            at = map(torch.Tensor.narrow, itertools.repeat(buffer), itertools.repeat(0), g.offsets, numels)
            views.extend(map(torch.Tensor.view, at, shapes))
        return list(map(views.__getitem__, self._leaf_order))

    def flat(self, tree: Any) -> dict[str, torch.Tensor]:
        """``{group key: buffer}`` of a tree shaped like the parameters (the gradients): one ``cat`` per group,
        zeros in the padding; a new tensor even for a group of one parameter (an update passed through unchanged
        must not be a view of a gradient the telemetry's ``torch.cond`` also reads)."""
        leaves = _tree.tree_leaves(tree)
        out = {}
        for g, (numels, _, packed) in zip(self.groups, self._view_plan, strict=True):
            key, members, offsets = g.key, g.members, g.offsets
            if packed:  # members end to end from 0: their flattened gradients (a map: no loop traced)
                parts = list(map(torch.Tensor.reshape, map(leaves.__getitem__, members), itertools.repeat(-1)))
                cursor = offsets[-1] + numels[-1]
            else:
                parts, cursor = [], 0
                for i, off, n in zip(members, offsets, numels, strict=True):
                    x = leaves[i]
                    # zeros made from the gradient: not before it (zeros with no input may go to the forward)
                    if off > cursor:
                        parts.append(x.new_zeros(off - cursor))
                    parts.append(x.reshape(-1))
                    cursor = off + n
            if g.numel > cursor:
                parts.append(leaves[members[-1]].new_zeros(g.numel - cursor))
            if len(parts) == 1:
                out[key] = parts[0].clone()  # never a view of a gradient
                continue
            with tags.flat_gradients():  # written into as the backward makes them (funcamp.passes.flat_gradients)
                out[key] = torch.cat(parts)
        return out

    def check(self, stage: Any, grads: Any, loss: torch.Tensor, layout: Any) -> Any:
        """The finite check (``stage``, :mod:`funcamp.train._stages`') of the gradients :meth:`gradients` made:
        ``stage(grads, loss, layout)`` with the :class:`FlatParams` and :class:`_MemberNorms` of ``layout``, which
        reads the norm and flags from the buffers' rows, or where the rows do not apply hands ``layout`` the members'
        views (:meth:`tree`), made only then: the views were made in every step and read in none, 292 graph nodes
        of GPT-2 124M's traced step. Per-leaf gradients (eager): ``stage(grads, loss, layout)``."""
        if not isinstance(grads, FlatParams):
            return stage(grads, loss, layout)
        return stage(grads, loss, _MemberNorms(layout, self, (grads, grads.buffers), rows=grads.rows))

    def update(
        self,
        stage: Any,
        optimizer: GradientTransformation,
        grads: Any,
        opt_state: Any,
        params: Any,
        layout: Any,
        finite: Any,
    ) -> tuple[Any, Any]:
        """The optimizer stage (``stage``, :mod:`funcamp.train._stages`'): over the buffers for :class:`FlatParams`
        (``grads`` as :meth:`gradients` made them, the gradients concatenated; each mask and label giving a buffer
        its leaves' value, the global norm taken over the members' views), leaf by leaf over the views otherwise
        (eager, in place when donating). In a compiled step whose body lets its update write the new state as it
        computes it (``plan.direct_update``) on a single process, where :meth:`regions` planned them: one region
        per buffer, compiled once per kind of buffer (:mod:`funcamp.train._flat_regions`: the pure update and the
        verdict's select, written into the donated buffers, or without donation into new ones, which the
        parameters returned mark as ``committed``), and the updates are None (no probe reads them in such a step).
        Returns ``(params, opt_state, updates)``, the updates held as the parameters (:class:`FlatParams`)."""
        if not isinstance(params, FlatParams):
            return stage(optimizer, grads, opt_state, params, layout, finite)
        norms = _MemberNorms(layout, self, gradients=grads.buffers, rows=grads.rows)
        regions = self.regions(optimizer)
        plan = _scope.step_plan()
        if (
            isinstance(regions, _flat_regions.Regions)
            and plan is not None
            and plan.compiled
            and plan.direct_update  # (in_place: donating and direct_update)
            and type(layout) is SingleProcess
        ):
            # one region per buffer, compiled once per kind. Donating: written into the given buffers, the
            # parameters and the state's buffers the given ones (commit selects nothing there, donation copies
            # nothing). Else into new buffers, already selected: commit keeps them (FlatParams.committed).
            t, s = norms.scaled_global_norm(grads.buffers)
            fresh = not plan.in_place
            new, new_state = _flat_regions.run(
                regions, grads.buffers, params.buffers, opt_state, finite, t, s, fresh=fresh
            )
            return (FlatParams(new, self, committed=True) if fresh else params), new_state, None
        new, new_state, updates = _flat_opt.replaying(
            self.replay, stage, optimizer, grads.buffers, opt_state, params.buffers, norms, None
        )
        return FlatParams(new, self), new_state, FlatParams(updates, self)

    def commit(self, finite: torch.Tensor, params: FlatParams, opt_state: Any, old_opt_state: Any) -> tuple[Any, Any]:
        """``commit``'s select for ``params`` that :meth:`update`'s regions returned ``committed`` (their buffers
        and the optimizer state's hold ``where(finite, new, old)`` already): ``(params, opt_state)``, the buffers as
        they are, each 0-d optimizer-state leaf (counts, rates) ``where(finite, new, old)``."""
        # the traced walk where it applies, as select_tree and _flat_regions.run (optree traced by Dynamo is slow)
        fast = _tree.flatten_same(opt_state, old_opt_state)
        if fast is None:
            new_leaves, spec = _tree.tree_flatten(opt_state)
            old_leaves = _tree.tree_leaves(old_opt_state)
            rebuild = lambda leaves: _tree.tree_unflatten(spec, leaves)  # noqa: E731
        else:
            (new_leaves, old_leaves), rebuild = fast
        kept = [
            torch.where(finite, new, old) if isinstance(new, torch.Tensor) and new.ndim == 0 else new
            for new, old in zip(new_leaves, old_leaves, strict=True)
        ]
        return FlatParams(params.buffers, self), rebuild(kept)

    def row_sums(self, buffers: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(sums, s)`` of :func:`funcamp._tree.scaled_row_sums` over ``buffers`` (one per group, by key: the
        gradient buffers :meth:`gradients` made, zeros in the padding), read as rows of :data:`NORM_ROW` elements in
        group order; None where that does not apply (float8 buffers, float16 on MPS, all empty)."""
        return _tree.scaled_row_sums([buffers[g.key] for g in self.groups], NORM_ROW)

    def row_flags(self, sums: torch.Tensor) -> torch.Tensor:
        """Each leaf's finite flag (1-d bool, tree order) read from the row sums of :meth:`row_sums`: a row's sum is
        finite exactly when its elements are, and a leaf is finite when none of its rows is not, counted by one
        running sum of the non-finite rows (exact: integers) read at each leaf's first row and past its last."""
        # bad[r]: the non-finite rows before row r; padded from the sums, not concatenated with zeros made from
        # nothing, which inductor may compute in the forward (and its peak-memory reordering then counts them there)
        bad = torch.nn.functional.pad(
            torch.cumsum((~torch.isfinite(sums)).to(torch.int32), 0, dtype=torch.int32), (1, 0)
        )
        at = bad.gather(0, torch.tensor(self._row_bounds, dtype=torch.int64, device=sums.device))
        n = len(self.shapes)
        return at[:n] == at[n:]

    def holds_buffers(self, tree: dict[str, Any]) -> bool:
        """Whether ``tree`` is one buffer of this storage's size per group, by group key (in group order)."""
        return list(tree) == [g.key for g in self.groups] and all(
            _fills(g, b) for g, b in zip(self.groups, tree.values(), strict=True)
        )

    def member_views(self, key: str, buffer: torch.Tensor) -> list[torch.Tensor] | None:
        """The members' views of ``buffer`` if ``key`` is one of this storage's groups and ``buffer`` its size."""
        g = next((g for g in self.groups if g.key == key), None)
        if g is None or not _fills(g, buffer):
            return None
        return [buffer.narrow(0, off, self.numels[i]) for i, off in zip(g.members, g.offsets, strict=True)]

    # --- on the host ---------------------------------------------------------------------------------------

    def lay_out(self, params: Any, optimizer: GradientTransformation) -> tuple[Any, Any]:
        """``(params, opt_state)`` of a new state: the buffers made, the parameters copied in (padding zero), the
        optimizer's ``init`` run over the buffers; both trees per-leaf views of them."""
        leaves = _tree.tree_leaves(params)
        buffers = {}
        with torch.no_grad():
            for g in self.groups:
                base = torch.zeros(g.numel, dtype=g.dtype, device=g.device)
                for i, off in zip(g.members, g.offsets, strict=True):
                    base.narrow(0, off, self.numels[i]).copy_(leaves[i].reshape(-1))
                buffers[g.key] = base
            flat_state = _flat_opt.replaying(self.replay, optimizer.init, buffers)
        return self._per_leaf(buffers, flat_state)

    def adopt(self, params: Any, opt_state: Any) -> tuple[Any, Any] | None:
        """Host side, when a state of this storage is made (loaded, unpickled, ``replace``-d): None if ``params``
        and ``opt_state`` are already the views of this storage's buffers (or the buffers themselves); otherwise
        both copied into new buffers, as per-leaf views (the given tensors are left as they are).

        Raises:
          TypeError: as :meth:`enter`, for trees of another structure, shapes, dtypes or devices.
        """
        if isinstance(params, FlatParams) or any(
            isinstance(x, torch.Tensor) and (x.device.type == "meta" or torch._subclasses.fake_tensor.is_fake(x))
            for x in _tree.tree_leaves(params)
        ):
            return None
        state = _Trees(params, opt_state)
        entered, after = self.enter(state)
        if after is _nothing:
            return None
        return self._per_leaf(entered.params.buffers, entered.opt_state)

    def compact(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """``(FlatParams, flat optimizer state)``: the buffers the trees are views of (copied where they are not),
        as a state is pickled: each buffer once, not once per view."""
        entered, _ = self.enter(_Trees(params, opt_state))
        return entered.params, entered.opt_state

    def expand(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """:meth:`compact`'s trees as per-leaf views (trees that are per leaf already are returned as they are)."""
        return self._per_leaf(params.buffers, opt_state) if isinstance(params, FlatParams) else (params, opt_state)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without what holds functions (the rebuild, the optimizers and their masks' replay): a step's
        :meth:`admit` of its optimizer makes the replay again."""
        return {**self.__dict__, "_rebuild": None, "_admitted": [], "_regions": {}, "replay": _flat_opt.Replay({}, [])}

    def __setstate__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)
        self._plan_views()  # made again: a layout pickled before it held none
        self.__dict__.setdefault("_regions", {})  # planned again when a step admits its optimizer
        self.__dict__.setdefault("stacked", ())  # a layout pickled before stacked runs had none
        self.__dict__.setdefault("unstacked", {})
        self._rebuild = _tree.rebuilder(self._stand_ins)
        self._identity = repr(self._key())  # made again: a layout pickled before it held one has none

    def _per_leaf(self, buffers: dict[str, torch.Tensor], flat_state: Any) -> tuple[Any, Any]:
        flat_leaves = _tree.tree_leaves(flat_state)
        leaves = [self._leaf(source, flat_leaves) for source in self.state_map.leaf_sources]
        opt_state = _tree.tree_unflatten(self.state_map.leaf_spec, leaves)
        return _tree.tree_unflatten(self.params_spec, self._views(buffers)), opt_state

    def _leaf(self, source: tuple[Any, ...], flat_leaves: list[Any]) -> Any:
        if source[0] != "view":
            return flat_leaves[source[1]]
        _, j, i, ratio, shape = source
        g, k = self._group_of[i]
        return flat_leaves[j].narrow(0, int(g.offsets[k] * ratio), int(self.numels[i] * ratio)).view(shape)

    def enter(self, state: Any) -> tuple[Any, Any]:
        """``(flat_state, after)``: ``state`` with :class:`FlatParams` and a flat optimizer state, and what to do
        after a donating call (copy the results back into tensors that had to be copied in).

        The buffers are those the state's views are of (no copy). A tensor that is not the view of its buffer at
        its place (the user replaced it, or the state was loaded or built elsewhere) is copied with its whole
        group into a new buffer; ``after()`` then writes the buffer's values back into the given tensors, so a
        donating step writes into the caller's memory and never re-points it.

        Raises:
          TypeError: if the state's parameters or optimizer state are not of this storage's structure, shapes,
            dtypes and devices (the message says which; build the state with ``TrainState.create``).
        """
        p_leaves, p_spec = _tree.tree_flatten(state.params)
        s_leaves, s_spec = _tree.tree_flatten(state.opt_state)
        if p_spec != self.params_spec or s_spec != self.state_map.leaf_spec:
            which = "parameters" if p_spec != self.params_spec else "optimizer state"
            raise TypeError(
                f"train_step: the state's {which} are not of the structure its flat storage was laid out for "
                "(TrainState.create); a state changed by hand keeps its storage's structure: build a new one with "
                "TrainState.create(params, optimizer), or replace tensors leaf for leaf"
            )
        copies: list[Any] = []
        buffers = {g.key: self._buffer(g, [p_leaves[i] for i in g.members], g.dtype, copies) for g in self.groups}
        flat_leaves = []
        for source in self.state_map.flat_sources:
            if source[0] == "group":
                _, n, ts, dtype, ratio, shapes = source
                g = self.groups[n]
                flat_leaves.append(self._buffer(g, [s_leaves[t] for t in ts], dtype, copies, ratio, shapes))
            else:
                flat_leaves.append(s_leaves[source[1]])
        opt_state = _tree.tree_unflatten(self.state_map.flat_spec, flat_leaves)
        flat_state = dataclasses.replace(state, params=FlatParams(buffers, self), opt_state=opt_state)
        return flat_state, (lambda: self._write_back(copies)) if copies else _nothing

    def _buffer(
        self,
        g: Group,
        tensors: list[Any],
        dtype: torch.dtype,
        copies: list[Any],
        ratio: Fraction = Fraction(1),
        shapes: list[tuple[int, ...]] | None = None,
    ) -> torch.Tensor:
        """Group ``g``'s buffer whose members are ``tensors`` (of ``dtype``, ``ratio`` elements per parameter
        element, of ``shapes``; default the parameters'): the buffer they are views of, or a new one they are
        copied into (recorded in ``copies``)."""
        shapes = shapes or [self.shapes[i] for i in g.members]
        for t, shape in zip(tensors, shapes, strict=True):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device != g.device or tuple(t.shape) != shape:
                got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(
                    f"train_step: a leaf of the state is {got} where its flat storage holds {dtype} "
                    f"{shape} on {g.device}; replace state tensors only with tensors of the same shape, "
                    "dtype and device (or build a new state with TrainState.create)"
                )
        numel, offsets = _scaled(g.numel, tuple(g.offsets), ratio)  # (a tuple already: the same object)
        base = tensors[0]._base
        if (
            base is not None
            and base.ndim == 1
            and base.shape[0] == numel
            and base.dtype == dtype
            and base.storage_offset() == 0
            and all(
                t._base is base and t.storage_offset() == off and t.is_contiguous()
                for t, off in zip(tensors, offsets, strict=True)
            )
        ):
            return base  # the views the state was given (TrainState.create, a step's result)
        storage = tensors[0].untyped_storage()
        if storage.nbytes() == numel * dtype.itemsize and all(
            t.untyped_storage()._cdata == storage._cdata and t.storage_offset() == off and t.is_contiguous()
            for t, off in zip(tensors, offsets, strict=True)
        ):  # tensors on one buffer's memory at its offsets (an unpickled or deep-copied state): a new tensor on it
            return torch.empty(0, dtype=dtype, device=g.device).set_(storage, 0, (numel,), (1,))
        made = torch.zeros(numel, dtype=dtype, device=g.device)
        with torch.no_grad():
            for t, off in zip(tensors, offsets, strict=True):
                made.narrow(0, off, t.numel()).copy_(t.reshape(-1))
        copies.append((tensors, made, offsets))
        return made

    def _write_back(self, copies: list[Any]) -> None:
        with torch.no_grad():
            for tensors, made, offsets in copies:
                for t, off in zip(tensors, offsets, strict=True):
                    t.copy_(made.narrow(0, off, t.numel()).view(t.shape))

    def leave(self, flat_state: Any) -> Any:
        """``flat_state`` (a pure compiled step's result) with per-leaf views of its buffers."""
        params, opt_state = self._per_leaf(flat_state.params.buffers, flat_state.opt_state)
        return dataclasses.replace(flat_state, params=params, opt_state=opt_state)


def _nothing() -> None:
    return None


@functools.lru_cache(maxsize=4096)
def _scaled(numel: int, offsets: tuple[int, ...], ratio: Fraction) -> tuple[int, tuple[int, ...]]:
    """A group's length and offsets in a state leaf of ``ratio`` elements per parameter element, computed once per
    group and ratio (host constants): :meth:`Flat.enter` asks at every step, for every buffer of the state (the
    ``Fraction`` products were 4 of GPT-2 124M's 19 ms a step outside the compiled call)."""
    return int(numel * ratio), tuple(int(off * ratio) for off in offsets)


@dataclasses.dataclass
class _Trees:
    """The two trees :meth:`Flat.enter` reads of a state, for :meth:`Flat.adopt`."""

    params: Any
    opt_state: Any


def _fills(group: Any, buffer: Any) -> bool:
    """Whether ``buffer`` is a 1-d tensor of ``group``'s size: its buffer, or one shaped like it."""
    return isinstance(buffer, torch.Tensor) and buffer.ndim == 1 and buffer.shape[0] == group.numel


class _MemberNorms:
    """The step's process layout as the check and the optimizer see it over flat buffers: the global norm of the
    gradient buffers (the updates a first clip sees) or of the gradients the check was handed is read from the
    buffers as rows (:meth:`Flat.row_sums`: one 2-d reduction per buffer, each row's sum of squares, not one
    reduction per member), and each member's finite flag from its rows (:meth:`Flat.row_flags`, exact); the check's
    and a clip's norm read the same row sums, made once with the gradient buffers (:attr:`FlatParams.rows`; they
    were two expressions that the ``cse`` graph pass merged, traced twice by Dynamo). Updates a transformation made
    (whose padding need not be zero) are normed member by member. The norm sums the squares per row where the per-leaf
    step sums them per leaf: within round-off of it, not bit for bit (``tests/test_flat.py``). Where the rows do
    not apply (float8 buffers, float16 on MPS, every member empty, shards), the layout's own per-leaf norm and flags
    of the members' views. Rows of float32, bfloat16 and float16 are summed in float64: the norm is rounded to
    float32 once. Everything else is the layout's."""

    def __init__(
        self,
        layout: Any,
        storage: Flat,
        checked: tuple[Any, dict[str, Any]] | None = None,
        gradients: dict[str, torch.Tensor] | None = None,
        rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        # checked: the FlatParams the check is handed and its gradient buffers;
        # gradients: the gradient buffers :meth:`Flat.flat` made (zeros in the padding), for the optimizer's norms;
        # rows: their row sums (FlatParams.rows), made once for the check and the clip
        self._layout, self._storage, self._checked, self._rows = layout, storage, checked, rows
        self._gradients = gradients if checked is None else checked[1]

    def stats(self, grads: Any, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layout's ``(finite, flags, grad_norm)``; for the gradient buffers :meth:`Flat.check` was handed
        (:class:`FlatParams`), each member's flag and the norm read from the buffers' rows (:meth:`Flat.row_sums`,
        :meth:`Flat.row_flags`), or the layout's of the members' views where the rows do not apply."""
        if self._checked is None or grads is not self._checked[0]:
            return self._layout.stats(grads, loss)
        rows = (
            self._rows
            # shards: the layout's norm is over every rank's
            if getattr(self._layout, "whole_gradients", False) and hasattr(self._layout, "agree")
            else None
        )
        if rows is None:
            return self._layout.stats(self._storage.tree(grads), loss)
        sums, s = rows
        flags = self._storage.row_flags(sums)
        # the per-leaf norm's dtype (float64 only where a float64 parameter holds elements: _tree.norm_dtype's rule,
        # over the buffers), where float32 rows were summed in float64
        groups = self._storage.groups
        dtype = torch.float64 if any(g.dtype == torch.float64 and g.numel for g in groups) else torch.float32
        norm = _tree.norm_of_scaled(sums.sum().sqrt(), s, dtype)
        return self._layout.agree(flags.all() & torch.isfinite(loss)), flags, norm

    def scaled_global_norm(self, tree: Any, fn: str = "global_norm") -> tuple[torch.Tensor, torch.Tensor]:
        """``(t, s)`` of :func:`funcamp._tree.scaled_global_norm`: for the gradient buffers (the updates a first
        clip sees), read from the row sums the finite check reads its norm from (:attr:`FlatParams.rows`, traced
        once for both); over each buffer's members otherwise (the layout's norm of the views)."""
        if isinstance(tree, dict) and self._storage.holds_buffers(tree):
            grads = self._gradients
            # The rows and the buffers' largest magnitudes read the padding: only the gradient buffers are known to
            # hold zeros there. An update made from them (a transformation before the clip) may not: f(0) != 0, or
            # Adam's 0 / 0 with eps=0; its norm is the members' (the per-leaf step's, bitwise).
            if grads is not None and self._rows is not None and all(tree[k] is grads.get(k) for k in tree):
                return self._rows[0].sum().sqrt(), self._rows[1]
            return self._layout.scaled_global_norm(self._storage._views(tree), fn)
        views: list[torch.Tensor] = []
        for key, leaf in zip(_tree.tree_paths(tree), _tree.tree_leaves(tree), strict=True):
            members = (
                self._storage.member_views(key.rsplit(".", 1)[-1], leaf) if isinstance(leaf, torch.Tensor) else None
            )
            views.extend([leaf] if members is None else members)
        return self._layout.scaled_global_norm(views, fn)

    def element_offsets(self) -> Any:
        """The layout's (None: the parameters are whole)."""
        return self._layout.element_offsets()

    def finish_params(self, params: Any) -> Any:
        """The layout's."""
        return self._layout.finish_params(params)


# --- building the layout -----------------------------------------------------------------------------------


def _aligned(offset: int, itemsize: int, block: int = 1) -> int:
    """``offset`` rounded up to a multiple of :data:`ALIGN_BYTES` (in elements of ``itemsize`` bytes), of
    :data:`NORM_ROW` elements and of ``block`` elements."""
    step = math.lcm(max(1, ALIGN_BYTES // itemsize), NORM_ROW, block)
    return -(-offset // step) * step


def _plain(x: Any) -> bool:
    """A tensor the flat layout can hold: dense, strided, floating, of torch's own tensor type."""
    return (
        type(x) in (torch.Tensor, torch.nn.Parameter)
        and x.layout == torch.strided
        and x.is_floating_point()
        and not x.is_nested
    )


def _stand_in(x: torch.Tensor) -> torch.Tensor:
    """A shape-only copy of ``x`` (meta): what a mask callable is given (its shape, dtype and ``ndim``)."""
    return torch.empty(x.shape, dtype=x.dtype, device="meta")


class _Tags(TorchFunctionMode):
    """While active, every tensor made by a torch function from tensors of one tag gets that tag (optax's
    ``tree_map_params`` placeholders, for torch: the tags follow ``zeros_like``, ``new_zeros``, ``to``...)."""

    def __init__(self, tags: WeakIdKeyDictionary) -> None:
        super().__init__()
        self.tags = tags

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        found = {
            self.tags[x]
            for x in torch_pytree.tree_leaves((args, kwargs))
            if isinstance(x, torch.Tensor) and x in self.tags
        }
        if len(found) == 1:
            tag = found.pop()
            for y in torch_pytree.tree_leaves(out):
                if isinstance(y, torch.Tensor) and y not in self.tags:
                    self.tags[y] = tag
        return out


def _tagged_init(
    fn: Any, tree: Any, replay: _flat_opt.Replay | None, record: _flat_opt.Recording | None
) -> tuple[Any, list[Any]]:
    """``(state, tags)``: ``fn(tree)`` (``init`` over meta tensors), and for each of its leaves the index of the leaf of
    ``tree`` it was made from (None: made from none, or from several)."""
    tags = WeakIdKeyDictionary()
    leaves = _tree.tree_leaves(tree)
    for n, x in enumerate(leaves):
        tags[x] = n
    with _Tags(tags):
        state = _flat_opt.replaying(replay, fn, tree) if replay is not None else _flat_opt.recording(record, fn, tree)
    return state, [tags.get(x) if isinstance(x, torch.Tensor) else None for x in _tree.tree_leaves(state)]


def layout(
    params: Any,
    optimizer: GradientTransformation,
    *,
    devices: list[torch.device] | None = None,
    blocks: bool = True,
    stacked: tuple[str, ...] = (),
) -> Flat | str:
    """The flat storage of ``params`` under ``optimizer``, or the reason they must be kept leaf by leaf.

    ``devices``: each parameter's device, for meta ``params`` (:meth:`Flat.admit`; the grouping and the CPU's
    buffer size read them); default the parameters' own. ``blocks``: each block of a run of alike blocks in
    buffers of its own (:func:`_segments`); False packs them, as a layout pickled before that rule did (its
    :meth:`Flat.admit` lays the step's optimizer out so again). ``stacked``: the runs a compiled step scans
    (``apply_fn.scan``), laid out name-major (:func:`_segments`): each parameter name's layers end to end in one
    buffer, so that the scan's stack of them is a view of it (:mod:`funcamp.passes.scan_stacks`).
    Leaf by leaf when the optimizer holds a transformation that is not marked elementwise (a user's own, one
    that reads shapes), a parameter is not a plain dense floating tensor, the optimizer's masks depend on more
    than the leaves (a spec gave one leaf two values), or its state does not correspond leaf for leaf between
    the two layouts. Runs ``init`` and ``update`` on shape-only (meta) stand-ins, per leaf (recording the masks'
    values) and over the buffers (checking the result).
    """
    if not _flat_opt.runs_flat(optimizer):
        return (
            "the optimizer holds a transformation not marked elementwise "
            "(declare it with funcamp.optim.elementwise if it is)"
        )
    paths, leaves, _ = _tree.tree_flatten_with_path(params)
    if not leaves:
        return "no parameters"
    odd = next((".".join(map(str, p)) for p, x in zip(paths, leaves, strict=True) if not _plain(x)), None)
    if odd is not None:
        return f"parameter {odd!r} is not a plain dense floating tensor"
    names = [".".join(str(k) for k in p) for p in paths]
    record = _flat_opt.Recording()
    meta = _tree.tree_map(_stand_in, params)
    try:
        leaf_state, leaf_tags = _tagged_init(optimizer.init, meta, None, record)
        _flat_opt.recording(record, optimizer.update, _tree.tree_map(_stand_in, params), leaf_state, meta)
    except TypeError as e:
        if "requires_grad" in str(e):
            raise  # a mask that reads requires_grad: refused whatever the storage (funcamp.optim._flat)
        return f"the optimizer does not run on shape-only tensors ({type(e).__name__}: {e})"
    except Exception as e:  # noqa: BLE001 (an optimizer that cannot run on meta tensors runs leaf by leaf)
        return f"the optimizer does not run on shape-only tensors ({type(e).__name__}: {e})"
    if not record.consistent:
        return "a mask or label of the optimizer gave one parameter two values"
    devices = devices or [x.device for x in leaves]
    stacked, unstacked = _stackable(tuple(stacked), names, leaves, _keys(leaves, names, record, devices))
    groups = _groups(leaves, names, record, devices, blocks, stacked)
    replay = _flat_opt.Replay(
        {
            id(spec): {
                g.key: record.values[id(spec)].get(names[g.members[0]])
                for g in groups
                if names[g.members[0]] in record.values[id(spec)]
            }
            for spec in record.specs
        },
        record.specs,
    )
    flat_meta = {g.key: torch.empty(g.numel, dtype=g.dtype, device="meta") for g in groups}
    try:
        flat_state, flat_tags = _tagged_init(optimizer.init, flat_meta, replay, None)
        _flat_opt.replaying(
            replay, optimizer.update, _tree.tree_map(torch.empty_like, flat_meta), flat_state, flat_meta
        )
    except Exception as e:  # noqa: BLE001
        return f"the optimizer does not run over flat buffers ({type(e).__name__}: {e})"
    state_map = _state_map(leaf_state, leaf_tags, flat_state, flat_tags, leaves, groups)
    if isinstance(state_map, str):
        return state_map
    return Flat(params, groups, replay, state_map, optimizer, stacked, unstacked)


#: No flat buffer holds more than this many bytes of parameters, unless one parameter alone does; larger groups are
#: split in leaf order. Two reasons, measured on a CPU. Memory: inductor's peak-memory reordering
#: (``torch._inductor.config.reorder_for_peak_memory``) counts the update's fused intermediates as allocations, so its
#: estimate of the step's peak sits in the update whatever the backward's order, and it may schedule a buffer's
#: gradient writes after the buffer's last gradient: the members' gradients then live beside the buffer, a step adds
#: up to one buffer's gradients more than the per-leaf step (8 x ``Linear(2048, 2048)``, AdamW, bf16, compiled and
#: donating: 128.3 MB in one buffer, 64.1 MB split and per leaf; :mod:`funcamp.passes.flat_gradients`), on any device.
#: Time on a CPU: glibc's ``malloc`` serves a block over its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
#: unmaps it when freed, so an undonated step's new state in larger buffers page-faults on every step (GPT-2 124M,
#: 4 x 256, bfloat16: 148 parameters in 1 buffer, the undonated step 1.19x torch.amp's; in 62 buffers of at most
#: 8 MiB, 1.09x; the donated step 0.96x and 0.99x; docs/memory.md). 16 MiB was measured and not kept: the compile's
#: cost grows with the number of buffers, but the steady step with it (AMD EPYC Zen 4, 2 cores; docs/benchmarks.md):
#: GPT-2 124M's body first step 47.0 s against 59.4 s, steady 1.04x; at 4 x 256, in one process, interleaved, the
#: steady step 1.05x donated and 1.08x undonated: 150-250 steps pay back the first step's saving.
BUFFER_BYTES = 8 << 20

#: The plan lists each buffer up to this many; past it, a summary per dtype (GPT-2 124M has 62).
_LISTED = 8


def _keys(
    leaves: list[torch.Tensor], names: list[str], record: _flat_opt.Recording, devices: list[torch.device]
) -> list[tuple[Any, ...]]:
    """Each parameter's buffer key: its device, dtype and the values every mask of the optimizer gave it."""
    return [
        (device, x.dtype, tuple(record.values[id(spec)].get(name, _ABSENT) for spec in record.specs))
        for x, name, device in zip(leaves, names, devices, strict=True)
    ]


def _stackable(
    stacked: tuple[str, ...], names: list[str], leaves: list[torch.Tensor], keys: list[tuple[Any, ...]]
) -> tuple[tuple[str, ...], dict[str, str]]:
    """The runs of ``stacked`` that can be laid out name-major, and why each other one cannot: its layers hold
    the same relative names and shapes in the same order, and each name's layers one buffer key (a mask or label
    that tells layers apart, as a layer-wise learning-rate decay does, keeps the run per layer)."""
    runs, why = [], {}
    for run in stacked:
        layers: dict[str, list[int]] = {}
        relative: dict[int, str] = {}
        for i, name in enumerate(names):
            found = _in_run(name, run)
            if found is not None:
                layers.setdefault(found[0], []).append(i)
                relative[i] = found[1]
        signatures = {tuple((relative[i], tuple(leaves[i].shape), keys[i]) for i in part) for part in layers.values()}
        if len(layers) < 2:
            why[run] = f"no two layers named {run}.<i>.* among the parameters"
        elif len({tuple((r, sh) for r, sh, _ in sig) for sig in signatures}) > 1:
            why[run] = "its layers hold different parameter names or shapes"
        elif len(signatures) > 1:
            why[run] = "the optimizer's masks or labels tell its layers apart"
        else:
            runs.append(run)
    return tuple(runs), why


def _groups(
    leaves: list[torch.Tensor],
    names: list[str],
    record: _flat_opt.Recording,
    devices: list[torch.device],
    blocks: bool = True,
    stacked: tuple[str, ...] = (),
) -> list[Group]:
    """The parameters grouped by device, dtype and the values every mask gave them, in leaf order; within a
    group, each block of a run of alike blocks (:func:`_segments`) in buffers of its own, or, for the runs of
    ``stacked``, each parameter name's layers end to end; each part split into buffers of at most
    :data:`BUFFER_BYTES`, in leaf order, never between the layers of a stacked name."""
    keyed: dict[Any, list[int]] = {}
    for i, key in enumerate(_keys(leaves, names, record, devices)):
        keyed.setdefault(key, []).append(i)
    pieces = []
    for key, members in keyed.items():
        segments = _segments(members, names, leaves, stacked) if blocks or stacked else [("", [[i] for i in members])]
        for block, units in segments:
            parts, size = [[]], 0
            for unit in units:
                nbytes = sum(leaves[i].numel() for i in unit) * key[1].itemsize
                if parts[-1] and size + nbytes > BUFFER_BYTES:
                    parts.append([])
                    size = 0
                parts[-1] += unit
                size += nbytes
            pieces += [(key, part, len(parts) > 1, block) for part in parts]
    groups = []
    for n, ((device, dtype, values), members, split, block) in enumerate(pieces):
        align = 1  # elements every member starts at a multiple of (a blockwise moment format's block size)
        for spec, value in zip(record.specs, values, strict=True):
            if hasattr(spec, "flat_block_size"):
                align = math.lcm(align, spec.flat_block_size(value))
        offsets, at = [], 0
        for i in members:
            at = _aligned(at, dtype.itemsize, align)
            offsets.append(at)
            at += leaves[i].numel()
        numel = _aligned(at, dtype.itemsize, align)  # a whole number of blocks and of rows
        groups.append(Group(f"flat{n:04d}", device, dtype, tuple(members), tuple(offsets), numel, split, block))
    return groups


def _in_run(name: str, run: str) -> tuple[str, str] | None:
    """``(layer index, name within the layer)`` of a parameter of the run ``run`` (``<run>.<index>.<rest>``)."""
    if not name.startswith(f"{run}."):
        return None
    index, _, local = name[len(run) + 1 :].partition(".")
    return (index, local) if index.isdigit() and local else None


#: A parameter's name in a run of blocks: ``<run>.<index>.<rest>`` at its first all-digit component (a
#: ``ModuleList``'s or ``Sequential``'s child: ``h.3.attn.c_attn.weight``, ``model.layers.11.mlp.up.weight``).
_BLOCK_NAME = re.compile(r"^((?:[^.]+\.)*?)(\d+)\.(.+)$")


def _segments(
    members: list[int], names: list[str], leaves: list[torch.Tensor], stacked: tuple[str, ...] = ()
) -> list[tuple[str, list[list[int]]]]:
    """``members`` (leaf indices of one buffer key, in leaf order) as ``(block, units)`` pairs, ``units`` the
    lists of members a buffer's split keeps together: each block of a run (the children of one ``ModuleList`` or
    ``Sequential``) that has an alike block in the same run a part of its own, named ``<run>.<index>`` (alike: the
    same relative names and shapes, in the same order; a ``Sequential``'s first and last layers, unlike its
    blocks, stay out), each member a unit; a run of ``stacked`` (checked alike by :func:`_stackable`) one part,
    named ``<run>.*``, name-major: each relative name's layers in layer order, end to end, one unit; then the
    rest (block ``""``), each in leaf order.

    Why per block: a block's parameters then sit at the same offsets in its own buffers as every other block's,
    so the kernels inductor writes for the blocks' forward and backward, which read parameters and write gradients
    at constant offsets into the buffers, are the same source for every block and compile once (inductor keeps
    one kernel per distinct source), as they do for ``torch.compile(model)``'s separate parameter tensors. Packed
    across blocks, each block's kernels differed only in those offsets (GPT-2 124M's body: 84 C++ kernels against
    torch's 23, 0.7-1.0 s of C++ compiler each for the small ones on a 2-core Xeon).

    Why name-major for a scanned run: its forward stacks each name's layers (``torch.stack``, one loop per
    layer and name in the kernel inductor writes for it: GPT-2 124M's body, 147 loops, the scanned step's largest
    kernel) and its backward hands back each name's stacked gradient; laid end to end, a name's layers are one
    strided view of its buffer, read and written whole (:mod:`funcamp.passes.scan_stacks`).
    """
    blocks: list[tuple[int, str, list[list[int]]]] = []
    taken: set[int] = set()
    for run in stacked:  # by its name's prefix: a run may sit in a numbered module (``1.0.weight``, ``h.0.mlp.0.w``)
        by_layer: dict[str, list[tuple[int, str]]] = {}
        for i in members:
            found = None if i in taken else _in_run(names[i], run)
            if found is not None:
                by_layer.setdefault(found[0], []).append((i, found[1]))
        by_name: dict[str, list[int]] = {}
        for index in sorted(by_layer, key=int):
            for i, local in by_layer[index]:
                by_name.setdefault(local, []).append(i)
                taken.add(i)
        if by_name:
            blocks.append((min(min(u) for u in by_name.values()), f"{run}.*", list(by_name.values())))
    runs: dict[str, dict[str, list[int]]] = {}
    relative: dict[int, str] = {}  # a block member's name within its block
    rest: list[int] = []
    for i in members:
        if i in taken:
            continue
        m = _BLOCK_NAME.match(names[i])
        if m is None:
            rest.append(i)
        else:
            runs.setdefault(m[1], {}).setdefault(m[2], []).append(i)
            relative[i] = m[3]
    for run, by_index in runs.items():
        alike: dict[tuple[Any, ...], list[str]] = {}
        for index, part in by_index.items():
            signature = tuple((relative[i], tuple(leaves[i].shape)) for i in part)
            alike.setdefault(signature, []).append(index)
        for indices in alike.values():
            if len(indices) >= 2:
                blocks += [(by_index[index][0], f"{run}{index}", [[i] for i in by_index[index]]) for index in indices]
            else:
                rest += by_index[indices[0]]
    blocks.sort(key=lambda b: b[0])  # in leaf order of their first members
    return [*((block, units) for _, block, units in blocks), *([("", [[i] for i in sorted(rest)])] if rest else [])]


def _state_map(
    leaf_state: Any,
    leaf_tags: list[int | None],
    flat_state: Any,
    flat_tags: list[int | None],
    params: list[torch.Tensor],
    groups: list[Group],
) -> _StateMap | str:
    """The leaf-for-leaf correspondence of the per-leaf and flat optimizer states (meta), from the placeholders'
    tags: the ``k``-th flat leaf made from group ``g``'s buffer holds the ``k``-th leaf made from each member; the
    untagged leaves (counts, rates) correspond in order. A reason where they do not correspond."""
    t_leaves, t_spec = _tree.tree_flatten(leaf_state)
    f_leaves, f_spec = _tree.tree_flatten(flat_state)
    if any(not isinstance(x, torch.Tensor) for x in (*t_leaves, *f_leaves)):
        return "the optimizer state holds a leaf that is not a tensor"
    by_param: dict[int, list[int]] = {}
    untagged_leaf = []
    for t, tag in enumerate(leaf_tags):
        (untagged_leaf.append(t) if tag is None else by_param.setdefault(tag, []).append(t))
    untagged_flat = [j for j, tag in enumerate(flat_tags) if tag is None]
    if len(untagged_flat) != len(untagged_leaf):
        return "the optimizer state's leaves made from no parameter differ between the per-leaf and flat layouts"
    flat_sources: list[tuple[Any, ...]] = [()] * len(f_leaves)
    leaf_sources: list[tuple[Any, ...]] = [()] * len(t_leaves)
    for j, t in zip(untagged_flat, untagged_leaf, strict=True):
        if f_leaves[j].shape != t_leaves[t].shape or f_leaves[j].dtype != t_leaves[t].dtype:
            return "a leaf of the optimizer state made from no parameter has another shape over the flat buffers"
        flat_sources[j], leaf_sources[t] = ("same", t), ("same", j)
    seen = dict.fromkeys(range(len(params)), 0)
    for n, g in enumerate(groups):
        made = [j for j, tag in enumerate(flat_tags) if tag == n]
        for j in made:
            k = made.index(j)
            members = {}
            for i in g.members:
                mine = by_param.get(i, [])
                if k >= len(mine):
                    return f"parameter {i} has fewer optimizer-state leaves than its flat buffer"
                members[i] = mine[k]
            kind = _kind(f_leaves[j], g, [t_leaves[t] for t in members.values()], [params[i] for i in members])
            if kind is None:
                return "an optimizer-state leaf made from a parameter is neither its shape nor empty"
            if kind == "empty":
                flat_sources[j] = ("same", members[g.members[0]])
                for t in members.values():
                    leaf_sources[t] = ("empty", j)
            else:
                ratio = kind
                shapes = [tuple(t_leaves[members[i]].shape) for i in g.members]
                flat_sources[j] = ("group", n, [members[i] for i in g.members], f_leaves[j].dtype, ratio, shapes)
                for i, t in members.items():
                    leaf_sources[t] = ("view", j, i, ratio, tuple(t_leaves[t].shape))
        for i in g.members:
            seen[i] = len(made)
    if any(len(by_param.get(i, [])) != seen[i] for i in seen):
        return "a parameter has more optimizer-state leaves than its flat buffer"
    return _StateMap(t_spec, f_spec, flat_sources, leaf_sources)


def _kind(flat: torch.Tensor, g: Group, leaves: list[torch.Tensor], params: list[torch.Tensor]) -> Any:
    """``"empty"`` (all empty), the ratio ``r`` (a :class:`fractions.Fraction`) where each leaf holds ``r`` elements
    per element of its parameter (1: its parameter's shape, as a moment; a block-quantized moment's codes 1 or
    1/2, its scales ``1 / block``), the flat leaf ``r`` per element of the buffer and each member's part at ``r``
    times its offset (whole elements), one dtype; or None."""
    if all(x.shape == (0,) for x in leaves) and flat.shape == (0,):
        return "empty"
    if any(x.dtype != flat.dtype for x in leaves):
        return None
    # The ratio from the first member that holds elements (an empty parameter's leaf, of its shape, says nothing);
    # every member empty: each leaf of its parameter's shape, as a moment, and the buffer's leaf empty too.
    sized = next((k for k, p in enumerate(params) if p.numel()), None)
    ratio = Fraction(1) if sized is None else Fraction(leaves[sized].numel(), params[sized].numel())
    total = g.numel * ratio
    if total.denominator != 1 or tuple(flat.shape) != (int(total),):
        return None
    for x, p, off in zip(leaves, params, g.offsets, strict=True):
        if x.numel() != p.numel() * ratio or (off * ratio).denominator != 1:
            return None
        if x.shape != p.shape and x.ndim != 1:  # a moment (the parameter's shape) or a 1-D part (codes, scales)
            return None
    return ratio
