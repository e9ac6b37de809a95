"""The one assembly of every compiled train step: :func:`assemble`, its :class:`StepPlan` and :class:`Step`.

A step body is a pure function ``body(state, batch) -> (new_state, metrics)`` written from the stages of
:mod:`funcamp.train._stages` (``make_train_step``'s is the standard one; ``examples/gan.py`` composes two).
:func:`assemble` owns everything around it, decided once, when it is built: the compiled-or-eager choice (the
body runs within the plan, :func:`funcamp._scope.in_step`, so that what it calls asks the plan rather than the
compiler), the traced-autograd route (:mod:`funcamp._dynamo_autograd`), inductor's options and funcamp's graph
passes (:func:`inductor_options`), donation (:mod:`funcamp.train._donate`), the host boundary of each state's
storage (:meth:`funcamp.train.ParamStorage.enter` / ``leave``), the host-side checks a builder asks for, and the
eager re-run that shows an error of the user's code as itself. torchtitan's ``apply_compile`` is the model: one
public compile assembly that every model's ``parallelize`` calls.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from funcamp import _dynamo_autograd, _scope, passes
from funcamp.train import _donate, _hints
from funcamp.train._state import TrainState

__all__ = ["EAGER_RERUN_NOTE", "Step", "StepPlan", "assemble", "inductor_options"]

_log = logging.getLogger("funcamp.train")


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The static decisions of a step, made once when it is built (:func:`assemble`).

    Attributes:
      compiled: traced whole by ``torch.compile(fullgraph=True)`` (False: run eagerly).
      backend: the ``torch.compile`` backend (None when eager).
      donate: the next state is written into the given state's tensors.
      in_place: donating, the body's optimizer stage may write the new state into the given one as it computes it
        (the body reads neither the parameters and optimizer state nor the gradients after the update:
        ``make_train_step``'s without telemetry; :func:`funcamp.train._donate.updates_in_place`).
      direct_update: the body's optimizer stage may write the new state as it computes it, already selected by the
        verdict, and return no updates (the same bodies as ``in_place``): into the given state when donating
        (``in_place``), into new tensors otherwise (a compiled flat step's regions,
        :mod:`funcamp.train._flat_regions`).
      probes: the names of the metrics probes the body adds (for the plan's line only).

    What the state carries (its process layout and its storage) completes the plan of one call:
    :meth:`Step.plan_for`.
    """

    compiled: bool
    backend: str | None
    donate: bool
    probes: tuple[str, ...] = ()
    in_place: bool = False
    direct_update: bool = False

    def __str__(self) -> str:
        how = f"compiled ({self.backend})" if self.compiled else "eager"
        probes = f", probes {', '.join(self.probes)}" if self.probes else ""
        return f"{how}{', donating' if self.donate else ''}{probes}"


class Step:
    """A train step built by :func:`assemble`: ``step(state, batch) -> (new_state, metrics)``.

    Attributes:
      plan: the :class:`StepPlan` it was built with.
      body: the pure body it runs, ``body(state, batch) -> (new_state, metrics)``.
      prepare: the host-side checks run before each call, ``prepare(state, batch) -> state`` (None: none).
    """

    def __init__(
        self,
        run: Callable[..., Any],
        plan: StepPlan,
        body: Callable[..., Any],
        prepare: Callable[[Any, Any], Any] | None = None,
    ) -> None:
        self._run, self.plan, self.body, self.prepare = run, plan, body, prepare
        functools.update_wrapper(self, body, updated=())

    def __call__(self, state: Any, batch: Any) -> Any:
        _log_once(self.plan_for(state))
        return self._run(state, batch)

    def plan_for(self, state: Any) -> str:
        """The plan of a call on ``state``, in one line: this step's decisions, then each train state's (its
        process layout and its storage, with the reason whenever it is kept leaf by leaf)."""
        states = _states(state)
        return f"step: {self.plan}" + "".join(f"; state: {s.plan}{self._stacked_note(s)}" for s in states)

    def _stacked_note(self, state: Any) -> str:
        """What a pure compiled step costs over a state whose scanned runs are laid out name-major (the layout a
        donating step pays back: ``TrainState.create(scan=)``), or ""."""
        runs = getattr(getattr(state, "storage", None), "stacked", ())
        if not runs or self.plan.donate or not self.plan.compiled:
            return ""
        return (
            f" (its scanned run{'s' if len(runs) > 1 else ''} {', '.join(map(repr, runs))} laid out name-major, for "
            "a donating step: a pure step makes each name's new buffers whole every step, GPT-2 124M's body 1.1-1.4x "
            "the per-layer layout's steady step and 20% more memory; make_train_step(donate=True), or "
            "TrainState.create without scan=)"
        )

    def __repr__(self) -> str:
        return f"Step({self.plan})"


