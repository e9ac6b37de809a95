"""Tree utilities: all_finite, select_tree, global_norm, casting, bytes, paths."""

import math
from typing import NamedTuple

import pytest
import torch

import funcamp as fa
from funcamp import _tree

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_all_finite_sees_any_non_finite_element(dtype, bad):
    tree = {"a": torch.ones(3, 4, dtype=dtype), "b": [torch.zeros(5, dtype=dtype), None], "n": torch.arange(3)}
    assert fa.all_finite(tree)
    for leaf in (tree["a"], tree["b"][0]):
        for index in range(leaf.numel()):
            poisoned = leaf.clone()
            poisoned.view(-1)[index] = bad
            other = {**tree, "a": poisoned} if leaf is tree["a"] else {**tree, "b": [poisoned, None]}
            assert not fa.all_finite(other)


def test_all_finite_edge_cases():
    assert fa.all_finite({}) and fa.all_finite([]) and fa.all_finite(None)
    assert fa.all_finite({"a": None, "b": (None,)})
    assert fa.all_finite({"ids": torch.tensor([2**62]), "flag": torch.tensor(True), "i": 3, "n": 3.0})
    assert not fa.all_finite({"n": math.inf}) and not fa.all_finite({"z": complex(0.0, math.nan)})
    with pytest.raises(TypeError, match="leaf 's' is a str"):  # refused, not skipped (issue 11, kind 5)
        fa.all_finite({"ids": torch.tensor([1]), "s": "x"})
    result = fa.all_finite({"x": torch.ones(2)})
    assert result.dtype == torch.bool and result.ndim == 0
    assert not fa.all_finite(torch.tensor(float("nan")))


def test_finite_flags_per_leaf_in_leaf_order():
    tree = {"b": torch.tensor([float("inf")]), "a": torch.ones(1), "c": torch.arange(2), "d": torch.tensor([1 + 2j])}
    flags = _tree.finite_flags(tree)
    assert flags.tolist() == [True, False, True]  # optree order: a, b, d; the integer leaf c cannot be non-finite
    assert _tree.finite_flag_paths(tree) == ["a", "b", "d"]
    assert _tree.finite_flags({}).shape == (0,)


def test_select_tree_picks_whole_trees():
    a = {"x": torch.ones(2), "n": torch.tensor(1), "s": "same"}
    b = {"x": torch.zeros(2), "n": torch.tensor(2), "s": "same"}
    chosen = fa.select_tree(torch.tensor(True), a, b)
    assert torch.equal(chosen["x"], a["x"]) and chosen["n"].item() == 1 and chosen["s"] == "same"
    chosen = fa.select_tree(torch.tensor(False), a, b)
    assert torch.equal(chosen["x"], b["x"]) and chosen["n"].item() == 2


def test_select_tree_returns_a_shared_leaf_as_is():
    """A leaf that is one tensor in both trees (already written in place by a donating step, or passed through)
    is returned itself, not a copy; the others are chosen."""
    shared = torch.tensor([1.0, float("nan")])
    a, b = {"s": shared, "x": torch.ones(2)}, {"s": shared, "x": torch.zeros(2)}
    for pred in (torch.tensor(True), torch.tensor(False)):
        chosen = fa.select_tree(pred, a, b)
        assert chosen["s"] is shared and torch.equal(chosen["x"], (a if pred else b)["x"])


def test_select_tree_keeps_nan_payload_bitwise():
    a = {"x": torch.tensor([float("nan"), 1.0])}
    b = {"x": torch.tensor([2.0, -0.0])}
    chosen = fa.select_tree(torch.tensor(False), a, b)["x"]
    assert chosen[0].item() == 2.0 and math.copysign(1.0, chosen[1].item()) == -1.0


@pytest.mark.parametrize(
    "pred, error, fragment",
    [
        (True, TypeError, "0-d torch.bool tensor"),
        (torch.tensor(1), TypeError, "dtype torch.int64"),
        (torch.tensor([True]), ValueError, "must be 0-d"),
        (torch.tensor([[True, False]]), ValueError, "shape (1, 2)"),
    ],
)
def test_select_tree_rejects_bad_predicates(pred, error, fragment):
    with pytest.raises(error, match="pred") as info:
        fa.select_tree(pred, {"x": torch.ones(1)}, {"x": torch.ones(1)})
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "a, b, fragment",
    [
        ({"x": torch.ones(1)}, {"y": torch.ones(1)}, "same structure"),
        ({"x": torch.ones(1)}, {"x": torch.ones(1), "y": torch.ones(1)}, "same structure"),
        ({"x": torch.ones(1)}, {"x": torch.ones(1, dtype=torch.float16)}, "dtype"),
        ({"x": "a"}, {"x": "b"}, "must be equal"),
        ({"x": torch.ones(1)}, {"x": 1.0}, "must be equal"),
    ],
)
def test_select_tree_rejects_mismatched_trees(a, b, fragment):
    with pytest.raises(ValueError, match=fragment):
        fa.select_tree(torch.tensor(True), a, b)


