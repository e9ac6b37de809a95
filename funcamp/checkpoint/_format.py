"""The single-file checkpoint: its format (a tree encoded into plain dicts, lists, strings and tensors that
``torch.load(weights_only=True)`` accepts; version 1, described in :mod:`funcamp.checkpoint`), :func:`save`,
:func:`load`, and the errors both formats raise.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import os
import pickle
import zipfile
from typing import Any

import torch

from funcamp._errors import DonatedStateError
from funcamp.checkpoint._atomic import replace_atomically

FORMAT = "funcamp.checkpoint"
#: Flat storage pads each tensor of a buffer by fewer elements than this (``funcamp.train._flat.NORM_ROW``, which the
#: checkpoint package, below train, does not import; ``tests/test_checkpoint.py`` holds them equal).
PADDING_ELEMENTS = 256


VERSION = 1


_SCALARS = (bool, int, float, str, type(None))


DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


class CheckpointError(ValueError):
    """A checkpoint cannot be read or does not fit; the message names the file."""


class CorruptCheckpointError(CheckpointError):
    """The file is not a readable funcamp checkpoint (truncated, corrupt, or another format)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's structure, a shape or a dtype differs from ``like``; the message says where."""


def is_namedtuple(x: Any) -> bool:
    """Whether ``x`` is a NamedTuple (a tuple whose type has ``_fields``)."""
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def type_name(cls: type) -> str:
    """``module.QualName`` of ``cls``, as a checkpoint records a type."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _tensors(x: Any) -> list[torch.Tensor]:
    """Every tensor in ``x`` (the trees :func:`save` takes), in any order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [t for f in _saved_fields(x) for t in _tensors(getattr(x, f.name))]
    return []


def _memory(x: torch.Tensor) -> tuple[Any, int]:
    return (x.device, x.untyped_storage().data_ptr())


def _saved_whole(state: Any) -> set[Any]:
    """The storages the tensors of ``state`` cover (but for the alignment padding of a flat buffer: gaps of fewer
    than ``PADDING_ELEMENTS`` elements after a tensor): saved as they are, shared. A tensor on a storage it shares
    with tensors that are not saved (one parameter of a flat state) is cloned instead, so that a file holds only what
    was asked for and a loaded tensor pins no larger buffer (``torch.save`` writes a view's whole storage). Each
    member of a flat buffer starts on a row of ``PADDING_ELEMENTS`` elements, so a member left out leaves a gap of
    at least a row; a total of padding per tensor would let a member of up to a row hide in the others' slack."""
    spans: dict[Any, list[Any]] = {}
    for x in _tensors(state):
        if x.numel():
            entry = spans.setdefault(_memory(x), [x.untyped_storage().nbytes(), x.element_size(), []])
            entry[1] = min(entry[1], x.element_size())
            extent = 1 + sum((n - 1) * abs(st) for n, st in zip(x.shape, x.stride(), strict=True))
            if extent != x.numel() or any(st < 0 for st in x.stride()):  # overlapping or gapped: never whole
                entry[2] = None
            elif entry[2] is not None:
                start = x.storage_offset() * x.element_size()
                entry[2].append((start, start + x.numel() * x.element_size()))
    whole = set()
    for key, (nbytes, itemsize, ranges) in spans.items():
        if ranges is None:
            continue
        slack, cursor, ok = PADDING_ELEMENTS * itemsize, 0, True
        for start, end in sorted(ranges):
            ok = ok and start - cursor < slack
            cursor = max(cursor, end)
        if ok and nbytes - cursor < slack:
            whole.add(key)
    return whole


