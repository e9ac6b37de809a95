"""The sharded checkpoint on ``torch.distributed.checkpoint`` (DCP): :func:`save_sharded` (every rank writes its
own shards, whole tensors once, the rest in ``funcamp.json``) and :func:`load_sharded` (each rank reads the
saved shards that overlap its rows, N ranks to M).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from funcamp.checkpoint._atomic import fsync_dir, replace_atomically
from funcamp.checkpoint._format import (
    DTYPES,
    CorruptCheckpointError,
    check_path,
    decode,
    encode,
    is_namedtuple,
    join,
    mismatch,
    type_name,
)

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
                "items": [[k, _split_tensors(v, join(path, k), layout, tensors, where)] for k, v in node["items"]],
            }
        if node.get("$") in ("list", "tuple"):
            items = [_split_tensors(v, join(path, i), layout, tensors, where) for i, v in enumerate(node["items"])]
            return {**node, "items": items}
        if node.get("$") in ("namedtuple", "dataclass"):
            fields = {}
            for k, v in node["fields"].items():
                inner = where
                if node.get("type") == _TRAIN_STATE and where is None and k in ("params", "opt_state"):
                    inner = (k, join(path, k))
                fields[k] = _split_tensors(v, join(path, k), layout, tensors, inner)
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
    if type_name(type(tree)) == _TRAIN_STATE:
        return [tree]
    if isinstance(tree, dict):
        return [s for v in tree.values() for s in _states(v)]
    if isinstance(tree, (list, tuple)) and not is_namedtuple(tree):
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

    check_path("save_sharded", path, tree)
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
    skeleton = _split_tensors(encode(tree, ""), "", layout, tensors)
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
        fsync_dir(tmp)
        os.replace(tmp, final)
        replace_atomically(os.path.join(path, _LATEST), lambda f: f.write(name[0] + "\n"), "w")
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

    check_path("load_sharded", path)
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
        raise mismatch(directory, "the parameters", f"differ from the layout's: missing {missing}, unexpected {extra}")
    for name, a, b in zip(saved.names, saved.shapes, layout.shapes):
        if a != b:
            raise mismatch(
                directory, f"parameter {name!r}", f"has whole shape {a} in the checkpoint, {b} in the layout"
            )
    if saved.world_size != layout.world_size and not reshard:
        raise mismatch(
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
    return _carrying(decode(node, like, "", directory, like is not None), layout)


def _carrying(tree: Any, layout: Any) -> Any:
    """``tree`` with every TrainState in it carrying ``layout`` (its ``params`` are that layout's shards), so
    that a train step built without ``shard=`` trains it sharded."""
    if type_name(type(tree)) == _TRAIN_STATE:
        return dataclasses.replace(tree, shard=layout)
    if isinstance(tree, dict):
        return {k: _carrying(v, layout) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_carrying(v, layout) for v in tree]
    if isinstance(tree, tuple) and not is_namedtuple(tree):
        return tuple(_carrying(v, layout) for v in tree)
    return tree


def _dtype(name: str, file: str) -> torch.dtype:
    if name not in DTYPES:
        raise CorruptCheckpointError(f"{file}: unknown dtype {name!r}")
    return DTYPES[name]


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
