"""The compiled train step's differentiation: ``torch.autograd.grad`` traced by Dynamo, so that every custom
``torch.autograd.Function``'s backward is the one used.

torch 2.13's ``torch.compile(torch.func.grad(f))`` differentiates the *forward* of a custom Function applied to
a differentiated input itself, silently (pytorch/pytorch#193279): a straight-through estimator on a float32
parameter trains with the rounding's zero derivative, a gradient reversal with the wrong sign, a Function with
saved tensors with its forward's derivative. Dynamo-traced ``torch.autograd.grad`` (its
``trace_autograd_ops`` setting) uses the Function's backward wherever it is applied, under aot_eager and
inductor, and its graph is the same single graph (:func:`funcamp.grad._autograd_route`).

:func:`compile` is ``torch.compile`` with that setting switched on while the compiled function traces, and
only then: ``torch._dynamo.config.patch`` around each call, never a process-wide change (another compiled
function in the process keeps Dynamo's default). AOTAutograd's pass that recomputes
``torch.utils.checkpoint`` regions in such graphs is switched off in the same scope (:data:`_AS_TORCH_FUNC`).
:data:`route` is the route the compiled step differentiates with; the public
:func:`funcamp.grad_and_value` keeps ``torch.func``'s (it composes with ``vmap``).

A Function whose forward or backward Dynamo cannot trace (a ``print``, an ``.item()``, a call into another
library) is refused by ``fullgraph=True`` with Dynamo's error at the line in question; :func:`function_note`
adds a note naming the Function and what to do, rather than differentiating its forward.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

try:  # torch 2.13
    from torch._inductor.custom_graph_pass import CustomSchedulerPass
except ImportError:  # an inductor without scheduler passes: the wait comes before compile_fx
    CustomSchedulerPass = None  # type: ignore[assignment, misc]

from funcamp.grad import _autograd_route

__all__ = ["compile", "function_note", "probe_cpu_isas", "route", "wait_for_cpu_isa_probe"]

_log = logging.getLogger("funcamp.train")

#: The compiled step's route (:data:`funcamp.grad._Route`): ``torch.autograd.grad`` on detached inputs.
route = _autograd_route

#: AOTAutograd's settings that differ for a graph with a traced ``torch.autograd.grad``, kept as they act on
#: torch.func's graph: its pass that recomputes ``torch.utils.checkpoint`` regions in a forward-loss-backward
#: graph (``remat_using_tags_for_fwd_loss_bwd_graph``) refuses a region holding dropout ("does not support RNG
#: ops in recompute regions"); under torch.func the step kept those regions' activations, as it still does
#: (funcamp's own ``functionalize(remat=)`` is :class:`funcamp.passes.RematPass`'s, not this pass's).
_AS_TORCH_FUNC = {"remat_using_tags_for_fwd_loss_bwd_graph": False}

_FUNCTION_OP = "autograd.Function"  # the higher-order operator Dynamo names in a Function's trace errors


def compile(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``torch.compile(fn, **options)``, traced with ``torch._dynamo.config.trace_autograd_ops`` on.

    The setting is patched around each call (a retrace after a guard failure sees it too) and restored after;
    the calls that do not trace pay one context manager. For inductor, the first call starts
    :func:`probe_cpu_isas`. ``fn`` is compiled as a frame of its own
    (:func:`_own_frame`): building it again in the same process compiles it afresh, never as a recompile of an
    earlier build. Same arguments and errors as ``torch.compile``.
    """
    backend = options.pop("backend", "inductor")
    inductor = options.pop("options", None)
    compiled = torch.compile(_own_frame(fn), backend=_aliasing_aware(backend, inductor), **options)
    probe = backend == "inductor"

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if probe:
            probe_cpu_isas()  # at the first call, once per process: after a compile cache has put its programs
        with (
            torch._dynamo.config.patch(trace_autograd_ops=True),
            torch._functorch.config.patch(**_AS_TORCH_FUNC),
        ):
            return compiled(*args, **kwargs)

    return call


