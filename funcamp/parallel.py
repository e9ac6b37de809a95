"""Data parallelism on ``torch.distributed``: one pure train step on many processes, launched by ``torchrun``.

Each process (rank) holds a full copy of the parameters and computes gradients on its own shard of
the batch. Inside the train step, :func:`mean_gradients` averages the gradients over the ranks in the
policy's ``reduce_dtype``; when that dtype is narrower than the gradients' (float16 or bfloat16 on
the wire, float32 gradients), the gradients travel with the loss scale applied and are unscaled in
float32 after the sum, as ``DistributedDataParallel`` with ``torch.amp.GradScaler`` reduces scaled
gradients, so the loss scale protects small gradients on the wire as it does in the backward. An
overflow on the wire gives a non-finite mean on every rank, so the step is skipped everywhere and
the dynamic loss scale backs off. :func:`all_ranks_true` agrees on one ``grads_finite``, so a
non-finite gradient on any rank skips the step on every rank and the ranks stay identical. Both use
``torch.distributed._functional_collectives``, which ``torch.compile`` traces into the step's graph:
the compiled step stays one graph with no host sync. Outside the step, :func:`setup_from_env` starts
the process group from torchrun's environment, :func:`broadcast_params` makes every rank start from
rank 0's parameters, and :func:`is_main_process` tells the rank that logs and writes checkpoints.

Unlike ``torch.nn.parallel.DistributedDataParallel`` there are no autograd hooks, no module wrapper
and no overlap of communication with the backward pass: gradients are reduced once per step, after
all micro-batches, in one bucket per dtype. Unlike jmp (which leaves this to ``jax.lax.pmean``), the
reduction dtype is part of the :class:`funcamp.Policy` (``r=``/``reduce=``), as in FSDP2's
``MixedPrecisionPolicy(reduce_dtype=...)``.

The default process group must be initialized (:func:`setup_from_env` or
``torch.distributed.init_process_group``) before a data-parallel step is built.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from funcamp import _tree
from funcamp._deprecated import BUFFER_REDUCTIONS as _BUFFER_REDUCTIONS
from funcamp._deprecated import register_buffer_reduction

__all__ = [
    "all_ranks_true",
    "broadcast_params",
    "is_main_process",
    "mean_gradients",
    "mean_over_ranks",
    "reduce_buffers",
    "reduce_bytes",
    "register_buffer_reduction",
    "resolve_group",
    "setup_from_env",
    "shutdown",
]

T = TypeVar("T")

_ACCEPTED_GROUP = "None or False (one process), True (the default process group) or a ProcessGroup"


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"setup_from_env: WORLD_SIZE > 1 but the environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"setup_from_env: environment variable {name} must be an integer, got {value!r}") from None


def setup_from_env(backend: str | None = None, *, timeout_s: float = 600.0) -> tuple[int, int, torch.device]:
    """Start the default process group from the environment that ``torchrun`` sets.

    With ``WORLD_SIZE`` > 1, calls ``torch.distributed.init_process_group`` (reading ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); on CUDA it also selects GPU ``LOCAL_RANK``.
    Without ``WORLD_SIZE`` or with ``WORLD_SIZE=1`` it starts nothing. Calling it again once the group
    is up returns the same answer and starts nothing.

    Args:
      backend: ``"nccl"``, ``"gloo"`` or another ``torch.distributed`` backend; default ``"nccl"``
        when CUDA is available, else ``"gloo"``.
      timeout_s: seconds a collective may wait for the other ranks before it fails (> 0).
    Returns:
      ``(rank, world_size, device)``: this process's global rank, the number of processes, and the
      device to put its parameters and batches on (``cuda:LOCAL_RANK`` when CUDA is available and
      ``backend`` is not ``"gloo"``, else ``cpu``). ``(0, 1, device)`` for a single process.
    Raises:
      TypeError: if ``backend`` is not None or a string.
      ValueError: if ``timeout_s`` is not > 0, or ``WORLD_SIZE``, ``RANK`` or ``LOCAL_RANK`` is
        missing (with ``WORLD_SIZE`` > 1) or not an integer.
      RuntimeError: if ``torch.distributed`` is not available in this build of torch, or
        ``backend="nccl"`` without CUDA.

    Example:
      >>> import os
      >>> "WORLD_SIZE" in os.environ or setup_from_env()[:2] == (0, 1)
      True
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"setup_from_env: backend must be None or a string such as 'gloo' or 'nccl', got {backend!r}")
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
        raise ValueError(f"setup_from_env: timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0) if world_size <= 1 else _env_int("LOCAL_RANK")
    cuda = torch.cuda.is_available() and backend != "gloo"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if world_size <= 1 and not _initialized():
        return 0, 1, device
    if not dist.is_available():
        raise RuntimeError("setup_from_env: WORLD_SIZE > 1 but this build of torch has no torch.distributed")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("setup_from_env: backend='nccl' needs CUDA; use backend='gloo' on CPUs")
    if not _initialized():
        _env_int("RANK")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend or ("nccl" if cuda else "gloo"),
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if cuda else None,
        )
    return dist.get_rank(), dist.get_world_size(), device


