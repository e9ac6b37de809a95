"""Mixed-precision gradients: scale the loss, differentiate, unscale in float32, check, cast back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as torch_pytree

from funcamp import _tree, passes
from funcamp._tree import _fast
from funcamp.loss_scale import LossScale

__all__ = ["GradAndValue", "grad_and_value"]


class GradAndValue(NamedTuple):
    """What :func:`grad_and_value` returns.

    Attributes:
      grads: gradients with the structure of the differentiated argument(s), each leaf in the dtype
        of the parameter it belongs to.
      value: the unscaled loss (``(loss, aux)`` with ``has_aux=True``), as ``fun`` returned it.
      grads_finite: 0-d bool tensor on the parameters' device; False if any gradient element (or the
        loss) is NaN or infinite.
    """

    grads: Any
    value: Any
    grads_finite: torch.Tensor


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"grad_and_value: fun must return a 0-d floating tensor (or (loss, aux) with has_aux=True), "
            f"got {type(loss).__name__}"
        )
    if not loss.is_floating_point():
        raise TypeError(f"grad_and_value: the loss must be a floating tensor, got dtype {loss.dtype}")
    if loss.ndim != 0:
        raise ValueError(
            f"grad_and_value: the loss must be 0-d (reduce it, e.g. with .mean()), got shape {tuple(loss.shape)}"
        )


def _check_differentiable(args: tuple[Any, ...], argnums: int | tuple[int, ...]) -> None:
    nums = (argnums,) if isinstance(argnums, int) else argnums
    for n in nums:
        if not -len(args) <= n < len(args):
            raise ValueError(f"grad_and_value: argnums={argnums} but only {len(args)} positional arguments given")
        bad = _tree.first_non_floating(args[n])
        if bad is not None:
            raise TypeError(
                f"grad_and_value: argument {n} is differentiated, so every leaf must be a floating tensor; "
                f"leaf {bad[0]!r} is {bad[1]}. Pass integer or frozen tensors in another argument."
            )


def _check_arguments(fun: Any, loss_scale: Any, argnums: Any) -> None:
    if not callable(fun):
        raise TypeError(f"grad_and_value: fun must be callable, got {type(fun).__name__}")
    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            "grad_and_value: loss_scale must be a funcamp loss scale (NoOpLossScale, StaticLossScale, "
            f"DynamicLossScale), got {type(loss_scale).__name__}; wrap a number, e.g. funcamp.StaticLossScale(1024.0)"
        )
    nums = argnums if isinstance(argnums, tuple) and argnums else (argnums,)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in nums):
        raise TypeError(f"grad_and_value: argnums must be an int or a non-empty tuple of ints, got {argnums!r}")


def _call_without_autocast(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fun`` with any enclosing CPU/CUDA autocast region switched off (the policy decides)."""
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return _call_without_autocast(fun, *args, **kwargs)
    if torch.is_autocast_enabled("cuda"):
        with torch.autocast("cuda", enabled=False):
            return _call_without_autocast(fun, *args, **kwargs)
    return fun(*args, **kwargs)


