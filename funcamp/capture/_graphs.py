"""CUDA-graph capture of a donating train step: :func:`cuda_graph` and the :class:`CapturedStep` it returns.

See :mod:`funcamp.capture` for why an explicit ``torch.cuda.CUDAGraph`` rather than inductor's CUDA-graph trees.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from funcamp import _tree
from funcamp._errors import check_not_donated, mark_donated

__all__ = ["CaptureWarning", "CapturedStep", "cuda_graph"]

_PACKAGE = os.path.dirname(__file__) + os.sep  # funcamp/capture/: its frames are not the caller's


class CaptureWarning(RuntimeWarning):
    """The step could not be captured as a CUDA graph (the message says why); it runs uncaptured."""


def cuda_graph(step: Callable[[Any, Any], tuple[Any, Any]], *, warmup: int = 2) -> CapturedStep:
    """``step`` replayed as one CUDA graph after ``warmup`` ordinary calls.

    ``step(state, batch) -> (new_state, metrics)`` must donate its state (``make_train_step(...,
    donate=True)``): the new state is written into the given state's tensors, so that a graph recorded once
    writes into the right place at every replay. The first ``warmup`` calls run ``step`` as it is (on a side
    stream: compilation, autotuning and cuBLAS set-up happen there, as ``torch.cuda.graph`` asks); the next
    call records one call of ``step`` into a ``torch.cuda.CUDAGraph`` and replays it, and later calls copy the
    batch into the graph's input buffers and replay. Every call is a real train step: the values are the
    uncaptured step's (random draws of the default CUDA generator included: replay advances its philox
    offset, so dropout masks differ from step to step as they do uncaptured).

    A call with another state (a state loaded from a checkpoint, not the one the last call returned) records
    a new graph. A batch whose tensors differ in shape, dtype or device from the recorded one, or whose
    non-tensor leaves differ, runs uncaptured (one :class:`CaptureWarning` per reason). When capture cannot
    happen at all (no CUDA, a state or batch tensor on the CPU, a step that does not donate, an error while
    recording) one :class:`CaptureWarning` says why and every call runs ``step`` uncaptured
    (:attr:`CapturedStep.reason` holds the message).

    The metrics returned are copies of the graph's outputs (a few 0-d tensors: one small copy each), so that
    they stay valid after later replays; the state returned is a new :class:`funcamp.TrainState` on the same
    tensors, and the given one is marked donated, as the donating step does.

    Args:
      step: a train step that donates its state (``make_train_step(..., donate=True)``).
      warmup: ordinary calls before the capture (>= 1; the first compiles).
    Returns:
      A :class:`CapturedStep`, called as ``step(state, batch) -> (new_state, metrics)``.
    Raises:
      TypeError: if ``step`` is not callable.
      ValueError: if ``warmup`` is not an int >= 1.
    """
    if not callable(step):
        raise TypeError(f"cuda_graph: step must be callable (a train step), got {type(step).__name__}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise ValueError(f"cuda_graph: warmup must be an int >= 1 (the first call compiles), got {warmup!r}")
    return CapturedStep(step, warmup)


class _Recorded(NamedTuple):
    """A recorded call: the graph, the state leaves it writes into, the batch buffers it reads, its outputs."""

    graph: Any
    state_leaves: list[Any]
    batch_spec: Any
    batch_leaves: list[Any]
    metrics: Any


class CapturedStep:
    """A train step replayed as one CUDA graph (see :func:`cuda_graph`).

    Attributes:
      reason: None while capture is possible; else the message saying why every call runs uncaptured.
      replays: calls served by a graph replay so far.
    """

    def __init__(self, step: Callable[[Any, Any], tuple[Any, Any]], warmup: int) -> None:
        self.step, self.warmup = step, warmup
        self.reason: str | None = None
        self.replays = 0
        self._warm_calls = 0
        self._recorded: _Recorded | None = None
        self._warned: set[str] = set()

    @property
    def captured(self) -> bool:
        """Whether the next call with the last state and a like batch replays a graph."""
        return self._recorded is not None

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        if self.reason is None and self._warm_calls == 0:
            self._give_up_if(_why_not_device(state, batch))
        if self.reason is not None:
            return self.step(state, batch)
        recorded = self._recorded
        if recorded is not None and _same_leaves(state, recorded.state_leaves):
            why = _batch_mismatch(batch, recorded)
            if why is not None:
                self._warn_once(f"cuda_graph: {why}; this call runs uncaptured")
                return self.step(state, batch)
            return self._replay(state, batch, recorded)
        if self._warm_calls < self.warmup:
            self._warm_calls += 1
            return self._warm(state, batch)
        self._recorded = None  # another state: record again
        if self._give_up_if(_why_not_device(state, batch)):
            return self.step(state, batch)
        return self._record(state, batch)

    def _warm(self, state: Any, batch: Any) -> tuple[Any, Any]:
        leaves = _tree.tree_leaves(state)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            new_state, metrics = self.step(state, batch)
        torch.cuda.current_stream().wait_stream(side)
        self._give_up_if(_why_not_donated(leaves, new_state))
        return new_state, metrics

    def _record(self, state: Any, batch: Any) -> tuple[Any, Any]:
        # A new container on the same tensors: recording marks it donated, not the caller's state (which an
        # uncaptured run after a failed recording still needs).
        check_not_donated(state, "train_step")
        proxy = _tree.tree_map(lambda x: x, state)
        batch_leaves, batch_spec = _tree.tree_flatten(batch)
        static = [x.clone() if isinstance(x, torch.Tensor) else x for x in batch_leaves]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                new_state, metrics = self.step(proxy, _tree.tree_unflatten(batch_spec, static))
        except Exception as error:  # noqa: BLE001 (any failure to record: say why once, run uncaptured)
            self._give_up_if(f"recording the step failed ({type(error).__name__}: {_first_line(error)})")
            return self.step(state, batch)
        leaves = _tree.tree_leaves(state)
        if self._give_up_if(_why_not_donated(leaves, new_state)):
            return self.step(state, batch)
        self._recorded = _Recorded(graph, leaves, batch_spec, static, metrics)
        return self._replay(state, batch, self._recorded)

    def _replay(self, state: Any, batch: Any, recorded: _Recorded) -> tuple[Any, Any]:
        check_not_donated(state, "train_step")
        for dst, src in zip(recorded.batch_leaves, _tree.tree_leaves(batch)):
            if isinstance(dst, torch.Tensor) and dst is not src:
                dst.copy_(src, non_blocking=True)
        recorded.graph.replay()
        self.replays += 1
        metrics = _tree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, recorded.metrics)
        new_state = _tree.tree_map(lambda x: x, state)
        if dataclasses.is_dataclass(state):  # a TrainState: consumed, as the donating step marks it
            mark_donated(state)
        return new_state, metrics

    def _give_up_if(self, why: str | None) -> bool:
        if why is None:
            return False
        self.reason = f"cuda_graph: the step runs uncaptured: {why}"
        self._recorded = None
        self._warn_once(self.reason)
        return True

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, CaptureWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside this package (the user's call of the step)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]


def _why_not_device(state: Any, batch: Any) -> str | None:
    """Why ``state`` and ``batch`` cannot be recorded on a CUDA device, or None."""
    if not torch.cuda.is_available():
        return "CUDA is not available (a CUDA graph needs a CUDA device)"
    devices = set()
    for name, tree in (("state", state), ("batch", batch)):
        for path, x in zip(_tree.tree_paths(tree), _tree.tree_leaves(tree)):
            if not isinstance(x, torch.Tensor):
                continue
            if x.device.type != "cuda":
                how = "move the batch to the device before the step" if name == "batch" else "build it on the device"
                return (
                    f"{name} leaf {path!r} is on {x.device}: a graph replays device work only, so it would keep the "
                    f"value it read when recorded; {how}"
                )
            devices.add(x.device)
    if len(devices) > 1:
        return f"the state and batch span several devices ({sorted(map(str, devices))}); capture records one"
    return None


def _why_not_donated(leaves: list[Any], new_state: Any) -> str | None:
    """Why a step that returned ``new_state`` for a state of ``leaves`` cannot be replayed, or None."""
    new = _tree.tree_leaves(new_state)
    if len(new) == len(leaves) and all(a is b for a, b in zip(new, leaves) if isinstance(a, torch.Tensor)):
        return None
    return (
        "the step returned a state on new tensors; a graph writes where it was recorded, so the step must write "
        "the next state into the given one: build it with make_train_step(..., donate=True)"
    )


def _same_leaves(state: Any, leaves: list[Any]) -> bool:
    now = _tree.tree_leaves(state)
    return len(now) == len(leaves) and all(a is b for a, b in zip(now, leaves))


def _batch_mismatch(batch: Any, recorded: _Recorded) -> str | None:
    """Why ``batch`` cannot go through the recorded graph's input buffers, or None."""
    leaves, spec = _tree.tree_flatten(batch)
    if spec != recorded.batch_spec:
        return "the batch's structure differs from the recorded one"
    for path, x, y in zip(_tree.tree_paths(batch), leaves, recorded.batch_leaves):
        if isinstance(y, torch.Tensor):
            if not isinstance(x, torch.Tensor) or (x.shape, x.dtype, x.device) != (y.shape, y.dtype, y.device):
                got = (tuple(x.shape), x.dtype, str(x.device)) if isinstance(x, torch.Tensor) else type(x).__name__
                return f"batch leaf {path!r} is {got}, the recorded graph's {(tuple(y.shape), y.dtype, str(y.device))}"
        elif not (x is y or x == y):
            return f"batch leaf {path!r} is {x!r}, recorded as {y!r} (a Python value is baked into the graph)"
    return None