def encode(x: Any, path: str, whole: set[Any] | None = None) -> Any:
    """``x`` as the checkpoint file holds it (tensors detached, containers and types as tagged dicts); ``path``
    names it in errors."""
    if isinstance(x, torch.Tensor):
        if type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter):
            raise TypeError(
                f"funcamp.checkpoint.save: {path or 'the state'} is a {type(x).__name__}; save plain tensors"
            )
        if whole is not None and _memory(x) not in whole:
            return x.detach().clone()  # a part of a larger buffer: only its own bytes go into the file
        return x.detach()
    if isinstance(x, _SCALARS):
        return x
    if isinstance(x, torch.dtype):
        return {"$": "dtype", "name": str(x).removeprefix("torch.")}
    if isinstance(x, dict):
        return {"$": "dict", "items": [[k, encode(v, join(path, k), whole)] for k, v in x.items()]}
    if is_namedtuple(x):
        fields = {f: encode(getattr(x, f), join(path, f), whole) for f in type(x)._fields}
        return {"$": "namedtuple", "type": type_name(type(x)), "fields": fields}
    if isinstance(x, (list, tuple)):
        kind = "list" if isinstance(x, list) else "tuple"
        return {"$": kind, "items": [encode(v, join(path, i), whole) for i, v in enumerate(x)]}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        if getattr(x, "_funcamp_donated", False):  # funcamp.train._donate.mark_donated
            raise DonatedStateError(
                f"funcamp.checkpoint.save: {path or 'the state'} was donated to a train step built with donate=True, "
                "which wrote the next state into its tensors; save the state that step returned"
            )
        fields = {f.name: encode(getattr(x, f.name), join(path, f.name), whole) for f in _saved_fields(x)}
        return {"$": "dataclass", "type": type_name(type(x)), "fields": fields}
    raise TypeError(
        f"funcamp.checkpoint.save: cannot save {path or 'the state'} of type {type(x).__name__}; a checkpoint holds "
        "tensors, None, bool/int/float/str, torch dtypes, dicts, lists, tuples, NamedTuples and dataclasses "
        "(TrainState, loss scales, Policy)"
    )


def _saved_fields(x: Any) -> list[dataclasses.Field]:
    """The fields of a dataclass that a checkpoint holds: every ``__init__`` field but the static facts a state
    carries (``TrainState.shard``, ``buffer_reductions``: metadata ``funcamp.static``), which a load takes from
    ``like``."""
    return [f for f in dataclasses.fields(x) if f.init and not f.metadata.get("funcamp.static")]


def join(path: str, key: Any) -> str:
    """The dotted path of ``key`` under ``path`` (``key`` alone at the root)."""
    return f"{path}.{key}" if path else str(key)


def check_path(fn: str, path: Any, tree: Any = None) -> None:
    """Refuse a ``path`` that is not a path, saying so when the arguments are in ``torch.save``'s order."""
    if isinstance(path, (str, os.PathLike)):
        return
    swapped = (
        f"; the arguments are swapped: {fn}(path, tree), the path first (torch.save(obj, f) and "
        "torch.distributed.checkpoint.save(state_dict, ...) put the tree first)"
        if isinstance(tree, (str, os.PathLike))
        else ""
    )
    raise TypeError(f"funcamp.checkpoint.{fn}: path must be a str or path, got {type(path).__name__}{swapped}")


def _check_like(fn: str, like: Any) -> None:
    """Refuse a device given as ``like`` (``torch.load(f, map_location)``'s second positional argument)."""
    if isinstance(like, (str, torch.device)):
        raise TypeError(
            f"funcamp.checkpoint.{fn}: like must be None or a tree shaped like the saved one, got {like!r}; "
            f"to choose the device, pass it by keyword ({fn}(path, map_location={str(like)!r}) as in torch.load); "
            "with like, each tensor goes to the device of the tensor it replaces"
        )


