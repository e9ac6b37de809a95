"""The flat update compiled once per kind of buffer (funcamp/train/_flat_regions.py).

The oracle is the same compiled donating step with the regions off (``MIN_REUSED`` out of reach): the update of
every buffer over all buffers at once, itself checked against the step kept leaf by leaf (tests/test_flat.py)
and against torch (tests/test_train.py). Bitwise, one thread (a parallel scatter-add in the embedding-free model
below is not used; the thread count keeps inductor's reductions in one order).
"""

from __future__ import annotations

import _passes_case
import pytest
import torch

import funcamp as fa
from funcamp import _scope, _tree, optim
from funcamp.train import _flat_regions


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x)).relu()


class _Model(torch.nn.Module):
    """Four alike blocks (each in buffers of its own: ``_flat._segments``), so buffers of one kind repeat."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(4))
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


torch.manual_seed(0)
_APPLY, _PARAMS = fa.nn.functionalize(_Model(), "float32")
_DECAY = {k: v.ndim >= 2 for k, v in _PARAMS.items()}


def _loss(params, batch):
    return torch.nn.functional.cross_entropy(_APPLY(params, batch[0]), batch[1])


def _optimizer():
    """The main job's: clip, AdamW on a warmup-cosine schedule, no decay on biases and norms."""
    return optim.chain(
        optim.clip_by_global_norm(0.5),
        optim.adamw(optim.warmup_cosine_decay(1e-2, warmup=2, total=20, end_value=1e-3), weight_decay=0.1, mask=_DECAY),
    )


def _batches():
    g = torch.Generator().manual_seed(1)
    out = [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(4)]
    out[2] = (torch.full((16, 8), float("nan")), out[2][1])  # skipped: the state kept, the counts not advanced
    return out


def _state(optimizer, reuse, monkeypatch):
    monkeypatch.setattr(_flat_regions, "MIN_REUSED", reuse)
    return fa.TrainState.create({k: v.clone() for k, v in _PARAMS.items()}, optimizer)


def _run(reuse, monkeypatch, backend, *, donate=True, telemetry=None):
    """Four steps (the third skipped) of the compiled step; the final state's leaves, the metrics, and how many
    steps ran the regions."""
    optimizer = _optimizer()
    state = _state(optimizer, reuse, monkeypatch)
    used = []
    real_run = _flat_regions.run

    def counted(*args, **kwargs):
        used.append(1)  # traced: Dynamo replays the append at every call of the compiled step
        return real_run(*args, **kwargs)

    monkeypatch.setattr(_flat_regions, "run", counted)
    torch._dynamo.reset()
    step = fa.make_train_step(_loss, optimizer, donate=donate, backend=backend, telemetry=telemetry)
    metrics = []
    for batch in _batches():
        before = None if donate else [x.clone() for x in _tree.tree_leaves(state)]
        new_state, out = step(state, batch)
        if before is not None:  # a step that does not donate leaves the given state as it was
            assert all(_same(a, b) for a, b in zip(before, _tree.tree_leaves(state), strict=True))
        state = new_state
        metrics.append({k: v.clone() for k, v in out.items() if isinstance(v, torch.Tensor)})
    leaves = [x.clone() for x in _tree.tree_leaves((state.params, state.opt_state))]
    return state, leaves, metrics, len(used)


def _same(a, b):
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("donate", [True, False], ids=["donating", "fresh"])
def test_the_regions_update_as_the_whole_update_does(monkeypatch, donate):
    """Inductor-compiled, donating or not, the regions (4 kinds for 10 buffers) leave every parameter, moment, count
    and metric as the update over all buffers at once does, compiled with ``aot_eager``, a skipped step included: each
    float leaf within 1e-5 of its largest magnitude (measured 4.1e-7: inductor's forward, backward and update
    round otherwise than eager kernels), integers and flags equal. Inductor's own whole update, bitwise the
    regions' when they came, is a second inductor compile (40 s of the suite); bit for bit, one buffer's update
    alone is the whole update's on every layout that gets regions: :func:`plan` checks it eagerly before it plans
    them. The test holds the hazard the module names: a region no graph output reads is dropped with its writes
    (planted: the new counts taken from the first region alone; every other buffer kept its old values). A step that
    does not donate has its regions write into new buffers, and the state it was given is left as it was after every
    call (planted: the fresh regions written into the given parameters -> the given state changed; the 0-d leaves
    not selected by commit -> the skipped step's counts advanced)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        state, got, got_m, used = _run(1, monkeypatch, "inductor", donate=donate)
        assert used == 4, "the regions were not used in every step"
        assert "compiled once per kind of buffer (4 kinds)" in state.storage.describe()
        _, ref, ref_m, unused = _run(10**9, monkeypatch, "aot_eager", donate=donate)
        assert unused == 0
    finally:
        torch.set_num_threads(threads)
    assert len(got) == len(ref)
    bad = [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if not _close(a, b)]
    assert not bad, f"state leaves {bad} differ"
    for step, (a, b) in enumerate(zip(got_m, ref_m, strict=True)):
        assert a.keys() == b.keys()
        assert all(_close(a[k], b[k]) for k in a), (step, [k for k in a if not _close(a[k], b[k])])
    assert [int(m["skipped_steps"]) for m in got_m] == [0, 0, 1, 1]


def _close(a, b):
    """Equal dtype and shape; integers and bools equal; floats within 1e-5 of ``b``'s largest magnitude, NaN where
    ``b`` has NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    if not torch.equal(a.isnan(), b.isnan()):
        return False
    a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    return bool((a - b).abs().max() <= 1e-5 * b.abs().max()) if b.numel() else True


