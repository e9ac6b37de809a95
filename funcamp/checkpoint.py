"""Save and load funcamp states: atomic writes, loadable with ``torch.load(weights_only=True)``.

:func:`save` encodes a tree of funcamp states (a :class:`funcamp.TrainState`, loss scales, optimizer
NamedTuples, :class:`funcamp.Policy`, dicts, lists, tuples, tensors, Python numbers and strings) into
plain dicts, lists, strings and tensors, so that the file loads with ``torch.load(weights_only=True)``
(no pickled classes, nothing executed), and writes it to a temporary file in the same directory,
fsyncs it and renames it over ``path``: a crash mid-write keeps the previous checkpoint.

:func:`load` decodes it. With ``like=state`` it rebuilds into the structure, types and devices of
``state`` and checks every tensor's shape and dtype, so a resumed run gets a state that is equal field
by field (the compiled step does not recompile) and continues bit-for-bit like one that never stopped.

File layout (version 1), for other tools: ``{"format": "funcamp.checkpoint", "version": 1, "tree":
node}`` where a node is a tensor, ``None``, a bool, int, float or str, or a dict with a ``"$"`` key:
``{"$": "dict", "items": [[key, node], ...]}``, ``{"$": "list" | "tuple", "items": [node, ...]}``,
``{"$": "namedtuple" | "dataclass", "type": "module.QualName", "fields": {name: node}}``,
``{"$": "dtype", "name": "float32"}``.

:func:`save_sharded` and :func:`load_sharded` write and read a state sharded with
:mod:`funcamp.sharding` through ``torch.distributed.checkpoint`` (DCP): every rank writes its own
shards into one directory, and a checkpoint saved on N ranks loads on M (1 included), each rank
reading the saved shards that overlap its rows. Layout (version 1): ``path/LATEST`` names the current
subdirectory, which holds DCP's files (keys ``r/<path in the tree>`` for tensors saved once,
``s/<path>/<rank>`` for shards) and ``funcamp.json``: ``{"format": "funcamp.sharded_checkpoint",
"version": 1, "world_size": N, "names": [...], "shapes": [...], "tree": node}``, the node tree above
with each tensor replaced by ``{"$": "dcp", "path": ..., "shard": index or null, "shape": [...],
"dtype": ...}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import pickle
import socket
import tempfile
import warnings
import zipfile
from collections.abc import Iterator
from typing import Any

import torch

from funcamp._errors import DonatedStateError

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "load",
    "load_sharded",
    "save",
    "save_sharded",
]

FORMAT = "funcamp.checkpoint"
VERSION = 1

_SCALARS = (bool, int, float, str, type(None))
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


class CheckpointError(ValueError):
    """A checkpoint cannot be read or does not fit; the message names the file."""


class CorruptCheckpointError(CheckpointError):
    """The file is not a readable funcamp checkpoint (truncated, corrupt, or another format)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's structure, a shape or a dtype differs from ``like``; the message says where."""


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _encode(x: Any, path: str) -> Any:
    if isinstance(x, torch.Tensor):
        if type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter):
            raise TypeError(
                f"funcamp.checkpoint.save: {path or 'the state'} is a {type(x).__name__}; save plain tensors"
            )
        return x.detach()
    if isinstance(x, _SCALARS):
        return x
    if isinstance(x, torch.dtype):
        return {"$": "dtype", "name": str(x).removeprefix("torch.")}
    if isinstance(x, dict):
        return {"$": "dict", "items": [[k, _encode(v, _join(path, k))] for k, v in x.items()]}
    if _is_namedtuple(x):
        fields = {f: _encode(getattr(x, f), _join(path, f)) for f in type(x)._fields}
        return {"$": "namedtuple", "type": _type_name(type(x)), "fields": fields}
    if isinstance(x, (list, tuple)):
        kind = "list" if isinstance(x, list) else "tuple"
        return {"$": kind, "items": [_encode(v, _join(path, i)) for i, v in enumerate(x)]}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        if getattr(x, "_funcamp_donated", False):  # funcamp.train._donate.mark_donated
            raise DonatedStateError(
                f"funcamp.checkpoint.save: {path or 'the state'} was donated to a train step built with donate=True, "
                "which wrote the next state into its tensors; save the state that step returned"
            )
        fields = {f.name: _encode(getattr(x, f.name), _join(path, f.name)) for f in _saved_fields(x)}
        return {"$": "dataclass", "type": _type_name(type(x)), "fields": fields}
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


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _check_path(fn: str, path: Any, tree: Any = None) -> None:
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
    _check_path("save", path, state)
    payload = {"format": FORMAT, "version": VERSION, "tree": _encode(state, "")}
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"funcamp.checkpoint.save: directory {directory!r} of {path!r} does not exist")
    _replace_atomically(path, lambda f: torch.save(payload, f), "wb")


