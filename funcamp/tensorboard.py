"""TensorBoard logging of train-step metrics, read from the device once per logging interval.

:class:`TensorBoardLogger` keeps the 0-d metric tensors a compiled step returns (no host sync), and
at the end of each interval stacks them into one tensor and reads it with one ``.tolist()``: one
device-to-host transfer per interval, never inside the step. It writes with TensorBoard's
``SummaryWriter`` (``torch.utils.tensorboard``); open the curves with
``python3 -m tensorboard.main --logdir DIR``.

The precision telemetry of ``make_train_step(telemetry=N)`` (:mod:`funcamp.numerics`) is written as
scalars under its own names (``numerics/<group>/...``) and its ``grad_log2_hist`` vectors as
TensorBoard histograms of log2|g|, from the interval's last step that computed them.
"""

from __future__ import annotations

import math
import numbers
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["DEFAULT_TAGS", "MEAN_METRICS", "TensorBoardLogger"]

#: Where each metric of :func:`funcamp.make_train_step` goes; ``None``: not written. Other 0-d numeric
#: metrics are written under ``train/<name>``, ``numerics/...`` ones under their own name; other
#: non-scalar ones (``aux``) are ignored.
DEFAULT_TAGS: dict[str, str | None] = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "learning_rate": "train/learning_rate",
    "loss_scale": "amp/loss_scale",
    "grads_finite": "amp/grads_finite",
    "skipped_steps": "amp/skipped_steps",
    "consecutive_skips": "amp/consecutive_skips",
    "nonfinite_leaf": None,  # a parameter index: see funcamp.nonfinite_leaf_name
    "too_many_skips": None,
    "numerics/active": None,  # whether the step computed its numerics/... metrics; decides which are written
}

#: The prefix of :mod:`funcamp.numerics` metrics: written under their own name, from an active step.
NUMERICS_PREFIX = "numerics/"
_ACTIVE = "numerics/active"
_HIST_SUFFIX = "/grad_log2_hist"

#: Metrics written as their mean over the interval (``grads_finite``: the fraction of finite steps);
#: every other metric is written as its value at the interval's last step.
MEAN_METRICS: frozenset[str] = frozenset({"loss", "grad_norm", "grads_finite"})

#: The tag of the throughput, in tokens (or samples) per second of wall time over the interval.
THROUGHPUT_TAG = "perf/tokens_per_second"


def _is_numerics(name: str, x: Any) -> bool:
    return name.startswith(NUMERICS_PREFIX) and isinstance(x, torch.Tensor) and x.ndim <= 1


