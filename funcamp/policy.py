"""Precision policies: which dtype parameters are stored in, computed in, and returned in.

A :class:`Policy` is a frozen, hashable description of four dtypes; its ``cast_to_*`` methods cast the
floating-point leaves of any pytree and leave everything else (integer, bool and complex tensors, Python
numbers, strings, ``None``) as the same objects. :func:`get_policy` parses the strings jmp accepts, plus
torch-style names and presets.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch

from funcamp import _tree, hardware

__all__ = [
    "Policy",
    "cast_to_full",
    "cast_to_half",
    "get_policy",
    "half_dtype",
    "keep_in_float32",
]

T = TypeVar("T")

# Canonical name first: it is what ``str(policy)`` writes.
_DTYPE_NAMES: dict[torch.dtype, tuple[str, ...]] = {
    torch.float16: ("float16", "f16", "fp16", "half", "torch.float16", "torch.half"),
    torch.bfloat16: ("bfloat16", "bf16", "torch.bfloat16"),
    torch.float32: ("float32", "f32", "fp32", "full", "float", "torch.float32", "torch.float"),
    torch.float64: ("float64", "f64", "fp64", "double", "torch.float64", "torch.double"),
}
_NAME_TO_DTYPE = {name: dtype for dtype, names in _DTYPE_NAMES.items() for name in names}

_KEYS = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
    "r": "reduce_dtype",
    "reduce": "reduce_dtype",
}

_PRESETS = {
    "mixed_float16": "params=float32,compute=float16,output=float32",
    "mixed_bfloat16": "params=float32,compute=bfloat16,output=float32",
}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype][0]


def _check_dtype(name: str, dtype: Any) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"Policy: {name} must be a torch.dtype (one of {', '.join(map(str, _DTYPE_NAMES))}), "
            f"got {dtype!r}; use funcamp.get_policy to parse strings"
        )
    if dtype not in _DTYPE_NAMES:
        raise ValueError(
            f"Policy: {name} must be a real floating-point dtype ({', '.join(map(str, _DTYPE_NAMES))}), got {dtype}"
        )


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy: the dtypes of parameters, computation, outputs and gradient reduction.

    Only real floating-point tensor leaves are ever cast; see :meth:`cast_to_compute`.

    Args:
      param_dtype: dtype the master parameters are stored (and updated) in, usually float32.
      compute_dtype: dtype of parameters and floating inputs inside the forward pass.
      output_dtype: dtype of the model's floating outputs.
      reduce_dtype: dtype gradients are all-reduced in for data-parallel training; defaults to
        ``param_dtype`` (as FSDP2's ``MixedPrecisionPolicy``). It is not part of jmp's policy.
    Raises:
      TypeError: if a field is not a ``torch.dtype``.
      ValueError: if a field is not one of float16, bfloat16, float32, float64.

    Example:
      >>> p = Policy(torch.float32, torch.bfloat16, torch.float32)
      >>> str(p)
      'params=float32,compute=bfloat16,output=float32'
      >>> p.cast_to_compute({"x": torch.ones(2), "ids": torch.arange(2)})["x"].dtype
      torch.bfloat16
    """

    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    output_dtype: torch.dtype
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.reduce_dtype is None:
            object.__setattr__(self, "reduce_dtype", self.param_dtype)
        for f in dataclasses.fields(self):
            _check_dtype(f.name, getattr(self, f.name))

    def cast_to_param(self, tree: T) -> T:
        """Cast the floating leaves of ``tree`` to ``param_dtype``; other leaves are returned as is."""
        return _tree.cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """Cast the floating leaves of ``tree`` to ``compute_dtype``; other leaves are returned as is.

        ``tree`` may be any pytree, for example ``(args, kwargs)`` of a call. Integer, bool and complex
        tensors, Python scalars, strings and ``None`` come back as the same objects, and a tensor that
        already has the dtype comes back as the same tensor.
        """
        return _tree.cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        """Cast the floating leaves of ``tree`` to ``output_dtype``; other leaves are returned as is."""
        return _tree.cast_floating(tree, self.output_dtype)

    def cast_to_reduce(self, tree: T) -> T:
        """Cast the floating leaves of ``tree`` to ``reduce_dtype``; other leaves are returned as is."""
        return _tree.cast_floating(tree, self.reduce_dtype)

    def with_output_dtype(self, output_dtype: torch.dtype) -> Policy:
        """A copy of this policy with another ``output_dtype``."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    def with_compute_dtype(self, compute_dtype: torch.dtype) -> Policy:
        """A copy of this policy with another ``compute_dtype``."""
        return dataclasses.replace(self, compute_dtype=compute_dtype)

    def state_dict(self) -> dict[str, str]:
        """The policy as a dict of dtype names, loadable with ``torch.load(weights_only=True)``."""
        return {f.name: _dtype_name(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict[str, str]) -> Policy:
        """Inverse of :meth:`state_dict`.

        Raises:
          ValueError: if a name is not a known dtype name or a key is missing.
        """
        try:
            return cls(**{k: _parse_dtype(v, f"'{k}'") for k, v in state.items()})
        except TypeError as e:
            raise ValueError(f"Policy.from_state_dict: bad keys {sorted(state)}: {e}") from e

    def __str__(self) -> str:
        text = (
            f"params={_dtype_name(self.param_dtype)},compute={_dtype_name(self.compute_dtype)},"
            f"output={_dtype_name(self.output_dtype)}"
        )
        if self.reduce_dtype != self.param_dtype:
            text += f",reduce={_dtype_name(self.reduce_dtype)}"
        return text


# fp8 is not a dtype a whole policy computes in: its matmuls go through funcamp.fp8's layers.
_FP8_HINT = (
    "fp8 runs the matmuls of chosen layers, not a whole policy: write fp8=tensorwise|rowwise|delayed in the "
    "string given to funcamp.nn.functionalize, or use funcamp.fp8.convert with "
    "module_policies=funcamp.fp8.MODULE_POLICIES"
)


def _parse_dtype(value: str, where: str) -> torch.dtype:
    name = value.strip().lower()
    try:
        return _NAME_TO_DTYPE[name]
    except KeyError:
        hint = f". {_FP8_HINT}" if any(k in name for k in ("float8", "fp8", "f8", "e4m3", "e5m2")) else ""
        raise ValueError(
            f"get_policy: unknown dtype {value.strip()!r} in {where}; accepted dtype names: "
            f"{', '.join(sorted(_NAME_TO_DTYPE))}{hint}"
        ) from None


def get_policy(policy: str | Policy) -> Policy:
    """Parse a policy string such as ``"params=float32,compute=bfloat16,output=float32"``.

    The grammar is jmp's: comma-separated ``key=dtype`` parts with keys ``p``/``params``,
    ``c``/``compute``, ``o``/``output`` (and funcamp's ``r``/``reduce``); unspecified params default
    to float32, compute to params, output to compute, reduce to params. A bare dtype name (``"f16"``)
    sets every field. Beyond jmp, funcamp ignores surrounding whitespace and case, accepts torch-style
    names (``fp16``, ``torch.bfloat16``, ``double``) and the presets ``mixed_float16`` and
    ``mixed_bfloat16`` (params float32, compute half, output float32). ``half`` is always float16
    (jmp picks bfloat16 on TPU). ``str(get_policy(s))`` parses back to an equal policy.

    Args:
      policy: a policy string, or a :class:`Policy` (returned unchanged).
    Returns:
      The :class:`Policy`.
    Raises:
      TypeError: if ``policy`` is neither a string nor a Policy.
      ValueError: if the string is empty, has an empty part, a part with no or several ``=``, an
        unknown key, a key given twice, or an unknown dtype name; the message names the bad part
        and lists what is accepted.

    Example:
      >>> get_policy("c=bf16")
      Policy(param_dtype=torch.float32, compute_dtype=torch.bfloat16, output_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    """  # noqa: E501
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"get_policy: expected a policy string or a Policy, got {type(policy).__name__}")
    text = policy.strip()
    if not text:
        raise ValueError(
            "get_policy: empty policy string; expected e.g. 'params=float32,compute=bfloat16,output=float32', "
            f"a dtype name, or a preset ({', '.join(_PRESETS)})"
        )
    text = _PRESETS.get(text.lower(), text)
    if "=" not in text:
        dtype = _parse_dtype(text, f"{policy!r}")
        return Policy(dtype, dtype, dtype)
    fields: dict[str, torch.dtype] = {}
    for part in text.split(","):
        fields.update(_parse_part(part, policy, fields))
    param = fields.get("param_dtype", torch.float32)
    compute = fields.get("compute_dtype", param)
    output = fields.get("output_dtype", compute)
    return Policy(param, compute, output, fields.get("reduce_dtype", param))


def _parse_part(part: str, policy: str, seen: dict[str, torch.dtype]) -> dict[str, torch.dtype]:
    keys = "/".join(_KEYS)
    if part.count("=") != 1:
        what = "an empty part" if not part.strip() else f"part {part.strip()!r}"
        raise ValueError(
            f"get_policy: {what} in {policy!r}; each comma-separated part must be key=dtype with key one of {keys}"
        )
    key, value = (s.strip() for s in part.split("="))
    field = _KEYS.get(key.lower())
    if field is None and key.lower() == "fp8":
        raise ValueError(f"get_policy: fp8= is not a dtype key ({policy!r}); {_FP8_HINT}")
    if field is None:
        raise ValueError(f"get_policy: unknown key {key!r} in {policy!r}; accepted keys: {keys}")
    if field in seen:
        raise ValueError(f"get_policy: {field} given twice in {policy!r}; give each of {keys} at most once")
    return {field: _parse_dtype(value, f"part {part.strip()!r} of {policy!r}")}


def half_dtype(device: str | torch.device | None = None) -> torch.dtype:
    """The dtype to compute in on ``device``: its fast half-precision dtype, or float32 if it has none.

    Decided by :func:`funcamp.hardware.probe` (once per device and process): bfloat16 where the device
    computes it fast, else float16 where that is fast, else **float32**. CUDA: bfloat16 from compute
    capability 8.0, float16 from 7.0. CPU: bfloat16 with AMX, neither on a CPU for which oneDNN has
    no half-precision kernels (AVX2-only CPUs, where a bfloat16 matmul is 20-40x slower than float32),
    and a few-millisecond matmul measurement in between (AVX-512 without AMX). Other devices: measured.

    Unlike jmp's ``half_dtype`` (float16 off TPU) and ``torch.autocast`` on CPU (bfloat16 everywhere),
    this never returns a dtype the device computes slowly; ``funcamp.hardware.probe(device).explain()``
    says why it chose what it did.

    Args:
      device: a device or its name; ``None`` means CUDA when available, else CPU.
    Returns:
      ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.
    Raises:
      TypeError: if ``device`` is not a str, torch.device or None.
    """
    return hardware.probe(device).half_dtype


def cast_to_full(tree: T) -> T:
    """Cast the floating leaves of ``tree`` to float32; other leaves are returned as is."""
    return _tree.cast_floating(tree, torch.float32)


def cast_to_half(tree: T, device: str | torch.device | None = None) -> T:
    """Cast the floating leaves of ``tree`` to :func:`half_dtype` of ``device`` (float32 where no half is fast)."""
    return _tree.cast_floating(tree, half_dtype(device))


def _full(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def keep_in_float32(surrounding: Policy) -> Policy:
    """The default policy of normalisation layers, given the policy of the module around them.

    Parameters are stored and the layer computes in float32 (float64 stays float64: never lower than
    the surrounding dtypes); its output is cast to the surrounding compute dtype, so the next layer
    sees what it would have seen without the norm's policy (haiku's recipe for BatchNorm). Embeddings
    have a default of their own, :func:`float32_lookup`, which keeps the param dtype.

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


#: The names of :mod:`funcamp.fp8`'s recipes (``fp8.get_recipe``), for the ``fp8=`` part of a policy string.
_FP8_RECIPES = ("tensorwise", "rowwise", "delayed", "mxfp8", "nvfp4")


def _split_fp8(policy: str | Policy) -> tuple[str | Policy, str | None]:
    """``(dtype policy, recipe name or None)`` of a policy string with an optional ``fp8=<recipe>`` part.

    Raises:
      TypeError: if ``policy`` is not a string.
      ValueError: if ``fp8=`` is given twice or is the only part.

    Example:
      >>> _split_fp8("p=f32,c=bf16,o=f32, fp8=delayed")
      ('p=f32,c=bf16,o=f32', 'delayed')
    """
    if isinstance(policy, Policy):
        return policy, None
    if not isinstance(policy, str):
        raise TypeError(
            f"fp8: the policy must be a string such as 'p=f32,c=bf16,o=f32,fp8=tensorwise' or a Policy, got {policy!r}"
        )
    parts = policy.split(",")
    fp8 = [p for p in parts if p.partition("=")[0].strip().lower() == "fp8"]
    if len(fp8) > 1:
        raise ValueError(f"fp8: fp8= given twice in {policy!r}; give one recipe: {', '.join(_FP8_RECIPES)}")
    if not fp8:
        return policy, None
    rest = ",".join(p for p in parts if p not in fp8)
    if not rest.strip():
        raise ValueError(f"fp8: {policy!r} has no dtypes besides fp8=; e.g. 'p=f32,c=bf16,o=f32,fp8=tensorwise'")
    return rest, fp8[0].partition("=")[2].strip()