def _replace_atomically(path: str, write: Any, mode: str) -> None:
    """Write a temporary file beside ``path`` with ``write(file)``, fsync it, rename it over ``path`` with
    ``os.replace`` and fsync the directory: a reader sees the old file or the new one, never a part.

    The temporary file's name carries this host and process id (``.NAME.HOST-PID.RANDOM.tmp``); a
    killed writer's file is removed by the next write of the same ``path`` from this host once that
    process is gone. Files of live processes, of other hosts, and anything else are left alone."""
    directory = os.path.dirname(os.path.abspath(path))
    base, owner = os.path.basename(path), f"{_host()}-{os.getpid()}"
    _remove_stale_temporaries(directory, base)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.{owner}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _host() -> str:
    return "".join(c if c.isalnum() else "_" for c in socket.gethostname()) or "host"


def _remove_stale_temporaries(directory: str, base: str) -> None:
    """Remove ``directory``'s ``.BASE.HOST-PID.*.tmp`` files whose HOST is this one and whose PID is gone."""
    prefix, host = f".{base}.", _host()
    for name in os.listdir(directory):
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        owner, _, _ = name[len(prefix) : -len(".tmp")].rpartition(".")
        owner_host, _, pid = owner.rpartition("-")
        if owner_host != host or not pid.isdigit() or _process_alive(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):  # another writer removed it first
            os.unlink(os.path.join(directory, name))


def _process_alive(pid: int) -> bool:
    if pid == os.getpid() or os.name == "nt":  # Windows' os.kill(pid, 0) would end the process
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # exists but is another user's, or the OS cannot tell: keep its file
        return True
    return True


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
    come from the checkpoint, not from ``like``.

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
    _check_path("load", path)
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
    return _decode(payload["tree"], like, "", path, like is not None)


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


def _mismatch(file: str, path: str, what: str) -> CheckpointMismatchError:
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
    if _is_namedtuple(like):
        return f"namedtuple {_type_name(type(like))}"
    if isinstance(like, (list, tuple)):
        return type(like).__name__
    if dataclasses.is_dataclass(like):
        return f"dataclass {_type_name(type(like))}"
    return type(like).__name__


def _decode(node: Any, like: Any, path: str, file: str, checked: bool) -> Any:
    if isinstance(node, torch.Tensor):
        return _decode_tensor(node, like, path, file, checked)
    if not isinstance(node, dict):
        if checked and (isinstance(like, (torch.Tensor, dict, list, tuple)) or dataclasses.is_dataclass(like)):
            raise _mismatch(file, path, f"is a {_kind(node)} in the checkpoint but a {_like_kind(like)} in like")
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
        raise _mismatch(file, path, f"is a tensor in the checkpoint but a {_like_kind(like)} in like")
    if node.shape != like.shape:
        raise _mismatch(file, path, f"has shape {tuple(node.shape)} in the checkpoint, {tuple(like.shape)} in like")
    if node.dtype != like.dtype:
        raise _mismatch(file, path, f"has dtype {node.dtype} in the checkpoint, {like.dtype} in like")
    return node.to(like.device)


def _decode_dtype(node: dict[str, Any], path: str, file: str) -> torch.dtype:
    name = node.get("name")
    if name not in _DTYPES:
        raise CorruptCheckpointError(f"{file}: unknown dtype {name!r} at {path or 'the root'}")
    return _DTYPES[name]