@functools.lru_cache(maxsize=256)
def _log_once(line: str) -> None:
    """Log ``line`` at INFO on ``funcamp.train``, once per distinct line in a process."""
    _log.info("funcamp %s", line)


def assemble(
    body: Callable[..., Any],
    *,
    compile: bool = True,
    backend: str | None = None,
    donate: bool = False,
    prepare: Callable[[Any, Any], Any] | None = None,
    probes: Sequence[str] = (),
) -> Step:
    """Build a train step from ``body``, compiled whole (or eager), with the guarantees of ``make_train_step``.

    ``body(state, batch) -> (new_state, metrics)`` is pure: ``state`` is a :class:`funcamp.TrainState` or a
    dict, list or tuple of them (a GAN's two), ``new_state`` the same structure; ``metrics`` a dict of tensors.
    Write it from the stages (:func:`funcamp.train.run`, or :func:`gradients` ... :func:`commit`).

    What the step does around ``body``:

    * Compiled (``compile=True``): ``torch.compile(fullgraph=True)`` with the traced-autograd route (a custom
      ``autograd.Function``'s backward is always used) and funcamp's graph passes (``functionalize(remat=)``
      recomputed, sharded gathers at use; :func:`inductor_options` under inductor). A flat state enters as its
      buffers (the optimizer runs once per buffer) and leaves as per-leaf views. An error that Dynamo meets
      while tracing is shown as the eager body raises it (:data:`EAGER_RERUN_NOTE`).
    * Donating (``donate=True``): the next state is written into the given state's tensors (compiled: input
      mutations inside the graph; eager: copied in after the body, or in place where the body says it may,
      as ``make_train_step``'s does) and the given state is marked consumed.
    * ``prepare(state, batch) -> state``, when given, runs on the host before each call (the arguments'
      checks of a builder, cheap); what it returns is what the step runs on.

    The decisions are made once, here, and shown: ``step.plan`` (a :class:`StepPlan`),
    ``step.plan_for(state)`` (with the state's process layout and storage), logged once at INFO on
    ``funcamp.train`` at the first call with each plan.

    Args:
      body: the pure step body.
      compile: compile with ``torch.compile(fullgraph=True)`` (default), or run eagerly.
      backend: the ``torch.compile`` backend (default inductor).
      donate: write the next state into the given one (see ``make_train_step``).
      prepare: host-side checks run before each call (see above).
      probes: names of the metrics probes ``body`` runs, for the plan's line.
    Returns:
      A :class:`Step`.
    Raises:
      TypeError: if ``body`` or ``prepare`` is not callable.

    Example:
      >>> import funcamp as fa
      >>> from funcamp import optim
      >>> opt = optim.sgd(0.1)
      >>> loss_fn = lambda p, batch: ((batch @ p["w"]) ** 2).mean()
      >>> state = fa.TrainState.create({"w": torch.ones(2)}, opt)
      >>> body = lambda state, batch: (lambda r: (r.new_state, r.metrics))(fa.train.run(loss_fn, opt, state, batch))
      >>> step = fa.train.assemble(body, compile=False)
      >>> state, metrics = step(state, torch.eye(2))
      >>> state.params["w"]
      tensor([0.9000, 0.9000])
    """
    if not callable(body):
        raise TypeError(
            f"assemble: body must be callable, (state, batch) -> (new_state, metrics); got {type(body).__name__}"
        )
    if prepare is not None and not callable(prepare):
        raise TypeError(f"assemble: prepare must be None or callable, got {type(prepare).__name__}")
    direct = _donate.may_update_in_place(body)
    in_place = donate and direct
    plan = StepPlan(compile, (backend or "inductor") if compile else None, donate, tuple(probes), in_place, direct)
    planned = _within_plan(body, plan)
    if compile:
        traced = _donate.donating(planned) if donate else planned
        options = inductor_options() if plan.backend == "inductor" else None  # None where torch lacks the option
        compiled = _dynamo_autograd.compile(traced, fullgraph=True, backend=plan.backend, options=options)
        run = _with_eager_errors(body, _storage_boundary(compiled, donate), plan)
    else:
        run = _donate.eager(planned, in_place) if donate else planned
    run = _prepared(run, prepare)
    return Step(_donate.returning_state(run) if donate else run, plan, body, prepare)


def _within_plan(body: Callable[..., Any], plan: StepPlan) -> Callable[..., Any]:
    def planned(state: Any, batch: Any) -> Any:
        return _scope.in_step(plan, body, state, batch)

    return planned


def _prepared(run: Callable[..., Any], prepare: Callable[[Any, Any], Any] | None) -> Callable[..., Any]:
    if prepare is None:
        return run

    def call(state: Any, batch: Any) -> Any:
        return run(prepare(state, batch), batch)

    return call