@functools.cache
def probe_cpu_isas() -> threading.Thread | None:
    """Start inductor's probe of this CPU's vector instruction sets in a thread, once per process; the thread.

    Before inductor generates its first CPU kernel in a process, it compiles and loads one small C++ program per
    instruction set the CPU reports (``torch._inductor.cpu_vec_isa.valid_vec_isa_list``: AVX2, AVX-512, AMX, ...),
    one after the other on the thread that compiles: 8.5 s of the main job's first step on the 2-core Xeon with a
    cold inductor cache (10 builds of 0.7 s and their loads; about 1.5 s with the programs cached on disk). The
    probe waits on the C++ compiler, not on Python, so here it runs while Dynamo and AOTAutograd trace the
    step and inductor lowers it; inductor waits for it before it fuses (:func:`_wait_before_fusion`) and, where a
    cache may hold the graph, before it compiles (:func:`_after_probe`), because its instruction-set objects
    change their compiler flags while they check, so two threads must not ask at once; it then finds the answer
    cached. Nothing is started where the list is cached already; a failure in the thread is logged at DEBUG and
    inductor probes again itself. Differs from ``torch.compile``, which probes when its first kernel needs it.

    Called by the first call of a step compiled for inductor (:func:`compile`), not when it is built: a compile
    cache loaded in between (:mod:`funcamp.compile_cache`) puts the probe's programs in inductor's cache first,
    and the probe then only loads them (built alongside, they raced the load and changed the cache's files).
    """
    from torch._inductor import cpu_vec_isa

    if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
        return None
    # Everything the probe imports is imported here, on the calling thread: an import on the thread while Dynamo
    # imports on this one broke Dynamo's (ModuleNotFoundError for a module that exists: the GPT-2 main job).
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.cpp_builder  # noqa: F401
    import torch.utils.cpp_extension  # noqa: F401  (setuptools, distutils: the compiler's command line)

    def probe() -> None:
        try:
            cpu_vec_isa.valid_vec_isa_list()
        except Exception:  # noqa: BLE001 - inductor probes again on its own thread and reports there
            _log.debug("funcamp: the background probe of the CPU's vector instruction sets failed", exc_info=True)

    thread = threading.Thread(target=probe, name="funcamp-cpu-isa-probe", daemon=True)
    thread.start()
    return thread


def _after_probe(inner_compile: Callable[..., Any]) -> Callable[..., Any]:
    """``inner_compile`` (inductor's caching and code generation, after AOTAutograd), which must not meet
    :func:`probe_cpu_isas`' thread: inductor's instruction-set objects are not safe to share between threads
    (``VecAVX512.__bool__`` changes its compiler flags while it checks bfloat16 support). Inductor asks them when
    it loads a graph from its FX graph cache and when it generates code, after its post-grad passes. So this
    waits for the thread here where the cache may hold graphs (it is on and its directory is not empty, or a
    remote cache is on), and otherwise the scheduler does, before it fuses (:func:`_wait_before_fusion`): the
    post-grad passes and the lowering then overlap the probe too."""

    @functools.wraps(inner_compile)
    def compile_inner(*args: Any, **kwargs: Any) -> Any:
        if _fx_cache_may_hit():
            wait_for_cpu_isa_probe()
        return inner_compile(*args, **kwargs)

    return compile_inner


def _fx_cache_may_hit() -> bool:
    from torch._inductor import config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    if getattr(config, "fx_graph_remote_cache", False):
        return True
    if not config.fx_graph_cache:
        return False
    try:
        with os.scandir(os.path.join(cache_dir(), "fxgraph")) as entries:
            return any(True for _ in entries)
    except OSError:
        return False


def _wait_before_fusion(options: dict[str, Any]) -> dict[str, Any] | None:
    """The inductor option that waits for :func:`probe_cpu_isas`' thread before the scheduler fuses (after the
    lowering: nothing before the fusion asks the instruction sets): torch 2.13's ``_pre_fusion_custom_pass``,
    which its FX graph cache key takes by its uuid, wrapping any given one. None where inductor has no such
    option (the caller then waits before ``compile_fx``)."""
    from torch._inductor import config

    if not hasattr(config, "_pre_fusion_custom_pass") or CustomSchedulerPass is None:
        return None
    given = options.get("_pre_fusion_custom_pass")
    if given is not None and not isinstance(given, CustomSchedulerPass):  # no uuid: inductor bypasses its cache

        def waits_then_given(nodes: list[Any]) -> list[Any]:  # a plain callable too, so that it still does
            wait_for_cpu_isa_probe()
            return given(nodes)

        return {"_pre_fusion_custom_pass": waits_then_given}
    return {"_pre_fusion_custom_pass": _BeforeFusion(given)}


