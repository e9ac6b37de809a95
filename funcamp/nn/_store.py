"""What ``apply_fn`` is made from: trainable masters, frozen tensors (or int8 ones), buffers, forward dtypes.

The trainable/frozen split (``trainable=``), the int8 choice (``quantize=``) and the dtype every
tensor is stored in and enters the forward in, computed once by :func:`store` from your module (which
is then no longer needed: everything here is a copy).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from funcamp import quant
from funcamp.nn._plan import HALF, Plan
from funcamp.policy import Policy

#: A value of ``trainable``: None (each parameter's ``requires_grad``), True (every parameter), fnmatch
#: patterns of parameter or module names, or a predicate ``(name, tensor) -> bool``.
Trainable = bool | str | Iterable[str] | Callable[[str, torch.Tensor], bool] | None


class Store(NamedTuple):
    """The tensors ``apply_fn`` is made from, each a copy of your module's.

    Attributes:
      params: the trainable masters by first name, floating ones in their param dtype (returned to you).
      frozen: the frozen tensors by first name, held by ``apply_fn``: in the dtype they enter the forward in
        (:func:`_frozen_dtype`), or :class:`funcamp.quant.Int8Weight` for those in ``int8``.
      buffers: the persistent buffers by first name, floating ones in their param dtype.
      int8: ``{name: output-channel dim}`` of the int8 weights.
      forward_dtypes: the dtype each tensor (tied uses under each of their names) enters the forward in.
    """

    params: dict[str, torch.Tensor]
    frozen: dict[str, Any]
    buffers: dict[str, torch.Tensor]
    int8: dict[str, int]
    forward_dtypes: dict[str, torch.dtype]


def store(module: nn.Module, plan: Plan, chosen: set[str], int8: dict[str, int], autocast: bool) -> Store:
    """The :class:`Store` of ``module``: ``chosen`` (first names) trainable, ``int8`` frozen in int8."""
    named = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    params = {name: _master(named[name], plan.tensors[name]) for name in plan.params if name in chosen}

    def stored(name: str) -> torch.Tensor | quant.Int8Weight:
        if name in int8:
            return quant.quantize_int8(named[name], int8[name])
        dtype = _frozen_dtype(named[name], plan.tensors[name], autocast)
        return named[name].detach().to(dtype, copy=True)

    frozen = {name: stored(name) for name in plan.params if name not in chosen}
    buffers = {name: _master(named[name], plan.tensors[name]) for name in plan.buffers}
    forward_dtypes = {name: plan.forward_dtype(name, autocast) for name in [*plan.tensors, *plan.aliases]}
    # A frozen tensor enters the forward in its module's compute dtype (stored so, or narrower: see
    # _frozen_dtype), except under autocast in a half module, where it enters as stored.
    for name, t in frozen.items():
        if name not in int8 and (not t.is_floating_point() or autocast and plan.tensors[name].compute_dtype in HALF):
            forward_dtypes[name] = t.dtype
    # An int8 weight is dequantized into its module's compute dtype (a tied use: into its own module's).
    forward_dtypes.update({name: plan.tensors[name].compute_dtype for name in int8})
    forward_dtypes.update({a: plan.alias_policies[a].compute_dtype for a, name in plan.aliases.items() if name in int8})
    return Store(params, frozen, buffers, int8, forward_dtypes)


def _master(tensor: torch.Tensor, policy: Policy) -> torch.Tensor:
    dtype = policy.param_dtype if tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to(dtype, copy=True)


# --- trainable and frozen parameters ------------------------------------------------------------


def _prefixes(name: str) -> list[str]:
    """``"a.b.weight"`` -> ``["a.b.weight", "a.b", "a"]``: the tensor and the modules that hold it."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def trainable_names(module: nn.Module, plan: Plan, trainable: Trainable) -> set[str]:
    """The parameters (by first name) that go into ``params``; see ``trainable`` in :func:`functionalize`."""
    tensors = dict(module.named_parameters(remove_duplicate=False))
    names = {name: [name] for name in plan.params}  # first name -> all its names
    for alias, first in plan.aliases.items():
        if first in names:
            names[first].append(alias)
    if trainable is None:
        return {name for name in plan.params if tensors[name].requires_grad}
    if trainable is True:
        return set(plan.params)
    if callable(trainable):
        chosen = set()
        for first, all_names in names.items():
            for name in all_names:
                keep = trainable(name, tensors[name])
                if not isinstance(keep, bool):
                    raise TypeError(
                        f"functionalize: trainable({name!r}, tensor) must return a bool, got {type(keep).__name__}"
                    )
                if keep:
                    chosen.add(first)
        if not chosen:
            raise ValueError(
                f"functionalize: the trainable predicate selected no parameter of the {len(plan.params)} "
                f"({sample(plan.params)}); to freeze the whole model for inference use "
                "model.requires_grad_(False) and trainable=None"
            )
        return chosen
    patterns = [trainable] if isinstance(trainable, str) else trainable
    if isinstance(trainable, (bool, bytes)) or not isinstance(patterns, Iterable):
        raise TypeError(
            "functionalize: trainable must be None (each parameter's requires_grad), True (every parameter), "
            "a name pattern or list of them (fnmatch, e.g. ['lm_head.*', '*.bias']), or a function "
            f"(name, tensor) -> bool; got {trainable!r}"
        )
    patterns = list(patterns)
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad or not patterns:
        raise TypeError(f"functionalize: trainable patterns must be a non-empty list of strings, got {trainable!r}")
    chosen = set()
    for pattern in patterns:
        hits = {
            first
            for first, all_names in names.items()
            if any(fnmatch.fnmatchcase(p, pattern) for name in all_names for p in _prefixes(name))
        }
        if not hits:
            raise ValueError(
                f"functionalize: trainable pattern {pattern!r} matches no parameter (nor module holding one); "
                f"parameter names are {sample(plan.params)}"
            )
        chosen |= hits
    return chosen


