"""Bring your own ``torch.nn.Module``: a pure function of parameter pytrees, with a policy per module.

:func:`functionalize` turns a module into ``apply_fn(params, *args, **kwargs)`` built on
``torch.func.functional_call``, together with detached master parameters in the policy's param dtype.
Parameters and floating inputs are cast to the compute dtype inside ``apply_fn`` (or the forward runs
under ``torch.autocast``), and the output is cast to the output dtype. Normalisation layers keep their
parameters and their arithmetic in float32, as torch.amp, Apex (``keep_batchnorm_fp32``) and Hugging
Face (``_keep_in_fp32_modules``) do. Buffers that change in training (BatchNorm running statistics)
come in and go out explicitly: ``apply_fn(params, buffers, *args, **kwargs) -> (out, new_buffers)``.

The module you pass is never changed, nor kept alive: ``functionalize`` works on a structural copy of
it whose parameters are shape-only placeholders (on the ``meta`` device), sets the training flag and
the per-module casting wrappers on that copy, and runs it with the tensors passed to ``apply_fn``.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch import nn

from funcamp.policy import Policy, get_policy

__all__ = [
    "NORM_TYPES",
    "functionalize",
    "keep_in_float32",
    "param_policies",
]

PolicyLike = Policy | str
#: A value of ``module_policies``: a policy, a policy string, ``None`` (no policy of its own: follow the
#: surrounding module), or a function of the surrounding policy such as :func:`keep_in_float32`.
ModulePolicy = Policy | str | Callable[[Policy], Policy] | None
ModulePolicies = Mapping[type | str, ModulePolicy]

#: Module types that run in float32 by default (with :func:`keep_in_float32`): BatchNorm*, SyncBatchNorm
#: and InstanceNorm* (``_NormBase``), LayerNorm, GroupNorm, RMSNorm, LocalResponseNorm (which has no
#: half-precision CPU kernel).
NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.LocalResponseNorm,
)
# Normalisation layers of other libraries, recognised by their class name: LlamaRMSNorm, T5LayerNorm,
# FusedLayerNorm, torchvision's FrozenBatchNorm2d, ...
_NORM_NAME = re.compile(r"(Layer|RMS|Group|Batch|Instance)Norm(\dd)?$")
_HALF = (torch.float16, torch.bfloat16)


def _full(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def keep_in_float32(surrounding: Policy) -> Policy:
    """The default policy of normalisation layers, given the policy of the module around them.

    Parameters are stored and the layer computes in float32 (float64 stays float64: never lower than
    the surrounding dtypes); its output is cast to the surrounding compute dtype, so the next layer
    sees what it would have seen without the norm's policy (haiku's recipe for BatchNorm).

    Args:
      surrounding: the policy of the enclosing module (the top-level policy for most layers).
    Returns:
      ``Policy(param=max(param, float32), compute=max(compute, float32), output=surrounding compute)``.

    Example:
      >>> str(keep_in_float32(get_policy("params=float32,compute=bfloat16,output=float32")))
      'params=float32,compute=float32,output=bfloat16'
    """
    return Policy(
        _full(surrounding.param_dtype),
        _full(surrounding.compute_dtype),
        surrounding.compute_dtype,
        surrounding.reduce_dtype,
    )


def _is_default_norm(name: str, module: nn.Module) -> bool:
    return isinstance(module, NORM_TYPES) or bool(_NORM_NAME.search(type(module).__name__))


_Matcher = Callable[[str, nn.Module], bool]


def _matcher(key: Any) -> _Matcher:
    if isinstance(key, str):
        return lambda name, module: fnmatch.fnmatchcase(name, key)
    if isinstance(key, type) and issubclass(key, nn.Module):
        return lambda name, module: isinstance(module, key)
    raise TypeError(
        f"functionalize: module_policies keys must be nn.Module subclasses or name patterns (str, fnmatch "
        f"syntax such as 'lm_head' or '*.ln_*'), got {key!r}"
    )


def _check_value(key: Any, value: Any) -> ModulePolicy:
    if value is None or isinstance(value, Policy) or callable(value):
        return value
    if isinstance(value, str):
        return get_policy(value)
    raise TypeError(
        f"functionalize: module_policies[{key!r}] must be a Policy, a policy string, None or a function "
        f"of the surrounding policy (e.g. funcamp.nn.keep_in_float32), got {type(value).__name__}"
    )


def _entries(module_policies: ModulePolicies | None) -> list[tuple[_Matcher, ModulePolicy, bool]]:
    """``(matcher, value, from_user_string)``: the user's entries in order, then the norm default."""
    if module_policies is not None and not isinstance(module_policies, Mapping):
        raise TypeError(
            f"functionalize: module_policies must be a mapping (dict) or None, got {type(module_policies).__name__}"
        )
    user = [(_matcher(k), _check_value(k, v), isinstance(k, str)) for k, v in (module_policies or {}).items()]
    return [*user, (_is_default_norm, keep_in_float32, False)]


