"""Memory a flat state shares with something else (issue 47, classes 2-4 and the flat host boundary's faults).

A flat state (funcamp/train/_flat.py) holds its parameters and optimizer state as views of one buffer per group,
laid out by ``TrainState.create``; a state made from other tensors (``replace``, a load) is copied into new
buffers; the compiled step's host boundary (``Flat.enter``) takes the buffers the views are of, or copies a
state whose tensors are not those views into new ones and, donating, writes the results back into the given
tensors after the call. Nothing is re-pointed (``Tensor.set_``).

The sweeps here use parameter sizes that are not multiples of 16 floats (padding and 64-byte alignment between
the members of a buffer), and compare each step with the eager step over a state kept leaf by leaf
(``FUNCAMP_FLAT=off``): bitwise for these elementwise optimizers, the clip included (its norm is taken over the
members' views), since for this model ``aot_eager`` is bitwise eager (the mask sweep checks it). Compiled steps
use ``aot_eager`` (the layout is the point, not inductor's lowering); one compile per test.

Planted faults (each run, watched fail, restored):

- ``Flat._buffer`` without its offset check (either of its two tests): parameters that are views of one vector
  in module order are taken as the buffer, read shifted
  (:func:`test_parameters_that_are_views_of_one_vector_are_copied_in`);
- ``any`` for ``all`` in ``Flat._buffer`` (either test): a leaf replaced between steps is never trained
  (:func:`test_a_leaf_replaced_between_steps_is_trained`);
- the copied-in buffer made in the parameters' dtype: bfloat16 parameters get bfloat16 moments
  (:func:`test_bf16_parameters_keep_float32_moments_when_copied_in`);
- the write-back after a donating call dropped (:func:`test_a_state_off_its_buffers_gets_the_results_written_back`,
  and the bfloat16 test);
- no alignment between members (``_aligned`` returning its offset):
  :func:`test_views_kept_of_a_state_see_every_donated_step`.

On the code before the storage rebuild (54d4102) the class sweeps fail: a donating compiled step re-pointed the
state's tensors (a view kept of one went stale, every ``data_ptr`` moved), a part of a stepped state saved its
whole buffer (35,753 bytes for an 84-byte head), pickling wrote each buffer once per view (139 KB for 68 KB), and
a mask reading ``requires_grad`` was not refused. A mask reading the device was recorded on the layout's meta
stand-ins (the compiled flat step decayed nothing): found here, refused while recording now, so such a state is
kept leaf by leaf (:func:`test_a_mask_reading_the_device_decays_as_eagerly`).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from _storage import storage_kind
from test_flat import _assert_bitwise, _assert_clipped

import funcamp as fa
from funcamp import _tree, optim

BACKEND = "aot_eager"
STEPS = 3


def _params(dtype=torch.float32):
    """Odd sizes (45, 9, 27, 3 and 1 floats: no member a multiple of 16), in module order (not sorted order)."""
    g = torch.Generator().manual_seed(0)
    made = {
        "w1": torch.randn(5, 9, generator=g) * 0.5,
        "b1": torch.randn(9, generator=g) * 0.1,
        "w2": torch.randn(9, 3, generator=g) * 0.5,
        "b2": torch.randn(3, generator=g) * 0.1,
        "gain": torch.tensor(1.5),
    }
    return {k: v.to(dtype) for k, v in made.items()}


def _loss(p, batch):
    x, y = batch
    h = torch.relu(x @ p["w1"].float() + p["b1"].float())
    return torch.nn.functional.cross_entropy((h @ p["w2"].float() + p["b2"].float()) * p["gain"].float(), y)


def _batches(n=STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _by_ndim(tree):
    return _tree.tree_map(lambda x: x.ndim >= 2, tree)


def _clip_adamw():
    """The main job's optimizer: a clip that always clips, AdamW with no decay on vectors (two buffers)."""
    return optim.chain(optim.clip_by_global_norm(0.05), optim.adamw(1e-2, weight_decay=0.1, mask=_by_ndim))