class _BeforeFusion(CustomSchedulerPass or object):  # type: ignore[misc]
    """Inductor's ``_pre_fusion_custom_pass``: waits for :func:`probe_cpu_isas`' thread, then runs ``inner`` (a
    ``CustomSchedulerPass`` given, or nothing); a ``CustomSchedulerPass`` itself, so that inductor's FX graph cache
    keeps the graph (its key takes the ``uuid``, ``inner``'s or a constant)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, nodes: list[Any]) -> list[Any]:
        wait_for_cpu_isa_probe()
        return nodes if self.inner is None else self.inner(nodes)

    def uuid(self) -> Any:
        return b"funcamp-wait-for-cpu-isa-probe" if self.inner is None else self.inner.uuid()


def wait_for_cpu_isa_probe() -> None:
    """Wait for the probe :func:`probe_cpu_isas` started, if it did (its compiler would load a timing)."""
    if probe_cpu_isas.cache_info().currsize and (thread := probe_cpu_isas()) is not None:
        thread.join()


def _aliasing_aware(backend: Any, inductor_options: dict[str, Any] | None) -> Callable[..., Any]:
    """``backend`` (a name or a callable; ``inductor_options`` for inductor) as a callable backend that keeps
    AOTAutograd's cache away from a graph whose inputs share memory.

    torch 2.13's AOTAutograd cache key does not see which graph inputs share storage (pytorch/pytorch #139789;
    PRs #184481 and #185891 add the alias groups to the key later): a graph compiled for a step whose closure read
    a copy of a state tensor was served to the same Dynamo graph where that tensor is a view of a donated input
    (wrong aux and buffer values, ``tests/test_flat.py``). Such a graph is compiled with the cache off, so it is
    neither served from it nor stored in it (``funcamp.compile_cache`` saves what the caches hold); inductor's FX
    graph cache keys the graph after AOTAutograd, where the aliasing shows.
    """
    from torch._dynamo.backends.registry import lookup_backend

    def compile_graph(gm: Any, example_inputs: Any) -> Any:
        shared = _inputs_share_memory(example_inputs)
        cache = torch._functorch.config.enable_autograd_cache and not shared
        with torch._functorch.config.patch(enable_autograd_cache=cache):
            if backend == "inductor":
                from torch._inductor.compile_fx import compile_fx, compile_fx_inner

                before_fusion = _wait_before_fusion(inductor_options or {})
                # A hit in AOTAutograd's cache loads inductor's graph and its kernels with neither the inner
                # compile nor the scheduler, so no wait there; an inductor without a pre-fusion pass waits here too.
                if before_fusion is None or (cache and _fx_cache_may_hit()):
                    wait_for_cpu_isa_probe()
                patches = {**(inductor_options or {}), **(before_fusion or {})}
                return compile_fx(
                    gm, example_inputs, inner_compile=_after_probe(compile_fx_inner), config_patches=patches
                )
            return (lookup_backend(backend) if isinstance(backend, str) else backend)(gm, example_inputs)

    return compile_graph


def _inputs_share_memory(inputs: Any) -> bool:
    """Whether two of the graph's tensor inputs are on one storage (views of one buffer, a tensor and its alias)."""
    seen: set[tuple[Any, int]] = set()
    for x in inputs:
        if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.device.type == "meta":
            continue  # a tensor subclass holds its storage in its parts
        if x.untyped_storage().nbytes() == 0:
            continue
        key = (x.device, x.untyped_storage().data_ptr())
        if key in seen:
            return True
        seen.add(key)
    return False


#: Numbers the frames :func:`_own_frame` makes, one per compiled build in this process.
_BUILDS = itertools.count(1)