def _is_scalar(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.ndim == 0 and not x.is_complex()
    return isinstance(x, numbers.Real)


class TensorBoardLogger:
    """Write a train step's metrics to TensorBoard, one value per logging interval.

    Call :meth:`log` after every step with that step's metrics (0-d tensors, on any device). The
    logger only keeps references until the interval ends; then it stacks every kept scalar (and
    a tensor ``step``), converts them to float64 (float32 on MPS) on their device and reads them in
    one ``.tolist()``. ``loss``, ``grad_norm`` and ``grads_finite`` are written as means over the
    interval (non-finite values included, so an overflowing loss shows), the others
    (``loss_scale``, ``skipped_steps``, ``learning_rate``, ...) as their last value; tags follow
    :data:`DEFAULT_TAGS`. With ``tokens_per_step`` it also writes ``perf/tokens_per_second``: the
    tokens of the interval's timed steps over the wall time between two reads (everything the loop
    did; the first step, which compiles, and work before :meth:`restart_clock` are left out).

    Telemetry (``numerics/...`` metrics of ``make_train_step(telemetry=N)``): from the interval's last
    step whose ``numerics/active`` is true, each scalar at that step under its own name, and each
    ``numerics/<group>/grad_log2_hist`` as a TensorBoard histogram of log2|g| (one bin per binade, see
    :mod:`funcamp.numerics`; the histogram's sum and sum of squares use the bin centres). An interval
    without an active step writes no telemetry. They travel in the interval's one read.

    Intervals: when :meth:`log` gets an ``int`` step, an interval ends at every step divisible by
    ``log_every`` (so a resumed run logs at the same steps); otherwise every ``log_every`` calls.

    Unlike ``torch.amp``-based loops that call ``loss.item()`` every step (a host sync per step),
    nothing here reads the device between intervals. funcamp-specific: jmp and torch.amp have no logger.

    Args:
      logdir: directory for the event files (created if missing); a ``str`` or ``os.PathLike``.
      log_every: steps per interval, an int >= 1.
      tokens_per_step: tokens (or samples) one step processes, for the throughput; ``None``: none.
      tags: overrides of :data:`DEFAULT_TAGS` (``{"loss": "loss"}``; a value ``None`` drops a metric).
      enabled: ``False`` makes every method a no-op that writes nothing (non-main ranks).
      flush_secs: how often ``SummaryWriter`` flushes to disk, in seconds.
      purge_step: when resuming, the first step of this run: TensorBoard then hides the events of
        earlier runs in ``logdir`` at this step and later (those logged after the last checkpoint).
    Raises:
      TypeError: if ``logdir`` is not a path, or ``tags`` not a mapping of names to str or None.
      ValueError: if ``log_every`` is not an int >= 1, or ``tokens_per_step`` not a number > 0.

    Example:
      >>> import tempfile
      >>> with tempfile.TemporaryDirectory() as d, TensorBoardLogger(d, log_every=2) as logger:
      ...     logger.log({"loss": torch.tensor(3.0), "loss_scale": torch.tensor(8.0)}, step=1)
      ...     logger.log({"loss": torch.tensor(1.0), "loss_scale": torch.tensor(4.0)}, step=2)
      {'train/loss': 2.0, 'amp/loss_scale': 4.0}
    """

    def __init__(
        self,
        logdir: str | os.PathLike[str],
        *,
        log_every: int = 10,
        tokens_per_step: float | None = None,
        tags: Mapping[str, str | None] | None = None,
        enabled: bool = True,
        flush_secs: int = 30,
        purge_step: int | None = None,
    ) -> None:
        if not isinstance(logdir, (str, os.PathLike)):
            raise TypeError(f"TensorBoardLogger: logdir must be a str or path, got {type(logdir).__name__}")
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"TensorBoardLogger: log_every must be an int >= 1, got {log_every!r}")
        if tokens_per_step is not None and not (
            isinstance(tokens_per_step, numbers.Real) and 0 < tokens_per_step < math.inf
        ):
            raise ValueError(
                f"TensorBoardLogger: tokens_per_step must be None or a number > 0, got {tokens_per_step!r}"
            )
        if tags is not None and (
            not isinstance(tags, Mapping) or not all(v is None or isinstance(v, str) for v in tags.values())
        ):
            raise TypeError(f"TensorBoardLogger: tags must map metric names to a tag string or None, got {tags!r}")
        self.logdir = os.fspath(logdir)
        self.log_every = log_every
        self.tokens_per_step = tokens_per_step
        self.tags = {**DEFAULT_TAGS, **(tags or {})}
        self.enabled = enabled
        self._pending: list[tuple[Any, dict[str, Any]]] = []
        self._calls = 0
        self._untimed = 0  # pending steps that ran before the throughput clock (re)started
        self._last_time: float | None = None
        self._writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.logdir, flush_secs=flush_secs, purge_step=purge_step)

    def _tag(self, name: str) -> str | None:
        if name in self.tags:
            return self.tags[name]
        return name if name.startswith(NUMERICS_PREFIX) else f"train/{name}"

    def log(self, metrics: Mapping[str, Any], step: int | torch.Tensor | None = None) -> dict[str, float] | None:
        """Keep one step's metrics; at the end of an interval, read and write them all.

        Args:
          metrics: name -> 0-d tensor (any device) or Python number, e.g. a train step's metrics.
            Entries that are not real scalars (``aux``) and those tagged ``None`` are ignored.
          step: the global step these metrics belong to (the x axis): a Python ``int`` (preferred:
            decides the interval without a device read), a 0-d integer tensor (read with the
            rest at the interval's end), or ``None`` (the number of calls so far).
        Returns:
          At the end of an interval, ``{tag: value}`` as written (floats, on the host), for a
          progress bar; otherwise (and when disabled) ``None``.
        Raises:
          TypeError: if ``metrics`` is not a mapping, or ``step`` is not an int, a 0-d tensor or None.
        """
        if not isinstance(metrics, Mapping):
            raise TypeError(f"TensorBoardLogger.log: metrics must be a mapping, got {type(metrics).__name__}")
        if not (step is None or isinstance(step, int) or (isinstance(step, torch.Tensor) and step.ndim == 0)):
            raise TypeError(f"TensorBoardLogger.log: step must be an int, a 0-d tensor or None, got {step!r}")
        if not self.enabled:
            return None
        self._calls += 1
        step = self._calls if step is None else step
        kept = {
            k: v
            for k, v in metrics.items()
            if not k.startswith(NUMERICS_PREFIX) and self._tag(k) is not None and _is_scalar(v)
        }
        # numerics/...: scalars and histograms, with the flag that says whether this step computed them.
        kept.update({k: v for k, v in metrics.items() if _is_numerics(k, v) and (k == _ACTIVE or self._tag(k))})
        self._pending.append((step, kept))
        if self._last_time is None:  # the first step (compilation) is not timed
            self.restart_clock()
        if isinstance(step, int) and not isinstance(step, bool):
            done = step % self.log_every == 0
        else:
            done = len(self._pending) >= self.log_every
        return self.flush_metrics() if done else None

    def flush_metrics(self) -> dict[str, float] | None:
        """Read and write the metrics kept since the last interval now (e.g. at the end of training).

        Returns:
          ``{tag: value}`` as written, or ``None`` if nothing was pending or the logger is disabled.
        """
        if not self.enabled or not self._pending:
            return None
        pending, self._pending = self._pending, []
        steps, values = _read(pending)
        now = time.perf_counter()
        elapsed, timed = now - (self._last_time or now), len(pending) - self._untimed
        self._last_time, self._untimed = now, 0
        numerics = _last_active(steps, values)  # (step, {name: value}) of the last step that measured
        names = {name for _, kept in pending for name in kept if not name.startswith(NUMERICS_PREFIX)}
        written: dict[str, float] = {}
        for name in sorted(names, key=lambda n: list(DEFAULT_TAGS).index(n) if n in DEFAULT_TAGS else 99):
            series = [v[name] for v in values if name in v]
            value = sum(series) / len(series) if name in MEAN_METRICS else series[-1]
            written[self._tag(name)] = float(value)
        if self.tokens_per_step is not None and elapsed > 0 and timed > 0:
            written[THROUGHPUT_TAG] = self.tokens_per_step * timed / elapsed
        step = steps[-1]
        for tag, value in written.items():
            self._writer.add_scalar(tag, value, global_step=step)
        if numerics is not None:
            written.update(self._write_numerics(*numerics))
        return written

    def _write_numerics(self, step: int, values: dict[str, Any]) -> dict[str, float]:
        """Write one step's telemetry: scalars under their names, ``grad_log2_hist`` as histograms."""
        written = {}
        for name, value in sorted(values.items()):
            tag = self._tag(name)
            if name == _ACTIVE or tag is None:
                continue
            if isinstance(value, list):
                if name.endswith(_HIST_SUFFIX):
                    _add_log2_histogram(self._writer, tag, value, step)
                continue
            written[tag] = float(value)
            # TensorBoard draws no line at all for a chart holding one +-inf point (a NaN is a gap): an
            # overflowed step's grad_amax (inf) and headroom_log2 (-inf) are written as NaN. The returned
            # dict keeps the real values.
            self._writer.add_scalar(tag, float(value) if math.isfinite(value) else math.nan, global_step=step)
        return written

    def restart_clock(self) -> None:
        """Restart the throughput clock now; steps already kept in this interval are not timed.

        Call it after work that is not training (evaluation, checkpointing, sampling) so that its
        time does not lower ``perf/tokens_per_second``. :meth:`log` calls it at the first step, so
        the first step (compilation) is not timed.
        """
        self._last_time = time.perf_counter()
        self._untimed = len(self._pending)

    def log_scalars(self, scalars: Mapping[str, float | torch.Tensor], step: int) -> None:
        """Write scalars under the given tags now, e.g. ``{"val/loss": 1.9}`` (tensors are read once).

        Args:
          scalars: full tag -> Python number or 0-d tensor.
          step: the global step, an int.
        Raises:
          TypeError: if ``step`` is not an int, or a value is not a real scalar.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"TensorBoardLogger.log_scalars: step must be an int, got {step!r}")
        for tag, value in scalars.items():
            if not _is_scalar(value):
                raise TypeError(f"TensorBoardLogger.log_scalars: {tag!r} must be a real scalar, got {value!r}")
        if not self.enabled:
            return
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, float(value), global_step=step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Write a text summary (e.g. a generated sample), shown in TensorBoard's Text tab."""
        if self.enabled:
            self._writer.add_text(tag, text, global_step=step)

    def flush(self) -> None:
        """Write pending metrics and flush the event file to disk."""
        if self.enabled:
            self.flush_metrics()
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; later calls write nothing."""
        if self.enabled:
            self.flush()
            self._writer.close()
            self.enabled = False

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _last_active(steps: list[int], values: list[dict[str, Any]]) -> tuple[int, dict[str, Any]] | None:
    """The last step of an interval whose ``numerics/...`` were computed (``numerics/active`` true)."""
    for step, v in zip(reversed(steps), reversed(values)):
        numerics = {k: x for k, x in v.items() if k.startswith(NUMERICS_PREFIX)}
        if numerics and numerics.get(_ACTIVE, 1.0):
            return step, numerics
    return None


def _add_log2_histogram(writer: Any, tag: str, counts: list[float], step: int) -> None:
    """A histogram of log2|g| from :mod:`funcamp.numerics`'s fixed binade counts (bin centres for the moments)."""
    from funcamp.numerics import histogram_edges

    edges = histogram_edges()
    num = sum(counts)
    if num <= 0:  # an all-zero (or all non-finite) gradient: nothing to draw
        return
    used = [i for i, c in enumerate(counts) if c > 0]
    centres = [(edges[i] + edges[i + 1]) / 2 for i in range(len(counts))]
    writer.add_histogram_raw(
        tag,
        min=edges[used[0]],
        max=edges[used[-1] + 1],
        num=num,
        sum=sum(c * x for c, x in zip(counts, centres)),
        sum_squares=sum(c * x * x for c, x in zip(counts, centres)),
        bucket_limits=edges[1:],
        bucket_counts=counts,
        global_step=step,
    )