def shutdown() -> None:
    """Destroy the default process group if one is up (call it at the end of a torchrun job)."""
    if _initialized():
        dist.destroy_process_group()


def is_main_process() -> bool:
    """True on global rank 0, and in a process without an initialized process group.

    Use it to log, write checkpoints and show progress bars once per job.

    Example:
      >>> is_main_process()
      True
    """
    return not _initialized() or dist.get_rank() == 0


def resolve_group(data_parallel: Any) -> dist.ProcessGroup | None:
    """The process group that ``TrainState.create(data_parallel=...)`` gives the step to reduce over (host side).

    Args:
      data_parallel: None or False (no data parallelism), True (the default process group, all
        ranks), or a ``torch.distributed.ProcessGroup``.
    Returns:
      The group, or None for no data parallelism.
    Raises:
      TypeError: if ``data_parallel`` is none of the above.
      RuntimeError: if a group is asked for and the default process group is not initialized.

    Example:
      >>> resolve_group(None) is None and resolve_group(False) is None
      True
    """
    if data_parallel is None or data_parallel is False:
        return None
    if data_parallel is not True and not (dist.is_available() and isinstance(data_parallel, dist.ProcessGroup)):
        raise TypeError(f"data_parallel must be {_ACCEPTED_GROUP}, got {data_parallel!r}")
    if not _initialized():
        raise RuntimeError(
            "data_parallel: the default torch.distributed process group is not initialized; call "
            "funcamp.parallel.setup_from_env() (under torchrun) or torch.distributed.init_process_group first"
        )
    return dist.group.WORLD if data_parallel is True else data_parallel


def broadcast_params(tree: T, src: int = 0, group: dist.ProcessGroup | None = None) -> T:
    """Copies of the tensor leaves of ``tree`` as rank ``src`` holds them, on every rank (host side).

    Call it on the initial parameters (and buffers) before ``TrainState.create``, outside the
    compiled step, so that every rank starts identical; the data-parallel step keeps them so. (DDP
    does this when it wraps the module; funcamp has no wrapper.) Every rank must call it with a tree of
    the same structure, shapes and dtypes. Non-tensor leaves are returned as they are. Tensors stay on
    their devices (gloo for CPU tensors, nccl for CUDA ones).

    Args:
      tree: a pytree of tensors, e.g. the parameters.
      src: the global rank whose values are copied.
      group: the process group; default the default group.
    Returns:
      A tree of the same structure with new tensors; ``tree`` itself (no copy) when no process
      group is initialized.
    Raises:
      TypeError: if ``src`` is not an int.
      ValueError: if ``src`` is not a rank of the group.

    Example:
      >>> broadcast_params({"w": torch.ones(2)})  # one process: returned as is
      {'w': tensor([1., 1.])}
    """
    if not isinstance(src, int) or isinstance(src, bool):
        raise TypeError(f"broadcast_params: src must be an int (a global rank), got {src!r}")
    if not _initialized():
        return tree
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    if src not in ranks:
        raise ValueError(f"broadcast_params: src={src} is not a rank of the group (ranks {ranks})")

    def copy(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        y = x.detach().clone(memory_format=torch.contiguous_format)
        dist.broadcast(y, src=src, group=group)
        return y

    return _tree.tree_map(copy, tree)


def _check_group(group: Any, fn: str) -> None:
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"{fn}: group must be a torch.distributed.ProcessGroup (see resolve_group), got {group!r}")


