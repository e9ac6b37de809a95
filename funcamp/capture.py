"""CUDA-graph capture of a donating train step, and a check on the CPU of what capture forbids.

A CUDA graph records the kernels of one call and replays them with one launch: no Python, no Dynamo guards,
no per-kernel launch cost. It replays exactly what it recorded, at the addresses it recorded, so the step it
records must keep its state at fixed addresses, read nothing on the host, keep its shapes, and draw random
numbers only from a generator that replay advances. funcamp's step meets this by construction: it is pure,
compiled whole (``fullgraph=True``), reads nothing on the host, and with ``make_train_step(..., donate=True)``
writes the next state into the tensors of the state it is given, so the state never moves.

:func:`cuda_graph` wraps such a step: ``step = funcamp.capture.cuda_graph(funcamp.make_train_step(loss_fn,
opt, donate=True))``. It is an explicit ``torch.cuda.CUDAGraph`` around the compiled callable rather than
``torch.compile(mode="reduce-overhead")`` (inductor's CUDA-graph trees), because:

* the trees skip any graph that mutates an input they do not know to be static ("skipping cudagraphs due to
  mutated inputs"), and the donated state is exactly that: every state leaf would have to be marked with
  ``torch._dynamo.mark_static_address`` (and guarded on its identity) for the trees to capture it;
* the trees say why they skipped only in a log that is off by default; the wrapper says it once, as a warning,
  and runs the step uncaptured (:attr:`CapturedStep.reason`);
* the wrapper records the whole call (the fused optimizer kernels' writes into the state included) and
  replays it with one ``graph.replay()``; the compiled step itself is unchanged, so the step built without the
  wrapper is the one the rest of the suite tests.

:func:`check` traces a step on the CPU (``make_fx`` over fake tensors standing in for device tensors) and
lists what capture forbids: host syncs (``.item()``, ``bool(tensor)``), CPU tensors in a device step,
data-dependent shapes (``nonzero``, ``masked_select``), RNG state calls and explicit generators, and
``torch.cond`` (inductor evaluates its predicate on the host). The property therefore holds without a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from funcamp import _tree
from funcamp._errors import check_not_donated, mark_donated

__all__ = ["CaptureReport", "CaptureWarning", "CapturedStep", "Violation", "check", "cuda_graph"]


class CaptureWarning(RuntimeWarning):
    """The step could not be captured as a CUDA graph (the message says why); it runs uncaptured."""


# --- the wrapper -------------------------------------------------------------------------------------------


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
    """The ``stacklevel`` of the first frame outside this module (the user's call of the step)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename == __file__:
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


# --- the check ---------------------------------------------------------------------------------------------


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


_HOST_SYNC_OPS = ("_local_scalar_dense", "item", "is_nonzero", "equal", "allclose")
_STAND_IN = torch.device("meta")
#: torch's tracing code, which saves and restores the RNG state while it traces (not in the traced step).
_TRACING_MACHINERY = (
    "torch/_higher_order_ops/",
    "torch/_dynamo/",
    "torch/fx/",
    "torch/_subclasses/",
    "torch/_functorch/",
)


def check(fn: Callable[..., Any], *args: Any, keep_on_host: Any = ()) -> CaptureReport:
    """Trace ``fn(*args)`` as a device step, on the CPU, and list what CUDA-graph capture forbids.

    Every tensor in ``args`` is replaced by a fake tensor of its shape, dtype and strides on a stand-in device
    (``meta``: a CPU build of torch cannot run autograd on fake ``cuda`` tensors), except those in
    ``keep_on_host`` (compared by identity), which stay fake CPU tensors: what a step sees when a tensor was
    left on the host. ``fn`` is traced with ``torch.fx.experimental.proxy_tensor.make_fx`` under a
    ``FakeTensorMode`` whose shape environment records ``.item()`` and value-dependent shapes as symbols
    instead of failing, so each is found where it is. Nothing is computed and nothing is compiled (a GPT
    step traces in seconds). Check the step built with ``compile=False``: the stages it runs are the ones
    ``compile=True`` compiles; code that branches on ``device.type == "cuda"`` takes its other side here.

    Found (see :class:`Violation`): host syncs (``aten._local_scalar_dense``, ``aten.is_nonzero``,
    ``aten.equal``); a Python branch on a tensor's value (which stops the trace: the rest is not checked);
    tensors on the CPU, inputs (by path) or made by the step (``torch.ones(())`` without a device);
    data-dependent shapes (any output with a size known only from values); RNG state calls
    (``torch.get_rng_state``, ``set_rng_state``, ``manual_seed``, ``torch.cuda``'s, ``fork_rng``); random
    ops given an explicit ``generator``; ``torch.cond`` (inductor reads its predicate on the host). ``.tolist()``
    is read as ``.item()`` per element and ``.numpy()`` recorded (the trace stops there); a tensor made on the CPU
    (``torch.arange(n)`` without a device) is recorded and the trace goes on with it on the stand-in device. Each is
    placed at the last frame outside torch, this module and the frames that pass a call on (a
    ``__torch_function__`` such as funcamp's op policies): the line that did it. Tensors the step holds rather
    than takes (``apply_fn``'s frozen weights, buffers held as constants) stand in for device tensors where they
    are on the arguments' device; a CPU tensor no output depends on (the first call's host-side checks, outside
    the compiled graph) is not reported.

    Args:
      fn: the step, ``fn(*args)``; pure (it runs on fake tensors).
      args: its arguments, pytrees of tensors (a :class:`funcamp.TrainState` and a batch).
      keep_on_host: tensors of ``args`` to leave on the CPU in the trace.
    Returns:
      A :class:`CaptureReport`; ``report.ok`` when capture may proceed, ``str(report)`` for the list.
    Raises:
      TypeError: if ``fn`` is not callable.
      Exception: what ``fn`` raises while traced, other than a branch on a tensor's value, as itself.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

    if not callable(fn):
        raise TypeError(f"capture.check: fn must be callable (the train step), got {type(fn).__name__}")
    leaves, spec = _tree.tree_flatten(args)
    paths = _tree.tree_paths(args)
    keep = list(_tree.tree_leaves(keep_on_host))
    found: list[Violation] = []
    shape_env = ShapeEnv(allow_scalar_outputs=True, allow_dynamic_output_shape_ops=True)
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    devices = {x.device for x in leaves if isinstance(x, torch.Tensor) and not any(x is k for k in keep)}
    reads = _HostReads(found)
    _constants_on_the_stand_in(mode, devices, found, reads)
    with mode:
        fake = [_fake(x, any(x is k for k in keep)) if isinstance(x, torch.Tensor) else x for x in leaves]
    tensor_at = [i for i, x in enumerate(fake) if isinstance(x, torch.Tensor)]

    def flat(*tensors: torch.Tensor) -> list[Any]:
        given = list(fake)
        for i, t in zip(tensor_at, tensors):
            given[i] = t
        out = fn(*_tree.tree_unflatten(spec, given))
        return [x for x in _tree.tree_leaves(out) if isinstance(x, torch.Tensor)]

    graph = None
    with mode, _recording_rng_state(found), _all_frames(), _as_compiling(), reads:
        try:
            with warnings.catch_warnings():
                # torch's scan operator traces its body with Dynamo, which reads .grad of the stacked (non-leaf)
                # parameters it is given: torch's warning, not the step's
                warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
                graph = make_fx(flat, record_stack_traces=True)(*[fake[i] for i in tensor_at])
        except GuardOnDataDependentSymNode as error:
            found.append(Violation("host branch", "bool(tensor) / a Python branch on a value", _frame_of(error)))
        except _TraceStopped:  # recorded where it stopped
            pass
    if graph is not None:
        found += _inputs_on_host(graph, [paths[i] for i in tensor_at])
        found += _graph_violations(graph, _live(graph))
    random_ops = 0 if graph is None else sum(_is_random(n) for n in graph.graph.nodes if n.op == "call_function")
    return CaptureReport(tuple(dict.fromkeys(found)), random_ops, graph)


def _as_compiling() -> Any:
    """Within: ``torch.compiler.is_compiling()`` is True (torch's own flag, as non-strict export sets it), so that
    the step takes the path Dynamo traces: its eager-only checks, which may read values, stay out, and
    ``torch.cond`` is where the compiled step has it."""
    return torch.compiler._compile_session_context()


@contextlib.contextmanager
def _all_frames() -> Iterator[None]:
    """Within: ``make_fx(record_stack_traces=True)`` keeps every frame of each node's stack (by default it keeps
    those of ``forward`` methods only); :func:`_pick` takes the last one outside torch."""
    from torch.fx.experimental.proxy_tensor import PythonKeyTracer

    saved = PythonKeyTracer.__dict__.get("_filter_traceback_frames")
    PythonKeyTracer._filter_traceback_frames = lambda self, summary: summary  # type: ignore[method-assign]
    try:
        yield
    finally:
        if saved is None:
            del PythonKeyTracer._filter_traceback_frames
        else:
            PythonKeyTracer._filter_traceback_frames = saved  # type: ignore[method-assign]


def _constants_on_the_stand_in(mode: Any, devices: set[torch.device], found: list[Violation], reads: Any) -> None:
    """Tensors the step holds rather than takes (``apply_fn``'s frozen and int8 weights, its buffers held as
    constants, a model's non-persistent buffers) enter the trace as fakes on the stand-in device where they are
    on the device of the step's arguments (as the arguments do: on a CPU build that device is the CPU); one on the
    CPU while the arguments are elsewhere is a CPU tensor in a device step, recorded where it is first used. A
    tensor the step makes from data (``torch.tensor(2.0)``: made for real, then lifted into the trace) stays where
    it was made, and a CPU one is found in the graph."""
    converter = mode.fake_tensor_converter
    original, made = converter.from_real_tensor, {}

    def from_real_tensor(fake_mode: Any, t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if t.device.type == "meta" or reads.making_from_data or id(t) in made and made[id(t)][0] is t:
            return made[id(t)][1] if id(t) in made else original(fake_mode, t, *args, **kwargs)
        if t.device in devices or not devices:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                stand_in = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=_STAND_IN)
                stand_in.requires_grad_(t.requires_grad)
            made[id(t)] = (t, original(fake_mode, stand_in, *args, **kwargs))
            return made[id(t)][1]
        if t.device.type == "cpu":
            found.append(Violation("cpu tensor", "constant", _user_frame(traceback.extract_stack()[:-1])))
        return original(fake_mode, t, *args, **kwargs)

    converter.from_real_tensor = from_real_tensor


class _HostReads(torch.overrides.TorchFunctionMode):
    """Within the trace: what would stop it is recorded and stepped over. A tensor made on the CPU (``torch.arange(n)``
    without a device, ``x.cpu()``) is recorded from the graph (its node) and continues on the stand-in device, so that
    later ops do not fail to mix devices; ``tolist()`` reads each element (``.item()``: host syncs, found at the
    caller's line); ``numpy()`` is recorded and stops the trace."""

    def __init__(self, found: list[Violation]) -> None:
        super().__init__()
        self.found = found
        self.making_from_data = False  # within torch.tensor and its kin (see _constants_on_the_stand_in)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist:
            return _elements(args[0])
        if func in (torch.Tensor.numpy, torch.Tensor.__array__):
            self.found.append(Violation("host sync", f"Tensor.{func.__name__}", _user_frame(traceback.extract_stack())))
            raise _TraceStopped
        if func in _FROM_DATA:
            self.making_from_data = True
            try:
                out = func(*args, **kwargs)
            finally:
                self.making_from_data = False
        else:
            out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.device.type == "cpu" and not _is_host_input(args, kwargs):
            return out.to(_STAND_IN)
        return out


#: Functions that make a tensor from Python data (a real tensor, lifted into the trace).
_FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor, torch.from_numpy)


def _is_host_input(args: Any, kwargs: Any) -> bool:
    """Whether an argument is itself on the CPU (kept on the host, ``keep_on_host``): its results stay there."""
    return any(
        isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in torch.utils._pytree.tree_leaves((args, kwargs))
    )


def _elements(t: torch.Tensor) -> Any:
    """``t.tolist()`` read element by element with ``.item()`` (each a host sync in the trace)."""
    return t.item() if t.ndim == 0 else [_elements(t[i]) for i in range(t.shape[0])]


def _fake(x: torch.Tensor, on_host: bool) -> torch.Tensor:
    """A tensor like ``x`` (shape, strides, dtype, requires_grad) on the stand-in device, or on the CPU."""
    device = torch.device("cpu") if on_host else _STAND_IN
    out = torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device=device)
    return out.requires_grad_(x.requires_grad)


class _TraceStopped(Exception):
    """Raised into the traced step where it cannot go on (a CUDA RNG state call on a CPU build), after recording."""


class _RecordingGenerator:
    """Stands in for ``torch.random``'s default generator: its state calls are recorded and do nothing."""

    _STATE = ("get_state", "set_state", "manual_seed", "seed", "initial_seed", "graphsafe_get_state")

    def __init__(self, real: Any, found: list[Violation]) -> None:
        self._real, self._found = real, found

    def __getattr__(self, attr: str) -> Any:
        if attr not in self._STATE:
            return getattr(self._real, attr)

        def record(*args: Any, **kwargs: Any) -> Any:
            _record_rng_call(self._found, "torch")
            return torch.zeros(16, dtype=torch.uint8) if attr.endswith("get_state") else 0

        return record


@contextlib.contextmanager
def _recording_rng_state(found: list[Violation]) -> Iterator[None]:
    """Within: RNG state calls (``torch.get_rng_state``, ``set_rng_state``, ``manual_seed``, ``fork_rng``, and
    ``torch.cuda``'s) record a violation instead of running. Only the generator object that ``torch.random``'s
    functions read and the CUDA initialisers that ``torch.cuda.random``'s read are swapped: the functions themselves
    keep their identity, which Dynamo's tables hold."""
    import torch.cuda.random as cuda_random

    def lazy_call(*args: Any, **kwargs: Any) -> None:  # torch.cuda.manual_seed(_all), set_rng_state, seed
        _record_rng_call(found, "torch.cuda")

    def lazy_init() -> None:  # torch.cuda.get_rng_state, initial_seed: no state to return on a CPU build
        _record_rng_call(found, "torch.cuda")
        raise _TraceStopped

    saved = (torch.random.default_generator, cuda_random._lazy_call, cuda_random._lazy_init)
    torch.random.default_generator = _RecordingGenerator(saved[0], found)
    cuda_random._lazy_call, cuda_random._lazy_init = lazy_call, lazy_init
    try:
        yield
    finally:
        torch.random.default_generator, cuda_random._lazy_call, cuda_random._lazy_init = saved


#: torch's wrappers around its RNG functions (``torch._disable_dynamo``): not the caller.
_WRAPPERS = ("torch/_compile.py", "torch/_dynamo/eval_frame.py")


def _record_rng_call(found: list[Violation], module: str) -> None:
    """Record the RNG state function (of ``torch.random`` or ``torch.cuda.random``) that is running."""
    stack = traceback.extract_stack()[:-2]
    inside = [i for i, f in enumerate(stack) if f.filename.endswith(("torch/random.py", "torch/cuda/random.py"))]
    if not inside:
        return
    first = inside[0]  # the outermost RNG function: torch.manual_seed, not the torch.cuda call it makes
    if module == "torch.cuda" and stack[first].filename.endswith("torch/random.py"):
        return
    callers = [f for f in stack[:first] if not f.filename.endswith(_WRAPPERS)]  # past torch's disable-Dynamo wrapper
    if callers and any(part in callers[-1].filename for part in _TRACING_MACHINERY):  # torch.cond's own save/restore
        return
    found.append(Violation("rng state", f"{module}.{stack[first].name}", _user_frame(stack[:first])))


def _inputs_on_host(graph: Any, paths: list[str]) -> list[Violation]:
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    return [
        Violation("cpu tensor", "input", _arg_path(path))
        for n, path in zip(placeholders, paths)
        if _on_host(n.meta.get("val"))
    ]


def _arg_path(path: str) -> str:
    """``args[0].step`` for the path ``0.step`` of a leaf in the arguments' tuple."""
    head, _, rest = path.partition(".")
    return f"args[{head}]" + (f".{rest}" if rest else "")


def _live(graph: Any) -> set[Any]:
    """The nodes some output of the traced step depends on (a CPU tensor no output depends on, such as the first
    call's host-side checks on shape-only copies, is not in the device step)."""
    nodes = list(graph.graph.nodes)
    live = {n for n in nodes if n.op == "output"}
    for n in reversed(nodes):
        if n in live:
            live.update(n.all_input_nodes)
    return live


def _graph_violations(graph: Any, live: set[Any]) -> list[Violation]:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    found = []
    for n in graph.graph.nodes:
        if n.op != "call_function":
            continue
        op, where, val = _op_name(n.target), _frame(n), n.meta.get("val")
        if op in _HOST_SYNC_OPS:
            found.append(Violation("host sync", str(n.target), where))
        elif isinstance(val, torch.Tensor) and free_unbacked_symbols(val):
            found.append(Violation("data-dependent shape", str(n.target), where))
        if isinstance(n.target, torch._ops.HigherOrderOperator) and op == "cond":
            found.append(Violation("cond", "torch.cond", where))
        if _on_host(val) and n in live:
            found.append(Violation("cpu tensor", str(n.target), where))
        if n.kwargs.get("generator") is not None:
            found.append(Violation("generator", str(n.target), where))
    return found


def _op_name(target: Any) -> str:
    """``nonzero`` for ``aten.nonzero.default``; a higher-order op's name (``cond``); else the target's name."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    return getattr(target, "__name__", str(target))


def _on_host(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and val.device.type == "cpu"


def _is_random(n: Any) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags


def _frame(n: Any) -> str:
    trace = n.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.splitlines() if line.strip().startswith("File ")]
    return _pick(frames) or "(no source recorded)"


#: Frames that pass a call on (a torch function mode such as funcamp.ops.OpPolicies, a tensor subclass): the caller
#: is the line that made it. Frames of generated code (``<eval_with_key>``: an FX graph re-run) are torch's too.
_PASSING = ("in __torch_function__", "in __torch_dispatch__")


def _pick(frames: list[str]) -> str:
    """The last frame outside torch, this module and the frames that pass a call on, as ``file:line in fn``."""
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    for line in reversed(frames):
        if torch_dir in line or __file__ in line or "contextlib.py" in line or "<eval_with_key>" in line:
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


def _user_frame(stack: traceback.StackSummary) -> str:
    return _pick([f'File "{f.filename}", line {f.lineno}, in {f.name}' for f in stack])


def _frame_of(error: BaseException) -> str:
    return _user_frame(traceback.extract_tb(error.__traceback__))
