"""Which precision policy each module and each tensor of an ``nn.Module`` follows under ``functionalize``."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from funcamp.policy import Policy, _full, get_policy, keep_in_float32

__all__ = ["EMBEDDING_TYPES", "NORM_TYPES", "float32_lookup", "keep_in_float32", "param_policies"]

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
#: Lookup tables that follow :func:`float32_lookup` by default: the table is stored in the param dtype,
#: the lookup runs in float32 and the looked-up rows are rounded once to the surrounding compute dtype.
EMBEDDING_TYPES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)
# Normalisation layers of other libraries, recognised by their class name: LlamaRMSNorm, T5LayerNorm,
# FusedLayerNorm, torchvision's FrozenBatchNorm2d, ...
_NORM_NAME = re.compile(r"(Layer|RMS|Group|Batch|Instance)Norm(\dd)?$")
HALF = (torch.float16, torch.bfloat16)


def float32_lookup(surrounding: Policy) -> Policy:
    """The default policy of embeddings (:data:`EMBEDDING_TYPES`), given the policy of the module around them.

    The table is stored in the surrounding param dtype, looked up in float32 (float64 stays float64)
    and the looked-up rows are cast to the surrounding compute dtype, which the next layer receives.
    A lookup is a gather with no arithmetic to speed up in a half dtype (``EmbeddingBag``'s sum or
    mean over a bag is added in float32), and its backward adds the gradient of every use of a row
    (a scatter-add), which in float32 is not rounded to a half dtype on its way to the master.

    What it costs: with float32 params (``params=float32,compute=bfloat16``) the table enters the
    lookup as it is stored, so no copy at all, where the surrounding compute dtype would make a half
    copy of the whole table at every call. With half params (``params=float16``, the footprint of
    ``model.half()``) the table stays stored in half precision and is cast to float32 at each call:
    exactly the cast :data:`funcamp.ops.FLOAT32_ACCUMULATION`'s ``"embedding"`` rule makes for a half
    table, so no new cost. Forward values equal a half lookup's (casting a row after the lookup rounds
    the same elements as casting the table before it).

    Where it differs: torch.amp leaves embeddings out of autocast's lists (float32 table, float32
    output); here the output is the surrounding compute dtype. jmp with haiku and flax's
    ``nn.Embed(dtype=...)`` cast the table to the compute dtype and look up there. Unlike
    :func:`keep_in_float32`, the param dtype is not raised: half params store a half table.

    Args:
      surrounding: the policy of the enclosing module (the top-level policy for most embeddings).
    Returns:
      ``Policy(param=param, compute=max(compute, float32), output=surrounding compute, reduce=reduce)``.

    Example:
      >>> str(float32_lookup(get_policy("params=float32,compute=bfloat16,output=float32")))
      'params=float32,compute=float32,output=bfloat16'
      >>> str(float32_lookup(get_policy("params=float16,compute=float16,output=float32")))
      'params=float16,compute=float32,output=float16'
    """
    return Policy(
        surrounding.param_dtype,
        _full(surrounding.compute_dtype),
        surrounding.compute_dtype,
        surrounding.reduce_dtype,
    )


def is_default_norm(name: str, module: nn.Module) -> bool:
    """Whether ``module`` is a normalization layer by default (a torch norm type, or a class named like one)."""
    return isinstance(module, NORM_TYPES) or bool(_NORM_NAME.search(type(module).__name__))


def _is_default_embedding(name: str, module: nn.Module) -> bool:
    return isinstance(module, EMBEDDING_TYPES)


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


def _entries(module_policies: ModulePolicies | None) -> list[tuple[_Matcher, ModulePolicy, bool, bool]]:
    """``(matcher, value, from_user_string, default)``: the user's entries in order, then the norm and
    embedding defaults."""
    if module_policies is not None and not isinstance(module_policies, Mapping):
        raise TypeError(
            f"functionalize: module_policies must be a mapping (dict) or None, got {type(module_policies).__name__}"
        )
    user = [(_matcher(k), _check_value(k, v), isinstance(k, str), False) for k, v in (module_policies or {}).items()]
    return [
        *user,
        (is_default_norm, keep_in_float32, False, True),
        (_is_default_embedding, float32_lookup, False, True),
    ]


def _apply(value: ModulePolicy, surrounding: Policy) -> Policy:
    if value is None:
        return surrounding
    if isinstance(value, Policy):
        return value
    policy = value(surrounding)
    if not isinstance(policy, Policy):
        raise TypeError(f"functionalize: a module policy function returned {type(policy).__name__}, not a Policy")
    return policy


class Plan:
    """Which policy each module and each tensor follows; computed once from the module's structure.

    Attributes:
      modules: resolved policy of every module, by qualified name ("" is the root).
      own: the modules that have a policy of their own (their forward gets a casting wrapper).
      defaults: the modules of ``own`` whose policy is a default (norms, embeddings), not yours; under
        autocast they get no casting wrapper (the policy sets only the dtype their tensors enter in).
      tensors: policy of every parameter and persistent buffer, by qualified name.
      params: parameter names (tied parameters once, under their first name).
      buffers: persistent buffer names (the state that ``apply_fn`` takes and returns).
    """

    def __init__(self, module: nn.Module, policy: Policy, module_policies: ModulePolicies | None) -> None:
        entries = _entries(module_policies)
        self.modules: dict[str, Policy] = {}
        self.own: dict[str, Policy] = {}
        self.defaults: set[str] = set()
        for name, sub in module.named_modules(remove_duplicate=False):
            surrounding = self.modules[name.rpartition(".")[0]] if name else policy
            match = next(((value, s, default) for m, value, s, default in entries if m(name, sub)), None)
            self.modules[name] = surrounding if match is None else _apply(match[0], surrounding)
            if match is not None and match[0] is not None:
                self.own[name] = self.modules[name]
                if match[2]:
                    self.defaults.add(name)
        patterns = [(m, v) for m, v, from_string, _ in entries if from_string]
        self.params = [name for name, _ in module.named_parameters()]
        self.buffers = [name for name, _ in module.named_buffers() if _is_persistent(module, name)]
        self.tensors = {name: self._tensor_policy(name, patterns) for name in self.params + self.buffers}
        self.aliases = {a: m for a, m in tied_names(module).items() if m in self.tensors}
        self.alias_policies = {a: self._tensor_policy(a, patterns) for a in self.aliases}

    def _tensor_policy(self, name: str, patterns: list[tuple[_Matcher, ModulePolicy]]) -> Policy:
        """A tensor's storage follows the first name pattern matching it; its use, its module's policy.

        The module computes with all of its tensors in its own compute dtype (a float32 bias in a bf16
        Linear is cast to bf16 there), so the result keeps the pattern's ``param_dtype`` and
        ``reduce_dtype`` and takes ``compute_dtype`` and ``output_dtype`` from the owning module.
        """
        owner = self.modules[name.rpartition(".")[0]]
        value = next((v for m, v in patterns if m(name, None)), None)  # type: ignore[arg-type]
        if value is None:
            return owner
        own = _apply(value, owner)
        return Policy(own.param_dtype, owner.compute_dtype, owner.output_dtype, own.reduce_dtype)

    def forward_dtype(self, name: str, autocast: bool) -> torch.dtype:
        """The dtype a floating tensor enters the forward pass in (under autocast, half casts are left to it)."""
        policy = self.alias_policies[name] if name in self.aliases else self.tensors[name]
        if autocast and policy.compute_dtype in HALF:
            return policy.param_dtype
        return policy.compute_dtype


def tied_names(module: nn.Module) -> dict[str, str]:
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
    check_module(module)
    plan = Plan(module, get_policy(policy), module_policies)
    return {**plan.tensors, **plan.alias_policies}


def check_module(module: Any) -> None:
    """Refuse anything but an ``nn.Module`` (``functionalize``'s argument)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"functionalize: expected a torch.nn.Module, got {type(module).__name__}")