def _apply(value: ModulePolicy, surrounding: Policy) -> Policy:
    if value is None:
        return surrounding
    if isinstance(value, Policy):
        return value
    policy = value(surrounding)
    if not isinstance(policy, Policy):
        raise TypeError(f"functionalize: a module policy function returned {type(policy).__name__}, not a Policy")
    return policy


class _Plan:
    """Which policy each module and each tensor follows; computed once from the module's structure.

    Attributes:
      modules: resolved policy of every module, by qualified name ("" is the root).
      own: the modules that have a policy of their own (their forward gets a casting wrapper).
      tensors: policy of every parameter and persistent buffer, by qualified name.
      params: parameter names (tied parameters once, under their first name).
      buffers: persistent buffer names (the state that ``apply_fn`` takes and returns).
    """

    def __init__(self, module: nn.Module, policy: Policy, module_policies: ModulePolicies | None) -> None:
        entries = _entries(module_policies)
        self.modules: dict[str, Policy] = {}
        self.own: dict[str, Policy] = {}
        for name, sub in module.named_modules(remove_duplicate=False):
            surrounding = self.modules[name.rpartition(".")[0]] if name else policy
            match = next(((value, s) for m, value, s in entries if m(name, sub)), None)
            self.modules[name] = surrounding if match is None else _apply(match[0], surrounding)
            if match is not None and match[0] is not None:
                self.own[name] = self.modules[name]
        patterns = [(m, v) for m, v, from_string in entries if from_string]
        self.params = [name for name, _ in module.named_parameters()]
        self.buffers = [name for name, _ in module.named_buffers() if _is_persistent(module, name)]
        self.tensors = {name: self._tensor_policy(name, patterns) for name in self.params + self.buffers}
        self.aliases = {a: m for a, m in _aliases(module).items() if m in self.tensors}
        self.alias_policies = {a: self._tensor_policy(a, patterns) for a in self.aliases}

    def _tensor_policy(self, name: str, patterns: list[tuple[_Matcher, ModulePolicy]]) -> Policy:
        owner = self.modules[name.rpartition(".")[0]]
        value = next((v for m, v in patterns if m(name, None)), None)  # type: ignore[arg-type]
        return _apply(value, owner)

    def forward_dtype(self, name: str, autocast: bool) -> torch.dtype:
        """The dtype a floating tensor enters the forward pass in (under autocast, half casts are left to it)."""
        policy = self.alias_policies[name] if name in self.aliases else self.tensors[name]
        if autocast and policy.compute_dtype in _HALF:
            return policy.param_dtype
        return policy.compute_dtype


def _aliases(module: nn.Module) -> dict[str, str]:
    """Every further name of a tied (shared) parameter or buffer, mapped to its first name."""
    first: dict[int, str] = {}
    named = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    return {name: first[id(t)] for name, t in named if first.setdefault(id(t), name) != name}


def _is_persistent(module: nn.Module, name: str) -> bool:
    prefix, _, leaf = name.rpartition(".")
    return leaf not in module.get_submodule(prefix)._non_persistent_buffers_set


def param_policies(
    module: nn.Module, policy: PolicyLike, *, module_policies: ModulePolicies | None = None
) -> dict[str, Policy]:
    """The policy each parameter and persistent buffer of ``module`` follows under :func:`functionalize`.

    Pass the result to :func:`funcamp.memory.memory_report` for a per-dtype report that knows which
    layers stay in float32.

    Args:
      module: the model.
      policy: the top-level policy (or policy string).
      module_policies: as for :func:`functionalize`.
    Returns:
      A dict from qualified name to Policy: every parameter and persistent buffer, a tied parameter
      under each of its names (each use is cast to the policy of the module using it).
    Raises:
      TypeError: if ``module`` is not an ``nn.Module`` or ``module_policies`` is malformed.
      ValueError: if a policy string does not parse.

    Example:
      >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
      >>> {k: str(p) for k, p in param_policies(model, "c=bf16").items()}["1.weight"]
      'params=float32,compute=float32,output=bfloat16'
    """
    _check_module(module)
    plan = _Plan(module, get_policy(policy), module_policies)
    return {**plan.tensors, **plan.alias_policies}