def _own_frame(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a function whose code object, and name in it, are its own: ``<name>_build<n>``.

    Dynamo keeps its compiled entries on the code object and what it has seen of the inputs (automatic dynamic
    shapes) under the code's file, first line and name. Every step ``make_train_step`` builds runs the same inner
    function, so without this the second build in a process is a recompile of the first one's frame: it is
    guarded against all earlier builds, the ninth fails ``fullgraph=True`` at Dynamo's recompile limit, and the
    Python numbers that differ between builds (a ``Remat`` budget, a remat region's id) are traced as symbols
    (automatic dynamic), which the region's tags cannot hold ("SymNodeVariable() is not a constant"). With a
    frame of its own, each build compiles once, static, as if it were the first; a recompile within one build
    (a new batch shape) is torch's as usual. A callable that is not a plain function is called from one.
    """
    if not isinstance(fn, types.FunctionType):
        inner = fn

        def fn(*args: Any, **kwargs: Any) -> Any:
            return inner(*args, **kwargs)

    n, code = next(_BUILDS), fn.__code__
    code = code.replace(co_name=f"{code.co_name}_build{n}", co_qualname=f"{code.co_qualname}_build{n}")
    own = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__, own.__qualname__, own.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    own.__dict__.update(fn.__dict__)
    return own


def function_note(error: BaseException) -> str | None:
    """A note for a compile failure met while tracing the loss's backward, naming the user's Function, or None.

    Two forms are recognised. Dynamo names the higher-order operator (``autograd.Function``) when it cannot
    trace a Function's ``forward`` or ``backward`` (a ``print``, a call into another library): the Function is
    the subclass whose method holds the last line of the error's user stack that lies in one. An error whose
    user stack ends at the step's ``torch.autograd.grad`` (``.item()`` in a backward, say) happened while the
    backward was traced: the note says so, without a name.
    """
    message = str(error)
    frames = _user_frames(message)
    if _FUNCTION_OP in message:
        where = next((_describe(f) for f in reversed(frames) if f[2] in _METHODS), None)
        name = f"the torch.autograd.Function {where}" if where else "a torch.autograd.Function"
        return (
            f"funcamp: torch.compile cannot trace {name} in the loss, so the compiled step cannot use its "
            f"backward, and refuses rather than differentiate its forward. {_FIX}"
        )
    if frames and frames[-1][0].endswith(_GRAD_FILE) and "torch.autograd.grad(" in frames[-1][3]:
        return (
            "funcamp: torch.compile failed while tracing the backward of the loss (torch.autograd.grad in the "
            "step), where every custom torch.autograd.Function's backward is traced; if the loss applies one, "
            f"its backward is the likely cause. {_FIX}"
        )
    return None


_FIX = (
    "Make its forward and backward traceable (no print, .item(), numpy or other host work), or run "
    "make_train_step(..., compile=False), which uses its backward eagerly"
)
_GRAD_FILE = "funcamp/grad.py"
_METHODS = ("forward", "setup_context", "backward")


def _user_frames(message: str) -> list[tuple[str, int, str, str]]:
    """``(path, line, function, source)`` of each ``File "...", line N, in f`` frame of ``message``."""
    frames, lines = [], message.splitlines()
    for i, line in enumerate(lines):
        text = line.strip()
        if not text.startswith('File "'):
            continue
        try:
            path, rest = text[len('File "') :].split('", line ', 1)
            lineno, function = rest.split(", in ", 1)
            frames.append((path, int(lineno), function, lines[i + 1].strip() if i + 1 < len(lines) else ""))
        except ValueError:
            continue
    return frames


def _describe(frame: tuple[str, int, str, str]) -> str:
    path, lineno, method, _ = frame
    owner = _owner(path, lineno, method)
    return f"{owner}.{method} ({path}:{lineno})" if owner else f"{method} ({path}:{lineno})"


def _owner(path: str, lineno: int, method: str) -> str | None:
    """The qualified name of the ``torch.autograd.Function`` subclass whose ``method`` spans ``path:lineno``."""
    pending, seen = list(torch.autograd.Function.__subclasses__()), set()
    while pending:
        cls = pending.pop()
        if cls in seen:
            continue
        seen.add(cls)
        pending.extend(cls.__subclasses__())
        code = getattr(cls.__dict__.get(method), "__func__", cls.__dict__.get(method))
        code = getattr(code, "__code__", None)
        if code is None or code.co_filename != path:
            continue
        lines = [line for _, _, line in code.co_lines() if line is not None]
        if lines and min(lines + [code.co_firstlineno]) <= lineno <= max(lines):
            return cls.__qualname__
    return None
