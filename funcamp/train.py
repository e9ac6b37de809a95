"""The functional train step: ``(state, batch) -> (state, metrics)``, compiled whole.

One call scales the loss, differentiates (optionally over micro-batches), unscales and checks the
gradients, runs the optimizer, and keeps the old parameters, buffers and optimizer state where the
gradients were not finite, with ``torch.where``: no host sync and no Python branch on tensor values,
so ``torch.compile(fullgraph=True)`` turns the whole step into one graph.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from funcamp import _tree, numerics, parallel, sharding
from funcamp.grad import scaled_grad_and_value
from funcamp.loss_scale import LossScale, NoOpLossScale
from funcamp.optim import GradientTransformation, apply_updates, learning_rate
from funcamp.policy import Policy, get_policy

__all__ = [
    "SkippedStepsError",
    "TrainState",
    "check_skips",
    "make_train_step",
    "nonfinite_leaf_name",
]


def _zero_int(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int32, device=device)


@_tree.dataclass
class TrainState:
    """Everything a training run carries from step to step; immutable, a pytree of tensors.

    Build it with :meth:`create`; :meth:`replace` returns a modified copy.

    Attributes:
      step: 0-d int32, the number of train-step calls so far (applied and skipped).
      params: the master parameters (a dict of tensors, usually float32).
      opt_state: the optimizer state (NamedTuples of tensors).
      loss_scale: the current :class:`funcamp.LossScale`.
      buffers: model buffers that change in training (BatchNorm statistics), or None.
      skipped_steps: 0-d int32, steps skipped for non-finite gradients since the start.
      consecutive_skips: 0-d int32, skipped steps since the last applied one.
    """

    step: torch.Tensor
    params: Any
    opt_state: Any
    loss_scale: LossScale
    buffers: Any = None
    skipped_steps: torch.Tensor | None = None
    consecutive_skips: torch.Tensor | None = None

    @classmethod
    def create(
        cls,
        params: Any,
        optimizer: GradientTransformation,
        *,
        loss_scale: LossScale | None = None,
        buffers: Any = None,
        shard: sharding.ShardLayout | None = None,
    ) -> TrainState:
        """A fresh state: ``optimizer.init(params)``, counters at 0, the loss scale on the params' device.

        With ``shard`` (a :class:`funcamp.sharding.ShardLayout`, from
        ``funcamp.sharding.shard_layout(params, group)``), ``params`` are the whole parameters, the same
        on every rank (:func:`funcamp.parallel.broadcast_params`), and the state holds this rank's
        shards of them (rows ``[r*c, (r+1)*c)`` along dim 0, zero-padded) and the optimizer state
        built from those shards: about ``1 / N`` of the unsharded state. Train it with
        ``make_train_step(..., data_parallel=group, shard=layout)``.

        Args:
          params: the master parameters, a pytree (usually a dict) of floating tensors.
          optimizer: a :class:`funcamp.optim.GradientTransformation`.
          loss_scale: default :class:`funcamp.NoOpLossScale`.
          buffers: model buffers (``funcamp.nn.functionalize`` returns them), or None.
          shard: None (every rank holds everything), or the layout to shard the parameters with.
        Raises:
          TypeError: if ``optimizer`` is not a GradientTransformation, ``loss_scale`` not a LossScale,
            ``params`` an ``nn.Module`` or an iterator (``model.parameters()``), or a parameter leaf is
            not a floating tensor, or ``shard`` is not None or a ShardLayout.
          ValueError: if ``params``' names or shapes differ from ``shard``'s; with a ``shard`` made by
            ``shard_layout(params, group)``: if this process is not the layout's rank of its world size
            in that group, or the parameters differ between the group's ranks (a float64 checksum per
            leaf, one ``all_gather_object``; the error names the first differing parameter).
        """
        if not isinstance(optimizer, GradientTransformation):
            raise TypeError(
                f"TrainState.create: optimizer must be a funcamp.optim.GradientTransformation, "
                f"got {type(optimizer).__name__}"
            )
        loss_scale = NoOpLossScale() if loss_scale is None else loss_scale
        if not isinstance(loss_scale, LossScale):
            raise TypeError(
                f"TrainState.create: loss_scale must be a funcamp loss scale (NoOpLossScale, StaticLossScale, "
                f"DynamicLossScale), got {type(loss_scale).__name__}; e.g. funcamp.DynamicLossScale(2.0**15)"
            )
        if isinstance(params, torch.nn.Module):
            raise TypeError(
                "TrainState.create: params must be a pytree (dict) of tensors, got an nn.Module; "
                "use `apply_fn, params = funcamp.nn.functionalize(model, policy)` and pass those params"
            )
        if isinstance(params, (types.GeneratorType, Iterator)):
            raise TypeError(
                f"TrainState.create: params must be a pytree (dict) of tensors, got a {type(params).__name__} "
                "(model.parameters()?), which has no names and can be read only once; use "
                "`apply_fn, params = funcamp.nn.functionalize(model, policy)`, or "
                "`{name: p.detach() for name, p in model.named_parameters()}`"
            )
        bad = _tree.first_non_floating(params)
        if bad is not None:
            raise TypeError(
                f"TrainState.create: every parameter must be a floating tensor; {bad[0]!r} is {bad[1]}. "
                "Keep integer state in buffers."
            )
        if shard is not None:
            if not isinstance(shard, sharding.ShardLayout):
                raise TypeError(
                    f"TrainState.create: shard must be None or a funcamp.sharding.ShardLayout "
                    f"(funcamp.sharding.shard_layout(params, group)), got {type(shard).__name__}"
                )
            if shard.group is not None:  # a layout from shard_layout(params, group): one all_gather_object
                sharding.check_same_params(params, shard.group, "TrainState.create", layout=shard)
            params = sharding.shard_params(params, shard)
        device = _tree.tree_device(params)
        return cls(
            step=_zero_int(device),
            params=params,
            opt_state=optimizer.init(params),
            loss_scale=loss_scale.to(device),
            buffers=buffers,
            skipped_steps=_zero_int(device),
            consecutive_skips=_zero_int(device),
        )

    def replace(self, **changes: Any) -> TrainState:
        """A copy with the given fields replaced."""
        return dataclasses.replace(self, **changes)


def _micro_batches(batch: Any, k: int) -> list[Any]:
    if k == 1:
        return [batch]
    leaves, spec = _tree.tree_flatten(batch)
    chunks = []
    for path, leaf in zip(_tree.tree_paths(batch), leaves):
        if not isinstance(leaf, torch.Tensor) or leaf.ndim == 0 or leaf.shape[0] % k:
            shape = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise ValueError(
                f"make_train_step: with accumulation_steps={k}, every batch leaf must be a tensor whose first "
                f"dimension is divisible by {k}; leaf {path!r} is {shape}"
            )
        chunks.append(leaf.chunk(k))
    return [_tree.tree_unflatten(spec, [c[i] for c in chunks]) for i in range(k)]


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: GradientTransformation,
    *,
    has_aux: bool = False,
    accumulation_steps: int = 1,
    max_consecutive_skips: int | None = None,
    compile: bool = True,
    backend: str | None = None,
    data_parallel: Any = None,
    policy: Policy | str | None = None,
    telemetry: numerics.Telemetry | int | None = None,
    shard: sharding.ShardLayout | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
    """Build the pure train step ``step(state, batch) -> (new_state, metrics)``.

    Per call: split ``batch`` into ``accumulation_steps`` micro-batches along dim 0; for each, the
    gradient of ``loss_fn`` times the loss scale, unscaled in float32 and summed; their mean is cast to
    the parameters' dtypes (the gradient of the mean loss). If every gradient and the loss are finite,
    the optimizer update is applied; otherwise params, buffers and the whole optimizer state (its step
    count too, so schedules do not advance) are kept bitwise. The loss scale is adjusted once per call.
    ``state`` is never mutated.

    ``loss_fn`` is ``loss_fn(params, batch) -> loss`` when ``state.buffers`` is None, else
    ``loss_fn(params, buffers, batch) -> (loss, new_buffers)``; with ``has_aux`` the loss becomes
    ``(loss, aux)``, i.e. ``(loss, aux)`` or ``((loss, aux), new_buffers)``.

    Metrics (0-d tensors on the parameters' device): ``loss`` (mean unscaled loss, float32),
    ``loss_scale`` (the scale used this step), ``grads_finite``, ``grad_norm`` (global L2 norm of the
    unscaled gradients, before any clipping), ``learning_rate`` (the rate this step used or would
    have used), ``skipped_steps``, ``consecutive_skips``, ``nonfinite_leaf`` (index of the first
    parameter whose gradient was not finite, -1 if none; see :func:`nonfinite_leaf_name`), and with
    ``max_consecutive_skips`` also ``too_many_skips`` (bool; :func:`check_skips` raises on it). With
    ``has_aux``, ``metrics["aux"]`` holds the last micro-batch's aux. With ``telemetry``, also the
    ``numerics/...`` metrics of :mod:`funcamp.numerics` (per module group: gradient and weight amax,
    the fractions of gradient elements that underflow or overflow in float16/bfloat16/fp8 before and
    after loss scaling, exact zeros, the loss scale's headroom, a log2|g| histogram), computed every
    ``every``-th step inside the same graph (``torch.cond``; zeros and ``numerics/active`` False on
    the other steps).

    Unlike ``torch.amp.GradScaler``, nothing is read on the host: pass metrics to a logger at its
    own interval.

    Args:
      loss_fn: the loss, see above; a 0-d floating tensor.
      optimizer: a :class:`funcamp.optim.GradientTransformation`.
      has_aux: whether the loss comes with aux data.
      accumulation_steps: micro-batches per step (>= 1); every batch leaf's first dimension must be
        divisible by it.
      max_consecutive_skips: report ``too_many_skips`` once this many steps in a row were skipped.
      compile: wrap the step in ``torch.compile(fullgraph=True)``.
      backend: the ``torch.compile`` backend (default inductor).
      data_parallel: None or False (one process), True (the default ``torch.distributed`` process
        group) or a process group: gradients are averaged over its ranks in ``policy.reduce_dtype``
        and one ``grads_finite`` is agreed for all ranks, with functional collectives that ``torch.compile``
        traces (see :mod:`funcamp.parallel`); floating buffers are averaged over the ranks in their
        own dtype (DDP instead broadcasts rank 0's), except fp8 delayed-scaling state: amax histories
        max-reduced, scales min-reduced (:func:`funcamp.parallel.reduce_buffers`).
      policy: the precision policy (or string) whose ``reduce_dtype`` the gradients are averaged in;
        default: each gradient's own dtype. Only used with ``data_parallel``.
      telemetry: None (default: off), an int N (:class:`funcamp.numerics.Telemetry` ``(every=N)``:
        module groups of depth 2, float16 and bfloat16, histograms) or a ``Telemetry``.
      shard: None, or the :class:`funcamp.sharding.ShardLayout` of a state made with
        ``TrainState.create(..., shard=layout)`` (ZeRO-3 / FSDP2-style sharded data parallelism over
        the ``data_parallel`` group, see :mod:`funcamp.sharding`): the step all-gathers the parameters
        (in ``layout.gather_dtype``, default their own), computes the gradients as above,
        reduce-scatters their mean in ``policy.reduce_dtype`` (loss scale on a narrower wire), agrees
        one ``grads_finite`` and takes ``grad_norm`` over all shards, and updates only this rank's
        shards. The metrics are the unsharded step's (``grad_norm`` to float32 round-off). The
        optimizer must not contain ``funcamp.optim.clip_by_global_norm`` (use
        ``funcamp.sharding.clip_by_global_norm`` built for the same group), and an
        ``optim.stochastic_rounding`` in it takes ``layout=`` the same layout (its noise then hashes
        each element's index in the whole tensor: the unsharded run's noise). Building the step checks
        (one ``all_gather_object``) that every rank has the same layout and policy; that every rank
        starts from the same parameters is checked by ``TrainState.create(shard=layout)``, where the
        whole parameters are at hand.

    The first call (host side, before anything is traced) checks the state: a sharded state (made by
    ``TrainState.create(shard=)`` or ``funcamp.checkpoint.load_sharded``) given to a step built without
    ``shard=`` is refused; with ``data_parallel`` and no ``shard``, one ``all_gather_object`` of a
    float64 checksum per parameter (sum and sum of squares) refuses parameters that differ between
    ranks (which would otherwise diverge silently: the gradients are averaged, the parameters never
    compared). Later calls check nothing more.
    Returns:
      The step function.
    Raises:
      TypeError: if ``loss_fn`` is not callable, ``optimizer`` not a GradientTransformation,
        ``data_parallel`` not None, a bool or a ProcessGroup, or ``telemetry`` not None, an int or a
        Telemetry.
      RuntimeError: if ``data_parallel`` asks for a group and torch.distributed is not initialized.
      ValueError: if ``accumulation_steps`` < 1, ``max_consecutive_skips`` < 1 or ``telemetry`` < 1; at call time, if a
        batch leaf cannot be split into ``accumulation_steps`` micro-batches. With ``shard``: if
        ``data_parallel`` is missing (and the layout is for more than one rank), the layout's world
        size or rank is not the group's, ranks differ in layout or policy (the message names the rank),
        ``telemetry`` is set, or the optimizer clips by a per-shard global norm or by
        ``funcamp.sharding.clip_by_global_norm`` of another group, or holds ``optim.stochastic_rounding``
        without ``layout=`` (over more than one rank) or with another layout. Without ``shard``: if the
        optimizer holds ``funcamp.sharding.clip_by_global_norm`` with a group, or
        ``optim.stochastic_rounding`` with a layout over more than one rank. At the first call: if the state
        is sharded and the step is not, or (data parallel) the parameters differ between ranks.

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
    if not callable(loss_fn):
        raise TypeError(f"make_train_step: loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(
            f"make_train_step: optimizer must be a funcamp.optim.GradientTransformation, got {type(optimizer).__name__}"
        )
    if not isinstance(accumulation_steps, int) or isinstance(accumulation_steps, bool) or accumulation_steps < 1:
        raise ValueError(f"make_train_step: accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
    if max_consecutive_skips is not None and (not isinstance(max_consecutive_skips, int) or max_consecutive_skips < 1):
        raise ValueError(
            f"make_train_step: max_consecutive_skips must be None or an int >= 1, got {max_consecutive_skips!r}"
        )
    reduce_dtype = None if policy is None else get_policy(policy).reduce_dtype
    telemetry = numerics.as_telemetry(telemetry)
    group = parallel.resolve_group(data_parallel)  # None: one process
    k = accumulation_steps
    if shard is not None:
        _check_shard(shard, group, optimizer, policy, telemetry)
    else:
        sharding.check_optimizer(optimizer, group, sharded=False)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        with_buffers = state.buffers is not None
        if with_buffers:
            # The buffers come back through aux; the loss_fn's own aux (if any) rides along.
            def fun(params: Any, buffers: Any, mb: Any) -> Any:
                returned = loss_fn(params, buffers, mb)
                if not (isinstance(returned, tuple) and len(returned) == 2):
                    got = f"a tuple of {len(returned)}" if isinstance(returned, tuple) else type(returned).__name__
                    form = "((loss, aux), new_buffers)" if has_aux else "(loss, new_buffers)"
                    raise TypeError(
                        f"make_train_step: with state.buffers, loss_fn(params, buffers, batch) must return {form}; "
                        f"got {got}"
                    )
                out, new_buffers = returned
                loss, aux = out if has_aux else (out, ())
                return loss, (new_buffers, aux)
        else:

            def fun(params: Any, buffers: Any, mb: Any) -> Any:
                out = loss_fn(params, mb)
                loss, aux = out if has_aux else (out, ())
                return loss, ((), aux)

        grad_fn = scaled_grad_and_value(fun, state.loss_scale, has_aux=True)
        # Sharded: differentiate the whole parameters, all-gathered once (the collective is not differentiated).
        whole = state.params if shard is None else sharding.all_gather_params(state.params, shard, group)
        # torch.func wants tensors (or empty containers) in aux: () stands for "no buffers".
        buffers, total, losses, aux = (state.buffers if with_buffers else ()), None, [], ()
        for mb in _micro_batches(batch, k):
            grads32, (loss, (buffers, aux)) = grad_fn(whole, buffers, mb)
            total = grads32 if total is None else _tree.tree_map(torch.add, total, grads32)
            losses.append(loss.float())
        params = state.params
        if k > 1:
            total = _tree.tree_map(lambda g: g / k, total)
        scale = None if isinstance(state.loss_scale, NoOpLossScale) else state.loss_scale.loss_scale
        if shard is not None:  # this rank's rows of the mean over ranks, same rule as mean_gradients
            total = sharding.reduce_scatter_gradients(total, shard, group, reduce_dtype, loss_scale=scale)
        elif group is not None:  # the mean over micro-batches, then over ranks (float32 in, float32 out)
            # On a narrower wire (r=f16/bf16) the gradients travel scaled and are unscaled after the sum, as
            # DDP + GradScaler; an overflow there makes them non-finite on every rank (skip, back off).
            total = parallel.mean_gradients(total, group, reduce_dtype, loss_scale=scale)
        grads = _tree.tree_map(lambda g, p: g.to(p.dtype), total, params)
        loss = torch.stack(losses).mean() if k > 1 else losses[0]
        if shard is not None:  # over all shards (padding rows excluded), the loss of every rank: one all_reduce
            finite, flags, grad_norm = sharding.global_stats(grads, shard, group, loss)
        else:
            flags = _tree.finite_flags(grads)
            finite, grad_norm = flags.all() & torch.isfinite(loss), _tree.global_norm(grads)
        if group is not None:
            if shard is None:
                finite = parallel.all_ranks_true(finite, group)
            loss = parallel.mean_over_ranks(loss, group)
            if with_buffers and _tree.tree_leaves(state.buffers):
                # Running statistics averaged, fp8 amax histories max-reduced and scales min-reduced
                # (parallel.register_buffer_reduction), so that ranks stay identical.
                buffers = parallel.reduce_buffers(buffers, group)

        updates, new_opt_state = optimizer.update(grads, state.opt_state, params)
        new_params = apply_updates(params, updates)
        if shard is not None:  # padding stays exactly zero, whatever the optimizer does there
            new_params = sharding.zero_padding(new_params, shard)
        skipped = state.skipped_steps + (~finite).to(torch.int32)
        consecutive = torch.where(finite, torch.zeros_like(state.consecutive_skips), state.consecutive_skips + 1)
        new_state = state.replace(
            step=state.step + 1,
            params=_tree.select_tree(finite, new_params, params),
            opt_state=_tree.select_tree(finite, new_opt_state, state.opt_state),
            loss_scale=state.loss_scale.adjust(finite),
            buffers=_tree.select_tree(finite, buffers, state.buffers) if with_buffers else None,
            skipped_steps=skipped,
            consecutive_skips=consecutive,
        )
        first_bad = torch.argmax((~flags).to(torch.int32)) if flags.numel() else torch.zeros((), dtype=torch.long)
        metrics = {
            "loss": loss,
            # On the parameters' device (state.step lives there): NoOpLossScale has no tensor to carry a
            # device, and a stateless optimizer's learning_rate is a NaN made on the CPU.
            "loss_scale": state.loss_scale.loss_scale.to(state.step.device),
            "grads_finite": finite,
            "grad_norm": grad_norm,
            "learning_rate": learning_rate(new_opt_state).to(state.step.device),
            "skipped_steps": skipped,
            "consecutive_skips": consecutive,
            "nonfinite_leaf": torch.where(flags.all(), -1, first_bad.to(torch.int32)),
        }
        if max_consecutive_skips is not None:
            metrics["too_many_skips"] = consecutive >= max_consecutive_skips
        if has_aux:
            metrics["aux"] = aux
        if telemetry is not None:  # every N steps, by torch.cond on the step count: one graph
            active = (state.step + 1) % telemetry.every == 0
            # Averaged over ranks, the gradients are views of one reduced buffer, and torch.cond refuses
            # operands that alias each other: give it copies (data parallelism with telemetry only).
            seen = grads if group is None else _tree.tree_map(torch.clone, grads)
            metrics.update(numerics.telemetry_metrics(seen, params, metrics["loss_scale"], telemetry, active))
        return new_state, metrics

    first_call = _first_call_check(shard, group, loss_fn)
    if compile:
        backend = backend or "inductor"
        options = _inductor_options() if backend == "inductor" else None  # None where torch lacks the option
        compiled = torch.compile(step, fullgraph=True, backend=backend, options=options)
        return _with_eager_errors(step, compiled, first_call)
    return _with_checked_args(step, first_call)


def _inductor_options() -> dict[str, Any] | None:
    """The inductor options of the compiled step: let AOTAutograd's cache store it.

    funcamp's casting mode (:class:`funcamp.ops.OpPolicies`, a ``TorchFunctionMode``) makes Dynamo record the
    ``Tensor`` methods that torch writes in Python (``Tensor.split``, ``Tensor.unique``, ...) as calls to those
    Python functions, which AOTAutograd's cache refuses ("Bypassing autograd cache due to: Unsupported
    call_function target Tensor.split"): every new process re-ran AOTAutograd on the whole step (3.6 s of
    the warm first step of the benchmark GPT on a 2-core AMD EPYC, AVX2). They are torch's own functions,
    marked cacheable here under the running torch version (``torch._inductor.config.
    unsafe_marked_cacheable_functions``), so a change of torch changes the cache key.
    """
    from torch._inductor import config as inductor_config

    if not hasattr(inductor_config, "unsafe_marked_cacheable_functions"):  # older torch: no such option
        return None
    methods = (getattr(torch.Tensor, name, None) for name in _PYTHON_TENSOR_MATH)
    names = sorted(
        f"{fn.__module__}.{fn.__name__}"
        for fn in methods
        if isinstance(fn, types.FunctionType) and fn.__module__ == "torch._tensor"
    )
    return {"unsafe_marked_cacheable_functions": dict.fromkeys(names, torch.__version__)}


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


def _loss_fn_arity_error(loss_fn: Callable[..., Any], with_buffers: bool) -> str | None:
    """Why ``loss_fn`` cannot take the arguments the step passes it, or None (also when it cannot tell)."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # builtins and some C callables have no signature: let the call decide
        return None
    args = ("params", "buffers", "batch") if with_buffers else ("params", "batch")
    try:
        signature.bind(*args)
    except TypeError:
        pass
    else:
        return None
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    if with_buffers:
        return (
            f"train_step: state.buffers is not None (the model has buffers: BatchNorm statistics, fp8 recipe "
            f"state), so loss_fn is called as loss_fn(params, buffers, batch) and must return "
            f"(loss, new_buffers), but {name}{signature} does not take three arguments; write "
            "loss_fn(params, buffers, batch), or build the state without buffers"
        )
    return (
        f"train_step: state.buffers is None, so loss_fn is called as loss_fn(params, batch), but "
        f"{name}{signature} does not take two arguments; if the model has buffers, pass "
        "TrainState.create(..., buffers=buffers) and write loss_fn(params, buffers, batch)"
    )


def _first_call_check(shard: Any, group: Any, loss_fn: Callable[..., Any]) -> Callable[[Any], None]:
    """The host-side check of the state at a step's first call (later calls do nothing)."""
    done = [False]

    def check(state: TrainState) -> None:
        if done[0]:
            return
        message = _loss_fn_arity_error(loss_fn, state.buffers is not None)
        if message is not None:
            raise TypeError(message)
        if shard is None and sharding.is_sharded(state.params):
            raise ValueError(
                "train_step: state.params are shards (from TrainState.create(..., shard=layout) or "
                "funcamp.checkpoint.load_sharded), but this step was built without shard=; build it with "
                "make_train_step(..., data_parallel=group, shard=layout)"
            )
        if shard is None and group is not None:
            sharding.check_same_params(state.params, group, "train_step")
        done[0] = True

    return check


def _check_shard(shard: Any, group: Any, optimizer: GradientTransformation, policy: Any, telemetry: Any) -> None:
    """The argument checks of ``make_train_step(shard=...)`` (build time, host side)."""
    if not isinstance(shard, sharding.ShardLayout):
        raise TypeError(
            f"make_train_step: shard must be None or a funcamp.sharding.ShardLayout "
            f"(funcamp.sharding.shard_layout(params, group)), got {type(shard).__name__}"
        )
    if group is None and shard.world_size != 1:
        raise ValueError(
            f"make_train_step: shard= is a layout over {shard.world_size} ranks; pass data_parallel=True (or the "
            "group it was made for)"
        )
    if telemetry is not None:
        raise ValueError("make_train_step: telemetry= is not supported with shard= (it reads whole gradients)")
    sharding.check_optimizer(optimizer, group, sharded=True, layout=shard)
    if group is not None:
        sharding.check_consistent(
            shard, group, optimizer=optimizer, policy=None if policy is None else get_policy(policy)
        )


def _check_step_args(state: Any, batch: Any) -> None:
    """Refuse a call whose first argument is not a TrainState, outside any compiled region."""
    if isinstance(state, TrainState):
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
    is re-raised and the held log lines are emitted. The arguments' types are checked first.
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
            raise dynamo_error
        finally:
            logger.removeFilter(held)
            for record in held.records:
                logger.handle(record)

    return compiled_step


def nonfinite_leaf_name(params: Any, index: int | torch.Tensor) -> str | None:
    """The name of the parameter that ``metrics["nonfinite_leaf"]`` points at (host side).

    Args:
      params: the parameters (``state.params``), to read the names from.
      index: ``metrics["nonfinite_leaf"]`` (reads it from the device: call it outside the step).
    Returns:
      The parameter's dotted name (``"blocks.0.attn.weight"``), or None for -1 (all finite).
    Raises:
      IndexError: if ``index`` is out of range for ``params``.
    """
    i = int(index)
    if i < 0:
        return None
    names = _tree.finite_flag_paths(params)  # the leaves metrics["nonfinite_leaf"] indexes, in its order
    if i >= len(names):
        raise IndexError(f"nonfinite_leaf_name: index {i} out of range for {len(names)} floating parameters")
    return names[i]


class SkippedStepsError(RuntimeError):
    """Raised by :func:`check_skips` when too many consecutive steps were skipped."""


def check_skips(metrics: dict[str, Any], params: Any = None, *, replay: Callable[[], Any] | None = None) -> None:
    """Raise if the step reported ``too_many_skips`` (host side: reads device tensors).

    Call it outside the compiled step, at your logging interval.

    ``replay`` says *why* the steps were skipped: a callable of no arguments, called only when
    raising, whose result's ``str`` ends the error message. The usual one replays the last step
    eagerly and names the first op that made a NaN or inf,
    ``functools.partial(funcamp.debug.locate_from_state, loss_fn, prev_state, batch)`` with the state
    *before* that step (``make_train_step`` never mutates it, so keeping a reference costs nothing).
    This module does not import :mod:`funcamp.debug`; anything that describes the failure will do.
    If ``replay`` itself raises, the message says so and ``SkippedStepsError`` is raised all the same,
    from that exception.

    Args:
      metrics: the metrics of a step built with ``max_consecutive_skips``.
      params: optional, to name the first parameter whose gradient was not finite.
      replay: optional, ``replay() -> report``; see above. Not called when nothing is raised.
    Raises:
      TypeError: if ``replay`` is neither None nor callable.
      KeyError: if ``metrics`` has no ``too_many_skips`` (the step was built without
        ``max_consecutive_skips``).
      SkippedStepsError: if ``too_many_skips`` is true.
    """
    if replay is not None and not callable(replay):
        raise TypeError(
            f"check_skips: replay must be a callable of no arguments or None, got {type(replay).__name__}; "
            "e.g. functools.partial(funcamp.debug.locate_from_state, loss_fn, prev_state, batch)"
        )
    if "too_many_skips" not in metrics:
        raise KeyError("check_skips: metrics has no 'too_many_skips'; build the step with max_consecutive_skips=N")
    if bool(metrics["too_many_skips"]):
        where = ""
        if params is not None:
            name = nonfinite_leaf_name(params, metrics["nonfinite_leaf"])
            where = f"; first non-finite gradient: {name}" if name else "; the loss itself was not finite"
        message = (
            f"{int(metrics['consecutive_skips'])} consecutive steps skipped for non-finite gradients at loss "
            f"scale {float(metrics['loss_scale']):g}{where}. Lower the learning rate, check the data, or "
            "compute in bfloat16/float32."
        )
        cause = None
        if replay is not None:
            try:
                report = str(replay())
            except Exception as e:  # a failing diagnosis must not hide the failure it diagnoses
                cause, report = e, f"(the replay failed: {type(e).__name__}: {e})"
            message = f"{message}\n{report}"
        raise SkippedStepsError(message) from cause