def test_the_plan_says_where_the_update_may_write_in_place():
    """``StepPlan.direct_update``, which the regions require (they write the new state, selected, as they compute
    it, and return no updates): a step without telemetry (it reads the parameters and updates after the update);
    ``StepPlan.in_place``: a donating one of those (the regions write into the given state)."""
    optimizer = _optimizer()
    plans = {
        (donate, telemetry): (lambda plan: (plan.in_place, plan.direct_update))(
            fa.make_train_step(_loss, optimizer, donate=donate, telemetry=telemetry, backend="aot_eager").plan
        )
        for donate, telemetry in ((True, None), (False, None), (True, 1), (False, 1))
    }
    assert plans == {
        (True, None): (True, True),
        (False, None): (False, True),
        (True, 1): (False, False),
        (False, 1): (False, False),
    }


def _reason(optimizer):
    state = fa.TrainState.create({k: v.clone() for k, v in _PARAMS.items()}, optimizer)
    planned = state.storage.regions(optimizer)
    assert isinstance(planned, str), planned
    assert "compiled once per kind" not in state.storage.describe()
    return planned


def test_what_one_buffer_alone_cannot_compute_is_refused_on_the_host(monkeypatch):
    """Each refusal names its reason, and the update then runs over all buffers at once: too few alike buffers
    (the default rule here), a clip of what Adam made (a norm of updates, not of the gradients), a transformation
    whose 0-d state sums its updates (checked bit for bit on small buffers: it differs buffer by buffer).
    (``stochastic_rounding``, which reads element positions, keeps its state leaf by leaf before any of this.)"""
    monkeypatch.setattr(_flat_regions, "MIN_REUSED", 16)
    assert "< 16" in _reason(_optimizer())
    monkeypatch.setattr(_flat_regions, "MIN_REUSED", 1)
    late_clip = optim.chain(optim.scale_by_adam(), optim.clip_by_global_norm(0.5), optim.scale(-1e-3))
    assert "global norm of the updates" in _reason(late_clip)

    def init(params):
        return torch.zeros(())

    def update(updates, state, params=None):
        return updates, state + sum(u.sum() for u in updates.values())

    summing = optim.elementwise(optim.GradientTransformation(init, update))
    why = _reason(optim.chain(summing, optim.sgd(1e-2)))
    assert "differs" in why, why

    # a 0-d leaf that reduces the updates otherwise than their largest (all of them small: any buffer's, once each
    # region counts its own) agrees with the whole update on random buffers, not on a step's (found by a sweep:
    # parameters 0.22 apart; planted: the scaled-data check skipped -> granted)
    def all_small(updates, state, params=None):
        small = torch.stack([u.abs().max() < 0.3 for u in updates.values()]).all()
        return {k: u / (1.0 + state) for k, u in updates.items()}, state + small.float()

    counting = optim.elementwise(optim.GradientTransformation(init, all_small))
    why = _reason(optim.chain(counting, optim.sgd(1e-2)))
    assert "depends on the values of the updates" in why, why

    # a norm of the gradients and more (the parameters beside them): in a region it would be the gradients' alone
    # (planted: every gradient key present taken as the gradients -> granted)
    def superset(updates, state, params=None):
        tree, layout = {**updates, **{"p." + k: p for k, p in params.items()}}, _scope.current()
        t, s = _tree.scaled_global_norm(tree) if layout is None else layout.scaled_global_norm(tree)
        return {k: u / (1.0 + t / s) for k, u in updates.items()}, state

    wider = optim.elementwise(optim.GradientTransformation(lambda params: optim.EmptyState(), superset))
    why = _reason(optim.chain(wider, optim.sgd(1e-2)))
    assert "global norm of the updates" in why, why


