"""``make_train_step``: the standard step, the stages of :mod:`funcamp.train._stages` in one body.

The body is :func:`funcamp.train.run` (gradients, cast, check, update, commit, metrics) and the probes the
keywords ask for (:mod:`funcamp.train._probes`); everything around it (compiled or eager, donation, the host
boundary of the state's storage, the graph passes) is :func:`funcamp.train.assemble`'s. The process layout and
the storage come from the state (``TrainState.create``). No stage branches on a feature flag.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from funcamp import _tree, numerics
from funcamp.optim import GradientTransformation
from funcamp.train import _assemble, _donate, _layout, _loss, _probes, _stages
from funcamp.train._assemble import EAGER_RERUN_NOTE
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
) -> _assemble.Step:
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
        is consumed (using it again raises :class:`funcamp.train.DonatedStateError`). Default False: each step
        allocates a new state, and on a CPU with glibc every block over 32 MiB is a fresh ``mmap`` whose pages
        fault on first write (flat buffers are split at 8 MiB; GPT-2 124M's undonated step is still
        1.10x the donated one, its embedding one block; equal with ``MALLOC_MMAP_MAX_=0
        MALLOC_TRIM_THRESHOLD_=17179869184`` set before Python starts: docs/memory.md).
      **moved: ``data_parallel=``, ``policy=`` and ``shard=``, deprecated (``DeprecationWarning``): the state
        carries them (``TrainState.create(params, optimizer, data_parallel=..., policy=..., shard=...)``, which
        checks the parameters and the layout across the ranks) and the step runs each state under the layout it
        carries; given here they still work as before and must agree with the state's. A sharded state trains
        this rank's shards with the unsharded step's metrics (:mod:`funcamp.sharding`).
    Returns:
      The step, a :class:`funcamp.train.Step` (:func:`funcamp.train.assemble` over the stages): call it as
      ``step(state, batch)``; ``step.plan`` and ``step.plan_for(state)`` show what it decided (compiled or
      eager, donation, probes; the state's process layout and storage, flat buffers or leaf by leaf and why),
      which the first call logs once at INFO on ``funcamp.train``.
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
    telemetry = numerics.as_telemetry(telemetry)
    probes = _probes_for(max_consecutive_skips, has_aux, telemetry)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        record = _stages.run(loss_fn, optimizer, state, batch, has_aux=has_aux, accumulation_steps=accumulation_steps)
        metrics = dict(record.metrics)
        for probe in probes.values():
            metrics.update(probe(record))
        return record.new_state, metrics

    return _assemble.assemble(
        step if telemetry is not None else _donate.updates_in_place(step),  # telemetry reads after the update
        compile=compile,
        backend=backend,
        donate=donate,
        prepare=_prepare(loss_fn, optimizer, telemetry, moved),
        probes=tuple(probes),
    )


def _probes_for(max_consecutive_skips: int | None, has_aux: bool, telemetry: Any) -> dict[str, Any]:
    """The probes the step's keywords ask for, by name (raises as :func:`funcamp.train.skip_limit`)."""
    probes: dict[str, Any] = (
        {} if max_consecutive_skips is None else {"skip_limit": _probes.skip_limit(max_consecutive_skips)}
    )
    probes.update({"aux": _probes.aux_probe} if has_aux else {})
    return probes | ({} if telemetry is None else {"telemetry": _probes.telemetry_probe(telemetry)})


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


def _check_opt_state(state: TrainState, optimizer: GradientTransformation) -> None:
    """Refuse an optimizer state made by another optimizer (its structure differs from ``optimizer.init``'s).

    ``init`` runs on shape-only (meta) copies of the parameters, once per structure, shapes and dtypes
    (:func:`_init_structure`): nothing is allocated. An ``init`` that cannot run there is not checked.
    """
    leaves, spec = _tree.tree_flatten(state.params)
    if any(not isinstance(x, torch.Tensor) or not x.is_floating_point() for x in leaves):
        return  # the step names that leaf itself
    expected = _init_structure(optimizer, spec, tuple((tuple(x.shape), x.dtype) for x in leaves))
    if expected is not None and expected != _tree.tree_structure(state.opt_state):
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