def _step(optimizer, *, compile=True, donate=False):
    torch._dynamo.reset()
    if compile:
        return fa.make_train_step(_loss, optimizer, backend=BACKEND, donate=donate)
    return fa.make_train_step(_loss, optimizer, compile=False, donate=donate)


def _reference(params, optimizer, batches, monkeypatch, *, compile=False, replace=None):
    """The pure step over a state kept leaf by leaf, from ``params``: the state after each batch (clones).
    Eager by default: for this model ``aot_eager`` is bitwise eager (checked by
    :func:`test_masks_by_ndim_or_name_decay_alike_everywhere`), and an eager reference compiles nothing.
    ``replace(i, state)``, if given, makes the state the ``i``-th batch is given."""
    with monkeypatch.context() as m:
        m.setenv("FUNCAMP_FLAT", "off")
        state = fa.TrainState.create(_tree.tree_map(torch.clone, params), optimizer)
        step = _step(optimizer, compile=compile)
        out = []
        for i, batch in enumerate(batches):
            state = state if replace is None else replace(i, state)
            state, _ = step(state, batch)
            out.append(_tree.tree_map(torch.clone, (state.params, state.opt_state)))
    return out


# --- class 2: donation writes into the caller's memory, re-points nothing -------------------------------------


def _padding(state):
    """The elements of the state's buffers that no leaf covers (the padding between and after members)."""
    leaves = [x for x in _tree.tree_leaves((state.params, state.opt_state)) if x._base is not None]
    bases = {id(x._base): x._base for x in leaves}
    covered = {k: torch.zeros(b.numel(), dtype=torch.bool) for k, b in bases.items()}
    for x in leaves:
        start = x.storage_offset() - x._base.storage_offset()
        covered[id(x._base)][start : start + x.numel()] = True
    return torch.cat([b[~covered[k]].float() for k, b in bases.items()])


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
def test_views_kept_of_a_state_see_every_donated_step(compile):
    """Views the user keeps of a state's tensors (a transpose, a row, a moment's column, a 0-d parameter) hold the
    values of every later donated step, and every tensor of the state keeps its ``data_ptr``: the donating step
    writes into the given memory. The layout of odd sizes: every leaf starts on a 64-byte line
    (``_flat.ALIGN_BYTES``) and the padding between members stays zero. On the code before the rebuild the
    compiled step re-pointed the tensors at its buffers at the first call: the views stayed behind, every
    ``data_ptr`` moved. Planted: no alignment (``_flat._aligned`` returning its offset): fails."""
    from funcamp.train import _flat

    optimizer = _clip_adamw()
    state = fa.TrainState.create(_params(), optimizer)
    kept = {
        "w1.T": lambda s: s.params["w1"].T,
        "w2[1]": lambda s: s.params["w2"][1],
        "gain": lambda s: s.params["gain"],
        "mu.w1[:, 2]": lambda s: s.opt_state[1][0].mu["w1"][:, 2],  # chain(clip, adamw = chain(adam, decay, lr))
        "nu.b1": lambda s: s.opt_state[1][0].nu["b1"],
    }
    views = {k: f(state) for k, f in kept.items()}
    before = {k: v.clone() for k, v in views.items()}
    held = _tree.tree_leaves((state.params, state.opt_state))
    ptrs = [x.data_ptr() for x in held]
    step = _step(optimizer, compile=compile, donate=True)
    for batch in _batches():
        state, _ = step(state, batch)
    for name, f in kept.items():
        assert not torch.equal(before[name], f(state)), f"the steps moved {name}"
        assert torch.equal(views[name], f(state)), f"a view kept of {name} is stale"
    assert [x.data_ptr() for x in held] == ptrs, "a tensor of the given state was re-pointed"
    assert all(x is y for x, y in zip(held, _tree.tree_leaves((state.params, state.opt_state)), strict=True))
    if getattr(state, "storage", None) is not None:  # the layout (the code before the rebuild had none)
        assert all(x.data_ptr() % _flat.ALIGN_BYTES == 0 for x in held if x.ndim > 0), "a leaf off a 64-byte line"
        padding = _padding(state)
        assert padding.numel() > 0 and bool((padding == 0).all()), "odd sizes leave padding, and it stays zero"