def test_quantized_moments_get_regions(monkeypatch):
    """int8, int4 and float8 moments (buffers of at least 4,096 elements are quantized) get their regions. int8 and
    int4 dequantize through a map: made inside a region it was a constant torch 2.13's inductor left unset in the
    region's code ("non-tensor input": a sweep found the pure and the donating step crashing at their first call);
    kept on the buffers' device (``_moments.keep_maps``), it is an input of the region. Inductor-compiled, int8, a
    skipped step included: the pure and the donating step with regions leave every leaf bit for bit as the pure step
    without them (planted: the map made in the update again -> the crash). Planned under ``multi_transform`` too
    (planted: the one-buffer replay answering one value whatever the tree -> refused)."""
    monkeypatch.setattr(_flat_regions, "MIN_REUSED", 1)
    torch.manual_seed(0)
    apply, params = fa.nn.functionalize(_Wide(), "float32")
    for dtype in ("int8", "int4", torch.float8_e4m3fn):
        optimizer = optim.adamw(1e-2, moment_dtype=dtype)
        state = fa.TrainState.create({k: v.clone() for k, v in params.items()}, optimizer)
        planned = state.storage.regions(optimizer)
        assert isinstance(planned, _flat_regions.Regions), (dtype, planned)
        assert any(leaf.dtype == torch.uint8 for leaf in _tree.tree_leaves(state.opt_state)), dtype  # quantized
    # and under multi_transform, where a label's subtree holds no leaf of another label's buffer (a helper's sweep:
    # refused, "zip() argument 2 is longer than argument 1", the masks' replay giving a buffer's value to no leaf)
    labels = {k: "a" if k.endswith("weight") else "b" for k in params}  # the two blocks alike
    optimizer = optim.multi_transform(
        {"a": optim.adamw(1e-2, moment_dtype="int8"), "b": optim.adamw(1e-3, moment_dtype="int4")}, labels
    )
    state = fa.TrainState.create({k: v.clone() for k, v in params.items()}, optimizer)
    planned = state.storage.regions(optimizer)
    assert isinstance(planned, _flat_regions.Regions), planned

    def loss(p, batch):
        return torch.nn.functional.cross_entropy(apply(p, batch[0]), batch[1])

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=g), torch.randint(0, 256, (16,), generator=g)) for _ in range(3)]
    batches[1] = (torch.full((16, 8), float("nan")), batches[1][1])
    results = []
    for reuse, donate in ((1, False), (1, True), (10**9, False)):
        monkeypatch.setattr(_flat_regions, "MIN_REUSED", reuse)
        optimizer = optim.adamw(1e-2, moment_dtype="int8")
        state = fa.TrainState.create({k: v.clone() for k, v in params.items()}, optimizer)
        assert isinstance(state.storage.regions(optimizer), _flat_regions.Regions) == (reuse == 1)
        torch._dynamo.reset()
        step = fa.make_train_step(loss, optimizer, donate=donate)
        for batch in batches:
            state, _ = step(state, batch)
        results.append([x.clone() for x in _tree.tree_leaves((state.params, state.opt_state))])
    for leaves in results[:2]:
        assert all(_same(a, b) for a, b in zip(leaves, results[2], strict=True))


def test_a_map_kept_later_does_not_recompile_a_step(monkeypatch):
    """The quantization maps are a module-level table (``_moments._MAPS``) that a compiled int8 step reads: a map
    kept later for another device (another state, another process's layout loaded) leaves that step's guards alone
    (Dynamo guards the entry the step read, not the table's keys; planted: the step reading ``len(_MAPS)`` -> a
    second compile)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from funcamp.optim import _moments

    apply, params = fa.nn.functionalize(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)), "float32"
    )
    optimizer = optim.adamw(1e-2, moment_dtype="int8")
    state = fa.TrainState.create(params, optimizer)
    assert ("int8", True, "cpu") in _moments._MAPS
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    step = fa.make_train_step(lambda p, x: apply(p, x).square().mean(), optimizer, backend=counter)
    x = torch.randn(8, 64)
    state, _ = step(state, x)
    monkeypatch.setitem(_moments._MAPS, ("int8", True, "elsewhere"), torch.zeros(256))
    state, _ = step(state, x)
    assert counter.frame_count == 1


def test_another_layout_planned_later_does_not_recompile_a_step(monkeypatch):
    """Each kind is its region's own constant, reached from the layout the step traces: a second state planned with
    regions after a step compiled (a model built for evaluation, a second run in one process) leaves that step's
    guards alone (planted: the kinds in a module-level list indexed by the regions; the step compiled again)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    optimizer = _optimizer()
    state = _state(optimizer, 1, monkeypatch)
    torch._dynamo.reset()
    step = fa.make_train_step(_loss, optimizer, donate=True, backend=counter)
    batches = _batches()
    state, _ = step(state, batches[0])
    _state(_optimizer(), 1, monkeypatch)  # planned after the step compiled
    state, _ = step(state, batches[1])
    assert counter.frame_count == 1


