"""The tracing fast path of funcamp._tree: the same leaves, order and trees as optree, and the same
compiled train step.

Under ``torch.compile``, Dynamo runs optree through its Python pytree polyfill; funcamp walks the trees
of a train step (dicts, lists, tuples, NamedTuples, None) itself while tracing (``_tree._fast.flatten``),
and hands anything else to optree. These tests hold that walk to optree's results, eager and traced.
Speed is measured by benchmarks/bench_first_step.py, not here.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import optree
import pytest
import torch

import funcamp as fa
from funcamp import _tree, optim


class Pair(NamedTuple):
    a: object
    b: object


def _trees() -> list[object]:
    t = torch.arange(3.0)
    return [
        t,
        {"b": t, "a": t + 1, "c": None},  # unsorted keys: leaves sorted, result in insertion order
        {"z": [t, (t, 1, 2.5)], "y": {"q": None, "p": True}},
        [None, (t, None), [], (), {}],
        Pair(a={"k": t}, b=[t, "s"]),
        (Pair(1, 2), [Pair(t, None)]),
        {"x": torch.tensor(1, dtype=torch.int32), "w": 3 + 1j, "v": b"raw"},
        fa.StaticLossScale(2.0),  # funcamp's dataclasses: children in field order, static fields kept
        [fa.DynamicLossScale(2.0**15, period=7), {"s": fa.NoOpLossScale()}],
        fa.TrainState.create({"w": t, "b": {"x": t + 1}}, optim.adamw(0.1)),  # static storage and plan
    ]


class _Sub(fa.StaticLossScale):
    pass


def _same_tree(x: object, y: object) -> bool:
    """Equal structure (types, dict key order) and identical leaves (the same objects)."""
    if type(x) is not type(y):
        return False
    if isinstance(x, dict):
        return list(x) == list(y) and all(_same_tree(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same_tree(a, b) for a, b in zip(x, y))
    fields = getattr(type(x), _tree._fast.FIELDS, None)
    if fields is not None:
        _, children, statics = fields
        return all(_same_tree(getattr(x, n), getattr(y, n)) for n in children) and all(
            getattr(x, n) is getattr(y, n) or getattr(x, n) == getattr(y, n) for n in statics
        )
    return x is y


@pytest.mark.parametrize("tree", _trees(), ids=range(len(_trees())))
def test_fast_flatten_matches_optree(tree: object) -> None:
    flat = _tree._fast.flatten(tree, (), strict=True)
    assert flat is not None
    leaves, rest_leaves, skeleton = flat
    expected = optree.tree_leaves(tree, namespace=_tree.NAMESPACE)
    assert len(leaves) == len(expected) and all(a is b for a, b in zip(leaves, expected))
    assert rest_leaves == []
    rebuilt = _tree._fast.unflatten(skeleton, leaves)
    assert _same_tree(rebuilt, optree.tree_unflatten(optree.tree_structure(tree, namespace=_tree.NAMESPACE), leaves))
    assert _same_tree(rebuilt, tree)


def test_fast_unflatten_refuses_extra_leaves() -> None:
    _, _, skeleton = _tree._fast.flatten({"a": torch.zeros(1)}, (), strict=True)
    with pytest.raises(ValueError, match="more leaves"):
        _tree._fast.unflatten(skeleton, [torch.zeros(1), torch.zeros(1)])


@pytest.mark.parametrize(
    "tree",
    [
        {1: torch.zeros(1), "a": torch.zeros(1)},  # non-string keys: optree's own order
        collections.OrderedDict(a=torch.zeros(1)),
        collections.defaultdict(list, a=torch.zeros(1)),
        collections.deque([torch.zeros(1)]),
        _Sub(2.0),  # a subclass of a funcamp dataclass: optree's registry does not know it
        object(),
        torch.return_types.max((torch.zeros(1), torch.zeros(1))),  # structseq
    ],
    ids=["int-keys", "OrderedDict", "defaultdict", "deque", "dataclass-subclass", "object", "structseq"],
)
def test_fast_flatten_hands_other_nodes_to_optree(tree: object) -> None:
    assert _tree._fast.flatten(tree, (), strict=True) is None
    assert _tree._fast.flatten([tree], (), strict=True) is None


def test_fast_flatten_registered_namedtuple_goes_to_optree() -> None:
    class Custom(NamedTuple):
        x: object
        y: object

    with pytest.warns(UserWarning, match="already registered"):  # optree warns: it overrides the NamedTuple
        optree.register_pytree_node(
            Custom, lambda c: ((c.x,), c.y), lambda y, children: Custom(children[0], y), namespace=_tree.NAMESPACE
        )
    try:
        assert _tree._fast.flatten(Custom(torch.zeros(1), "meta"), (), strict=True) is None
        assert _tree._fast.flatten(Pair(torch.zeros(1), "leaf"), (), strict=True) is not None
    finally:
        optree.unregister_pytree_node(Custom, namespace=_tree.NAMESPACE)


def test_fast_flatten_with_rest_trees() -> None:
    t = torch.zeros(2)
    a, b = {"w": t, "b": [t, None]}, {"b": [t + 1, None], "w": t + 2}
    leaves, (rest,), _ = _tree._fast.flatten(a, (b,), strict=True)
    assert rest == optree.tree_leaves(b, namespace=_tree.NAMESPACE) and len(leaves) == 2
    # Up to the first tree's leaves (optree.tree_map's rule): a leaf may face a subtree, unless strict.
    deeper = {"w": (t, t), "b": [t, None]}
    assert _tree._fast.flatten(a, (deeper,), strict=False) is not None
    assert _tree._fast.flatten(a, (deeper,), strict=True) is None
    for other in ({"w": t}, {"w": t, "b": (t, None)}, {"w": t, "b": [t, t]}, {"w": t, "c": [t, None]}):
        assert _tree._fast.flatten(a, (other,), strict=False) is None, other


def test_fast_flatten_of_a_dict_of_tensors_with_rest_trees() -> None:
    """A dict whose values are all plain tensors (parameters, gradients, moments) is walked without a step per key:
    the same leaves, rest leaves, rebuilt tree and paths as optree's, a missing key or (strict) a subtree facing a
    leaf handed back, a subtree passed whole when not strict; a tensor subclass takes the per-key walk."""
    t = torch.zeros(2)
    a = {"w": t, "b": t + 1, "a": torch.nn.Parameter(t + 2)}  # unsorted keys, a Parameter
    b = {"b": t + 3, "a": 4, "w": t + 5}
    leaves, (rest,), skeleton = _tree._fast.flatten(a, (b,), strict=True)
    assert leaves == optree.tree_leaves(a, namespace=_tree.NAMESPACE) and len(leaves) == 3
    assert rest == optree.tree_leaves(b, namespace=_tree.NAMESPACE)
    rebuilt = _tree._fast.unflatten(skeleton, leaves)
    assert _same_tree(rebuilt, a) and list(rebuilt) == list(a)
    paths: list[str] = []
    _tree._fast.skeleton_paths(skeleton, (), paths)
    assert paths == ["a", "b", "w"]
    assert _tree._fast.flatten(a, ({"b": t, "a": t, "x": t},), strict=True) is None  # a key missing
    deeper = {"b": t, "a": (t, t), "w": t}
    assert _tree._fast.flatten(a, (deeper,), strict=True) is None
    _, (whole,), _ = _tree._fast.flatten(a, (deeper,), strict=False)
    assert whole[0] is deeper["a"]  # passed to the map function whole, as optree.tree_map does

    class Sub(torch.Tensor):
        pass

    c = {"y": t, "x": t.as_subclass(Sub)}
    leaves, _, skeleton = _tree._fast.flatten(c, (), strict=True)
    assert leaves == optree.tree_leaves(c, namespace=_tree.NAMESPACE)
    assert _same_tree(_tree._fast.unflatten(skeleton, leaves), c)


def test_fast_flatten_pairs_dataclasses_by_their_static_fields() -> None:
    """Two funcamp dataclasses pair up where their static fields are the same object or equal constants; a
    differing one, another class or a subclass goes to optree (which says how they differ)."""
    scale = fa.DynamicLossScale(2.0**15, period=7)
    assert _tree._fast.flatten(scale, (scale.adjust(torch.tensor(True)),), strict=True) is not None
    assert _tree._fast.flatten(scale, (fa.DynamicLossScale(2.0**15, period=8),), strict=True) is None
    assert _tree._fast.flatten(scale, (fa.StaticLossScale(2.0),), strict=True) is None
    static = fa.StaticLossScale(2.0)
    assert _tree._fast.flatten(static, (_Sub(2.0),), strict=True) is None
    paths: list[str] = []
    _tree._fast.skeleton_paths(_tree._fast.flatten({"s": scale}, (), strict=True)[2], (), paths)
    assert paths == [".".join(map(str, p)) for p in optree.tree_paths({"s": scale}, namespace=_tree.NAMESPACE)]
    assert paths == ["s.loss_scale", "s.counter", "s.hysteresis_left"], paths


# --- traced: the fast path is taken, and gives what optree gives ------------------------------------------


def _compiled(fn):  # Dynamo only: the fast path is about tracing, not code generation
    return torch.compile(fn, backend="eager", fullgraph=True)


def test_fast_path_taken_while_tracing_and_not_eager() -> None:
    a = {"w": torch.zeros(2), "b": torch.zeros(1)}
    assert _tree.flatten_same(a, a) is None  # eager: optree
    assert _compiled(lambda x: torch.tensor(_tree.flatten_same(x, x) is not None))(a)


def test_traced_tree_functions_equal_eager() -> None:
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3), "b": torch.randn(3), "emb": torch.randn(5, 2, dtype=torch.bfloat16)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    grads["b"][1] = float("nan")
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))
    state = opt.init(params)

    def run(params, grads, state):
        updates, new_state = opt.update(grads, state, params)
        new_params = optim.apply_updates(params, updates)
        finite = _tree.all_finite(grads)
        flags = _tree.finite_flags(grads)
        kept = _tree.select_tree(finite, new_params, params)
        chosen = _tree.select_tree(~finite, new_state, state)
        cast = _tree.cast_floating(params, torch.float16)
        mapped = _tree.tree_map(lambda x, y: x * 2 + y.float().sum(), params, grads)
        return kept, chosen, cast, mapped, flags, _tree.global_norm(params), _tree.tree_leaves(chosen)

    eager, traced = run(params, grads, state), _compiled(run)(params, grads, state)
    e_leaves, e_spec = optree.tree_flatten(eager, namespace=_tree.NAMESPACE)
    t_leaves, t_spec = optree.tree_flatten(traced, namespace=_tree.NAMESPACE)
    assert e_spec == t_spec
    assert list(traced[2]) == list(params)  # dict key order kept
    for x, y in zip(e_leaves, t_leaves):
        assert x.dtype == y.dtype and torch.equal(x, y) or (x.isnan().any() and torch.equal(x.isnan(), y.isnan()))


@pytest.mark.skipif(
    not _tree._structure._DYNAMO_COMPARES_SPECS,
    reason="torch < 2.13: Dynamo cannot compare treespecs, so a traced call compares leaf counts only",
)
def test_traced_structure_errors_still_raised() -> None:
    a = {"w": torch.zeros(2)}
    with pytest.raises(Exception, match="same structure"):
        _compiled(lambda x, y: _tree.select_tree(torch.tensor(True), x, y))(a, {"v": torch.zeros(2)})
    with pytest.raises(Exception, match="same tree structure"):
        _compiled(optim.apply_updates)(a, {"w": torch.zeros(2), "v": torch.zeros(2)})


def test_traced_grad_flatten_has_torch_pytrees_leaves() -> None:
    """The differentiated argument is flattened as ``torch.utils._pytree`` does, traced or not: a ``None`` there is a
    leaf, which both refuse with the same error (the fast walk would skip it), and a funcamp dataclass is a leaf
    (not registered with torch); the fast walk, which skips ``None`` and opens the dataclass, is taken only where
    the leaves agree."""
    from funcamp import grad

    t = torch.zeros(2)
    for tree in (
        {"w": t, "b": None},
        {"w": t, "t": (t + 1, None)},
        [t, fa.StaticLossScale(2.0)],
        {"b": t, "a": t + 1, "c": [t, Pair(t, t)]},
    ):
        traced_flatten = _compiled(lambda x: grad._flatten(x, 0)[0])
        if isinstance(tree, dict) and "w" in tree:  # a None inside
            # traced under fullgraph, Dynamo reports the TypeError as an observed exception that carries it
            for flatten, error in ((lambda x: grad._flatten(x, 0)[0], TypeError), (traced_flatten, Exception)):
                with pytest.raises(error, match=r"argument 0 is differentiated, and its entry .* is None"):
                    flatten(tree)
        else:
            eager = grad._flatten(tree, 0)[0]
            traced = traced_flatten(tree)
            assert len(traced) == len(eager) and all(type(a) is type(b) for a, b in zip(traced, eager)), tree
        plain = _tree._fast.torch_leaves(_tree._fast.flatten(tree, (), strict=True)[2])
        assert plain == (isinstance(tree, dict) and "c" in tree)  # the fast walk still takes plain containers


# --- the whole train step: compiled equals eager, bitwise -------------------------------------------------


def test_compiled_train_step_bitwise_equal_to_eager() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    apply_fn, params = fa.nn.functionalize(model, fa.get_policy("params=float32,compute=bfloat16,output=float32"))

    def loss_fn(p, batch):
        return torch.nn.functional.cross_entropy(apply_fn(p, batch["x"]), batch["y"])

    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))
    scale = fa.DynamicLossScale(2.0**15, period=2)
    batches = [{"x": torch.randn(6, 8), "y": torch.randint(0, 4, (6,))} for _ in range(3)]
    batches.append({"x": torch.full((6, 8), float("inf")), "y": torch.zeros(6, dtype=torch.long)})  # skipped
    results = []
    for compile in (False, True):
        step = fa.make_train_step(loss_fn, opt, compile=compile, backend="aot_eager")
        state, metrics_seen = fa.TrainState.create(params, opt, loss_scale=scale), []
        for batch in batches:
            state, metrics = step(state, batch)
            metrics_seen.append(metrics)
        results.append((state, metrics_seen))
    (s_eager, m_eager), (s_comp, m_comp) = results
    assert not bool(m_comp[-1]["grads_finite"]) and int(s_comp.skipped_steps) == 1
    for x, y in zip(_tree.tree_leaves((s_eager, m_eager)), _tree.tree_leaves((s_comp, m_comp))):
        assert x.dtype == y.dtype and torch.equal(x, y) or torch.equal(x.isnan(), y.isnan())


# --- the compiled step's inductor options (funcamp.train.inductor_options) --------------------------------


def test_inductor_pairs_each_node_with_a_window_of_its_buffer_groups_in_the_step_only(monkeypatch) -> None:
    """The compiled step's scheduler tries each node against FUSION_PAIR_WINDOW later nodes of a buffer group,
    not inductor's 64 (the per-parameter nodes reading one scalar cost GPT-2 124M 13 s of pair checks); a
    torch.compile of the user's own keeps inductor's setting. (Planted: the option left out of
    inductor_options: 64 in the step.)"""
    from torch._inductor import config as inductor_config
    from torch._inductor import scheduler

    from funcamp.train import _assemble

    seen: list[int] = []
    real = scheduler.Scheduler.get_possible_fusions

    def recording(self, *args, **kwargs):
        seen.append(inductor_config.max_fusion_buffer_group_pairwise_attempts)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(scheduler.Scheduler, "get_possible_fusions", recording)
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    model = torch.nn.Linear(4, 4)
    apply_fn, params = fa.nn.functionalize(model, fa.get_policy("float32"))
    opt = optim.sgd(0.1)
    step = fa.make_train_step(lambda p, b: apply_fn(p, b).square().mean(), opt, backend="inductor")
    step(fa.TrainState.create(params, opt), torch.ones(2, 4))
    assert seen and set(seen) == {_assemble.FUSION_PAIR_WINDOW} and _assemble.FUSION_PAIR_WINDOW < 64
    seen.clear()
    torch._dynamo.reset()
    torch.compile(lambda x: (x.sin() + 1).sum(), backend="inductor")(torch.ones(3))
    assert seen and set(seen) == {inductor_config.max_fusion_buffer_group_pairwise_attempts} == {64}


def test_compiled_step_graph_is_cacheable_by_aot_autograd() -> None:
    """The casting mode records Tensor.split as a Python call, which AOTAutograd's cache refuses unless the
    step's options mark it (then a warm process skips AOTAutograd)."""
    from torch._functorch._aot_autograd.autograd_cache import check_node_safe
    from torch._inductor import config as inductor_config

    from funcamp.train import inductor_options

    marked = inductor_options()["unsafe_marked_cacheable_functions"]
    assert "torch._tensor.split" in marked and set(marked.values()) == {torch.__version__}

    class Split(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, b = self.proj(x).split(4, dim=-1)
            return a * b

    apply_fn, params = fa.nn.functionalize(Split(), fa.get_policy("params=float32,compute=bfloat16,output=float32"))
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch.compile(lambda p, x: apply_fn(p, x).float().sum(), backend=backend, fullgraph=True)(params, torch.ones(2, 4))
    nodes = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert any(n.target is torch.Tensor.split for n in nodes)  # what the casting mode records
    with pytest.raises(Exception, match="Unsupported call_function target"):
        for n in nodes:
            check_node_safe(n)
    with inductor_config.patch(unsafe_marked_cacheable_functions=marked):
        for n in nodes:
            check_node_safe(n)


# --- nested compile regions (issue 24 item 1) ------------------------------------------------------------


def test_nested_compile_region_does_not_compose_with_the_steps_gradient():
    """One marked block, differentiated with torch.func inside one compiled graph, as funcamp's step does.

    torch 2.13: Dynamo's tracing of the region (``invoke_subgraph``) assumes plain fake tensors at its inputs;
    inside ``torch.func.grad_and_value`` they are functorch wrappers (see
    ``benchmarks/results/nested_compile_region_torch_2_13.md``). When this test fails because the step compiles,
    torch has lifted the limit: funcamp can then mark its repeated blocks as nested compile regions.
    """
    torch._dynamo.reset()
    block = torch.compiler.nested_compile_region(lambda w, x: torch.tanh(x @ w) + x)

    def loss(params, x):
        for w in params:
            x = block(w, x)
        return x.sum()

    params, x = [torch.randn(4, 4) for _ in range(2)], torch.randn(2, 4)
    step = torch.compile(lambda p, x: torch.func.grad_and_value(loss)(p, x), fullgraph=True, backend="aot_eager")
    with pytest.raises(AssertionError, match="Expected FakeTensor"):
        step(params, x)


def test_compute_dtype_table_is_the_promotion() -> None:
    """``optim.base.compute_dtype`` reads one and two floating dtypes from a table made at import (Dynamo traced
    the promotions for every buffer in every transformation): the table is the promotion with float32 it stands
    for, and other dtypes (integers, three at once) still promote. (Planted: bfloat16 alone mapped to
    bfloat16: fails.)"""
    from funcamp.optim import base

    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.uint8]

    def promoted(*ds: torch.dtype) -> torch.dtype:
        out = torch.float32
        for d in ds:
            out = torch.promote_types(out, d)
        return out

    for a in dtypes:
        assert base.compute_dtype(a) == promoted(a), a
        for b in dtypes:
            assert base.compute_dtype(a, b) == promoted(a, b), (a, b)
            assert base.compute_dtype(a, b, torch.float64) == torch.float64
    assert base.compute_dtype() == torch.float32
