"""Per-op dtypes inside a half-precision step: :func:`choose_op_dtypes` (measured, cached) and its cache files.

:func:`funcamp.tune.choose_compute_dtype` chooses one compute dtype for the whole step; some ops are then slower in
it than in float32 on the same machine. Measured on a 2-core AMD EPYC Zen 4 (AVX-512 with bfloat16, no AMX), torch
2.13.0+cpu: causal ``scaled_dot_product_attention`` forward+backward at 32 x 4 heads x 128 x 32 takes 22-29 ms in
bfloat16 and 12-14 ms in float32 (the backward alone 19-25 against 8-10 ms), while at 4 x 12 x 256 x 64 the two are
equal: whether the rule pays depends on the shapes and the machine, so it is measured on the block's own kernels.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from funcamp import hardware
from funcamp.tune._checks import check_counts, check_margin
from funcamp.tune._keys import cache_path, label, read_cached, software_key, step_machine, write_json
from funcamp.tune._probe import BlockProbe
from funcamp.tune._timing import synchronizer

__all__ = ["ATTENTION", "OpDtypeChoice", "OpTiming", "choose_op_dtypes"]

#: The op :func:`choose_op_dtypes` considers by default: attention, the op whose CPU kernels are slower in bfloat16
#: than in float32 at some shapes on machines without AMX.
ATTENTION = "scaled_dot_product_attention"

_FORMAT = 1  # version of the op-dtype cache files' layout
_PREFIX = "op-dtypes-"


@dataclasses.dataclass(frozen=True)
class OpTiming:
    """One op's measurement: the block's kernels with the op in float32 against the block as it is.

    Attributes:
      op: the op's name (an :class:`funcamp.ops.OpPolicies` key).
      ratio: the median over rounds of the seconds with the rule over the seconds without, in the same round
        (below 1: the rule is faster); None when the op was not timed.
      low: the lower quartile of those per-round ratios (None when not timed).
      high: the upper quartile (None when not timed); ``high - low`` is the spread the gain ``1 - ratio`` must pass.
      kept: whether the rule is kept.
      why: one phrase: why it is kept or not.
    """

    op: str
    ratio: float | None
    low: float | None
    high: float | None
    kept: bool
    why: str


@dataclasses.dataclass(frozen=True)
class OpDtypeChoice:
    """The per-op rules :func:`choose_op_dtypes` chose for a step computing in ``dtype``.

    Attributes:
      op_policies: ``{op name: torch.float32}`` for each op kept (empty when none pays): pass it as
        ``funcamp.nn.functionalize(..., op_policies=)``.
      dtype: the step's compute dtype the rules were measured in.
      source: ``"measured"`` (timed in this call), ``"cache"`` (read from ``cache_path``) or ``"skipped"``
        (nothing to measure: float32 compute).
      timings: one :class:`OpTiming` per op considered.
      rounds: interleaved timing rounds behind ``timings``.
      what: what was timed (the probe's ``what``).
      cache_path: the cache file written or read (None when caching is off or nothing was measured).
      measured_at: when the timings were taken (ISO 8601, UTC), None when nothing was timed.
    """

    op_policies: Mapping[str, torch.dtype]
    dtype: torch.dtype
    source: str
    timings: tuple[OpTiming, ...] = ()
    rounds: int = 0
    what: str = ""
    cache_path: Path | None = None
    measured_at: str | None = None

    def explain(self) -> str:
        """One line for a program's header: the rules kept and why, and where the decision came from."""
        if self.source == "skipped":
            return f"no per-op rule: {label(self.dtype)} compute (nothing computes in a half dtype)"
        kept = ", ".join(f"{op} in float32" for op in self.op_policies) or "no per-op rule"
        each = "; ".join(f"{t.op}: {t.why}" for t in self.timings)
        where = f"measured now ({self.rounds} interleaved rounds of {self.what})"
        if self.source == "cache":
            where = f"from the cache file {self.cache_path} (measured {self.measured_at}, {self.rounds} rounds)"
        return f"{kept} in a {label(self.dtype)} step: {where}; {each}"


def _judge(op: str, ratios: list[float], margin: float) -> OpTiming:
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    ratio = statistics.median(ratios)
    gain, spread = 1 - ratio, high - low
    if ratio >= 1:
        return OpTiming(op, ratio, low, high, False, f"not faster in float32 ({ratio:.3g}x)")
    if gain <= spread:
        why = f"{ratio:.3g}x in float32, within the spread of the rounds' ratios ({low:.3g}-{high:.3g})"
        return OpTiming(op, ratio, low, high, False, why)
    if gain <= margin:
        return OpTiming(op, ratio, low, high, False, f"{ratio:.3g}x in float32, within the margin ({margin:.0%})")
    why = f"the block's kernels take {ratio:.3g}x with it in float32 (quartiles {low:.3g}-{high:.3g})"
    return OpTiming(op, ratio, low, high, True, why)


def choose_op_dtypes(
    probe: BlockProbe,
    dtype: torch.dtype,
    *,
    ops: Sequence[str] = (ATTENTION,),
    rounds: int = 9,
    margin: float = 0.02,
    cache: bool | str | os.PathLike = True,
    retune: bool = False,
    key: Mapping[str, Any] | None = None,
    timer: Callable[[Callable[[], Any]], float] | None = None,
) -> OpDtypeChoice:
    """Which ops of a ``dtype`` step run faster in float32, measured on one block's kernels; cached.

    For each op of ``ops`` in turn: :func:`block_probe`'s replay of the block's library kernels (matmuls,
    attention) as the step computes them in ``dtype``, against the same block with ``{op: torch.float32}``
    added to its op rules (:class:`funcamp.ops.OpPolicies`: the op's floating inputs cast to float32, its outputs
    back), timed in ``rounds`` interleaved rounds (the order rotated each round). The rule is kept when the median
    per-round ratio's gain ``1 - ratio`` is larger than the spread of the ratios (their quartiles) and than
    ``margin``, as :func:`choose_compute_dtype` judges a half dtype; later ops are timed with the rules kept so
    far. An op the block does not call changes no kernel and is not timed. The decision is cached per probe
    key, ``dtype``, ops, rounds, margin, machine, torch and funcamp versions and ``key``, in the directory
    :func:`choose_compute_dtype` uses (files ``op-dtypes-<hash>.json``); ``retune=True`` measures again.

    torch.amp's op lists are fixed per device (CPU autocast runs attention in bfloat16 everywhere); jmp and optax
    have no per-op dtype. Here the rule is measured on the machine and shapes at hand, and numerics only gain:
    a float32 op inside a half step is at least as accurate.

    Args:
      probe: the block probe of the step (:func:`block_probe`), as given to :func:`choose_compute_dtype`.
      dtype: the step's compute dtype; float32 measures nothing (``source="skipped"``).
      ops: op names to consider, :class:`funcamp.ops.OpPolicies` keys (default attention only).
      rounds: interleaved timing rounds (>= 3: the quartiles need them).
      margin: the rule must also be faster by more than this fraction (>= 0).
      cache: True (the default directory), a directory, or False.
      retune: measure even when the cache holds a decision, and overwrite it.
      key: anything else the step's speed depends on, a JSON mapping.
      timer: ``timer(run) -> seconds`` of one call of ``run`` (tests); ``run.op_policies`` is its candidate's
        rules. Default: wall seconds of one call, synchronising the device before and after.
    Returns:
      An :class:`OpDtypeChoice`; its ``op_policies`` go to ``functionalize(..., op_policies=)``.
    Raises:
      TypeError: if ``probe`` is not a :class:`BlockProbe`, ``dtype`` is not a floating dtype, ``ops`` is not a
        sequence of non-empty names, or ``key`` is not a JSON mapping.
      ValueError: if ``rounds < 3``, ``margin < 0``, or ``timer`` returns a time that is not positive.
      RuntimeError: whatever the block's forward or backward raises (from the probe).
    """
    fn = "choose_op_dtypes"
    if not isinstance(probe, BlockProbe):
        raise TypeError(f"{fn}: probe must be a funcamp.tune.BlockProbe (block_probe(...)), got {type(probe).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{fn}: dtype must be the step's floating compute dtype, got {dtype!r}")
    if isinstance(ops, str) or not all(isinstance(op, str) and op for op in ops):
        raise TypeError(f"{fn}: ops must be a sequence of op names such as ({ATTENTION!r},), got {ops!r}")
    check_counts(fn, rounds=(rounds, 3))
    check_margin(margin, fn)
    try:
        extra = json.loads(json.dumps(dict(key or {}), sort_keys=True))
    except (TypeError, ValueError) as error:
        raise TypeError(f"{fn}: key must hold JSON values only (str, numbers, bools, lists, dicts): {error}") from None
    if dtype == torch.float32:
        return OpDtypeChoice({}, dtype, "skipped")
    device = probe.device
    key_doc = {
        "format": _FORMAT,
        "probe": probe.key,
        "dtype": label(dtype),
        "ops": list(ops),
        "rounds": rounds,
        "margin": float(margin),
        "machine": step_machine(device, hardware.capability(device)),
        **software_key(device),
        "key": extra,
    }
    path = cache_path(cache, key_doc, fn, prefix=_PREFIX)
    if path is not None and not retune:
        hit = _load(path, key_doc, dtype)
        if hit is not None:
            return hit
    kept: dict[str, torch.dtype] = {}
    timings = []
    for op in ops:
        base = probe.run_with(dtype, kept)
        trial = probe.run_with(dtype, {**kept, op: torch.float32})
        if [f for f, _, _ in base.kernels] == [f for f, _, _ in trial.kernels] and _same_dtypes(base, trial):
            timings.append(OpTiming(op, None, None, None, False, "the block does not call it (not timed)"))
            continue
        t = _judge(op, _ratios(trial, base, rounds, synchronizer(device), timer), float(margin))
        timings.append(t)
        if t.kept:
            kept[op] = torch.float32
    when = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    choice = OpDtypeChoice(kept, dtype, "measured", tuple(timings), rounds, probe.what, path, when)
    if path is not None:
        _save(path, choice, key_doc)
    return choice


def _same_dtypes(a: Any, b: Any) -> bool:
    """Whether two replays' kernels get operands of the same dtypes (a rule that matched nothing changes none)."""

    def dtypes(run: Any) -> list[list[torch.dtype]]:
        return [[x.dtype for x in args if isinstance(x, torch.Tensor)] for _, args, _ in run.kernels]

    return dtypes(a) == dtypes(b)


def _ratios(
    trial: Callable[[], Any], base: Callable[[], Any], rounds: int, sync: Callable[[], None], timer: Any
) -> list[float]:
    """Per round, ``trial``'s seconds over ``base``'s, the two timed in turn (the order rotated each round)."""

    def seconds(run: Callable[[], Any]) -> float:
        if timer is not None:
            s = float(timer(run))
        else:
            sync()
            start = time.perf_counter()
            run()
            sync()
            s = time.perf_counter() - start
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"choose_op_dtypes: the timer returned {s!r} seconds; it must be > 0")
        return s

    base(), trial()  # warm-up: each kernel's first call
    out = []
    for r in range(rounds):
        pair = (trial, base) if r % 2 else (base, trial)
        got = {id(run): seconds(run) for run in pair}
        out.append(got[id(trial)] / got[id(base)])
    return out


def _save(path: Path, choice: OpDtypeChoice, key_doc: dict) -> None:
    doc = {
        "key": key_doc,
        "op_policies": {op: label(d) for op, d in choice.op_policies.items()},
        "timings": [dataclasses.asdict(t) for t in choice.timings],
        "rounds": choice.rounds,
        "what": choice.what,
        "measured_at": choice.measured_at,
    }
    write_json(path, doc, "choose_op_dtypes")


def _load(path: Path, key_doc: dict, dtype: torch.dtype) -> OpDtypeChoice | None:
    """The decision a cache file holds for this key; None when there is none (a warning when it is unreadable)."""

    def parse(doc: dict) -> OpDtypeChoice:
        rules = {op: getattr(torch, d) for op, d in doc["op_policies"].items()}
        if any(d != torch.float32 for d in rules.values()) or not set(rules) <= set(key_doc["ops"]):
            raise ValueError(f"its rules {doc['op_policies']!r} are not float32 rules of the ops asked")
        timings = tuple(OpTiming(**t) for t in doc["timings"])
        return OpDtypeChoice(rules, dtype, "cache", timings, doc["rounds"], doc["what"], path, doc["measured_at"])

    return read_cached(path, key_doc, "choose_op_dtypes", parse)