def save(path: str | os.PathLike[str], state: Any) -> None:
    """Write ``state`` to ``path`` atomically, in a file ``torch.load(weights_only=True)`` accepts.

    The file is written to a temporary file in ``path``'s directory, flushed and fsynced, then
    renamed over ``path`` with ``os.replace`` (and the directory fsynced where the OS allows): a reader
    sees the old file or the new one, never a partial one, and a crash keeps the previous checkpoint.
    A temporary file left by a writer that was killed (``.NAME.HOST-PID.RANDOM.tmp``) is removed by the
    next save of the same ``path`` on that host, once that process has ended; nothing else is touched.
    Tensors are saved as they are (device, dtype, values); call it outside the compiled step (it
    copies device tensors to the host). Unlike ``torch.save(model.state_dict())``, the whole train
    state goes in (loss scale with its configuration, optimizer NamedTuples, step counters); jmp has
    no checkpoint format.

    Args:
      path: the file to write (``str`` or ``os.PathLike``); its directory must exist.
      state: a tree of tensors, ``None``, bool/int/float/str, torch dtypes, dicts, lists, tuples,
        NamedTuples and dataclasses (:class:`funcamp.TrainState`, loss scales, :class:`funcamp.Policy`),
        e.g. ``{"state": train_state, "rng": torch.get_rng_state(), "config": {...}}``.
    Raises:
      TypeError: if ``path`` is not a path, or a part of ``state`` has another type (named by its path).
      FileNotFoundError: if the directory of ``path`` does not exist.

    Example:
      >>> import tempfile, funcamp as fa
      >>> with tempfile.TemporaryDirectory() as d:
      ...     save(f"{d}/ckpt.pt", {"scale": fa.DynamicLossScale(1024.0, period=10)})
      ...     load(f"{d}/ckpt.pt")["scale"].loss_scale
      tensor(1024.)
    """
    check_path("save", path, state)
    payload = {"format": FORMAT, "version": VERSION, "tree": encode(state, "", _saved_whole(state))}
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"funcamp.checkpoint.save: directory {directory!r} of {path!r} does not exist")
    replace_atomically(path, lambda f: torch.save(payload, f), "wb")


def load(
    path: str | os.PathLike[str],
    like: Any = None,
    *,
    map_location: str | torch.device | None = None,
) -> Any:
    """Read a checkpoint written by :func:`save`, with ``torch.load(weights_only=True)``.

    Without ``like``, the tree is rebuilt from the type names in the file; only funcamp's own
    NamedTuples and dataclasses are rebuilt that way (a checkpoint cannot make ``load`` import
    anything else), and tensors go to ``map_location`` (default: where they were saved).

    With ``like`` (e.g. a freshly created state), the tree is rebuilt into ``like``'s types and
    containers, and checked against it node by node: the same container kinds, dict keys, fields,
    lengths and class names, and for every tensor the same shape and dtype; each tensor is moved to
    the device of the tensor it replaces. Python values (loss-scale configuration, config dicts)
    come from the checkpoint, not from ``like``. A tensor saved as a part of a larger buffer (a flat state's)
    loaded where ``like``'s tensor owns its memory (a state kept leaf by leaf) is copied out of it, so that the
    loaded tensors share memory only where ``like``'s do.

    Args:
      path: the checkpoint file (``str`` or ``os.PathLike``).
      like: ``None``, or a tree with the structure of the saved one.
      map_location: passed to ``torch.load`` (without ``like``), e.g. ``"cpu"``.
    Returns:
      The saved tree, tensors included (dtypes and values as saved).
    Raises:
      TypeError: if ``path`` is not a path, or ``like`` is a str or ``torch.device`` (``map_location`` is
        keyword-only, unlike ``torch.load``'s second argument).
      FileNotFoundError: if ``path`` does not exist.
      CorruptCheckpointError: if the file is truncated, corrupt, not a funcamp checkpoint, or of a
        newer format version; or (without ``like``) names a type outside funcamp; or ``path`` is a
        directory (a sharded checkpoint's: use :func:`load_sharded`).
      CheckpointMismatchError: if the saved tree differs from ``like`` (the message gives the path in
        the tree, e.g. ``state.params.wte.weight``, and what differs).
    """
    check_path("load", path)
    _check_like("load", like)
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"funcamp.checkpoint.load: no checkpoint at {path!r}")
    if os.path.isdir(path):
        what = (
            "a sharded checkpoint: use funcamp.checkpoint.load_sharded"
            if os.path.isfile(os.path.join(path, "LATEST"))
            else "not a checkpoint file"
        )
        raise CorruptCheckpointError(f"funcamp.checkpoint.load: {path!r} is a directory, {what}")
    payload = _read(path, map_location)
    return decode(payload["tree"], like, "", path, like is not None)