def _off_buffers(state, optimizer, how):
    """``state`` with every parameter and optimizer-state leaf in other memory than its buffers, as a state gets
    it from a pure eager step (``"eager"``: the step takes the first batch) or from a hand that swaps its fields
    past ``replace`` (``"hand"``: each leaf a clone, ``w1`` the transpose of a tensor the user stores, as a module
    holding ``stored`` and reading ``stored.T`` would). Returns the state and the stored tensor (or None)."""
    if how == "eager":
        state, _ = _step(optimizer, compile=False)(state, _batches(1)[0])
        return state, None
    stored = state.params["w1"].T.clone()  # (9, 5); the state's w1 is its transpose, a non-contiguous view
    params = {**_tree.tree_map(torch.clone, state.params), "w1": stored.T}
    object.__setattr__(state, "params", params)  # past TrainState.__post_init__ (which would copy them in)
    object.__setattr__(state, "opt_state", _tree.tree_map(torch.clone, state.opt_state))
    return state, stored


def test_a_state_off_its_buffers_gets_the_results_written_back(monkeypatch):
    """A flat state whose tensors are not its buffers' views (the result of a pure eager step; leaves swapped by
    hand, one the transpose of a stored tensor) enters the donating compiled step by a copy into new buffers, and
    the results are written back into the given tensors after the call: each holds what the per-leaf step
    computes (within the clip's round-off, :func:`_assert_clipped`), at its own ``data_ptr``; later steps go on
    alike. Planted: the write-back dropped
    (``Flat.enter``'s ``after``): the given tensors keep the old values, and so does the returned state. On the
    code before the rebuild the tensors were re-pointed (``set_``): values right, every ``data_ptr`` moved."""
    optimizer = _clip_adamw()
    batches = _batches(STEPS + 1)
    want = _reference(_params(), optimizer, batches, monkeypatch)
    step = _step(optimizer, donate=True)  # one compile: both states have one structure
    for how in ("eager", "hand"):
        state, stored = _off_buffers(fa.TrainState.create(_params(), optimizer), optimizer, how)
        first = 1 if how == "eager" else 0
        held = _tree.tree_leaves((state.params, state.opt_state))
        assert all(x._base is None or x._base is stored for x in _tree.tree_leaves(state.params)), "off the buffers"
        ptrs = [x.data_ptr() for x in held]
        new, _ = step(state, batches[first])
        given = _tree.tree_unflatten(_tree.tree_structure((new.params, new.opt_state)), held)
        _assert_clipped(given, want[first], (how, "the given tensors after the call"))
        _assert_clipped((new.params, new.opt_state), want[first], (how, "the returned state"))
        assert [x.data_ptr() for x in held] == ptrs, (how, "a given tensor was re-pointed")
        if stored is not None:
            # the stored tensor the state's w1 is a view of holds the step's result
            _assert_clipped(stored, want[first][0]["w1"].T, (how, "the stored tensor"))
        for batch, expected in zip(batches[first + 1 :], want[first + 1 :], strict=False):
            new, _ = step(new, batch)
            _assert_clipped((new.params, new.opt_state), expected, (how, "a later step"))


# --- the host boundary's faults -----------------------------------------------------------------------------