def _check_module(module: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"functionalize: expected a torch.nn.Module, got {type(module).__name__}")


def _cast_io(tree: Any, dtype: torch.dtype) -> Any:
    """Cast the real floating tensors of a module's inputs or outputs to ``dtype``.

    Walked with ``torch.utils._pytree``, the registry ``torch.compile`` and Hugging Face use, so that
    ``ModelOutput`` and other registered containers are cast too.
    """

    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x

    return torch_pytree.tree_map_only(torch.Tensor, cast, tree)


def _device_type(*trees: Any) -> str:
    for tree in trees:
        for leaf in torch_pytree.tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                return leaf.device.type
    return "cpu"


def _wrap_forward(module: nn.Module, policy: Policy, autocast: bool) -> None:
    """Make ``module`` cast its inputs to the policy's compute dtype and its outputs to its output dtype.

    With ``autocast``, a half compute dtype runs the forward under ``torch.autocast`` with that dtype
    (inputs are left to it); a full one runs it with autocast off and inputs cast.
    """
    forward = module.forward
    half = autocast and policy.compute_dtype in _HALF

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not autocast:
            args, kwargs = _cast_io((args, kwargs), policy.compute_dtype)
            return _cast_io(forward(*args, **kwargs), policy.output_dtype)
        if not half:
            args, kwargs = _cast_io((args, kwargs), policy.compute_dtype)
        device = _device_type(args, kwargs)
        with torch.autocast(device, dtype=policy.compute_dtype if half else None, enabled=half):
            out = forward(*args, **kwargs)
        return _cast_io(out, policy.output_dtype)

    module.forward = wrapped


def _skeleton(module: nn.Module, plan: _Plan, autocast: bool, training: bool | None) -> nn.Module:
    """A copy of ``module``'s structure with the casting wrappers installed.

    ``apply_fn`` passes every parameter and persistent buffer in, so the copy holds shape-only ``meta``
    placeholders for them (it does not keep your module's weights alive); non-persistent buffers,
    the constants, are shared with your module.
    """
    named = dict(module.named_buffers())
    state = [*module.parameters(), *(named[name] for name in plan.buffers)]
    memo: dict[int, Any] = {id(t): t for t in module.buffers()}
    memo.update({id(t): _placeholder(t) for t in state})
    try:
        skeleton = copy.deepcopy(module, memo)
    except Exception as e:
        raise TypeError(
            f"functionalize: could not copy the structure of {type(module).__name__} (copy.deepcopy failed: "
            f"{e}); functionalize needs a deep-copyable module so that it never changes yours"
        ) from e
    if training is not None:
        skeleton.train(training)
    modules = dict(skeleton.named_modules(remove_duplicate=False))
    wrapped: set[int] = set()
    for name, policy in plan.own.items():  # a module reachable by two names is wrapped once, by the first
        if id(modules[name]) not in wrapped:
            wrapped.add(id(modules[name]))
            _wrap_forward(modules[name], policy, autocast)
    return skeleton


def _placeholder(tensor: torch.Tensor) -> torch.Tensor:
    empty = torch.empty_like(tensor, device="meta")
    return nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty


def _check_keys(what: str, got: Mapping[str, Any], expected: list[str]) -> None:
    if not isinstance(got, Mapping):
        hint = (
            " (this module has buffers: call apply_fn(params, buffers, *args, **kwargs))" if what == "buffers" else ""
        )
        raise TypeError(f"apply_fn: {what} must be a dict of tensors by name, got {type(got).__name__}{hint}")
    if got.keys() != set(expected):
        missing = sorted(set(expected) - got.keys())
        unexpected = sorted(got.keys() - set(expected))
        raise ValueError(
            f"apply_fn: {what} do not match the module: missing {missing}, unexpected {unexpected}; pass the "
            f"{what} functionalize returned (or a tree_map of them)"
        )


