"""What a measurement is keyed on, and its cache files: :mod:`funcamp.tune`'s keys and cache.

A module's signature (its class, tensors and settings, :func:`module_signature`), a tree's shapes and dtypes
(:func:`tree_signature`), the machine's name, and the cache directory and files (a key document hashed to a file name,
written atomically). :func:`funcamp.tune.tune_policy` and :func:`funcamp.tune.choose_compute_dtype` key their
caches with these, :func:`funcamp.tune.block_probe` its ``key``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import json
import math
import os
import platform
import re
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.utils._pytree as torch_pytree
from torch import nn

from funcamp import hardware
from funcamp._version import __version__

T = TypeVar("T")


def label(dtype: torch.dtype) -> str:
    """``dtype``'s name without ``torch.`` (``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


def tree_signature(tree: Any) -> list:
    """Shapes and dtypes of the tensors of a tree, and the repr of other leaves (JSON-ready)."""
    leaves, spec = torch_pytree.tree_flatten(tree)
    out: list = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append([list(leaf.shape), label(leaf.dtype), leaf.device.type])
        else:
            out.append(repr(leaf)[:200])
    return out


def module_signature(module: nn.Module) -> list:
    """What a module computes with, JSON-ready: its class, its tensors' names, shapes and dtypes, and its own
    settings (:func:`_settings`). Two modules of one class and shapes with other settings (a GELU's
    approximation, a LayerNorm's eps, a dropout's p, training or eval) differ."""
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return [
        f"{type(module).__module__}.{type(module).__qualname__}",
        [[n, list(t.shape), label(t.dtype), t.requires_grad] for n, t in tensors],
        _settings(module),
    ]


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _settings(module: nn.Module) -> dict[str, Any]:
    """A module's own settings, JSON-ready and the same in every process: its public non-module attributes
    (``training``, ``approximate``, ``eps``, ``p``, ``inplace``, a config dataclass, ...), its ``extra_repr()``,
    and a digest of its class's ``forward`` code (an edited forward is another computation)."""
    out = {name: setting_value(value, 0) for name, value in sorted(vars(module).items()) if not name.startswith("_")}
    out["extra_repr()"] = _ADDRESS.sub("", module.extra_repr())
    out["forward"] = _code_digest(getattr(type(module).forward, "__code__", None))
    return out


def setting_value(value: Any, depth: int) -> Any:
    """One attribute's value, JSON-ready and free of memory addresses (see :func:`_settings`)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), label(value.dtype), value.device.type]
    if isinstance(value, (torch.dtype, torch.device, type, enum.Enum)):
        return str(value)
    if depth >= 4:  # deep enough for any setting; the rest is the type
        return type(value).__qualname__
    if isinstance(value, nn.Module):  # a module held outside _modules (a plain list or dict, an attribute)
        return ["module", *module_signature(value)]
    if isinstance(value, (list, tuple, set, frozenset, Mapping)) and len(value) > 64:  # a table: its digest
        text = repr(sorted(map(repr, value))) if isinstance(value, (set, frozenset)) else repr(value)  # hash order
        digest = hashlib.sha256(_ADDRESS.sub("", text).encode()).hexdigest()[:16]
        return [type(value).__qualname__, len(value), digest]
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [setting_value(v, depth + 1) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, Mapping):
        return {str(k): setting_value(v, depth + 1) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return {f.name: setting_value(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}
    if isinstance(value, functools.partial):
        return [
            "partial",
            setting_value(value.func, depth + 1),
            setting_value(value.args, depth + 1),
            setting_value(value.keywords, depth + 1),
        ]
    if inspect.ismethod(value):
        return ["method", value.__func__.__qualname__, _code_digest(getattr(value.__func__, "__code__", None))]
    if inspect.isfunction(value):
        return ["function", value.__qualname__, _code_digest(value.__code__)]
    return _ADDRESS.sub("", repr(value))[:200]


def _code_digest(code: Any) -> str | None:
    """A digest of a code object: its bytecode, names and constants (nested code objects included)."""
    if code is None:
        return None
    h = hashlib.sha256()

    def feed(c: Any) -> None:
        h.update(c.co_code)
        h.update(repr(c.co_names).encode())
        for const in c.co_consts:
            if inspect.iscode(const):
                feed(const)
            else:
                h.update(repr(const).encode())

    feed(code)
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    """``$FUNCAMP_CACHE_DIR/tune`` if that variable is set, else ``~/.cache/funcamp/tune``."""
    root = os.environ.get("FUNCAMP_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "funcamp") / "tune"


def machine_name(device: torch.device) -> str:
    """The machine ``device`` is on, in words (a CPU: its name, architecture, cores and threads)."""
    report = hardware.probe(device)
    if device.type == "cpu":
        return f"{report.name}, {platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
    return report.name


def cache_path(cache: Any, key_doc: dict, fn: str = "tune_policy", prefix: str = "") -> Path | None:
    """The cache file of ``key_doc`` under ``cache`` (True: the default directory), or None when caching is off."""
    if cache is False or cache is None:
        return None
    if cache is True:
        directory = default_cache_dir()
    elif isinstance(cache, (str, os.PathLike)):
        directory = Path(cache)
    else:
        raise TypeError(f"{fn}: cache must be True, False or a directory, got {cache!r}")
    digest = hashlib.sha256(json.dumps(key_doc, sort_keys=True).encode()).hexdigest()[:32]
    return directory / f"{prefix}{digest}.json"


def software_key(device: torch.device) -> dict[str, Any]:
    """What a timing on ``device`` depends on beside the machine's name, for a cache key: the CPU's facts (None off
    the CPU) and the torch and funcamp versions (the step's code is funcamp's)."""
    facts = {k: str(v) for k, v in sorted(hardware._cpu_facts().items())} if device.type == "cpu" else None
    return {"facts": facts, "torch": torch.__version__, "funcamp": __version__}


def read_cached(path: Path, key_doc: dict, fn: str, parse: Callable[[dict], T]) -> T | None:
    """``parse(doc)`` of the cache file at ``path`` if it holds ``key_doc``'s decision; None when there is no file,
    and None with a warning when it is unreadable, holds another key, or ``parse`` raises ``ValueError`` (or a
    ``KeyError``, ``TypeError``, ``AttributeError`` of a malformed document)."""
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        if doc["key"] != json.loads(json.dumps(key_doc, sort_keys=True)):
            raise ValueError("its key is not this step's")
        return parse(doc)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(f"{fn}: ignoring the unreadable cache file {path} ({error}); measuring again", stacklevel=4)
        return None


def write_json(path: Path, doc: dict, fn: str) -> None:
    """Write ``doc`` to ``path`` atomically (a reader sees the old file or the new one); warn if it cannot."""
    text = json.dumps(doc, indent=1, default=str)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            f.write(text)
        os.replace(f.name, path)
    except OSError as error:
        warnings.warn(f"{fn}: could not write the cache file {path}: {error}", stacklevel=4)


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere), or ``""``."""
    return hardware._cpuinfo("model name") or platform.processor()


def step_machine(device: torch.device, cap: hardware.Capability) -> str:
    """The machine a step is timed on, in words (a CPU: its model, architecture, cores and threads)."""
    if device.type == "cpu":
        model = _cpu_model()
        return (
            f"{cap.name}{', ' + model if model else ''}, {platform.machine()}, {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} threads"
        )
    return cap.name