def _read(path: str, map_location: Any) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            payload = torch.load(io.BytesIO(f.read()), map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, KeyError) as e:
        raise CorruptCheckpointError(
            f"{path}: not a readable funcamp checkpoint (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{path}: not a funcamp checkpoint (no format={FORMAT!r} header)")
    if payload.get("version") != VERSION:
        raise CorruptCheckpointError(
            f"{path}: checkpoint format version {payload.get('version')!r}; this funcamp reads version {VERSION}"
        )
    return payload


def mismatch(file: str, path: str, what: str) -> CheckpointMismatchError:
    """The error for a checkpoint ``file`` whose entry at ``path`` is not what ``like`` holds (``what`` says how)."""
    return CheckpointMismatchError(f"{file}: {path or 'the root'} {what}")


def _kind(node: Any) -> str:
    if isinstance(node, torch.Tensor):
        return "tensor"
    if isinstance(node, dict):
        return f"{node.get('$')} {node.get('type', '')}".strip()
    return type(node).__name__


def _like_kind(like: Any) -> str:
    if isinstance(like, torch.Tensor):
        return "tensor"
    if isinstance(like, dict):
        return "dict"
    if is_namedtuple(like):
        return f"namedtuple {type_name(type(like))}"
    if isinstance(like, (list, tuple)):
        return type(like).__name__
    if dataclasses.is_dataclass(like):
        return f"dataclass {type_name(type(like))}"
    return type(like).__name__


def decode(node: Any, like: Any, path: str, file: str, checked: bool) -> Any:
    """The value of the file's ``node`` (the inverse of :func:`encode`), checked against ``like`` where ``checked``."""
    if isinstance(node, torch.Tensor):
        return _decode_tensor(node, like, path, file, checked)
    if not isinstance(node, dict):
        if checked and (isinstance(like, (torch.Tensor, dict, list, tuple)) or dataclasses.is_dataclass(like)):
            raise mismatch(file, path, f"is a {_kind(node)} in the checkpoint but a {_like_kind(like)} in like")
        return node
    kind = node.get("$")
    if kind == "dtype":
        return _decode_dtype(node, path, file)
    if kind == "dict":
        return _decode_dict(node, like, path, file, checked)
    if kind in ("list", "tuple"):
        return _decode_sequence(node, like, path, file, checked)
    if kind in ("namedtuple", "dataclass"):
        return _decode_object(node, like, path, file, checked)
    raise CorruptCheckpointError(f"{file}: unknown node kind {kind!r} at {path or 'the root'}")


def _decode_tensor(node: torch.Tensor, like: Any, path: str, file: str, checked: bool) -> torch.Tensor:
    if not checked:
        return node
    if not isinstance(like, torch.Tensor):
        raise mismatch(file, path, f"is a tensor in the checkpoint but a {_like_kind(like)} in like")
    if node.shape != like.shape:
        raise mismatch(file, path, f"has shape {tuple(node.shape)} in the checkpoint, {tuple(like.shape)} in like")
    if node.dtype != like.dtype:
        raise mismatch(file, path, f"has dtype {node.dtype} in the checkpoint, {like.dtype} in like")
    out = node.to(like.device)
    if out.untyped_storage().nbytes() > out.nbytes and like.untyped_storage().nbytes() <= like.nbytes:
        # A part of a buffer saved whole (a flat state's) loaded where like's tensor owns its memory (a state kept
        # leaf by leaf): its own copy, as like's, so that the leaves share no memory (a step's torch.cond refuses
        # operands that alias)
        out = out.clone()
    return out