def _master(tensor: torch.Tensor, policy: Policy) -> torch.Tensor:
    dtype = policy.param_dtype if tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to(dtype, copy=True)


def functionalize(
    module: nn.Module,
    policy: PolicyLike,
    *,
    module_policies: ModulePolicies | None = None,
    autocast: bool = False,
    training: bool | None = None,
    with_buffers: bool | None = None,
) -> (
    tuple[Callable[..., Any], dict[str, torch.Tensor]]
    | tuple[Callable[..., Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]
):
    """Turn ``module`` into a pure function of its parameters (and buffers), under a precision policy.

    The return value follows the state dict: ``(apply_fn, params)`` for a module without persistent
    buffers, ``(apply_fn, params, buffers)`` for one with them (BatchNorm).

    - ``apply_fn(params, *args, **kwargs) -> out``, or with buffers
      ``apply_fn(params, buffers, *args, **kwargs) -> (out, new_buffers)``. Pure: ``params``,
      ``buffers`` and ``module`` are never changed; in-place buffer updates (running statistics) land
      in fresh copies, which come back as ``new_buffers``.
    - ``params``: detached copies of ``named_parameters()`` (new memory, not views of the module's),
      floating ones in their policy's ``param_dtype``. A tied weight (GPT-2's token embedding and LM
      head) is one master tensor, under its first name; each use gets its own compute-dtype copy, so
      its gradient is the sum of the gradients of both uses, added in the parameter dtype.
    - ``buffers``: copies of the persistent buffers, floating ones in ``param_dtype`` (BatchNorm
      statistics in float32), integer ones (``num_batches_tracked``) unchanged. Non-persistent buffers
      (causal masks, rotary tables, position ids) are constants of ``apply_fn``, used as the module
      holds them: not cast, and not copied (a forward that writes one in place writes your module's).

    Casting (``autocast=False``, the rule of jmp and haiku): floating inputs are cast to
    ``policy.compute_dtype``, each parameter and floating buffer to its own policy's compute dtype, and
    the output to ``policy.output_dtype``. A module with a policy of its own casts its floating inputs
    to that policy's compute dtype and its output to that policy's output dtype. By default
    normalisation layers (:data:`NORM_TYPES`, and classes named ``*LayerNorm``, ``*RMSNorm``,
    ``*GroupNorm``, ``*BatchNorm{1,2,3}d``, ``*InstanceNorm{1,2,3}d``, such as Hugging Face's
    ``LlamaRMSNorm``) follow :func:`keep_in_float32`: float32 parameters, statistics and arithmetic,
    output in the surrounding compute dtype.

    With ``autocast=True`` the forward runs under ``torch.autocast(device, compute_dtype)`` instead
    (the parameters' device type), with parameters in their param dtype and inputs not cast, so that
    torch's op lists decide: matmuls and convolutions in the compute dtype; losses, and on CUDA
    softmax, in float32. Modules whose policy computes in float32 (the norms) run with autocast off and
    float32 inputs. Both modes give gradients in the parameters' dtypes and compile with
    ``fullgraph=True``. Known torch 2.13 failure: on CPU, differentiating ``scaled_dot_product_attention``
    with ``dropout_p > 0`` under ``torch.func.grad`` and autocast raises a dtype error in the backward
    (Hugging Face GPT-2 in training mode); the default casting mode is not affected.

    Inputs and outputs are walked with ``torch.utils._pytree`` (so Hugging Face's ``ModelOutput`` is
    cast); only real floating tensors are cast.

    Args:
      module: the model; left unchanged (same parameters, dtypes, training flag, no hooks).
      policy: a :class:`funcamp.Policy` or a policy string for the whole model.
      module_policies: ``{module type or name pattern: policy}``; first match wins, before the norm
        default. A type matches its instances; a string (fnmatch syntax) matches qualified module names
        (the module and everything under it follows the policy) and parameter names (that parameter's
        dtypes only). Values: a Policy, a policy string, a function of the surrounding policy (such as
        :func:`keep_in_float32`), or ``None`` to follow the surrounding module (``{nn.LayerNorm: None}``
        turns the norm default off for LayerNorm).
      autocast: run under ``torch.autocast`` instead of casting parameters up front.
      training: the training flag ``apply_fn`` runs with (dropout, BatchNorm statistics), set on the
        internal copy; ``None`` keeps each submodule's flag as it is now. ``functionalize(model.eval(),
        ...)`` works too, but changes your module's flag; ``training=False`` does not.
      with_buffers: ``None`` (the rule above); ``True``: always the buffer form (an empty dict for a
        model without buffers, handy for generic code); ``False``: always the short form, the buffers
        being constants whose in-place updates are discarded (inference, frozen statistics).
    Returns:
      ``(apply_fn, params)`` or ``(apply_fn, params, buffers)``, see above.
    Raises:
      TypeError: if ``module`` is not an ``nn.Module``, ``module_policies`` is malformed, or the module
        cannot be deep-copied.
      ValueError: if a policy string does not parse; at call time, if ``params`` or ``buffers`` do not
        have the module's names.
      TypeError: at call time, if ``params`` or ``buffers`` is not a dict.

    Example:
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
      >>> apply_fn, params = functionalize(model, "params=float32,compute=bfloat16,output=float32")
      >>> params["0.weight"].dtype, params["1.weight"].dtype
      (torch.float32, torch.float32)
      >>> out = apply_fn(params, torch.ones(3, 4))
      >>> out.dtype, out.shape
      (torch.float32, torch.Size([3, 2]))
      >>> grads = torch.func.grad(lambda p, x: apply_fn(p, x).sum())(params, torch.ones(3, 4))
      >>> grads["0.weight"].dtype
      torch.float32
    """
    _check_module(module)
    policy = get_policy(policy)
    plan = _Plan(module, policy, module_policies)
    skeleton = _skeleton(module, plan, autocast, training)
    named = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    params = {name: _master(named[name], plan.tensors[name]) for name in plan.params}
    buffers = {name: _master(named[name], plan.tensors[name]) for name in plan.buffers}
    forward_dtypes = {name: plan.forward_dtype(name, autocast) for name in [*plan.tensors, *plan.aliases]}
    stored_dtypes = {name: buffers[name].dtype for name in plan.buffers}

    def run(params: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], args: Any, kwargs: Any) -> Any:
        _check_keys("params", params, plan.params)
        _check_keys("buffers", state, plan.buffers)
        tensors = {name: _to_forward(p, forward_dtypes[name]) for name, p in params.items()}
        # Fresh tensors: the module's in-place updates (running statistics) must not reach the caller's.
        fresh = {name: _to_forward(b, forward_dtypes[name], copy=True) for name, b in state.items()}
        tensors.update(fresh)
        # Each use of a tied parameter gets its own cast, so that the gradients of the uses are summed in
        # the parameter's dtype (and a use in a module with another policy gets that policy's dtype).
        # A tied buffer is the same fresh tensor under every name.
        for alias, name in plan.aliases.items():
            tensors[alias] = fresh[name] if name in fresh else _to_forward(params[name], forward_dtypes[alias])
        if autocast:
            half = policy.compute_dtype in _HALF
            with torch.autocast(
                _device_type(params, args, kwargs), dtype=policy.compute_dtype if half else None, enabled=half
            ):
                out = torch.func.functional_call(skeleton, tensors, tuple(args), kwargs, tie_weights=False)
        else:
            args, kwargs = _cast_io((tuple(args), kwargs), policy.compute_dtype)
            out = torch.func.functional_call(skeleton, tensors, args, kwargs, tie_weights=False)
        # functional_call writes attribute reassignments back into the dict it was given.
        new_state = {name: tensors[name].to(stored_dtypes[name]) for name in fresh}
        return _cast_io(out, policy.output_dtype), new_state

    explicit = bool(plan.buffers) if with_buffers is None else with_buffers
    if explicit:

        def apply_fn(
            params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor], /, *args: Any, **kwargs: Any
        ) -> tuple[Any, dict[str, torch.Tensor]]:
            return run(params, buffers, args, kwargs)

        return apply_fn, params, buffers

    frozen = buffers

    def apply_fn(params: Mapping[str, torch.Tensor], /, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        return run(params, frozen, args, kwargs)[0]

    return apply_fn, params


def _to_forward(tensor: torch.Tensor, dtype: torch.dtype, copy: bool = False) -> torch.Tensor:
    if not tensor.is_floating_point():
        return tensor.clone() if copy else tensor
    return tensor.to(dtype, copy=copy)
