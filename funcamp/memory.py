"""Memory footprints: the bytes of parameters and buffers, and what a precision policy stores and computes.

:func:`memory_footprint` counts what Hugging Face's ``model.get_memory_footprint()`` counts (parameters,
tied ones once, plus buffers) for a module, or the tensor leaves of any pytree. :func:`memory_report`
splits the bytes by dtype: what the master copy holds between steps, and the compute-dtype copies of
the parameters that a forward pass under the policy makes, fp8 copies included (:mod:`funcamp.fp8`
layers). Both take ``apply_fn=`` (what :func:`funcamp.nn.functionalize` returned) to count the frozen
tensors ``apply_fn`` holds, int8 weights (:class:`funcamp.quant.Int8Weight`) with their float32 scales,
and the copies its forward really makes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from funcamp import _tree, fp8
from funcamp.policy import Policy, get_policy
from funcamp.quant import Int8Weight

__all__ = ["MemoryReport", "memory_footprint", "memory_report"]

PolicyArg = Policy | str | Mapping[str, Policy | str] | None


def _nbytes(tensor: torch.Tensor | Int8Weight) -> int:
    if isinstance(tensor, Int8Weight):
        return _nbytes(tensor.qdata) + _nbytes(tensor.absmax)
    return tensor.numel() * tensor.element_size()


def _frozen_of(apply_fn: Any) -> Mapping[str, Any]:
    frozen = getattr(apply_fn, "frozen", None)
    if not callable(apply_fn) or not isinstance(frozen, Mapping) or not hasattr(apply_fn, "forward_dtypes"):
        raise TypeError(
            f"memory: apply_fn must be the function funcamp.nn.functionalize returned, got {type(apply_fn).__name__}"
        )
    return frozen


def memory_footprint(tree_or_module: Any, *, buffers: bool = True, apply_fn: Any = None) -> int:
    """Bytes held by a module's parameters and buffers, or by the tensor leaves of a pytree.

    For a module this is ``model.get_memory_footprint(return_buffers=buffers)`` of Hugging Face
    transformers: ``numel * element_size`` of each parameter (a tied parameter once) plus each buffer.
    For a pytree (the ``params`` that :func:`funcamp.nn.functionalize` returns, a train state) it is
    :func:`funcamp.tree_bytes`. Views are counted at their own size, not their storage's.

    With ``apply_fn`` (from :func:`funcamp.nn.functionalize`), the frozen tensors it holds
    (``apply_fn.frozen``) are added: int8 weights as ``qdata`` (1 byte per element) plus their float32
    scales (4 bytes per output channel). transformers' ``get_memory_footprint`` of a ``load_in_8bit``
    model counts the int8 weights but not bitsandbytes' scales (``SCB``, an attribute, not a parameter).

    Args:
      tree_or_module: an ``nn.Module`` or a pytree whose tensor leaves are counted (``params``).
      buffers: for a module, whether to count its buffers too (ignored for a pytree).
      apply_fn: optional; a function returned by ``functionalize``, whose frozen tensors are added.
    Returns:
      The size in bytes, a Python int.
    Raises:
      TypeError: if ``apply_fn`` is not a function ``functionalize`` returned.

    Example:
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
      >>> memory_footprint(model)  # (16 + 4 + 4 + 4) * 4 float32 params, 8 float32 stats, one int64
      152
      >>> memory_footprint({"w": torch.zeros(4, 4, dtype=torch.bfloat16), "step": 3})
      32
    """
    held = 0 if apply_fn is None else _tree.tree_bytes(dict(_frozen_of(apply_fn)))
    if isinstance(tree_or_module, nn.Module):
        total = sum(_nbytes(p) for p in tree_or_module.parameters())
        if buffers:
            total += sum(_nbytes(b) for b in tree_or_module.buffers())
        return total + held
    return _tree.tree_bytes(tree_or_module) + held


def _format_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes by dtype that a model holds, and that its forward pass adds, under a precision policy.

    Attributes:
      stored: bytes of the master parameters and buffers between steps, by dtype (floating parameters
        and persistent buffers in their policy's ``param_dtype``; integer tensors and non-persistent
        buffers as they are).
      compute: bytes of the compute-dtype copies of floating parameters and persistent buffers that
        a forward pass makes, by dtype (none where ``compute_dtype == param_dtype``), and the fp8
        copies of the :mod:`funcamp.fp8` layers (float8_e4m3fn, with float32 inverse scales; see
        :func:`memory_report`). Activations (but the fp8 copies of the fp8 layers' inputs, when
        ``tokens`` is given), gradients and optimizer state are not included.
      policy: the policy as text; for per-name policies, the one holding the most bytes and how many
        tensors follow others; ``None`` without a policy.
    """

    stored: dict[torch.dtype, int]
    compute: dict[torch.dtype, int]
    policy: str | None = None

    @property
    def stored_bytes(self) -> int:
        """Total bytes stored."""
        return sum(self.stored.values())

    @property
    def compute_bytes(self) -> int:
        """Total bytes of compute copies."""
        return sum(self.compute.values())

    @property
    def total_bytes(self) -> int:
        """Stored plus compute-copy bytes: the peak for parameters during a forward pass."""
        return self.stored_bytes + self.compute_bytes

    def __str__(self) -> str:
        dtypes = sorted({*self.stored, *self.compute}, key=lambda d: (not d.is_floating_point, -d.itemsize, str(d)))

        def cell(table: dict[torch.dtype, int], dtype: torch.dtype) -> str:
            return _format_bytes(table[dtype]) if dtype in table else "-"

        rows = [("dtype", "stored", "compute copies")]
        rows += [(_dtype_name(d), cell(self.stored, d), cell(self.compute, d)) for d in dtypes]
        rows.append(("total", _format_bytes(self.stored_bytes), _format_bytes(self.compute_bytes)))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}" for r in rows]
        title = f"memory ({self.policy})" if self.policy else "memory"
        return "\n".join([title, *lines])


