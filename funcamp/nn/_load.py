"""The way back into the module: trained ``params`` (and buffers) as a state dict of the original ``nn.Module``.

:func:`functionalize` hands out a tied parameter once (under its first name), keeps frozen tensors in
``apply_fn.frozen`` (int8 ones as :class:`funcamp.quant.Int8Weight`) and masters in the policy's param
dtype; ``model.load_state_dict(params, strict=True)`` refuses all three. :func:`state_dict` undoes them
for the module at hand, and :func:`load_into` loads the result.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from funcamp import quant
from funcamp.nn._plan import tied_names

__all__ = ["load_into", "state_dict"]

# The recipe state that funcamp.fp8's layers (Float8Linear, Float8Conv1D, delayed recipe) keep as persistent
# buffers: f"fp8_amax_history_{role}" and f"fp8_scale_{role}" for role in funcamp.fp8._ROLES (a test checks
# that the two agree). A plain Linear or Conv1D of the module you load into has no place for it.
_FP8_STATE = ("fp8_amax_history_input", "fp8_amax_history_weight", "fp8_scale_input", "fp8_scale_weight")


def state_dict(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor] | None = None,
    *,
    frozen: Mapping[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Build the state dict of ``model`` holding trained ``params`` (and buffers), for ``load_state_dict``.

    The result has exactly the keys of ``model.state_dict()``, in its order, so that
    ``model.load_state_dict(result, strict=True)`` (or Hugging Face's ``save_pretrained(dir,
    state_dict=result)``) accepts it:

    - a tied parameter (GPT-2's ``transformer.wte.weight`` and ``lm_head.weight``), which
      :func:`functionalize` keeps once under its first name, appears under each of its names (the same
      tensor, as ``model.state_dict()`` gives it);
    - frozen tensors (functionalize's ``trainable=`` split, ``requires_grad=False``) come from
      ``frozen=``. Frozen weights come back bitwise as the module held them: ``apply_fn.frozen`` holds
      them as ``apply_fn`` uses them, in the compute dtype (bfloat16 roundings under a bfloat16 policy)
      or in int8 (``quantize=``, :class:`funcamp.quant.Int8Weight`), copies from which the weight cannot
      be recovered. Where such a copy is narrower than the module's tensor, the module's own tensor is
      kept if the copy was made from it (it casts, or quantizes, to the copy bitwise: the module
      ``apply_fn`` was made from, or one loaded with the same weights), and the call is refused
      otherwise (a module with other weights: pass the weights themselves, such as
      ``{k: v for k, v in base.state_dict().items() if k in apply_fn.frozen}``; or, to write the
      values ``apply_fn`` computed with, give them in the module's dtype, ``v.float()`` or
      ``funcamp.quant.dequantize_int8(v, torch.float32)``). A frozen value as wide as the module's
      tensor, or wider, is written as any other;
    - layers swapped by :func:`funcamp.fp8.convert` keep their parameters' names, so their weights
      load into the original (unconverted) model and into the converted one alike. The delayed
      recipe's state buffers (``fp8_amax_history_*``, ``fp8_scale_*``) load into a converted model;
      for a layer that is a plain ``nn.Linear`` or Hugging Face ``Conv1D`` in ``model`` they are left
      out (the state of fp8 training, which a plain layer has no place for);
    - each value is cast to the dtype and moved to the device of the module's own tensor. The cast
      is deliberate, not an error: float32 masters trained for a bfloat16 module come back rounded to
      bfloat16 (round to nearest even), as ``load_state_dict`` would copy them anyway. On a module
      built on the ``meta`` device the values stay on their own device (for
      ``load_state_dict(..., assign=True)``).

    Values are detached and not copied where dtype and device already match (they share memory with
    ``params``, as ``model.state_dict()`` shares with the module). Non-persistent buffers are not in a
    state dict and are not touched.

    Args:
      model: the module ``params`` were made from by :func:`funcamp.nn.functionalize`, or another instance
        of the same architecture, or its :func:`funcamp.fp8.convert`-ed copy; not changed.
      params: the trained parameters by first name (``state.params``), tensors of the module's shapes,
        floating ones in any floating dtype.
      buffers: the persistent buffers (``state.buffers``, functionalize's third value), or None for a
        module without them.
      frozen: the frozen tensors (``apply_fn.frozen``): tensors or :class:`funcamp.quant.Int8Weight`;
        None when ``params`` holds every parameter.
    Returns:
      ``{name: tensor}`` with the keys, shapes, dtypes and devices of ``model.state_dict()``.
    Raises:
      TypeError: if ``model`` is not an ``nn.Module``, or ``params``, ``buffers`` or ``frozen`` is not a
        dict of tensors (``frozen``: or ``Int8Weight``), naming the key.
      TypeError: if a floating value is given for an integer (or bool) tensor of the module, or the
        reverse, or an integer value of another integer dtype (``num_batches_tracked`` is int64).
      ValueError: if a name is in two of ``params``, ``buffers`` and ``frozen``, or the names do not
        match the module's (missing ones, unexpected ones, a further name of a tied tensor),
        naming them and saying where they belong.
      ValueError: if a value's shape differs from the module's tensor, naming the key and both shapes.
      ValueError: if a frozen value is narrower than the module's tensor (a compute-dtype copy, an
        ``Int8Weight``) and was not made from it, naming the keys and what to pass.

    Example:
      >>> import funcamp
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
      >>> model[1].weight = model[0].weight  # tied
      >>> apply_fn, params = funcamp.nn.functionalize(model, "params=float32,compute=bfloat16,output=float32")
      >>> sorted(params)  # the tied weight once, under its first name
      ['0.bias', '0.weight', '1.bias']
      >>> sd = state_dict(model, params)
      >>> sorted(sd), sd["1.weight"] is sd["0.weight"]
      (['0.bias', '0.weight', '1.bias', '1.weight'], True)
      >>> model.load_state_dict(sd, strict=True)
      <All keys matched successfully>
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"funcamp.nn.state_dict: expected a torch.nn.Module, got {type(model).__name__}")
    target = model.state_dict()
    aliases = {a: f for a, f in tied_names(model).items() if a in target and f in target}
    given, source = _gather(params, buffers, frozen)
    for name in [n for n in given if n not in target and source[n] == "buffers" and _fp8_state_of_plain(model, n)]:
        del given[name]
    _check_names(model, target, aliases, given, buffers is None, frozen is None)
    _check_frozen(model, target, given, source)
    values = {key: _value(key, given[key], own, source[key]) for key, own in target.items() if key not in aliases}
    return {key: values[aliases.get(key, key)] for key in target}  # a tied name: its first name's tensor


def load_into(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor] | None = None,
    *,
    frozen: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Write trained ``params`` (and buffers, frozen tensors) into ``model``, in place, and return it.

    ``model.load_state_dict(state_dict(model, params, buffers, frozen=frozen), strict=True)`` under
    ``torch.no_grad()``: each tensor of the module is overwritten (copied into, so ties, the
    parameters' ``requires_grad`` and their device stay as they are), cast to its dtype; see
    :func:`state_dict` for ties, frozen, int8 and fp8 tensors and the casts.

    Args:
      model: the module to write into (see :func:`state_dict`); changed in place.
      params: the trained parameters by first name (``state.params``).
      buffers: the persistent buffers (``state.buffers``), or None for a module without them.
      frozen: the frozen tensors (``apply_fn.frozen``), or None when ``params`` holds every parameter.
    Returns:
      ``model`` itself.
    Raises:
      TypeError, ValueError: as :func:`state_dict`, naming the key; the module is then unchanged.
      ValueError: if a tensor of ``model`` is on the ``meta`` device (a copy into it would keep nothing):
        ``model.to_empty(device=...)`` first, or ``model.load_state_dict(state_dict(...), assign=True)``.

    Example:
      >>> import funcamp
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
      >>> apply_fn, params, buffers = funcamp.nn.functionalize(model, "float32", with_buffers=True)
      >>> out, buffers = apply_fn(params, buffers, torch.randn(16, 4))  # a training forward
      >>> params = {k: v + 1 for k, v in params.items()}  # stands for training
      >>> load_into(model, params, buffers) is model
      True
      >>> bool((model[0].bias == params["0.bias"]).all()), int(model[1].num_batches_tracked)
      (True, 1)
    """
    sd = state_dict(model, params, buffers, frozen=frozen)
    meta = [k for k, t in model.state_dict().items() if t.is_meta]
    if meta:
        raise ValueError(
            f"funcamp.nn.load_into: {_sample(meta)} of the module are on the meta device, where a copy keeps "
            "nothing; materialize it first (model.to_empty(device=...)) or call "
            "model.load_state_dict(funcamp.nn.state_dict(model, params, ...), assign=True)"
        )
    with torch.no_grad():
        model.load_state_dict(sd, strict=True)
    return model


