"""Which dtypes a device computes fast: asked of torch first, measured where torch cannot tell.

Mixed precision only pays where the hardware has fast half-precision kernels. Many CPUs do not: on an
AVX2-only CPU (no AVX-512, no AMX) oneDNN has no bfloat16 or float16 matmul, and torch falls back to
a scalar loop that is 20-40x slower than float32. :func:`probe` decides, once per device and process:

* **CPU**: a half dtype is slow when oneDNN reports no kernels for it
  (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` / ``_is_mkldnn_fp16_supported()``); bfloat16 is
  fast where AMX tiles are available (``torch._C._cpu._init_amx()``); otherwise (AVX-512 without AMX)
  a matmul of a few milliseconds in each dtype decides.
* **CUDA**: bfloat16 is fast from compute capability 8.0 (Ampere tensor cores), float16 from 7.0
  (Volta tensor cores) and on 6.0 (P100); elsewhere slow (6.1 consumer Pascal runs float16 at 1/64
  rate). No measurement.
* **Other devices** (MPS, XPU, ...): measured.

"Fast" means a matmul in that dtype takes at most :data:`FAST_RATIO` times as long as in float32.
Unlike ``torch.amp`` (which autocasts to bfloat16 on every CPU) and jmp (whose ``half_dtype`` is
float16 off TPU), funcamp's :func:`funcamp.half_dtype` uses this probe and computes in float32 where no
half dtype is fast.

:func:`capability` is the part of it that times nothing: the facts alone (CUDA compute capability; a CPU
without oneDNN half kernels), and otherwise the half dtypes worth measuring. The main job's ``--policy
auto`` starts from it and, where the facts do not decide, times one repeated block's kernels in each
candidate dtype (:func:`funcamp.tune.choose_compute_dtype` with :func:`funcamp.tune.block_probe`) instead of
a matmul.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import torch

__all__ = ["FAST_RATIO", "Capability", "DtypeSpeed", "HardwareReport", "capability", "probe"]

#: A half dtype is "fast" when its matmul takes at most this many times float32's.
FAST_RATIO = 1.1

_MEASURE_N = 256  # a (256 x 256) @ (256 x 256) matmul: under a millisecond in float32 on one core
_MEASURE_REPEATS = 3


@dataclasses.dataclass(frozen=True)
class DtypeSpeed:
    """Whether one dtype is fast on a device, and why.

    Attributes:
      dtype: ``torch.bfloat16`` or ``torch.float16``.
      fast: True when a matmul in ``dtype`` is at most :data:`FAST_RATIO` times float32's time.
      reason: one line: what torch reported or what was measured.
      ratio: measured time relative to float32 (None when torch's report decided without measuring).
      kernels: False when the device has no optimized kernels for ``dtype`` at all (oneDNN reports
        none on this CPU, or a matmul raised): then some ops have no implementation in ``dtype``
        (oneDNN's LSTM under CPU autocast), not only slow ones.
    """

    dtype: torch.dtype
    fast: bool
    reason: str
    ratio: float | None = None
    kernels: bool = True


@dataclasses.dataclass(frozen=True)
class HardwareReport:
    """What :func:`probe` found for one device.

    Attributes:
      device: the probed device (``cpu``, ``cuda:0``, ...).
      name: the CPU capability (``torch.backends.cpu.get_cpu_capability()``) or the GPU's name and
        compute capability.
      bfloat16: the verdict for bfloat16.
      float16: the verdict for float16.
    """

    device: torch.device
    name: str
    bfloat16: DtypeSpeed
    float16: DtypeSpeed

    @property
    def half_dtype(self) -> torch.dtype:
        """bfloat16 if fast, else float16 if fast, else float32 (no half dtype is fast here)."""
        for speed in (self.bfloat16, self.float16):
            if speed.fast:
                return speed.dtype
        return torch.float32

    def explain(self) -> str:
        """One line: the chosen compute dtype and why, e.g. for a program's header."""
        chosen = self.half_dtype
        if chosen == torch.float32:
            return (
                f"float32 compute on {self.name}: no fast half dtype "
                f"(bfloat16: {self.bfloat16.reason}; float16: {self.float16.reason})"
            )
        verdict = self.bfloat16 if chosen == torch.bfloat16 else self.float16
        return f"{str(chosen).removeprefix('torch.')} compute on {self.name}: {verdict.reason}"


def _normalize(device: str | torch.device | None, fn: str = "probe") -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{fn}: device must be a str, a torch.device or None, got {type(device).__name__}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def probe(device: str | torch.device | None = None) -> HardwareReport:
    """Find out whether bfloat16 and float16 are fast on ``device`` (cached per device and process).

    Args:
      device: a device or its name; ``None`` means CUDA when available, else CPU.
    Returns:
      A :class:`HardwareReport`; ``probe(d).half_dtype`` is the dtype to compute in.
    Raises:
      TypeError: if ``device`` is not a str, torch.device or None.
      RuntimeError: if ``device`` names a device type torch does not know.

    Example:
      >>> probe("cpu").device
      device(type='cpu')
    """
    return _probe(_normalize(device))


@functools.cache
def _probe(device: torch.device) -> HardwareReport:
    if device.type == "cpu":
        return _probe_cpu(device, _cpu_facts())
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return _probe_cuda(device, torch.cuda.get_device_name(device), (major, minor))
    if device.type == "meta":
        # Nothing runs on meta; report what a CPU would get so that shapes-only runs pick the same policy.
        return dataclasses.replace(_probe(torch.device("cpu")), device=device)
    name = device.type
    return HardwareReport(device, name, _measured(torch.bfloat16, device), _measured(torch.float16, device))


def _cpu_facts() -> dict[str, Any]:
    """What torch reports about this CPU (one place, so that tests can replace it)."""

    def ask(fn: Any) -> bool:
        try:
            return bool(fn())
        except (AttributeError, RuntimeError):
            return False

    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_bf16": ask(lambda: torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "mkldnn_fp16": ask(lambda: torch.ops.mkldnn._is_mkldnn_fp16_supported()),
        "amx": ask(lambda: torch._C._cpu._init_amx()),
        "amx_fp16": "amx_fp16" in _cpu_flags(),
    }


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (``/proc/cpuinfo``); empty where there is none.

    torch reports AMX (``_init_amx``, the bfloat16 tiles) but not AMX-FP16 (Granite Rapids and newer)."""
    return frozenset(_cpuinfo("flags").split())


def _cpuinfo(key: str) -> str:
    """The value of the first ``key`` line of ``/proc/cpuinfo`` (``"flags"``, ``"model name"``), or ``""``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _probe_cpu(device: torch.device, facts: dict[str, Any]) -> HardwareReport:
    capability = facts["capability"]
    name = f"CPU ({capability}{', AMX' if facts['amx'] else ''})"

    def verdict(dtype: torch.dtype, supported: bool) -> DtypeSpeed:
        label = str(dtype).removeprefix("torch.")
        if not supported:
            return DtypeSpeed(dtype, False, f"oneDNN has no {label} kernels for this CPU ({capability})", kernels=False)
        if dtype == torch.bfloat16 and facts["amx"]:
            return DtypeSpeed(dtype, True, "AMX bfloat16 tiles")
        return _measured(dtype, device)

    return HardwareReport(
        device, name, verdict(torch.bfloat16, facts["mkldnn_bf16"]), verdict(torch.float16, facts["mkldnn_fp16"])
    )


def _probe_cuda(device: torch.device, gpu: str, cc: tuple[int, int]) -> HardwareReport:
    name = f"{gpu} (compute capability {cc[0]}.{cc[1]})"
    bf16_fast = cc >= (8, 0)
    fp16_fast = cc >= (7, 0) or cc == (6, 0)
    return HardwareReport(
        device,
        name,
        DtypeSpeed(
            torch.bfloat16,
            bf16_fast,
            "bfloat16 tensor cores (compute capability 8.0+)" if bf16_fast else "no bfloat16 tensor cores before 8.0",
        ),
        DtypeSpeed(
            torch.float16,
            fp16_fast,
            "float16 tensor cores" if fp16_fast else f"float16 runs at a fraction of float32's rate on {cc[0]}.{cc[1]}",
        ),
    )


def _measured(dtype: torch.dtype, device: torch.device) -> DtypeSpeed:
    label = str(dtype).removeprefix("torch.")
    try:
        ratio = _matmul_seconds(dtype, device) / _matmul_seconds(torch.float32, device)
    except (RuntimeError, NotImplementedError) as error:  # no kernel at all for this dtype here
        return DtypeSpeed(
            dtype, False, f"no {label} matmul on {device.type}: {str(error).splitlines()[0]}", kernels=False
        )
    fast = ratio <= FAST_RATIO
    return DtypeSpeed(dtype, fast, f"measured: a {label} matmul takes {ratio:.2g}x float32's time", ratio)


def _matmul_seconds(dtype: torch.dtype, device: torch.device) -> float:
    """Median seconds of a (256 x 256) @ (256 x 256) matmul in ``dtype`` on ``device`` (after a warm-up)."""
    a = torch.randn(_MEASURE_N, _MEASURE_N, device=device).to(dtype)
    b = torch.randn(_MEASURE_N, _MEASURE_N, device=device).to(dtype)
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu, torch.cpu
    sync = getattr(backend, "synchronize", None) or (lambda: None)
    (a @ b).sum()
    sync()
    times = []
    for _ in range(_MEASURE_REPEATS):
        start = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@dataclasses.dataclass(frozen=True)
class Capability:
    """What torch reports about a device's half dtypes, with nothing timed.

    Attributes:
      device: the device asked about (``cpu``, ``cuda:0``, ...).
      name: as :attr:`HardwareReport.name`: the CPU capability (and AMX), or the GPU's name and compute capability.
      decided: the compute dtype when the facts alone decide (CUDA: by compute capability, as :func:`probe`;
        a CPU whose oneDNN has neither bfloat16 nor float16 kernels: float32), else None.
      candidates: when undecided, the half dtypes worth timing against float32 (on a CPU those oneDNN has
        kernels for; elsewhere bfloat16 and float16); ``()`` when decided.
      reason: one line: why the facts decide, or which facts leave the choice to a measurement.
    """

    device: torch.device
    name: str
    decided: torch.dtype | None
    candidates: tuple[torch.dtype, ...]
    reason: str


def capability(device: str | torch.device | None = None) -> Capability:
    """What torch's facts alone say about computing in a half dtype on ``device`` (nothing is timed).

    * **CUDA**: the compute capability decides, as in :func:`probe` (bfloat16 from 8.0, float16 on 7.x and
      6.0, else float32).
    * **CPU**: a half dtype without oneDNN kernels (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` /
      ``_is_mkldnn_fp16_supported()`` False, as on AVX2-only CPUs) is out at once, and so is float16 without
      AMX-FP16 tiles (the ``amx_fp16`` flag of ``/proc/cpuinfo``; Granite Rapids and newer): with AVX512-FP16
      alone (Sapphire Rapids) a float16 train step measured 1.01x float32's, and float16 needs a loss scale.
      When no half dtype is left, float32 is decided. Otherwise (AVX-512 with bfloat16, AMX) the half dtypes
      left are for a measurement to decide: fast matmuls do not make the whole step faster (CPU attention
      can be several times slower in bfloat16, and a narrow model pays its casts).
    * **meta**: the CPU's facts (as :func:`probe`). **Other devices** (MPS, XPU, ...): bfloat16 and float16
      are left to a measurement.

    Args:
      device: a device or its name; ``None`` means CUDA when available, else CPU.
    Returns:
      A :class:`Capability`; ``.decided`` is None when only a measurement can choose among ``.candidates``.
    Raises:
      TypeError: if ``device`` is not a str, torch.device or None.
      RuntimeError: if ``device`` names a device type torch does not know.

    Example:
      >>> capability("cpu").device
      device(type='cpu')
    """
    device = _normalize(device, "capability")
    if device.type == "cuda":
        report = _probe(device)  # compute capability: no measurement on CUDA
        chosen = report.half_dtype
        verdict = {torch.bfloat16: report.bfloat16, torch.float16: report.float16}.get(chosen)
        why = verdict.reason if verdict is not None else f"{report.bfloat16.reason}; {report.float16.reason}"
        return Capability(device, report.name, chosen, (), why)
    if device.type in ("cpu", "meta"):
        return dataclasses.replace(_capability_cpu(_cpu_facts()), device=device)
    return Capability(
        device,
        device.type,
        None,
        (torch.bfloat16, torch.float16),
        f"no facts about half dtypes on {device.type}: to be measured",
    )


def _capability_cpu(facts: dict[str, Any]) -> Capability:
    cap = facts["capability"]
    name = f"CPU ({cap}{', AMX' if facts['amx'] else ''})"
    kernels = [d for d, key in ((torch.bfloat16, "mkldnn_bf16"), (torch.float16, "mkldnn_fp16")) if facts[key]]
    if not kernels:
        return Capability(
            torch.device("cpu"),
            name,
            torch.float32,
            (),
            f"oneDNN has no bfloat16 or float16 kernels for this CPU ({cap})",
        )
    # float16 kernels without AMX-FP16 tiles (AVX512-FP16, as on Sapphire Rapids) compute a step at about
    # float32's speed and need a loss scale: not a candidate worth measuring.
    slow_fp16 = torch.float16 in kernels and not facts.get("amx_fp16", False)
    halves = tuple(d for d in kernels if not (d == torch.float16 and slow_fp16))
    have = " and ".join(str(d).removeprefix("torch.") for d in kernels)
    dropped = "; float16 not measured: no AMX-FP16 tiles" if slow_fp16 else ""
    if not halves:
        return Capability(
            torch.device("cpu"),
            name,
            torch.float32,
            (),
            f"oneDNN has {have} kernels for this CPU "
            f"({cap}{', AMX' if facts['amx'] else ''}){dropped}, and no other half dtype",
        )
    return Capability(
        torch.device("cpu"),
        name,
        None,
        halves,
        f"oneDNN has {have} kernels for this CPU ({cap}{', AMX' if facts['amx'] else ''}){dropped}: to be measured",
    )
