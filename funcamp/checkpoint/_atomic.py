"""Atomic file replacement, shared by both checkpoint formats (and :mod:`funcamp.compile_cache`): a temporary
file beside the target, fsynced, renamed over it, the directory fsynced; a killed writer's temporary removed by
the next write from the same host.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from typing import Any


def replace_atomically(path: str, write: Any, mode: str) -> None:
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
    fsync_dir(directory)


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


def fsync_dir(directory: str) -> None:
    """Flush ``directory``'s entries to disk (a rename made durable); nothing where a directory cannot be opened."""
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
