"""Tests for funcamp.optim.groups: masked, multi_transform and set_to_zero against torch.optim param groups."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import funcamp as fa
from funcamp import _tree, checkpoint, optim
from funcamp.optim.groups import MaskedState, MultiTransformState, masked, multi_transform, set_to_zero
from funcamp.train import TrainState, make_train_step

SHAPES = {"w": (5, 7), "b": (7,), "norm": (7,), "head": (7, 3)}
STEPS = 100
# torch.optim.AdamW multiplies p by 1 - lr*wd rounded to float32 (tests/test_optim.py, _ADAMW_DRIFT):
# the two can drift apart by up to STEPS * 2**-24 * |p| with |p| <= 4 here.
ATOL = 1e-6 + STEPS * 2.0**-24 * 4.0


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def _grads(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(s, generator=gen) for k, s in SHAPES.items()} for _ in range(n)]


def _run(opt, params, grads):
    state = opt.init(params)
    for g in grads:
        updates, state = opt.update(g, state, params)
        params = optim.apply_updates(params, updates)
    return params, state


def _run_torch(cls, groups, params, grads, clip=None):
    """``groups``: list of (names, kwargs); parameters in no group are not given to torch.optim."""
    tensors = {k: v.clone().requires_grad_() for k, v in params.items()}
    torch_opt = cls([{"params": [tensors[k] for k in names], **kw} for names, kw in groups])
    for g in grads:
        for k, t in tensors.items():
            t.grad = g[k].clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(tensors.values()), clip)
        torch_opt.step()
    return {k: v.detach() for k, v in tensors.items()}


def _labels(params):  # the usual split: matrices decay, vectors (biases, norms) do not, the head is its own group
    return {k: "head" if k == "head" else "decay" if v.ndim >= 2 else "no_decay" for k, v in params.items()}


GROUPS = {
    "decay": (dict(lr=1e-2, weight_decay=0.1), lambda: optim.adamw(1e-2, weight_decay=0.1)),
    "no_decay": (dict(lr=1e-2, weight_decay=0.0), lambda: optim.adamw(1e-2, weight_decay=0.0)),
    "head": (dict(lr=3e-2, weight_decay=0.01), lambda: optim.adamw(3e-2, weight_decay=0.01)),
}


def _torch_groups(params):
    labels = _labels(params)
    return [([k for k in params if labels[k] == name], kw) for name, (kw, _) in GROUPS.items()]


def _assert_moved_and_close(mine, theirs, params):
    for k in params:
        moved = (theirs[k] - params[k]).abs().max().item()
        assert moved > 100 * ATOL, f"{k}: the reference must move the parameters far beyond the tolerance"
        torch.testing.assert_close(mine[k] - params[k], theirs[k] - params[k], rtol=1e-5, atol=ATOL)


@pytest.mark.parametrize("labels", ["tree", "callable"])
def test_multi_transform_matches_torch_adamw_param_groups(labels):
    params, grads = _params(), _grads(STEPS)
    param_labels = _labels(params) if labels == "tree" else _labels
    opt = multi_transform({name: make() for name, (_, make) in GROUPS.items()}, param_labels)
    mine, state = _run(opt, params, grads)
    theirs = _run_torch(torch.optim.AdamW, _torch_groups(params), params, grads)
    _assert_moved_and_close(mine, theirs, params)
    assert isinstance(state, MultiTransformState) and list(state.inner_states) == list(GROUPS)
    adam_state = state.inner_states["no_decay"][0]  # adamw: chain(scale_by_adam, add_decayed_weights, lr)
    # a group's state holds its own parameters only; the others are None (empty nodes)
    assert {k for k, v in adam_state.mu.items() if v is not None} == {"b", "norm"}
    assert adam_state.count.item() == STEPS


def test_masked_weight_decay_matches_torch_adam_param_groups():
    """L2 decay on the matrices only: torch.optim.Adam with weight_decay in one of two groups."""
    params, grads = _params(), _grads(STEPS)
    mask = {k: v.ndim >= 2 for k, v in params.items()}
    opt = optim.chain(
        masked(optim.add_decayed_weights(0.1), mask), optim.scale_by_adam(), optim.scale_by_learning_rate(1e-2)
    )
    mine, _ = _run(opt, params, grads)
    groups = [(["w", "head"], dict(lr=1e-2, weight_decay=0.1)), (["b", "norm"], dict(lr=1e-2, weight_decay=0.0))]
    theirs = _run_torch(torch.optim.Adam, groups, params, grads)
    _assert_moved_and_close(mine, theirs, params)


def test_chain_clip_then_groups_matches_torch():
    """A global clip over all parameters, then groups: clip_grad_norm_ then torch.optim.AdamW groups."""
    params, grads = _params(), [{k: 3.0 * v for k, v in g.items()} for g in _grads(STEPS)]
    opt = optim.chain(
        optim.clip_by_global_norm(1.0), multi_transform({n: make() for n, (_, make) in GROUPS.items()}, _labels)
    )
    mine, _ = _run(opt, params, grads)
    theirs = _run_torch(torch.optim.AdamW, _torch_groups(params), params, grads, clip=1.0)
    # clip_grad_norm_ divides by norm + 1e-6 (relative 1e-6 of the update at |grad| ~ 10): Adam's
    # normalisation cancels most of that, so the float32 tolerance holds.
    _assert_moved_and_close(mine, theirs, params)


def test_masked_passes_other_updates_through_and_keeps_no_state_for_them():
    params = _params()
    grads = _grads(1)[0]
    opt = masked(optim.adam(0.1), {"w": True, "b": False, "norm": False, "head": True})
    state = opt.init(params)
    assert isinstance(state, MaskedState)
    adam = state.inner_state[1]
    assert adam.mu["b"] is None and adam.mu["norm"] is None and adam.mu["w"].shape == (5, 7)
    updates, _ = opt.update(grads, state, params)
    assert updates["b"] is grads["b"] and updates["norm"] is grads["norm"]  # untouched objects, as optax
    ref, _ = optim.adam(0.1).update({"w": grads["w"]}, optim.adam(0.1).init({"w": params["w"]}), {"w": params["w"]})
    assert torch.equal(updates["w"], ref["w"])


def test_set_to_zero_freezes_bitwise_including_negative_zero():
    params = {"frozen": torch.tensor([-0.0, 0.0, 1.5, -3e-41, float("inf")]), "w": torch.ones(5)}
    opt = multi_transform({"train": optim.sgd(0.1), "frozen": set_to_zero()}, {"frozen": "frozen", "w": "train"})
    grads = {"frozen": torch.full((5,), 7.0), "w": torch.ones(5)}
    new, _ = _run(opt, params, [grads] * 3)
    # bit patterns, so that -0.0 vs +0.0 counts: torch.optim leaves a parameter in no group untouched
    assert torch.equal(new["frozen"].view(torch.int32), params["frozen"].view(torch.int32))
    torch.testing.assert_close(new["w"], torch.full((5,), 0.7))
    # optax's +0.0 would turn -0.0 into +0.0: the sign bit is what the assertion above checks
    assert torch.equal((torch.tensor(-0.0) + 0.0).view(torch.int32), torch.tensor(0))


def test_transform_without_params_is_allowed_as_in_optax():
    params = {"w": torch.ones(3)}
    opt = multi_transform({"a": optim.adam(0.1), "unused": optim.adam(0.1)}, {"w": "a"})
    state = opt.init(params)
    updates, state = opt.update({"w": torch.ones(3)}, state, params)
    assert state.inner_states["unused"][1].mu == {"w": None}  # built on an empty group
    assert state.inner_states["unused"][1].count.device == params["w"].device
    torch.testing.assert_close(updates["w"], torch.full((3,), -0.1))


# --- with the train step: compiled, skipped steps, frozen group --------------------------------------


def _loss_fn(params, batch):
    h = batch["x"] @ params["w"] + params["b"]
    return ((h * params["norm"]) @ params["head"]).square().mean()


def _only_b(tree):  # one level down, the other groups' leaves are None and stay None
    return {k: None if v is None else k == "b" for k, v in tree.items()}


def _none_of(tree):  # a mask that selects nothing (the other groups' leaves stay None)
    return {k: None if v is None else False for k, v in tree.items()}


def _all_x(tree):
    return {k: None if v is None else "x" for k, v in tree.items()}


def _groups():
    """Three groups, and every way a group can hold no parameter (allowed, as in optax): labels that no parameter
    carries (a chain; a mask inside, which then sees only None), a label unused one level down, a mask that
    selects nothing."""
    return multi_transform(
        {
            "decay": optim.adamw(1e-2, weight_decay=0.1),
            # a masked transform with a callable mask inside a group: L2 decay on "b" only
            "no_decay": optim.chain(
                masked(optim.add_decayed_weights(0.5), _only_b),
                masked(optim.add_decayed_weights(0.1), _none_of),
                optim.adam(1e-2),
            ),
            "head": multi_transform({"x": set_to_zero(), "unused": optim.adam(1.0)}, _all_x),
            "unused_chain": optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1.0)),
            "unused_masked": masked(optim.sgd(1.0, momentum=0.9), _none_of),
            # a prefix at the root (one value for the whole tree, as optax allows), over a group with no parameter
            "unused_prefix": masked(optim.adam(1.0), True),
        },
        _labels,
    )


@pytest.fixture(scope="module")
def compiled_step():
    opt = _groups()
    torch._dynamo.reset()
    return opt, make_train_step(_loss_fn, opt, backend="aot_eager")


def test_compiled_train_step_with_groups_skips_and_freezes(compiled_step):
    opt, step = compiled_step
    params = _params()
    eager = make_train_step(_loss_fn, opt, compile=False)
    state = TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(2.0**15))
    gen = torch.Generator().manual_seed(3)
    batches = [{"x": torch.randn(4, 5, generator=gen)} for _ in range(4)]
    batches[2] = {"x": batches[2]["x"].clone().index_fill_(0, torch.tensor([1]), float("inf"))}
    s_c, s_e = state, state
    with torch._dynamo.config.patch(error_on_recompile=True):
        s_c, _ = step(s_c, batches[0])  # the first call compiles; no recompiles after it
        s_e, _ = eager(s_e, batches[0])
        for b in batches[1:]:
            before = s_c
            s_c, m = step(s_c, b)
            s_e, _ = eager(s_e, b)
            if not bool(m["grads_finite"]):  # the skipped step keeps every group's state bitwise
                for x, y in zip(_tree.tree_leaves(before.opt_state), _tree.tree_leaves(s_c.opt_state), strict=True):
                    assert torch.equal(x, y)
    assert s_c.skipped_steps.item() == 1
    assert type(s_c.opt_state.inner_states["no_decay"][0]) is MaskedState
    assert s_c.opt_state.inner_states["decay"][0].count.item() == 3
    assert torch.equal(s_c.params["head"], params["head"])  # frozen group, bitwise
    assert not torch.equal(s_c.params["w"], params["w"])
    for k in params:
        torch.testing.assert_close(s_c.params[k], s_e.params[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ["compiled", "donated"])
def test_groups_without_parameters_train_as_in_eager(mode, request):
    """The groups that hold no parameter, in the compiled step (aot_eager; Dynamo failed on them) and the eager
    donating step: the parameters move as in the pure eager step, and the empty groups keep no tensor for any
    parameter."""
    if mode == "compiled":
        opt, step = request.getfixturevalue("compiled_step")
    else:
        opt = _groups()
        step = make_train_step(_loss_fn, opt, compile=False, donate=True)
    eager = make_train_step(_loss_fn, opt, compile=False)
    gen = torch.Generator().manual_seed(4)
    s_new, s_ref = (TrainState.create(_params(), opt, loss_scale=fa.DynamicLossScale(2.0**15)) for _ in "12")
    for _ in range(3):
        batch = {"x": torch.randn(4, 5, generator=gen)}
        s_new, m = step(s_new, batch)
        s_ref, _ = eager(s_ref, batch)
        assert bool(m["grads_finite"])
    groups = s_new.opt_state.inner_states
    assert groups["unused_chain"][1][0].mu == {k: None for k in SHAPES}
    assert groups["head"].inner_states["unused"][1].mu == {k: None for k in SHAPES}
    for k in SHAPES:
        if mode == "donated":
            assert torch.equal(s_new.params[k], s_ref.params[k]), k
        else:
            torch.testing.assert_close(s_new.params[k], s_ref.params[k], rtol=1e-6, atol=1e-7)
    assert not torch.equal(s_new.params["b"], _params()["b"])


def test_state_round_trips(tmp_path):
    def present(tree):  # a callable mask one level down gets the other group's leaves as None
        return {k: True if v is not None else None for k, v in tree.items()}

    opt = multi_transform({"decay": optim.adamw(1e-2), "no_decay": masked(optim.adam(1e-2), present)}, _labels)
    params = {k: v for k, v in _params().items() if k != "head"}
    grads = [{k: v for k, v in g.items() if k != "head"} for g in _grads(2)]
    _, state = _run(opt, params, grads)
    leaves, spec = _tree.tree_flatten(state)
    checkpoint.save(tmp_path / "s.pt", state)
    others = (
        _tree.tree_unflatten(spec, leaves),
        copy.deepcopy(state),
        pickle.loads(pickle.dumps(state)),
        checkpoint.load(tmp_path / "s.pt", like=opt.init(params)),
        checkpoint.load(tmp_path / "s.pt"),
    )
    for other in others:
        other_leaves, other_spec = _tree.tree_flatten(other)
        assert other_spec == spec and type(other) is MultiTransformState
        assert type(other.inner_states["no_decay"]) is MaskedState
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(leaves, other_leaves, strict=True))


# --- bad inputs --------------------------------------------------------------------------------------


def test_labels_tree_of_wrong_structure():
    opt = multi_transform({"a": optim.sgd(0.1)}, {"w": "a"})
    with pytest.raises(ValueError, match=r"param_labels must have the structure of the parameters, or be a prefix.*"
                       r"at the top param_labels has no entry for the parameters' key\(s\) \['b'\]"):  # fmt: skip
        opt.init({"w": torch.ones(1), "b": torch.ones(1)})
    opt = masked(optim.sgd(0.1), {"w": True, "extra": False})
    with pytest.raises(
        ValueError, match=r"masked: mask must .* mask has key\(s\) \['extra'\] that the parameters do not"
    ):
        opt.init({"w": torch.ones(1)})


# --- prefix trees (optax's): one value for a whole subtree ----------------------------------------------------

NESTED = {"enc": {"w": (2, 3), "b": (3,)}, "dec": {"w": (3, 2), "b": (2,)}, "head": [(2,), (2, 2)]}


def _nested(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def make(shape):
        return torch.randn(shape, generator=gen)

    return {
        k: [make(s) for s in v] if isinstance(v, list) else {n: make(s) for n, s in v.items()}
        for k, v in NESTED.items()
    }


def _full(prefix):
    """The full tree a prefix stands for, written out by hand."""
    full = {}
    for k, v in prefix.items():
        if isinstance(v, (dict, list)):
            full[k] = v
        else:
            full[k] = [v] * len(NESTED[k]) if isinstance(NESTED[k], list) else {n: v for n in NESTED[k]}
    return full


@pytest.mark.parametrize(
    "build",
    [
        lambda m: masked(optim.adam(0.1), m),
        lambda m: optim.add_decayed_weights(0.5, m),
        lambda m: optim.adamw(0.1, weight_decay=0.5, mask=m),
        lambda m: multi_transform({True: optim.sgd(0.1, momentum=0.9), False: set_to_zero()}, m),
    ],
    ids=["masked", "add_decayed_weights", "adamw_mask", "multi_transform"],
)
def test_a_prefix_tree_is_the_full_tree_it_stands_for(build):
    prefix = {"enc": False, "dec": {"w": True, "b": False}, "head": True}
    params, grads = _nested(), [_nested(s) for s in (1, 2, 3)]
    results = []
    for tree in (prefix, _full(prefix), lambda p: prefix):
        opt = build(tree)
        p, state = params, opt.init(params)
        for g in grads:
            u, state = opt.update(g, state, p)
            p = optim.apply_updates(p, u)
        results.append(_tree.tree_leaves(p))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))
    moved = [not torch.equal(a, b) for a, b in zip(_tree.tree_leaves(params), results[0], strict=True)]
    assert any(moved)


def test_a_label_for_a_whole_submodule_as_in_optax():
    params = _nested()
    opt = multi_transform(
        {"frozen": set_to_zero(), "train": optim.sgd(1.0)}, {"enc": "frozen", "dec": "train", "head": "train"}
    )
    updates, state = opt.update(_nested(1), opt.init(params), params)
    assert all(torch.equal(u, torch.full_like(u, -0.0)) for u in updates["enc"].values())
    assert torch.equal(updates["dec"]["w"], -_nested(1)["dec"]["w"])
    assert state.inner_states["frozen"] == optim.EmptyState()
    sgd_state = state.inner_states["train"]
    assert sgd_state[1].count.item() == 1  # chain(add_decayed_weights, scale_by_learning_rate)
    # one label for the whole tree
    whole = multi_transform({"a": optim.sgd(1.0)}, "a")
    assert torch.equal(whole.update(_nested(1), whole.init(params), params)[0]["head"][1], -_nested(1)["head"][1])


def test_what_is_not_a_prefix_is_refused_naming_the_path():
    params = _nested()
    top, dec, head = "at the top mask has", "at 'dec' mask has", "at 'head' the parameters hold a list of 2 and mask"
    cases = [
        ({"enc": False, "dec": {"w": True}, "head": True}, rf"{dec} no entry for the parameters' key\(s\) \['b'\]"),
        ({"enc": False, "dec": True, "head": [True]}, rf"{head} holds a list of 1"),
        ({"enc": False, "dec": True, "head": (True, False)}, rf"{head} holds a tuple of 2"),
        ({"enc": {"w": {"x": True}, "b": True}, "dec": True, "head": True}, None),  # deeper than a leaf: taken whole
        ({"enc": False, "dec": True}, rf"{top} no entry for the parameters' key\(s\) \['head'\]"),
    ]  # fmt: skip
    for mask, match in cases:
        opt = masked(optim.sgd(0.1), mask)
        if match is None:
            with pytest.raises(TypeError, match=r"mask leaves must be Python bools .*, got dict at 'enc.w'"):
                opt.init(params)
        else:
            with pytest.raises(ValueError, match=match):
                opt.init(params)
    with pytest.raises(ValueError, match=r"at 'dec' param_labels has key\(s\) \['x'\] that the parameters do not"):
        multi_transform({"a": optim.sgd(0.1)}, {"enc": "a", "dec": {"w": "a", "b": "a", "x": "a"}, "head": "a"}).init(
            params
        )
    with pytest.raises(ValueError, match=r"add_decayed_weights: mask must .* at 'enc' mask has no entry"):
        optim.add_decayed_weights(0.1, {"enc": {"w": True}, "dec": True, "head": True}).update(params, (), params)


def test_dotted_names_are_not_prefixes_and_the_message_says_what_to_write():
    """funcamp's parameters are a flat dict of dotted names; optax's trees are nested, and it never reads a key as
    a prefix of dotted names: neither does funcamp, and the message shows the callable to write instead."""
    params = {"0.weight": torch.ones(2), "0.bias": torch.ones(2), "1.weight": torch.ones(2)}
    opt = masked(optim.sgd(0.1), {"0": False, "1": True})
    with pytest.raises(
        ValueError,
        match=r"dict keys are matched whole, not as dotted prefixes: '0' does not cover '0\.\w+' in a flat dict.*"
        r"lambda params: \{k: not k.startswith\('0.'\) for k in params\}",
    ):
        opt.init(params)
    suggested = masked(optim.sgd(0.1), lambda params: {k: not k.startswith("0.") for k in params})
    updates, _ = suggested.update(params, suggested.init(params), params)
    assert torch.equal(updates["0.weight"], torch.ones(2)) and torch.equal(updates["1.weight"], torch.full((2,), -0.1))


def test_an_inner_mask_may_hold_any_value_where_the_outer_group_left_none():
    """As optax accepts any value in place of its MaskedNode: a mask written for the whole tree works one level down."""
    params = {"a": torch.ones(2), "b": torch.ones(2)}
    inner = masked(optim.scale(-1.0), {"a": True, "b": True})  # the whole tree's mask, inside group "x" = {"a"}
    opt = multi_transform({"x": inner, "y": set_to_zero()}, {"a": "x", "b": "y"})
    updates, _ = opt.update(params, opt.init(params), params)
    assert torch.equal(updates["a"], -torch.ones(2)) and torch.equal(updates["b"], torch.full((2,), -0.0))


def test_prefix_trees_compile_in_one_graph():
    """Dynamo traces the prefix walk (plain Python over the mask and the parameters' containers): fullgraph, and
    the compiled updates are the eager ones."""
    params = _nested()
    opt = optim.chain(
        masked(optim.add_decayed_weights(0.1), {"enc": True, "dec": False, "head": [False, True]}),
        multi_transform(
            {"a": optim.adam(0.1), "b": optim.sgd(0.1)}, {"enc": "a", "dec": {"w": "a", "b": "b"}, "head": "b"}
        ),
    )

    def step(g, state, p):
        return opt.update(g, state, p)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    state = opt.init(params)
    want, _ = step(_nested(1), state, params)
    got, _ = compiled(_nested(1), state, params)
    for a, b in zip(_tree.tree_leaves(want), _tree.tree_leaves(got), strict=True):
        assert torch.equal(a, b)


def test_label_without_transform_names_parameter_and_labels():
    opt = multi_transform({"decay": optim.sgd(0.1), "no_decay": optim.sgd(0.1)}, {"w": "decay", "b": "nodecay"})
    with pytest.raises(ValueError, match=r"parameter 'b' has label 'nodecay'.*\['decay', 'no_decay'\].*set_to_zero"):
        opt.init({"w": torch.ones(1), "b": torch.ones(1)})


def test_bad_mask_labels_and_transforms():
    params = {"w": torch.ones(1)}
    with pytest.raises(TypeError, match=r"mask leaves must be Python bools.*Tensor at 'w'"):
        masked(optim.sgd(0.1), {"w": torch.tensor(True)}).init(params)
    with pytest.raises(TypeError, match=r"labels must be hashable.*Tensor at 'w'"):
        multi_transform({"a": optim.sgd(0.1)}, {"w": torch.tensor(0)}).init(params)
    with pytest.raises(TypeError, match=r"non-empty mapping"):
        multi_transform({}, {"w": "a"})
    with pytest.raises(TypeError, match=r"transforms\['a'\] must be a GradientTransformation, got function"):
        multi_transform({"a": optim.sgd}, {"w": "a"})
    with pytest.raises(TypeError, match=r"masked: inner must be a GradientTransformation"):
        masked(lambda g: g, {"w": True})
    opt = multi_transform({"a": optim.sgd(0.1)}, {"w": "a"})
    other = multi_transform({"b": optim.sgd(0.1)}, {"w": "b"})
    with pytest.raises(ValueError, match=r"state has labels \['b'\] but transforms has \['a'\]"):
        opt.update({"w": torch.ones(1)}, other.init(params), params)
