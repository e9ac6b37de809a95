"""The flat optimizer update compiled once per kind of buffer (``torch.compiler.nested_compile_region``).

Inside a compiled step the optimizer runs once per flat buffer (:meth:`funcamp.train._flat.Flat.update`), and
inductor lowers and generates each buffer's update on its own, even where two buffers are alike: GPT-2 124M's
body holds 62 buffers of 6 kinds (12 blocks, each split alike), and its clip + AdamW update took some 20 s of the
first step's inductor time on a 2-core Xeon. Here the update of one buffer (the optimizer's ``update``, the
``apply_updates``, the select of a skipped step and the writes into the donated tensors) is a function of tensors
and constants only, marked as a nested compile region: Dynamo traces it once per *kind* (the buffer's size and
dtype, the values its masks give it, its optimizer-state leaves' sizes and dtypes) and stamps the traced region
out for every other buffer of that kind, and inductor compiles each kind's region once. A region's operands are
tensors in memory: a weight's gradient widened from the backward's bfloat16 would be written out in float32 for it,
so the ``region_casts`` graph pass (:mod:`funcamp.passes.region_casts`) hands the region the bfloat16 gradient and
the region widens it as it reads.

When it applies (decided on the host, once per optimizer, by :func:`plan`, and shown in the storage's line of
the step's plan): a compiled step whose body lets its optimizer stage write the new state as it computes it
(:func:`funcamp.train._donate.updates_in_place`: it reads neither the parameters nor the optimizer state nor the
updates after the update; ``make_train_step``'s body without telemetry; ``StepPlan.direct_update``), a
single-process layout, and a layout where at least :data:`MIN_REUSED` buffer updates are stamped out rather than
compiled. A donating step's regions write into the given buffers; a step that does not donate has each region
return new buffers (the given ones only read), already selected by the verdict, which ``commit`` keeps
(``FlatParams.committed``; GPT-2 124M's body, pure step: first step 0.77-0.79x the update over all buffers', the
steady step 1.01-1.03x). The optimizer must compute one
buffer's update alone exactly as over all buffers: this is checked on the host, eagerly, on small buffers of
each kind (:func:`plan` runs both and compares every result bit for bit); an optimizer that asks a global norm
of anything but the gradients (or of the gradients and more), reads element positions (``stochastic_rounding``),
or advances a 0-d state leaf from the updates' values (checked again on the data scaled by ``2**-20``, ``2**20`` and
``-1``: a leaf that agreed on the random buffers by chance differs there) is refused there, with the reason, and runs
over all buffers at once as before.

Three facts of torch 2.13 shape the code. A region is reused only when Dynamo need not re-check what it read;
funcamp's optimizer reads its masks and norms from dynamic scopes (module-level stacks), so each kind's region
names itself with ``reuse_hash_fn`` (a number unique to the kind: every tensor it is handed has the kind's sizes
and dtypes by construction; the kind is the region's closure, not an entry of a module-level table, which Dynamo
would guard on). A region must not enter those scopes itself: a push onto a stack made outside the region is a
side effect, for which Dynamo returns every intermediate of the region as an extra output and stamps them all
out at each reuse (~58 a call on GPT-2 124M's body); :func:`run` enters them around the calls, the kind's
masks around each call, the gradients' norm (:class:`_CallNorm`) around all. And inductor drops a region whose outputs
no graph output reads, with its writes into the donated tensors (measured: the writes of every region whose
output was unused were lost, silently): every region returns the new 0-d optimizer-state leaves (step counts,
rates), their bytes packed in one tensor, and the new leaves are read from the largest of the regions' bytes,
equal in every region (checked by :func:`plan`), so that every region feeds the new state.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

import torch

from funcamp import _scope, _tree
from funcamp.optim import _flat as _flat_opt
from funcamp.optim import _moments, apply_updates

__all__ = ["MIN_REUSED", "Regions", "plan", "run"]

#: Compile the update once per kind of buffer only where at least this many buffers' updates are stamped out
#: rather than compiled (buffers minus kinds). Measured on a 2-core Intel Xeon (AMX), torch 2.13.0+cpu, the main
#: job's clip + AdamW, donating: GPT-2 124M's body (62 buffers, 6 kinds, 56 stamped out) first step 98.6 and 99.7
#: s against 116.3 and 117.2 s (inductor 59-60 s against 84-89 s, Dynamo 22-26 s against 14-15 s); the main job's
#: GPT small (10 buffers, 4 kinds, 6 stamped out) 46.2-52.0 s against 40.9-46.6 s: each region call costs Dynamo
#: about 0.1 s and each kind's trace 1-2 s, which only many alike buffers repay.
MIN_REUSED = 16

#: The one buffer's key in the trees a region hands the optimizer.
_KEY = "buffer"


class _Kind(NamedTuple):
    """One kind of buffer: what a region of it rebuilds and runs (host-made constants)."""

    rebuild: Any  # ``rebuild(leaves)``: the one-buffer optimizer state of its leaves (``_tree.rebuilder``)
    tagged: tuple[int, ...]  # indices (in the one-buffer state's leaves) of the leaves made from the buffer
    zero_d: tuple[int, ...]  # indices of the others (step counts, rates), in order
    replay: Any  # :class:`_OneReplay`: each mask's value for this kind
    optimizer: Any


#: Each kind's reuse hash (``nested_compile_region(reuse_hash_fn=)``): unique in the process, host-made.
_HASHES = itertools.count()


class Regions(NamedTuple):
    """The plan of a layout's update under one optimizer: one region call per buffer, in group order."""

    # (the kind's region into the given tensors, its region returning new ones, its replay, the buffer's key, its flat
    # state-leaf indices in the kind's leaf order, those of the leaves it writes (the kind's tagged) in their order)
    calls: tuple[tuple[Any, Any, Any, str, tuple[int, ...], tuple[int, ...]], ...]
    zero_d: tuple[int, ...]  # flat state-leaf indices of the 0-d leaves, in the kinds' zero_d order
    kinds: int  # distinct kinds among the calls