def _decode_dict(node: dict[str, Any], like: Any, path: str, file: str, checked: bool) -> dict[Any, Any]:
    items = node["items"]
    if checked:
        if not isinstance(like, dict):
            raise _mismatch(file, path, f"is a dict in the checkpoint but a {_like_kind(like)} in like")
        keys = [k for k, _ in items]
        missing = [k for k in like if k not in keys]
        unexpected = [k for k in keys if k not in like]
        if missing or unexpected:
            raise _mismatch(file, path, f"has other keys than like: missing {missing}, unexpected {unexpected}")
        out = {k: _decode(v, like[k], _join(path, k), file, True) for k, v in items}
        return type(like)((k, out[k]) for k in like) if type(like) is not dict else {k: out[k] for k in like}
    return {k: _decode(v, None, _join(path, k), file, False) for k, v in items}


def _decode_sequence(node: dict[str, Any], like: Any, path: str, file: str, checked: bool) -> list[Any] | tuple:
    items, kind = node["items"], node["$"]
    if checked:
        if _is_namedtuple(like) or not isinstance(like, (list, tuple)) or type(like).__name__ != kind:
            raise _mismatch(file, path, f"is a {kind} in the checkpoint but a {_like_kind(like)} in like")
        if len(items) != len(like):
            raise _mismatch(file, path, f"has {len(items)} entries in the checkpoint, {len(like)} in like")
        out = [_decode(v, lk, _join(path, i), file, True) for i, (v, lk) in enumerate(zip(items, like))]
    else:
        out = [_decode(v, None, _join(path, i), file, False) for i, v in enumerate(items)]
    return out if kind == "list" else tuple(out)


def _decode_object(node: dict[str, Any], like: Any, path: str, file: str, checked: bool) -> Any:
    kind, name, fields = node["$"], node["type"], node["fields"]
    if checked:
        is_kind = _is_namedtuple(like) if kind == "namedtuple" else dataclasses.is_dataclass(like)
        if not is_kind or type(like).__name__ != name.rsplit(".", 1)[-1]:
            raise _mismatch(file, path, f"is a {kind} {name} in the checkpoint but a {_like_kind(like)} in like")
        cls = type(like)
        expected = list(cls._fields) if kind == "namedtuple" else [f.name for f in _saved_fields(like)]
        if sorted(expected) != sorted(fields):
            raise _mismatch(file, path, f"has fields {sorted(fields)} in the checkpoint, {sorted(expected)} in like")
        values = {k: _decode(v, getattr(like, k), _join(path, k), file, True) for k, v in fields.items()}
        if kind == "dataclass":  # the static facts a state carries (not saved) come from like
            static = [f.name for f in dataclasses.fields(like) if f.init and f.metadata.get("funcamp.static")]
            values.update({k: getattr(like, k) for k in static})
    else:
        cls = _funcamp_type(name, kind, path, file)
        values = {k: _decode(v, None, _join(path, k), file, False) for k, v in fields.items()}
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


# --- sharded checkpoints (torch.distributed.checkpoint) --------------------------------------------

SHARDED_FORMAT = "funcamp.sharded_checkpoint"
SHARDED_VERSION = 1
_LATEST = "LATEST"
_META = "funcamp.json"


_TRAIN_STATE = "funcamp.train.TrainState"


def _shard_index(rel: str, shape: tuple[int, ...], layout: Any, *, exact: bool) -> int | None:
    """The parameter whose shard the tensor at ``rel`` (its path inside ``params`` or ``opt_state``) is, or None.

    ``exact`` (``params``): ``rel`` is the parameter's name. Otherwise (the optimizer state, built by
    ``optimizer.init(shards)``): ``rel`` ends with the name (``0.mu.w1`` mirrors ``w1``); the longest
    such name wins. Either way the shape must be that parameter's shard shape.
    """
    best = None
    for i, name in enumerate(layout.names):
        if (rel == name or (not exact and rel.endswith("." + name))) and shape == layout.shard_shape(i):
            if best is None or len(name) > len(layout.names[best]):
                best = i
    return best