def _wait(x: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for: traced, the collective already inserts its wait; eager, it
    returns an AsyncCollectiveTensor, and this waits for a plain one. The one compiled-or-eager fork of the
    collectives (funcamp.sharding and funcamp._at_use call it too)."""
    from torch.distributed import _functional_collectives as funcol

    return x if torch.compiler.is_compiling() else funcol.wait_tensor(x)


def _sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol

    return _wait(funcol.all_reduce(x, "sum", group))


def mean_gradients(
    grads: T,
    group: dist.ProcessGroup,
    reduce_dtype: torch.dtype | None = None,
    *,
    loss_scale: torch.Tensor | None = None,
) -> T:
    """The mean of ``grads`` over the ranks of ``group``, communicated in ``reduce_dtype``.

    For each floating leaf ``g`` (own dtype ``d``, wire dtype ``w = reduce_dtype or d``), every rank
    sends ``(g * loss_scale) / world_size`` computed in ``d`` and cast to ``w`` if ``w`` is narrower
    than ``d`` (e.g. float32 gradients on a float16 or bfloat16 wire) and ``loss_scale`` is given,
    else ``(g / world_size)`` cast to ``w``; the leaves are packed into one flat bucket per wire dtype,
    summed over the ranks with one functional ``all_reduce`` per bucket, cast back to ``d``, and
    multiplied in ``d`` by ``1 / loss_scale`` (reciprocal computed in float64 and cast to float32, as
    ``torch.amp.GradScaler``) where they were scaled. Every rank gets the same result. Non-floating
    leaves are returned as they are.

    Why this order (the rule; ``tests/test_numerics_parallel.py`` measures it):

    - The loss scale on the wire: ``DistributedDataParallel`` all-reduces the gradients autograd
      produced, which under ``torch.amp.GradScaler`` are the scaled ones; ``GradScaler.unscale_``
      runs after the reduction. Casting unscaled gradients to float16 instead flushes every
      gradient below ``2**-24 * world_size`` to zero and rounds those below ``2**-14`` coarsely (a
      mean gradient of 3e-8 became 0 and 1e-7 became 1.19e-7 on two ranks when funcamp did so).
    - The division before the sum, in ``d`` (float32), as DDP divides each bucket by the world size
      before its all-reduce: a sum of ``world_size`` scaled gradients can overflow float16 where
      their mean does not; dividing first cannot overflow where every rank's scaled gradient fits
      the wire (as with float16 compute, where a larger one overflows in the backward already). It costs
      ``log2(world_size)`` bits at the bottom of the range, which a dynamic loss scale wins back: it
      backs off only when the wire overflows, so it settles about ``world_size`` times higher.
      Dividing in float32 rounds once, where ``fp16_compress_hook`` casts to float16 and then divides.
    - Overflow on the wire (the loss scale is too high for these gradients) gives ``inf`` (or NaN)
      in the mean on every rank, like an overflow in the backward: the train step's finite check
      then skips the step on all ranks and a :class:`funcamp.DynamicLossScale` backs off, exactly as
      ``GradScaler`` finds the ``inf`` in the reduced gradients.
    - With ``w`` as wide as ``d`` (the default ``reduce_dtype``, the parameters' dtype) nothing is
      scaled: the result is bitwise what it was without ``loss_scale``.

    Traceable by ``torch.compile`` (no graph break, no host sync; ``loss_scale`` is used as a tensor,
    so a changing scale does not recompile); every rank must call it with trees of the same
    structure, shapes and dtypes.

    Args:
      grads: a pytree of gradients (in the train step: the unscaled float32 gradients, the mean
        over micro-batches; also used there for floating buffers such as BatchNorm running
        statistics, with ``reduce_dtype=None`` and no ``loss_scale``).
      group: the process group (:func:`resolve_group`).
      reduce_dtype: the dtype on the wire (``Policy.reduce_dtype``); None keeps each leaf's dtype.
      loss_scale: the loss scale the gradients were computed with, a 0-d float32 tensor (the
        train step passes ``state.loss_scale.loss_scale``); None (or a :class:`funcamp.NoOpLossScale`
        run) sends the gradients unscaled.
    Returns:
      A tree like ``grads``: same structure, shapes, dtypes and devices; a leaf is ``inf`` or NaN
      where its scaled share overflowed ``reduce_dtype``.
    Raises:
      TypeError: if ``group`` is not a ProcessGroup, ``reduce_dtype`` not a floating dtype, or
        ``loss_scale`` not a 0-d float32 tensor.
    References:
      ``torch.nn.parallel.DistributedDataParallel`` (gradient division before the all-reduce) and
      ``torch.amp.GradScaler`` (``unscale_`` after it); Micikevicius et al. 2018, "Mixed Precision
      Training", arXiv:1710.03740.
    """
    _check_wire_args("mean_gradients", reduce_dtype, loss_scale)
    _check_group(group, "mean_gradients")
    leaves, spec = _tree.tree_flatten(grads)
    world = group.size()
    buckets: dict[torch.dtype, list[int]] = {}
    for i, x in enumerate(leaves):
        if _tree.is_floating(x):
            buckets.setdefault(reduce_dtype or x.dtype, []).append(i)
    inv = None if loss_scale is None else torch.reciprocal(loss_scale.double()).float()
    out = list(leaves)
    for dtype, idx in buckets.items():
        scaled = [loss_scale is not None and dtype.itemsize < leaves[i].dtype.itemsize for i in idx]
        flat = torch.cat([_share(leaves[i], loss_scale if s else None, world, dtype) for i, s in zip(idx, scaled)])
        parts = _sum(flat, group).split([leaves[i].numel() for i in idx])
        for i, s, part in zip(idx, scaled, parts):
            mean = part.view(leaves[i].shape).to(leaves[i].dtype)
            out[i] = mean * inv if s else mean
    return _tree.tree_unflatten(spec, out)


def _attribute(path: str) -> str:
    return path.rpartition(".")[2]


def warn_undeclared_reductions(buffers: Any, reductions: Any, fn: str) -> list[str]:
    """Host side, once per step: warn (``FutureWarning``) for each floating buffer whose reduction over ranks
    comes from the deprecated name table (:func:`register_buffer_reduction`, and funcamp.fp8's names for
    states made without ``buffer_reductions=``) rather than from the state; returns their dotted names.

    The table still decides for them (max or min, not the mean), as before; the warning says what to pass.
    """
    import warnings

    declared = dict(reductions or ())
    paths = _tree.tree_paths(buffers)
    leaves = _tree.tree_leaves(buffers)
    names = [
        p
        for p, x in zip(paths, leaves)
        if _tree.is_floating(x) and p not in declared and _attribute(p) in _BUFFER_REDUCTIONS
    ]
    if names:
        warnings.warn(
            f"{fn}: the state does not say how to reduce the buffers {names[:4]}{' ...' if len(names) > 4 else ''} "
            "over the ranks, so the deprecated name table decides (max for amax histories, min for scales); pass "
            "buffer_reductions=apply_fn.buffer_reductions (from funcamp.nn.functionalize) to TrainState.create",
            FutureWarning,
            stacklevel=3,
        )
    return names


def _max(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol

    return _wait(funcol.all_reduce(x, "max", group))


def reduce_buffers(buffers: T, group: dist.ProcessGroup, *, reductions: Any = None) -> T:
    """Model buffers after a data-parallel step, the same on every rank: fp8 amaxes max-reduced, the rest averaged.

    Floating buffers named in ``reductions`` (their dotted path in ``buffers`` -> ``"max"`` or ``"min"``: the
    state's ``buffer_reductions``, declared by the modules that own them) take the elementwise maximum or
    minimum over the ranks of ``group``; so do those whose last name part was registered with the
    deprecated :func:`register_buffer_reduction` (and funcamp.fp8's, for states made without
    ``buffer_reductions``); every other
    floating buffer (BatchNorm running statistics) takes the mean, as :func:`mean_gradients` with no
    ``reduce_dtype``; non-floating leaves (``num_batches_tracked``) are returned as they are. A
    buffer's name is the last part of its dotted path in ``buffers`` (:func:`funcamp.nn.functionalize`'s
    names). The max and min buffers travel in one ``all_reduce(max)`` per dtype (a minimum is the
    maximum of the negated values, exact), the mean ones in one ``all_reduce(sum)`` per dtype.

    fp8 delayed scaling (:mod:`funcamp.fp8` registers its buffers): the amax histories take the
    maximum over ranks, as TransformerEngine reduces its amaxes (``reduce_amax``), so every rank casts
    with the same scale and none saturates because another rank's activations were smaller; the scales
    take the minimum, which is the scale of the largest amax (the scale ``fp8_max / (a * 2**margin)``
    falls as ``a`` grows, power-of-two rounding included), so the state equals what one update from the
    max-reduced amaxes gives. One exception: a rank whose tensor had amax 0 (all zeros) keeps its old
    scale, as the recipe does, and if that old scale is below the one the other ranks' amax gives, the
    minimum keeps it (a smaller scale: no overflow, coarser values) until the next step's update from
    the reduced history. The reduction runs once per step, after all micro-batches: within a step
    each rank casts with its own state, as gradient accumulation leaves it.

    Traceable by ``torch.compile`` (functional collectives, no host sync); every rank must call it
    with trees of the same structure, shapes and dtypes. The train step calls it on the new buffers
    before it keeps or drops them, so a skipped step still keeps the old buffers on every rank.

    Args:
      buffers: a pytree of buffers (the flat dict ``functionalize`` returns), or ``()``.
      group: the process group (:func:`resolve_group`).
      reductions: None, or a mapping (or ``(name, reduction)`` pairs) of dotted buffer names to ``"max"`` or
        ``"min"``.
    Returns:
      A tree like ``buffers``: same structure, shapes, dtypes and devices, new tensors.
    Raises:
      TypeError: if ``group`` is not a ProcessGroup.
    References:
      NVIDIA TransformerEngine ``recipe.DelayedScaling`` (``reduce_amax``, amax reduction over the
      data-parallel group before the scale update).
    """
    _check_group(group, "reduce_buffers")
    leaves, spec = _tree.tree_flatten(buffers)
    declared = dict(reductions or ())
    paths = _tree.tree_paths(buffers)
    out = list(leaves)
    mean_idx, extreme = [], {}  # extreme: dtype -> [(index, sign)], sign -1 for a minimum
    for i, (path, x) in enumerate(zip(paths, leaves)):
        if not _tree.is_floating(x):
            continue
        reduction = declared.get(path) or _BUFFER_REDUCTIONS.get(_attribute(path))
        if reduction is None:
            mean_idx.append(i)
        else:
            extreme.setdefault(x.dtype, []).append((i, 1.0 if reduction == "max" else -1.0))
    if mean_idx:
        for i, mean in zip(mean_idx, mean_gradients([leaves[i] for i in mean_idx], group)):
            out[i] = mean
    for idx in extreme.values():
        flat = torch.cat([(leaves[i] * sign).reshape(-1) for i, sign in idx])
        parts = _max(flat, group).split([leaves[i].numel() for i, _ in idx])
        for (i, sign), part in zip(idx, parts):
            out[i] = part.view(leaves[i].shape) * sign
    return _tree.tree_unflatten(spec, out)


def _check_wire_args(fn: str, reduce_dtype: Any, loss_scale: Any) -> None:
    """Refuse a ``reduce_dtype`` that is not None or a floating dtype, and a ``loss_scale`` that is not None
    or a 0-d float32 tensor (the arguments of :func:`mean_gradients` and of the sharded reduce-scatter)."""
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
        raise TypeError(f"{fn}: reduce_dtype must be None or a floating torch.dtype, got {reduce_dtype!r}")
    if loss_scale is not None and not (
        isinstance(loss_scale, torch.Tensor) and loss_scale.dtype == torch.float32 and loss_scale.ndim == 0
    ):
        raise TypeError(
            f"{fn}: loss_scale must be None or a 0-d float32 tensor (a LossScale's .loss_scale), got {loss_scale!r}"
        )


def _share(g: torch.Tensor, scale: torch.Tensor | None, world: int, wire: torch.dtype) -> torch.Tensor:
    """This rank's flat contribution to the sum: ``g`` (times ``scale``), divided by ``world``, in ``wire``."""
    x = g if scale is None else g * scale
    return (x / world).to(wire).reshape(-1)


def reduce_bytes(grads: Any, reduce_dtype: torch.dtype | None = None) -> int:
    """Bytes each rank puts into the gradient all-reduce of one step, for gradients shaped like ``grads``.

    The payload of :func:`mean_gradients`: ``numel * itemsize`` of ``reduce_dtype`` (or each leaf's
    own dtype) summed over the floating leaves. A ring all-reduce sends about twice this per rank.
    Computed from shapes and dtypes only (no copy, no communication).

    Example:
      >>> g = {"w": torch.zeros(10, 10), "b": torch.zeros(10)}
      >>> reduce_bytes(g), reduce_bytes(g, torch.bfloat16)
      (440, 220)
    """
    return sum(x.numel() * (reduce_dtype or x.dtype).itemsize for x in _tree.tree_leaves(grads) if _tree.is_floating(x))


def all_ranks_true(flag: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Whether ``flag`` is true on every rank of ``group``: one int32 all-reduce, no host sync.

    Args:
      flag: a 0-d bool tensor (e.g. this rank's ``grads_finite``).
      group: the process group.
    Returns:
      A 0-d bool tensor on ``flag``'s device, the same on every rank.
    Raises:
      TypeError: if ``flag`` is not a bool tensor or ``group`` not a ProcessGroup.
      ValueError: if ``flag`` is not 0-d.
    """
    if not isinstance(flag, torch.Tensor) or flag.dtype != torch.bool:
        raise TypeError(f"all_ranks_true: flag must be a 0-d torch.bool tensor, got {flag!r}")
    if flag.ndim != 0:
        raise ValueError(f"all_ranks_true: flag must be 0-d, got shape {tuple(flag.shape)}")
    _check_group(group, "all_ranks_true")
    return _sum((~flag).to(torch.int32), group) == 0


def mean_over_ranks(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The mean of the floating tensor ``x`` over the ranks of ``group`` (e.g. the loss), in ``x``'s dtype.

    Raises:
      TypeError: if ``x`` is not a floating tensor or ``group`` not a ProcessGroup.
    """
    return _checked_sum(x, group, "mean_over_ranks") / group.size()


def sum_over_ranks(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of the floating tensor ``x`` over the ranks of ``group``, in ``x``'s dtype (one ``all_reduce``).

    The train step sums :class:`funcamp.LossSum` totals and counts with it (float64), no host sync.

    Raises:
      TypeError: if ``x`` is not a floating tensor or ``group`` not a ProcessGroup.
    """
    return _checked_sum(x, group, "sum_over_ranks")


def _checked_sum(x: torch.Tensor, group: dist.ProcessGroup, fn: str) -> torch.Tensor:
    if not _tree.is_floating(x):
        raise TypeError(f"{fn}: x must be a floating tensor, got {x!r}")
    _check_group(group, fn)
    return _sum(x, group)