class _OneReplay(_flat_opt.Replay):
    """The masks' values for one buffer, by the mask itself (``is``): Dynamo cannot trace ``id()`` of an object
    it reaches inside a region, which :class:`funcamp.optim._flat.Replay` looks masks up by."""

    def __init__(self, pairs: list[tuple[Any, Any]]) -> None:
        super().__init__({}, [spec for spec, _ in pairs])
        self.pairs = pairs

    def __call__(self, spec: Any, tree: Any) -> list[Any]:
        for known, value in self.pairs:
            if known is spec:
                # one value a leaf of ``tree``: the buffer's, or none where ``tree`` holds no leaf (the buffer left
                # out of a ``multi_transform`` label's subtree)
                return [value for _ in _tree.tree_leaves(tree)]
        raise RuntimeError(
            "funcamp: a mask or label tree that was not seen when the flat layout was built is read in a flat "
            "buffer's update; report this"
        )


class _GivenNorm:
    """The layout the optimizer sees in a region (and in :func:`_check`): the global norm of the gradients, computed
    before the regions over all buffers (``(t, s)``, :meth:`funcamp.train._flat._MemberNorms.scaled_global_norm`),
    for the tree of gradient buffers it was given; any other norm is refused (in a region it would be that buffer's
    alone), as are element offsets."""

    def __init__(self, t: torch.Tensor, s: torch.Tensor, grads: dict[str, torch.Tensor]) -> None:
        self._t, self._s, self._grads = t, s, grads

    def scaled_global_norm(self, tree: Any, fn: str = "global_norm") -> tuple[torch.Tensor, torch.Tensor]:
        grads = self._grads
        if tree is grads or (
            isinstance(tree, dict) and tree.keys() == grads.keys() and all(tree[k] is grads[k] for k in grads)
        ):
            return self._t, self._s
        raise _NotAlone(f"{fn}: a global norm of the updates a transformation made (not of the gradients)")

    def element_offsets(self) -> None:
        raise _NotAlone("element offsets (stochastic_rounding places each element in its whole tensor)")

    def finish_params(self, params: Any) -> Any:
        return params


class _NotAlone(Exception):
    """The optimizer asked a region for what one buffer alone cannot answer."""


