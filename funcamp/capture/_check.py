"""The check on the CPU of what CUDA-graph capture forbids: :func:`check` traces a step with ``make_fx`` over
fake tensors, built with the compiled choice, and reports each :class:`funcamp.capture.Violation` at its line."""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from funcamp import _scope, _tree
from funcamp.capture._report import CaptureReport, Violation, error_frame, node_frame, user_frame

__all__ = ["check"]

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
    step traces in seconds); code that branches on ``device.type == "cuda"`` takes its other side here.

    The step is traced as it is built compiled, whether it was built with ``compile=True`` or ``False``: a
    :class:`funcamp.train.Step` (``make_train_step``'s, ``funcamp.train.assemble``'s) has its host-side checks
    (``step.prepare``) run on the given arguments first, as every call does, then its body traced within its
    plan made compiled (``dataclasses.replace(step.plan, compiled=True)``, :func:`funcamp._scope.in_step`), so
    what the body calls takes the compiled step's branches (no eager-only host reads, telemetry's
    ``torch.cond``, ``scan=``'s scan, the compiled step's autograd). Any other callable is traced as the body
    of a compiled step in the same way; a funcamp step called inside it is traced compiled too. torch's own
    compiling flag is left as it is.

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
      fn: the step, ``fn(*args)``: a :class:`funcamp.train.Step`, or a pure callable (it runs on fake tensors).
      args: its arguments, pytrees of tensors (a :class:`funcamp.TrainState` and a batch; a ``Step`` takes
        exactly these two).
      keep_on_host: tensors of ``args`` to leave on the CPU in the trace.
    Returns:
      A :class:`CaptureReport`; ``report.ok`` when capture may proceed, ``str(report)`` for the list.
    Raises:
      TypeError: if ``fn`` is not callable, or is a ``Step`` given other than two arguments.
      Exception: what a ``Step``'s host-side checks raise; what ``fn`` raises while traced, other than a branch
        on a tensor's value, as itself.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

    if not callable(fn):
        raise TypeError(f"capture.check: fn must be callable (the train step), got {type(fn).__name__}")
    fn, args = _as_compiled(fn, args)
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
    with mode, _recording_rng_state(found), _all_frames(), reads:
        try:
            with warnings.catch_warnings():
                # torch's scan operator traces its body with Dynamo, which reads .grad of the stacked (non-leaf)
                # parameters it is given: torch's warning, not the step's
                warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
                graph = make_fx(flat, record_stack_traces=True)(*[fake[i] for i in tensor_at])
        except GuardOnDataDependentSymNode as error:
            found.append(Violation("host branch", "bool(tensor) / a Python branch on a value", error_frame(error)))
        except _TraceStopped:  # recorded where it stopped
            pass
    if graph is not None:
        found += _inputs_on_host(graph, [paths[i] for i in tensor_at])
        found += _graph_violations(graph, _live(graph))
    random_ops = 0 if graph is None else sum(_is_random(n) for n in graph.graph.nodes if n.op == "call_function")
    return CaptureReport(tuple(dict.fromkeys(found)), random_ops, graph)


def _as_compiled(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``(body, args)``: what a compiled build of ``fn`` traces, and the arguments it traces it on.

    A :class:`funcamp.train.Step`: its body within its plan made compiled, on what its host-side checks return
    for ``args``. Any other callable: itself within a compiled plan.
    """
    from funcamp.train import Step, StepPlan

    if isinstance(fn, Step):
        if len(args) != 2:
            raise TypeError(
                f"capture.check: a train step is checked as check(step, state, batch); got {len(args)} argument(s) "
                "after the step"
            )
        plan, body = dataclasses.replace(fn.plan, compiled=True), fn.body
        if fn.prepare is not None:  # on the host, on the real arguments, as each call of the step runs them
            args = (fn.prepare(*args), args[1])
    else:
        plan, body = StepPlan(compiled=True, backend=None, donate=False), fn

    def compiled(*given: Any) -> Any:
        return _scope.in_step(plan, body, *given)

    return compiled, args


@contextlib.contextmanager
def _all_frames() -> Iterator[None]:
    """Within: ``make_fx(record_stack_traces=True)`` keeps every frame of each node's stack (by default it keeps
    those of ``forward`` methods only); :func:`funcamp.capture._report.node_frame` takes the last one outside torch."""
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
            found.append(Violation("cpu tensor", "constant", user_frame(traceback.extract_stack()[:-1])))
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
            self.found.append(Violation("host sync", f"Tensor.{func.__name__}", user_frame(traceback.extract_stack())))
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
    found.append(Violation("rng state", f"{module}.{stack[first].name}", user_frame(stack[:first])))


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
        op, where, val = _op_name(n.target), node_frame(n), n.meta.get("val")
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