def _check_no_history(state: TrainState) -> None:
    """Refuse a state built by hand with a leaf that requires grad (``TrainState.create`` detaches them): the eager
    step would chain every step's autograd history onto the state, the compiled one fail inside torch.

    Raises:
      TypeError: naming the first such leaf.
    """
    for i, leaf in enumerate(_tree.tree_leaves(state)):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            path = _tree.tree_paths(state)[i]
            raise TypeError(
                f"train_step: state leaf {path!r} requires grad (an nn.Parameter, or a tensor with autograd history); "
                "a train state carries none. Build the state with TrainState.create(params, optimizer), which takes "
                "such tensors as tensor.detach() (the same memory), or pass {k: p.detach() for k, p in "
                "model.named_parameters()}"
            )


@functools.lru_cache(maxsize=32)
def _init_structure(optimizer: GradientTransformation, spec: Any, shapes: tuple[Any, ...]) -> Any:
    """The structure of ``optimizer.init`` over meta parameters of ``spec`` and ``shapes``, or None where it cannot
    run on them (an init that needs real values: the step itself decides)."""
    meta = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in shapes]
    try:
        return _tree.tree_structure(optimizer.init(_tree.tree_unflatten(spec, meta)))
    except Exception:  # noqa: BLE001
        return None


def _prepare(
    loss_fn: Callable[..., Any], optimizer: GradientTransformation, telemetry: Any, moved: dict[str, Any]
) -> Callable[[Any, Any], Any]:
    """The host-side checks of each call (cheap; what needs the ranks ran at ``TrainState.create``): the
    arguments, the loss's arity, the optimizer state's structure, and the layout a deprecated keyword asks for."""
    arity = {buffers: _loss.arity_error(loss_fn, buffers) for buffers in (False, True)}
    given = _given_layout(*_moved_to_state(moved), telemetry)

    def prepare(state: Any, batch: Any) -> Any:
        _check_step_args(state, batch)
        if arity[state.buffers is not None] is not None:
            raise TypeError(arity[state.buffers is not None])
        _check_no_history(state)
        _check_opt_state(state, optimizer)
        state.storage.admit(optimizer)  # flat: the optimizer groups the parameters as the state's (once per object)
        if given is not None:  # deprecated: the state was not checked across the ranks for this layout
            state = dataclasses.replace(state, layout=given(state.shard, state.data_parallel, state.policy))
            state.layout.check_state(state)
        elif state.layout is None:  # unpickled without its group: made again, or the error says why not
            state = dataclasses.replace(state)
        if telemetry is not None and not state.layout.whole_gradients:
            raise ValueError("make_train_step: telemetry= is not supported with shard= (it reads whole gradients)")
        return state

    return prepare


def _given_layout(data_parallel: Any, shard: Any, policy: Any, telemetry: Any) -> Callable[..., Any] | None:
    """With the deprecated ``data_parallel=``, ``shard=`` or ``policy=`` of ``make_train_step``: the layout they
    and a state's fields describe together (checked against each other, one object per set of fields), else
    None (the state's own layout). A layout given here is checked across ranks now, at build time."""
    if data_parallel is None and shard is None and policy is None:
        return None
    built = _layout.layout_from(data_parallel, shard, policy)
    built.check_ranks()
    if telemetry is not None:
        _probes.telemetry_probe(telemetry, built)  # refuses a layout without whole gradients, now

    @functools.lru_cache(maxsize=16)
    def combined(state_shard: Any, state_group: Any, state_policy: Any) -> Any:
        fields = types.SimpleNamespace(shard=state_shard, data_parallel=state_group, policy=state_policy)
        layout = _layout.layout_from(data_parallel, shard, policy, state=fields)
        if shard is None and state_shard is not None:  # taken from the state: checked as one given here
            layout.check_ranks()
        return layout

    return combined
