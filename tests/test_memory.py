"""funcamp.memory: footprints as Hugging Face counts them, and per-dtype reports under a policy.

GPT-2 (124M) figures are checked against ``transformers``' own ``get_memory_footprint`` (random
weights from ``GPT2Config()``, no download); those tests skip without transformers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from funcamp.memory import MemoryReport, memory_footprint, memory_report
from funcamp.nn import functionalize, param_policies

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
MIB = 2**20


def test_footprint_of_a_module_counts_params_once_and_buffers():
    model = nn.Sequential(nn.Embedding(10, 4), nn.BatchNorm1d(4), nn.Linear(4, 10, bias=False))
    model[2].weight = model[0].weight  # tied: counted once, as model.parameters() yields it once
    params = 10 * 4 + 4 + 4
    assert memory_footprint(model) == params * 4 + 8 * 4 + 8
    assert memory_footprint(model, buffers=False) == params * 4
    assert memory_footprint(model.to(BF16), buffers=False) == params * 2


def test_footprint_of_a_pytree():
    tree = {"a": torch.zeros(3, dtype=F16), "b": [torch.zeros(2, dtype=torch.int64), None, 1.5, "s"]}
    assert memory_footprint(tree) == 6 + 16
    assert memory_footprint({}) == 0 and memory_footprint(None) == 0


def test_report_without_policy_is_what_is_stored():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    report = memory_report(model)
    assert report.stored == {F32: (20 + 8 + 8) * 4, torch.int64: 8} and report.compute == {}
    assert report.stored_bytes == memory_footprint(model) and report.policy is None


def test_report_under_a_policy():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    report = memory_report(model, "params=float32,compute=bfloat16,output=float32")
    assert report.stored == {F32: (20 + 8 + 8) * 4, torch.int64: 8}
    assert report.compute == {BF16: (20 + 8 + 8) * 2}  # a plain policy knows nothing of norms
    assert report.total_bytes == report.stored_bytes + report.compute_bytes
    # Per-name policies from funcamp.nn know that BatchNorm stays in float32: no copies of it.
    report = memory_report(model, param_policies(model, "params=float32,compute=bfloat16,output=float32"))
    assert report.stored == {F32: (20 + 8 + 8) * 4, torch.int64: 8}
    assert report.compute == {BF16: 20 * 2}
    assert report.policy == "params=float32,compute=bfloat16,output=float32; 4 tensors under other policies"
    # Storing in half: the compute copy is not needed.
    report = memory_report(model.to(F32), "bf16")
    assert report.stored == {BF16: (20 + 8 + 8) * 2, torch.int64: 8} and report.compute == {}


def test_tied_parameters_are_stored_once_and_cast_per_use():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    report = memory_report(model, "params=float32,compute=bfloat16")
    assert report.stored == {F32: 40 * 4} and report.compute == {BF16: 2 * 40 * 2}
    # An LM head in float32 by name: its use of the tied weight is not copied.
    pols = param_policies(model, "params=float32,compute=bfloat16", module_policies={"1": "float32"})
    assert memory_report(model, pols).compute == {BF16: 40 * 2}


def test_report_of_params_from_functionalize():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    policy = "params=bfloat16,compute=bfloat16,output=bfloat16"
    _, params = functionalize(model, policy)
    report = memory_report(params, param_policies(model, policy))
    assert report.stored == {BF16: 20 * 2, F32: 8 * 4}  # the LayerNorm is kept in float32
    assert report.compute == {}
    assert report.stored_bytes == memory_footprint(params)


def test_non_persistent_buffers_are_counted_as_they_are():
    model = nn.Linear(2, 2)
    model.register_buffer("mask", torch.ones(8, dtype=F32), persistent=False)
    report = memory_report(model, "bf16")
    assert report.stored == {BF16: 6 * 2, F32: 8 * 4}


def test_report_errors():
    with pytest.raises(TypeError, match="flat dict"):
        memory_report([torch.ones(2)], {"w": "f32"})
    with pytest.raises(ValueError, match="no policy for 'b'"):
        memory_report({"w": torch.ones(2), "b": torch.ones(2)}, {"w": "f32"})
    with pytest.raises(ValueError, match="unknown dtype"):
        memory_report({"w": torch.ones(2)}, "f8")


def test_report_table():
    report = MemoryReport({F32: 3 * MIB, torch.int64: 8}, {BF16: 1536 * 1024}, "params=float32,compute=bfloat16")
    text = str(report)
    lines = text.splitlines()
    assert lines[0] == "memory (params=float32,compute=bfloat16)"
    assert lines[1].split() == ["dtype", "stored", "compute", "copies"]
    assert lines[2].split() == ["float32", "3.0", "MiB", "-"]
    assert lines[3].split() == ["bfloat16", "-", "1.5", "MiB"]
    assert lines[4].split() == ["int64", "8", "B", "-"]
    assert lines[5].split() == ["total", "3.0", "MiB", "1.5", "MiB"]


# --- GPT-2 (124M) against transformers ------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config())


def _buffer_bytes(model: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in model.buffers())


def test_gpt2_footprint_matches_transformers(gpt2):
    f32 = memory_footprint(gpt2)
    assert f32 == gpt2.get_memory_footprint()
    assert 470 * MIB < f32 < 480 * MIB  # 124,439,808 parameters (the LM head tied to the embedding)
    assert memory_footprint(gpt2, buffers=False) == gpt2.get_memory_footprint(return_buffers=False)
    half = copy.deepcopy(gpt2).to(F16)
    assert memory_footprint(half) == half.get_memory_footprint()
    assert abs(2 * memory_footprint(half) - f32) <= _buffer_bytes(gpt2)
    # What funcamp stores under a policy equals transformers' count of the model cast to it.
    _, params = functionalize(
        gpt2, "params=float16,compute=float16,output=float32", module_policies={nn.LayerNorm: None}
    )
    assert memory_footprint(params) == half.get_memory_footprint(return_buffers=False)
    assert memory_report(gpt2, "float16").stored_bytes == half.get_memory_footprint()


def test_gpt2_report_under_mixed_bfloat16(gpt2):
    policy = "params=float32,compute=bfloat16,output=float32"
    report = memory_report(gpt2, param_policies(gpt2, policy))
    assert report.stored_bytes == gpt2.get_memory_footprint()
    norm_params = sum(p.numel() for m in gpt2.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters())
    lm_head_use = gpt2.lm_head.weight.numel()  # tied to the token embedding: a second bf16 copy
    assert report.compute == {BF16: (gpt2.num_parameters() - norm_params + lm_head_use) * 2}
