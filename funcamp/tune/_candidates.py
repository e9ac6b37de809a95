"""A measured policy per module: :func:`tune_policy` with its candidates (numerics checked against float32,
timed, chosen) and its cache rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from funcamp.nn._plan import is_default_norm
from funcamp.policy import Policy, get_policy
from funcamp.tune._checks import (
    CANDIDATES,
    check_candidates,
    check_counts,
    check_margin,
    check_module,
    timing_device,
)
from funcamp.tune._keys import cache_path, label, machine_name, module_signature, tree_signature, write_json
from funcamp.tune._timing import median_seconds
from funcamp.tune._units import Runner, candidate_policy, capture_inputs, rel_error, units_at_depth

#: Default error bound per candidate dtype: the largest accepted normwise relative error of the output
#: and of each gradient against float32 on the same inputs. 16 units of roundoff of the dtype
#: (``16 * finfo.eps / 2``): bfloat16 0.0625, float16 0.0078. Measured on the CPU, the blocks of the
#: main job's GPT (``small``: two LayerNorms, attention, MLP; batch 32 x 128) and their attention and MLP
#: alone stay within 2 units in both dtypes (bfloat16 gradients 0.0066, float16 0.00082); a catastrophic
#: cancellation (``x + 1000 - 1000``) measures over 100 units, an overflow infinity.
DEFAULT_RTOL: dict[torch.dtype, float] = {
    torch.bfloat16: 16 * torch.finfo(torch.bfloat16).eps / 2,
    torch.float16: 16 * torch.finfo(torch.float16).eps / 2,
}


_FORMAT = 2  # version of the cache files' layout (2: the key holds each module's settings)


@dataclasses.dataclass(frozen=True)
class TuneCandidate:
    """One candidate compute dtype of one group of modules.

    Attributes:
      dtype: the compute dtype.
      seconds: median wall seconds of one forward+backward of one module of the group (None if it raised).
      output_error: normwise relative error of the output against float32 (max over the group's modules).
      grad_error: the largest normwise relative error of a parameter or input gradient against float32.
      bound: the largest accepted error (0 for float32, the reference).
      refused: why the candidate cannot be chosen (``""`` when it can): above the bound, non-finite, or
        the error it raised.
    """

    dtype: torch.dtype
    seconds: float | None
    output_error: float
    grad_error: float
    bound: float
    refused: str = ""


@dataclasses.dataclass(frozen=True)
class TuneRow:
    """One group of identical modules (same type, parameter shapes and input shapes).

    Attributes:
      modules: the qualified names of the group's modules.
      kind: the modules' class name.
      candidates: one :class:`TuneCandidate` per candidate dtype, in the order tried.
      choice: the chosen compute dtype.
    """

    modules: tuple[str, ...]
    kind: str
    candidates: tuple[TuneCandidate, ...]
    choice: torch.dtype


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """What :func:`tune_policy` measured and chose.

    Attributes:
      module_policies: ``{module name: Policy}`` for ``functionalize(model, policy,
        module_policies=...)``; each tuned module gets ``Policy(param_dtype, chosen, chosen)`` with the
        base policy's param and reduce dtypes.
      table: one :class:`TuneRow` per group of modules.
      policy: the base policy (pass it to ``functionalize`` with the map).
      device: the device measured on.
      machine: the device's name (CPU capability or GPU name and compute capability).
      margin: float32 is chosen when it is at most ``1 + margin`` times the fastest safe candidate.
      from_cache: whether the timings were read from the cache rather than measured (the numerics in
        ``table`` are always those of the batch this call was given).
      cache_path: the cache file (None when caching is off).
    """

    module_policies: dict[str, Policy]
    table: tuple[TuneRow, ...]
    policy: Policy
    device: str
    machine: str
    margin: float
    from_cache: bool = False
    cache_path: Path | None = None

    def __str__(self) -> str:
        lines = [
            f"tune_policy on {self.device} ({self.machine}), torch {torch.__version__}; "
            f"base policy {self.policy}{' (from cache)' if self.from_cache else ''}",
            "error: normwise relative error of the output / worst gradient against float32 on the same inputs; "
            f"float32 wins within {self.margin:.0%} of the fastest safe candidate",
        ]
        head = ("module", "n", "dtype", "fwd+bwd ms", "out err", "grad err", "bound", "verdict")
        body = []
        for row in self.table:
            for i, c in enumerate(row.candidates):
                verdict = "CHOSEN" if c.dtype == row.choice else (f"refused: {c.refused}" if c.refused else "slower")
                body.append(
                    (
                        _group_name(row.modules) if i == 0 else "",
                        str(len(row.modules)) if i == 0 else "",
                        label(c.dtype),
                        "-" if c.seconds is None else f"{1e3 * c.seconds:.3f}",
                        _num(c.output_error),
                        _num(c.grad_error),
                        _num(c.bound) if c.bound else "-",
                        verdict,
                    )
                )
        widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]
        for r in (head, *body):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
        return "\n".join(lines)


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else ("nan" if math.isnan(x) else f"{x:.2g}")


def _group_name(names: Sequence[str]) -> str:
    """``["blocks.0", "blocks.1"]`` -> ``"blocks.{0,1}"``; a single name as is."""
    if len(names) == 1:
        return names[0]
    parts = [n.split(".") for n in names]
    if len({len(p) for p in parts}) == 1:
        differ = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
        if len(differ) == 1:
            i = differ[0]
            return ".".join([*parts[0][:i], "{" + ",".join(p[i] for p in parts) + "}", *parts[0][i + 1 :]])
    return ", ".join(names)


def _default_candidates(device: torch.device) -> tuple[torch.dtype, ...]:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return (torch.float32, torch.float16)
    return CANDIDATES


def _bounds(rtol: float | Mapping[Any, float] | None, candidates: tuple[torch.dtype, ...]) -> dict[torch.dtype, float]:
    bounds = dict(DEFAULT_RTOL)
    if isinstance(rtol, (int, float)) and not isinstance(rtol, bool):
        bounds = dict.fromkeys(bounds, float(rtol))
    elif isinstance(rtol, Mapping):
        for k, v in rtol.items():
            dtype = getattr(torch, k, None) if isinstance(k, str) else k
            if dtype not in DEFAULT_RTOL or not isinstance(v, (int, float)) or isinstance(v, bool):
                raise TypeError(f"tune_policy: rtol must map bfloat16/float16 to a number, got {k!r}: {v!r}")
            bounds[dtype] = float(v)
    elif rtol is not None:
        raise TypeError(f"tune_policy: rtol must be None, a number or {{dtype: number}}, got {rtol!r}")
    if any(not b >= 0 for b in bounds.values()):
        raise ValueError(f"tune_policy: rtol must be >= 0, got {rtol!r}")
    bounds[torch.float32] = 0.0
    return {c: bounds[c] for c in candidates}


def _choose(cands: Sequence[TuneCandidate], margin: float) -> torch.dtype:
    safe = [c for c in cands if not c.refused and c.seconds is not None]
    fastest = min(safe, key=lambda c: c.seconds)
    f32 = next((c for c in safe if c.dtype == torch.float32), None)
    if f32 is not None and f32.seconds <= (1 + margin) * fastest.seconds:
        return torch.float32
    return fastest.dtype


_RAISED = "raised: "


def _check_numerics(
    members: list[tuple[str, nn.Module]],
    inputs: dict[str, Any],
    candidates: tuple[torch.dtype, ...],
    bounds: dict[torch.dtype, float],
    base: Policy,
    device: torch.device,
    op_policies: Any,
) -> list[TuneCandidate]:
    """The numerics verdict of each candidate on these inputs (``seconds`` None): one forward+backward
    per candidate and member, in eval mode (no dropout), against the float32 run of the same member.

    A candidate is refused when the error of its output *or of any gradient* (every parameter that
    requires grad, every floating input, positional or keyword) is non-finite or above its bound, or
    when it raises; a float32 error is raised.
    """
    refs: dict[str, tuple[list, list]] = {}
    out: list[TuneCandidate] = []
    for dtype in candidates:
        policy = candidate_policy(base, dtype)
        out_err = grad_err = 0.0
        try:
            for name, module in members:
                got = Runner(module, policy, inputs[name], device, False, op_policies).run()
                if dtype == torch.float32:
                    refs[name] = got
                    continue
                ref = refs[name]
                out_err = max([out_err, *(rel_error(a, b) for a, b in zip(got[0], ref[0], strict=True))])
                grad_err = max([grad_err, *(rel_error(a, b) for a, b in zip(got[1], ref[1], strict=True))])
        except (RuntimeError, NotImplementedError, TypeError) as error:
            if dtype == torch.float32:
                raise
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            out.append(TuneCandidate(dtype, None, math.nan, math.nan, bounds[dtype], f"{_RAISED}{first[:120]}"))
            continue
        out.append(
            TuneCandidate(dtype, None, out_err, grad_err, bounds[dtype], _verdict(out_err, grad_err, bounds[dtype]))
        )
    return out


def _verdict(out_err: float, grad_err: float, bound: float) -> str:
    """``""`` when both the output's and the worst gradient's error are finite and within ``bound``."""
    worst = max(out_err, grad_err)
    if not math.isfinite(worst):
        return "non-finite"
    if worst > bound:
        return f"error {worst:.2g} > bound {bound:.2g}"
    return ""


def _time_candidates(
    members: list[tuple[str, nn.Module]],
    inputs: dict[str, Any],
    checked: list[TuneCandidate],
    base: Policy,
    device: torch.device,
    timer: Callable[[Callable[[], Any]], float],
    op_policies: Any,
    rounds: int,
) -> list[TuneCandidate]:
    """``checked`` with ``seconds`` filled in for each candidate that ran (refused for its error too)."""
    timed: dict[torch.dtype, Callable[[], Any]] = {}
    for c in checked:
        if c.refused.startswith(_RAISED):
            continue
        name, module = members[0]
        runner = Runner(module, candidate_policy(base, c.dtype), inputs[name], device, None, op_policies)

        def run(runner: Runner = runner) -> Any:  # the module's own training flags
            return runner.run()

        run.dtype, run.module = c.dtype, name  # type: ignore[attr-defined]
        timed[c.dtype] = run
    # Interleaved rounds (A B C, A B C, ...), the median per candidate: a neighbour's load that comes and
    # goes hits every candidate alike instead of whichever was being timed.
    samples: dict[torch.dtype, list[float]] = {dtype: [] for dtype in timed}
    for _ in range(rounds):
        for dtype, run in timed.items():
            samples[dtype].append(float(timer(run)))
    return [
        dataclasses.replace(c, seconds=statistics.median(samples[c.dtype])) if c.dtype in timed else c for c in checked
    ]


def _with_cached_times(checked: list[TuneCandidate], cached: Sequence[TuneCandidate]) -> list[TuneCandidate] | None:
    """Today's verdicts with the cached timings; None when the cache cannot time a candidate that passes."""
    seconds = {c.dtype: c.seconds for c in cached}
    if [c.dtype for c in checked] != list(seconds):
        return None
    out = []
    for c in checked:
        if seconds[c.dtype] is None and not c.refused.startswith(_RAISED):
            return None  # it raised when measured and runs now: measure again
        out.append(dataclasses.replace(c, seconds=None if c.refused.startswith(_RAISED) else seconds[c.dtype]))
    return out


def tune_policy(
    model: nn.Module,
    example_args: tuple | list,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    device: str | torch.device | None = None,
    candidates: Sequence[torch.dtype | str] | None = None,
    policy: Policy | str = "params=float32,compute=float32,output=float32",
    rtol: float | Mapping[torch.dtype | str, float] | None = None,
    margin: float = 0.05,
    depth: int = 2,
    op_policies: Mapping[Any, Any] | None = None,
    cache: bool | str | os.PathLike = True,
    timer: Callable[[Callable[[], Any]], float] | None = None,
    rounds: int = 3,
) -> TuneResult:
    """Measure which compute dtype each module of ``model`` should use on ``device``, and return the map.

    For each *unit* (the submodules ``depth`` levels below the root, where ``ModuleList``,
    ``ModuleDict`` and ``Sequential`` do not count as a level, or leaves above that depth), grouped
    when identical (same class, parameter and buffer names and shapes, input shapes and dtypes):
    capture the inputs each unit receives in one forward of ``model(*example_args, **example_kwargs)``
    as the model is (float32 for a float32 model; no grad); then for each candidate compute dtype, run
    the unit alone as :func:`funcamp.nn.functionalize` runs it under ``Policy(param_dtype, candidate,
    candidate)`` (casting mode; norm layers inside in float32; ``op_policies`` added to the
    float32-accumulation rules).

    - Numerics, for every module of the group, in eval mode (no dropout): output and gradients of the
      parameters and floating inputs (``torch.autograd.grad`` of ``sum(out * g)``, ``g`` a fixed
      standard-normal cotangent) against float32 on the same inputs. Error: the normwise relative error
      ``||x - x_32||_2 / ||x_32||_2`` in float64; the output's and the worst gradient's are reported,
      and a candidate whose larger error exceeds its bound (``rtol``, default :data:`DEFAULT_RTOL`:
      16 units of roundoff), is non-finite, or raises (no kernel for that dtype) is refused. A
      gradient alone refuses: ``1 / x`` on ``x`` in [1e-3, 2e-3] is accurate in float16 forward, but
      its input gradient (about -1e6) overflows float16's 65504. Checked on every call, cache hit
      included, on this call's inputs; where the float32 reference itself is not finite, no half
      candidate is accepted.
    - Time, for the first module of the group, with the module's own training flags: ``timer`` of one
      forward+backward, seconds (default :func:`median_seconds`), called for each candidate in turn,
      ``rounds`` times (interleaved, so that a neighbour's passing load hits all candidates alike); the
      median per candidate. Eager, so a half candidate pays its
      casts and the op-rule mode's dispatch (about 4% of an eager step); a compiled step pays neither.
    - Choice: the fastest candidate not refused; float32 if it is within ``margin`` of that one.

    Only the units are measured: code in a parent's forward around them (a residual addition) runs in
    the dtype the units hand it and is not timed or checked; choose ``depth`` so that the work sits in
    the units. Norm layers that are units themselves (``functionalize``'s default, :func:`funcamp.nn.keep_in_float32`)
    are not tuned and get no entry; units not called by the forward get none either.

    Args:
      model: the model; not changed (hooks are removed, its weights are copied by ``functionalize``).
      example_args: the positional arguments of one forward, a tuple (a batch of the real shape).
      example_kwargs: keyword arguments of that forward.
      device: where to measure (parameters and inputs are copied there); default: the model's
        parameters' device. The capture forward runs where the model is.
      candidates: compute dtypes to try (float32, the reference, is always added); default float32,
        bfloat16 and float16 (float16 only on a CUDA device without bfloat16). A dtype the device
        computes slowly is measured, not skipped: the measurement is what decides.
      policy: the base policy the map is used with (``param_dtype``/``reduce_dtype`` of each entry).
      rtol: the error bound: a number for every half dtype, or ``{dtype: number}``.
      margin: float32 wins when it is at most ``1 + margin`` times the fastest safe candidate's time.
      depth: unit level (1: the model's children, such as the blocks of a GPT; 2: theirs, such as
        attention and MLP, so that attention alone can stay in float32).
      op_policies: per-op rules passed to ``functionalize`` while measuring (use the same in training).
      cache: True (default, :func:`default_cache_dir`: ``$FUNCAMP_CACHE_DIR/tune`` or
        ``~/.cache/funcamp/tune``), a directory, or False (always measure, write nothing). The cache
        holds timings only: the key is a hash of the model's structure (module classes, parameter and
        buffer names, shapes, dtypes), the example inputs' shapes and dtypes, the device and its name
        (CPU capability, AMX, cores and torch threads; or the GPU's name), the torch version, and every
        option above except ``timer``; on a hit the numerics are still checked on ``example_args``
        (values are not in the key: a float16 that was safe on small values may overflow on these), and
        the choice is made from today's verdicts and the cached times. A group whose cached timing
        is missing (a candidate that raised when measured and runs now) is timed again.
      timer: ``timer(fn) -> seconds`` for one call of ``fn``, which runs one forward+backward (tests,
        or another measurement); ``fn.dtype`` and ``fn.module`` say which candidate and module it runs.
      rounds: timer calls per candidate (>= 1).
    Returns:
      A :class:`TuneResult`: ``.module_policies`` for ``functionalize(model, result.policy,
      module_policies=result.module_policies)``, ``.table``, and ``str(result)`` the printed table.
    Raises:
      TypeError: if ``model`` is not an ``nn.Module``, ``example_args`` is not a tuple or list,
        ``candidates`` or ``rtol`` are malformed, or ``cache`` is not a bool or path.
      ValueError: if a candidate is not float32/bfloat16/float16, ``rtol`` or ``margin`` is negative,
        ``depth < 1`` or ``rounds < 1``, the device is ``meta``, or the model has no unit called by its forward.
      RuntimeError: whatever the model's forward, or a unit's float32 forward or backward, raises.

    Example:
      >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
      >>> result = tune_policy(model, (torch.randn(4, 8),), cache=False, timer=lambda fn: 1.0)
      >>> sorted(result.module_policies), str(result.module_policies["0"])  # equal times: float32 wins
      (['0', '1', '2'], 'params=float32,compute=float32,output=float32')
    """
    check_module(model, "tune_policy")
    if not isinstance(example_args, (tuple, list)):
        raise TypeError(
            f"tune_policy: example_args must be a tuple of the forward's positional arguments, got "
            f"{type(example_args).__name__} (write (x,) for one tensor)"
        )
    kwargs = dict(example_kwargs or {})
    base = get_policy(policy)
    check_counts("tune_policy", depth=(depth, 1), rounds=(rounds, 1))
    check_margin(margin, "tune_policy")
    device = timing_device(model, device, "tune_policy", "pass a model and inputs on a real device")
    cands = check_candidates(_default_candidates(device) if candidates is None else candidates)
    bounds = _bounds(rtol, cands)
    machine = machine_name(device)

    units = units_at_depth(model, depth)
    inputs = capture_inputs(model, units, tuple(example_args), kwargs)
    tuned = [(n, m) for n, m in units if n in inputs and not is_default_norm(n, m)]
    if not tuned:
        raise ValueError(
            f"tune_policy: no unit of {type(model).__name__} at depth {depth} was called by its forward "
            "(norm layers are not tuned); try another depth"
        )
    groups: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in tuned:
        key = json.dumps([module_signature(module), tree_signature(inputs[name])])
        groups.setdefault(key, []).append((name, module))

    key_doc = {
        "format": _FORMAT,
        "model": [[n, *module_signature(m)] for n, m in model.named_modules()],
        "inputs": tree_signature((tuple(example_args), kwargs)),
        "device": str(device),
        "machine": machine,
        "torch": torch.__version__,
        "candidates": [label(c) for c in cands],
        "bounds": {label(k): v for k, v in bounds.items()},
        "policy": str(base),
        "margin": margin,
        "rounds": rounds,
        "depth": depth,
        "op_policies": repr(sorted((repr(k), repr(v)) for k, v in (op_policies or {}).items())),
    }
    path = cache_path(cache, key_doc)
    cached = {row.modules: row.candidates for row in _load(path)} if path is not None else {}

    # Numerics are checked on the batch at hand on every call, a cache hit included: a verdict measured on
    # other values (small ones, where float16 does not overflow) says nothing about these. Only the
    # timings, which depend on shapes, dtypes and the machine (all in the key), are reused.
    rows, timed_now = [], False
    for members in groups.values():
        names = tuple(n for n, _ in members)
        checked = _check_numerics(members, inputs, cands, bounds, base, device, op_policies)
        cand = _with_cached_times(checked, cached[names]) if names in cached else None
        if cand is None:
            timed_now = True
            cand = _time_candidates(
                members, inputs, checked, base, device, timer or median_seconds, op_policies, rounds
            )
        rows.append(TuneRow(names, type(members[0][1]).__name__, tuple(cand), _choose(cand, margin)))
    result = TuneResult(
        _policies(rows, base), tuple(rows), base, str(device), machine, float(margin), not timed_now, path
    )
    if path is not None and timed_now:
        _save(path, result, key_doc)
    return result


def _policies(rows: Sequence[TuneRow], base: Policy) -> dict[str, Policy]:
    return {name: candidate_policy(base, row.choice) for row in rows for name in row.modules}


def _save(path: Path, result: TuneResult, key_doc: dict) -> None:
    rows = [
        {
            "modules": list(r.modules),
            "kind": r.kind,
            "choice": label(r.choice),
            "candidates": [{**dataclasses.asdict(c), "dtype": label(c.dtype)} for c in r.candidates],
        }
        for r in result.table
    ]
    write_json(path, {"key": key_doc, "rows": rows}, "tune_policy")


def _load(path: Path) -> list[TuneRow]:
    """The rows of a cache file (their timings are what a hit reuses); ``[]`` when there is none."""
    if not path.exists():
        return []
    try:
        doc = json.loads(path.read_text())
        rows = []
        for r in doc["rows"]:
            cands = tuple(TuneCandidate(**{**c, "dtype": getattr(torch, c["dtype"])}) for c in r["candidates"])
            rows.append(TuneRow(tuple(r["modules"]), r["kind"], cands, getattr(torch, r["choice"])))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(
            f"tune_policy: ignoring the unreadable cache file {path} ({error}); measuring again", stacklevel=3
        )
        return []
    return rows