def test_the_new_state_is_rebuilt_alike_by_the_traced_walk_and_by_optree(monkeypatch):
    """``run`` rebuilds the new optimizer state by the traced walk (plain containers, while a step is traced) or by
    optree (any other state): the same leaves in the same places either way (both eager here; planted: the traced
    walk's rebuild handed the leaves rotated by two places, and 22 leaves differ)."""
    optimizer = _optimizer()
    state = _state(optimizer, 1, monkeypatch)
    regions = state.storage.regions(optimizer)
    assert isinstance(regions, _flat_regions.Regions), regions
    flat_state, _ = state.storage.enter(state)
    g = torch.Generator().manual_seed(2)
    grads = {k: torch.randn(b.shape, generator=g) for k, b in flat_state.params.buffers.items()}
    t, s = torch.cat(list(grads.values())).square().sum().sqrt(), torch.ones(())

    def once():
        params = {k: v.clone() for k, v in flat_state.params.buffers.items()}
        opt_state = _tree.tree_map(torch.clone, flat_state.opt_state)
        _, new = _flat_regions.run(regions, grads, params, opt_state, torch.tensor(True), t, s)
        return _tree.tree_leaves((params, new))

    slow = once()
    monkeypatch.setattr(_tree._fast, "traced", lambda: True)
    fast = once()
    bad = [i for i, (a, b) in enumerate(zip(fast, slow, strict=True)) if not _same(a, b)]
    assert not bad, f"state leaves {bad} differ"


def test_a_region_is_traced_without_side_effects(monkeypatch):
    """The scopes the optimizer reads in a region (the kind's masks, the gradients' norm) are entered by the outer
    trace, around the calls: a scope entered inside a region is a side effect, for which Dynamo returns every
    intermediate of the region as an extra output (41 beside its 3 on 3 blocks of width 64; ~58 a call on GPT-2's body,
    each stamped out again at every reuse). Dynamo collects those outputs only for a region with side effects
    (planted: the replay entered inside the region; collected for both kinds)."""
    from torch._dynamo.variables import higher_order_ops

    collected = []
    real = higher_order_ops.collect_intermediate_outputs

    def collect(*args, **kwargs):
        collected.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(higher_order_ops, "collect_intermediate_outputs", collect)
    optimizer = _optimizer()
    state = _state(optimizer, 1, monkeypatch)
    torch._dynamo.reset()
    step = fa.make_train_step(_loss, optimizer, donate=True, backend="eager")
    step(state, _batches()[0])
    assert "compiled once per kind of buffer" in state.storage.describe()
    assert collected == []