def _named_tensors(tree_or_module: Any) -> Iterator[tuple[str | None, torch.Tensor | Int8Weight, bool, bool]]:
    """``(name, tensor, follows_policy, first_use)`` for everything counted.

    Names are None in a nested tree. An :class:`Int8Weight` value of a flat dict comes whole. A tied
    parameter of a module comes once per name, with ``first_use`` False after the first (it is stored
    once but cast once per use).
    """
    if isinstance(tree_or_module, nn.Module):
        seen: set[int] = set()
        for name, p in tree_or_module.named_parameters(remove_duplicate=False):
            yield name, p, True, id(p) not in seen
            seen.add(id(p))
        for name, b in tree_or_module.named_buffers():
            prefix, _, leaf = name.rpartition(".")
            owner = tree_or_module.get_submodule(prefix)
            yield name, b, leaf not in owner._non_persistent_buffers_set, True
        return
    if isinstance(tree_or_module, Mapping) and all(isinstance(k, str) for k in tree_or_module):
        for name, leaf in tree_or_module.items():
            if isinstance(leaf, Int8Weight):
                yield name, leaf, True, True
                continue
            for x in _tree.tree_leaves(leaf):
                if isinstance(x, torch.Tensor):
                    yield name, x, True, True
        return
    for x in _tree.tree_leaves(tree_or_module):
        if isinstance(x, torch.Tensor):
            yield None, x, True, True


def _policy_for(policy: Any, name: str | None) -> Policy:
    if not isinstance(policy, Mapping):
        return policy
    if name is None:
        raise TypeError(
            "memory_report: per-name policies need a module or a flat dict of tensors by name "
            "(such as the params funcamp.nn.functionalize returns)"
        )
    if name not in policy:
        raise ValueError(
            f"memory_report: no policy for {name!r}; pass funcamp.nn.param_policies(model, policy) "
            "for the model these tensors belong to"
        )
    return get_policy(policy[name])