def _split_tensors(
    node: Any, path: str, layout: Any, tensors: dict[str, torch.Tensor], where: tuple[str, str] | None = None
) -> Any:
    """The encoded tree with each tensor replaced by a placeholder; the tensors go into ``tensors`` by DCP key.

    Shards are exactly the leaves of a ``TrainState``'s ``params`` and the leaves of its ``opt_state``
    that mirror them (``where`` is then ``("params" | "opt_state", path of that field)``); every other
    tensor is whole (key ``r/<path>``).
    """
    if isinstance(node, torch.Tensor):
        index = None
        if where is not None:
            kind, base = where
            rel = path[len(base) + 1 :]
            index = _shard_index(rel, tuple(node.shape), layout, exact=kind == "params")
            if kind == "params" and index is None:
                raise ValueError(
                    f"funcamp.checkpoint.save_sharded: {path} is not a shard of the layout (shape "
                    f"{tuple(node.shape)}); save a state made with TrainState.create(..., shard=layout)"
                )
        key = f"r/{path}" if index is None else f"s/{path}/{layout.rank}"
        tensors[key] = node.detach()
        return {"$": "dcp", "path": path, "shard": index, "shape": list(node.shape), "dtype": str(node.dtype)[6:]}
    if isinstance(node, dict):
        if node.get("$") == "dict":
            return {
                "$": "dict",
                "items": [[k, _split_tensors(v, _join(path, k), layout, tensors, where)] for k, v in node["items"]],
            }
        if node.get("$") in ("list", "tuple"):
            items = [_split_tensors(v, _join(path, i), layout, tensors, where) for i, v in enumerate(node["items"])]
            return {**node, "items": items}
        if node.get("$") in ("namedtuple", "dataclass"):
            fields = {}
            for k, v in node["fields"].items():
                inner = where
                if node.get("type") == _TRAIN_STATE and where is None and k in ("params", "opt_state"):
                    inner = (k, _join(path, k))
                fields[k] = _split_tensors(v, _join(path, k), layout, tensors, inner)
            return {**node, "fields": fields}
    return node


def _digest(x: torch.Tensor) -> str:
    import hashlib

    data = x.detach().cpu().contiguous().view(-1)
    raw = data.view(torch.uint8) if data.numel() else data
    return f"{x.dtype}{tuple(x.shape)}:{hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).hexdigest()}"


def _check_replicated(tensors: dict[str, torch.Tensor], pg: Any, layout: Any) -> None:
    """Refuse whole tensors (keys ``r/...``) that differ between the ranks (DCP would keep one rank's copy),
    and layouts not made for their rank (on every rank alike: one ``all_gather_object``)."""
    from funcamp import sharding

    if pg is None:
        return
    mine = {k[2:]: _digest(v) for k, v in tensors.items() if k.startswith("r/")}
    everyone: list[Any] = [None] * pg.size()
    torch.distributed.all_gather_object(everyone, (mine, (layout.rank, layout.world_size)), group=pg)
    sharding._check_claims([claim for _, claim in everyone], "funcamp.checkpoint.save_sharded")
    everyone = [m for m, _ in everyone]
    for key in sorted(everyone[0]):
        values = [d.get(key) for d in everyone]
        if len(set(values)) > 1:
            groups: dict[Any, list[int]] = {}
            for r, v in enumerate(values):
                groups.setdefault(v, []).append(r)
            raise ValueError(
                f"funcamp.checkpoint.save_sharded: {key!r} differs between ranks (ranks holding the same value: "
                f"{sorted(groups.values())}); a sharded checkpoint stores every tensor outside the TrainState's "
                "params and optimizer state once, for all ranks, so it must be the same on every rank (e.g. "
                "seed the RNG the same on every rank, or keep per-rank values out of the saved tree)"
            )
    keys = [set(d) for d in everyone]
    if any(k != keys[0] for k in keys):
        raise ValueError(
            "funcamp.checkpoint.save_sharded: the ranks save trees of different structure: "
            f"{sorted(set.union(*keys) - set.intersection(*keys))} are not on every rank"
        )


