"""``torch.utils.checkpoint`` inside ``apply_fn``: recompute with the tensors of the call that saved.

``apply_fn`` runs your module's forward on a structural copy whose parameters and buffers are
placeholders: the call's buffers are swapped in by ``torch.func.functional_call``, and each module
makes its parameters' forward tensors from the call's ``params`` where it runs (:mod:`funcamp.nn._use`);
all are swapped out again when the forward returns. Activation checkpointing recomputes a region
*later*, in the backward pass, by calling the region's function again: on its own it would find the
placeholders. This module makes the recompute see what the forward saw:

- Non-reentrant checkpoints (``use_reentrant=False``, ``checkpoint_sequential``, Hugging Face's
  ``gradient_checkpointing_enable()``): a checkpoint taken inside ``apply_fn`` records the call's
  tensors, and its recompute runs with them swapped in again, buffers as they were when the region
  began in the forward (in fresh copies, so running statistics are not updated twice): a module run
  more than once in one forward, such as an fp8 layer whose delayed-scaling state advances at each
  call, is recomputed with the state each call saw. The gradients are those of the same model
  without checkpointing, bitwise.
- Reentrant checkpoints (``use_reentrant=True``) cannot work with ``torch.autograd.grad`` or
  ``torch.func`` (which funcamp differentiates with: torch refuses ``.grad()`` there), so inside
  ``apply_fn`` they run as non-reentrant ones: the same gradients, and no lost parameter gradients
  when no input requires grad (the reentrant variant's known pitfall).
- Under ``torch.func`` gradient transforms (``torch.func.grad``, ``vjp``, a compiled
  :func:`funcamp.grad_and_value`, eager calls nested in another transform) torch 2.13 cannot
  checkpoint at all: saved-tensor hooks are disabled there, and ``torch.utils.checkpoint`` raises
  "torch.func transforms don't yet support saved tensor hooks". There the region runs without
  recomputation (the same gradients; its activations are kept, so no memory is saved) and a
  :class:`RematInactiveWarning` says so once. The compiled train step differentiates with traced
  ``torch.autograd.grad`` (:mod:`funcamp._dynamo_autograd`): Dynamo traces the region as is, with
  no warning, and its activations are kept there too.

How: the first ``functionalize`` call wraps two private entry points of ``torch.utils.checkpoint``
(``_checkpoint_without_reentrant_generator`` and ``CheckpointFunction``; both are looked up at call
time, so ``from torch.utils.checkpoint import checkpoint`` in your model is covered). Outside
``apply_fn`` they behave as torch's own, except where torch would raise the saved-tensor-hooks error
above.

``functionalize(..., remat=...)`` checkpoints chosen modules without editing the model
(:func:`select` chooses them, :func:`wrap_forward` routes each one's forward, on the internal copy,
through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``), as FSDP's
``apply_activation_checkpointing(model, check_fn=...)`` and flax's ``nn.remat`` do; :class:`Remat` adds an
activation memory budget for the compiled step.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import functools
import math
import numbers
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from funcamp import _scope, passes

__all__ = ["Remat", "RematBudgetWarning", "RematInactiveWarning"]

#: The modules ``functionalize(..., remat=...)`` checkpoints: an ``nn.Module`` subclass; an fnmatch pattern of
#: qualified module names; a list mixing the two; or a predicate ``(name, module) -> bool``.
Modules = type | str | Iterable[type | str] | Callable[[str, nn.Module], bool]


@dataclasses.dataclass(frozen=True)
class Remat:
    """``functionalize(..., remat=Remat(modules, budget=...))``: checkpoint ``modules``, keeping a fraction of
    their activations (an activation memory budget, as ``torch._functorch.config.activation_memory_budget``).

    ``modules`` is anything ``remat=`` takes (a module type, an fnmatch pattern of qualified names, a list of
    those, a predicate ``(name, module) -> bool``); ``remat=Block`` is ``Remat(Block)``, budget 0.

    ``budget`` is the fraction of the bytes that the chosen modules' recomputed nodes would keep for the
    backward without remat that may still be kept, in ``[0, 1]``: ``0.0`` recomputes every one of them (the
    most memory saved, the default), ``1.0`` keeps them all (no memory saved, nothing recomputed). In the
    compiled step (inductor, :class:`funcamp.passes.RematPass`) the backward-read values of all regions of
    one budget are ranked by recompute cost per byte (matmul, convolution and attention FLOPs; other ops one
    per output element; a view's bytes counted on its base, and a view kept with it), and the costliest per
    byte are kept, in that order, while their bytes stay within ``budget`` times the total; the rest are
    recomputed from what is kept. Eager (``torch.utils.checkpoint``) has no such choice: a budget below 1
    recomputes the whole module, ``1.0`` runs it as is (nothing recomputed). The budget is a constant of the
    traced graph (a tag on the region's nodes): it never recompiles. Gradients are bitwise those without remat
    at every budget eagerly and, compiled, with float32 compute; with bfloat16 compute inductor's fused kernels
    round at other points when values are recomputed (the last digits can differ). Eager runs of a budget
    between 0 and 1 warn once (:class:`RematBudgetWarning`). There is no ``remat="auto"``: choosing a budget
    automatically needs a memory target (a device's capacity, less what else the step holds) that the graph
    pass does not know.

    Example:
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
      >>> from funcamp.nn import functionalize
      >>> apply_fn, params = functionalize(model, "float32", remat=Remat(torch.nn.Linear, budget=0.5))
      >>> apply_fn.remat
      ('0', '2')

    Raises:
      TypeError: if ``budget`` is not a real number (a bool is not), or ``modules`` is itself a ``Remat``
        or ``None``.
      ValueError: if ``budget`` is NaN or outside ``[0, 1]``.
    """

    modules: Modules
    budget: float = 0.0

    def __post_init__(self) -> None:
        budget = self.budget
        if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
            raise TypeError(
                f"Remat: budget must be a real number in [0, 1] (0.0 recomputes everything, 1.0 keeps every "
                f"activation); got {budget!r} ({type(budget).__name__})"
            )
        if math.isnan(budget) or not 0.0 <= budget <= 1.0:
            raise ValueError(
                f"Remat: budget must be in [0, 1] (the fraction of the activation bytes kept: 0.0 recomputes "
                f"everything, 1.0 keeps every activation); got {budget!r}"
            )
        if self.modules is None or isinstance(self.modules, Remat):
            raise TypeError(
                f"Remat: modules must be an nn.Module subclass, an fnmatch pattern of module names, a list of "
                f"those, or a predicate (name, module) -> bool; got {type(self.modules).__name__}"
            )
        object.__setattr__(self, "budget", float(budget))


#: A value of ``functionalize(..., remat=...)``: ``None``, a :data:`Modules` value (budget 0) or a :class:`Remat`.
RematLike = Modules | Remat | None


class RematBudgetWarning(UserWarning):
    """A :class:`Remat` budget between 0 and 1 ran eagerly, where the whole module is recomputed (as budget 0)."""


class RematInactiveWarning(UserWarning):
    """A checkpointed region ran without recomputation (torch.func transforms cannot checkpoint)."""


class Call:
    """What a recompute needs from one ``apply_fn`` call: the module copy and the tensors it ran with.

    ``params`` makes the call's trainable tensors current again (a context): the recomputed modules make
    their parameters' forward tensors from them, as the forward did (:mod:`funcamp.nn._use`); buffers are
    re-made by ``make_buffers`` at each recompute, in fresh copies: from ``buffers`` (the caller's, never
    written) as the call began, or, for a region that began later in the forward, as they were then
    (:meth:`region`). ``start`` holds the buffers bound when this run of the forward (or of a
    recompute) began, with their version counters, to see which ones the run has changed so far.
    """

    def __init__(
        self,
        skeleton: nn.Module,
        params: Callable[[], contextlib.AbstractContextManager[Any]],
        make_buffers: Callable[[], Mapping[str, torch.Tensor]],
        mode: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        start: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.skeleton = skeleton
        self.params = params
        self.make_buffers = make_buffers
        self.mode = mode  # the call's per-op precision (funcamp.ops.OpPolicies), re-entered to recompute
        self.start = {name: (t, t._version) for name, t in (start or {}).items()}

    def region(self) -> Call:
        """This call as a checkpointed region starting now must see it again when it is recomputed.

        Buffers the forward has changed so far are taken as they are now: a reassigned one (the fp8
        delayed state of a layer called before in this forward) by reference, a written one (running
        statistics) as a copy, since later calls write it again. The recompute gets fresh copies of
        those, and the others from ``make_buffers`` as before. Without this, the recompute of a layer's
        second call would see the state of the call's start, the one its first call saw
        (TransformerEngine's rule: recompute with the forward's own scales).
        """
        held: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (the buffer as the region begins, version)
        copies: dict[int, torch.Tensor] = {}  # a tied buffer (two names, one tensor) stays one tensor
        for name, (tensor, version) in self.start.items():
            now = self.skeleton.get_buffer(name)
            if not isinstance(now, torch.Tensor) or (now is tensor and now._version == version):
                continue
            if now is tensor:
                if id(now) not in copies:
                    copies[id(now)] = now.clone()
                now = copies[id(now)]
            held[name] = (now, now._version)
        if not held:
            return self
        base = self.make_buffers

        def make_buffers() -> dict[str, torch.Tensor]:
            fresh = dict(base())
            again: dict[int, torch.Tensor] = {}
            for name, (tensor, version) in held.items():
                if tensor._version != version:
                    raise RuntimeError(
                        f"funcamp remat: the buffer {name!r} was reassigned in the forward before a checkpointed "
                        "region began and written in place after that, so its recompute cannot see the value the "
                        "region saw; reassign the buffer (module.name = new_tensor) instead of writing it in "
                        "place, or leave the module that writes it out of remat"
                    )
                if id(tensor) not in again:
                    again[id(tensor)] = tensor.clone()
                fresh[name] = again[id(tensor)]
            return fresh

        return Call(self.skeleton, self.params, make_buffers, self.mode)

    @contextlib.contextmanager
    def bound(self) -> Iterator[None]:
        buffers = self.make_buffers()
        # A region nested in this one (recomputed inside it) starts from what this recompute changes.
        token = _CALL.set(Call(self.skeleton, self.params, self.make_buffers, self.mode, buffers))
        try:
            with (
                self.params(),
                _reparametrize_module(self.skeleton, buffers, tie_weights=False, strict=False),
                self.mode(),
            ):
                yield
        finally:
            _CALL.reset(token)


_CALL: contextvars.ContextVar[Call | None] = contextvars.ContextVar("funcamp_nn_call", default=None)


@contextlib.contextmanager
def inside(call: Call) -> Iterator[None]:
    """Mark the forward of one ``apply_fn`` call (eager only: not traced by ``torch.compile``)."""
    token = _CALL.set(call)
    try:
        yield
    finally:
        _CALL.reset(token)


def _hooks_disabled() -> bool:
    return torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is not None


_warned = False


_warned_budget = [False]


def _warn_budget_eager(budget: float) -> None:
    if not _warned_budget[0]:
        _warned_budget[0] = True
        warnings.warn(
            f"funcamp: Remat(..., budget={budget}) ran eagerly (make_train_step(compile=False) or an eager "
            "grad_and_value): torch.utils.checkpoint recomputes a whole module, so the module is recomputed as "
            "at budget 0; the compiled step keeps the fraction. Gradients are unchanged.",
            RematBudgetWarning,
            stacklevel=4,
        )


def _warn_inactive() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "funcamp: a torch.utils.checkpoint region ran without recomputation, because torch.func "
            "gradient transforms (torch.func.grad, a compiled funcamp.grad_and_value) cannot use saved-tensor hooks "
            "in this torch version. Gradients are unchanged; the region's activations are kept. Eager "
            "funcamp.grad_and_value and make_train_step(compile=False) do recompute.",
            RematInactiveWarning,
            stacklevel=4,
        )


def _wrap_generator(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def generator(fn: Callable[..., Any], *rest: Any, **kwargs: Any) -> Iterator[None]:
        if torch.is_grad_enabled() and _hooks_disabled():  # torch would raise here: run the region as is
            _warn_inactive()
            yield
            return
        call = _CALL.get()
        if call is not None:
            inner, region = fn, call.region()  # the buffers as this region begins, for its recompute

            def fn(*args: Any, **kw: Any) -> Any:
                with region.bound():
                    return inner(*args, **kw)

        yield from original(fn, *rest, **kwargs)

    generator._funcamp_original = original  # type: ignore[attr-defined]
    return generator


def _wrap_function(original: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    class CheckpointFunction(original):  # type: ignore[valid-type, misc]
        """torch's reentrant checkpoint; inside funcamp's ``apply_fn`` the non-reentrant one instead."""

        _funcamp_original = original

        @classmethod
        def apply(cls, function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
            if _CALL.get() is None:
                return original.apply(function, preserve_rng_state, *args)
            return torch_checkpoint.checkpoint(
                function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state
            )

    CheckpointFunction.__qualname__ = original.__qualname__
    CheckpointFunction.__module__ = original.__module__
    return CheckpointFunction


_lock = threading.Lock()


def install() -> None:
    """Wrap ``torch.utils.checkpoint``'s two entry points (idempotent, thread-safe); see the module doc."""
    with _lock:
        gen = torch_checkpoint._checkpoint_without_reentrant_generator
        if not hasattr(gen, "_funcamp_original"):
            torch_checkpoint._checkpoint_without_reentrant_generator = _wrap_generator(gen)
        fn = torch_checkpoint.CheckpointFunction
        if not hasattr(fn, "_funcamp_original"):
            torch_checkpoint.CheckpointFunction = _wrap_function(fn)


# --- remat=: checkpoint chosen modules -----------------------------------------------------------------

_ACCEPTED = (
    "remat must be None, an nn.Module subclass (e.g. GPT2Block), an fnmatch pattern of module names (e.g. "
    "'transformer.h.*'), a list of those, a predicate (name, module) -> bool, or funcamp.nn.Remat(one of "
    "those, budget=...)"
)


def _entry_matcher(entry: Any) -> Callable[[str, nn.Module], bool]:
    if isinstance(entry, Remat):
        raise TypeError(
            f"functionalize: a Remat inside a remat list ({entry!r}) is not accepted: one budget per "
            "functionalize; pass Remat([entries...], budget=...) instead"
        )
    if isinstance(entry, str):
        return lambda name, module: fnmatch.fnmatchcase(name, entry)
    if isinstance(entry, type) and issubclass(entry, nn.Module):
        return lambda name, module: isinstance(module, entry)
    raise TypeError(f"functionalize: {_ACCEPTED}; got the entry {entry!r} ({type(entry).__name__})")


def _sample(names: list[str], n: int = 6) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return f"[{shown}{', ...' if len(names) > n else ''}]"


#: Containers without a forward of their own: never candidates (choosing one would skip its children).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def budget(remat: RematLike) -> float:
    """The activation memory budget of a ``remat=`` value: a :class:`Remat`'s, else 0.0 (recompute all)."""
    return remat.budget if isinstance(remat, Remat) else 0.0


def select(module: nn.Module, remat: RematLike) -> list[str]:
    """The qualified names of the submodules ``remat`` chooses, outermost only, in module order.

    Candidates are the submodules (every name, shared modules under each of theirs), never the root
    nor containers without a forward (``ModuleList``, ``ModuleDict``). A module inside a chosen one is
    not chosen again: it is recomputed with its parent.

    Raises:
      TypeError: if ``remat`` or one of its entries is not one of the accepted forms, or the predicate
        returns a non-bool.
      ValueError: if a type or pattern matches no submodule, or the predicate chooses none; if ``remat`` is
        ``"auto"`` (not offered: see :class:`Remat`) and no submodule is named ``auto``.
    """
    if remat is None:
        return []
    if isinstance(remat, Remat):
        remat = remat.modules
    if isinstance(remat, str) and remat == "auto" and not any(n == "auto" for n, _ in module.named_modules()):
        raise ValueError(
            "functionalize: remat='auto' is not offered: an automatic budget needs a memory target the graph pass "
            "does not know (no device capacity on a CPU, none given); choose the modules and a budget, e.g. "
            "remat=funcamp.nn.Remat(Block, budget=0.5) (the fraction of their activation bytes kept), or "
            f"{_ACCEPTED}"
        )
    named = [
        (name, sub)
        for name, sub in module.named_modules(remove_duplicate=False)
        if name and not isinstance(sub, _CONTAINERS)
    ]
    if isinstance(remat, nn.Module):  # callable, but not a predicate
        raise TypeError(
            f"functionalize: {_ACCEPTED}; got a module instance ({type(remat).__name__}): pass its type, or "
            "its name pattern"
        )
    if isinstance(remat, (str, type)):
        entries: list[Any] = [remat]
    elif callable(remat):
        entries = []
    elif isinstance(remat, Iterable) and not isinstance(remat, (bytes, Mapping)):
        entries = list(remat)
        if not entries:
            raise TypeError(f"functionalize: {_ACCEPTED}; got an empty {type(remat).__name__}")
    else:
        raise TypeError(f"functionalize: {_ACCEPTED}; got {type(remat).__name__}")
    names = [name for name, _ in named]
    if entries:
        hits: set[str] = set()
        for entry in entries:
            match = _entry_matcher(entry)
            found = {name for name, sub in named if match(name, sub)}
            if not found:
                what = f"type {entry.__name__}" if isinstance(entry, type) else f"pattern {entry!r}"
                raise ValueError(
                    f"functionalize: remat {what} matches no submodule of {type(module).__name__}; {_ACCEPTED} "
                    f"(patterns match qualified module names such as {_sample(names)}; the root is not a "
                    "candidate, nor ModuleList/ModuleDict: use 'name.*' for their children)"
                )
            hits |= found
    else:
        hits = set()
        for name, sub in named:
            keep = remat(name, sub)  # type: ignore[operator]
            if not isinstance(keep, bool):
                raise TypeError(f"functionalize: remat({name!r}, module) must return a bool, got {type(keep).__name__}")
            if keep:
                hits.add(name)
        if not hits:
            raise ValueError(
                f"functionalize: the remat predicate chose no submodule of {type(module).__name__} (names: "
                f"{_sample(names)}); {_ACCEPTED}"
            )
    chosen: list[str] = []
    for name in names:
        if name in hits and not any(name.startswith(outer + ".") for outer in chosen):
            chosen.append(name)
    return chosen


#: Keywords of torch.utils.checkpoint.checkpoint itself: a forward taking one gets its kwargs bound first.
_CHECKPOINT_KEYWORDS = frozenset(
    {"preserve_rng_state", "use_reentrant", "context_fn", "determinism_check", "debug", "early_stop"}
)


def wrap_forward(module: nn.Module, budget: float = 0.0) -> None:
    """Run ``module``'s forward through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

    Set on the internal copy, over the casting wrapper if any (the input cast is recomputed too). With
    gradients off (inference, ``torch.no_grad``) the forward runs as is. RNG state is preserved
    (dropout masks are replayed), as torch's default. Under ``torch.compile`` the forward runs as is,
    its nodes tagged (:func:`funcamp.passes.remat_region`): the compiled train step's graph pass
    recomputes them for the backward (inductor), and dynamo's activation-checkpoint operator, which
    refuses a forward that reassigns a buffer ("HOP: Unsafe side effect", the fp8 delayed state), is
    never used.

    ``budget`` (:class:`Remat`): compiled, carried by the region's tags (the pass keeps that fraction of its
    activations); eager, ``1.0`` runs the forward as is (nothing recomputed, nothing to choose) and any lower
    budget checkpoints the whole module, as ``0.0``.
    """
    forward = module.forward
    region = passes.new_region_id()

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if _scope.compiling():  # tagged for the compiled step's recompute pass (funcamp.passes)
            with passes.remat_region(region, budget):
                return forward(*args, **kwargs)
        if budget == 1.0:  # eager: keep every activation, as the compiled pass does at this budget
            return forward(*args, **kwargs)
        if budget > 0.0:
            _warn_budget_eager(budget)
        if _CHECKPOINT_KEYWORDS.isdisjoint(kwargs):
            return torch_checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return torch_checkpoint.checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=False)

    module.forward = checkpointed
