"""funcamp.checkpoint: round trips of every state type, weights_only loading, atomicity, clear errors."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import funcamp as fa
from funcamp import _tree, checkpoint, optim
from funcamp.checkpoint import CheckpointMismatchError, CorruptCheckpointError


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(4, 3, generator=g),
        "layer.bias": torch.randn(4, generator=g),
        "norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
    }


def _optimizer() -> optim.GradientTransformation:
    schedule = optim.warmup_cosine_decay(1e-2, warmup=2, total=10)
    return optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(schedule, weight_decay=0.1))


def _state(loss_scale: fa.LossScale | None = None, params: dict | None = None) -> fa.TrainState:
    opt = _optimizer()
    ls = fa.DynamicLossScale(2.0**10, period=3, min_loss_scale=0.25, hysteresis=2) if loss_scale is None else loss_scale
    return fa.TrainState.create(_params() if params is None else params, opt, loss_scale=ls)


def _trained_state(steps: int = 3) -> fa.TrainState:
    """A state whose counters, moments and loss scale have all moved (a step of non-finite grads too)."""
    opt = _optimizer()
    state = _state()
    step = fa.make_train_step(
        lambda p, b: (p["layer.weight"] @ b).float().pow(2).mean() + p["norm.weight"].sum(), opt, compile=False
    )
    for i in range(steps):
        x = torch.full((3,), float("inf")) if i == 1 else torch.ones(3)
        state, _ = step(state, x)
    return state


def _assert_equal_trees(a, b) -> None:
    la, sa = _tree.tree_flatten(a)
    lb, sb = _tree.tree_flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        assert type(x) is type(y)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device
            assert torch.equal(x, y)
        else:
            assert x == y


def test_train_state_round_trip_with_and_without_like(tmp_path):
    state = _trained_state()
    assert int(state.skipped_steps) == 1 and int(state.step) == 3  # the state has really moved
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, state)
    alone = checkpoint.load(path)  # without like: the static fields are the defaults, the storage per leaf
    assert alone.storage.kind == "per leaf" and state.storage.kind == "flat"
    _assert_equal_trees(alone, dataclasses.replace(state, storage=fa.train.PerLeaf()))
    into = checkpoint.load(path, like=_state())  # into a created state: its storage, the tensors laid out in it
    _assert_equal_trees(into, state)
    assert into.storage.kind == "flat" and all(p._base is not None for p in into.params.values())
    loaded = checkpoint.load(path)
    assert type(loaded.opt_state[1][0]) is optim.ScaleByAdamState
    assert loaded.loss_scale.hysteresis == 2 and loaded.loss_scale.min_loss_scale == 0.25


def test_file_loads_with_plain_torch_load_weights_only(tmp_path):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, {"state": _trained_state(), "policy": fa.get_policy("mixed_float16")})
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == "funcamp.checkpoint" and raw["version"] == 1
    assert raw["tree"]["$"] == "dict"


@pytest.mark.parametrize(
    "loss_scale",
    [fa.NoOpLossScale(), fa.StaticLossScale(128.0), fa.DynamicLossScale(2.0**15, period=7, backoff_factor=0.25)],
    ids=["noop", "static", "dynamic"],
)
def test_loss_scales_round_trip(tmp_path, loss_scale):
    path = tmp_path / "ls.pt"
    checkpoint.save(path, loss_scale)
    loaded = checkpoint.load(path)
    assert type(loaded) is type(loss_scale)
    _assert_equal_trees(loaded, loss_scale)
    assert loaded.state_dict().keys() == loss_scale.state_dict().keys()


def test_policy_dtypes_and_python_values_round_trip(tmp_path):
    tree = {
        "policy": fa.get_policy("params=float32,compute=float16,output=float32,reduce=bfloat16"),
        "dtype": torch.bfloat16,
        "config": {"lr": 3e-4, "name": "gpt", "layers": 4, "flag": True, "none": None},
        "pair": (1, [2.5, "x"]),
        "ints": torch.arange(3, dtype=torch.int64),
        "rng": torch.get_rng_state(),
    }
    path = tmp_path / "misc.pt"
    checkpoint.save(path, tree)
    loaded = checkpoint.load(path)
    assert loaded["policy"] == tree["policy"] and loaded["dtype"] is torch.bfloat16
    assert loaded["config"] == tree["config"] and loaded["pair"] == (1, [2.5, "x"])
    assert torch.equal(loaded["ints"], tree["ints"]) and torch.equal(loaded["rng"], tree["rng"])


def test_loaded_state_has_the_same_treespec_so_the_step_does_not_recompile(tmp_path):
    state = _trained_state(2)
    checkpoint.save(tmp_path / "c.pt", state)
    loaded = checkpoint.load(tmp_path / "c.pt", like=_state())
    assert _tree.tree_structure(loaded) == _tree.tree_structure(state)


def test_resume_continues_bit_for_bit(tmp_path):
    opt = _optimizer()

    def loss_fn(p, b):
        return ((p["layer.weight"] @ b + p["layer.bias"]).float() * p["norm.weight"].float()).pow(2).mean()

    step = fa.make_train_step(loss_fn, opt, compile=False)
    batches = [torch.randn(3, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    state = _state()
    for i, b in enumerate(batches):
        state, _ = step(state, b)
        if i == 2:
            checkpoint.save(tmp_path / "c.pt", state)
    resumed = checkpoint.load(tmp_path / "c.pt", like=_state())
    for b in batches[3:]:
        resumed, _ = step(resumed, b)
    _assert_equal_trees(resumed, state)


def test_save_is_atomic_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, {"x": torch.ones(2)})

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(path, {"x": torch.zeros(2)})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left behind
    assert torch.equal(checkpoint.load(path)["x"], torch.ones(2))


def test_save_keeps_the_temporary_file_of_a_process_it_cannot_signal(tmp_path, monkeypatch):
    """A save removes a killed writer's temporary file (its process gone: ``os.kill(pid, 0)`` raises
    ``ProcessLookupError``) but keeps one whose process it may not signal (``PermissionError``, EPERM: another
    user's live process, mid-save). ``os.kill`` is faked: this suite may run as root, which may signal anyone.
    (Planted: EPERM read as "gone": the live writer's file is deleted.)"""
    from funcamp.checkpoint import _atomic

    other_user, gone = 3999991, 3999992
    real_kill = os.kill

    def kill(pid, sig):
        if pid == other_user:
            raise PermissionError(1, "Operation not permitted")
        if pid == gone:
            raise ProcessLookupError(3, "No such process")
        return real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill)
    host = _atomic._host()
    live, stale = tmp_path / f".ckpt.pt.{host}-{other_user}.x.tmp", tmp_path / f".ckpt.pt.{host}-{gone}.y.tmp"
    live.write_text("another user's save, in progress")
    stale.write_text("a killed writer's")
    checkpoint.save(tmp_path / "ckpt.pt", {"x": torch.ones(2)})
    assert live.exists() and not stale.exists()


def test_truncated_file_raises_corrupt_error_naming_the_path(tmp_path):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, _state())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match=str(path)):
        checkpoint.load(path)