def _fp8_layers(tree_or_module: Any, model: nn.Module | None) -> list[Any]:
    """The fp8 layers of the module (once each), or of ``model`` for a pytree of its tensors."""
    if isinstance(tree_or_module, nn.Module):
        if model is not None and model is not tree_or_module:
            raise TypeError("memory_report: model= is for a pytree of a model's tensors; here the module is given")
        model = tree_or_module
    elif model is None:
        names = [path.rpartition(".")[2] for path in _tree.tree_paths(tree_or_module)]
        delayed = sorted({n for n in names if n.startswith("fp8_amax_history_") or n.startswith("fp8_scale_")})
        if delayed:
            raise TypeError(
                f"memory_report: these tensors include fp8 recipe state ({', '.join(delayed)}); pass model= (the "
                "fp8.convert-ed module they came from) so that the fp8 copies of its layers are counted"
            )
        return []
    elif not isinstance(model, nn.Module):
        raise TypeError(
            f"memory_report: model must be an nn.Module (the one functionalized), got {type(model).__name__}"
        )
    return [m for m in model.modules() if isinstance(m, (fp8.Float8Linear, fp8.Float8Conv1D))]


def _add_fp8_copies(compute: dict[torch.dtype, int], layers: list[Any], tokens: int | None) -> None:
    """Per-tensor recipes: every layer's copies (kept until the backward); rowwise: the largest layer's
    (freed when its call returns, so one layer's at a time)."""
    largest: dict[torch.dtype, int] = {}
    for layer in layers:
        copies = layer.fp8_copy_bytes(tokens)
        if layer.keeps_fp8_copies:
            for dtype, n in copies.items():
                _add(compute, dtype, n)
        elif sum(copies.values()) > sum(largest.values()):
            largest = copies
    for dtype, n in largest.items():
        _add(compute, dtype, n)


def _check_tokens(tokens: Any) -> None:
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1):
        raise ValueError(
            f"memory_report: tokens must be None or an int >= 1 (the rows entering each fp8 layer: batch x "
            f"sequence), got {tokens!r}"
        )


