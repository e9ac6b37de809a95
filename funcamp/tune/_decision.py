"""One compute dtype for the whole step: :func:`choose_compute_dtype` (the facts, the cache, the measurement,
the decision) and its cache files.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from funcamp import hardware
from funcamp.tune._checks import check_candidates, check_counts, check_margin, check_module, timing_device
from funcamp.tune._keys import (
    cache_path,
    label,
    module_signature,
    read_cached,
    software_key,
    step_machine,
    tree_signature,
    write_json,
)
from funcamp.tune._timing import StepTiming, time_steps

_CHOICE_FORMAT = 2  # version of the compute-dtype cache files' layout (2: module settings, facts, `what`)


_CHOICE_PREFIX = "compute-dtype-"


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
        head = f"{label(self.dtype)} compute on {self.machine}"
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
        return f"{label(t.dtype)} {t.refused}"
    text = f"{label(t.dtype)} {1e3 * t.seconds:.4g} ms"
    return text if t.dtype == torch.float32 else f"{text} (median per-round ratio {t.ratio:.3g}x)"


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
        halves = "; ".join(f"{label(t.dtype)}: {t.refused}" for t in judged if t.dtype != torch.float32)
        noisy = any("is wider than the difference" in t.refused for t in judged)
        lead = "float32: no half dtype on a measurement this noisy" if noisy else "float32: no half dtype is faster"
        return torch.float32, f"{lead} ({halves})", tuple(judged)
    best = min(winners, key=lambda t: t.ratio)
    judged = [
        dataclasses.replace(t, refused=f"slower than {label(best.dtype)}") if t in winners and t is not best else t
        for t in judged
    ]
    gain, spread = 1 - best.ratio, best.high - best.low
    reason = (
        f"{label(best.dtype)}'s step takes {best.ratio:.3g}x float32's (quartiles of the rounds' ratios "
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
    check_module(model, fn)
    if key is not None and not isinstance(key, Mapping):
        raise TypeError(f"{fn}: key must be a mapping of JSON values (the step's settings), got {type(key).__name__}")
    try:
        extra = json.loads(json.dumps(dict(key or {}), sort_keys=True))
    except (TypeError, ValueError) as error:
        raise TypeError(f"{fn}: key must hold JSON values only (str, numbers, bools, lists, dicts): {error}") from None
    check_counts(fn, rounds=(rounds, 3), warmup=(warmup, 1))
    check_margin(margin, fn)
    if not isinstance(what, str):
        raise TypeError(f"{fn}: what must be a str (what run() runs), got {type(what).__name__}")
    device = timing_device(model, device, fn, "pass the device the step runs on")
    wanted = None if candidates is None else check_candidates(candidates, fn)
    cap = hardware.capability(device)
    machine = step_machine(device, cap)
    if cap.decided is not None:
        return ComputeDtypeChoice(cap.decided, "capability", cap.reason, str(device), machine)
    halves = tuple(d for d in cap.candidates if wanted is None or d in wanted)
    if not halves:
        asked = ", ".join(label(d) for d in (wanted or ()) if d != torch.float32) or "none"
        why = f"no half dtype to measure (asked for: {asked}; {cap.reason})"
        return ComputeDtypeChoice(torch.float32, "capability", why, str(device), machine)
    dtypes = (torch.float32, *halves)

    key_doc = {
        "format": _CHOICE_FORMAT,
        "model": [[n, *module_signature(m)] for n, m in model.named_modules()],
        "batch": tree_signature(example_batch),
        "device": str(device),
        "machine": machine,
        **software_key(device),
        "what": what,
        "candidates": [label(d) for d in dtypes],
        "rounds": rounds,
        "warmup": warmup,
        "margin": float(margin),
        "key": extra,
    }
    path = cache_path(cache, key_doc, fn, prefix=_CHOICE_PREFIX)
    if path is not None and not retune:
        hit = _load_choice(path, key_doc, dtypes)
        if hit is not None:
            return hit
    timings = time_steps(make_step, dtypes, device, rounds, warmup, timer)
    dtype, reason, judged = _decide(timings, float(margin))
    when = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    choice = ComputeDtypeChoice(dtype, "measured", reason, str(device), machine, judged, rounds, path, when, what)
    if path is not None:
        _save_choice(path, choice, key_doc)
    return choice


def _save_choice(path: Path, choice: ComputeDtypeChoice, key_doc: dict) -> None:
    timings = [{**dataclasses.asdict(t), "dtype": label(t.dtype)} for t in choice.timings]
    doc = {
        "key": key_doc,
        "choice": label(choice.dtype),
        "reason": choice.reason,
        "device": choice.device,
        "machine": choice.machine,
        "rounds": choice.rounds,
        "measured_at": choice.measured_at,
        "what": choice.what,
        "timings": timings,
    }
    write_json(path, doc, "choose_compute_dtype")


def _load_choice(path: Path, key_doc: dict, dtypes: tuple[torch.dtype, ...]) -> ComputeDtypeChoice | None:
    """The decision a cache file holds for this key; None when there is none (a warning when it is unreadable)."""

    def parse(doc: dict) -> ComputeDtypeChoice:
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

    return read_cached(path, key_doc, "choose_compute_dtype", parse)