def test_not_a_funcamp_checkpoint(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(1)}, path)
    with pytest.raises(CorruptCheckpointError, match="not a funcamp checkpoint"):
        checkpoint.load(path)
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CorruptCheckpointError, match="plain.pt"):
        checkpoint.load(path)


def test_newer_format_version_is_refused(tmp_path):
    path = tmp_path / "v2.pt"
    torch.save({"format": "funcamp.checkpoint", "version": 2, "tree": None}, path)
    with pytest.raises(CorruptCheckpointError, match="version 2"):
        checkpoint.load(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint.load(tmp_path / "nope.pt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint.save(tmp_path / "no_dir" / "c.pt", {})


def test_mismatch_errors_name_the_path_and_what_differs(tmp_path):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, {"state": _state()})

    wider = {**_params(), "layer.weight": torch.zeros(4, 5)}
    with pytest.raises(CheckpointMismatchError, match=r"state\.params\.layer\.weight has shape \(4, 3\)"):
        checkpoint.load(path, like={"state": _state(params=wider)})

    half = {**_params(), "layer.bias": torch.zeros(4, dtype=torch.float16)}
    with pytest.raises(CheckpointMismatchError, match=r"layer\.bias has dtype torch\.float32 .* torch\.float16"):
        checkpoint.load(path, like={"state": _state(params=half)})

    extra = {**_params(), "head.weight": torch.zeros(2)}
    with pytest.raises(CheckpointMismatchError, match=r"missing \['head\.weight'\]"):
        checkpoint.load(path, like={"state": _state(params=extra)})

    with pytest.raises(CheckpointMismatchError, match="DynamicLossScale in the checkpoint but a dataclass .*NoOp"):
        checkpoint.load(path, like={"state": _state(loss_scale=fa.NoOpLossScale())})

    with pytest.raises(CheckpointMismatchError, match=r"missing \['model'\], unexpected \['state'\]"):
        checkpoint.load(path, like={"model": _state()})

    with pytest.raises(CheckpointMismatchError, match="ckpt.pt: the root is a dict in the checkpoint but a list"):
        checkpoint.load(path, like=[1])


def test_without_like_only_funcamp_types_are_rebuilt(tmp_path):
    from collections import namedtuple

    Point = namedtuple("Point", "x y")
    path = tmp_path / "p.pt"
    checkpoint.save(path, {"p": Point(torch.ones(1), 2)})
    with pytest.raises(CorruptCheckpointError, match="not a funcamp type; pass like="):
        checkpoint.load(path)
    loaded = checkpoint.load(path, like={"p": Point(torch.zeros(1), 0)})
    assert type(loaded["p"]) is Point and loaded["p"].y == 2


def test_like_moves_tensors_to_like_device_and_map_location(tmp_path):
    path = tmp_path / "c.pt"
    checkpoint.save(path, {"w": torch.ones(2)})
    assert checkpoint.load(path, map_location="cpu")["w"].device.type == "cpu"
    like = {"w": torch.empty(2, device="meta")}
    assert checkpoint.load(path, like=like)["w"].device.type == "meta"


def test_bad_arguments():
    with pytest.raises(TypeError, match="path must be a str or path"):
        checkpoint.save(3, {})
    with pytest.raises(TypeError, match="path must be a str or path"):
        checkpoint.load(None)
    with pytest.raises(TypeError, match=r"cannot save x of type object"):
        checkpoint.save("unused.pt", {"x": object()})


def test_load_of_a_directory_says_what_it_is(tmp_path):
    """checkpoint.load on a sharded checkpoint's directory names load_sharded (it was IsADirectoryError)."""
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "LATEST").write_text("ckpt-0")
    with pytest.raises(checkpoint.CorruptCheckpointError, match="is a directory, a sharded checkpoint: use"):
        checkpoint.load(tmp_path / "sharded")
    with pytest.raises(checkpoint.CorruptCheckpointError, match="is a directory, not a checkpoint file"):
        checkpoint.load(tmp_path)