def sample(names: list[str], n: int = 6) -> str:
    """The first ``n`` of ``names`` for a message, ``...`` marking more."""
    shown = ", ".join(repr(x) for x in names[:n])
    return f"[{shown}{', ...' if len(names) > n else ''}]"


def _frozen_dtype(tensor: torch.Tensor, policy: Policy, autocast: bool) -> torch.dtype:
    """The dtype a frozen tensor is stored in: the one it enters the forward in, never a needless upcast.

    Casting mode: its module's compute dtype, or its param dtype where that one is narrower (a float16
    embedding table looked up in float32 by :func:`funcamp.nn.float32_lookup` stays float16 and is cast
    at each call, as a trainable one is). Under autocast, for a module computing in half precision
    (autocast casts per op): its own dtype if that is a half one, else its param dtype.
    """
    if not tensor.is_floating_point():
        return tensor.dtype
    if autocast and policy.compute_dtype in HALF:
        return tensor.dtype if tensor.dtype in HALF else policy.param_dtype
    if policy.param_dtype.itemsize < policy.compute_dtype.itemsize:
        return policy.param_dtype
    return policy.compute_dtype


def int8_names(module: nn.Module, quantize: Any, chosen: set[str]) -> dict[str, int]:
    """``{parameter name: output-channel dim}`` of the weights stored in int8; they must be frozen."""
    if quantize is None:
        return {}
    if not isinstance(quantize, quant.Int8WeightOnlyConfig):
        raise TypeError(
            "functionalize: quantize must be None or a funcamp.quant.Int8WeightOnlyConfig, got "
            f"{type(quantize).__name__}"
        )
    int8 = quantize.select(module)
    trained = sorted(set(int8) & chosen)
    if trained:
        raise ValueError(
            f"functionalize: {sample(trained)} ({len(trained)} tensors) would be stored in int8 and trained; "
            "int8 weights are frozen. Freeze them (module.requires_grad_(False) on them, or a trainable= "
            "pattern or predicate that leaves them out), or leave them out of quantize (exclude=...)"
        )
    return int8