#: ``group`` not given to :func:`save_sharded` / :func:`load_sharded`: the layout's own group, else True.
_FROM_LAYOUT: Any = object()


def _states(tree: Any) -> list[Any]:
    """The TrainStates in ``tree`` (dicts, lists and tuples walked), in order."""
    if _type_name(type(tree)) == _TRAIN_STATE:
        return [tree]
    if isinstance(tree, dict):
        return [s for v in tree.values() for s in _states(v)]
    if isinstance(tree, (list, tuple)) and not _is_namedtuple(tree):
        return [s for v in tree for s in _states(v)]
    return []


def _carried_layout(tree: Any, layout: Any, fn: str) -> Any:
    """``layout``, or else the one the TrainStates of ``tree`` carry (the first; a given layout wins: its checks
    against the tree run on every rank alike, where a local comparison here could leave the other ranks waiting).

    Raises:
      TypeError: if neither ``layout`` nor a TrainState of ``tree`` gives one.
    """
    if layout is not None:
        return layout
    found = next((s.shard for s in _states(tree) if s.shard is not None), None)
    if found is None:
        raise TypeError(
            f"funcamp.checkpoint.{fn}: no layout: pass layout=, or a tree holding a TrainState made with "
            "TrainState.create(..., shard=layout)"
        )
    return found


def _layout_group(layout: Any, group: Any) -> Any:
    if group is not _FROM_LAYOUT:
        return group
    return True if layout.group is None else layout.group


def _sharded_group(layout: Any, group: Any) -> Any:
    from funcamp import sharding

    if layout.world_size == 1:
        return None
    return sharding._resolve(True if group is None else group)


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes one process when torch.distributed is not initialized: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _multi_rank_job() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier(pg: Any) -> None:
    if pg is not None:
        torch.distributed.barrier(group=pg)


