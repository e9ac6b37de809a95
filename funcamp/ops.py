"""Per-op precision: run chosen torch functions in another dtype than the surrounding computation.

A policy says which dtype a *module* computes in; some *ops* need another. Two reasons:

* **Accuracy.** Some backward passes add many contributions into one element in the dtype of the
  forward's inputs: the gradient of an embedding row used 4096 times is a sum of 4096 terms, and
  bfloat16 (8 bits of mantissa) stops adding equal terms after 256. Measured on the CPU with bfloat16
  inputs, the relative error of such gradients against float64 grows from 2e-3 (16 contributions) to
  0.5 (4096): silently wrong. :data:`FLOAT32_ACCUMULATION` lists these op families; funcamp's casting
  mode (``funcamp.nn.functionalize``) runs them in float32 and hands their outputs back in the compute
  dtype, so the accumulation happens in float32 and the result is rounded once.
* **Speed.** Some ops are slower in a half dtype on some hardware (CPU attention without AMX):
  ``{"scaled_dot_product_attention": torch.float32}`` runs attention in float32 inside a bfloat16 model.

:class:`OpPolicies` is a ``torch.overrides.TorchFunctionMode``: it sees each torch function call
(``torch.*``, ``torch.nn.functional.*`` and ``Tensor`` methods) above autograd, so its casts are part
of the differentiated graph; ``torch.compile(fullgraph=True)`` traces it (no graph break), and
``torch.func`` transforms compose with it. A matched call casts its floating tensor arguments (also
inside lists and tuples) to the rule's dtype, runs with ``torch.autocast`` disabled (so that the rule
wins in autocast mode too), and casts its floating tensor outputs back to the dtype of its first
floating argument, except a loss's (:data:`LOSSES`: ``cross_entropy``, ``nll_loss``, ...), which is never
handed back narrower than the rule computed it: a bfloat16 model's own loss under the float32
``cross_entropy`` rule is float32, not the float32 value rounded to bfloat16. Integer and bool tensors
(indices, masks) are never cast.

Unlike ``torch.autocast``, whose op lists are fixed per device, rules are yours to set, and outputs go
back to the surrounding dtype (autocast's float32 ops return float32; here only the losses do).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from funcamp import policy as _policy

__all__ = ["FLOAT32_ACCUMULATION", "LOSSES", "OpPolicies", "OpRule", "with_op_policies"]

#: A rule: a dtype (or its name), or ``fn(*args, **kwargs) -> dtype | None`` (None: leave the call alone).
OpRule = torch.dtype | str | Callable[..., torch.dtype | None]

_HALF = (torch.float16, torch.bfloat16)

# Names under which one op reaches __torch_function__ (function, method, in-place and operator forms).
_ALIASES: dict[str, tuple[str, ...]] = {
    "matmul": ("matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "linear", "addmm", "baddbmm"),
    "softmax": ("softmax", "_softmax"),
    "log_softmax": ("log_softmax", "_log_softmax"),
    "getitem": ("__getitem__",),
}


def _half_index(*args: Any, **kwargs: Any) -> torch.dtype | None:
    """float32 for ``x[idx]`` on a half ``x`` with an integer or bool tensor index (its backward is an
    accumulating scatter); None for slices and Python ints, which are views and accumulate nothing."""
    x, index = args[0], args[1]
    items = index if isinstance(index, tuple) else (index,)
    if isinstance(x, torch.Tensor) and x.dtype in _HALF and any(isinstance(i, torch.Tensor) for i in items):
        return torch.float32
    return None


def _when_half(*args: Any, **kwargs: Any) -> torch.dtype | None:
    """float32 when the call has a half-precision floating tensor argument, else leave it alone."""
    return torch.float32 if any(t.dtype in _HALF for t in _floating_tensors((args, kwargs))) else None


#: Op families whose backward (or forward) accumulates many terms into one element in the input dtype.
#: Each runs in float32 when it sees half-precision inputs. Measured with bfloat16 inputs on the CPU
#: (tests/test_ops.py): without the rule, the gradient error against float64 at 4096 contributions is
#: 0.5 (embedding, embedding_bag, advanced indexing) and 2e-2 (log_softmax over 4096 classes).
FLOAT32_ACCUMULATION: dict[str, OpRule] = {
    "embedding": _when_half,  # backward: rows used many times
    "embedding_bag": _when_half,
    "getitem": _half_index,  # x[idx]: backward index_put(accumulate=True)
    "index_select": _when_half,  # backward index_add (atomics on CUDA)
    "gather": _when_half,  # backward scatter_add
    "take_along_dim": _when_half,
    "index_add": _when_half,
    "scatter_add": _when_half,
    "index_put": _when_half,
    "scatter_reduce": _when_half,
    "cumsum": _when_half,  # a running sum along a dimension
    "cumprod": _when_half,
    "logcumsumexp": _when_half,
    "softmax": _when_half,  # sums of exp over the last dimension, and their backward
    "log_softmax": _when_half,
    "cross_entropy": _when_half,
    "nll_loss": _when_half,
}


#: ``torch.nn.functional``'s losses: under a rule, their outputs come back in the wider of the rule's dtype and the
#: surrounding one (``torch.promote_types``), as ``torch.autocast`` returns its float32 losses in float32. Before,
#: the float32 ``cross_entropy`` rule rounded a bfloat16 T5's own loss (``labels=``) to bfloat16: 4.65625 for the
#: float32 4.6697 of the same logits, and the eager and compiled steps parted at that rounding.
LOSSES = frozenset(
    {
        "cross_entropy",
        "nll_loss",
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "kl_div",
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "poisson_nll_loss",
        "gaussian_nll_loss",
        "ctc_loss",
        "soft_margin_loss",
        "multilabel_soft_margin_loss",
        "multi_margin_loss",
        "multilabel_margin_loss",
        "margin_ranking_loss",
        "hinge_embedding_loss",
        "cosine_embedding_loss",
        "triplet_margin_loss",
        "triplet_margin_with_distance_loss",
    }
)


def _floating_tensors(tree: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.is_floating_point():
                out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y)

    visit(tree)
    return out


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_cast(y, dtype) for y in x)
    return x


def _check_rule(name: Any, rule: Any) -> OpRule:
    if isinstance(rule, str):
        rule = _policy._parse_dtype(rule, f"the op rule for {name!r}")
    if isinstance(rule, torch.dtype):
        if not rule.is_floating_point or rule.is_complex:
            raise ValueError(f"OpPolicies: the rule for {name!r} must be a floating dtype, got {rule}")
        return rule
    if callable(rule):
        return rule
    raise TypeError(
        f"OpPolicies: the rule for {name!r} must be a torch.dtype, a dtype name or a callable "
        f"fn(*args, **kwargs) -> dtype | None, got {type(rule).__name__}"
    )


def _names(key: Any) -> tuple[str, ...]:
    if isinstance(key, str):
        if not key:
            raise ValueError("OpPolicies: an op name must not be empty")
        return _ALIASES.get(key, (key,))
    name = getattr(key, "__name__", None)
    if not callable(key) or not isinstance(name, str):
        raise TypeError(
            f"OpPolicies: keys must be op names (e.g. 'scaled_dot_product_attention', 'softmax', 'matmul') "
            f"or torch functions, got {key!r}"
        )
    return (name,)


class OpPolicies(TorchFunctionMode):
    """A context manager that runs the named torch functions in the dtypes their rules give.

    Args:
      rules: ``{op: rule}``. ``op`` is a torch function (``torch.nn.functional.softmax``) or its name
        (``"scaled_dot_product_attention"``, ``"cross_entropy"``); ``"matmul"`` also covers ``@``,
        ``mm``, ``bmm``, ``linear``, ``addmm`` and ``baddbmm``, ``"getitem"`` covers ``x[...]``. A
        rule is a floating dtype or its name (``"float32"``), or ``fn(*args, **kwargs) -> dtype |
        None`` that sees the call's arguments (shapes and dtypes; not values, so that it traces) and
        returns None to leave that call alone, e.g. matmuls below a size:
        ``{"matmul": lambda a, b, *r, **k: torch.float32 if b.numel() < 4096 else None}``. A rule
        ``None`` removes the rule an earlier key of the mapping set for that op (``{**defaults,
        "softmax": None}``).
    Raises:
      TypeError: if a key is neither a name nor a named callable, or a rule is not a dtype, a name or
        a callable.
      ValueError: if a dtype name is unknown, a rule's dtype is not floating, or a name is empty.

    Example:
      >>> import torch.nn.functional as F
      >>> x = torch.randn(2, 8, dtype=torch.bfloat16)
      >>> with OpPolicies({"softmax": torch.float32}):
      ...     y = F.softmax(x, dim=-1)   # computed in float32, returned in bfloat16
      >>> y.dtype
      torch.bfloat16
    """

    def __init__(self, rules: Mapping[Any, OpRule | None]) -> None:
        super().__init__()
        if type(rules) is _Checked:  # an earlier instance's rules (checked_rules): the same rules, not checked again
            self.rules = rules
            return
        if not isinstance(rules, Mapping):
            raise TypeError(f"OpPolicies: rules must be a mapping {{op: rule}}, got {type(rules).__name__}")
        self.rules: dict[str, OpRule] = {}
        for key, rule in rules.items():
            names = _names(key)
            if rule is None:  # no rule: removes one given earlier in the mapping (a default)
                for name in names:
                    self.rules.pop(name, None)
                continue
            checked = _check_rule(key, rule)
            for name in names:
                self.rules[name] = checked

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Asked of every op a forward under the policy runs, and traced for each by torch.compile: the op without a
        # rule in a few instructions, the rest in _ruled (22 traced instructions an op, where 30 were).
        rule = self.rules.get(getattr(func, "__name__", ""))
        if rule is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        return self._ruled(rule, func, args, kwargs or {})

    def _ruled(self, rule: OpRule, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)`` under ``rule``: its floating tensors cast to the rule's dtype, and back."""
        dtype = rule if isinstance(rule, torch.dtype) else rule(*args, **kwargs)
        floating = _floating_tensors((args, kwargs))
        if dtype is None or not floating or all(t.dtype == dtype for t in floating):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        back = torch.promote_types(dtype, floating[0].dtype) if name in LOSSES else floating[0].dtype
        args = tuple(_cast(a, dtype) for a in args)
        kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        device_type = floating[0].device.type
        # A device autocast does not know (meta: funcamp.capture's stand-in) has no autocast to switch off.
        if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type, enabled=False):
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        return _cast(out, back)