def _decode_dtype(node: dict[str, Any], path: str, file: str) -> torch.dtype:
    name = node.get("name")
    if name not in DTYPES:
        raise CorruptCheckpointError(f"{file}: unknown dtype {name!r} at {path or 'the root'}")
    return DTYPES[name]


def _decode_dict(node: dict[str, Any], like: Any, path: str, file: str, checked: bool) -> dict[Any, Any]:
    items = node["items"]
    if checked:
        if not isinstance(like, dict):
            raise mismatch(file, path, f"is a dict in the checkpoint but a {_like_kind(like)} in like")
        keys = [k for k, _ in items]
        missing = [k for k in like if k not in keys]
        unexpected = [k for k in keys if k not in like]
        if missing or unexpected:
            raise mismatch(file, path, f"has other keys than like: missing {missing}, unexpected {unexpected}")
        out = {k: decode(v, like[k], join(path, k), file, True) for k, v in items}
        return type(like)((k, out[k]) for k in like) if type(like) is not dict else {k: out[k] for k in like}
    return {k: decode(v, None, join(path, k), file, False) for k, v in items}


def _decode_sequence(node: dict[str, Any], like: Any, path: str, file: str, checked: bool) -> list[Any] | tuple:
    items, kind = node["items"], node["$"]
    if checked:
        if is_namedtuple(like) or not isinstance(like, (list, tuple)) or type(like).__name__ != kind:
            raise mismatch(file, path, f"is a {kind} in the checkpoint but a {_like_kind(like)} in like")
        if len(items) != len(like):
            raise mismatch(file, path, f"has {len(items)} entries in the checkpoint, {len(like)} in like")
        out = [decode(v, lk, join(path, i), file, True) for i, (v, lk) in enumerate(zip(items, like))]
    else:
        out = [decode(v, None, join(path, i), file, False) for i, v in enumerate(items)]
    return out if kind == "list" else tuple(out)


def _decode_object(node: dict[str, Any], like: Any, path: str, file: str, checked: bool) -> Any:
    kind, name, fields = node["$"], node["type"], node["fields"]
    if checked:
        is_kind = is_namedtuple(like) if kind == "namedtuple" else dataclasses.is_dataclass(like)
        if not is_kind or type(like).__name__ != name.rsplit(".", 1)[-1]:
            raise mismatch(file, path, f"is a {kind} {name} in the checkpoint but a {_like_kind(like)} in like")
        cls = type(like)
        expected = list(cls._fields) if kind == "namedtuple" else [f.name for f in _saved_fields(like)]
        if sorted(expected) != sorted(fields):
            raise mismatch(file, path, f"has fields {sorted(fields)} in the checkpoint, {sorted(expected)} in like")
        values = {k: decode(v, getattr(like, k), join(path, k), file, True) for k, v in fields.items()}
        if kind == "dataclass":  # the static facts a state carries (not saved) come from like
            static = [f.name for f in dataclasses.fields(like) if f.init and f.metadata.get("funcamp.static")]
            values.update({k: getattr(like, k) for k in static})
    else:
        cls = _funcamp_type(name, kind, path, file)
        values = {k: decode(v, None, join(path, k), file, False) for k, v in fields.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{file}: cannot rebuild {name} at {path or 'the root'}: {e}") from e


def _funcamp_type(name: str, kind: str, path: str, file: str) -> type:
    module, _, qualname = name.rpartition(".")
    where = path or "the root"
    if module != "funcamp" and not module.startswith("funcamp."):
        raise CorruptCheckpointError(
            f"{file}: {where} is a {name}, not a funcamp type; pass like=<a state of that structure> to load it"
        )
    try:
        cls = getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError) as e:
        raise CorruptCheckpointError(f"{file}: {where} names an unknown type {name}: {e}") from e
    if kind == "namedtuple":
        ok = isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")
    else:
        ok = isinstance(cls, type) and dataclasses.is_dataclass(cls)
    if not ok:
        raise CorruptCheckpointError(f"{file}: {where} names {name}, which is not a {kind}")
    return cls