def test_a_leaf_replaced_between_steps_is_trained(monkeypatch):
    """A state given a new tensor for one leaf (``replace``) between donating compiled steps trains that tensor's
    values: the per-leaf step that replaced the same leaves (within the clip's round-off). Replaced in turn: ``w2`` (the
    second member of the decayed matrices' buffer), ``b1`` (the first of the other buffer's), and ``w2``'s first moment.
    Planted: ``any`` for ``all`` in ``Flat._buffer`` (the group taken as the replaced leaf's old buffer): the replaced
    leaf is never read or trained."""
    optimizer = _clip_adamw()
    batches = _batches(4)
    g = torch.Generator()

    def replace(i, state):
        if i == 0:
            g.manual_seed(7)
            return state
        if i == 3:
            adam = state.opt_state[1][0]
            mu = {**adam.mu, "w2": torch.randn(9, 3, generator=g) * 0.01}
            return state.replace(opt_state=(state.opt_state[0], (adam._replace(mu=mu), *state.opt_state[1][1:])))
        name = "w2" if i == 1 else "b1"
        return state.replace(params={**state.params, name: torch.randn(state.params[name].shape, generator=g)})

    want = _reference(_params(), optimizer, batches, monkeypatch, replace=replace)
    state = fa.TrainState.create(_params(), optimizer)
    assert len(state.storage.groups) == 2
    step = _step(optimizer, donate=True)
    for i, (batch, expected) in enumerate(zip(batches, want, strict=True)):
        state, _ = step(replace(i, state), batch)
        _assert_clipped((state.params, state.opt_state), expected, f"step {i}")


def test_parameters_that_are_views_of_one_vector_are_copied_in(monkeypatch):
    """Parameters that are views of one vector in module order (``w1, b1, w2, b2, gain`` packed end to end, the
    vector as long as the buffer) are not the buffer, whose members sit in sorted order at aligned offsets: a state
    given them (``replace``) holds copies of them, and its compiled step is the per-leaf step, bitwise. Given as
    slices of the vector (``_base`` is it) and as detached slices (one storage, no ``_base``). Planted:
    ``Flat._buffer`` without its offset check (the first or the second test there): the vector is taken as the
    buffer, the state holds the given tensors, and the step reads the parameters shifted and swapped."""
    optimizer = optim.sgd(1e-1, momentum=0.9)  # one group: every parameter in one buffer
    params = _params()
    batch = _batches(1)[0]
    want = _reference(params, optimizer, [batch], monkeypatch)[0]
    state = fa.TrainState.create(_tree.tree_map(torch.clone, params), optimizer)
    (group,) = state.storage.groups
    vector, at, views = torch.zeros(group.numel), 0, {}
    for name, x in params.items():  # module order
        views[name] = vector[at : at + x.numel()].view(x.shape)
        views[name].copy_(x)
        at += x.numel()
    assert at < group.numel and list(params) != sorted(params)
    step = _step(optimizer)
    for how, given in {"views": views, "same storage": {k: v.detach() for k, v in views.items()}}.items():
        made = state.replace(params=given)
        new, _ = step(made, batch)
        _assert_bitwise((new.params, new.opt_state), want, how)
        assert all(x.untyped_storage().data_ptr() != vector.data_ptr() for x in made.params.values()), how


