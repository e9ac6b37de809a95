"""A warm start for compiled steps: torch's compile artifacts in one checked file per step.

``torch.compile`` keeps what inductor and AOTAutograd made in an on-disk cache
(``TORCHINDUCTOR_CACHE_DIR``, by default under ``/tmp``), and torch's "mega-cache"
(:func:`torch.compiler.save_cache_artifacts` / :func:`torch.compiler.load_cache_artifacts`) hands
everything this process compiled over as one blob of bytes. This module writes that blob to a file
named by a key of the step (:func:`step_key`: the tree structure, shapes, strides, dtypes and devices of
the state and the batch, the device's capability, and the torch, Python and funcamp versions), and
loads it back in another process, so that its first step finds its graphs compiled: Dynamo still traces
the step, but AOTAutograd and inductor (the C++ or Triton compiler included) are skipped.

    from funcamp import compile_cache

    key = compile_cache.step_key(state, batch, extra={"backend": "inductor"})
    path = compile_cache.path(compile_cache.default_dir(), key)
    print(compile_cache.load(path, key))     # compile cache: loaded 4 artifacts from ...
    state, metrics = train_step(state, batch)  # compiles, or finds it compiled
    print(compile_cache.save(path, key))     # compile cache: saved 4 artifacts to ...

A file that does not fit is never an error: a corrupt one (bad header, truncated, checksum mismatch), one
written for another key, or one torch refuses is ignored, and the returned :class:`CacheResult` says why
in one line. Loading cannot change numbers: torch keys each artifact by the graph it compiles (and the
inductor configuration, the torch version and the machine's instruction set), so an artifact that does
not match a graph is simply never used; funcamp's key only chooses the file.

On the CPU the file also carries the C++ kernel libraries the step loaded, which torch's mega-cache leaves
out (it bundles GPU kernels only): without them a process with an empty inductor cache directory would
run the C++ compiler again for every kernel.

A cache file is code (pickles and shared libraries that this process loads), so, as ssh refuses a key file
that others can change, :func:`load` and :func:`save` refuse a file, or a directory holding it, that another
user owns or can write (POSIX; the checks and their reasons are :func:`_untrusted`'s): the result says why in
one line, and the step compiles as without a cache.

File layout (version 1): the line ``funcamp compile cache 1``; one line of JSON ``{"key": fields, "digest":
sha256 hex of the key, "payload_bytes": n, "payload_sha256": hex, "torch_bytes": m, "artifacts": {type:
[torch's keys]}, "kernels": [[name, bytes, sha256 hex], ...]}``; then the payload: the ``m`` bytes
:func:`torch.compiler.save_cache_artifacts` returned, followed by each kernel library (``name`` is its path
in the inductor cache directory, ``<2 characters>/<hash>.so``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from funcamp import _tree
from funcamp._version import __version__

__all__ = ["CacheKey", "CacheResult", "default_dir", "load", "path", "save", "step_key"]

MAGIC = b"funcamp compile cache 1\n"
#: The longest header line read (the key of a large state is a few hundred kilobytes).
_MAX_HEADER = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """What a cache file is for: JSON-able ``fields`` and their ``digest`` (sha256 hex of canonical JSON)."""

    fields: Mapping[str, Any]
    digest: str


@dataclasses.dataclass(frozen=True)
class CacheResult:
    """What :func:`load` or :func:`save` did; ``str()`` is the one-line message to print.

    Attributes:
      action: ``"loaded"``, ``"saved"``, ``"unchanged"`` (save: the file already holds these artifacts),
        ``"missing"`` (load: no file yet), ``"ignored"`` (load: the file was not used), ``"nothing"``
        (save: torch recorded no artifacts) or ``"refused"`` (load and save: another user owns or can write
        the file or a directory holding it; nothing was read or written).
      path: the cache file.
      artifacts: how many artifacts were loaded or saved (0 otherwise).
      reason: why a file was ignored or nothing was saved ("" otherwise).
    """

    action: str
    path: str
    artifacts: int = 0
    reason: str = ""

    def __str__(self) -> str:
        if self.action == "loaded":
            return f"compile cache: loaded {self.artifacts} artifacts from {self.path}"
        if self.action == "saved":
            return f"compile cache: saved {self.artifacts} artifacts to {self.path}"
        if self.action == "unchanged":
            return f"compile cache: {self.path} is up to date ({self.artifacts} artifacts)"
        if self.action == "missing":
            return f"compile cache: none yet at {self.path} (this run compiles, then saves it)"
        if self.action == "ignored":
            return f"compile cache: ignored {self.path} ({self.reason}); compiling instead"
        if self.action == "refused":
            return f"compile cache: refused {self.path} ({self.reason}); compiling without a cache"
        return f"compile cache: nothing saved to {self.path} ({self.reason})"


def default_dir() -> Path:
    """``$FUNCAMP_CACHE_DIR/compile`` if that variable is set, else ``~/.cache/funcamp/compile``."""
    root = os.environ.get("FUNCAMP_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "funcamp") / "compile"


def _device(device: torch.device) -> str:
    if device.type == "cpu":
        return f"cpu {platform.machine()} {torch.backends.cpu.get_cpu_capability()}"
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda {torch.cuda.get_device_name(index)} sm_{major}{minor} cuda {torch.version.cuda}"
    return device.type


def _leaf(leaf: Any, devices: set[str]) -> str:
    if isinstance(leaf, torch.Tensor):
        devices.add(_device(leaf.device))
        grad = " requires_grad" if leaf.requires_grad else ""
        dtype = str(leaf.dtype).removeprefix("torch.")
        return f"{dtype}{list(leaf.shape)} stride {list(leaf.stride())} {leaf.device}{grad}"
    if leaf is None or isinstance(leaf, (bool, int, float, str)):  # Dynamo specializes on Python constants
        return f"{type(leaf).__name__} {leaf!r}"[:200]
    return type(leaf).__qualname__


def step_key(*trees: Any, extra: Mapping[str, Any] | None = None) -> CacheKey:
    """The key of a compiled step called with ``trees`` (e.g. ``state, batch``): what its graphs depend on.

    Fields: ``trees`` (per tree, its structure as optree prints it in funcamp's namespace, static fields
    such as a loss scale's configuration included, and per leaf dtype, shape, stride, device and
    ``requires_grad``; Python constants by value), ``devices`` (per device type, the CPU's architecture
    and ``torch.backends.cpu.get_cpu_capability()``, or the CUDA device's name, compute capability and
    CUDA version), ``torch``, ``python`` and ``funcamp`` versions, and ``extra``. Anything else the step's
    graph depends on (the loss function's code, hyperparameters held in closures, the backend) is yours to
    put in ``extra``: a key that misses it only makes a file hold artifacts that torch does not use.

    Args:
      trees: the step's arguments, any pytrees (tensors are described, never read: no host sync).
      extra: JSON-able settings of your own (strings, numbers, bools, None, lists and dicts of them).
    Returns:
      A :class:`CacheKey`.
    Raises:
      TypeError: if ``extra`` is not a mapping, or not JSON-able.
    """
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"compile_cache.step_key: extra must be a mapping (dict) or None, got {type(extra).__name__}")
    devices: set[str] = set()
    described = [
        {"structure": str(_tree.tree_structure(t)), "leaves": [_leaf(x, devices) for x in _tree.tree_leaves(t)]}
        for t in trees
    ]
    fields = {
        "trees": described,
        "devices": sorted(devices),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "funcamp": __version__,
        "extra": dict(extra or {}),
    }
    try:
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"compile_cache.step_key: extra must be JSON-able (strings, numbers, bools, None, lists and dicts of "
            f"them): {e}"
        ) from None
    return CacheKey(json.loads(canonical), hashlib.sha256(canonical.encode()).hexdigest())


def path(directory: str | os.PathLike[str], key: CacheKey) -> Path:
    """The file of ``key`` in ``directory``: ``directory / "step-<first 24 hex digits of the digest>.bin"``."""
    return Path(directory) / f"step-{key.digest[:24]}.bin"


# --- who may have written the file --------------------------------------------------------------------------


def _untrusted(file: Path) -> str | None:
    """Why ``file`` must not be loaded nor written, or None: the rule ssh applies to a key file (StrictModes).

    On the real path (symbolic links resolved) and on the path as given: the file (if it exists) and the
    directory holding it must be owned by this user or root and writable by nobody else (no group or other
    write bit); every directory above must be owned by this user or root and, if others may write it, sticky
    (``/tmp``: others can add entries there, but not rename or remove this user's). On a system without
    POSIX owners (Windows) nothing is checked.
    """
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    if uid is None:
        return None
    given = Path(os.path.abspath(file))
    for chain in dict.fromkeys((given, Path(os.path.realpath(given)))):
        for i, entry in enumerate((chain, *chain.parents)):
            try:
                st = os.lstat(entry)
            except FileNotFoundError:
                continue  # not made yet (save makes it, with no write bit for others)
            except OSError as e:
                return f"cannot check {entry}: {e.strerror or e}"
            what = "the cache file" if i == 0 else "its directory" if i == 1 else "a directory above it"
            if stat.S_ISLNK(st.st_mode):
                continue  # the real path is checked too
            if st.st_uid not in (uid, 0):
                return f"{what} {entry} is owned by another user (uid {st.st_uid}); it holds code this process loads"
            others_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            if others_write and (i < 2 or not st.st_mode & stat.S_ISVTX):
                return (
                    f"{what} {entry} is writable by {'its group' if others_write == stat.S_IWGRP else 'others'} "
                    f"(mode {stat.S_IMODE(st.st_mode):o}); it holds code this process loads: chmod go-w it"
                )
    return None


def _make_private_dirs(directory: Path) -> None:
    """Make ``directory`` and its missing parents, each writable by this user only (mode 700)."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    for d in reversed(missing):
        d.mkdir(mode=0o700, exist_ok=True)


class _Unfit(Exception):
    """A cache file that cannot be used; the message says why."""


def _read(file: Path, key: CacheKey) -> tuple[dict[str, Any], bytes]:
    """``(header, payload)`` of a sound file of ``key``.

    Raises:
      _Unfit: if the file is corrupt or made for another key.
      OSError: if it cannot be read.
    """
    with open(file, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise _Unfit("corrupt: not a funcamp compile cache file (version 1)")
        line = f.readline(_MAX_HEADER)
        payload = f.read()
    try:
        header = json.loads(line)
        total, sha, digest, fields = (
            int(header["payload_bytes"]),
            str(header["payload_sha256"]),
            header["digest"],
            header["key"],
        )
        torch_bytes = int(header["torch_bytes"])
        kernels = [(str(name), int(n), str(h)) for name, n, h in header["kernels"]]
        if not isinstance(fields, dict):
            raise TypeError(fields)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise _Unfit("corrupt: unreadable header") from None
    if digest != key.digest:
        differ = sorted(k for k in set(key.fields) | set(fields) if key.fields.get(k) != fields.get(k))
        raise _Unfit(f"made for another step: its key differs in {', '.join(differ) or 'its digest'}")
    if len(payload) != total or torch_bytes < 0 or torch_bytes + sum(n for _, n, _ in kernels) != total:
        raise _Unfit(f"corrupt: {len(payload)} payload bytes, the header says {total}")
    if hashlib.sha256(payload).hexdigest() != sha:
        raise _Unfit("corrupt: checksum mismatch")
    if not all(_KERNEL_NAME.fullmatch(name) for name, _, _ in kernels):
        raise _Unfit("corrupt: a kernel file name outside the inductor cache layout")
    offset = torch_bytes  # each kernel where the header says (the header is outside the payload's checksum)
    for name, n, h in kernels:
        if n < 0 or hashlib.sha256(payload[offset : offset + n]).hexdigest() != h:
            raise _Unfit(f"corrupt: kernel {name} does not match its checksum")
        offset += n
    header["kernels"] = kernels
    return header, payload


# --- C++ kernels ---------------------------------------------------------------------------------------
# On the CPU, inductor compiles each kernel to a shared library in its cache directory, named by the hash of
# the kernel's source and compiler command line; torch's mega-cache carries the graphs' Python wrappers but
# not these libraries (it bundles Triton kernels only), so a process with an empty inductor cache would run
# the C++ compiler again for every kernel. The file carries them too: those this process loaded.

#: ``<2 characters>/<hash>[.main].so``, as inductor names its libraries (``codecache.get_path``).
_KERNEL_NAME = re.compile(r"[a-z0-9]{2}/c[a-z0-9]{20,80}(\.main)?\.so")


def _kernel_files() -> list[tuple[str, Path]]:
    """``(name relative to the inductor cache, path)`` of the C++ libraries a process needs to skip the compiler.

    The kernels this process's compiled code loaded, read from inductor's in-process code caches, and the
    small programs inductor compiles in each new cache directory to find the CPU's instruction sets (a
    ``.so`` whose ``.cpp`` is at most 2 KB). Private parts of torch: where they change, fewer libraries are
    carried and the next process compiles the rest. Any library is safe to carry: inductor looks one up by
    the hash of its source and compiler command line only.
    """
    try:
        from torch._inductor import codecache
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        keys: set[str] = set()
        pending = [codecache.CppCodeCache]
        while pending:
            cls = pending.pop()
            keys.update(vars(cls).get("cache", {}))
            pending.extend(cls.__subclasses__())
        root = Path(cache_dir())
    except (ImportError, AttributeError, TypeError):
        return []
    libs = {lib for key in keys for lib in (root / key[1:3]).glob(f"{key}*.so")}
    for lib in root.glob("??/c*.so"):  # the instruction-set probes
        source = lib.with_name(lib.name.removesuffix(".so") + ".cpp")
        if not lib.name.endswith(".main.so") and source.is_file() and source.stat().st_size <= 2048:
            libs.add(lib)
    named = ((f"{lib.parent.name}/{lib.name}", lib) for lib in libs)
    return sorted((name, lib) for name, lib in named if _KERNEL_NAME.fullmatch(name))


def _install_kernels(kernels: list[tuple[str, int, str]], blob: bytes) -> int:
    """Write the carried libraries into this process's inductor cache where missing; how many were written."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from funcamp.checkpoint._atomic import replace_atomically

    root, offset, written = Path(cache_dir()), 0, 0
    for name, n, sha in kernels:
        data, offset = blob[offset : offset + n], offset + n
        target = root / name
        if target.exists() or hashlib.sha256(data).hexdigest() != sha:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(str(target), lambda f, data=data: f.write(data), "wb")
        target.chmod(0o755)  # as inductor leaves its libraries
        written += 1
    return written


def _count(info: Any) -> int:
    artifacts = getattr(info, "artifacts", None) or {}
    return sum(len(v) for v in artifacts.values())


def load(file: str | os.PathLike[str], key: CacheKey) -> CacheResult:
    """Load the compile artifacts in ``file`` into torch's caches, if the file fits ``key``.

    Call it before the step's first call. A missing file gives ``action="missing"``; a corrupt one, one
    written for another key, one that cannot be read, or one torch refuses gives ``action="ignored"`` with
    the reason: nothing is loaded and nothing raises (the step then compiles as without a cache). Loading
    writes torch's artifacts into the inductor and AOTAutograd caches (``TORCHINDUCTOR_CACHE_DIR``) and the
    carried C++ libraries beside them where missing; torch uses each only for the graph or kernel source it
    was compiled from. A cache file holds compiled code and pickles, as torch's own cache directory does: a
    file, or a directory holding it, that another user owns or can write (group or other write bit; a
    directory above it may be sticky and world-writable, as ``/tmp``) is refused (``action="refused"``,
    the reason in one line) and never read, as ssh refuses a key file others can change.

    Args:
      file: the cache file (see :func:`path`).
      key: the step's key (:func:`step_key`).
    Returns:
      A :class:`CacheResult` (``loaded``, ``missing``, ``ignored`` or ``refused``); ``artifacts`` counts
      torch's artifacts and the C++ libraries.
    """
    file = Path(file)
    untrusted = _untrusted(file)
    if untrusted is not None:
        return CacheResult("refused", str(file), reason=untrusted)
    if not file.exists():
        return CacheResult("missing", str(file))
    try:
        header, payload = _read(file, key)
    except _Unfit as e:
        return CacheResult("ignored", str(file), reason=str(e))
    except OSError as e:
        return CacheResult("ignored", str(file), reason=f"cannot read it: {e.strerror or e}")
    torch_bytes = header["torch_bytes"]
    try:
        info = torch.compiler.load_cache_artifacts(payload[:torch_bytes])
        if info is None:
            return CacheResult("ignored", str(file), reason="torch refused it (load_cache_artifacts returned None)")
        _install_kernels(header["kernels"], payload[torch_bytes:])
    except Exception as e:  # torch's own format changed, or a cache directory it cannot write
        return CacheResult("ignored", str(file), reason=f"torch refused it: {type(e).__name__}: {e}".splitlines()[0])
    return CacheResult("loaded", str(file), _count(info) + len(header["kernels"]))


def _why_nothing() -> str:
    """Why torch recorded no artifact: its count of graphs its FX graph cache bypassed in this process, when it has
    one (torch says why in its ``cache`` log only)."""
    from torch._dynamo.utils import counters  # loaded by the compile that came first

    reason = "torch recorded no compile artifacts in this process"
    bypassed = counters["inductor"].get("fxgraph_cache_bypass", 0)
    if not bypassed:
        return reason
    graphs = "graph" if bypassed == 1 else "graphs"
    return (
        f"{reason}: its FX graph cache bypassed {bypassed} {graphs} (one holding an operator torch cannot cache, "
        "such as a higher-order operator torch does not mark cacheable (funcamp's compiled step marks the scan of "
        "functionalize(scan=...)); TORCH_LOGS=+cache says which), so every new process compiles the step again"
    )


def save(file: str | os.PathLike[str], key: CacheKey) -> CacheResult:
    """Write every compile artifact torch recorded in this process to ``file``, for ``key``.

    Call it after the step's first call (its compilation). What goes in: the bytes of
    :func:`torch.compiler.save_cache_artifacts` (AOTAutograd and inductor entries, autotuning results) and,
    on the CPU, the C++ kernel libraries this process loaded (torch's mega-cache leaves them out). The file
    is replaced atomically (a temporary file in the same directory, fsynced and renamed), so a reader sees
    the old file or the new one; the directory is made if needed, writable by this user only. A file or
    directory that :func:`load` would refuse is not written (``action="refused"``). A file that already holds the same
    artifacts for the same key is left as it is (``action="unchanged"``). With caches off
    (``TORCHINDUCTOR_FORCE_DISABLE_CACHES``) or a backend that writes none (``aot_eager``) there is nothing
    to save (``action="nothing"``), and so with a step torch's FX graph cache will not take (one holding a
    higher-order operator torch does not mark cacheable; funcamp's compiled step marks the scan of
    ``funcamp.nn.functionalize(scan=...)`` cacheable, :func:`funcamp.train._assemble.inductor_options`), which the
    reason then says.

    Args:
      file: the cache file (see :func:`path`).
      key: the step's key (:func:`step_key`).
    Returns:
      A :class:`CacheResult` (``saved``, ``unchanged``, ``nothing`` or ``refused``).
    Raises:
      OSError: if the directory cannot be made or the file cannot be written.
    """
    from funcamp.checkpoint._atomic import replace_atomically

    file = Path(file)
    untrusted = _untrusted(file)
    if untrusted is not None:
        return CacheResult("refused", str(file), reason=untrusted)
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return CacheResult("nothing", str(file), reason=_why_nothing())
    blob, info = saved
    kernels, parts = [], [blob]
    for name, lib in _kernel_files():
        data = lib.read_bytes()
        kernels.append([name, len(data), hashlib.sha256(data).hexdigest()])
        parts.append(data)
    payload = b"".join(parts)
    artifacts = {kind: sorted(keys) for kind, keys in sorted(info.artifacts.items())}
    count = sum(len(keys) for keys in artifacts.values()) + len(kernels)
    header = {
        "key": key.fields,
        "digest": key.digest,
        "payload_bytes": len(payload),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "torch_bytes": len(blob),
        "artifacts": artifacts,
        "kernels": kernels,
    }
    if _holds(file, key, artifacts, kernels):
        return CacheResult("unchanged", str(file), count)
    _make_private_dirs(file.parent)

    def write(f: Any) -> None:
        f.write(MAGIC)
        f.write(json.dumps(header, sort_keys=True, separators=(",", ":")).encode() + b"\n")
        f.write(payload)

    replace_atomically(str(file), write, "wb")
    return CacheResult("saved", str(file), count)


def _holds(file: Path, key: CacheKey, artifacts: dict[str, list[str]], kernels: list[list[Any]]) -> bool:
    """Whether ``file`` is a sound file of ``key`` with the same artifacts (torch's keys, their order aside)
    and the same kernel libraries."""
    try:
        header, _ = _read(file, key)
    except (_Unfit, OSError):
        return False
    return header.get("artifacts") == artifacts and header["kernels"] == [tuple(k) for k in kernels]
