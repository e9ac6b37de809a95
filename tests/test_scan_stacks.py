"""``TrainState.create(..., scan=apply_fn.scan)``: a scanned run laid out name-major, its stacks read and its
stacked gradients written whole.

The layout: each parameter name's layers end to end in one buffer, equally spaced, in layer order; the rest as
before; a run whose layers the optimizer's masks tell apart stays per layer and the plan says why. The passes:
``scan_stacks`` (the forward's stack of a name's layers, one strided view of its buffer) and ``flat_gradients``'
stacked parts (the backward's stacked gradient written into its buffer once), each on hand-made graphs, with
their negatives. The compiled step (inductor, where the passes run) with the run name-major: every parameter,
optimizer-state leaf and metric bitwise the per-layer layout's, undonated and donated, through a skipped step,
and both passes fired.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import funcamp as fa
from funcamp import _tree, optim
from funcamp.passes import flat_gradients, scan_stacks
from funcamp.passes.tags import _FLAT_GRADS

POLICY = "params=float32,compute=bfloat16,output=float32"
_convert = torch.ops.prims.convert_element_type  # a cast as the post-grad graph holds it (not ``_to_copy``)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(24)  # 24 elements: padded to a row of 256, so the layers are spaced by 256
        self.up = nn.Linear(24, 40)
        self.down = nn.Linear(40, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _Net(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 24)
        self.blocks = nn.ModuleList(_Block() for _ in range(layers))
        self.out = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _model() -> tuple:
    torch.manual_seed(0)
    apply_fn, params = fa.nn.functionalize(_Net(), POLICY, scan="blocks")
    return apply_fn, params


def _members(state) -> dict:
    """``{parameter name: (group key, offset)}`` of a flat state (its members are indices in the tree's leaf order)."""
    names = [".".join(map(str, path)) for path in _tree.tree_flatten_with_path(state.params)[0]]
    return {names[i]: (g.key, off) for g in state.storage.groups for i, off in zip(g.members, g.offsets)}


def test_a_scanned_run_is_laid_out_name_major():
    """With ``scan=``, each name's layers share one buffer at equally spaced offsets, in layer order; without it,
    each layer has buffers of its own (the per-block rule). The plan says which. (Planted: ``_segments`` ignoring
    ``stacked``: the layers fall in buffers of their own.)"""
    apply_fn, params = _model()
    assert apply_fn.scan == ("blocks",)
    opt = optim.adamw(1e-3)
    stacked = fa.TrainState.create(params, opt, scan=apply_fn.scan)
    where = _members(stacked)
    for local in ("norm.weight", "norm.bias", "up.weight", "up.bias", "down.weight", "down.bias"):
        spots = [where[f"blocks.{i}.{local}"] for i in range(4)]
        assert len({key for key, _ in spots}) == 1, local
        offsets = [off for _, off in spots]
        assert len({b - a for a, b in zip(offsets, offsets[1:])}) == 1 and offsets[1] > offsets[0], local
    assert "run 'blocks' name-major" in stacked.storage.describe()
    per_layer = fa.TrainState.create(params, opt)
    where = _members(per_layer)
    assert len({where[f"blocks.{i}.up.weight"][0] for i in range(4)}) == 4
    assert "name-major" not in per_layer.storage.describe()
    for name in params:  # the same values under the same names
        assert torch.equal(stacked.params[name], per_layer.params[name]), name


def test_a_run_inside_a_numbered_module_is_found_by_its_name():
    """A scanned run's parameters are found by the run's name as a prefix, not by the first number in a name: a
    ``Sequential``'s child ``1`` that is itself a run (``1.0.w``, ``1.1.w``) and a run under a numbered module
    (``body.0.layers.2.w``). (Planted: the first all-digit component read as the layer -> neither is found.)"""
    from funcamp.train import _flat

    shapes = {"0.w": (3,), "1.0.w": (3,), "1.1.w": (3,), "body.0.layers.0.w": (2,), "body.0.layers.1.w": (2,)}
    names, leaves = list(shapes), [torch.zeros(shape) for shape in shapes.values()]
    got = _flat._segments(list(range(len(names))), names, leaves, ("1", "body.0.layers"))
    assert got == [("1.*", [[1, 2]]), ("body.0.layers.*", [[3, 4]]), ("", [[0]])], got


def test_masks_that_tell_the_layers_apart_keep_the_run_per_layer():
    """A label per layer (a layer-wise learning rate) puts a name's layers in different buffers: the run stays per
    layer, and the plan says why."""
    apply_fn, params = _model()
    labels = {name: ("first" if name.startswith("blocks.0.") else "rest") for name in params}
    opt = optim.multi_transform({"first": optim.adamw(1e-4), "rest": optim.adamw(1e-3)}, labels)
    state = fa.TrainState.create(params, opt, scan=apply_fn.scan)
    assert state.storage.kind == "flat"
    assert "run 'blocks' per layer (the optimizer's masks or labels tell its layers apart)" in state.storage.describe()


def test_bad_scan_arguments_are_refused():
    apply_fn, params = _model()
    opt = optim.sgd(1e-2)
    with pytest.raises(TypeError, match="scan must be a str or a sequence of str"):
        fa.TrainState.create(params, opt, scan=3)
    with pytest.raises(ValueError, match=r"scan='layers' names no two layers of params"):
        fa.TrainState.create(params, opt, scan="layers")
    state = fa.TrainState.create(params, opt, scan="blocks")  # a str is one run
    assert state.storage.stacked == ("blocks",)


# --- the passes on hand-made graphs ------------------------------------------------------------------------------


def _cats(gm) -> int:
    return sum(n.target is torch.ops.aten.cat.default for n in gm.graph.nodes)


def test_scan_stacks_reads_equally_spaced_slices_as_one_view():
    """A ``cat`` of casts of views of equally spaced slices of one buffer becomes one strided view, cast; without a
    cast, copied; a name's layers in two buffers, a view of each, concatenated; the values the ``cat``'s. Not
    rewritten: overlapping slices, two buffers one slice each, mixed casts, another dimension; of unequal spacing,
    only the equally spaced run. (Planted: the spacing check dropped -> the unequal case's values differ.)"""

    def cast(b):  # 3 layers of (2, 5) at offsets 4, 20, 36: spaced by 16
        parts = [_convert(b[o : o + 10].view(2, 5), torch.bfloat16) for o in (4, 20, 36)]
        return torch.cat(parts) * 2

    def plain(b):
        return torch.cat([b[o : o + 10].view(2, 5) for o in (0, 16, 32)]) * 2

    def two_buffers(b, c):  # layers 0-1 in b, 2-4 in c: a view of each
        parts = [b[o : o + 10] for o in (0, 16)] + [c[o : o + 10] for o in (8, 24, 40)]
        return torch.cat(parts) * 2

    def unequal(b):  # 0 and 16 are a run, 40 is not
        return torch.cat([_convert(b[o : o + 10], torch.bfloat16) for o in (0, 16, 40)])

    b, c = torch.randn(64), torch.randn(64)
    for fn, views in ((cast, 1), (plain, 1), (two_buffers, 2), (unequal, 1)):
        args = (b, c) if fn is two_buffers else (b,)
        gm = make_fx(fn, tracing_mode="fake")(*args)
        assert scan_stacks._scan_stacks(gm.graph) == 1, fn.__name__
        gm.graph.lint()
        assert sum(n.target is torch.ops.aten.as_strided.default for n in gm.graph.nodes) == views, fn.__name__
        assert _cats(gm) == (0 if fn in (cast, plain) else 1), fn.__name__
        gm.recompile()
        assert torch.equal(gm(*args), fn(*args)), fn.__name__

    def overlapping(b):
        return torch.cat([b[o : o + 10] for o in (0, 8, 16)])

    def one_each(b, c):
        return torch.cat([b[0:10], c[16:26]])

    def mixed(b):
        half = _convert(_convert(b[16:26], torch.float16), torch.bfloat16)
        return torch.cat([_convert(b[0:10], torch.bfloat16), half])

    def other_dim(b):
        return torch.cat([b[o : o + 10].view(2, 5) for o in (0, 16)], dim=1)

    for fn in (overlapping, one_each, mixed, other_dim):
        args = (b, c) if fn is one_each else (b,)
        gm = make_fx(fn, tracing_mode="fake")(*args)
        assert scan_stacks._scan_stacks(gm.graph) == 0, fn.__name__
        gm.recompile()
        assert torch.equal(gm(*args), fn(*args)), fn.__name__


def _flat_gradients_of(fn, args) -> tuple:
    """``fn`` traced, its ``cat`` tagged as a flat state's gradients and rewritten by ``flat_gradients``: the graph
    module and the shapes of its ``as_strided_scatter`` writes, sorted."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    cat = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.cat.default)
    cat.meta["custom"] = {_FLAT_GRADS: True}
    assert flat_gradients._flat_gradients(gm.graph) == 1
    gm.graph.lint()
    writes = [n for n in gm.graph.nodes if n.target is torch.ops.aten.as_strided_scatter.default]
    return gm, sorted(tuple(n.args[2]) for n in writes)


@pytest.mark.parametrize("reverse", [True, False])
def test_flat_gradients_writes_a_stacked_gradient_whole(reverse):
    """Parts that are every layer of one stacked tensor (cast alike) at equally spaced offsets are written as one
    strided write of the stack (reversed where the offsets fall as the layer rises, as the scan's backward stacks
    them): one ``as_strided_scatter`` for the stack, values the ``cat``'s, padding zeros included; consecutive layers
    of it (the rest in another buffer) one write too; layers not consecutive a write each. (Planted: the reversal
    ignored -> the layers land reversed.)"""

    def step(g, x):
        layers = [_convert(g[j], torch.float32).reshape(-1) for j in range(3)]
        if reverse:
            layers = layers[::-1]
        pad = x.new_zeros(2)
        return torch.cat([x.reshape(-1) * 2, layers[0], pad, layers[1], pad, layers[2]]) + 1

    args = (torch.randn(3, 2, 3).bfloat16(), torch.randn(4))
    gm, shapes = _flat_gradients_of(step, args)
    assert (3, 6) in shapes and (6,) not in shapes, shapes
    empty = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.empty.memory_format)
    empty.target = lambda size, **kw: torch.full(size, float("nan"), dtype=kw["dtype"], device=kw["device"])
    gm.recompile()
    assert torch.equal(gm(*args), step(*args))

    def layer(g, j):
        return _convert(g[j], torch.float32).reshape(-1)

    def some(g, x):  # layers 1 and 2 of three (the rest in another buffer): one write of those two
        return torch.cat([x.reshape(-1), layer(g, 1), layer(g, 2)]) + 1

    def gapped(g, x):  # layers 0 and 2: not consecutive, a write each
        return torch.cat([x.reshape(-1), layer(g, 0), layer(g, 2)]) + 1

    for fn, expected in ((some, [(2, 6), (4,)]), (gapped, [(4,), (6,), (6,)])):
        gm, shapes = _flat_gradients_of(fn, args)
        assert shapes == expected, fn.__name__
        gm.recompile()
        assert torch.equal(gm(*args), fn(*args)), fn.__name__


# --- the compiled step ------------------------------------------------------------------------------------------


def _run(scan: tuple, donate: bool, counts: dict, monkeypatch) -> tuple:
    apply_fn, params = _model()

    def loss_fn(p, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(apply_fn(p, x).float(), y)

    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))
    state = fa.TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(2.0**8), scan=scan)
    step = fa.make_train_step(loss_fn, opt, backend="inductor", donate=donate)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 8, generator=g)
    bad = (x.clone().index_put_((torch.tensor([0]),), torch.tensor(float("inf"))), y)
    metrics = []
    for batch in ((x, y), bad, (x, y), (x, y)):
        state, m = step(state, batch)
        metrics.append({k: v.clone() for k, v in m.items() if isinstance(v, torch.Tensor)})
    leaves = [t.clone() for t in _tree.tree_leaves((dict(state.params), state.opt_state, state.loss_scale))]
    return leaves, metrics, state.storage.describe()


@pytest.mark.slow
def test_the_compiled_step_name_major_is_the_per_layer_step_bit_for_bit(monkeypatch):
    """The step compiled with inductor over the run laid out name-major: every parameter, optimizer-state leaf,
    loss scale and metric after four steps (the second skipped: an infinite input) bitwise the per-layer layout's,
    undonated and donated; and both rewrites fired (the forward's stacks as views, the stacked gradients written
    whole). (Planted: either rewrite's stride taken as the layer's size, which this model's padded layers
    tell apart -> the parameters differ. The reversal is not exercised here: the layers reach ``flat_gradients``
    in order; the hand-made graphs above hold it.)"""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)  # the passes run in this process, every time
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", False)
    counts = {"stacks": 0, "writes": 0}
    rewrite, stacked = scan_stacks._rewrite, flat_gradients._stacked

    def counted_rewrite(graph, cat):
        done = rewrite(graph, cat)
        counts["stacks"] += done
        return done

    def counted_stacked(writes, dtype):
        out = stacked(writes, dtype)
        counts["writes"] += sum(len(w[1]) == 2 for w in out)
        return out

    monkeypatch.setattr(scan_stacks, "_rewrite", counted_rewrite)
    monkeypatch.setattr(flat_gradients, "_stacked", counted_stacked)
    base, base_metrics, base_plan = _run((), False, counts, monkeypatch)
    assert counts == {"stacks": 0, "writes": 0} and "name-major" not in base_plan
    for donate in (False, True):
        torch._dynamo.reset()
        counts.update(stacks=0, writes=0)
        leaves, metrics, plan = _run(("blocks",), donate, counts, monkeypatch)
        assert "run 'blocks' name-major" in plan
        assert counts["stacks"] >= 4 and counts["writes"] >= 4, counts  # the two linears' weights and biases
        assert not bool(metrics[1]["grads_finite"]) and bool(metrics[2]["grads_finite"])
        assert len(leaves) == len(base)
        for i, (a, b) in enumerate(zip(leaves, base)):
            assert torch.equal(a, b), (donate, i)
        for m, mb in zip(metrics, base_metrics):
            for k in mb:
                torch.testing.assert_close(m[k], mb[k], rtol=0, atol=0, equal_nan=True, msg=f"{donate} {k}")


def test_a_pure_step_says_what_the_name_major_layout_costs_it():
    """The plan line of a pure compiled step over a state laid out name-major says it is for a donating step (a
    pure step makes the stacked names' new buffers whole every step); a donating step's, an eager step's and a
    per-layer state's say nothing of it. (Planted: the note for every step -> the donating one shows it.)"""
    apply_fn, params = _model()
    opt = optim.sgd(1e-2)
    stacked = fa.TrainState.create(params, opt, scan=apply_fn.scan)
    per_layer = fa.TrainState.create(params, opt)

    def loss_fn(p, x):
        return apply_fn(p, x).float().square().mean()

    note = "laid out name-major, for a donating step"
    assert note in fa.make_train_step(loss_fn, opt).plan_for(stacked)
    assert note not in fa.make_train_step(loss_fn, opt, donate=True).plan_for(stacked)
    assert note not in fa.make_train_step(loss_fn, opt, compile=False).plan_for(stacked)
    assert note not in fa.make_train_step(loss_fn, opt).plan_for(per_layer)


def test_scan_stacks_leaves_a_flat_gradient_cat_to_flat_gradients():
    """A flat state's gradient ``cat`` (tagged) is ``flat_gradients``' to write into its buffer, even where its
    parts are equally spaced slices of one tensor: ``scan_stacks`` leaves it, tag and all. (Planted: the tag not
    checked -> the ``cat`` becomes a view and a copy, untagged, and ``flat_gradients`` finds nothing to write.)"""

    def step(g):
        return torch.cat([g[o : o + 10] for o in (0, 16, 32)]) + 1

    gm = make_fx(step, tracing_mode="fake")(torch.randn(64))
    cat = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.cat.default)
    cat.meta["custom"] = {_FLAT_GRADS: True}
    assert scan_stacks._scan_stacks(gm.graph) == 0
    assert flat_gradients._flat_gradients(gm.graph) == 1


@pytest.mark.slow
def test_one_step_over_both_layouts_recompiles_with_dynamic_shapes(monkeypatch):
    """One compiled step called on a name-major state, then on a per-layer state of the same parameters (a
    checkpoint loaded ``like=`` the other layout): Dynamo's second compile makes the buffers' sizes symbolic, and
    the passes leave symbolic sizes alone (a helper's find: ``scan_stacks`` hashed a SymInt, and
    ``flat_gradients`` made zeros of a symbolic size, which inductor cannot lower; the latter was so before this
    layout, for any two flat layouts through one step). Both steps' parameters agree. (Planted: either pass's
    check of static sizes removed -> the second compile crashes.)"""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", False)
    apply_fn, params = _model()
    opt = optim.sgd(1e-2)

    def loss_fn(p, batch):
        return torch.nn.functional.mse_loss(apply_fn(p, batch[0]).float(), batch[1])

    step = fa.make_train_step(loss_fn, opt, backend="inductor")
    g = torch.Generator().manual_seed(5)
    batch = (torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 8, generator=g))
    results = []
    for scan in (apply_fn.scan, ()):
        state, metrics = step(fa.TrainState.create(params, opt, scan=scan), batch)
        results.append((dict(state.params), metrics["loss"]))
    (a, loss_a), (b, loss_b) = results
    assert torch.equal(loss_a, loss_b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7, msg=name)
