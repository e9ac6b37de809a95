"""Timing: one call's median seconds (:func:`median_seconds`), and a step's candidates timed in interleaved
rounds (:func:`time_steps`, :class:`StepTiming`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from funcamp._dynamo_autograd import wait_for_cpu_isa_probe
from funcamp.tune._keys import label


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

    wait_for_cpu_isa_probe()  # a compiled step built before this may have started the compiler in a thread
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return float(timer.blocked_autorange(min_run_time=min_run_time).median)


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


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A call that waits for ``device``'s queued work (its backend's ``synchronize``; else a no-op)."""
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu, torch.cpu
    return getattr(backend, "synchronize", None) or (lambda: None)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:160]


def time_steps(
    make_step: Callable[[torch.dtype], Callable[[], Any]],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    rounds: int,
    warmup: int,
    timer: Callable[[Callable[[], Any]], float] | None,
) -> list[StepTiming]:
    """Build each candidate's step, call it ``warmup`` times (the first compiles), then time it in
    ``rounds`` interleaved rounds, the order rotated each round (A B, B A, ...)."""
    sync = synchronizer(device)

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
                f"choose_compute_dtype: make_step({label(dtype)}) must return a function of no arguments that "
                f"runs one step, got {type(fn).__name__}"
            )
        fn.dtype = dtype  # type: ignore[attr-defined]  # for a timer that wants to know (tests)
        runs[dtype] = fn
    wait_for_cpu_isa_probe()  # the candidates' compiles may have started the compiler in a thread
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