# --- helpers ------------------------------------------------------------------------------------------


def _gather(
    params: Any, buffers: Any, frozen: Any
) -> tuple[dict[str, torch.Tensor | quant.Int8Weight], dict[str, str]]:
    """``params``, ``buffers`` and ``frozen`` as one dict, and which of the three each name came from."""
    given: dict[str, Any] = {}
    source: dict[str, str] = {}
    for what, tree in (("params", params), ("buffers", buffers), ("frozen", frozen)):
        if tree is None and what != "params":
            continue
        if not isinstance(tree, Mapping):
            raise TypeError(
                f"funcamp.nn.state_dict: {what} must be a dict of tensors by name (functionalize's {what}"
                f"{', apply_fn.frozen' if what == 'frozen' else ''}), got {type(tree).__name__}"
            )
        for name, value in tree.items():
            if name in given:
                raise ValueError(
                    f"funcamp.nn.state_dict: {name!r} is in both {source[name]} and {what}; a tensor is either "
                    "trainable (params), frozen (apply_fn.frozen) or a buffer"
                )
            kinds = (torch.Tensor, quant.Int8Weight) if what == "frozen" else torch.Tensor
            if not isinstance(value, kinds):
                accepted = "a tensor or a funcamp.quant.Int8Weight" if what == "frozen" else "a tensor"
                raise TypeError(
                    f"funcamp.nn.state_dict: {what}[{name!r}] must be {accepted}, got {type(value).__name__}"
                )
            given[name], source[name] = value, what
    return given, source


