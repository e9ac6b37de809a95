"""The module copy ``apply_fn`` runs, and its per-module wrappers, installed as a plan.

:func:`skeleton` copies your module's structure (placeholders for its tensors) and installs, on each
module and innermost first: the binding of the parameters it uses, each made into its forward tensor
(cast, or int8 dequantized, through the step layout's ``param_at_use``: :mod:`funcamp.nn._use`); the
cast of its inputs and outputs, for a module with a policy of its own (:func:`_wrap_cast`); and its
checkpointing (``remat=``, :func:`funcamp.nn._remat.wrap_forward`). :func:`op_mode` is the per-op
precision entered around the whole forward (``op_policies=``). fp8 is a conversion of the model before
all this (``fp8=`` in the policy string), and the trainable/frozen/int8 store is :mod:`funcamp.nn._store`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch import nn

from funcamp import ops
from funcamp.nn import _remat, _use
from funcamp.nn._copy import copy_structure
from funcamp.nn._plan import HALF, Plan
from funcamp.ops import OpRule
from funcamp.policy import Policy


def cast_io(tree: Any, dtype: torch.dtype) -> Any:
    """Cast the real floating tensors of a module's inputs or outputs to ``dtype``.

    Walked with ``torch.utils._pytree``, the registry ``torch.compile`` and Hugging Face use, so that
    ``ModelOutput`` and other registered containers are cast too.
    """

    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x

    # A plain tensor, or a module's (args, kwargs) of plain tensors and no keywords, without the pytree walk, which
    # torch.compile traces for every wrapped module's call (GPT-2 124M's 25 LayerNorms: 50 walks).
    if type(tree) is torch.Tensor:
        return cast(tree)
    if type(tree) is tuple and len(tree) == 2 and type(tree[0]) is tuple and type(tree[1]) is dict and not tree[1]:
        if all(type(x) is torch.Tensor for x in tree[0]):
            return tuple(map(cast, tree[0])), {}
    return torch_pytree.tree_map_only(torch.Tensor, cast, tree)


def device_type(*trees: Any) -> str:
    """The device type (``"cpu"``, ``"cuda"``...) of the first tensor in ``trees``, ``"cpu"`` without one: what
    ``torch.autocast`` is entered with."""
    for tree in trees:
        for leaf in torch_pytree.tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                return leaf.device.type
    return "cpu"


def autocast_on(device: str, dtype: torch.dtype | None = None, enabled: bool = True) -> Any:
    """``torch.autocast(device, dtype, enabled)``, or nothing on a device autocast does not know (``meta``:
    ``funcamp.capture.check``'s stand-in for the step's device, where there is no autocast to enter or leave)."""
    if not torch.amp.is_autocast_available(device):
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=dtype, enabled=enabled)


def _wrap_cast(module: nn.Module, policy: Policy, autocast: bool) -> None:
    """Make ``module`` cast its inputs to the policy's compute dtype and its outputs to its output dtype.

    With ``autocast``, a half compute dtype runs the forward under ``torch.autocast`` with that dtype
    (inputs are left to it); a full one runs it with autocast off and inputs cast.
    """
    forward = module.forward
    half = autocast and policy.compute_dtype in HALF

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not autocast:
            args, kwargs = cast_io((args, kwargs), policy.compute_dtype)
            return cast_io(forward(*args, **kwargs), policy.output_dtype)
        if not half:
            args, kwargs = cast_io((args, kwargs), policy.compute_dtype)
        with autocast_on(device_type(args, kwargs), dtype=policy.compute_dtype if half else None, enabled=half):
            out = forward(*args, **kwargs)
        return cast_io(out, policy.output_dtype)

    module.forward = wrapped


def skeleton(
    module: nn.Module,
    plan: Plan,
    uses: _use.Uses,
    *,
    autocast: bool,
    training: bool | None,
    remat: Mapping[str, float],
    mode: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> nn.Module:
    """A copy of ``module``'s structure with the plan of per-module wrappers installed, innermost first."""
    copied = _copy(module, plan, training)
    _bind_uses(copied, uses)
    _casts(copied, plan, autocast)
    _checkpoints(copied, remat)
    _modes_in_checkpoints(copied, mode)
    return copied


def _copy(module: nn.Module, plan: Plan, training: bool | None) -> nn.Module:
    """``module``'s structure, with shape-only placeholders for the tensors ``apply_fn`` passes in.

    It does not keep your module's weights alive: persistent buffers become ``meta`` tensors (bound for
    the whole call), parameters are replaced by :func:`_bind_uses`; non-persistent buffers, the
    constants, are shared with your module. ``training`` (unless None) is set on the copy.
    """
    named = dict(module.named_buffers())
    state = [*module.parameters(), *(named[name] for name in plan.buffers)]
    memo: dict[int, Any] = {id(t): t for t in module.buffers()}
    memo.update({id(t): torch.empty_like(t, device="meta") for t in state})
    copied = copy_structure(module, memo)
    for sub in copied.modules():
        if getattr(sub, "_use_kernels", False):  # transformers' hub kernels: re-applied at each train()/eval(),
            sub._use_kernels = False  # which fails on the copy's meta tensors; the copy keeps the forwards it has
    if training is not None:
        copied.train(training)
    return copied