def save_sharded(path: str | os.PathLike[str], tree: Any, layout: Any = None, *, group: Any = _FROM_LAYOUT) -> None:
    """Write a sharded state with ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards.

    ``tree`` is what :func:`save` accepts (e.g. ``{"state": train_state, "rng": ..., "config": {...}}``),
    holding a state made with ``TrainState.create(..., shard=layout)``. The shards are exactly the
    leaves of each ``TrainState``'s ``params`` (each must be the shard of the parameter of that name)
    and the leaves of its ``opt_state`` that mirror them (built by ``optimizer.init(shards)``: a leaf
    whose path inside ``opt_state`` ends with a parameter's name and whose shape is that parameter's
    shard shape, e.g. Adam's ``mu`` and ``nu``): each rank writes its own. Every other tensor
    (counters, the loss scale, an RNG state, an EMA of the whole parameters kept beside the state)
    is whole and written once, so it must be the same on every rank: this is checked before anything
    is written (a hash of each, one ``all_gather_object``), and a tensor that differs is refused with
    its path and the ranks, rather than silently saved from one rank (per-rank values are not
    saved). The rest of the tree, the layout (world size, names, whole shapes) and the placement of
    every tensor go into ``funcamp.json`` beside DCP's files.

    ``path`` is a directory. Each save writes a new subdirectory (first under a temporary name,
    renamed when complete) and then replaces ``path/LATEST``, a one-line file naming it, with
    ``os.replace``; older subdirectories are removed afterwards (never the one ``LATEST`` names,
    nor a temporary one younger than this save's). A crash at any point leaves ``LATEST`` naming the
    previous complete checkpoint. Every rank of the group must call it (it communicates); run it
    outside the compiled step. A one-rank layout (``shard_layout(params, None)``) in a job of several
    ranks is refused unless ``group=None`` is passed, to say that this one process writes alone.

    Args:
      path: the checkpoint directory (created if missing; its parent must exist).
      tree: the tree to save.
      layout: the :class:`funcamp.sharding.ShardLayout` the state was sharded with; default: the one the
        ``TrainState`` in ``tree`` carries (``TrainState.create(..., shard=layout)``).
      group: True (the default process group) or a ProcessGroup; with a one-rank layout, None
        (this process writes alone). Default: the layout's group (``shard_layout(params, group)``), else True.
    Raises:
      TypeError: if ``path`` is not a path, ``layout`` not a ShardLayout, or a part of ``tree``
        cannot be saved (named by its path).
      FileNotFoundError: if the parent directory of ``path`` does not exist.
      ValueError: if the layout is not for this process's rank and world size in the group, a
        one-rank layout is used in a multi-rank job without ``group=None``, a ``TrainState``'s
        parameter is not a shard of the layout, or a whole tensor differs between ranks (the message
        names its path and the ranks).
    References:
      ``torch.distributed.checkpoint`` (DCP), as FSDP2 uses it for sharded state dicts.
    """
    import json
    import shutil
    import uuid

    import torch.distributed.checkpoint as dcp

    _check_path("save_sharded", path, tree)
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(os.path.dirname(path)):
        raise FileNotFoundError(f"funcamp.checkpoint.save_sharded: the parent directory of {path!r} does not exist")
    from funcamp import sharding

    layout = _carried_layout(tree, layout, "save_sharded")
    if not isinstance(layout, sharding.ShardLayout):
        raise TypeError(
            f"funcamp.checkpoint.save_sharded: layout must be a funcamp.sharding.ShardLayout, got {layout!r}"
        )
    group = _layout_group(layout, group)
    if layout.world_size == 1 and group is not None and _multi_rank_job():
        raise ValueError(
            "funcamp.checkpoint.save_sharded: the layout is for one process, but this process is rank "
            f"{torch.distributed.get_rank()} of a {torch.distributed.get_world_size()}-rank job: every rank would "
            "write (and clean up) the same directory. Use shard_layout(params, group) on every rank, or, to "
            "write from one process on purpose, call it on that rank only with group=None"
        )
    pg = _sharded_group(layout, group)
    size = 1 if pg is None else pg.size()
    if layout.world_size != size:
        sharding.check_rank(layout, pg, "funcamp.checkpoint.save_sharded")
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split_tensors(_encode(tree, ""), "", layout, tensors)
    _check_replicated(tensors, pg, layout)
    name = [f"ckpt-{uuid.uuid4().hex[:12]}"]
    if pg is not None:
        torch.distributed.broadcast_object_list(name, src=torch.distributed.get_global_rank(pg, 0), group=pg)
    final, tmp = os.path.join(path, name[0]), os.path.join(path, f".tmp-{name[0]}")
    if layout.rank == 0:
        os.makedirs(tmp)
        started = os.stat(tmp).st_mtime
    _barrier(pg)
    with _quiet_single_process():
        dcp.save(tensors, checkpoint_id=tmp, process_group=pg, no_dist=pg is None)
    if layout.rank == 0:
        meta = {
            "format": SHARDED_FORMAT,
            "version": SHARDED_VERSION,
            "world_size": layout.world_size,
            "names": list(layout.names),
            "shapes": [list(s) for s in layout.shapes],
            "tree": skeleton,
        }
        with open(os.path.join(tmp, _META), "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _replace_atomically(os.path.join(path, _LATEST), lambda f: f.write(name[0] + "\n"), "w")
        with open(os.path.join(path, _LATEST)) as f:
            current = f.read().strip()  # another writer may have replaced LATEST since: keep what it names
        for old in os.listdir(path):  # earlier checkpoints, and leftovers of saves interrupted before this one
            full = os.path.join(path, old)
            if old in (name[0], current) or not (old.startswith("ckpt-") or old.startswith(".tmp-ckpt-")):
                continue
            with contextlib.suppress(OSError):
                if old.startswith("ckpt-") or os.stat(full).st_mtime < started:
                    shutil.rmtree(full, ignore_errors=True)
    _barrier(pg)


def _latest(path: str) -> str:
    latest = os.path.join(path, _LATEST)
    if not os.path.isfile(latest):
        what = "a single-file checkpoint: use funcamp.checkpoint.load" if os.path.isfile(path) else "no LATEST file"
        raise FileNotFoundError(f"funcamp.checkpoint.load_sharded: {path!r} is not a sharded checkpoint ({what})")
    with open(latest) as f:
        return os.path.join(path, f.read().strip())


def load_sharded(
    path: str | os.PathLike[str], like: Any, layout: Any = None, *, group: Any = _FROM_LAYOUT, reshard: bool = True
) -> Any:
    """Read a checkpoint written by :func:`save_sharded` into this rank's shards of ``layout``.

    The checkpoint may come from another number of ranks (``N``): each rank reads, with
    ``torch.distributed.checkpoint``, the saved shards that overlap its rows of ``layout`` (``M``
    ranks, 1 for one process without a process group) and cuts and pads them to its shard shape, so
    the values are exactly those saved. On the same world size each rank reads back its own shards:
    a resumed run continues bitwise. The tree is then rebuilt and checked against ``like`` as by
    :func:`load` (structure, types, every tensor's shape and dtype).

    Args:
      path: the checkpoint directory (``path/LATEST`` names the checkpoint read).
      like: a tree of the saved structure for this rank, e.g. ``{"state": TrainState.create(params,
        optimizer, shard=layout), ...}``; None rebuilds funcamp types from the names in the file.
      layout: the :class:`funcamp.sharding.ShardLayout` to load into (this process's rank); default: the one
        the ``TrainState`` in ``like`` carries. The loaded states carry it (a step needs no ``shard=``).
      group: True (the default process group) or a ProcessGroup; ignored with a one-rank layout.
        Default: the layout's group, else True.
      reshard: False: refuse a checkpoint saved on another number of ranks.
    Returns:
      The saved tree with this rank's shards.
    Raises:
      FileNotFoundError: if ``path`` has no ``LATEST`` file (e.g. it is a single-file checkpoint).
      CorruptCheckpointError: if ``funcamp.json`` is missing, unreadable or of another format.
      CheckpointMismatchError: if the parameters' names or whole shapes differ from ``layout``'s, the
        world size differs and ``reshard`` is False, or the tree differs from ``like``.
      ValueError: if ``layout`` is not for this process's rank and world size in the group (checked on
        every rank alike, one ``all_gather_object``).
    """
    import json

    import torch.distributed.checkpoint as dcp

    from funcamp import sharding

    _check_path("load_sharded", path)
    layout = _carried_layout(like, layout, "load_sharded")
    if not isinstance(layout, sharding.ShardLayout):
        raise TypeError(
            f"funcamp.checkpoint.load_sharded: layout must be a funcamp.sharding.ShardLayout, got {layout!r}"
        )
    group = _layout_group(layout, group)
    directory = _latest(os.path.abspath(os.fspath(path)))
    try:
        with open(os.path.join(directory, _META)) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{directory}: no readable {_META}: {type(e).__name__}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != SHARDED_FORMAT or meta.get("version") != SHARDED_VERSION:
        raise CorruptCheckpointError(f"{directory}: not a funcamp sharded checkpoint of version {SHARDED_VERSION}")
    saved = sharding.ShardLayout(meta["world_size"], 0, tuple(meta["names"]), tuple(tuple(s) for s in meta["shapes"]))
    if saved.names != layout.names:
        missing, extra = sorted(set(layout.names) - set(saved.names)), sorted(set(saved.names) - set(layout.names))
        raise _mismatch(directory, "the parameters", f"differ from the layout's: missing {missing}, unexpected {extra}")
    for name, a, b in zip(saved.names, saved.shapes, layout.shapes):
        if a != b:
            raise _mismatch(
                directory, f"parameter {name!r}", f"has whole shape {a} in the checkpoint, {b} in the layout"
            )
    if saved.world_size != layout.world_size and not reshard:
        raise _mismatch(
            directory,
            "the checkpoint",
            f"was saved by {saved.world_size} ranks but is loaded on {layout.world_size} (rank {layout.rank}) with "
            "reshard=False; pass reshard=True to cut its shards to the new layout",
        )
    pg = _sharded_group(layout, group)
    if pg is not None:  # a layout of another world size, or not this process's rank: every rank raises alike
        if pg.size() != layout.world_size:
            sharding.check_rank(layout, pg, "funcamp.checkpoint.load_sharded")
        claims: list[Any] = [None] * pg.size()
        torch.distributed.all_gather_object(claims, (layout.rank, layout.world_size), group=pg)
        sharding._check_claims(claims, "funcamp.checkpoint.load_sharded")
    wanted: dict[str, torch.Tensor] = {}
    _collect(meta["tree"], saved, layout, wanted, directory)
    with _quiet_single_process():
        dcp.load(wanted, checkpoint_id=directory, process_group=pg, no_dist=pg is None)
    node = _fill(meta["tree"], saved, layout, wanted)
    return _carrying(_decode(node, like, "", directory, like is not None), layout)


def _carrying(tree: Any, layout: Any) -> Any:
    """``tree`` with every TrainState in it carrying ``layout`` (its ``params`` are that layout's shards), so
    that a train step built without ``shard=`` trains it sharded."""
    if _type_name(type(tree)) == _TRAIN_STATE:
        return dataclasses.replace(tree, shard=layout)
    if isinstance(tree, dict):
        return {k: _carrying(v, layout) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_carrying(v, layout) for v in tree]
    if isinstance(tree, tuple) and not _is_namedtuple(tree):
        return tuple(_carrying(v, layout) for v in tree)
    return tree


def _dtype(name: str, file: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CorruptCheckpointError(f"{file}: unknown dtype {name!r}")
    return _DTYPES[name]


def _overlap(saved: Any, layout: Any, i: int) -> tuple[int, int, range]:
    """This rank's real rows ``[a, b)`` of parameter ``i`` and the saved ranks whose shards hold them."""
    c_new, c_old = layout.rows(i), saved.rows(i)
    a = layout.rank * c_new
    b = a + layout.valid_rows(i)
    return a, b, range(a // c_old, (b - 1) // c_old + 1) if b > a else range(0)


def _walk(node: Any, fn: Any) -> Any:
    if isinstance(node, dict):
        if node.get("$") == "dcp":
            return fn(node)
        if node.get("$") == "dict":
            return {**node, "items": [[k, _walk(v, fn)] for k, v in node["items"]]}
        if node.get("$") in ("list", "tuple"):
            return {**node, "items": [_walk(v, fn) for v in node["items"]]}
        if node.get("$") in ("namedtuple", "dataclass"):
            return {**node, "fields": {k: _walk(v, fn) for k, v in node["fields"].items()}}
    return node


def _collect(tree: Any, saved: Any, layout: Any, wanted: dict, file: str) -> None:
    def want(node: dict[str, Any]) -> None:
        dtype = _dtype(node["dtype"], file)
        if node["shard"] is None:
            wanted[f"r/{node['path']}"] = torch.empty(node["shape"], dtype=dtype)
            return
        i = node["shard"]
        for k in _overlap(saved, layout, i)[2]:
            wanted[f"s/{node['path']}/{k}"] = torch.empty(saved.shard_shape(i), dtype=dtype)

    _walk(tree, want)


def _fill(tree: Any, saved: Any, layout: Any, loaded: dict[str, torch.Tensor]) -> Any:
    def tensor(node: dict[str, Any]) -> torch.Tensor:
        if node["shard"] is None:
            return loaded[f"r/{node['path']}"]
        i = node["shard"]
        a, b, ks = _overlap(saved, layout, i)
        shape = layout.shard_shape(i)
        out = torch.zeros(shape, dtype=_dtype(node["dtype"], ""))
        if ks:
            rows = torch.cat([loaded[f"s/{node['path']}/{k}"] for k in ks])
            start = a - ks[0] * saved.rows(i)
            out[: b - a] = rows[start : start + b - a]
        return out

    return _walk(tree, tensor)