def test_select_tree_traces_without_graph_break():
    torch._dynamo.reset()
    select = torch.compile(fa.select_tree, fullgraph=True, backend="aot_eager")
    out = select(torch.tensor(False), {"x": torch.ones(2)}, {"x": torch.full((2,), 3.0)})
    assert out["x"].tolist() == [3.0, 3.0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_global_norm_in_float32_or_float64(dtype):
    # float64 leaves get a float64 norm: a finite float64 tree can have a norm beyond float32's range.
    tree = {"a": torch.tensor([3.0], dtype=dtype), "b": [torch.tensor([4.0], dtype=dtype)], "i": torch.tensor([7])}
    norm = fa.global_norm(tree)
    assert norm.dtype == torch.promote_types(dtype, torch.float32) and norm.ndim == 0 and norm.item() == 5.0
    assert fa.global_norm({}).item() == 0.0


def test_global_norm_does_not_overflow_for_large_float16_values():
    # 60000**2 overflows float16; the norm is taken in float32.
    norm = fa.global_norm({"a": torch.full((4,), 60000.0, dtype=torch.float16)})
    assert torch.isfinite(norm) and abs(norm.item() - 120000.0) < 1.0
    assert not torch.isfinite(fa.global_norm({"a": torch.tensor([float("inf")])}))


def test_tree_bytes_and_paths():
    tree = {
        "w": torch.ones(2, 3),
        "h": torch.ones(4, dtype=torch.float16),
        "ids": torch.ones(2, dtype=torch.int64),
        "s": 3,
    }
    assert fa.tree_bytes(tree) == 2 * 3 * 4 + 4 * 2 + 2 * 8
    assert _tree.tree_paths({"b": {"w": 1}, "a": [1, 2]}) == ["a.0", "a.1", "b.w"]


class _Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


def test_tree_paths_while_tracing_are_optrees():
    """The tracing fast path names the leaves as optree does: sorted keys, indices, None entries counted."""
    t = torch.ones(1)
    tree = {"z": {"y": t, "x": [t, (t, None, t)]}, "a": _Pair(t, t), "n": None, "k": [None, {"q": t}]}
    want = ["a.0", "a.1", "k.1.q", "z.x.0", "z.x.1.0", "z.x.1.2", "z.y"]
    assert _tree.tree_paths(tree) == want
    seen = []

    def fn(tree):
        seen.append(_tree.tree_paths(tree))
        return _tree.tree_leaves(tree)[0] + 1

    torch.compile(fn, fullgraph=True, backend="eager")(tree)
    assert seen == [want]


def test_cast_floating_leaves_others_alone():
    complex_leaf = torch.ones(1, dtype=torch.complex64)
    tree = {"x": torch.ones(1, dtype=torch.float64), "c": complex_leaf, "none": None, "obj": object}
    out = _tree.cast_floating(tree, torch.float16)
    assert out["x"].dtype == torch.float16 and out["c"] is complex_leaf and out["none"] is None and out["obj"] is object


# --- the finite check and the norm's first pass share one reduction per leaf (compile-time issue) --------


def _old_flag(x):
    """The finite flag before the shared reduction (commit dfc6d73): ``isfinite(x).all()``."""
    if x.is_sparse:
        x = x.coalesce().values()
    return torch.isfinite(x.float() if x.dtype.itemsize == 1 else x).all()


def _flag_cases():
    """Leaves with a NaN, +inf or -inf at the front, middle or back, or none; empty, complex, float8, sparse."""
    cases = []
    for dtype in [*DTYPES, torch.float8_e4m3fn, torch.float8_e5m2]:
        for bad in (None, math.nan, math.inf, -math.inf):
            for where in (0, 17, -1):
                x = torch.linspace(-3.0, 2.0, 40).to(dtype)
                if bad is not None:
                    if dtype == torch.float8_e4m3fn and math.isinf(bad):
                        continue  # e4m3fn has no infinity
                    x[where] = bad
                cases.append(x)
        cases.append(torch.empty(0, dtype=dtype))
    for bad in (None, complex(math.inf, 0.0), complex(0.0, -math.inf), complex(1.0, math.nan)):
        z = torch.tensor([1 + 2j, -3 - 1j, 0.5j], dtype=torch.complex64)
        if bad is not None:
            z[1] = bad
        cases += [z, z.conj()]
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0, 2]]), torch.tensor([1.0, -math.inf]), (4,), check_invariants=True
    )
    return [*cases, sparse, torch.tensor([-0.0, -0.0])]


