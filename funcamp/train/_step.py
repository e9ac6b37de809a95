"""The functional train step: ``(state, batch) -> (state, metrics)``, compiled whole.

``make_train_step`` is a short assembly: a process layout (:mod:`funcamp.train._layout`) from what the state
carries (``TrainState.create``'s ``shard``, ``data_parallel`` and ``policy``), the stages of
:mod:`funcamp.train._stages` in order, and the probes of :mod:`funcamp.train._probes` its keywords ask for;
then the host-side checks of the first call and ``torch.compile(fullgraph=True)`` around it.
No stage branches on a feature flag.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import torch

from funcamp import _dynamo_autograd, _tree, numerics, passes
from funcamp.optim import GradientTransformation
from funcamp.train import _donate, _flat, _hints, _layout, _loss, _probes, _stages
from funcamp.train._state import TrainState

__all__ = ["EAGER_RERUN_NOTE", "make_train_step"]


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: GradientTransformation,
    *,
    has_aux: bool = False,
    accumulation_steps: int = 1,
    max_consecutive_skips: int | None = None,
    compile: bool = True,
    backend: str | None = None,
    telemetry: numerics.Telemetry | int | None = None,
    donate: bool = False,
    **moved: Any,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
    """Build the pure train step ``step(state, batch) -> (new_state, metrics)``.

    Per call: split ``batch`` into ``accumulation_steps`` micro-batches along dim 0; for each, the
    gradient of ``loss_fn`` times the loss scale, unscaled in float32 and summed; their mean is cast to
    the parameters' dtypes (the gradient of the mean loss). If every gradient and the loss are finite,
    the optimizer update is applied; otherwise params, buffers and the whole optimizer state (its step
    count too, so schedules do not advance) are kept bitwise. The loss scale is adjusted once per call.
    ``state`` is never mutated (unless ``donate=True``). Nothing is read on the host. The guides:
    docs/training.md (the step, its stages, ``LossSum``), docs/memory.md (donation), docs/parallel.md
    (data parallel and sharded states), docs/telemetry.md.

    ``loss_fn`` is ``loss_fn(params, batch) -> loss`` when ``state.buffers`` is None, else
    ``loss_fn(params, buffers, batch) -> (loss, new_buffers)``; with ``has_aux`` the loss becomes
    ``(loss, aux)``. ``loss`` is a 0-d floating tensor (the micro-batch mean) or a :class:`funcamp.LossSum`
    ``(total, count)`` (the step trains on ``sum(total) / sum(count)`` over micro-batches and ranks).

    Metrics (0-d tensors on the parameters' device): ``loss`` (float32, unscaled), ``loss_scale`` (the one
    used), ``grads_finite``, ``grad_norm`` (unscaled, before clipping), ``learning_rate``, ``skipped_steps``,
    ``consecutive_skips``, ``nonfinite_leaf`` (:func:`nonfinite_leaf_name`); ``too_many_skips`` with
    ``max_consecutive_skips`` (:func:`check_skips`); ``aux`` (the last micro-batch's) with ``has_aux``; the
    ``numerics/...`` metrics of :mod:`funcamp.numerics` with ``telemetry``.

    Args:
      loss_fn: the loss, see above.
      optimizer: a :class:`funcamp.optim.GradientTransformation`.
      has_aux: whether the loss comes with aux data.
      accumulation_steps: micro-batches per step (>= 1); every batch leaf's first dimension must be
        divisible by it.
      max_consecutive_skips: report ``too_many_skips`` once this many steps in a row were skipped.
      compile: wrap the step in ``torch.compile(fullgraph=True)``.
      backend: the ``torch.compile`` backend (default inductor).
      telemetry: None (off), an int N (:class:`funcamp.numerics.Telemetry` ``(every=N)``) or a ``Telemetry``.
      donate: write the next state into the given state's tensors, bitwise the pure step's; the given state
        is consumed (using it again raises :class:`funcamp.train.DonatedStateError`). Default False.
      **moved: ``data_parallel=``, ``policy=`` and ``shard=``, deprecated (``DeprecationWarning``): the state
        carries them (``TrainState.create(params, optimizer, data_parallel=..., policy=..., shard=...)``) and
        the step takes them from it at its first call; given here they still work as before and must agree
        with the state's. At the first call a data-parallel step compares a float64 checksum of each
        parameter over the ranks (one ``all_gather_object``); a sharded one trains this rank's shards with
        the unsharded step's metrics (:mod:`funcamp.sharding`).
    Returns:
      The step function.
    Raises:
      TypeError: if ``loss_fn`` is not callable, ``optimizer`` not a GradientTransformation,
        ``data_parallel`` not None, a bool or a ProcessGroup, or ``telemetry`` not None, an int or a
        Telemetry; at the first call, if a state leaf requires grad (a state built by hand from
        ``nn.Parameter``s: ``TrainState.create`` detaches them).
      RuntimeError: if ``data_parallel`` asks for a group and torch.distributed is not initialized.
      ValueError: if ``accumulation_steps`` < 1, ``max_consecutive_skips`` < 1 or ``telemetry`` < 1; at call time, if a
        batch leaf cannot be split into ``accumulation_steps`` micro-batches. With a sharded layout (given
        here, or at the first call the state's): if it has no group (``shard_layout(params, None)`` or built
        by hand) and is for more than one rank, the layout's world size or rank is not the group's, ranks
        differ in layout or policy (the message names the rank), or ``telemetry`` is set. At the first
        call: if ``shard`` is not the state's layout or ``data_parallel`` not its group, an
        ``optim.stochastic_rounding(layout=)`` places a shard elsewhere than the step's layout, or (data
        parallel) the parameters differ between ranks.

    Example:
      >>> import funcamp as fa
      >>> from funcamp import optim
      >>> params = {"w": torch.zeros(3)}
      >>> loss_fn = lambda p, batch: ((batch["x"] @ p["w"] - batch["y"]) ** 2).mean()
      >>> opt = optim.sgd(0.1)
      >>> state = fa.TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(2.0**15))
      >>> step = fa.make_train_step(loss_fn, opt, compile=False)
      >>> state, metrics = step(state, {"x": torch.eye(3), "y": torch.ones(3)})
      >>> state.params["w"], metrics["grads_finite"]
      (tensor([0.0667, 0.0667, 0.0667]), tensor(True))
    """
    _stages.check_args("make_train_step", loss_fn, optimizer, accumulation_steps)
    data_parallel, shard, policy = _moved_to_state(moved)
    telemetry = numerics.as_telemetry(telemetry)
    built = _layout.layout_from(data_parallel, shard, policy)
    run_as = _Assembly(built, _probes_for(built, max_consecutive_skips, has_aux, telemetry))
    built.check_ranks()
    # Compiled, differentiate with traced torch.autograd.grad: torch.func's compiled grad ignores the backward
    # of a custom autograd.Function applied to a parameter itself (funcamp._dynamo_autograd).
    route = _dynamo_autograd.route if compile else None

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        layout = run_as.layout  # set by the first call's host-side check, before anything is traced
        record = _stages.run(
            loss_fn,
            optimizer,
            state,
            batch,
            has_aux=has_aux,
            accumulation_steps=accumulation_steps,
            layout=layout,
            route=route,
        )
        metrics = dict(record.metrics)
        for probe in run_as.probes:
            metrics.update(probe(record))
        return record.new_state, metrics

    def for_state(state: TrainState) -> None:  # the first call: the layout the state carries
        # Compiled, one process or data parallel, no telemetry (it reads every leaf's update): the optimizer over
        # flat buffers, where the optimizer and parameters allow it (funcamp.train._flat).
        runs_flat = compile and telemetry is None and shard is None and state.shard is None
        run_as.flat = _flat.layout_for(state.params, optimizer) if runs_flat else None
        if state.shard is None and state.data_parallel is None and state.policy is None:
            return
        layout = _layout.layout_from(data_parallel, shard, policy, state=state)
        if shard is None:  # taken from the state: checked as a layout given to the step is at build time
            run_as.probes = _probes_for(layout, max_consecutive_skips, has_aux, telemetry)
            layout.check_ranks()
        run_as.layout = layout

    first_call = _first_call_check(run_as, for_state, loss_fn, optimizer)
    body = _donating(step, compile, telemetry) if donate else step  # (state, batch) -> metrics, state written
    if compile:
        backend = backend or "inductor"
        options = _inductor_options() if backend == "inductor" else None  # None where torch lacks the option
        compiled = _dynamo_autograd.compile(body, fullgraph=True, backend=backend, options=options)
        flat = _flat_boundary(compiled, run_as, donate)  # the state's buffers in, its per-leaf views out
        run = _with_eager_errors(step, flat, first_call)  # an eager re-run of an error writes nothing
    else:
        run = _with_checked_args(body, first_call)
    return _donate.returning_state(run) if donate else run


def _donating(step: Callable[..., Any], compiled: bool, telemetry: Any) -> Callable[..., Any]:
    """The donating form of ``step`` (:mod:`funcamp.train._donate`): compiled, input mutations in the graph;
    eager, the optimizer in place, unless telemetry reads the gradients and old parameters after the update."""
    if compiled:
        return _donate.donating(step)
    return _donate.copying(step) if telemetry is not None else _donate.in_place(step)


class _Assembly:
    """What a step runs with: its layout and probes (those of the state's layout after the first call), and the
    flat layout of its parameters and optimizer state (None: leaf by leaf), chosen at the first call."""

    def __init__(self, layout: _layout.SingleProcess, probes: list[Any]) -> None:
        self.layout, self.probes = layout, probes
        self.flat: _flat.FlatLayout | None = None


def _flat_boundary(compiled: Callable[..., Any], run_as: _Assembly, donate: bool) -> Callable[..., Any]:
    """``compiled`` called on the state's flat buffers (:mod:`funcamp.train._flat`) where the step runs flat.

    The per-leaf state is packed (its tensors are views of the buffers: no copy, after the first call) and the
    step's result unpacked into per-leaf views. Donating, the step writes into the buffers, which the given
    state's tensors view (when a call has to copy them in, they are made views of the buffers before it). A state
    of another structure than the first call's runs leaf by leaf (compiled again, as any other structure is).
    """

    def call(state: TrainState, batch: Any) -> Any:
        flat = run_as.flat
        packed = None if flat is None else flat.pack(state)
        if packed is None:
            return compiled(state, batch)
        flat_state, copied = packed
        later = flat.adopt(state, flat_state) if donate and copied else []
        out = compiled(flat_state, batch)
        if donate:  # the metrics; the new state is in the buffers
            with torch.no_grad():
                for tensor, view in later:
                    tensor.copy_(view)
            return out
        new_state, metrics = out
        return flat.unpack(new_state), metrics

    return call


def _probes_for(
    layout: _layout.SingleProcess, max_consecutive_skips: int | None, has_aux: bool, telemetry: Any
) -> list[Any]:
    """The probes the step's keywords ask for, over ``layout`` (raises as :func:`funcamp.train.telemetry_probe`)."""
    probes: list[Any] = [] if max_consecutive_skips is None else [_probes.skip_limit(max_consecutive_skips)]
    probes += [_probes.aux_probe] if has_aux else []
    return probes + ([] if telemetry is None else [_probes.telemetry_probe(telemetry, layout)])


def _inductor_options() -> dict[str, Any] | None:
    """The inductor options of the compiled step: funcamp's graph pass, the backward's order kept, and a cache.

    ``post_grad_custom_pre_pass``: :class:`funcamp.passes.RematPass` (``functionalize(remat=)`` regions
    recomputed, sharded gathers at use, large backward buffers made late). ``reorder_for_locality=False``: the
    step's forward and backward are traced into one graph without a forward/backward split, which inductor
    takes for an inference graph and reorders for locality, moving each node to just before its first user:
    each weight gradient's matmul went to the end of the backward, where the finite check first reads it, and
    kept its inputs alive until then (a tied LM head: the logits' gradient through the whole backward,
    ``tests/test_remat.py``); torch does not run that pass on the graphs it compiles for training.

    Let AOTAutograd's cache store the step:

    funcamp's casting mode (:class:`funcamp.ops.OpPolicies`, a ``TorchFunctionMode``) makes Dynamo record the
    ``Tensor`` methods that torch writes in Python (``Tensor.split``, ``Tensor.unique``, ...) as calls to those
    Python functions, which AOTAutograd's cache refuses ("Bypassing autograd cache due to: Unsupported
    call_function target Tensor.split"): every new process re-ran AOTAutograd on the whole step (3.6 s of
    the warm first step of the benchmark GPT on a 2-core AMD EPYC, AVX2). They are torch's own functions,
    marked cacheable here under the running torch version (``torch._inductor.config.
    unsafe_marked_cacheable_functions``), so a change of torch changes the cache key.
    """
    from torch._inductor import config as inductor_config

    remat = {"post_grad_custom_pre_pass": passes.RematPass(), "reorder_for_locality": False}
    if not hasattr(inductor_config, "unsafe_marked_cacheable_functions"):  # older torch: no such option
        return remat
    methods = (getattr(torch.Tensor, name, None) for name in _PYTHON_TENSOR_MATH)
    names = sorted(
        f"{fn.__module__}.{fn.__name__}"
        for fn in methods
        if isinstance(fn, types.FunctionType) and fn.__module__ == "torch._tensor"
    )
    return {"unsafe_marked_cacheable_functions": dict.fromkeys(names, torch.__version__), **remat}


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


_MOVED = ("data_parallel", "policy", "shard")


def _moved_to_state(moved: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``(data_parallel, shard, policy)`` given to ``make_train_step`` (deprecated: each warns), None if not.

    Raises:
      TypeError: for any other keyword, as Python does.
    """
    import warnings

    unknown = sorted(set(moved) - set(_MOVED))
    if unknown:
        raise TypeError(f"make_train_step() got an unexpected keyword argument {unknown[0]!r}")
    for key in (k for k in _MOVED if k in moved):
        warnings.warn(
            f"make_train_step: {key}= is deprecated: pass it to TrainState.create(params, optimizer, {key}=...); "
            "the step takes it from the state",
            DeprecationWarning,
            stacklevel=3,
        )
    return moved.get("data_parallel"), moved.get("shard"), moved.get("policy")


def _first_call_check(
    run_as: _Assembly, for_state: Callable[[Any], None], loss_fn: Callable[..., Any], optimizer: GradientTransformation
) -> Callable[[Any], None]:
    """The host-side check of the state at a step's first call; later calls only compare the layout the state
    carries with the first call's (a host-side comparison of static metadata)."""
    done: list[Any] = [False, None, None]

    def check(state: TrainState) -> None:
        if done[0]:
            if state.shard is not done[1] and state.shard != done[1]:
                raise ValueError(
                    f"train_step: this step was first called with a state of layout {done[1]!r} and runs under it; "
                    f"this state carries {state.shard!r}: build another step for it (make_train_step)"
                )
            if (state.data_parallel, state.policy) != done[2]:
                raise ValueError(
                    f"train_step: this step was first called with a state of data_parallel and policy {done[2]!r} "
                    f"and runs under them; this state carries {(state.data_parallel, state.policy)!r}: build another "
                    "step for it (make_train_step)"
                )
            return
        message = _loss.arity_error(loss_fn, state.buffers is not None)
        if message is not None:
            raise TypeError(message)
        _check_no_history(state)
        for_state(state)
        _check_opt_state(state, optimizer)
        run_as.layout.check_state(state)
        done[0], done[1], done[2] = True, state.shard, (state.data_parallel, state.policy)

    return check


def _check_no_history(state: TrainState) -> None:
    """Refuse a state built by hand with a leaf that requires grad (``TrainState.create`` detaches them): the eager
    step would chain every step's autograd history onto the state, the compiled one fail inside torch.

    Raises:
      TypeError: naming the first such leaf.
    """
    for path, leaf in zip(_tree.tree_paths(state), _tree.tree_leaves(state)):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            raise TypeError(
                f"train_step: state leaf {path!r} requires grad (an nn.Parameter, or a tensor with autograd history); "
                "a train state carries none. Build the state with TrainState.create(params, optimizer), which takes "
                "such tensors as tensor.detach() (the same memory), or pass {k: p.detach() for k, p in "
                "model.named_parameters()}"
            )


def _check_opt_state(state: TrainState, optimizer: GradientTransformation) -> None:
    """Refuse an optimizer state made by another optimizer (its structure differs from ``optimizer.init``'s).

    ``init`` runs on shape-only (meta) copies of the parameters: nothing is allocated. An ``init`` that cannot
    run there is not checked.
    """
    if _tree.first_non_floating(state.params) is not None:  # the step names that leaf itself
        return
    meta = _tree.tree_map(lambda p: p.to("meta") if isinstance(p, torch.Tensor) else p, state.params)
    try:
        expected = _tree.tree_structure(optimizer.init(meta))
    except Exception:  # noqa: BLE001 (an init that needs real values: let the step itself decide)
        return
    if expected != _tree.tree_structure(state.opt_state):
        raise TypeError(
            "train_step: state.opt_state was not made by this step's optimizer for these parameters (its structure "
            "differs from optimizer.init(state.params)'s); build the state with TrainState.create(params, optimizer) "
            "using the optimizer given to make_train_step"
        )


def _check_step_args(state: Any, batch: Any) -> None:
    """Refuse a call whose first argument is not a TrainState, or a donated one, outside any compiled region."""
    if isinstance(state, TrainState):
        _donate.check_not_donated(state, "train_step")
        return
    if isinstance(batch, TrainState):
        raise TypeError(
            f"train_step: the arguments are swapped: got (batch, state), with a {type(state).__name__} first; "
            "call train_step(state, batch), the state first (as optax's update(grads, state))"
        )
    raise TypeError(
        f"train_step: the first argument must be a funcamp.TrainState, got {type(state).__name__}; build it with "
        "funcamp.TrainState.create(params, optimizer) and call train_step(state, batch)"
    )


def _with_checked_args(step: Callable[..., Any], first_call: Callable[[Any], None]) -> Callable[..., Any]:
    def checked_step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        _check_step_args(state, batch)
        first_call(state)
        return step(state, batch)

    return checked_step


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


def _with_eager_errors(
    step: Callable[..., Any], compiled: Callable[..., Any], first_call: Callable[[Any], None]
) -> Callable[..., Any]:
    """``compiled``, but an error of the user's code (or a bad input) raises itself rather than dynamo's.

    With ``fullgraph=True`` an exception raised while tracing reaches the caller wrapped by dynamo:
    ``torch._dynamo.exc.Unsupported`` ("Observed exception") for funcamp's own checks (a loss that is
    not 0-d, a batch that does not split into micro-batches), ``TorchRuntimeError`` (about 45 lines of
    fake-tensor detail, after a logged traceback) for an error in the user's ``loss_fn`` (float labels
    to ``cross_entropy``, a wrong feature size). The step is pure, so on any dynamo error it is run once
    eagerly: what that raises is raised instead, as itself, with :data:`EAGER_RERUN_NOTE` added and
    the fake-tensor log lines of the failed trace dropped. If the eager step succeeds, dynamo's error
    is re-raised (with a note saying what to do where :mod:`funcamp.train._hints` knows the failure) and
    the held log lines are emitted. The arguments' types are checked first.
    """

    def compiled_step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        _check_step_args(state, batch)
        first_call(state)
        logger, held = logging.getLogger(_FAKE_TENSOR_LOGGER), _HeldRecords()
        logger.addFilter(held)
        try:
            return compiled(state, batch)
        except torch._dynamo.exc.TorchDynamoException as dynamo_error:
            logger.removeFilter(held)
            try:
                step(state, batch)
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
