"""What :func:`funcamp.capture.check` reports: each :class:`Violation`, the :class:`CaptureReport`, and the source
line each is placed at (the last frame outside torch and this package: the line that did it)."""

from __future__ import annotations

import os
import traceback
from typing import Any, NamedTuple

import torch

__all__ = ["CaptureReport", "Violation", "error_frame", "node_frame", "user_frame"]

_PACKAGE = os.path.dirname(__file__) + os.sep  # funcamp/capture/


class Violation(NamedTuple):
    """One thing in a traced step that CUDA-graph capture forbids.

    Attributes:
      kind: ``"host sync"``, ``"host branch"``, ``"cpu tensor"``, ``"data-dependent shape"``, ``"rng state"``
        or ``"generator"``.
      op: the ATen op, Python function or input that does it.
      where: the source line that did it (the last frame outside torch), or the input's path.
    """

    kind: str
    op: str
    where: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.op} at {self.where}"


_WHY = {
    "host sync": "the host waits for the device and reads a value that replay would not read again",
    "host branch": "Python branches on a tensor's value, which replay cannot re-decide",
    "cpu tensor": "a CPU tensor in a device step is read on the host when recorded and never again",
    "data-dependent shape": "an output's shape depends on values; a graph has fixed shapes",
    "rng state": "RNG state is read or set on the host; replay neither reads nor restores it",
    "generator": "an explicit torch.Generator is not advanced by replay (only the default CUDA generator is)",
    "cond": "inductor evaluates torch.cond's predicate on the host (.item()), a sync capture forbids",
}


class CaptureReport(NamedTuple):
    """What :func:`check` found.

    Attributes:
      violations: each thing capture forbids, in trace order, one entry per (kind, op, where).
      random_ops: draws from the default generator (dropout): graph-safe, replay advances its offset.
      graph: the traced ``torch.fx.GraphModule`` (None when tracing stopped at a host branch).
    """

    violations: tuple[Violation, ...]
    random_ops: int
    graph: Any

    @property
    def ok(self) -> bool:
        """Whether nothing in the traced step forbids capture."""
        return not self.violations

    def kinds(self) -> set[str]:
        """The kinds of the violations found."""
        return {v.kind for v in self.violations}

    def __str__(self) -> str:
        if self.ok:
            return f"capturable (random draws from the default generator: {self.random_ops})"
        lines = [f"not capturable: {len(self.violations)} violation(s)"]
        lines += [f"  {v} ({_WHY[v.kind]})" for v in self.violations]
        return "\n".join(lines)


def node_frame(n: Any) -> str:
    """The source line that made the traced node ``n`` (from its recorded stack), as ``file:line in fn``."""
    trace = n.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.splitlines() if line.strip().startswith("File ")]
    return _pick(frames) or "(no source recorded)"


#: Frames that pass a call on (a torch function mode such as funcamp.ops.OpPolicies, a tensor subclass): the caller
#: is the line that made it. Frames of generated code (``<eval_with_key>``: an FX graph re-run) are torch's too.
_PASSING = ("in __torch_function__", "in __torch_dispatch__")


def _pick(frames: list[str]) -> str:
    """The last frame outside torch, this package and the frames that pass a call on, as ``file:line in fn``."""
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    for line in reversed(frames):
        if torch_dir in line or _PACKAGE in line or "contextlib.py" in line or "<eval_with_key>" in line:
            continue
        if line.endswith(_PASSING):
            continue
        return _short(line)
    return _short(frames[-1]) if frames else ""


def _short(line: str) -> str:
    # 'File "/a/b/c.py", line 12, in fn' -> 'c.py:12 in fn'
    try:
        file_part, line_part, fn_part = (p.strip() for p in line.split(",", 2))
        return f"{file_part[6:-1].rsplit('/', 1)[-1]}:{line_part[5:]} {fn_part}"
    except ValueError:
        return line


def user_frame(stack: traceback.StackSummary) -> str:
    """The line of ``stack`` that did it: the last frame outside torch and this package, as ``file:line in fn``."""
    return _pick([f'File "{f.filename}", line {f.lineno}, in {f.name}' for f in stack])


def error_frame(error: BaseException) -> str:
    """The line that raised ``error`` (the last frame of its traceback outside torch and this package)."""
    return user_frame(traceback.extract_tb(error.__traceback__))