def scaled_grad_and_value(
    fun: Callable[..., Any],
    loss_scale: LossScale,
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    route: _Route | None = None,
) -> Callable[..., tuple[Any, Any]]:
    """Like :func:`grad_and_value`, without the final cast and check: gradients stay unscaled float32.

    Used by the train step to accumulate micro-batches (and reduce them over ranks) in float32.
    Returns ``fn(*args, **kwargs) -> (grads32, value)``: every floating gradient leaf is float32
    (float64 stays float64), whatever the parameter's dtype and also with a
    :class:`funcamp.NoOpLossScale`, so that a sum of many bfloat16 or float16 gradients is not
    rounded to 8 or 11 bits at every term (``torch.amp`` keeps ``.grad`` in the parameter's dtype;
    funcamp casts to it once, after the sum).

    ``route`` differentiates (:data:`_Route`): default :func:`_func_route` (``torch.func``'s semantics); the
    compiled train step passes :func:`_autograd_route` (see :mod:`funcamp._dynamo_autograd`).
    """
    unscaled = _unscaled_grad_and_value(fun, loss_scale, argnums=argnums, has_aux=has_aux, route=route or _func_route)

    def fn(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        grads, value = unscaled(*args, **kwargs)
        return _at_least_float32(grads), value

    return fn


def _at_least_float32(tree: Any) -> Any:
    """Floating leaves narrower than float32 cast to float32 (a sparse one coalesced first, in its own dtype:
    :func:`funcamp._tree.widened`); float32 and float64 leaves as they are (no copy)."""
    if _fast.traced():  # plain floating tensors, none narrower than float32: the tree as it is (dtypes asked once)
        kinds = _fast.dtypes(_tree.tree_leaves(tree))
        if kinds is not None and _fast.all_floating(kinds, wide=True):
            return tree
    return _tree.tree_map(
        lambda g: _tree.widened(g, torch.float32) if _tree.is_floating(g) and g.dtype.itemsize < 4 else g, tree
    )


def _unscaled_grad_and_value(
    fun: Callable[..., Any],
    loss_scale: LossScale,
    *,
    argnums: int | tuple[int, ...],
    has_aux: bool,
    route: _Route,
) -> Callable[..., tuple[Any, Any]]:
    """``fn(*args, **kwargs) -> (grads, value)``: the gradients of the scaled loss, unscaled, differentiated by
    ``route``.

    Unscaled in float32 by a loss scale; as autograd gave them (the parameters' dtypes) with a
    :class:`funcamp.NoOpLossScale`, so that :func:`grad_and_value` makes no float32 copy there.
    """

    def scaled(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        with passes.phase("forward"):  # compiling: tags for funcamp.passes' recompute
            out = fun(*args, **kwargs)
        if has_aux:
            if not isinstance(out, tuple) or len(out) != 2:
                raise TypeError("grad_and_value: with has_aux=True, fun must return a (loss, aux) tuple")
            loss, aux = out
        else:
            loss, aux = out, None
        _check_loss(loss)
        return loss_scale.scale(loss), ((loss, aux) if has_aux else loss)

    _check_arguments(fun, loss_scale, argnums)
    run = route(scaled, argnums)

    def fn(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        _check_differentiable(args, argnums)
        with passes.phase("backward"):  # the forward inside is tagged "forward" again
            grads, (_, value) = _call_without_autocast(run, *args, **kwargs)
        return loss_scale.unscale(grads), value

    return fn


#: How a gradient is taken: ``route(fun, argnums) -> fn``, where ``fun(*args, **kwargs) -> (out, aux)`` (``out`` a
#: 0-d tensor) and ``fn(*args, **kwargs) -> (grads, (out, aux))`` is ``torch.func.grad_and_value(fun, argnums,
#: has_aux=True)``'s contract: gradients with the structure of the differentiated argument(s), zeros where
#: ``out`` does not depend on a leaf, ``out`` and ``aux`` detached.
_Route = Callable[[Callable[..., tuple[torch.Tensor, Any]], "int | tuple[int, ...]"], Callable[..., tuple[Any, Any]]]


def _func_route(
    fun: Callable[..., tuple[torch.Tensor, Any]], argnums: int | tuple[int, ...]
) -> Callable[..., tuple[Any, tuple[torch.Tensor, Any]]]:
    """The public route, ``torch.func.grad_and_value``'s semantics: it composes with ``vmap``, ``jacrev`` and an
    outer ``torch.func.grad``; eager calls outside any transform run on plain ``torch.autograd.grad``, at a
    lower peak memory (:func:`_autograd_grad_and_value`). The two agree in float32; in half precision they can
    differ where torch's autograd kernel computes a backward in float32 and ``torch.func``'s decomposition rounds
    at each op (SiLU's backward in bfloat16: 7.4e-3 of the largest element on random inputs; docs/module.md).

    Inside ``torch.compile`` it is ``torch.func.grad_and_value``: on torch 2.13 that differentiates the
    *forward* of a custom ``torch.autograd.Function`` applied directly to a differentiated input, silently
    (pytorch/pytorch#193279); the compiled train step uses :func:`_autograd_route` instead.
    """
    inner = torch.func.grad_and_value(fun, argnums=argnums, has_aux=True)
    eager = _autograd_grad_and_value(fun, argnums)

    def run(*args: Any, **kwargs: Any) -> tuple[Any, tuple[torch.Tensor, Any]]:
        return (eager if _plain_autograd_suffices(args, kwargs) else inner)(*args, **kwargs)

    return run


def _autograd_route(
    fun: Callable[..., tuple[torch.Tensor, Any]], argnums: int | tuple[int, ...]
) -> Callable[..., tuple[Any, tuple[torch.Tensor, Any]]]:
    """Always plain ``torch.autograd.grad`` on detached copies of the differentiated inputs: every custom
    ``torch.autograd.Function``'s backward is used, wherever it is applied. Under ``torch.compile`` Dynamo
    traces it only with ``torch._dynamo.config.trace_autograd_ops`` set (:mod:`funcamp._dynamo_autograd`
    compiles with it); it does not compose with an enclosing ``torch.func`` transform (the differentiated
    inputs are detached from it)."""
    return _autograd_grad_and_value(fun, argnums)


def _plain_autograd_suffices(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Not traced by Dynamo, outside any torch.func transform, and no input is part of an outer autograd graph.

    The route fork, named: torch.func where Dynamo traces (a ``grad_and_value`` under the user's own
    ``torch.compile``) or a transform encloses the call, plain autograd elsewhere. A step that
    ``funcamp.train.assemble`` built compiled never asks (its plan gives the stages the traced-autograd route,
    ``funcamp._dynamo_autograd.route``, as it does under ``funcamp.capture.check``, whose ``make_fx`` trace is
    not Dynamo's). It asks Dynamo itself, not :func:`funcamp._scope.compiling`: the question is which
    differentiation the tracer in use can trace."""
    if torch.compiler.is_dynamo_compiling() or torch._C._functorch.maybe_current_level() is not None:
        return False
    return not any(isinstance(x, torch.Tensor) and x.requires_grad for x in torch_pytree.tree_leaves((args, kwargs)))


def _autograd_grad_and_value(
    fun: Callable[..., tuple[torch.Tensor, Any]], argnums: int | tuple[int, ...]
) -> Callable[..., tuple[Any, tuple[torch.Tensor, Any]]]:
    """``torch.func.grad_and_value(fun, argnums, has_aux=True)`` on plain ``torch.autograd.grad``.

    Gradients with ``torch.func``'s structure (zeros for inputs the loss does not use; values as
    :func:`_func_route` says), the output and aux detached; for eager
    calls (see :func:`_plain_autograd_suffices`), and traced by Dynamo for the compiled train step
    (:func:`_autograd_route`). ``torch.func`` differentiates with
    ``create_graph=True`` so that transforms nest, which keeps the backward's intermediates alive: in eager
    mode that cost 1.5-1.7x the peak memory of ``loss.backward()`` on a GPT (benchmarks/bench_train_step.py).
    Inputs are walked with ``torch.utils._pytree``, as ``torch.func`` walks them.
    """
    nums = (argnums,) if isinstance(argnums, int) else argnums

    def run(*args: Any, **kwargs: Any) -> tuple[Any, tuple[torch.Tensor, Any]]:
        args, inputs = list(args), []
        for n in nums:
            leaves, rebuild = _flatten(args[n], n)
            # by map (Dynamo runs it itself): no traced frame per leaf
            leaves = list(map(torch.Tensor.requires_grad_, map(torch.Tensor.detach, leaves)))
            args[n] = rebuild(leaves)
            inputs.append((leaves, rebuild))
        with torch.enable_grad():
            out, aux = fun(*args, **kwargs)
        flat = [x for leaves, _ in inputs for x in leaves]
        found = torch.autograd.grad(out, flat, allow_unused=True) if out.requires_grad else [None] * len(flat)
        found = [torch.zeros_like(x) if g is None else g for g, x in zip(found, flat)]
        trees, i = [], 0
        for leaves, rebuild in inputs:
            trees.append(rebuild(found[i : i + len(leaves)]))
            i += len(leaves)
        detached = torch_pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, (out, aux))
        return (trees[0] if isinstance(argnums, int) else tuple(trees)), detached

    return run


def _flatten(tree: Any, n: int) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """``(leaves, rebuild)`` of a differentiated argument, walked with ``torch.utils._pytree``; while a compiled
    step traces, a tree of plain containers is walked by :mod:`funcamp._tree`'s fast path instead (the same
    tree rebuilt; torch's pytree under Dynamo is its Python polyfill, 27k traced bytecodes on GPT-2's 148
    parameters). The fast walk is taken only where torch's pytree has the same leaves
    (:func:`funcamp._tree.flatten_as_torch`: a ``None`` or a funcamp dataclass is a leaf there, on which the eager
    step fails, and so must the compiled one).

    Raises:
      TypeError: if a leaf is None (funcamp's trees take it for an absent entry, autograd cannot differentiate it:
        it failed inside with a bare AttributeError); the message names the entry of argument ``n``."""
    fast = _tree.flatten_as_torch(tree)
    if fast is not None:
        return fast
    leaves, spec = torch_pytree.tree_flatten(tree)
    if any(x is None for x in leaves):
        path = next(p for p, x in torch_pytree.tree_flatten_with_path(tree)[0] if x is None)
        raise TypeError(
            f"grad_and_value: argument {n} is differentiated, and its entry {torch_pytree.keystr(path)!r} is None, "
            "which torch.func cannot differentiate; leave the entry out of the tree (or pass it in another argument)"
        )
    return leaves, lambda new: torch_pytree.tree_unflatten(new, spec)


def _like_params(grads: Any, args: tuple[Any, ...], argnums: int | tuple[int, ...]) -> Any:
    params = args[argnums] if isinstance(argnums, int) else tuple(args[n] for n in argnums)
    return _tree.tree_map(lambda g, p: g.to(p.dtype), grads, params)


def grad_and_value(
    fun: Callable[..., Any],
    loss_scale: LossScale,
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
) -> Callable[..., GradAndValue]:
    """Mixed-precision ``torch.func.grad_and_value``: gradients of a scaled loss, unscaled and checked.

    The returned function calls ``fun``, multiplies its loss by ``loss_scale`` in float32,
    differentiates with ``torch.func.grad_and_value``, unscales the gradients in float32 (reciprocal
    in float64, as ``torch.amp.GradScaler``), casts each to the dtype of the parameter it belongs to
    and checks them all for NaN and infinity. No host sync; traceable by ``torch.compile(fullgraph=True)``.

    Casting the computation is ``fun``'s business (a :class:`funcamp.Policy` or ``funcamp.nn``); an
    enclosing ``torch.autocast`` region is switched off inside ``fun``, so the result is the same with
    and without one. Unlike ``GradScaler``, nothing is mutated and nothing is skipped here: the caller
    decides what to do with ``grads_finite`` (see :func:`funcamp.make_train_step`).

    Args:
      fun: ``fun(*args, **kwargs) -> loss`` (or ``(loss, aux)`` with ``has_aux``), ``loss`` a 0-d
        floating tensor.
      loss_scale: the loss scale to use (its ``loss_scale`` is a 0-d float32 tensor).
      argnums: which positional argument(s) to differentiate, as ``torch.func``; every leaf of those
        arguments must be a floating tensor.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
    Returns:
      A function returning :class:`GradAndValue` ``(grads, value, grads_finite)``: ``grads`` has the
      structure and dtypes of the differentiated argument(s), ``value`` is the unscaled loss (with
      aux), ``grads_finite`` a 0-d bool tensor, False if a gradient or the loss is not finite.
    Raises:
      TypeError: if ``fun`` returns a non-tensor or a non-floating loss, if ``has_aux`` is set and
        ``fun`` does not return a pair, or if a differentiated leaf is not a floating tensor.
      TypeError: if ``fun`` is not callable, ``loss_scale`` is not a funcamp loss scale, or
        ``argnums`` is not an int or a non-empty tuple of ints.
      ValueError: if the loss is not 0-d, or ``argnums`` names a missing argument.
    References:
      Micikevicius et al. 2018, "Mixed Precision Training", arXiv:1710.03740.

    Example:
      >>> from funcamp import StaticLossScale
      >>> params = {"w": torch.tensor([3.0, 4.0])}
      >>> loss_fn = lambda p, x: (p["w"].half() * x).sum()
      >>> x = torch.ones(2, dtype=torch.float16)
      >>> out = grad_and_value(loss_fn, StaticLossScale(2.0**10))(params, x)
      >>> out.grads["w"], out.value, out.grads_finite
      (tensor([1., 1.]), tensor(7., dtype=torch.float16), tensor(True))
    """
    scaled = _unscaled_grad_and_value(fun, loss_scale, argnums=argnums, has_aux=has_aux, route=_func_route)

    def fn(*args: Any, **kwargs: Any) -> GradAndValue:
        grads32, value = scaled(*args, **kwargs)
        grads = _like_params(grads32, args, argnums)
        loss = value[0] if has_aux else value
        return GradAndValue(grads, value, _tree.all_finite(grads) & torch.isfinite(loss).to(torch.bool))

    return fn