def _fp8_state_of_plain(model: nn.Module, name: str) -> bool:
    """Whether ``name`` is fp8 recipe state of a layer that is a plain Linear or Conv1D in ``model``."""
    prefix, _, leaf = name.rpartition(".")
    if leaf not in _FP8_STATE:
        return False
    try:
        layer = model.get_submodule(prefix)
    except AttributeError:
        return False
    return type(layer) is nn.Linear or quant._is_hf_conv1d(layer)


def _check_names(
    model: nn.Module,
    target: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    given: Mapping[str, Any],
    no_buffers: bool,
    no_frozen: bool,
) -> None:
    tied = sorted(n for n in given if n in aliases)
    if tied:
        pairs = ", ".join(f"{n!r} (tied to {aliases[n]!r})" for n in tied[:6])
        raise ValueError(
            f"funcamp.nn.state_dict: {pairs} are further names of tied tensors; give each tied tensor once, under "
            "its first name, as functionalize's params do"
        )
    missing = [k for k in target if k not in aliases and k not in given]
    unexpected = sorted(n for n in given if n not in target)
    if not missing and not unexpected:
        return
    buffer_names = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    hints = []
    if any(k in buffer_names for k in missing) and no_buffers:
        hints.append("the module has persistent buffers: pass buffers (state.buffers, functionalize's third value)")
    if any(k not in buffer_names for k in missing) and no_frozen:
        hints.append(
            "if the missing parameters were frozen (trainable=, requires_grad=False, quantize=), pass "
            "frozen=apply_fn.frozen"
        )
    if unexpected:
        hints.append("names the module does not have: are these the params of another model (or of its fp8 copy)?")
    raise ValueError(
        f"funcamp.nn.state_dict: the names do not match {type(model).__name__}'s state dict: missing "
        f"{_sample(missing)}, unexpected {_sample(unexpected)}" + "".join(f"; {h}" for h in hints)
    )


#: Floating dtypes that hold every value of the floating dtypes listed (a cast into them is exact).
_HOLDS = {
    torch.float64: {torch.float32, torch.float16, torch.bfloat16},
    torch.float32: {torch.float16, torch.bfloat16},
}