def _buffer_update(
    k: _Kind,
    fresh: bool,
    g: torch.Tensor,
    unit: torch.Tensor,
    p: torch.Tensor,
    finite: torch.Tensor,
    t: torch.Tensor,
    s: torch.Tensor,
    *leaves: Any,
) -> Any:
    """One buffer's update: the optimizer over ``{buffer: g * unit}`` with the global gradient norm ``(t, s)``, each
    buffer's new value selected by the verdict (``where(finite, new, old)``). Donating, written into ``p`` and the
    optimizer-state ``leaves`` made from the buffer (``_Kind.tagged``); returns the new 0-d state leaves, their
    bytes in one tensor (:func:`_pack`), unselected (``commit`` selects them). ``fresh`` (a step that does not
    donate): nothing written; returns ``(bytes, new p, *new tagged leaves)``, new tensors.

    ``unit`` is a 0-d one of ``g``'s dtype (``g * unit`` is ``g``, bit for bit): the ``region_casts`` graph pass
    hands a region whose gradient is ``x * c`` (an unscaled gradient: the loss scale's reciprocal ``c``) ``x`` and
    ``c`` there instead, and the region multiplies as it reads, so that the product is never written out.

    Run within the kind's replay and a :class:`_CallNorm` of ``(t, s)``, entered by the caller (:func:`run`): a
    scope entered here would be a side effect of the region."""
    state = k.rebuild(leaves)  # a host-made skeleton: no walk traced (a tree_map here: 1,700 instructions a kind)
    updates, new_state = k.optimizer.update({_KEY: g * unit}, state, {_KEY: p})
    new_p = apply_updates({_KEY: p}, updates)
    new_leaves = _tree.tree_leaves(new_state)
    kept_p = torch.where(finite, new_p[_KEY], p)
    kept = [torch.where(finite, new_leaves[i], leaves[i]) for i in k.tagged]
    packed = _pack([new_leaves[i] for i in k.zero_d])
    if fresh:
        return (packed, kept_p, *kept)
    p.copy_(kept_p)
    for i, new in zip(k.tagged, kept, strict=True):
        leaves[i].copy_(new)
    return packed


def _pack(zero_d: list[torch.Tensor]) -> torch.Tensor:
    """The 0-d tensors ``zero_d`` as one 1-d uint8 tensor: each one's bytes, largest item size first (so that every
    one starts at a multiple of its own item size, and :func:`_unpack` can view it again), in that order.

    One output per region, not one per 0-d leaf: inductor makes a node of every output of every region call and of
    every input of the ``cat`` that combined each leaf's values over the calls (GPT-2 124M's body: 62 calls, three
    0-d leaves, 372 of its step graph's 1,381 scheduler nodes)."""
    return torch.cat([zero_d[i].reshape(1).view(torch.uint8) for i in _byte_order(zero_d)])


def _byte_order(tensors: list[torch.Tensor]) -> list[int]:
    """The indices of ``tensors`` in the order :func:`_pack` lays out their bytes and :func:`_unpack` reads them:
    largest item size first (stable among equal sizes)."""
    return sorted(range(len(tensors)), key=lambda i: -tensors[i].dtype.itemsize)