def test_public_names_keep_their_module_and_pickle() -> None:
    """``funcamp.checkpoint`` is a package of rooms (``_format``, ``_sharded``, ``_atomic``); its public names are
    those of the one file it was, and its errors are ``funcamp.checkpoint.X`` in reprs and pickles (a worker's
    error travels pickled). (Planted: the errors left at ``funcamp.checkpoint._format``: fails.)"""
    import pickle

    assert sorted(checkpoint.__all__) == sorted(
        ["CheckpointError", "CheckpointMismatchError", "CorruptCheckpointError"]
        + ["load", "load_sharded", "save", "save_sharded"]
    )
    for cls in (checkpoint.CheckpointError, CheckpointMismatchError, CorruptCheckpointError):
        assert cls.__module__ == "funcamp.checkpoint", cls
        error = pickle.loads(pickle.dumps(cls("f.pt: the root differs")))
        assert type(error) is cls and str(error) == "f.pt: the root differs"
        assert b"funcamp.checkpoint._" not in pickle.dumps(cls("x"))


def test_the_padding_bound_is_the_flat_storages():
    """``_saved_whole`` takes a storage as saved whole when no gap between its saved tensors reaches
    ``PADDING_ELEMENTS`` elements: flat storage's row (``funcamp.train._flat.NORM_ROW``), which the checkpoint
    package (below train) does not import. A larger row would make every flat buffer's tensors saved as clones."""
    from funcamp.checkpoint import _format
    from funcamp.train import _flat

    assert _format.PADDING_ELEMENTS == _flat.NORM_ROW


@pytest.mark.parametrize("hidden", [1, 100, 256])
def test_one_member_of_a_flat_buffer_is_saved_alone(tmp_path, hidden):
    """Saving one parameter of a flat state writes that parameter, not its buffer: a neighbour of up to a row
    (``PADDING_ELEMENTS``) must not hide in the saved tensor's padding slack. (Planted: the slack summed per saved
    tensor (256 elements each), as before: the 256-element ``w`` covers the buffer but for the neighbour, which is
    written into the file and pins the loaded ``w``'s memory.)"""
    from funcamp.checkpoint import _format

    state = fa.TrainState.create({"w": torch.randn(256), "secret": torch.full((hidden,), 7.0)}, optim.sgd(0.1))
    assert state.storage.kind == "flat" and state.params["w"].untyped_storage().nbytes() == 512 * 4
    path = tmp_path / "w.pt"
    checkpoint.save(path, {"w": state.params["w"]})
    loaded = checkpoint.load(path)["w"]
    assert torch.equal(loaded, state.params["w"])
    assert loaded.untyped_storage().nbytes() == 256 * 4
    assert _format._saved_whole({"p": state.params}) != set()  # every member saved: the buffer, whole
