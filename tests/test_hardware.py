"""The hardware probe behind ``half_dtype``, and ``capability``, the facts ``--policy auto`` starts from.

The CPU facts (capability, oneDNN support, AMX) and the matmul timer are replaced by fakes, so each case
runs the same on every machine; one test also runs the real probe on this machine and checks it agrees
with what torch reports.
"""

from __future__ import annotations

import pytest
import torch

import funcamp as fa
from funcamp import hardware

AVX2 = {"capability": "AVX2", "mkldnn_bf16": False, "mkldnn_fp16": False, "amx": False}
AMX = {"capability": "AVX512", "mkldnn_bf16": True, "mkldnn_fp16": False, "amx": True}
AVX512 = {"capability": "AVX512", "mkldnn_bf16": True, "mkldnn_fp16": True, "amx": False}


@pytest.fixture
def fake_cpu(monkeypatch):
    """Set the CPU facts and the measured matmul seconds per dtype; the probe's cache is cleared around it."""
    timed: list[torch.dtype] = []

    def install(facts, seconds=None):
        monkeypatch.setattr(hardware, "_cpu_facts", lambda: dict(facts))

        def fake_seconds(dtype, device):
            timed.append(dtype)
            if seconds is None:
                raise AssertionError(f"the probe measured {dtype} although torch's report was conclusive")
            return seconds[dtype]

        monkeypatch.setattr(hardware, "_matmul_seconds", fake_seconds)
        hardware._probe.cache_clear()
        return timed

    yield install
    hardware._probe.cache_clear()


def test_avx2_cpu_computes_in_float32_without_measuring(fake_cpu):
    timed = fake_cpu(AVX2)
    report = hardware.probe("cpu")
    assert fa.half_dtype("cpu") == torch.float32
    assert fa.cast_to_half({"x": torch.ones(2)}, "cpu")["x"].dtype == torch.float32
    assert not report.bfloat16.fast and not report.float16.fast
    assert "oneDNN has no bfloat16 kernels" in report.bfloat16.reason and "AVX2" in report.explain()
    assert report.explain().startswith("float32 compute")
    assert not report.bfloat16.kernels and not report.float16.kernels
    assert timed == []


def test_amx_cpu_computes_in_bfloat16_without_measuring(fake_cpu):
    timed = fake_cpu(AMX)
    assert fa.half_dtype("cpu") == torch.bfloat16
    assert "AMX" in hardware.probe("cpu").explain()
    assert timed == []  # float16: oneDNN reports no kernels, so nothing to measure either


@pytest.mark.parametrize(
    "seconds, expected",
    [
        ({torch.float32: 1.0, torch.bfloat16: 0.5, torch.float16: 0.6}, torch.bfloat16),
        ({torch.float32: 1.0, torch.bfloat16: 1.6, torch.float16: 0.9}, torch.float16),
        ({torch.float32: 1.0, torch.bfloat16: 1.6, torch.float16: 40.0}, torch.float32),
        ({torch.float32: 1.0, torch.bfloat16: hardware.FAST_RATIO, torch.float16: 2.0}, torch.bfloat16),
    ],
)
def test_inconclusive_cpu_is_measured(fake_cpu, seconds, expected):
    timed = fake_cpu(AVX512, seconds)
    report = hardware.probe("cpu")
    assert report.half_dtype == expected == fa.half_dtype("cpu")
    assert set(timed) == {torch.float32, torch.bfloat16, torch.float16}
    assert report.bfloat16.ratio == pytest.approx(seconds[torch.bfloat16] / seconds[torch.float32])
    assert "measured" in report.bfloat16.reason


def test_probe_is_cached_per_device(fake_cpu):
    timed = fake_cpu(AVX512, {torch.float32: 1.0, torch.bfloat16: 0.5, torch.float16: 0.5})
    hardware.probe("cpu")
    n = len(timed)
    assert hardware.probe(torch.device("cpu")) is hardware.probe(None if not torch.cuda.is_available() else "cpu")
    assert len(timed) == n


def test_a_dtype_without_kernels_is_slow(fake_cpu, monkeypatch):
    fake_cpu(AVX512, {torch.float32: 1.0})

    def no_kernel(dtype, device):
        if dtype != torch.float32:
            raise RuntimeError('"addmm_impl_cpu_" not implemented for ' + str(dtype))
        return 1.0

    monkeypatch.setattr(hardware, "_matmul_seconds", no_kernel)
    report = hardware.probe("cpu")
    assert report.half_dtype == torch.float32
    assert "not implemented" in report.float16.reason and not report.float16.kernels