def _unpack(packed: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`_pack`'s inverse: the 0-d tensors of ``like``'s dtypes (in ``like``'s order) read from ``packed``."""
    out: list[Any] = [None] * len(like)
    at = 0
    for i in _byte_order(like):
        size = like[i].dtype.itemsize
        out[i] = packed[at : at + size].view(like[i].dtype).reshape(())
        at += size
    return out


def _update(replay: Any, optimizer: Any, grads: Any, state: Any, params: Any, layout: Any) -> tuple[Any, Any]:
    """The optimizer stage's pure update (``funcamp.train._stages.update`` without a donation) over buffers whose
    masks ``replay`` answers, within ``layout``: ``(new_params, new_state)``."""
    updates, new_state = _flat_opt.replaying(replay, _scope.within, layout, optimizer.update, grads, state, params)
    return apply_updates(params, updates), new_state


#: Dynamo keeps at most this many traced regions per function and compile (its default, 8, a layout's kinds may pass).
_MAX_KINDS = 1 << 12


def _region(kind: _Kind, fresh: bool) -> Any:
    """``kind``'s region: :func:`_buffer_update` of ``kind`` (into the given tensors, or ``fresh``: returning new
    ones), a nested compile region reused by a hash unique to it.

    The kind is a constant of the function (its closure), reached from the layout the step traces, not from a
    registry: a module-level table read while tracing is guarded, and a later layout that added to it would make
    every compiled step that read it compile again."""
    key = next(_HASHES)

    def update(*args: Any) -> Any:
        return _buffer_update(kind, fresh, *args)

    return torch.compiler.nested_compile_region(
        update, max_reuse_entries=_MAX_KINDS, reuse_hash_fn=lambda *args, **kwargs: key
    )


def run(
    regions: Regions,
    grads: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor],
    opt_state: Any,
    finite: torch.Tensor,
    t: torch.Tensor,
    s: torch.Tensor,
    *,
    fresh: bool = False,
) -> tuple[dict[str, torch.Tensor], Any]:
    """Inside the compiled step: every buffer's update by its kind's region; returns ``(params, opt_state)``, the
    new parameter buffers and optimizer state. Its buffers hold ``where(finite, new, old)`` (the step's commit has
    nothing left to select there); its 0-d leaves (counts, rates) are new, unselected.

    Donating (``fresh`` False), the regions write into the given ``params`` and ``opt_state`` buffers, which are
    returned. ``fresh`` (a step that does not donate): each region returns new buffers, the given ones only
    read."""
    # Plain containers by the traced walk: optree's flatten and rebuild, traced by Dynamo here, were 53,000 of the
    # GPT-2 body step's 241,000 bytecode instructions.
    fast = _tree.flatten_same(opt_state)
    if fast is None:
        leaves, spec = _tree.tree_flatten(opt_state)
        rebuild = lambda new: _tree.tree_unflatten(spec, new)  # noqa: E731
    else:
        (leaves,), rebuild = fast
    units = {g.dtype: torch.ones((), dtype=g.dtype, device=g.device) for g in grads.values()}
    outs = _scope.within(_CallNorm(t, s), _calls, regions.calls, grads, units, params, finite, t, s, leaves, fresh)
    new_params, new_leaves = dict(params), list(leaves)
    if fresh:
        for (_, _, _, key, _, written), out in zip(regions.calls, outs, strict=True):
            new_params[key] = out[1]
            for j, new in zip(written, out[2:], strict=True):
                new_leaves[j] = new
        outs = [out[0] for out in outs]
    # Every region's bytes are equal (plan() checked); their largest makes every region feed the new state. Their
    # stack's max: inductor hands the stack to aten.cat (no kernel of its own) and takes the max in one kernel, where
    # a chain of maximums took three on GPT-2 124M's body (the chain's last maximum fused into each 0-d leaf's read).
    packed = torch.stack(outs).amax(0)
    for j, new in zip(regions.zero_d, _unpack(packed, [leaves[j] for j in regions.zero_d]), strict=True):
        new_leaves[j] = new
    return new_params, rebuild(new_leaves)


def _calls(
    calls: Any, grads: Any, units: Any, params: Any, finite: Any, t: Any, s: Any, leaves: list[Any], fresh: bool
) -> list[Any]:
    """Every region call of ``calls``, each within its kind's replay (:func:`run`, within the norm)."""
    return [
        _flat_opt.replaying(
            replay,
            fresh_region if fresh else region,
            grads[key],
            units[grads[key].dtype],
            params[key],
            finite,
            t,
            s,
            *map(leaves.__getitem__, order),
        )
        for region, fresh_region, replay, key, order, _ in calls
    ]


class _CallNorm:
    """The layout the optimizer sees in a region of a compiled step: the gradients' global norm ``(t, s)`` for any
    tree, none of element offsets. Entered around the region calls, by the outer trace: it cannot tell the region's
    gradients from another tree, and does not need to; :func:`plan`'s eager check ran the optimizer over all buffers
    with :class:`_GivenNorm`, which answers only for the gradients, and refused an optimizer asking of another."""

    def __init__(self, t: torch.Tensor, s: torch.Tensor) -> None:
        self._t, self._s = t, s

    def scaled_global_norm(self, tree: Any, fn: str = "global_norm") -> tuple[torch.Tensor, torch.Tensor]:
        return self._t, self._s

    def element_offsets(self) -> None:
        raise _NotAlone("element offsets (stochastic_rounding places each element in its whole tensor)")


def plan(flat: Any, optimizer: Any, tagged_init: Any) -> Regions | str:
    """Host side: the regions of ``flat``'s update under ``optimizer``, or why the update runs over all buffers at
    once. Builds each kind's one-buffer state on shape-only tensors, then runs the optimizer eagerly on small
    buffers of every kind (random gradients, parameters and a state two updates in) both ways, over all buffers
    and buffer by buffer, and compares every result bit for bit."""
    groups = flat.groups
    keys = [_kind_key(flat, n) for n in range(len(groups))]
    reused = len(groups) - len(set(keys))
    if reused < MIN_REUSED:
        return f"{reused} alike buffer updates to reuse < {MIN_REUSED}"
    if not flat.state_map.flat_sources:
        return "the optimizer holds no state"
    untagged = tuple(j for j, src in enumerate(flat.state_map.flat_sources) if src[0] != "group")
    if not untagged:
        return "the optimizer state holds no 0-d leaf (a step count) for every region to feed"
    kinds: dict[Any, tuple[_Kind, Any, Any]] = {}  # kind key -> (kind, its regions: in place, fresh)
    calls = []
    for n, (g, key) in enumerate(zip(groups, keys, strict=True)):
        if key not in kinds:
            kind = _make_kind(flat, n, optimizer, tagged_init)
            if isinstance(kind, str):
                return kind
            if len(kind.zero_d) != len(untagged):
                return "the optimizer state of one buffer holds other 0-d leaves than over all buffers"
            kinds[key] = (kind, _region(kind, False), _region(kind, True))
        k, region, fresh_region = kinds[key]
        mine = [j for j, src in enumerate(flat.state_map.flat_sources) if src[0] == "group" and src[1] == n]
        if len(mine) != len(k.tagged):
            return "a buffer's optimizer state holds other leaves alone than over all buffers"
        order: list[int] = [0] * (len(k.tagged) + len(k.zero_d))
        for i, j in zip(k.tagged, mine, strict=True):
            order[i] = j
        for i, j in zip(k.zero_d, untagged, strict=True):
            order[i] = j
        calls.append((region, fresh_region, k.replay, g.key, tuple(order), tuple(order[i] for i in k.tagged)))
    if len(kinds) > _MAX_KINDS:
        return f"{len(kinds)} kinds of buffer > {_MAX_KINDS}"
    regions = Regions(tuple(calls), untagged, len(kinds))
    why = _check(flat, optimizer, regions)
    return why if why is not None else regions


def _kind_key(flat: Any, n: int) -> tuple[Any, ...]:
    """What makes two buffers' updates one region: size, dtype, device, mask values, state leaves' sizes and dtypes."""
    g = flat.groups[n]
    values = tuple(flat.replay.values[id(spec)].get(g.key) for spec in flat.replay.specs)
    state = tuple((src[3], src[4]) for src in flat.state_map.flat_sources if src[0] == "group" and src[1] == n)
    return (g.numel, g.dtype, g.device, tuple(map(repr, values)), state)


def _make_kind(flat: Any, n: int, optimizer: Any, tagged_init: Any) -> _Kind | str:
    g = flat.groups[n]
    pairs = [(spec, flat.replay.values[id(spec)].get(g.key)) for spec in flat.replay.specs]
    replay = _OneReplay(pairs)
    meta = {_KEY: torch.empty(g.numel, dtype=g.dtype, device="meta")}
    try:
        state, tags = tagged_init(optimizer.init, meta, replay, None)
    except Exception as e:  # noqa: BLE001 (an optimizer that cannot init one buffer alone runs over all at once)
        return f"the optimizer does not initialize one buffer alone ({type(e).__name__}: {e})"
    leaves = _tree.tree_leaves(state)
    tagged = tuple(i for i, tag in enumerate(tags) if tag is not None)
    zero_d = tuple(i for i, tag in enumerate(tags) if tag is None)
    if any(leaves[i].dtype in _QUANTIZED for i in tagged):
        # int8 / int4 moments dequantize through a map: one made inside a region would be a constant torch 2.13's
        # inductor leaves unset in the region's code ("non-tensor input"); kept on the buffers' device, it is an
        # input of the region (float8 moments, stored as bytes too, hold no map: nothing to keep). The moments'
        # zeros kept them where init ran in this process; a state unpickled here ran none.
        _moments.keep_maps(g.device)
    if any(leaves[i].ndim != 0 for i in zero_d):
        return "an optimizer-state leaf made from no buffer is not 0-d"
    if any(not (leaves[i].dtype.is_floating_point or leaves[i].dtype in _COUNTS) for i in zero_d):
        return "a 0-d optimizer-state leaf is neither a count nor floating"
    return _Kind(_tree.rebuilder(state), tagged, zero_d, replay, optimizer)


_COUNTS = (torch.int32, torch.int64)
_QUANTIZED = (torch.uint8, torch.int8)


def _check(flat: Any, optimizer: Any, regions: Regions) -> str | None:
    """Run the optimizer eagerly on small buffers of every kind, over all buffers at once (as the flat update does)
    and buffer by buffer (as the regions do: into the given buffers, and into fresh ones), two updates each; the
    reason if any result differs in a bit."""
    gen = torch.Generator().manual_seed(0)
    sizes = {g.key: math.gcd(g.numel, 4096) for g in flat.groups}  # whole rows and moment blocks (powers of two)

    def rand(key: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(sizes[key], generator=gen, dtype=torch.float32).to(dtype)

    params = {g.key: rand(g.key, g.dtype) for g in flat.groups}
    grad_steps = [{g.key: rand(g.key, g.dtype) for g in flat.groups} for _ in range(2)]
    t, s = torch.tensor(3.0), torch.tensor(1.0)
    finite = torch.tensor(True)
    try:
        whole_state = _flat_opt.replaying(flat.replay, optimizer.init, params)
    except Exception as e:  # noqa: BLE001
        return f"the optimizer does not initialize small buffers ({type(e).__name__}: {e})"
    whole_params = params
    parts_params = {k: v.clone() for k, v in params.items()}
    parts_state, first_state = _cloned(whole_state), whole_state  # the update over all buffers is pure
    fresh_params, fresh_state = params, whole_state  # only read by the fresh regions
    try:
        for grads in grad_steps:
            whole_params, whole_state = _update(
                flat.replay, optimizer, grads, whole_state, whole_params, _GivenNorm(t, s, grads)
            )
            if grads is grad_steps[0]:
                first_zero_d = _zero_d(whole_state, regions)
            _, parts_state = run(regions, grads, parts_params, parts_state, finite, t, s)
            fresh_params, fresh_state = run(regions, grads, fresh_params, fresh_state, finite, t, s, fresh=True)
    except _NotAlone as e:
        return f"the optimizer asks one buffer's update for {e}"
    except Exception as e:  # noqa: BLE001
        return f"the optimizer does not run buffer by buffer ({type(e).__name__}: {e})"
    same = all(
        torch.equal(whole_params[k], parts[k]) for parts in (parts_params, fresh_params) for k in params
    ) and all(
        a.dtype == b.dtype and torch.equal(a, b)
        for parts in (parts_state, fresh_state)
        for a, b in zip(_tree.tree_leaves(whole_state), _tree.tree_leaves(parts), strict=True)
    )
    if not same:
        return "one buffer's update alone differs from it over all buffers (checked on small buffers)"
    return _zero_d_of_norm_only(flat, optimizer, regions, params, grad_steps[0], first_state, first_zero_d, t, s)


def _cloned(tree: Any) -> Any:
    """``tree`` with each tensor leaf a copy."""
    return _tree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _zero_d(state: Any, regions: Regions) -> list[torch.Tensor]:
    """The 0-d leaves of an optimizer state over all buffers, in :attr:`Regions.zero_d`'s order."""
    leaves = _tree.tree_leaves(state)
    return [leaves[j] for j in regions.zero_d]


def _times(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x * scale`` in ``x``'s dtype (exact for a power of two or -1 in range; float8, which has no product of its
    own, through float32)."""
    return x * scale if x.dtype.itemsize > 1 else (x.float() * scale).to(x.dtype)


def _zero_d_of_norm_only(
    flat: Any, optimizer: Any, regions: Regions, params: Any, grads: Any, state: Any, ref: list[Any], t: Any, s: Any
) -> str | None:
    """Why the new 0-d state leaves are not functions of the old state and the gradients' norm alone, or None.

    Each region computes them from its own buffer, and :func:`run` keeps their largest; that equals the update over
    all buffers only when no buffer's values move them (a step count, a schedule, a norm's moving average), and a
    leaf that reduces the updates otherwise (a count of the steps whose updates are all small: any buffer's
    instead of all of them) can agree with it on :func:`_check`'s data and not on a step's. So one update is run
    over all buffers on the same state with the gradients and parameters scaled by ``2**-20``, ``2**20`` and
    ``-1``, the norm ``(t, s)`` kept: its new 0-d leaves must be ``ref``, those of the unscaled data, bit for bit."""

    def zero_d(scale: float) -> list[torch.Tensor]:
        g = {k: _times(v, scale) for k, v in grads.items()}
        p = {k: _times(v, scale) for k, v in params.items()}
        _, new_state = _update(flat.replay, optimizer, g, _cloned(state), p, _GivenNorm(t, s, g))
        return _zero_d(new_state, regions)

    try:
        for scale in (2.0**-20, 2.0**20, -1.0):
            if not all(torch.equal(a, b) for a, b in zip(ref, zero_d(scale), strict=True)):
                return "a 0-d optimizer-state leaf depends on the values of the updates, not on the norm alone"
    except Exception as e:  # noqa: BLE001
        return f"the optimizer does not run on scaled small buffers ({type(e).__name__}: {e})"
    return None