def memory_report(
    tree_or_module: Any,
    policy: PolicyArg = None,
    *,
    apply_fn: Any = None,
    model: nn.Module | None = None,
    tokens: int | None = None,
) -> MemoryReport:
    """Bytes by dtype that a model stores, and the compute copies it makes, under a precision policy.

    Every floating parameter (and persistent buffer, and floating leaf of a pytree) is counted in its
    policy's ``param_dtype`` under ``stored``, and, where the policy's ``compute_dtype`` differs, once
    more in the compute dtype under ``compute``: the copy :func:`funcamp.nn.functionalize`'s
    ``apply_fn`` casts it to. A tied parameter of a module (GPT-2's embedding and LM head) is stored
    once and copied once per use, as ``apply_fn`` does. Integer tensors and non-persistent buffers are
    counted as they are.
    Without a policy, ``stored`` is what the tensors hold now and ``compute`` has only fp8 copies. An
    :class:`funcamp.quant.Int8Weight` value of a flat dict is stored as it is (int8 data and float32
    scales) and, under a policy, copied once in the compute dtype (its dequantized weight).

    With ``apply_fn`` (instead of a policy), ``tree_or_module`` is the ``params`` (and, merged in, the
    ``buffers``) that :func:`funcamp.nn.functionalize` returned with it: ``stored`` counts them as they
    are plus the frozen tensors ``apply_fn`` holds (int8 weights with their scales), and ``compute``
    the copies a call makes, from the dtype each tensor really enters the forward in
    (``apply_fn.forward_dtypes``): a float32 master used in bfloat16, a dequantized int8 weight, each
    use of a tied weight that needs a cast of its own.

    fp8 layers (:class:`funcamp.fp8.Float8Linear`, :class:`funcamp.fp8.Float8Conv1D`, found in the
    module, or in ``model`` when ``tree_or_module`` is a pytree of its tensors) add their fp8 copies to
    ``compute``, with or without a policy: per layer, the float8_e4m3fn weight (``N * K`` bytes) and its
    float32 inverse scale (4 bytes; ``4 * N`` rowwise), and with ``tokens`` (``M``, the rows of each fp8
    layer's input, batch times sequence) the float8_e4m3fn input (``M * K``) and its inverse scale (4;
    ``4 * M`` rowwise) (:meth:`funcamp.fp8.Float8Linear.fp8_copy_bytes`). The ``tensorwise`` and
    ``delayed`` recipes keep these copies until the backward, so every layer's counts; ``rowwise``
    frees them when the layer returns, so only the largest layer's counts (one at a time). Their
    delayed-recipe state is a persistent float32 buffer, counted in ``stored``. Under
    ``fp8.MODULE_POLICIES`` the fp8 layers' weights enter in float32 (no bfloat16 copy). Not counted: a
    cast's float32 temporaries in eager mode, and the backward's casts, which live one layer at a time.
    torchao's ``Float8Linear`` also keeps one fp8 copy of each operand per call (it saves the
    high-precision tensors and casts them again in the backward).

    Args:
      tree_or_module: an ``nn.Module`` or a pytree of tensors.
      policy: a Policy, a policy string, a dict from names (``named_parameters`` names, or the keys of
        a flat dict) to policies such as :func:`funcamp.nn.param_policies` returns, which knows that
        normalisation layers stay in float32; or None.
      apply_fn: optional; the function ``functionalize`` returned with ``tree_or_module``.
      model: for a pytree ``tree_or_module``, the module it came from (the ``fp8.convert``-ed model
        given to ``functionalize``), to find its fp8 layers; None for a module. A pytree alone does
        not tell which tensors belong to ``tensorwise`` or ``rowwise`` fp8 layers (they have no state):
        without ``model`` their copies are missing; the ``delayed`` state is seen and refused.
      tokens: the rows of the input of each fp8 layer (batch times sequence), to count the fp8 copies
        of the inputs too; None counts the weights' copies only.
    Returns:
      A :class:`MemoryReport`; ``str()`` of it is a table.
    Raises:
      TypeError: if per-name policies are given with a nested pytree; if both ``policy`` and
        ``apply_fn`` are given, or ``apply_fn`` is not a function ``functionalize`` returned.
      TypeError: if a pytree holds fp8 recipe state (``fp8_amax_history_*``, ``fp8_scale_*``) and
        ``model`` is not given, or ``model`` is given with a module or is not an ``nn.Module``.
      ValueError: if ``tokens`` is not None or an int >= 1.
      ValueError: with ``apply_fn``, if a name of ``tree_or_module`` is not one of its parameters or
        buffers.
      ValueError: if a policy string does not parse, or a floating tensor has no per-name policy.

    Example:
      >>> model = torch.nn.Linear(1024, 1024)
      >>> report = memory_report(model, "params=float32,compute=bfloat16,output=float32")
      >>> report.stored_bytes, report.compute_bytes
      (4198400, 2099200)
      >>> print(report)
      memory (params=float32,compute=bfloat16,output=float32)
      dtype      stored  compute copies
      float32   4.0 MiB               -
      bfloat16        -         2.0 MiB
      total     4.0 MiB         2.0 MiB
    """
    _check_tokens(tokens)
    layers = _fp8_layers(tree_or_module, model)
    report = _report(tree_or_module, policy, apply_fn)
    _add_fp8_copies(report.compute, layers, tokens)
    return report


