"""Flat buffers: the compiled step's parameters and optimizer state as one contiguous buffer per group.

Inductor lowers a tensor operation once per tensor, and on the CPU it has no grouped lowering for lists of
tensors, so an optimizer written leaf by leaf costs compile time in proportion to the number of parameter
tensors (about half the first compile of the main job's step). The compiled step therefore runs the optimizer
over *flat buffers*: the parameters, and every optimizer-state tree shaped like them (Adam's moments, a
momentum trace, Kahan compensations), each concatenated into one 1-D buffer per group. A group is the
parameters of one device and dtype to which every mask and label of the optimizer gives the same values
(:mod:`funcamp.optim._flat`): the main job's AdamW with no decay on the norms has two. Inside the step the
gradients are concatenated once per group, the update (clip, AdamW, decay mask, schedule), the select that keeps
a skipped step's state and the donation's writes run once per buffer, and the forward reads each parameter as a
view of its buffer. Elementwise results are bitwise those of the leaf-by-leaf update; a global norm is summed in
another order (within float32 round-off of the float64 norm).

What users see stays per leaf: between steps ``state.params`` and ``state.opt_state`` have their usual trees,
names and shapes, and their tensors are views into the buffers (:meth:`FlatLayout.unpack`); at each call the step
takes the buffers back from the views without a copy (:meth:`FlatLayout.pack`), or, for a state whose tensors are
not laid out so (the first call, a state built or loaded elsewhere), copies them in once. Checkpoints, ``load_into``
and ``nonfinite_leaf_name`` read the per-leaf trees as before.

Which steps run flat is decided once, at a step's first call (:func:`layout_for`): compiled steps whose optimizer
is made of funcamp's transformations only (:func:`funcamp.optim._flat.runs_flat`) and whose parameters are plain
dense floating tensors, in one process or data parallel; a sharded step, a step with telemetry (which reads
every leaf's update) and an eager step run leaf by leaf.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from funcamp import _tree
from funcamp.optim import GradientTransformation
from funcamp.optim import _flat as _flat_opt

__all__ = ["FlatLayout", "FlatParams", "layout_for", "of"]

#: Every leaf starts at a multiple of this many bytes of its buffer (a cache line; 16-byte vector loads on GPUs).
ALIGN_BYTES = 64
_ABSENT = object()  # the value of a mask a leaf was never given (it sits outside that mask's subtree)


class Group(NamedTuple):
    """One flat buffer: the parameters (leaf indices, in leaf order) it holds and where each starts."""

    key: str  # the buffer's key in the flat trees: "flat0000", "flat0001", ... (sorted as the groups)
    device: torch.device
    dtype: torch.dtype
    members: tuple[int, ...]  # parameter leaf indices
    offsets: tuple[int, ...]  # each member's first element in the buffer (aligned to ALIGN_BYTES)
    numel: int  # the buffer's length, padding included

    def pieces(self, numels: list[int]) -> list[int]:
        """The lengths ``torch.split`` cuts the buffer into: each member, then the padding before the next."""
        sizes, at = [], 0
        for i, off in zip(self.members, self.offsets, strict=True):
            if off > at:
                sizes.append(off - at)
            sizes.append(numels[i])
            at = off + numels[i]
        if self.numel > at:
            sizes.append(self.numel - at)
        return sizes


@_tree.dataclass
class FlatParams:
    """The parameters inside a flat compiled step: ``buffers`` (``{group key: 1-D tensor}``) and their layout."""

    buffers: dict[str, torch.Tensor]
    layout: FlatLayout = _tree.field(pytree_node=False)


def of(params: Any) -> FlatLayout | None:
    """The layout of ``params`` if they are flat (:class:`FlatParams`), else None."""
    return params.layout if isinstance(params, FlatParams) else None


class _StateMap(NamedTuple):
    """How the per-leaf optimizer state and the flat one correspond, leaf by leaf.

    ``flat_sources[j]`` makes flat leaf ``j``: ``("same", t)`` (per-leaf leaf ``t``, a count or rate),
    ``("group", g, ts, dtype)`` (group ``g``'s buffer of ``dtype`` from per-leaf leaves ``ts``, one per member) or
    ``("empty", t)``
    (a group's empty placeholder, as ``kahan_summation`` keeps for float32 parameters).
    ``leaf_sources[t]`` makes per-leaf leaf ``t``: ``("same", j)``, ``("view", j, i)`` (parameter ``i``'s
    view of flat leaf ``j``) or ``("empty", j)``.
    """

    leaf_spec: Any
    flat_spec: Any
    flat_sources: list[tuple[Any, ...]]
    leaf_sources: list[tuple[Any, ...]]


class FlatLayout:
    """The flat layout of one step's parameters and optimizer state (built by :func:`layout_for`).

    Host side, at each call of the compiled step: :meth:`pack` (per-leaf state -> flat, no copy when the
    tensors are views of the buffers), :meth:`unpack` (flat -> per-leaf views), :meth:`adopt` (after a
    donating call that copied, the given state's tensors become views of the buffers). Inside the step:
    :meth:`tree` (the parameters' per-leaf views), :meth:`update` (the optimizer over the buffers).
    """

    def __init__(
        self,
        params: Any,
        groups: list[Group],
        replay: _flat_opt.Replay,
        state_map: _StateMap,
    ) -> None:
        leaves = _tree.tree_leaves(params)
        self.params_spec = _tree.tree_structure(params)
        self.shapes = [tuple(x.shape) for x in leaves]
        self.numels = [x.numel() for x in leaves]
        self.groups = groups
        self.replay = replay
        self.state_map = state_map
        self._rebuild = _tree.rebuilder(params)
        self._group_of = {i: (g, j) for g in groups for j, i in enumerate(g.members)}

    def __repr__(self) -> str:
        sizes = ", ".join(f"{g.dtype} x {len(g.members)} ({g.numel})" for g in self.groups)
        return f"FlatLayout({len(self.shapes)} parameters in {len(self.groups)} buffers: {sizes})"

    # --- inside the step ---------------------------------------------------------------------------------

    def tree(self, flat: FlatParams) -> Any:
        """The parameters' tree, each leaf a view of its buffer (traced: one split per buffer, a view per leaf)."""
        leaves: list[Any] = [None] * len(self.shapes)
        for g in self.groups:
            pieces = torch.split(flat.buffers[g.key], g.pieces(self.numels))
            at = iter(pieces)
            cursor = 0
            for i, off in zip(g.members, g.offsets, strict=True):
                if off > cursor:
                    next(at)  # the padding before this member
                leaves[i] = next(at).view(self.shapes[i])
                cursor = off + self.numels[i]
        return self._rebuild(leaves)

    def flat(self, tree: Any) -> dict[str, torch.Tensor]:
        """``{group key: buffer}`` of a tree shaped like the parameters (the gradients): one ``cat`` per group,
        zeros in the padding."""
        leaves = _tree.tree_leaves(tree)
        out = {}
        for g in self.groups:
            parts, cursor = [], 0
            for i, off in zip(g.members, g.offsets, strict=True):
                x = leaves[i]
                if off > cursor:
                    parts.append(x.new_zeros(off - cursor))
                parts.append(x.reshape(-1))
                cursor = off + self.numels[i]
            if g.numel > cursor:
                parts.append(leaves[g.members[-1]].new_zeros(g.numel - cursor))
            out[g.key] = torch.cat(parts) if len(parts) > 1 else parts[0]
        return out

    def update(self, stage: Any, optimizer: GradientTransformation, grads: Any, opt_state: Any, params: FlatParams,
               layout: Any) -> tuple[FlatParams, Any]:
        """``stage`` (:func:`funcamp.train.update`) over the buffers: the gradients concatenated, the masks and
        labels giving each buffer its leaves' values. Returns the new flat parameters and the new flat state."""
        new, new_state = _flat_opt.replaying(
            self.replay, stage, optimizer, self.flat(grads), opt_state, params.buffers, layout
        )
        return FlatParams(new, self), new_state

    # --- on the host, around each call -------------------------------------------------------------------

    def pack(self, state: Any) -> tuple[Any, bool] | None:
        """``(flat_state, copied)``: ``state`` with flat parameters and optimizer state, or None when its
        parameters or optimizer state are not of this layout's structure, shapes, dtypes and devices (the step
        then runs that call leaf by leaf). ``copied``: some buffer was made by copying (the tensors were not
        views of one buffer at the layout's offsets)."""
        p_leaves, p_spec = _tree.tree_flatten(state.params)
        s_leaves, s_spec = _tree.tree_flatten(state.opt_state)
        if p_spec != self.params_spec or s_spec != self.state_map.leaf_spec:
            return None
        if any(not isinstance(x, torch.Tensor) or tuple(x.shape) != s for x, s in zip(p_leaves, self.shapes)):
            return None
        made = [self._buffer(g, [p_leaves[i] for i in g.members], g.dtype) for g in self.groups]
        flat_leaves = []
        for source in self.state_map.flat_sources:
            if source[0] == "group":
                base = self._buffer(self.groups[source[1]], [s_leaves[t] for t in source[2]], source[3])
                made.append(base)
                flat_leaves.append(None if base is None else base[0])
            else:
                flat_leaves.append(s_leaves[source[1]])
        if any(m is None for m in made):
            return None
        copied = any(c for _, c in made)
        buffers = {g.key: base for g, (base, _) in zip(self.groups, made)}
        opt_state = _tree.tree_unflatten(self.state_map.flat_spec, flat_leaves)
        return dataclasses.replace(state, params=FlatParams(buffers, self), opt_state=opt_state), copied

    def _buffer(self, g: Group, tensors: list[Any], dtype: torch.dtype) -> tuple[torch.Tensor, bool] | None:
        """``(buffer, copied)`` of group ``g`` whose members are ``tensors`` (of ``dtype``): their own storage when
        they are views of one buffer at the layout's offsets, else a new buffer they are copied into (zeros in the
        padding); None when a tensor is not of ``dtype`` on the group's device."""
        if any(not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device != g.device for t in tensors):
            return None
        storage = tensors[0].untyped_storage()
        if storage.nbytes() == g.numel * dtype.itemsize and all(
            t.is_contiguous() and t.storage_offset() == off and t.untyped_storage()._cdata == storage._cdata
            for t, off in zip(tensors, g.offsets, strict=True)
        ):
            return torch.empty(0, dtype=dtype, device=g.device).set_(storage, 0, (g.numel,), (1,)), False
        base = torch.zeros(g.numel, dtype=dtype, device=g.device)
        with torch.no_grad():
            for t, i, off in zip(tensors, g.members, g.offsets, strict=True):
                base.narrow(0, off, self.numels[i]).copy_(t.reshape(-1))
        return base, True

    def unpack(self, flat_state: Any) -> Any:
        """``flat_state`` with per-leaf parameters and optimizer state, each tensor a view of its buffer."""
        flat_leaves = _tree.tree_leaves(flat_state.opt_state)
        leaves = [self._leaf(source, flat_leaves) for source in self.state_map.leaf_sources]
        opt_state = _tree.tree_unflatten(self.state_map.leaf_spec, leaves)
        buffers = flat_state.params.buffers
        params = [None] * len(self.shapes)
        for g in self.groups:
            for i, off in zip(g.members, g.offsets, strict=True):
                params[i] = buffers[g.key].narrow(0, off, self.numels[i]).view(self.shapes[i])
        return dataclasses.replace(flat_state, params=_tree.tree_unflatten(self.params_spec, params), opt_state=opt_state)

    def _leaf(self, source: tuple[Any, ...], flat_leaves: list[Any]) -> Any:
        if source[0] != "view":
            return flat_leaves[source[1]]
        _, j, i = source
        g, k = self._group_of[i]
        return flat_leaves[j].narrow(0, g.offsets[k], self.numels[i]).view(self.shapes[i])

    def adopt(self, state: Any, flat_state: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Before a donating call on ``flat_state`` (made from ``state`` by copying): every tensor of ``state``'s
        parameters and optimizer state becomes the view of its buffer (``Tensor.set_``), so that the caller's
        tensors hold the values the call writes, the next call takes the buffers without a copy, and a tensor
        that the user's code reads from outside the state (a closure) is seen by the trace as the view of the
        buffer it is. Returns the pairs ``(tensor, view)`` of the tensors that cannot be re-pointed (views of
        other tensors, subclasses): the caller copies each view into its tensor after the call."""
        views = self.unpack(flat_state)
        pairs = zip(
            _tree.tree_leaves((state.params, state.opt_state)), _tree.tree_leaves((views.params, views.opt_state))
        )
        later = []
        with torch.no_grad():
            for old, new in pairs:
                if old is new or not isinstance(old, torch.Tensor):
                    continue
                if old._is_view() or type(old) is not torch.Tensor:
                    later.append((old, new))
                else:
                    old.set_(new.untyped_storage(), new.storage_offset(), new.shape, new.stride())
        return later


def _aligned(offset: int, itemsize: int) -> int:
    step = max(1, ALIGN_BYTES // itemsize)
    return -(-offset // step) * step


def _plain(x: Any) -> bool:
    """A tensor the flat layout can hold: dense, strided, floating, of torch's own tensor type."""
    return (
        type(x) in (torch.Tensor, torch.nn.Parameter)
        and x.layout == torch.strided
        and x.is_floating_point()
        and not x.is_nested
    )


def _meta(tree: Any) -> Any:
    return _tree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta"), tree)


def layout_for(params: Any, optimizer: GradientTransformation) -> FlatLayout | None:
    """The flat layout of ``params`` under ``optimizer``, or None when they must run leaf by leaf.

    None when the optimizer holds a transformation that is not funcamp's (not marked elementwise), a
    parameter is not a plain dense floating tensor, the optimizer's masks depend on more than the leaves
    (a spec gave one leaf two values), or its state does not correspond leaf for leaf between the two
    layouts. Runs the optimizer's ``init`` and ``update`` on shape-only (meta) tensors, twice: per leaf,
    recording the masks' values, and over the buffers, checking the result.
    """
    if not _flat_opt.runs_flat(optimizer):
        return None
    paths, leaves, _ = _tree.tree_flatten_with_path(params)
    if not leaves or not all(_plain(x) for x in leaves):
        return None
    names = [".".join(str(k) for k in p) for p in paths]
    record = _flat_opt.Recording()
    meta = _meta(params)
    try:
        leaf_state = _flat_opt.recording(record, optimizer.init, meta)
        _flat_opt.recording(record, optimizer.update, _meta(params), leaf_state, meta)
    except Exception:  # noqa: BLE001 (an optimizer that cannot run on meta tensors runs leaf by leaf)
        return None
    if not record.consistent:
        return None
    groups = _groups(leaves, names, record)
    replay = _flat_opt.Replay(
        {
            id(spec): {g.key: record.values[id(spec)].get(names[g.members[0]]) for g in groups
                       if names[g.members[0]] in record.values[id(spec)]}
            for spec in record.specs
        }
    )
    flat_meta = {g.key: torch.empty(g.numel, dtype=g.dtype, device="meta") for g in groups}
    try:
        flat_state = _flat_opt.replaying(replay, optimizer.init, flat_meta)
        _flat_opt.replaying(replay, optimizer.update, _meta(flat_meta), flat_state, flat_meta)
    except Exception:  # noqa: BLE001
        return None
    state_map = _state_map(leaf_state, flat_state, paths, leaves, groups)
    return None if state_map is None else FlatLayout(params, groups, replay, state_map)


def _groups(leaves: list[torch.Tensor], names: list[str], record: _flat_opt.Recording) -> list[Group]:
    """The parameters grouped by device, dtype and the values every mask gave them, in leaf order."""
    keyed: dict[Any, list[int]] = {}
    for i, (x, name) in enumerate(zip(leaves, names, strict=True)):
        values = tuple(record.values[id(spec)].get(name, _ABSENT) for spec in record.specs)
        keyed.setdefault((x.device, x.dtype, values), []).append(i)
    groups = []
    for n, ((device, dtype, _), members) in enumerate(keyed.items()):
        offsets, at = [], 0
        for i in members:
            at = _aligned(at, dtype.itemsize)
            offsets.append(at)
            at += leaves[i].numel()
        groups.append(Group(f"flat{n:04d}", device, dtype, tuple(members), tuple(offsets), at))
    return groups


def _state_map(
    leaf_state: Any, flat_state: Any, param_paths: list[tuple[Any, ...]], params: list[torch.Tensor],
    groups: list[Group],
) -> _StateMap | None:
    """The leaf-for-leaf correspondence of the two optimizer states (meta), or None where there is none."""
    t_paths, t_leaves, t_spec = _tree.tree_flatten_with_path(leaf_state)
    f_paths, f_leaves, f_spec = _tree.tree_flatten_with_path(flat_state)
    index = {tuple(p): i for i, p in enumerate(param_paths)}
    lengths = sorted({len(p) for p in param_paths}, reverse=True)
    group_of = {i: n for n, g in enumerate(groups) for i in g.members}
    expected: dict[tuple[Any, ...], Any] = {}
    for t, (path, leaf) in enumerate(zip(t_paths, t_leaves, strict=True)):
        if not isinstance(leaf, torch.Tensor):
            return None
        hit = next(((path[:-k], index[path[-k:]]) for k in lengths if len(path) >= k and path[-k:] in index), None)
        if hit is None or (leaf.shape != params[hit[1]].shape and leaf.shape != (0,)):
            if path in expected:
                return None
            expected[path] = ("same", t)
            continue
        prefix, i = hit
        n = group_of[i]
        key = (*prefix, groups[n].key)
        kind = "group" if leaf.shape == params[i].shape else "empty"
        entry = expected.setdefault(key, [kind, n, {}])
        if entry[0] != kind:
            return None
        entry[2][i] = t
    flat_sources: list[tuple[Any, ...]] = []
    leaf_sources: list[Any] = [None] * len(t_leaves)
    for j, (path, leaf) in enumerate(zip(f_paths, f_leaves, strict=True)):
        entry = expected.pop(path, None)
        if entry is None:
            return None
        if entry[0] == "same":
            t = entry[1]
            if t_leaves[t].shape != leaf.shape or t_leaves[t].dtype != leaf.dtype:
                return None
            flat_sources.append(("same", t))
            leaf_sources[t] = ("same", j)
            continue
        kind, n, by_member = entry
        g = groups[n]
        if set(by_member) != set(g.members) or any(t_leaves[t].dtype != leaf.dtype for t in by_member.values()):
            return None
        if kind == "empty":
            if leaf.shape != (0,):
                return None
            flat_sources.append(("same", by_member[g.members[0]]))
            for t in by_member.values():
                leaf_sources[t] = ("empty", j)
            continue
        if leaf.shape != (g.numel,):
            return None
        flat_sources.append(("group", n, [by_member[i] for i in g.members], leaf.dtype))
        for i, t in by_member.items():
            leaf_sources[t] = ("view", j, i)
    if expected:
        return None
    return _StateMap(t_spec, f_spec, flat_sources, leaf_sources)