class _Checked(dict):
    """Rules by op name that :class:`OpPolicies` has checked (:func:`checked_rules`)."""


def checked_rules(rules: Mapping[Any, OpRule | None]) -> Mapping[str, OpRule]:
    """``rules`` checked once, by op name, for entering :class:`OpPolicies` again and again without checking them
    each time: a mode entered in every forward (``funcamp.nn.functionalize``'s, :func:`with_op_policies`) is
    traced by ``torch.compile`` with the forward, and the checks it would run there make no graph node.

    Raises:
      as :class:`OpPolicies`.
    """
    return _Checked(OpPolicies(rules).rules)


def with_op_policies(fn: Callable[..., Any], rules: Mapping[Any, OpRule]) -> Callable[..., Any]:
    """``fn`` run under :class:`OpPolicies` ``(rules)``: the same arguments and results, per-op dtypes.

    Args:
      fn: any function, e.g. an ``apply_fn`` from ``funcamp.nn.functionalize``.
      rules: as :class:`OpPolicies`.
    Returns:
      The wrapped function (pure if ``fn`` is).
    Raises:
      TypeError: if ``fn`` is not callable (and as :class:`OpPolicies` for ``rules``).
    """
    if not callable(fn):
        raise TypeError(f"with_op_policies: fn must be callable, got {type(fn).__name__}")
    checked = checked_rules(rules)  # checked now, not at the first call, nor at each

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with OpPolicies(checked):
            return fn(*args, **kwargs)

    wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapped
