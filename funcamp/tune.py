"""A measured precision policy for one model, batch and device: :func:`tune_policy`.

Whether a half dtype pays depends on the op, its shapes and the hardware: a bfloat16 matmul is 20-40x
slower than float32 on an AVX2-only CPU and several times faster on an AMX CPU or a GPU, and CPU
attention can be slower in bfloat16 even where matmuls are faster. :func:`tune_policy` measures instead
of guessing. For each unit of the model (a submodule; identical ones, same type, parameter shapes and
input shapes, form one group, such as the blocks of a transformer) it

1. captures the unit's real inputs during one forward of the whole model as it is (float32 for a float32
   model), no grad, on the example batch (forward pre-hooks, removed afterwards);
2. runs the unit alone, as :func:`funcamp.nn.functionalize` would run it under each candidate compute
   dtype (norm layers inside it in float32, the float32-accumulation op rules), forward and backward
   (gradients of the parameters and the floating inputs, with a fixed random output cotangent);
3. checks numerics against float32 on the same inputs: the normwise relative error of the output and of
   every gradient (parameters and floating inputs), ``||x - x_32|| / ||x_32||``, must be finite and at
   most the candidate's bound (default :data:`DEFAULT_RTOL`); a candidate above it on any one of them,
   non-finite, or raising is refused;
4. times forward+backward (median of ``torch.utils.benchmark.Timer.blocked_autorange``);
5. chooses the fastest candidate that is not refused, float32 when it is within ``margin`` (5%) of it.

The result is a ``module_policies`` map for :func:`funcamp.nn.functionalize` and a table. Timings are
cached as JSON per (model structure and shapes, input shapes and dtypes, device, torch version, CPU
capability or GPU name, thread count, options), so a second call times nothing; numerics (step 3)
depend on the values, not only the shapes, and are checked again on the batch at hand on every call,
a cache hit included (one forward+backward per unit and candidate, no timing).

No library in the field measures this per module; torch.amp's op lists and jmp's policies are fixed by
hand, and torchtitan filters small matmuls out of fp8 by shape only.

:func:`choose_compute_dtype` answers the coarser question a program asks first (the main job's
``--policy auto``): which one compute dtype for the whole step. It times what ``make_step`` gives it in each
candidate dtype: the compiled step (a compile per candidate) or, at a fraction of one compile,
:func:`block_probe`'s replay of one repeated block's library kernels (matmuls, attention, forward and
backward); interleaved, medians over rounds, it refuses a half dtype whose gain is inside the spread of the
rounds, and caches the decision per model structure, shapes and settings, device and torch version in the
same directory, so every fresh process on a machine makes the same choice whatever the load.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import functools
import hashlib
import inspect
import json
import math
import os
import platform
import re
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch import nn

from funcamp import hardware
from funcamp._version import __version__
from funcamp.nn import functionalize
from funcamp.nn._plan import _is_default_norm
from funcamp.policy import Policy, get_policy

__all__ = [
    "DEFAULT_RTOL",
    "ComputeDtypeChoice",
    "BlockProbe",
    "StepTiming",
    "TuneCandidate",
    "TuneResult",
    "TuneRow",
    "block_probe",
    "choose_compute_dtype",
    "default_cache_dir",
    "median_seconds",
    "tune_policy",
]

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
_CANDIDATES = (torch.float32, torch.bfloat16, torch.float16)
_FORMAT = 2  # version of the cache files' layout (2: the key holds each module's settings)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
                        _label(c.dtype),
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


# --- timing ------------------------------------------------------------------------------------------


def median_seconds(fn: Callable[[], Any], *, min_run_time: float = 0.1) -> float:
    """Median wall seconds of one call of ``fn`` (``torch.utils.benchmark.Timer.blocked_autorange``).

    Runs with the current number of torch threads (``Timer`` alone would use one) and synchronises CUDA
    around each block, as ``Timer`` does. ``tune_policy``'s default ``timer``.

    Args:
      fn: a function of no arguments (one forward+backward).
      min_run_time: seconds of measurement, at least one block (a slow ``fn`` runs once after the warm-up).
    Returns:
      Seconds per call (the median over blocks).
    """
    from torch.utils.benchmark import Timer

    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return float(timer.blocked_autorange(min_run_time=min_run_time).median)


# --- units and their inputs ----------------------------------------------------------------------------


def _units(model: nn.Module, depth: int) -> list[tuple[str, nn.Module]]:
    """Submodules ``depth`` levels below the root (containers do not count as a level), or leaves above."""
    out: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module, level: int) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if isinstance(child, _CONTAINERS):
                walk(full + ".", child, level)
            elif level == depth or not any(True for _ in child.children()):
                out.append((full, child))
            else:
                walk(full + ".", child, level + 1)

    walk("", model, 1)
    return out


def _capture(model: nn.Module, units: list[tuple[str, nn.Module]], args: tuple, kwargs: dict) -> dict[str, Any]:
    """The ``(args, kwargs)`` each unit is first called with during one forward of ``model`` (no grad).

    The model's buffers come back as they were (the same tensors, the same values): a forward may update
    them (BatchNorm statistics, fp8 amax histories), and measuring must not."""
    seen: dict[str, Any] = {}
    handles = []
    saved = [
        (model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], b, b.detach().clone())
        for name, b in model.named_buffers(remove_duplicate=False)
    ]

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, a: tuple, k: dict) -> None:
            if name not in seen:
                seen[name] = torch_pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (a, k))

        return record

    try:
        for name, unit in units:
            handles.append(unit.register_forward_pre_hook(hook(name), with_kwargs=True))
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for owner, attr, buffer, value in saved:
                owner._buffers[attr] = buffer  # a forward may have rebound it
                buffer.copy_(value)
    return seen


def _signature(tree: Any) -> list:
    """Shapes and dtypes of the tensors of a tree, and the repr of other leaves (JSON-ready)."""
    leaves, spec = torch_pytree.tree_flatten(tree)
    out: list = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append([list(leaf.shape), _label(leaf.dtype), leaf.device.type])
        else:
            out.append(repr(leaf)[:200])
    return out


def _module_signature(module: nn.Module) -> list:
    """What a module computes with, JSON-ready: its class, its tensors' names, shapes and dtypes, and its own
    settings (:func:`_settings`). Two modules of one class and shapes with other settings (a GELU's
    approximation, a LayerNorm's eps, a dropout's p, training or eval) differ."""
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return [
        f"{type(module).__module__}.{type(module).__qualname__}",
        [[n, list(t.shape), _label(t.dtype), t.requires_grad] for n, t in tensors],
        _settings(module),
    ]


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _settings(module: nn.Module) -> dict[str, Any]:
    """A module's own settings, JSON-ready and the same in every process: its public non-module attributes
    (``training``, ``approximate``, ``eps``, ``p``, ``inplace``, a config dataclass, ...), its ``extra_repr()``,
    and a digest of its class's ``forward`` code (an edited forward is another computation)."""
    out = {name: _setting(value, 0) for name, value in sorted(vars(module).items()) if not name.startswith("_")}
    out["extra_repr()"] = _ADDRESS.sub("", module.extra_repr())
    out["forward"] = _code_digest(getattr(type(module).forward, "__code__", None))
    return out


def _setting(value: Any, depth: int) -> Any:
    """One attribute's value, JSON-ready and free of memory addresses (see :func:`_settings`)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), _label(value.dtype), value.device.type]
    if isinstance(value, (torch.dtype, torch.device, type, enum.Enum)):
        return str(value)
    if depth >= 4:  # deep enough for any setting; the rest is the type
        return type(value).__qualname__
    if isinstance(value, nn.Module):  # a module held outside _modules (a plain list or dict, an attribute)
        return ["module", *_module_signature(value)]
    if isinstance(value, (list, tuple, set, frozenset, Mapping)) and len(value) > 64:  # a table: its digest
        text = repr(sorted(map(repr, value))) if isinstance(value, (set, frozenset)) else repr(value)  # hash order
        digest = hashlib.sha256(_ADDRESS.sub("", text).encode()).hexdigest()[:16]
        return [type(value).__qualname__, len(value), digest]
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_setting(v, depth + 1) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, Mapping):
        return {str(k): _setting(v, depth + 1) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return {f.name: _setting(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}
    if isinstance(value, functools.partial):
        return [
            "partial",
            _setting(value.func, depth + 1),
            _setting(value.args, depth + 1),
            _setting(value.keywords, depth + 1),
        ]
    if inspect.ismethod(value):
        return ["method", value.__func__.__qualname__, _code_digest(getattr(value.__func__, "__code__", None))]
    if inspect.isfunction(value):
        return ["function", value.__qualname__, _code_digest(value.__code__)]
    return _ADDRESS.sub("", repr(value))[:200]


def _code_digest(code: Any) -> str | None:
    """A digest of a code object: its bytecode, names and constants (nested code objects included)."""
    if code is None:
        return None
    h = hashlib.sha256()

    def feed(c: Any) -> None:
        h.update(c.co_code)
        h.update(repr(c.co_names).encode())
        for const in c.co_consts:
            if inspect.iscode(const):
                feed(const)
            else:
                h.update(repr(const).encode())

    feed(code)
    return h.hexdigest()[:16]


# --- one candidate ------------------------------------------------------------------------------------------


def _floating(tree: Any) -> list[torch.Tensor]:
    return [x for x in torch_pytree.tree_leaves(tree) if isinstance(x, torch.Tensor) and x.is_floating_point()]


def _rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64; inf when either is not finite (no oracle, no verdict)."""
    x, ref = x.double(), ref.double()
    if not (torch.isfinite(x).all() and torch.isfinite(ref).all()):
        return math.inf
    den = torch.linalg.vector_norm(ref)
    num = torch.linalg.vector_norm(x - ref)
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return float(num / den)


class _Runner:
    """One module under one policy: ``run()`` = forward + backward on its captured inputs."""

    def __init__(
        self,
        module: nn.Module,
        policy: Policy,
        inputs: Any,
        device: torch.device,
        training: bool | None,
        op_policies,
        module_policies: Mapping[Any, Any] | None = None,
    ) -> None:
        # {"": policy}: the unit itself follows the candidate even where functionalize has a default for its
        # type, as the map's entry (a user entry, which wins over the defaults) makes it in the whole model;
        # the user's own entries come first (first match wins).
        apply_fn, params, buffers = functionalize(
            module,
            policy,
            module_policies={**(module_policies or {}), "": policy},
            with_buffers=True,
            training=training,
            op_policies=op_policies,
        )
        self.apply_fn = apply_fn
        self.params = {k: v.to(device) for k, v in params.items()}
        self.buffers = {k: v.to(device) for k, v in buffers.items()}
        args, kwargs = torch_pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), inputs)
        self.args, self.kwargs = args, kwargs
        self.cotangents: list[torch.Tensor] | None = None

    def run(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(floating outputs, gradients of params and floating inputs), in the order of their trees."""
        params = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in self.params.items()}
        args, kwargs = torch_pytree.tree_map_only(
            torch.Tensor,
            lambda t: t.detach().requires_grad_(True) if t.is_floating_point() else t,
            (self.args, self.kwargs),
        )
        out, _ = self.apply_fn(params, self.buffers, *args, **kwargs)
        outs = _floating(out)
        if self.cotangents is None:
            g = torch.Generator(device=outs[0].device if outs else "cpu").manual_seed(0)
            self.cotangents = [torch.randn(o.shape, generator=g, device=o.device, dtype=torch.float32) for o in outs]
        wrt = [p for p in params.values() if p.requires_grad] + _floating((args, kwargs))
        loss = sum((o.float() * c).sum() for o, c in zip(outs, self.cotangents))
        grads = torch.autograd.grad(loss, wrt, allow_unused=True) if wrt and outs else []
        grads = [torch.zeros_like(w) if g is None else g for w, g in zip(wrt, grads)]
        return [o.detach() for o in outs], list(grads)


def _candidate_policy(base: Policy, dtype: torch.dtype) -> Policy:
    return Policy(base.param_dtype, dtype, dtype, base.reduce_dtype)


# --- the search ------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$FUNCAMP_CACHE_DIR/tune`` if that variable is set, else ``~/.cache/funcamp/tune``."""
    root = os.environ.get("FUNCAMP_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "funcamp") / "tune"


def _machine(device: torch.device) -> str:
    report = hardware.probe(device)
    if device.type == "cpu":
        return f"{report.name}, {platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
    return report.name


def _default_candidates(device: torch.device) -> tuple[torch.dtype, ...]:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return (torch.float32, torch.float16)
    return _CANDIDATES


def _check_candidates(candidates: Any, fn: str = "tune_policy") -> tuple[torch.dtype, ...]:
    if isinstance(candidates, (str, torch.dtype)) or not isinstance(candidates, Sequence):
        raise TypeError(f"{fn}: candidates must be a list of dtypes, got {candidates!r}")
    out = []
    for c in candidates:
        dtype = getattr(torch, c, None) if isinstance(c, str) else c
        if dtype not in _CANDIDATES:
            raise ValueError(
                f"{fn}: candidate {c!r} is not a compute dtype funcamp tunes; choose from float32, bfloat16, float16"
            )
        out.append(dtype)
    if torch.float32 not in out:
        out.insert(0, torch.float32)  # the reference
    return tuple(dict.fromkeys(out))


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
        policy = _candidate_policy(base, dtype)
        out_err = grad_err = 0.0
        try:
            for name, module in members:
                got = _Runner(module, policy, inputs[name], device, False, op_policies).run()
                if dtype == torch.float32:
                    refs[name] = got
                    continue
                ref = refs[name]
                out_err = max([out_err, *(_rel_error(a, b) for a, b in zip(got[0], ref[0], strict=True))])
                grad_err = max([grad_err, *(_rel_error(a, b) for a, b in zip(got[1], ref[1], strict=True))])
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
        runner = _Runner(module, _candidate_policy(base, c.dtype), inputs[name], device, None, op_policies)

        def run(runner: _Runner = runner) -> Any:  # the module's own training flags
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


def _check_module(model: Any, fn: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module, got {type(model).__name__}")


def _check_counts(fn: str, **counts: tuple[Any, int]) -> None:
    """Each ``name=(value, least)``: ``value`` an int (not a bool) >= ``least``."""
    for name, (value, least) in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{fn}: {name} must be an int >= {least}, got {value!r}")


def _check_margin(margin: Any, fn: str) -> None:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
        raise ValueError(f"{fn}: margin must be a number >= 0, got {margin!r}")


def _timing_device(model: nn.Module, device: Any, fn: str, hint: str) -> torch.device:
    """``device``, or that of the model's first parameter (CPU without one); never the meta device."""
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError(f"{fn}: nothing can be timed on the meta device; {hint}")
    return device


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
    _check_module(model, "tune_policy")
    if not isinstance(example_args, (tuple, list)):
        raise TypeError(
            f"tune_policy: example_args must be a tuple of the forward's positional arguments, got "
            f"{type(example_args).__name__} (write (x,) for one tensor)"
        )
    kwargs = dict(example_kwargs or {})
    base = get_policy(policy)
    _check_counts("tune_policy", depth=(depth, 1), rounds=(rounds, 1))
    _check_margin(margin, "tune_policy")
    device = _timing_device(model, device, "tune_policy", "pass a model and inputs on a real device")
    cands = _check_candidates(_default_candidates(device) if candidates is None else candidates)
    bounds = _bounds(rtol, cands)
    machine = _machine(device)

    units = _units(model, depth)
    inputs = _capture(model, units, tuple(example_args), kwargs)
    tuned = [(n, m) for n, m in units if n in inputs and not _is_default_norm(n, m)]
    if not tuned:
        raise ValueError(
            f"tune_policy: no unit of {type(model).__name__} at depth {depth} was called by its forward "
            "(norm layers are not tuned); try another depth"
        )
    groups: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in tuned:
        key = json.dumps([_module_signature(module), _signature(inputs[name])])
        groups.setdefault(key, []).append((name, module))

    key_doc = {
        "format": _FORMAT,
        "model": [[n, *_module_signature(m)] for n, m in model.named_modules()],
        "inputs": _signature((tuple(example_args), kwargs)),
        "device": str(device),
        "machine": machine,
        "torch": torch.__version__,
        "candidates": [_label(c) for c in cands],
        "bounds": {_label(k): v for k, v in bounds.items()},
        "policy": str(base),
        "margin": margin,
        "rounds": rounds,
        "depth": depth,
        "op_policies": repr(sorted((repr(k), repr(v)) for k, v in (op_policies or {}).items())),
    }
    path = _cache_path(cache, key_doc)
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
    return {name: _candidate_policy(base, row.choice) for row in rows for name in row.modules}


# --- the cache -----------------------------------------------------------------------------------------------


def _cache_path(cache: Any, key_doc: dict, fn: str = "tune_policy", prefix: str = "") -> Path | None:
    if cache is False or cache is None:
        return None
    if cache is True:
        directory = default_cache_dir()
    elif isinstance(cache, (str, os.PathLike)):
        directory = Path(cache)
    else:
        raise TypeError(f"{fn}: cache must be True, False or a directory, got {cache!r}")
    digest = hashlib.sha256(json.dumps(key_doc, sort_keys=True).encode()).hexdigest()[:32]
    return directory / f"{prefix}{digest}.json"


def _write_json(path: Path, doc: dict, fn: str) -> None:
    """Write ``doc`` to ``path`` atomically (a reader sees the old file or the new one); warn if it cannot."""
    text = json.dumps(doc, indent=1, default=str)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            f.write(text)
        os.replace(f.name, path)
    except OSError as error:
        warnings.warn(f"{fn}: could not write the cache file {path}: {error}", stacklevel=4)


def _save(path: Path, result: TuneResult, key_doc: dict) -> None:
    rows = [
        {
            "modules": list(r.modules),
            "kind": r.kind,
            "choice": _label(r.choice),
            "candidates": [{**dataclasses.asdict(c), "dtype": _label(c.dtype)} for c in r.candidates],
        }
        for r in result.table
    ]
    _write_json(path, {"key": key_doc, "rows": rows}, "tune_policy")


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


# --- one compute dtype for the whole step: choose_compute_dtype ----------------------------------------------

_CHOICE_FORMAT = 2  # version of the compute-dtype cache files' layout (2: module settings, facts, `what`)
_CHOICE_PREFIX = "compute-dtype-"


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """One candidate compute dtype's timings of the whole step, from :func:`choose_compute_dtype`.

    Attributes:
      dtype: the compute dtype.
      samples: wall seconds of one step in each round, in round order (``()`` when it did not run).
      seconds: the median of ``samples`` (None when it did not run).
      ratio: the median over rounds of this candidate's seconds over float32's in the same round (1.0 for
        float32; None when it did not run).
      low: the lower quartile of those per-round ratios.
      high: the upper quartile; ``high - low`` is the spread the difference ``1 - ratio`` is held against.
      first_s: seconds of the first call (compilation included); None when it raised.
      refused: why this half dtype was not chosen (``""`` for float32 and for the chosen one): slower,
        within the spread, within the margin, slower than another half dtype, or the error it raised.
    """

    dtype: torch.dtype
    samples: tuple[float, ...]
    seconds: float | None
    ratio: float | None
    low: float | None
    high: float | None
    first_s: float | None
    refused: str = ""


@dataclasses.dataclass(frozen=True)
class ComputeDtypeChoice:
    """The compute dtype :func:`choose_compute_dtype` chose for a step, and where the choice came from.

    Attributes:
      dtype: the compute dtype: ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``.
      source: ``"capability"`` (torch's facts decided, nothing timed), ``"measured"`` (timed in this call)
        or ``"cache"`` (read from ``cache_path``, nothing timed).
      reason: one line: why this dtype.
      device: the device (``cpu``, ``cuda:0``, ...).
      machine: the device's name: CPU capability and model, cores and torch threads; or the GPU's name.
      timings: one :class:`StepTiming` per candidate, float32 first (``()`` when the facts decided).
      rounds: interleaved timing rounds behind ``timings``.
      cache_path: the cache file written or read (None when caching is off or the facts decided).
      measured_at: when the timings were taken (ISO 8601, UTC), None when nothing was timed.
      what: what was timed (``"the step"``, or a :class:`BlockProbe`'s ``what``).
    """

    dtype: torch.dtype
    source: str
    reason: str
    device: str
    machine: str
    timings: tuple[StepTiming, ...] = ()
    rounds: int = 0
    cache_path: Path | None = None
    measured_at: str | None = None
    what: str = "the step"

    def explain(self) -> str:
        """One line: the dtype, where the choice came from (the facts, a measurement now, the cache file) and why."""
        head = f"{_label(self.dtype)} compute on {self.machine}"
        if self.source == "capability":
            return f"{head}: {self.reason} (torch's report decides; nothing timed)"
        table = ", ".join(_timing_text(t) for t in self.timings)
        measured = f"{self.rounds} interleaved rounds of {self.what}, medians: {table}"
        if self.source == "cache":
            where = f"from the cache file {self.cache_path} (measured {self.measured_at}, {measured})"
            return f"{head}: {where}; {self.reason}"
        saved = f"; saved to {self.cache_path}" if self.cache_path is not None else ""
        return f"{head}: measured now ({measured}); {self.reason}{saved}"


def _timing_text(t: StepTiming) -> str:
    if t.seconds is None:
        return f"{_label(t.dtype)} {t.refused}"
    text = f"{_label(t.dtype)} {1e3 * t.seconds:.4g} ms"
    return text if t.dtype == torch.float32 else f"{text} (median per-round ratio {t.ratio:.3g}x)"


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere), or ``""``."""
    return hardware._cpuinfo("model name") or platform.processor()


def _step_machine(device: torch.device, cap: hardware.Capability) -> str:
    if device.type == "cpu":
        model = _cpu_model()
        return (
            f"{cap.name}{', ' + model if model else ''}, {platform.machine()}, {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} threads"
        )
    return cap.name


def _synchronize(device: torch.device) -> Callable[[], None]:
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu, torch.cpu
    return getattr(backend, "synchronize", None) or (lambda: None)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:160]


def _time_steps(
    make_step: Callable[[torch.dtype], Callable[[], Any]],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    rounds: int,
    warmup: int,
    timer: Callable[[Callable[[], Any]], float] | None,
) -> list[StepTiming]:
    """Build each candidate's step, call it ``warmup`` times (the first compiles), then time it in
    ``rounds`` interleaved rounds, the order rotated each round (A B, B A, ...)."""
    sync = _synchronize(device)

    def one_call(fn: Callable[[], Any]) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    runs: dict[torch.dtype, Callable[[], Any]] = {}
    first: dict[torch.dtype, float] = {}
    raised: dict[torch.dtype, str] = {}
    for dtype in dtypes:
        fn = None
        try:
            fn = make_step(dtype)
            if callable(fn):
                first[dtype] = one_call(fn)
                for _ in range(warmup - 1):
                    fn()
        except (RuntimeError, NotImplementedError, TypeError) as error:  # no kernel, or no compile, for this dtype
            if dtype == torch.float32:
                raise
            raised[dtype] = f"raised: {_first_line(error)}"
            continue
        if not callable(fn):
            raise TypeError(
                f"choose_compute_dtype: make_step({_label(dtype)}) must return a function of no arguments that "
                f"runs one step, got {type(fn).__name__}"
            )
        fn.dtype = dtype  # type: ignore[attr-defined]  # for a timer that wants to know (tests)
        runs[dtype] = fn
    samples: dict[torch.dtype, list[float]] = {dtype: [] for dtype in runs}
    order = list(runs)
    for r in range(rounds):
        k = r % len(order)
        for dtype in order[k:] + order[:k]:
            seconds = float(timer(runs[dtype])) if timer is not None else one_call(runs[dtype])
            if not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"choose_compute_dtype: the timer returned {seconds!r} seconds; it must be > 0")
            samples[dtype].append(seconds)
    out = []
    for dtype in dtypes:
        if dtype in raised:
            out.append(StepTiming(dtype, (), None, None, None, None, None, raised[dtype]))
            continue
        s = samples[dtype]
        ratios = [a / b for a, b in zip(s, samples[torch.float32])]
        low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
        median, ratio = statistics.median(s), statistics.median(ratios)
        out.append(StepTiming(dtype, tuple(s), median, ratio, low, high, first[dtype]))
    return out


def _decide(timings: Sequence[StepTiming], margin: float) -> tuple[torch.dtype, str, tuple[StepTiming, ...]]:
    """The fastest half dtype whose gain over float32 exceeds both the spread and ``margin``, else float32."""
    judged: list[StepTiming] = []
    for t in timings:
        if t.dtype == torch.float32 or t.refused:
            judged.append(t)
            continue
        gain, spread = 1 - t.ratio, t.high - t.low
        if t.ratio >= 1:
            why = f"slower: its step takes {t.ratio:.3g}x float32's"
        elif gain <= spread:
            why = (
                f"its step takes {t.ratio:.3g}x float32's, but the spread of the rounds' ratios "
                f"({t.low:.3g}-{t.high:.3g}: {spread:.3g}) is wider than the difference ({gain:.3g})"
            )
        elif gain <= margin:
            why = f"its step takes {t.ratio:.3g}x float32's: faster by less than the margin ({margin:.0%})"
        else:
            why = ""
        judged.append(dataclasses.replace(t, refused=why))
    winners = [t for t in judged if t.dtype != torch.float32 and not t.refused]
    if not winners:
        halves = "; ".join(f"{_label(t.dtype)}: {t.refused}" for t in judged if t.dtype != torch.float32)
        noisy = any("is wider than the difference" in t.refused for t in judged)
        lead = "float32: no half dtype on a measurement this noisy" if noisy else "float32: no half dtype is faster"
        return torch.float32, f"{lead} ({halves})", tuple(judged)
    best = min(winners, key=lambda t: t.ratio)
    judged = [
        dataclasses.replace(t, refused=f"slower than {_label(best.dtype)}") if t in winners and t is not best else t
        for t in judged
    ]
    gain, spread = 1 - best.ratio, best.high - best.low
    reason = (
        f"{_label(best.dtype)}'s step takes {best.ratio:.3g}x float32's (quartiles of the rounds' ratios "
        f"{best.low:.3g}-{best.high:.3g}): faster by {gain:.1%}, more than the spread ({spread:.1%}) and the "
        f"margin ({margin:.0%})"
    )
    return best.dtype, reason, tuple(judged)


def choose_compute_dtype(
    make_step: Callable[[torch.dtype], Callable[[], Any]],
    model: nn.Module,
    example_batch: Any,
    *,
    device: str | torch.device | None = None,
    key: Mapping[str, Any] | None = None,
    candidates: Sequence[torch.dtype | str] | None = None,
    rounds: int = 9,
    warmup: int = 2,
    margin: float = 0.02,
    cache: bool | str | os.PathLike = True,
    retune: bool = False,
    timer: Callable[[Callable[[], Any]], float] | None = None,
    what: str = "the step",
) -> ComputeDtypeChoice:
    """Choose the one compute dtype of a train step by timing it (or one block of it), once per machine; cache it.

    1. **Facts first** (:func:`funcamp.hardware.capability`, nothing timed, nothing cached): on CUDA the
       compute capability decides (bfloat16 from 8.0, float16 on 7.x and 6.0, else float32); on a CPU
       whose oneDNN has no bfloat16 and no float16 kernels (AVX2-only), float32 at once; float16 on a CPU
       without AMX-FP16 tiles is not a candidate. A half dtype without kernels is never timed.
    2. **Cache**: otherwise, unless ``retune``, a decision cached for this key is returned without
       building or timing anything. The key is a hash of the model's structure (every module's class,
       parameter and buffer names, shapes, dtypes, and its settings: public attributes such as a GELU's
       ``approximate``, a LayerNorm's ``eps``, a dropout's ``p``, ``training``; ``extra_repr()``; a digest of
       its class's ``forward`` code), ``example_batch``'s shapes and dtypes, the device and its name (CPU
       capability, AMX, model name, cores and torch threads; or the GPU's name) and the CPU's facts, the
       torch and funcamp versions, the candidates, ``rounds``, ``warmup``, ``margin``, ``what`` and ``key``.
    3. **Measure**: ``make_step(dtype)`` for float32 and each remaining half dtype: the step as it will
       run (compiled, if the program compiles it: a compile per candidate), or, much cheaper, one repeated
       block's kernels (:func:`block_probe`); ``warmup`` calls each (the first compiles; its seconds
       are kept); then ``rounds`` rounds, each timing one call of every candidate, the order rotated each
       round (interleaved: a load that comes and goes hits all candidates alike). Per half dtype, the
       per-round ratios of its seconds over float32's in the same round: their median ``ratio`` and
       quartiles ``low``-``high``.
    4. **Decide**: the half dtype with the lowest ``ratio`` whose gain ``1 - ratio`` is larger than its
       spread ``high - low`` and than ``margin``; if none is, float32, and the reason says which of the
       three failed (slower, a spread wider than the difference: a measurement too noisy to trust, or
       within the margin). The decision is written to the cache (float32 from a noisy measurement too,
       so that every later process agrees; ``retune=True`` measures again).

    Unlike ``torch.amp`` (bfloat16 on every CPU) and :func:`funcamp.hardware.probe` (one 256x256
    matmul, three times), the measurement is of the whole step: on an AVX-512 CPU without AMX a bfloat16
    matmul can be fast while bfloat16 attention is several times slower than float32.

    Args:
      make_step: ``make_step(dtype) -> run``: builds the step computing in ``dtype`` and returns ``run()``,
        which runs one step to completion (its result is dropped; a pure step may be called again on the
        same state). Called only when measuring, once per candidate. A half dtype whose ``make_step`` or
        first calls raise ``RuntimeError``, ``NotImplementedError`` or ``TypeError`` is refused with the
        error; float32's error is raised.
      model: the model the step trains (its structure and shapes key the cache; it is not called).
      example_batch: the step's batch, a pytree (its tensors' shapes and dtypes key the cache).
      device: the device the step runs on; default the model's parameters' device (CPU if it has none).
      key: anything else the step's speed depends on (optimizer, compile backend, flags), a JSON mapping.
      candidates: half dtypes to consider (float32, the reference, is always one); default those
        :func:`funcamp.hardware.capability` leaves to a measurement. Those it rules out are dropped.
      rounds: interleaved timing rounds (>= 3: the quartiles need them).
      warmup: untimed calls of each candidate before the rounds (>= 1; the first compiles).
      margin: a half dtype must also be faster than float32 by more than this fraction (>= 0).
      cache: True (:func:`default_cache_dir`, files ``compute-dtype-<hash>.json``), a directory, or False.
      retune: measure even when the cache holds a decision, and overwrite it.
      timer: ``timer(run) -> seconds`` of one call of ``run`` (tests); ``run.dtype`` is its candidate.
        Default: wall seconds of one call, synchronising the device before and after.
      what: what ``run()`` runs, for the explanation and the key (a :class:`BlockProbe`'s ``what``).
    Returns:
      A :class:`ComputeDtypeChoice`; ``.explain()`` is one line for a program's header.
    Raises:
      TypeError: if ``make_step`` is not callable or returns something that is not, ``model`` is not an
        ``nn.Module``, ``key`` is not a JSON-serialisable mapping, ``candidates`` is malformed, ``what`` is
        not a str, or ``cache`` is not a bool or a path.
      ValueError: if a candidate is not float32/bfloat16/float16, ``rounds < 3``, ``warmup < 1``,
        ``margin < 0``, the device is ``meta``, or ``timer`` returns a time that is not positive.
      RuntimeError: whatever float32's ``make_step`` or step raises.

    Example:
      >>> model = torch.nn.Linear(4, 4)
      >>> choice = choose_compute_dtype(lambda dtype: lambda: None, model, torch.ones(2, 4), cache=False,
      ...                               timer=lambda run: 1.0)   # equal times: no half dtype is faster
      >>> choice.dtype, choice.source in ("capability", "measured")
      (torch.float32, True)
    """
    fn = "choose_compute_dtype"
    if not callable(make_step):
        raise TypeError(f"{fn}: make_step must be a function dtype -> run, got {type(make_step).__name__}")
    _check_module(model, fn)
    if key is not None and not isinstance(key, Mapping):
        raise TypeError(f"{fn}: key must be a mapping of JSON values (the step's settings), got {type(key).__name__}")
    try:
        extra = json.loads(json.dumps(dict(key or {}), sort_keys=True))
    except (TypeError, ValueError) as error:
        raise TypeError(f"{fn}: key must hold JSON values only (str, numbers, bools, lists, dicts): {error}") from None
    _check_counts(fn, rounds=(rounds, 3), warmup=(warmup, 1))
    _check_margin(margin, fn)
    if not isinstance(what, str):
        raise TypeError(f"{fn}: what must be a str (what run() runs), got {type(what).__name__}")
    device = _timing_device(model, device, fn, "pass the device the step runs on")
    wanted = None if candidates is None else _check_candidates(candidates, fn)
    cap = hardware.capability(device)
    machine = _step_machine(device, cap)
    if cap.decided is not None:
        return ComputeDtypeChoice(cap.decided, "capability", cap.reason, str(device), machine)
    halves = tuple(d for d in cap.candidates if wanted is None or d in wanted)
    if not halves:
        asked = ", ".join(_label(d) for d in (wanted or ()) if d != torch.float32) or "none"
        why = f"no half dtype to measure (asked for: {asked}; {cap.reason})"
        return ComputeDtypeChoice(torch.float32, "capability", why, str(device), machine)
    dtypes = (torch.float32, *halves)

    key_doc = {
        "format": _CHOICE_FORMAT,
        "model": [[n, *_module_signature(m)] for n, m in model.named_modules()],
        "batch": _signature(example_batch),
        "device": str(device),
        "machine": machine,
        "facts": {k: str(v) for k, v in sorted(hardware._cpu_facts().items())} if device.type == "cpu" else None,
        "torch": torch.__version__,
        "funcamp": __version__,  # the step's code is funcamp's
        "what": what,
        "candidates": [_label(d) for d in dtypes],
        "rounds": rounds,
        "warmup": warmup,
        "margin": float(margin),
        "key": extra,
    }
    path = _cache_path(cache, key_doc, fn, prefix=_CHOICE_PREFIX)
    if path is not None and not retune:
        hit = _load_choice(path, key_doc, dtypes)
        if hit is not None:
            return hit
    timings = _time_steps(make_step, dtypes, device, rounds, warmup, timer)
    dtype, reason, judged = _decide(timings, float(margin))
    when = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    choice = ComputeDtypeChoice(dtype, "measured", reason, str(device), machine, judged, rounds, path, when, what)
    if path is not None:
        _save_choice(path, choice, key_doc)
    return choice


def _save_choice(path: Path, choice: ComputeDtypeChoice, key_doc: dict) -> None:
    timings = [{**dataclasses.asdict(t), "dtype": _label(t.dtype)} for t in choice.timings]
    doc = {
        "key": key_doc,
        "choice": _label(choice.dtype),
        "reason": choice.reason,
        "device": choice.device,
        "machine": choice.machine,
        "rounds": choice.rounds,
        "measured_at": choice.measured_at,
        "what": choice.what,
        "timings": timings,
    }
    _write_json(path, doc, "choose_compute_dtype")


def _load_choice(path: Path, key_doc: dict, dtypes: tuple[torch.dtype, ...]) -> ComputeDtypeChoice | None:
    """The decision a cache file holds for this key; None when there is none (a warning when it is unreadable)."""
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        if doc["key"] != json.loads(json.dumps(key_doc, sort_keys=True)):
            raise ValueError("its key is not this step's")
        dtype = getattr(torch, doc["choice"])
        if dtype not in dtypes:
            raise ValueError(f"its choice {doc['choice']!r} is not a candidate")
        timings = tuple(
            StepTiming(**{**t, "dtype": getattr(torch, t["dtype"]), "samples": tuple(t["samples"])})
            for t in doc["timings"]
        )
        fields = (
            doc["reason"],
            doc["device"],
            doc["machine"],
            timings,
            doc["rounds"],
            path,
            doc["measured_at"],
            doc["what"],
        )
        return ComputeDtypeChoice(dtype, "cache", *fields)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(
            f"choose_compute_dtype: ignoring the unreadable cache file {path} ({error}); measuring again", stacklevel=3
        )
        return None


# --- one repeated block's library kernels: block_probe ---------------------------------------------------------

# The ops a compiled step hands to a library (oneDNN/MKL, cuBLAS, the attention kernels) rather than fusing: what
# a compute dtype changes most, and what eager timing measures as the compiled step runs them.
_KERNEL_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "convolution",
    "convolution_backward",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward",
    "_flash_attention_backward",
    "_efficient_attention_forward",
    "_efficient_attention_backward",
)
_MAX_CALLS = 256  # kernel calls in one replay, at most
_KERNELS = frozenset(getattr(torch.ops.aten, n) for n in _KERNEL_NAMES if hasattr(torch.ops.aten, n))


def _record_kernels(run: Callable[[], Any]) -> list[tuple[Any, tuple, dict]]:
    """The library kernels (``_KERNELS``) ``run()`` calls, forward and backward, with their real arguments."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[tuple[Any, tuple, dict]] = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            if func.overloadpacket in _KERNELS:
                calls.append((func, args, kwargs))
            return func(*args, **kwargs)

    with Recorder():
        run()
    return calls


@dataclasses.dataclass(eq=False)
class _Replay:
    """``run()`` for :func:`choose_compute_dtype`: the recorded kernels of one block, ``repeat`` times."""

    dtype: torch.dtype
    kernels: tuple[tuple[Any, tuple, dict], ...]
    repeat: int

    def __call__(self) -> None:
        for _ in range(self.repeat):
            for func, args, kwargs in self.kernels:
                func(*args, **kwargs)


class BlockProbe:
    """``make_step`` for :func:`choose_compute_dtype` that times one repeated block instead of the whole step.

    Built by :func:`block_probe`, which only finds the block: nothing runs until the first call, so a
    decision read from the cache costs no forward. ``probe(dtype)`` captures the block's input (once: one
    no-grad forward of the model), runs the block forward and backward once, eagerly, as
    :func:`funcamp.nn.functionalize` runs it under ``Policy(param_dtype, dtype, dtype)`` (norm layers in
    float32), records the library kernels it calls (matmuls, convolutions, attention, with their real arguments)
    and returns ``run()``, which calls those kernels again ``repeat`` times: the work a dtype changes in a
    compiled step, where the elementwise ops around them are fused.

    Attributes:
      name: the block timed (``"blocks.0"``; ``""`` for the whole model when it has no repeated block).
      members: the names of the identical blocks it stands for.
      kind: the block's class name.
      key: a JSON description of what is timed (the block, its signature, the base policy and op rules), for
        :func:`choose_compute_dtype`'s ``key``.
      what: one phrase for :class:`ComputeDtypeChoice`'s explanation (and ``choose_compute_dtype``'s ``what``).
      repeat: how many times one ``run()`` replays the kernels, set by the first call so that a run takes
        ``min_run_time`` (0 before it).
      kernels: how many kernel calls one forward+backward of the block makes, in the first dtype run (0 before).
    """

    def __init__(
        self,
        model: nn.Module,
        name: str,
        members: tuple[str, ...],
        example: tuple[tuple, dict],
        base: Policy,
        device: torch.device,
        op_policies: Any,
        module_policies: Any,
        min_run_time: float,
    ) -> None:
        self.name, self.members = name, members
        self._module_policies = dict(module_policies or {})
        self._model, self._module = model, model.get_submodule(name)
        self.kind = type(self._module).__name__
        self._example, self._base, self._device, self._op_policies = example, base, device, op_policies
        self._min_run_time = min_run_time
        self._inputs: Any = None
        self._replays: dict[torch.dtype, _Replay] = {}
        self.repeat = self.kernels = 0
        self.key = {
            "measure": "block kernels",
            "block": name,
            "members": len(members),
            "module": _module_signature(self._module),
            "policy": str(base),
            "op_policies": repr(sorted((repr(k), repr(v)) for k, v in (op_policies or {}).items())),
            "module_policies": [[_setting(k, 0), _setting(v, 0)] for k, v in self._module_policies.items()],
            "min_run_time": min_run_time,
        }
        if not name:
            self.what = f"the whole {self.kind}'s forward+backward kernels"
        else:
            many = f", one of {len(members)}" if len(members) > 1 else ""
            self.what = f"{name} ({self.kind}{many})'s forward+backward kernels"

    def _capture(self) -> Any:
        if self._inputs is None:
            args, kwargs = self._example
            if not self.name:
                self._inputs = (args, kwargs)
            else:
                seen = _capture(self._model, [(self.name, self._module)], args, kwargs)
                if self.name not in seen:
                    raise ValueError(
                        f"block_probe: {self.name} ({self.kind}) was not called by {type(self._model).__name__}'s "
                        "forward"
                    )
                self._inputs = seen[self.name]
        return self._inputs

    def _record(self, dtype: torch.dtype) -> _Replay:
        policy = _candidate_policy(self._base, dtype)
        runner = _Runner(
            self._module, policy, self._capture(), self._device, None, self._op_policies, self._module_policies
        )
        return _Replay(dtype, tuple(_record_kernels(runner.run)), max(self.repeat, 1))

    def _calibrate(self, first: _Replay) -> None:
        if not first.kernels:
            raise ValueError(
                f"block_probe: {self.name or 'the model'} ({self.kind}) calls no matmul, "
                "convolution or attention kernel: nothing a compute dtype would speed up (time the step instead)"
            )
        sync = _synchronize(self._device)
        first()
        seconds = []
        for _ in range(3):  # the quickest of three: the machine's load only makes runs longer
            sync()
            start = time.perf_counter()
            first()
            sync()
            seconds.append(time.perf_counter() - start)
        self.kernels = len(first.kernels)
        # At most _MAX_CALLS kernel calls a run: tiny kernels under load cost a scheduler slice each, not microseconds
        most = max(1, _MAX_CALLS // self.kernels)
        self.repeat = max(1, min(most, math.ceil(self._min_run_time / max(min(seconds), 1e-9))))
        first.repeat = self.repeat

    def __call__(self, dtype: torch.dtype) -> _Replay:
        """``run()`` replaying the block's kernels as they run in ``dtype``.

        Raises:
          ValueError: if the block is not called by the model's forward or calls no kernel.
          RuntimeError: whatever the block's forward or backward raises in ``dtype`` (no kernel for it).
        """
        if dtype not in self._replays:
            replay = self._record(dtype)
            if not self.repeat:
                self._calibrate(replay)
            self._replays[dtype] = replay
        return self._replays[dtype]

    def __repr__(self) -> str:
        return f"BlockProbe({self.what})"


def _repeated_block(model: nn.Module) -> tuple[str, tuple[str, ...]]:
    """The model's repeated block: among groups of two or more identical submodules (same class, tensor shapes
    and settings), the one holding the most parameters, the outermost on a tie; ``("", ("",))`` when none."""
    groups: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        if name:
            groups.setdefault(json.dumps(_module_signature(module), sort_keys=True), []).append((name, module))
    best: tuple[int, int, tuple[str, ...]] | None = None
    for members in groups.values():
        if len(members) < 2:
            continue
        size = sum(p.numel() for p in members[0][1].parameters())
        if size == 0:
            continue
        rank = (size * len(members), -min(n.count(".") for n, _ in members), tuple(n for n, _ in members))
        if best is None or rank[:2] > best[:2]:
            best = rank
    if best is None:
        return "", ("",)
    return best[2][0], best[2]


def block_probe(
    model: nn.Module,
    example_args: tuple | list,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    policy: Policy | str = "params=float32,compute=float32,output=float32",
    device: str | torch.device | None = None,
    op_policies: Mapping[Any, Any] | None = None,
    module_policies: Mapping[Any, Any] | None = None,
    min_run_time: float = 0.02,
) -> BlockProbe:
    """A cheap ``make_step`` for :func:`choose_compute_dtype`: one repeated block's kernels, not the whole step.

    Finds the model's repeated block (the largest group of identical submodules: same class, parameter shapes
    and settings, such as a transformer's blocks; the whole model when there is none); nothing runs yet. The
    first ``probe(dtype)`` captures the input the first of them receives in one no-grad forward of
    ``model(*example_args, **example_kwargs)``; each ``probe(dtype)`` runs that block forward and backward once
    in ``dtype`` and records the library kernels it calls (matmuls, convolutions, attention), and returns a
    ``run()`` that replays them: milliseconds to seconds a candidate, no compile, where timing the compiled
    step costs a compile per candidate.

    What it leaves out: elementwise work (fused by the compiled step; about the same or cheaper in a half
    dtype), the casts of the weights, and everything outside the block (embedding, head, loss, optimizer,
    the same in every candidate). So on a model whose blocks are narrow (the main job's GPT ``small``, width
    128) the step's ratio to float32 is closer to 1 than the block's kernels'.

    Args:
      model: the model (not changed; the block is copied by :func:`funcamp.nn.functionalize`).
      example_args: the forward's positional arguments, a tuple (a batch of the real shape).
      example_kwargs: keyword arguments of that forward.
      policy: the base policy: its ``param_dtype`` and ``reduce_dtype`` are kept, the compute and output
        dtypes are the candidate's.
      device: where to run; default the model's parameters' device.
      op_policies: per-op rules the step uses (as :func:`tune_policy`).
      module_policies: the step's ``functionalize`` entries that keep some modules off the candidate dtype
        (``{type: policy}``, such as :data:`funcamp.fp8.MODULE_POLICIES`; name patterns are matched against
        names inside the block); the rest of the block computes in the candidate.
      min_run_time: seconds one ``run()`` of the first dtype timed should take at least on a quiet machine (the
        kernels are replayed as often as needed, at most 256 kernel calls a run); each timed round of
        :func:`choose_compute_dtype` is one ``run()`` per candidate.
    Returns:
      A :class:`BlockProbe`: pass it as ``make_step`` and its ``key`` in the ``key`` mapping.
    Raises:
      TypeError: if ``model`` is not an ``nn.Module`` or ``example_args`` is not a tuple or list.
      ValueError: if the device is ``meta`` or ``min_run_time`` is not positive; from ``probe(dtype)``, if the
        block is not called by the forward or calls no matmul, convolution or attention kernel.
      RuntimeError: from ``probe(dtype)``, whatever the model's forward or the block's forward or backward raises.

    Example:
      >>> model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3)))
      >>> probe = block_probe(model, (torch.randn(8, 16),))
      >>> probe.name, probe.members
      ('0', ('0', '1', '2'))
      >>> run = probe(torch.float32)   # captures, runs forward+backward once, records
      >>> probe.kernels                # forward addmm, backward two mm
      3
    """
    fn = "block_probe"
    _check_module(model, fn)
    if not isinstance(example_args, (tuple, list)):
        raise TypeError(
            f"{fn}: example_args must be a tuple of the forward's positional arguments, got "
            f"{type(example_args).__name__} (write (x,) for one tensor)"
        )
    if isinstance(min_run_time, bool) or not isinstance(min_run_time, (int, float)) or not min_run_time > 0:
        raise ValueError(f"{fn}: min_run_time must be a number of seconds > 0, got {min_run_time!r}")
    kwargs = dict(example_kwargs or {})
    base = get_policy(policy)
    device = _timing_device(model, device, fn, "pass a model and inputs on a real device")
    name, members = _repeated_block(model)
    example = (tuple(example_args), kwargs)
    return BlockProbe(model, name, members, example, base, device, op_policies, module_policies, float(min_run_time))