def _report(tree_or_module: Any, policy: PolicyArg, apply_fn: Any) -> MemoryReport:
    """:func:`memory_report` without the fp8 copies."""
    if apply_fn is not None:
        if policy is not None:
            raise TypeError("memory_report: give either a policy or apply_fn (whose dtypes are the policy's), not both")
        return _report_of_apply_fn(tree_or_module, apply_fn)
    if isinstance(policy, Mapping):
        policy_name: str | None = None  # set below, from the bytes under each policy
    elif policy is not None:
        policy = get_policy(policy)
        policy_name = str(policy)
    else:
        policy_name = None
    stored: dict[torch.dtype, int] = {}
    compute: dict[torch.dtype, int] = {}
    by_policy: dict[str, list[int]] = {}  # policy text -> [bytes, tensors]
    for name, tensor, follows, first_use in _named_tensors(tree_or_module):
        if isinstance(tensor, Int8Weight):  # stored as it is; under a policy, dequantized to compute dtype
            _add(stored, torch.int8, _nbytes(tensor.qdata))
            _add(stored, tensor.absmax.dtype, _nbytes(tensor.absmax))
            if policy is not None:
                _add(compute, _policy_for(policy, name).compute_dtype, tensor.qdata.numel() * _itemsize(policy, name))
            continue
        if policy is None or not follows or not tensor.is_floating_point():
            if first_use:
                _add(stored, tensor.dtype, _nbytes(tensor))
            continue
        p = _policy_for(policy, name)
        if first_use:
            _add(stored, p.param_dtype, tensor.numel() * p.param_dtype.itemsize)
            count = by_policy.setdefault(str(p), [0, 0])
            count[0] += tensor.numel() * p.param_dtype.itemsize
            count[1] += 1
        if p.compute_dtype != p.param_dtype:
            _add(compute, p.compute_dtype, tensor.numel() * p.compute_dtype.itemsize)
    if isinstance(policy, Mapping):
        policy_name = _describe(by_policy)
    return MemoryReport(stored, compute, policy_name)


def _add(table: dict[torch.dtype, int], dtype: torch.dtype, n: int) -> None:
    table[dtype] = table.get(dtype, 0) + n


def _describe(by_policy: dict[str, list[int]]) -> str | None:
    """The policy holding the most bytes, and how many tensors follow other policies."""
    if not by_policy:
        return None
    main = max(by_policy, key=lambda text: by_policy[text][0])
    others = sum(n for text, (_, n) in by_policy.items() if text != main)
    return main if not others else f"{main}; {others} tensors under other policies"


def _itemsize(policy: Any, name: str | None) -> int:
    return _policy_for(policy, name).compute_dtype.itemsize


def _report_of_apply_fn(tree: Any, apply_fn: Any) -> MemoryReport:
    """:func:`memory_report` with ``apply_fn``: stored as held, copies as ``apply_fn``'s forward makes them."""
    frozen = _frozen_of(apply_fn)
    dtypes: Mapping[str, torch.dtype] = apply_fn.forward_dtypes
    aliases: Mapping[str, str] = getattr(apply_fn, "aliases", {})
    if not isinstance(tree, Mapping) or not all(isinstance(k, str) for k in tree):
        raise TypeError(
            "memory_report: with apply_fn, pass the flat dict of params (and buffers) functionalize returned, "
            f"got {type(tree).__name__}"
        )
    unknown = sorted(set(tree) - set(dtypes))
    if unknown:
        raise ValueError(
            f"memory_report: {unknown[:6]} are not parameters or buffers of this apply_fn; pass the params "
            "functionalize returned with it"
        )
    stored: dict[torch.dtype, int] = {}
    compute: dict[torch.dtype, int] = {}
    source: dict[str, torch.dtype] = {}  # name -> the dtype a tied use is cast from (stored, or dequantized)
    for name, t in [*tree.items(), *frozen.items()]:
        if isinstance(t, Int8Weight):
            _add(stored, torch.int8, _nbytes(t.qdata))
            _add(stored, t.absmax.dtype, _nbytes(t.absmax))
            _add(compute, dtypes[name], t.qdata.numel() * dtypes[name].itemsize)
            source[name] = dtypes[name]
            continue
        _add(stored, t.dtype, _nbytes(t))
        if t.is_floating_point() and dtypes[name] != t.dtype:
            _add(compute, dtypes[name], t.numel() * dtypes[name].itemsize)
        source[name] = t.dtype
    for alias, name in aliases.items():  # each use of a tied tensor is cast from its first name's
        t = frozen.get(name, tree.get(name))
        if t is not None and dtypes[alias] != source[name]:
            numel = t.qdata.numel() if isinstance(t, Int8Weight) else t.numel()
            if isinstance(t, Int8Weight) or t.is_floating_point():
                _add(compute, dtypes[alias], numel * dtypes[alias].itemsize)
    return MemoryReport(stored, compute, "as functionalize's apply_fn holds and casts them")