def test_bf16_parameters_keep_float32_moments_when_copied_in(monkeypatch):
    """bfloat16 parameters with float32 moments (``adamw``'s, beside ``kahan_summation``'s bfloat16
    compensations) in a state copied into new buffers (``replace`` with fresh tensors, then a pure eager step's
    result): the moments stay float32 and the donating compiled steps are the per-leaf steps, bitwise. Planted:
    the copied-in buffer made in the parameters' dtype (``Flat._buffer``): the moments come back bfloat16."""
    optimizer = optim.kahan_summation(optim.adamw(1e-2))
    params = _params(torch.bfloat16)
    batches = _batches(3)
    want = _reference(params, optimizer, batches, monkeypatch)
    state = fa.TrainState.create(_tree.tree_map(torch.clone, params), optimizer)
    dtypes = [x.dtype for x in _tree.tree_leaves(state.opt_state)]
    assert torch.float32 in dtypes and torch.bfloat16 in dtypes, "float32 moments, bfloat16 compensations"
    clone = lambda tree: _tree.tree_map(torch.clone, tree)  # noqa: E731
    state = state.replace(params=clone(state.params), opt_state=clone(state.opt_state))  # copied in
    assert [x.dtype for x in _tree.tree_leaves(state.opt_state)] == dtypes, "the copied-in moments' dtypes"
    state, _ = _step(optimizer, compile=False)(state, batches[0])  # an eager step: its result off the buffers
    step = _step(optimizer, donate=True)
    for batch, expected in zip(batches[1:], want[1:], strict=True):
        state, _ = step(state, batch)
        assert [x.dtype for x in _tree.tree_leaves(state.opt_state)] == dtypes
        _assert_bitwise((state.params, state.opt_state), expected, "kahan adamw")


# --- class 3: a part of a flat state owns only its bytes on disk ------------------------------------------------


@pytest.fixture(scope="module")
def big_state():
    """A flat state of a 257 x 33 matrix and a 3 x 7 head (one buffer, and one of the momentum), after one donating
    compiled step (the code before the rebuild laid the buffers out there)."""
    optimizer = optim.sgd(1e-2, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    state = fa.TrainState.create(
        {"big": torch.randn(257, 33, generator=g), "head": torch.randn(3, 7, generator=g)}, optimizer
    )
    torch._dynamo.reset()
    step = fa.make_train_step(
        lambda p, b: (p["big"].sum() + p["head"].sum()) * b, optimizer, backend=BACKEND, donate=True
    )
    state, _ = step(state, torch.tensor(1.0))
    return state


def _storage_bytes(tree):
    """The bytes of the distinct storages the tensors of ``tree`` are on."""
    return sum({x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in _tree.tree_leaves(tree)}.values())


def test_saving_part_of_a_flat_state_writes_only_its_bytes(big_state, tmp_path):
    """``funcamp.checkpoint.save`` of the head alone (84 bytes of a 34 KB buffer) writes what saving a clone of it
    writes, and the loaded head owns only its bytes; the whole state still writes each buffer once. On the code
    before the rebuild the part's file held the whole buffer."""
    head = big_state.params["head"]
    assert head.untyped_storage().nbytes() > 100 * head.nbytes, "the head is a part of a larger buffer"
    sizes = {}
    for name, tree in {"part": {"head": head}, "clone": {"head": head.clone()}}.items():
        fa.checkpoint.save(tmp_path / name, tree)
        sizes[name] = (tmp_path / name).stat().st_size
    assert sizes["part"] <= sizes["clone"] + 64, sizes
    loaded = fa.checkpoint.load(tmp_path / "part")["head"]
    assert torch.equal(loaded, head) and loaded.untyped_storage().nbytes() == head.nbytes
    fa.checkpoint.save(tmp_path / "state", big_state)
    assert (tmp_path / "state").stat().st_size < _storage_bytes(big_state) * 1.1 + 16384


def test_pickling_a_flat_state_writes_each_buffer_once(big_state):
    """``pickle.dumps`` of a flat state (two parameters and two momentum traces, views of two buffers; ``pickle``
    writes a view's whole storage, once per view) is about the buffers' bytes once; unpickled and deep-copied
    states equal it and hold views of buffers of their own. On the code before the rebuild a stepped state pickled
    each buffer once per view (2x here)."""
    size = len(pickle.dumps(big_state))
    assert size < _storage_bytes(big_state) * 1.1 + 16384, (size, _storage_bytes(big_state))
    for other in (pickle.loads(pickle.dumps(big_state)), copy.deepcopy(big_state)):
        _assert_bitwise((other.params, other.opt_state), (big_state.params, big_state.opt_state), "round trip")
        big, head = other.params["big"], other.params["head"]
        assert big.data_ptr() != big_state.params["big"].data_ptr()
        assert big._base is not None and big.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()


def test_a_flat_checkpoint_loaded_into_a_per_leaf_state_shares_no_memory(big_state, tmp_path, monkeypatch):
    """A checkpoint of a flat state (each buffer saved whole, the leaves views of it) loaded into a state kept leaf
    by leaf (``FUNCAMP_FLAT=off``; a transformation that is not elementwise) gives each leaf its own memory, as
    ``like``'s: a compiled step with telemetry runs on it. Found by the differential tester (``storage=
    "alternate"``): the loaded leaves were views of one storage and the telemetry's ``torch.cond`` refused them
    ("Encountered aliasing during higher order op tracing"); fixed in ``funcamp.checkpoint`` (``_decode_tensor``).
    Without the fix: fails."""
    fa.checkpoint.save(tmp_path / "flat", big_state)
    optimizer = optim.sgd(1e-2, momentum=0.9)
    with monkeypatch.context() as m:
        m.setenv("FUNCAMP_FLAT", "off")
        like = fa.TrainState.create(_tree.tree_map(torch.zeros_like, big_state.params), optimizer)
    loaded = fa.checkpoint.load(tmp_path / "flat", like=like)
    assert loaded.storage.kind == "per leaf"
    _assert_bitwise((loaded.params, loaded.opt_state), (big_state.params, big_state.opt_state), "loaded")
    leaves = _tree.tree_leaves((loaded.params, loaded.opt_state))
    assert all(x.untyped_storage().nbytes() == x.nbytes for x in leaves if x.ndim), "each leaf its own memory"
    torch._dynamo.reset()
    # (a loss linear in the parameters would not do: its gradients, expansions of one tensor, alias each other, and
    # torch.cond refuses them whatever the storage: a separate, older fault)
    loss = lambda p, b: (p["big"].square().sum() + p["head"].square().sum()) * b  # noqa: E731
    step = fa.make_train_step(loss, optimizer, backend=BACKEND, telemetry=1)
    new, metrics = step(loaded, torch.tensor(1.0))
    assert bool(metrics["grads_finite"])


# --- class 4: masks are evaluated on what the parameters are, or refused ----------------------------------------


def test_a_mask_reading_requires_grad_is_refused():
    """nanoGPT's decay rule ``p.requires_grad and p.ndim >= 2`` is given the state's tensors (never requiring
    grad): it would decay nothing. ``TrainState.create`` refuses it with a message that says what to select by.
    On the code before the rebuild the compiled step decayed nothing and the eager one every matrix."""
    rule = lambda p: _tree.tree_map(lambda x: x.requires_grad and x.ndim >= 2, p)  # noqa: E731
    for optimizer in (optim.adamw(1e-2, weight_decay=0.1, mask=rule), optim.multi_transform(
        {True: optim.adamw(1e-2), False: optim.adam(1e-2)}, rule
    )):  # fmt: skip
        with pytest.raises(TypeError, match=r"read p\.requires_grad.*Select by name .* or by shape \(p\.ndim >= 2\)"):
            fa.TrainState.create(_params(), optimizer)


def _masked_everywhere():
    """Decay masks of every kind in one optimizer: labels by ``ndim``; in the matrices' group a mask callable of
    names (``w1`` only); in the other a dict by name (``b1`` only); over all, a mask by ``ndim`` (``w1``, ``w2``)."""
    names = lambda tree: {k: k == "w1" for k in tree}  # noqa: E731
    by_dict = {"w1": False, "b1": True, "w2": False, "b2": False, "gain": False}
    return optim.chain(
        optim.multi_transform(
            {
                "mat": optim.adamw(1e-2, weight_decay=0.5, mask=names),
                "vec": optim.adamw(1e-2, weight_decay=0.5, mask=by_dict),
            },
            lambda p: _tree.tree_map(lambda x: "mat" if x.ndim >= 2 else "vec", p),
        ),
        optim.add_decayed_weights(1e-3, mask=_by_ndim),
    )


def test_masks_by_ndim_or_name_decay_alike_everywhere(monkeypatch):
    """Masks by ``ndim`` and by name (a callable of names, a dict, labels by ``ndim``) give the same parameters and
    moments compiled and eager, flat and per leaf: bitwise after 2 steps. Each mask acts: one eager step without
    each decay leaves exactly the parameters that mask selects unchanged."""
    batches = _batches(2)
    runs = {}
    for compile in (True, False):
        for flat in (True, False):
            with storage_kind(flat) as kind:
                optimizer = _masked_everywhere()
                state = fa.TrainState.create(_params(), optimizer)
                assert state.storage.kind == kind
                if flat:
                    assert len(state.storage.groups) == 4  # {w1}, {w2}, {b1}, {b2, gain}
                step = _step(optimizer, compile=compile)
                for batch in batches:
                    state, _ = step(state, batch)
            runs[compile, flat] = (state.params, state.opt_state)
    for key, run in runs.items():
        _assert_bitwise(run, runs[True, True], key)
    one = _reference(_params(), _masked_everywhere(), batches[:1], monkeypatch)[0][0]
    for off, selected in {"mat": ["w1"], "vec": ["b1"], "all": ["w1", "w2"]}.items():
        plain = optim.chain(
            optim.multi_transform(
                {g: optim.adamw(1e-2, weight_decay=0.0 if off == g else 0.5, mask=m) for g, m in
                 {"mat": lambda tree: {k: k == "w1" for k in tree},
                  "vec": {"w1": False, "b1": True, "w2": False, "b2": False, "gain": False}}.items()},
                lambda p: _tree.tree_map(lambda x: "mat" if x.ndim >= 2 else "vec", p),
            ),
            optim.add_decayed_weights(0.0 if off == "all" else 1e-3, mask=_by_ndim),
        )  # fmt: skip
        without = _reference(_params(), plain, batches[:1], monkeypatch)[0][0]
        assert [k for k in one if not torch.equal(one[k], without[k])] == selected, off


@pytest.mark.parametrize("read", ["device", "is_cpu", "get_device"])
def test_a_mask_reading_the_device_decays_as_eagerly(read, monkeypatch):
    """A mask callable that reads the parameters' device (decay what lives on the CPU) would be recorded on the
    flat layout's shape-only stand-ins (device ``meta``): the state is kept leaf by leaf and says why, and the
    compiled step decays what the eager one does, bitwise. Found by this test: the compiled flat step decayed
    nothing, the eager one every parameter; fixed in ``funcamp.optim._flat._StateTensorsOnly`` (device reads
    refused while a layout records). Without the fix: fails."""
    on_cpu = {
        "device": lambda x: x.device.type == "cpu",
        "is_cpu": lambda x: x.is_cpu,
        "get_device": lambda x: x.get_device() == -1,
    }[read]
    optimizer = optim.adamw(1e-2, weight_decay=0.5, mask=lambda p: _tree.tree_map(on_cpu, p))
    state = fa.TrainState.create(_params(), optimizer)
    assert state.storage.kind == "per leaf" and "device" in state.storage.reason
    batches = _batches(2)
    runs = _reference(_params(), optimizer, batches, monkeypatch)
    decay_off = _reference(_params(), optim.adam(1e-2), batches[:1], monkeypatch)[0][0]
    assert all(not torch.equal(runs[0][0][k], decay_off[k]) for k in decay_off), "every parameter decayed"
    want = runs[-1]
    if read == "device":  # one compile is enough: the state's storage is the point
        step = _step(optimizer)
        for batch in batches:
            state, _ = step(state, batch)
        _assert_bitwise((state.params, state.opt_state), want, read)