class _Wide(torch.nn.Module):
    """Two alike blocks of width 256 and a 256-way head: every parameter whole rows of the norm (256 elements), so
    the gradient buffers hold no padding."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 256)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.Linear(256, 256)) for _ in range(2)
        )
        self.out = torch.nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x).relu()
        return self.out(x)


def test_unscaled_gradients_reach_the_regions_as_factors(monkeypatch):
    """A dynamic loss scale's step, bfloat16 compute, donating, with regions: each gradient buffer holds the
    gradients as the backward made them and is multiplied by the scale's reciprocal once (``flat_gradients``), and
    each region is handed the buffer and the reciprocal and multiplies as it reads (``region_casts``; the region's
    gradient is ``g * unit``, a 0-d one otherwise): no region is handed a product. Bitwise the same step with both
    passes off, a skipped step included. (Planted: the region's ``g * unit`` dropped -> no region is handed the
    factors.)"""
    graphs = _passes_case.passed_graphs(monkeypatch)
    monkeypatch.setattr(_flat_regions, "MIN_REUSED", 1)
    torch.manual_seed(0)
    apply, params = fa.nn.functionalize(_Wide(), "params=float32,compute=bfloat16,output=float32")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=g), torch.randint(0, 256, (16,), generator=g)) for _ in range(3)]
    batches[1] = (torch.full((16, 8), float("nan")), batches[1][1])

    def loss(p, batch):
        return torch.nn.functional.cross_entropy(apply(p, batch[0]), batch[1])

    runs = {}
    for name, off in (("on", None), ("off", "flat_gradients,region_casts")):
        with monkeypatch.context() as m:
            if off:
                m.setenv("FUNCAMP_PASSES_OFF", off)
            torch._dynamo.reset()
            decay = {k: v.ndim >= 2 for k, v in params.items()}
            optimizer = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2, weight_decay=0.1, mask=decay))
            state = fa.TrainState.create(
                {k: v.clone() for k, v in params.items()}, optimizer, loss_scale=fa.DynamicLossScale(2.0**15)
            )
            step = fa.make_train_step(loss, optimizer, donate=True)
            metrics = []
            for batch in batches:
                state, out = step(state, batch)
                metrics.append({k: v.clone() for k, v in out.items() if isinstance(v, torch.Tensor)})
        assert "compiled once per kind of buffer" in state.storage.describe()
        runs[name] = (
            [x.clone() for x in _tree.tree_leaves((state.params, state.opt_state, state.loss_scale))],
            metrics,
        )
        runs[name + "_graphs"] = list(graphs)
        graphs.clear()
    from funcamp.passes import region_casts

    nodes = [n for graph in runs["on_graphs"] for n in graph.nodes]
    calls = [region_casts._Call(n) for n in nodes if region_casts._Call.of(n) is not None]
    operands = [op for c in calls for op in map(c.operand, range(16)) if isinstance(op, torch.fx.Node)]
    products = [op for op in operands if region_casts._product(op, op.meta["val"], torch.float32) is not None]
    ones = [op for op in operands if region_casts._one(op, torch.float32)]
    assert calls and not products and not ones, (len(calls), len(products), len(ones))
    assert all(_same(a, b) for a, b in zip(*(runs[k][0] for k in ("on", "off")), strict=True))
    for a, b in zip(runs["on"][1], runs["off"][1], strict=True):
        assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a), [k for k in a if not _same(a[k], b[k])]
    assert [int(m["skipped_steps"]) for m in runs["on"][1]] == [0, 1, 1]


def test_the_zero_d_leaves_pack_into_bytes_and_back_bit_for_bit():
    """A region returns its new 0-d state leaves as one byte tensor (``_pack``; largest item size first, so each
    one's bytes start at a multiple of its size and view back): every dtype a 0-d leaf may have (counts, floating,
    float8), mixed, in any order, and values whose bits a cast would change (NaN, -0.0, the largest int64) come
    back bit for bit (planted: unpacked in the leaves' own order, not the packing's: the int64 read from the
    float32's bytes)."""
    like = [
        torch.tensor(float("nan"), dtype=torch.float32),
        torch.tensor(2**62 + 1, dtype=torch.int64),
        torch.tensor(-0.0, dtype=torch.bfloat16),
        torch.tensor(7, dtype=torch.int32),
        torch.tensor(1e-300, dtype=torch.float64),
        torch.tensor(0.5, dtype=torch.float8_e4m3fn),
        torch.tensor(float("-inf"), dtype=torch.float16),
    ]
    packed = _flat_regions._pack(like)
    assert packed.dtype == torch.uint8 and packed.shape == (sum(x.dtype.itemsize for x in like),)
    back = _flat_regions._unpack(packed, like)
    assert all(_same(a.reshape(1), b.reshape(1)) and b.ndim == 0 for a, b in zip(like, back, strict=True))


def test_each_region_call_has_one_output(monkeypatch):
    """Each region call hands the step one tensor (the packed 0-d leaves), however many 0-d leaves the optimizer
    state holds (here the clip's, AdamW's and the schedule's counts): inductor made a node of every output of every
    call and of every input of the ``cat`` that combined them (372 of GPT-2 124M's body's 1,381 scheduler nodes,
    now 62 for its 62 calls). Counted in Dynamo's graph (planted: the leaves returned one by one: 3 outputs)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    optimizer = _optimizer()
    state = _state(optimizer, 1, monkeypatch)
    torch._dynamo.reset()
    step = fa.make_train_step(_loss, optimizer, donate=True, backend=backend)
    step(state, _batches()[0])
    assert "compiled once per kind of buffer" in state.storage.describe()
    calls = [n for g in graphs for n in g.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) >= 4  # one a buffer of each kind at least
    outputs = {len({u.args[1] for u in n.users}) for n in calls}
    assert outputs == {1}, outputs