def _narrower(value: torch.Tensor | quant.Int8Weight, own: torch.Tensor) -> bool:
    """Whether ``value`` cannot hold every value of ``own``'s dtype (an int8 weight, a half copy of float32)."""
    if isinstance(value, quant.Int8Weight):
        return True
    holds = value.dtype == own.dtype or own.dtype in _HOLDS.get(value.dtype, ())
    return value.is_floating_point() and own.is_floating_point() and not holds


def _made_from(value: torch.Tensor | quant.Int8Weight, own: torch.Tensor) -> bool:
    """Whether the narrower copy ``value`` is ``own`` cast (or int8-quantized) as functionalize stores it."""
    if own.is_meta or tuple(value.shape) != tuple(own.shape):
        return False
    own = own.detach().to(value.device)
    if isinstance(value, quant.Int8Weight):
        if own.ndim != 2 or not torch.isfinite(own).all():
            return False
        dims = [d for d in (0, 1) if value.absmax.shape[d] == value.shape[d] and value.absmax.shape[1 - d] == 1]
        return any(_same(quant.quantize_int8(own, d), value) for d in dims)
    return torch.equal(own.to(value.dtype), value)


def _same(a: quant.Int8Weight, b: quant.Int8Weight) -> bool:
    return a.absmax.shape == b.absmax.shape and torch.equal(a.qdata, b.qdata) and torch.equal(a.absmax, b.absmax)


def _check_frozen(
    model: nn.Module, target: Mapping[str, torch.Tensor], given: dict[str, Any], source: Mapping[str, str]
) -> None:
    """Keep the module's own tensor where a narrower frozen copy was made from it; refuse where it was not.

    Replaces such a copy in ``given`` by the module's tensor (so the write is a bitwise no-op).

    Raises:
      ValueError: naming the frozen keys whose narrower copies were made from other weights.
    """
    lossy = [k for k, v in given.items() if source[k] == "frozen" and k in target and _narrower(v, target[k])]
    if not lossy:
        return
    foreign = []
    for key in lossy:
        if _made_from(given[key], target[key]):
            given[key] = target[key]
        else:
            foreign.append(key)
    if foreign:
        key = foreign[0]
        kind = "int8" if isinstance(given[key], quant.Int8Weight) else str(given[key].dtype).removeprefix("torch.")
        raise ValueError(
            f"funcamp.nn.state_dict: frozen {_sample(foreign)} hold {kind} copies (what apply_fn computes with), "
            f"narrower than {type(model).__name__}'s {str(target[key].dtype).removeprefix('torch.')} tensors, and "
            "were not made from the weights this module holds: writing them would replace its weights with their "
            "roundings. Pass the weights themselves (frozen={k: v for k, v in base.state_dict().items() if k in "
            "apply_fn.frozen}, base the module functionalize was given), or, to write the values apply_fn computed "
            "with, give them in the module's dtype (v.float(), funcamp.quant.dequantize_int8(v, torch.float32))"
        )


def _value(key: str, value: torch.Tensor | quant.Int8Weight, own: torch.Tensor, what: str) -> torch.Tensor:
    """``value`` for the module tensor ``own``: checked, cast to its dtype, on its device (meta: left)."""
    if tuple(value.shape) != tuple(own.shape):
        raise ValueError(
            f"funcamp.nn.state_dict: {what}[{key!r}] has shape {tuple(value.shape)}, the module's tensor "
            f"{tuple(own.shape)}: params of another model or configuration, or a sharded state's rows (gather "
            "them first: funcamp.sharding.unshard_params)?"
        )
    device = value.device if own.is_meta else own.device
    if isinstance(value, quant.Int8Weight):
        if not own.is_floating_point():
            raise TypeError(f"funcamp.nn.state_dict: {what}[{key!r}] is an Int8Weight, the module's tensor {own.dtype}")
        return quant.dequantize_int8(value, own.dtype).to(device)
    if value.dtype != own.dtype and (
        not value.is_floating_point() or not own.is_floating_point() or value.is_complex() or own.is_complex()
    ):
        raise TypeError(
            f"funcamp.nn.state_dict: {what}[{key!r}] is {value.dtype}, the module's tensor {own.dtype}; only "
            "floating values are cast (to the module's floating dtype), others must match"
        )
    return value.detach().to(device=device, dtype=own.dtype)


def _sample(names: list[str], n: int = 6) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > n else ''}]"