def _states(tree: Any) -> list[TrainState]:
    """The train states in ``tree`` (a state, or a dict, list or tuple of them), in order."""
    if isinstance(tree, TrainState):
        return [tree]
    if isinstance(tree, dict):
        return [s for v in tree.values() for s in _states(v)]
    if isinstance(tree, (list, tuple)):
        return [s for v in tree for s in _states(v)]
    return []


def _map_states(fn: Callable[[TrainState], Any], tree: Any) -> Any:
    if isinstance(tree, TrainState):
        return fn(tree)
    if isinstance(tree, dict):
        return type(tree)((k, _map_states(fn, v)) for k, v in tree.items())
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_map_states(fn, v) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_states(fn, v) for v in tree)
    return tree


def _storage_boundary(compiled: Callable[..., Any], donate: bool) -> Callable[..., Any]:
    """``compiled`` called on each state as its storage enters it (a flat state: its buffers, no copy), the
    result's states as their storage shows them (per-leaf views); donating, the writes of a state that had to be
    copied in are copied back into the given tensors after the call."""

    def call(state: Any, batch: Any) -> Any:
        afters: list[Callable[[], None]] = []

        def enter(s: TrainState) -> Any:
            entered, after = s.storage.enter(s)
            afters.append(after)
            return entered

        out = compiled(_map_states(enter, state), batch)
        if donate:
            for after in afters:
                after()
            return out
        new_state, metrics = out
        return _map_states(lambda s: s.storage.leave(s), new_state), metrics

    return call


def inductor_options() -> dict[str, Any] | None:
    """The inductor options of every compiled step: funcamp's graph pass, the backward's order kept, and a cache.

    ``post_grad_custom_pre_pass``: :class:`funcamp.passes.RematPass` (``functionalize(remat=)`` regions
    recomputed, sharded gathers at use, large backward buffers made late). ``reorder_for_locality=False``: the
    step's forward and backward are traced into one graph without a forward/backward split, which inductor
    takes for an inference graph and reorders for locality, moving each node to just before its first user:
    each weight gradient's matmul went to the end of the backward, where the finite check first reads it, and
    kept its inputs alive until then (a tied LM head: the logits' gradient through the whole backward,
    ``tests/test_remat.py``); torch does not run that pass on the graphs it compiles for training.

    ``max_fusion_buffer_group_pairwise_attempts=``:data:`FUSION_PAIR_WINDOW`: inductor's scheduler tries to fuse
    each node with the next 64 nodes that read or write one of its buffers, every fusion round. A step's
    per-parameter work (each gradient's norm and finite flag, each buffer's update) reads the same few scalars
    (the loss scale, the norm's scale, the clip's coefficient, the step's verdict), so every such node is paired
    with 64 others that it cannot fuse with (different sizes): on GPT-2 124M's scanned body those pairs took
    13.2 of the first step's 80.5 s (a 2-core Xeon, cold). With 32 inductor generates the same code, byte for
    byte, for GPT small's step and GPT-2's body, unrolled and scanned; with 16 it missed fusions on GPT-2 and its
    steady step was 6% slower (502.9 against 472.4 ms): docs/benchmarks.md.

    Let AOTAutograd's cache store the step:

    funcamp's casting mode (:class:`funcamp.ops.OpPolicies`, a ``TorchFunctionMode``) makes Dynamo record the
    ``Tensor`` methods that torch writes in Python (``Tensor.split``, ``Tensor.unique``, ...) as calls to those
    Python functions, which AOTAutograd's cache refuses ("Bypassing autograd cache due to: Unsupported
    call_function target Tensor.split"): every new process re-ran AOTAutograd on the whole step (3.6 s of
    the warm first step of the benchmark GPT on a 2-core AMD EPYC, AVX2). They are torch's own functions,
    marked cacheable here under the running torch version (``torch._inductor.config.
    unsafe_marked_cacheable_functions``), so a change of torch changes the cache key.

    And let the caches store a scanned step (``functionalize(scan=)``): torch 2.13 takes a graph holding a
    higher-order operator into its FX graph and AOTAutograd caches only where the operator is marked cacheable
    (``invoke_subgraph`` is; ``scan`` is not: "Can't cache HigherOrderOperator: scan"), so every new process
    compiled a scanned step anew (GPT-2 124M's main job: 66.0 s to its first step warm, where the unrolled step's
    second process took 27.0 s), and :mod:`funcamp.compile_cache` had nothing to save. The scan's body and
    combine graphs are submodules of the graph, which torch's keys hold: two scans alike but for the body are two
    entries (``tests/test_compile_cache.py``, planted: one key for every graph serves the wrong body); funcamp's
    graph passes over scans are in the key through :meth:`funcamp.passes.RematPass.uuid`. A scanned step's second
    process loads it from :mod:`funcamp.compile_cache` and trains bit for bit as the first (the same tests); GPT-2
    124M's main job scanned: 70.3 s cold, 41.6 s warm (docs/module.md).
    """
    from torch._inductor import config as inductor_config

    remat = {"post_grad_custom_pre_pass": passes.RematPass(), "reorder_for_locality": False}
    if hasattr(inductor_config, "max_fusion_buffer_group_pairwise_attempts"):
        remat["max_fusion_buffer_group_pairwise_attempts"] = FUSION_PAIR_WINDOW
    if not hasattr(inductor_config, "unsafe_marked_cacheable_functions"):  # older torch: no such option
        return remat
    methods = (getattr(torch.Tensor, name, None) for name in _PYTHON_TENSOR_MATH)
    names = sorted(
        f"{fn.__module__}.{fn.__name__}"
        for fn in methods
        if isinstance(fn, types.FunctionType) and fn.__module__ == "torch._tensor"
    )
    marked = dict.fromkeys([*names, *_CACHEABLE_HOPS], torch.__version__)
    return {"unsafe_marked_cacheable_functions": marked, **remat}


