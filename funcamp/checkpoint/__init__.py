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

The package: ``_format`` (the single file: encoding, :func:`save`, :func:`load`, the errors), ``_sharded``
(:func:`save_sharded`, :func:`load_sharded` on DCP) and ``_atomic`` (the atomic replacement both use).
"""

from funcamp.checkpoint._format import CheckpointError, CheckpointMismatchError, CorruptCheckpointError, load, save
from funcamp.checkpoint._sharded import load_sharded, save_sharded

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "load",
    "load_sharded",
    "save",
    "save_sharded",
]

# The errors keep the module they had when this package was one file (their reprs and pickles).
for _cls in (CheckpointError, CheckpointMismatchError, CorruptCheckpointError):
    _cls.__module__ = __name__
del _cls