@pytest.fixture(scope="module")
def traced_checks():
    """``finite_flags`` and ``_max_magnitude`` (over a list) through torch.compile (aot_eager: the traced
    formulas, run by ATen); each test makes one call, so one compile each."""
    torch._dynamo.reset()
    flags = torch.compile(_tree.finite_flags, fullgraph=True, backend="aot_eager")
    magnitudes = torch.compile(
        lambda xs: [_tree._numerics._max_magnitude(x) for x in xs], fullgraph=True, backend="aot_eager"
    )
    return flags, magnitudes


def test_finite_flags_equal_the_old_isfinite_all_eager_and_traced(traced_checks):
    """The finite flag is read from ``max(|x|)`` (one reduction the norm shares) instead of ``isfinite(x).all()``:
    the same verdict for every leaf kind and position of NaN, +inf, -inf, eager and traced. Planted faults caught:
    a flag of ``isfinite(x.amax())`` (a -inf leaf read as finite) and a complex leaf's imaginary part left out."""
    traced_flags, _ = traced_checks
    cases = _flag_cases()
    want = torch.stack([_old_flag(x) for x in cases])
    tree = {f"{i:03d}": x for i, x in enumerate(cases)}
    assert torch.equal(_tree.finite_flags(tree), want)
    dense = {k: x for k, x in tree.items() if not x.is_sparse}
    assert torch.equal(traced_flags(dense), torch.stack([_old_flag(x) for x in dense.values()]))
    assert not torch.all(want) and torch.any(want)  # the cases hold both verdicts


def test_max_magnitude_traced_equals_eager(traced_checks):
    """Under torch.compile ``_max_magnitude`` is ``x.abs().amax()``, eager ``aminmax``: the same number, bit for
    bit (a zero's sign aside), so the norm's scale and the clip are unchanged. Planted fault caught: ``x.amax()``
    (no abs) while tracing."""
    _, traced = traced_checks
    gen = torch.Generator().manual_seed(0)
    xs = []
    for dtype in (torch.bfloat16, torch.float32, torch.float64, torch.float16):
        for trial in range(6):
            x = torch.randn(int(torch.randint(1, 500, (1,), generator=gen)), generator=gen) * 10.0 ** (trial - 3)
            if trial % 2:
                x = x - x.abs().max() * 2  # the largest magnitude is negative
            xs.append(x.to(dtype))
    xs.append(torch.tensor([1.0, math.nan, -5.0]))
    for x, got in zip(xs, traced(xs), strict=True):
        eager = _tree._numerics._max_magnitude(x)
        assert got.dtype == eager.dtype and torch.equal(got.abs(), eager.abs()) or (got.isnan() and eager.isnan()), x


def _traced_instructions(fn, *args):
    """Bytecode instructions Dynamo traces for ``fn(*args)`` (backend eager), by function name."""
    from collections import Counter

    from torch._dynamo import symbolic_convert

    counts: Counter = Counter()
    step = symbolic_convert.InstructionTranslatorBase.step

    def counted(self):
        counts[self.f_code.co_name] += 1
        return step(self)

    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(symbolic_convert.InstructionTranslatorBase, "step", counted)
        out = torch.compile(fn, fullgraph=True, backend="eager")(*args)
    return out, counts


def test_traced_walks_ask_constant_questions_once_not_per_leaf():
    """While traced, a tree function's walk asks what only constants answer (string keys, plain tensor values, the
    same keys in each tree) of tuples Dynamo calls a helper with, not per key: ``tree_map`` and ``select_tree``
    over dicts of 200 tensors trace under 12 instructions a leaf beyond ``fn`` (measured 10.0, 8 of them
    rebuilding the dicts; the per-key loops and comprehensions before took 46: planted, fails). A dict with
    other keys still goes to optree, with optree's result."""
    d = {f"layer{i:03d}.weight": torch.full((2,), float(i)) for i in range(200)}
    e = {k: v + 1 for k, v in d.items()}
    pred = torch.tensor(True)

    def fn(d, e, pred):
        return _tree.tree_map(lambda x, y: x, d, e), fa.select_tree(pred, d, e)

    (mapped, selected), counts = _traced_instructions(fn, d, e, pred)
    assert all(mapped[k] is not None and torch.equal(mapped[k], d[k]) for k in d)
    assert all(torch.equal(selected[k], d[k]) for k in d)
    walk = sum(counts.values()) - counts["<lambda>"] - counts["_select_leaf"] - counts["fn"]
    assert walk < 12 * 2 * len(d), counts.most_common(6)

    ints = {i: torch.full((2,), float(i)) for i in range(5)}
    (got, _), _ = _traced_instructions(fn, ints, {i: x + 1 for i, x in ints.items()}, pred)
    assert list(got) == list(ints) and all(torch.equal(got[i], ints[i]) for i in ints)