#: How many later nodes sharing a buffer inductor's scheduler tries to fuse each node with (inductor's default:
#: 64); :func:`inductor_options`.
FUSION_PAIR_WINDOW = 32


#: Higher-order operators whose graphs :func:`inductor_options` lets torch's caches store (their subgraphs are in
#: the key): the scan of ``functionalize(scan=)``.
_CACHEABLE_HOPS = ("torch.ops.higher_order.scan",)

#: Tensor methods that torch writes in Python and that only compute (no hooks, no autograd or storage
#: state): those a model calls inside the step. Others (``backward``, ``register_hook``) stay refused.
_PYTHON_TENSOR_MATH = (
    "split",
    "norm",
    "unique",
    "unique_consecutive",
    "stft",
    "istft",
    "lu",
    "unflatten",
    "__rsub__",
    "__rdiv__",
    "__rtruediv__",
    "__rpow__",
    "__floordiv__",
    "__rfloordiv__",
    "__rmatmul__",
    "__rlshift__",
    "__rrshift__",
)


#: Appended (``add_note``) to an error that the compiled step met while tracing and that the eager re-run
#: raised again: the error is the user's code's (or funcamp's) own, not the compiler's.
EAGER_RERUN_NOTE = (
    "funcamp: raised while torch.compile traced the train step; funcamp re-ran the step eagerly to show this "
    "error as your code raises it (make_train_step(..., compile=False) runs without compiling)"
)
_FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


class _HeldRecords(logging.Filter):
    """Hold a logger's records back instead of emitting them (released or dropped later)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


def _with_eager_errors(body: Callable[..., Any], compiled: Callable[..., Any], plan: StepPlan) -> Callable[..., Any]:
    """``compiled``, but an error of the user's code (or a bad input) raises itself rather than dynamo's.

    With ``fullgraph=True`` an exception raised while tracing reaches the caller wrapped by dynamo:
    ``torch._dynamo.exc.Unsupported`` ("Observed exception") for funcamp's own checks (a loss that is
    not 0-d, a batch that does not split into micro-batches), ``TorchRuntimeError`` (about 45 lines of
    fake-tensor detail, after a logged traceback) for an error in the user's ``loss_fn`` (float labels
    to ``cross_entropy``, a wrong feature size). The step is pure, so on any dynamo error it is run once
    eagerly: what that raises is raised instead, as itself, with :data:`EAGER_RERUN_NOTE` added and
    the fake-tensor log lines of the failed trace dropped. If the eager step succeeds, dynamo's error
    is re-raised (with a note saying what to do where :mod:`funcamp.train._hints` knows the failure) and
    the held log lines are emitted.
    """
    eager_plan = dataclasses.replace(plan, compiled=False)

    def compiled_step(state: Any, batch: Any) -> Any:
        logger, held = logging.getLogger(_FAKE_TENSOR_LOGGER), _HeldRecords()
        logger.addFilter(held)
        try:
            return compiled(state, batch)
        except torch._dynamo.exc.TorchDynamoException as dynamo_error:
            logger.removeFilter(held)
            try:
                _scope.in_step(eager_plan, body, state, batch)
            except Exception as error:
                held.records.clear()  # the fake-tensor traceback of the same error: noise
                error.add_note(EAGER_RERUN_NOTE)
                raise error from None
            _hints.add_known_fix(dynamo_error)  # a known fix (transformers' logging, an untraceable Function)
            raise dynamo_error
        finally:
            logger.removeFilter(held)
            for record in held.records:
                logger.handle(record)

    return compiled_step