def _bind_uses(copied: nn.Module, uses: _use.Uses) -> None:
    """An :class:`funcamp.nn._use.Unbound` per parameter slot (a tied weight's second slot under its alias),
    and on each module holding parameters the hook that binds their forward tensors where it is called."""
    own: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for holder, local, name in _use.slots(copied):
        p = holder._parameters[local]
        holder._parameters[local] = _use.Unbound(p.shape, uses.forward_dtypes[name], name, uses, p.requires_grad)
        own.setdefault(id(holder), []).append((holder, local, name))
    holders = [sub for sub in copied.modules() if id(sub) in own]  # each distinct module once
    for sub in holders:
        _use.bind_at_call(sub, own[id(sub)], uses)
    uses.hold(holders)


def _casts(copied: nn.Module, plan: Plan, autocast: bool) -> None:
    """The input and output casts of each module with a policy of its own (under autocast: yours only)."""
    modules = dict(copied.named_modules(remove_duplicate=False))
    wrapped: set[int] = set()
    for name, policy in plan.own.items():  # a module reachable by two names is wrapped once, by the first
        if autocast and name in plan.defaults:  # under autocast the defaults set storage only
            continue
        if id(modules[name]) not in wrapped:
            wrapped.add(id(modules[name]))
            _wrap_cast(modules[name], policy, autocast)


def _calls_checkpoint(cls: type) -> bool:
    """Whether ``cls.forward``'s code names a checkpoint (``torch.utils.checkpoint``, Hugging Face's
    ``_gradient_checkpointing_func``); True where the code cannot be read (it may)."""
    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None:
        return False
    try:
        return "checkpoint" in inspect.getsource(forward)
    except (OSError, TypeError):
        return True


def _modes_in_checkpoints(copied: nn.Module, mode: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
    """The per-op precision entered again in the forwards of the modules a module's code may checkpoint.

    Under ``torch.compile`` a ``torch.utils.checkpoint`` call in your model's code is Dynamo's checkpoint operator,
    whose body Dynamo traces without the torch-function modes entered around the forward: the compiled step ran the
    op rules (yours, and the default float32 softmax) in the compute dtype there, silently, where the eager step
    applied them. Each submodule of a module whose ``forward`` names a checkpoint (unless the module's
    ``gradient_checkpointing`` is False) enters ``mode`` where it finds the mode stack empty (inside such a body;
    elsewhere the mode is already entered, and nothing is added); a function checkpointed without calling a module
    is not covered. ``functionalize(remat=)`` is not concerned: it tags the region instead of calling the
    operator."""
    if mode is contextlib.nullcontext:
        return
    # A module that says it does not checkpoint (Hugging Face's ``gradient_checkpointing = False``, which its forward
    # reads) is spared: on transformers' GPT-2 with checkpointing off the wrappers cost 3.6% of the traced bytecode.
    names: dict[type, bool] = {}  # each class's source read once (a model's blocks share one)

    def calls(cls: type) -> bool:
        if cls not in names:
            names[cls] = _calls_checkpoint(cls)
        return names[cls]

    callers = [
        m for m in copied.modules() if getattr(m, "gradient_checkpointing", None) is not False and calls(type(m))
    ]
    targets = {id(d): d for m in callers for d in m.modules() if d is not m}
    for target in targets.values():
        forward = target.forward

        @functools.wraps(forward)
        def entered(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            if torch.compiler.is_dynamo_compiling() and torch._C._len_torch_function_stack() == 0:
                with mode():
                    return _forward(*args, **kwargs)
            return _forward(*args, **kwargs)

        target.forward = entered


def _checkpoints(copied: nn.Module, remat: Mapping[str, float]) -> None:
    """``remat=``: over the casting wrapper, so that the region starts at the module's own inputs; ``remat``
    maps each chosen module's name to its activation memory budget (:class:`funcamp.nn.Remat`)."""
    modules = dict(copied.named_modules(remove_duplicate=False))
    checkpointed: set[int] = set()
    for name, budget in remat.items():
        if id(modules[name]) not in checkpointed:
            checkpointed.add(id(modules[name]))
            _remat.wrap_forward(modules[name], budget)


def op_mode(
    policy: Policy,
    op_policies: Mapping[Any, OpRule | None] | None,
    autocast: bool,
    forward_dtypes: Mapping[str, torch.dtype],
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The per-op precision around the forward (``op_policies=``), checked now: a context factory.

    Under autocast torch's op lists decide: funcamp's default rules are not added, yours are. The mode is
    entered only where the model computes in a half dtype somewhere or rules were given.
    """
    rules = {**({} if autocast else ops.FLOAT32_ACCUMULATION), **(op_policies or {})}
    any_half = policy.compute_dtype in HALF or any(d in HALF for d in forward_dtypes.values())
    entered = rules and (op_policies or any_half)
    if not entered:
        return contextlib.nullcontext
    return functools.partial(ops.OpPolicies, ops.checked_rules(rules))  # checked now, not in each (traced) forward