@pytest.mark.parametrize(
    "cc, expected",
    [
        ((9, 0), torch.bfloat16),
        ((8, 0), torch.bfloat16),
        ((7, 5), torch.float16),
        ((7, 0), torch.float16),
        ((6, 0), torch.float16),
        ((6, 1), torch.float32),
        ((5, 2), torch.float32),
    ],
)
def test_cuda_by_compute_capability(cc, expected):
    report = hardware._probe_cuda(torch.device("cuda", 0), "GPU", cc)
    assert report.half_dtype == expected
    assert f"{cc[0]}.{cc[1]}" in report.name


def test_capability_decides_only_from_facts(fake_cpu):
    timed = fake_cpu(AVX2)
    cap = hardware.capability("cpu")
    assert (cap.decided, cap.candidates) == (torch.float32, ())
    assert cap.reason == "oneDNN has no bfloat16 or float16 kernels for this CPU (AVX2)"
    fake_cpu(AMX)  # AMX: fast matmuls, but the step decides (CPU attention can be slower in bfloat16)
    cap = hardware.capability("cpu")
    assert (cap.decided, cap.candidates, cap.name) == (None, (torch.bfloat16,), "CPU (AVX512, AMX)")
    fake_cpu(AVX512)  # float16 kernels without AMX-FP16 tiles: about float32's speed, not measured
    cap = hardware.capability(torch.device("cpu"))
    assert (cap.decided, cap.candidates) == (None, (torch.bfloat16,))
    assert cap.reason == (
        "oneDNN has bfloat16 and float16 kernels for this CPU (AVX512); float16 not measured: no AMX-FP16 tiles: "
        "to be measured"
    )
    fake_cpu({**AVX512, "amx": True, "amx_fp16": True})  # Granite Rapids: both are worth measuring
    cap = hardware.capability(torch.device("cpu"))
    assert (cap.decided, cap.candidates) == (None, (torch.bfloat16, torch.float16))
    assert "oneDNN has bfloat16 and float16 kernels for this CPU (AVX512, AMX): to be measured" == cap.reason
    fake_cpu({**AVX512, "mkldnn_bf16": False})  # float16 kernels alone, no AMX-FP16: nothing left to measure
    cap = hardware.capability("cpu")
    assert (cap.decided, cap.candidates) == (torch.float32, ())
    assert cap.reason.endswith("float16 not measured: no AMX-FP16 tiles, and no other half dtype")
    assert hardware.capability("meta").device == torch.device("meta") and timed == []


@pytest.mark.parametrize("cc, expected", [((9, 0), torch.bfloat16), ((7, 0), torch.float16), ((6, 1), torch.float32)])
def test_capability_on_cuda_is_the_compute_capability(monkeypatch, cc, expected):
    monkeypatch.setattr(hardware, "_probe", lambda device: hardware._probe_cuda(device, "GPU", cc))
    cap = hardware.capability("cuda:0")
    assert (cap.decided, cap.candidates) == (expected, ()) and f"{cc[0]}.{cc[1]}" in cap.name


def test_real_capability_agrees_with_torch():
    cap = hardware.capability("cpu")
    kernels = [torch.ops.mkldnn._is_mkldnn_bf16_supported(), torch.ops.mkldnn._is_mkldnn_fp16_supported()]
    kernels[1] = kernels[1] and "amx_fp16" in hardware._cpu_flags()  # float16 is measured with AMX-FP16 only
    assert (cap.decided == torch.float32) == (not any(kernels))
    assert cap.candidates == tuple(d for d, k in zip((torch.bfloat16, torch.float16), kernels) if k)


def test_real_probe_agrees_with_torch():
    report = hardware.probe("cpu")
    assert report.half_dtype in (torch.float32, torch.bfloat16, torch.float16)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert not report.bfloat16.fast
    if not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        assert not report.float16.fast
    assert torch.backends.cpu.get_cpu_capability() in report.name


def test_bad_device():
    with pytest.raises(TypeError, match="device must be"):
        hardware.probe(3)
    with pytest.raises(TypeError, match="capability: device must be a str, a torch.device or None, got int"):
        hardware.capability(3)