class _Opaque:
    """A static field's value that is neither a constant nor marked comparable (a user's object)."""


@_tree.dataclass
class _Holder:
    x: torch.Tensor
    how: object = _tree.field(default=None, pytree_node=False)


def test_tree_paths_while_tracing_a_dataclass_with_an_object_static():
    """The traced walk names the leaves of a tree whose dataclass holds an object in a static field: its skeleton
    is walked as traced code, never handed to a helper Dynamo calls on constants, which cannot take the object
    (planted: the skeleton's paths asked of such a helper, Dynamo refuses the trace and this fails)."""
    tree = {"a": _Holder(torch.ones(2), _Opaque()), "b": [torch.ones(1)]}
    seen = []

    def fn(tree):
        seen.append(_tree.tree_paths(tree))
        return _tree.tree_leaves(tree)[0] + 1

    torch.compile(fn, fullgraph=True, backend="eager")(tree)
    assert seen == [["a.x", "b.0"]] == [_tree.tree_paths(tree)]


def _where_nodes(fn, *args):
    """``(fn(*args) compiled, the number of torch.where calls in its Dynamo graph)``."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return out, sum(n.target is torch.where for g in graphs for n in g.graph.nodes)


def test_traced_select_tree_selects_only_differing_pairs_and_checks_them():
    """Traced, ``select_tree`` of plain tensors asks its per-pair questions of tuples (``map`` of tensor methods):
    a pair that is one tensor is returned as it is, with no ``where`` in the graph (planted: a ``where`` for every
    pair, 30 nodes, fails), the others selected; pairs differing in dtype or shape still raise, as eager."""
    d = {f"p{i:02d}": torch.full((2,), float(i)) for i in range(30)}
    e = {k: (v if i % 3 == 0 else v + 1) for i, (k, v) in enumerate(d.items())}
    for pred in (torch.tensor(True), torch.tensor(False)):
        out, wheres = _where_nodes(fa.select_tree, pred, d, e)
        assert wheres == 20
        assert all(torch.equal(out[k], (d if pred else e)[k]) for k in d)
        assert all(out[k] is d[k] for i, k in enumerate(d) if i % 3 == 0)
    for bad, message in ((torch.ones(2, dtype=torch.float64), "dtype"), (torch.ones(3), "shape")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=message):
            torch.compile(fa.select_tree, fullgraph=True, backend="eager")(torch.tensor(True), d, {**e, "p01": bad})


def test_traced_apply_updates_and_grad_widening_ask_dtypes_once():
    """Traced, ``apply_updates`` of float32/float64 pairs is ``p + u`` per pair (the sum of their compute dtype: the
    same bits as eager), bfloat16 parameters still sum in float32; an update of another shape still raises. The
    gradients' widening returns a tree of float32 leaves as it is, and widens a bfloat16 one; ``first_non_floating``
    names an integer leaf. Planted: the traced sum without the shape check broadcasts, and this fails."""
    from funcamp import optim
    from funcamp.grad import _at_least_float32

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        p = {f"w{i}": torch.randn(3, 4, generator=g).to(dtype) for i in range(5)}
        u = {k: torch.randn(3, 4, generator=g).to(dtype) * 1e-3 for k in p}
        torch._dynamo.reset()
        traced = torch.compile(optim.apply_updates, fullgraph=True, backend="aot_eager")(p, u)
        eager = optim.apply_updates(p, u)
        assert all(traced[k].dtype == dtype and torch.equal(traced[k], eager[k]) for k in p)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="shape"):
        torch.compile(optim.apply_updates, fullgraph=True, backend="eager")(
            {"w": torch.ones(3, 4)}, {"w": torch.ones(4)}
        )

    grads = {"a": torch.ones(2), "b": torch.ones(3, dtype=torch.float64)}
    torch._dynamo.reset()
    same = torch.compile(_at_least_float32, fullgraph=True, backend="eager")(grads)
    assert same["a"] is grads["a"] and same["b"] is grads["b"]
    torch._dynamo.reset()
    widened = torch.compile(_at_least_float32, fullgraph=True, backend="eager")(
        {**grads, "c": torch.ones(2).bfloat16()}
    )
    assert widened["c"].dtype == torch.float32 and widened["a"] is grads["a"]

    seen = []

    def first(tree):
        seen.append(_tree.first_non_floating(tree))
        return tree["a"] + 1

    torch._dynamo.reset()
    torch.compile(first, fullgraph=True, backend="eager")({**grads, "n": torch.ones(2, dtype=torch.int64)})
    torch.compile(first, fullgraph=True, backend="eager")(grads)
    assert seen == [("n", "torch.int64"), None]