def _read(pending: list[tuple[Any, dict[str, Any]]]) -> tuple[list[int], list[dict[str, Any]]]:
    """Every kept value on the host (floats; lists for 1-d tensors), one transfer per device."""
    tensors: list[torch.Tensor] = []
    for step, kept in pending:
        if isinstance(step, torch.Tensor):
            tensors.append(step)
        tensors.extend(v for v in kept.values() if isinstance(v, torch.Tensor))
    host = iter(_to_host(tensors))
    steps, values = [], []
    for step, kept in pending:
        steps.append(int(next(host)) if isinstance(step, torch.Tensor) else step)
        values.append({k: (next(host) if isinstance(v, torch.Tensor) else float(v)) for k, v in kept.items()})
    return steps, values


def _to_host(tensors: list[torch.Tensor]) -> list[Any]:
    """Concatenate 0-d and 1-d tensors (per device, in order) and read them with one ``.tolist()`` per
    device; a 0-d tensor comes back as a float, a 1-d one as a list of floats."""
    if not tensors:
        return []
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[Any] = [0.0] * len(tensors)
    for device, idx in by_device.items():
        dtype = torch.float32 if device.type == "mps" else torch.float64
        flat = torch.cat([tensors[i].detach().reshape(-1).to(dtype) for i in idx]).tolist()
        start = 0
        for i in idx:
            n = tensors[i].numel()
            out[i] = flat[start] if tensors[i].ndim == 0 else flat[start : start + n]
            start += n
    return out
