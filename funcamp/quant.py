"""Int8 weight-only storage of frozen matrices: per-output-channel absmax scales, dequantized to compute.

A frozen weight ``W`` (a Linear's ``[out, in]``, Hugging Face ``Conv1D``'s ``[in, out]``, an Embedding's
``[num, dim]``) is stored as ``qdata = round(W / absmax * 127)`` in int8 and ``absmax`` in float32,
one ``absmax = max |W|`` per output channel (a Linear's row, a ``Conv1D``'s column, an embedding's row):
symmetric quantization, as bitsandbytes' ``Linear8bitLt`` (``load_in_8bit=True``: ``CB`` int8 and
``SCB`` float32 absmax) and torchao's ``Int8WeightOnlyConfig`` store it; the quantization step is
``absmax / 127``. Inside ``apply_fn`` it is dequantized, ``(qdata / 127) * absmax`` in float32 and
rounded once to the compute dtype of the module using it (float32 for an embedding, which looks up in
float32 by default: :func:`funcamp.nn.float32_lookup`), so the forward computes with ``W`` up to the
quantization error and gradients flow to the trainable tensors through the dequantized weight. The
int8 weights themselves are never trained.

Error bound (per element, dequantized in float32), with ``step = absmax / 127``: ``|W - deq(W)| <=
step / 2``, up to float32 round-off, which ``step * (1/2 + 2**-16) + 2**-149`` covers: ``qdata`` is the
rounding of ``W / absmax * 127`` computed in float64 (exact but for float64's own rounding), and the
two float32 roundings of the dequantization add at most ``2**-23 * absmax`` (``127 * 2**-23 <
2**-16`` steps), or, where the result is subnormal, ``2**-24 * absmax + 2**-150``. This holds for every
finite absmax, tiny and subnormal ones included: the step is never formed on its own in float32, where
it underflows (``absmax / 127`` is 0 for ``absmax = 2**-149``), and neither is ``127 / absmax``, which
overflows to inf below ``absmax = 3.7e-37``. For ``y = x @ W.T`` (a Linear, ``x`` of shape ``[..., in]``)
it follows that ``|y[..., i] - y_deq[..., i]| <= step[i] / 2 * sum_j |x[..., j]|``: channel ``i``'s error
is its half-step times the input's l1 norm. Layers compose: after a 1-Lipschitz activation the next
layer's error is ``|W2_deq| @ e1 + step2 / 2 * ||h||_1``.

funcamp differs from bitsandbytes in two ways: it quantizes the weight as it is (bitsandbytes first
rounds a float32 weight to float16; for a float16 weight both give the same int8 values, except where
bitsandbytes' own rounding of ``127 / absmax`` and of the product moves a value within that round-off
of a half-integer across it: funcamp rounds the exact quotient); and the forward is the model's own
(``F.linear`` on the dequantized weight, in the policy's compute dtype), not an int8 matmul with
outlier decomposition (``llm_int8_threshold``; funcamp has none), so during a call the dequantized copy
exists as any compute-dtype copy does. Like bitsandbytes it stores ``absmax`` itself (``SCB``) and
divides by 127 at each use; unlike transformers' ``get_memory_footprint``, which does not see ``SCB``,
funcamp counts those 4 bytes per output channel in its footprints. From torchao it differs in storing
``absmax`` in float32 whatever the weight's dtype (torchao stores ``absmax / 127`` in the weight's
dtype).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["Int8Weight", "Int8WeightOnlyConfig", "dequantize_int8", "quantize_int8", "quantizable_channel_dim"]


class Int8Weight(NamedTuple):
    """A weight stored as int8 with one float32 absmax per output channel (a pytree of two tensors).

    ``qdata``: int8, the weight's shape, values in ``[-127, 127]``. ``absmax``: float32, the weight's
    shape with size 1 on every dimension but the output channel's (``[out, 1]`` for a Linear,
    ``[1, out]`` for a ``Conv1D``), so that ``qdata / 127 * absmax`` broadcasts; ``max |W|`` of the
    channel (bitsandbytes' ``SCB``; 0 for an all-zero channel). The quantization step is
    ``absmax / 127``; it is not stored, since in float32 it underflows for channels below 1.5e-36.
    ``qdata.numel() + 4 * absmax.numel()`` bytes.
    """

    qdata: torch.Tensor
    absmax: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """The weight's shape."""
        return self.qdata.shape

    @property
    def device(self) -> torch.device:
        """The weight's device."""
        return self.qdata.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in ``dtype``: see :func:`dequantize_int8`."""
        return dequantize_int8(self, dtype)


def quantize_int8(weight: torch.Tensor, channel_dim: int = 0) -> Int8Weight:
    """Store a 2-d floating weight as int8 with per-output-channel symmetric absmax scales.

    ``absmax[c] = max |weight|`` over channel ``c`` (dimension ``channel_dim`` indexes channels), stored
    in float32 (exact for float16, bfloat16 and float32 weights; a float64 one is rounded up, so that
    ``|weight| <= absmax`` holds); ``qdata = round(weight / absmax * 127)`` (round half to even),
    computed in float64, where it is exact up to float64's own rounding for every finite ``absmax > 0``:
    tiny and subnormal channels get the same integers as any other (``[1e-37, -0.5e-37, 0.3e-37, 0]``
    gives ``[127, -64, 38, 0]``). An all-zero channel gets ``qdata = 0`` and ``absmax = 0``. The float64
    copy is made one block of channels at a time (at most 2**22 elements), on ``weight``'s device. For a
    float16 weight ``qdata`` is bitsandbytes' ``CB`` (``int8_vectorwise_quant``: the same formula, up to
    its round-off near ties, see the module docstring) and ``absmax`` its ``SCB``.

    Args:
      weight: a 2-d float16, bfloat16, float32 or float64 tensor, all finite, on any device.
      channel_dim: the output-channel dimension: 0 for ``nn.Linear`` (``[out, in]``) and
        ``nn.Embedding`` (one channel per row), 1 for Hugging Face ``Conv1D`` (``[in, out]``).
    Returns:
      An :class:`Int8Weight` on ``weight``'s device (detached: no gradient flows to ``weight``).
    Raises:
      TypeError: if ``weight`` is not a floating-point tensor.
      ValueError: if ``weight`` is not 2-d, ``channel_dim`` is not 0 or 1, ``weight`` holds NaN or inf,
        or (float64) a channel's absmax exceeds float32's largest value, 3.4e38.

    Example:
      >>> q = quantize_int8(torch.tensor([[1.0, -0.5], [0.0, 0.0]]))
      >>> q.qdata.tolist(), q.absmax.flatten().tolist()  # -63.5 rounds half to even
      ([[127, -64], [0, 0]], [1.0, 0.0])
    """
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise TypeError(f"quantize_int8: expected a floating-point tensor, got {got}")
    if weight.ndim != 2:
        raise ValueError(f"quantize_int8: expected a 2-d weight (a matrix), got shape {tuple(weight.shape)}")
    if channel_dim not in (0, 1):
        raise ValueError(f"quantize_int8: channel_dim must be 0 (rows) or 1 (columns), got {channel_dim!r}")
    w = weight.detach()
    if not torch.isfinite(w).all():
        raise ValueError("quantize_int8: the weight holds NaN or inf; int8 absmax scales need finite weights")
    absmax = _absmax_float32(w.abs().amax(dim=1 - channel_dim, keepdim=True))
    denominator = torch.where(absmax > 0, absmax, torch.ones_like(absmax)).double()  # a zero channel: 0 / 1
    rows = max(1, _BLOCK // max(1, w.shape[1 - channel_dim]))
    blocks = zip(w.split(rows, dim=channel_dim), denominator.split(rows, dim=channel_dim))
    qdata = torch.cat([_round_quotient(wb, db) for wb, db in blocks], dim=channel_dim)
    return Int8Weight(qdata, absmax)


_BLOCK = 2**22  # elements of the float64 copy quantize_int8 makes at a time (32 MiB)


def _absmax_float32(absmax: torch.Tensor) -> torch.Tensor:
    """``absmax`` in float32, rounded up (exact unless float64); raises past float32's range."""
    if absmax.dtype != torch.float64:
        return absmax.float()
    up = absmax.float()
    up = torch.where(up.double() < absmax, torch.nextafter(up, torch.full_like(up, torch.inf)), up)
    if torch.isinf(up).any():
        raise ValueError(
            f"quantize_int8: a channel's absmax is {absmax.max().item():.6g}, above float32's largest value "
            f"{torch.finfo(torch.float32).max:.6g}; int8 absmax scales are float32. Scale the weight down first"
        )
    return up


def _round_quotient(w: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """``round(w / absmax * 127)`` in float64 (``absmax`` float64 > 0), as int8."""
    q = torch.div(w.to(torch.float64), absmax).mul_(127).round_()  # a new tensor: w itself is never written
    return q.clamp_(-127, 127).to(torch.int8)  # |w| <= absmax: the clamp changes nothing


def dequantize_int8(weight: Int8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(qdata / 127) * absmax`` computed in float32, then rounded once to ``dtype``.

    In this order no intermediate overflows (``qdata * absmax`` is inf for ``absmax`` above 2.7e36) or
    underflows (``absmax / 127`` is 0 for ``absmax = 2**-149``). Traceable (no host sync, no branch on
    values): ``apply_fn`` calls it inside the compiled step.

    Args:
      weight: an :class:`Int8Weight`.
      dtype: the floating dtype to return (the compute dtype of the module using the weight).
    Returns:
      A tensor of ``weight.shape`` in ``dtype`` on ``weight``'s device, within half a step
      (``absmax / 254``) of the original weight per element, up to float32 round-off (see the module
      docstring) and the rounding to ``dtype``.
    """
    return (weight.qdata.to(torch.float32) / 127 * weight.absmax).to(dtype)


# --- which modules ---------------------------------------------------------------------------------------


def _is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2's ``c_attn``, ``c_proj``, ``c_fc``): a Linear with weight ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def quantizable_channel_dim(module: nn.Module) -> int | None:
    """The output-channel dimension of ``module.weight`` if it can be stored in int8, else None.

    0 for ``nn.Linear`` (and subclasses) and ``nn.Embedding`` (a channel per row), 1 for Hugging Face
    ``Conv1D`` (recognised by its class name and ``nf`` attribute, so transformers need not be imported).
    """
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return 0
    if _is_hf_conv1d(module):
        return 1
    return None


_KINDS = "nn.Linear (and subclasses), Hugging Face Conv1D, nn.Embedding"
Target = type | str
Targets = Target | Iterable[Target] | Callable[[str, nn.Module], bool] | None


@dataclasses.dataclass(frozen=True)
class Int8WeightOnlyConfig:
    """Which frozen matrices :func:`funcamp.nn.functionalize` stores in int8 (``quantize=``).

    Named after torchao's ``Int8WeightOnlyConfig``; the same storage as transformers'
    ``load_in_8bit=True`` (bitsandbytes). Chosen weights must be frozen (``functionalize`` raises if
    one is trainable); the rest of the model follows the policy (frozen biases in the compute dtype,
    frozen embedding tables in the param dtype at most, norms in float32, trainable tensors as float32
    or ``param_dtype`` masters).

    Args:
      targets: the modules whose ``weight`` is stored in int8. ``None`` (default): every ``nn.Linear``
        and Hugging Face ``Conv1D``, leaving out a weight tied to a module that is not a target
        (GPT-2's LM head shares the token embedding: both stay in floating point, as transformers'
        default ``llm_int8_skip_modules`` keeps the output head). Otherwise a module type, an fnmatch
        pattern of qualified module names (``"transformer.h.*"``, ``"*.mlp.*"``), a list of these, or a
        predicate ``(name, module) -> bool`` called on every module that can take int8. A pattern
        selects the int8-capable modules it matches. Embeddings are quantized only when targeted
        (``nn.Embedding`` or their name); a tied weight (embedding and LM head) only when every module
        using it is a target.
      exclude: fnmatch patterns of module names to leave in floating point (transformers'
        ``llm_int8_skip_modules``), applied after ``targets``.
    Raises:
      TypeError: if a target type cannot be stored in int8 (only nn.Linear and subclasses, Conv1D and
        nn.Embedding can), or a target or exclude entry is not a type, a string or a predicate.

    Example:
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
      >>> sorted(Int8WeightOnlyConfig().select(model))
      ['0.weight', '2.weight']
    """

    targets: Targets = None
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        targets = self.targets
        if isinstance(targets, (type, str)):
            targets = (targets,)
        if targets is not None and not (callable(targets) and not isinstance(targets, type)):
            if not isinstance(targets, Iterable):
                raise TypeError(_bad_targets(targets))
            targets = tuple(targets)
            if not targets:
                raise TypeError("Int8WeightOnlyConfig: targets is empty; pass None for every Linear and Conv1D")
            for t in targets:
                _check_target(t)
        object.__setattr__(self, "targets", targets)
        exclude = (self.exclude,) if isinstance(self.exclude, str) else tuple(self.exclude)
        if any(not isinstance(p, str) for p in exclude):
            raise TypeError(f"Int8WeightOnlyConfig: exclude must be module name patterns (str), got {self.exclude!r}")
        object.__setattr__(self, "exclude", exclude)

    def select(self, module: nn.Module) -> dict[str, int]:
        """The weights to store in int8: ``{parameter name: output-channel dim}``, tied weights once.

        A tied weight is listed under its first name in ``module.named_parameters()`` (the name
        ``functionalize`` keeps it under).

        Raises:
          ValueError: if a target (type, pattern or predicate) or an ``exclude`` pattern matches no
            module; if a pattern matches only modules that cannot take int8 (naming their types); if a
            targeted weight is tied to a module that is not a target (or to one with another channel
            layout); if nothing is left to quantize.
          TypeError: if the predicate returns a non-bool.
        """
        modules = dict(module.named_modules(remove_duplicate=False))
        capable = {name: m for name, m in modules.items() if quantizable_channel_dim(m) is not None}
        chosen = self._targeted(modules, capable)
        for pattern in self.exclude:
            hits = {name for name in modules if fnmatch.fnmatchcase(name, pattern)}
            if not hits:
                raise ValueError(
                    f"Int8WeightOnlyConfig: exclude pattern {pattern!r} matches no module; module names are "
                    f"{_sample(list(modules))}"
                )
            chosen -= hits
        return self._resolve_ties(module, capable, chosen)

    def _targeted(self, modules: dict[str, nn.Module], capable: dict[str, nn.Module]) -> set[str]:
        if self.targets is None:
            return {name for name, m in capable.items() if isinstance(m, nn.Linear) or _is_hf_conv1d(m)}
        if callable(self.targets):
            chosen = set()
            for name, m in capable.items():
                keep = self.targets(name, m)
                if not isinstance(keep, bool):
                    raise TypeError(
                        f"Int8WeightOnlyConfig: targets({name!r}, module) must return a bool, got {type(keep).__name__}"
                    )
                if keep:
                    chosen.add(name)
            if not chosen:
                raise ValueError(
                    f"Int8WeightOnlyConfig: the targets predicate selected none of the {len(capable)} modules that "
                    f"can take int8 ({_sample(list(capable))})"
                )
            return chosen
        chosen = set()
        for target in self.targets:
            if isinstance(target, type):
                hits = {name for name, m in capable.items() if isinstance(m, target)}
                if not hits:
                    raise ValueError(f"Int8WeightOnlyConfig: the model has no {target.__name__} module")
            else:
                matched = {name: m for name, m in modules.items() if fnmatch.fnmatchcase(name, target)}
                hits = {name for name in matched if name in capable}
                if not matched:
                    raise ValueError(
                        f"Int8WeightOnlyConfig: target pattern {target!r} matches no module; module names are "
                        f"{_sample(list(modules))}"
                    )
                if not hits:
                    kinds = sorted({type(m).__name__ for m in matched.values()})
                    raise TypeError(
                        f"Int8WeightOnlyConfig: target pattern {target!r} matches only modules that cannot be "
                        f"stored in int8 ({', '.join(kinds)}); int8 weight-only storage takes {_KINDS}"
                    )
            chosen |= hits
        return chosen

    def _resolve_ties(self, module: nn.Module, capable: dict[str, nn.Module], chosen: set[str]) -> dict[str, int]:
        users: dict[int, list[tuple[str, str]]] = {}  # id(weight) -> [(module name, parameter name)]
        first: dict[int, str] = {}
        for pname, p in module.named_parameters(remove_duplicate=False):
            first.setdefault(id(p), pname)
            owner, _, leaf = pname.rpartition(".")
            if leaf == "weight" and owner in capable:
                users.setdefault(id(p), []).append((owner, pname))
        selected: dict[str, int] = {}
        for key, uses in users.items():
            picked = [owner for owner, _ in uses if owner in chosen]
            if not picked:
                continue
            others = [owner for owner, _ in uses if owner not in chosen]
            shared = sum(1 for _, p in module.named_parameters(remove_duplicate=False) if id(p) == key)
            if others or shared > len(uses):
                if self.targets is None:
                    continue  # the default leaves tied weights (an LM head sharing the embedding) alone
                holders = others or ["a module that cannot take int8"]
                raise ValueError(
                    f"Int8WeightOnlyConfig: {first[key]!r} is tied: used by {picked} (targets) and {holders} "
                    "(not targets); target every module that uses it, or exclude them all"
                )
            dims = {quantizable_channel_dim(capable[owner]) for owner, _ in uses}
            if len(dims) != 1:
                raise ValueError(
                    f"Int8WeightOnlyConfig: {first[key]!r} is tied between modules with different output-channel "
                    f"layouts ({[owner for owner, _ in uses]}); exclude them"
                )
            selected[first[key]] = dims.pop()
        if not selected:
            raise ValueError(
                f"Int8WeightOnlyConfig: no weight left to store in int8 (targets {self.targets!r}, exclude "
                f"{list(self.exclude)!r}); int8 weight-only storage takes {_KINDS}"
            )
        return selected


def _check_target(target: Any) -> None:
    if isinstance(target, str):
        return
    if not isinstance(target, type):
        raise TypeError(_bad_targets(target))
    if not issubclass(target, nn.Module):
        raise TypeError(f"Int8WeightOnlyConfig: target {target!r} is not an nn.Module subclass")
    if not (issubclass(target, (nn.Linear, nn.Embedding)) or target.__name__ == "Conv1D"):
        raise TypeError(
            f"Int8WeightOnlyConfig: {target.__name__} weights cannot be stored in int8 here; int8 weight-only "
            f"storage takes {_KINDS} (norms, convolutions and others stay in floating point)"
        )


def _bad_targets(targets: Any) -> str:
    return (
        "Int8WeightOnlyConfig: targets must be None (every Linear and Conv1D), a module type, a module name "
        f"pattern (fnmatch), a list of these, or a predicate (name, module) -> bool; got {targets!r}"
    )


def _sample(names: list[str], n: int = 6) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return f"[{shown}{', ...' if len(names) > n else ''}]"
