"""funcamp.memory: footprints as Hugging Face counts them, and per-dtype reports under a policy.

GPT-2 (124M) figures are checked against ``transformers``' own ``get_memory_footprint`` (random
weights from ``GPT2Config()``, no download); those tests skip without transformers.
"""

from __future__ import annotations

import copy
import dataclasses

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
    # functionalize's per-module policies: the embedding looks up in float32 (funcamp.nn.float32_lookup),
    # so only the head's use is copied to bf16.
    pols = param_policies(model, "params=float32,compute=bfloat16")
    assert memory_report(model, pols).compute == {BF16: 40 * 2}
    # An LM head in float32 by name too: neither use of the tied weight is copied.
    pols = param_policies(model, "params=float32,compute=bfloat16", module_policies={"1": "float32"})
    assert memory_report(model, pols).compute == {}
    # With the embedding default off, the embedding's use is the bf16 copy.
    pols = param_policies(
        model, "params=float32,compute=bfloat16", module_policies={"1": "float32", nn.Embedding: None}
    )
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
    # The embeddings (wte, wpe) look up in float32 from their float32 masters (funcamp.nn.float32_lookup):
    # not copied. The LM head, tied to wte, uses it in bf16: one copy.
    embeddings = gpt2.transformer.wte.weight.numel() + gpt2.transformer.wpe.weight.numel()
    lm_head_use = gpt2.lm_head.weight.numel()
    assert (norm_params, embeddings, lm_head_use) == (38_400, 39_383_808, 38_597_376)
    assert report.compute == {BF16: (gpt2.num_parameters() - norm_params - embeddings + lm_head_use) * 2}
    assert report.compute[BF16] == 247_229_952  # 235.8 MiB (325,997,568 = 310.9 MiB with bf16 embedding copies)


# --- what functionalize's apply_fn holds and casts (frozen tensors, int8 weights) -----------------------------


def _tied_lm() -> nn.Module:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 10, bias=False))
    model[3].weight = model[0].weight  # tied head
    return model


def test_report_with_apply_fn_counts_frozen_tensors_and_real_copies():
    model = _tied_lm()
    policy = "params=float32,compute=bfloat16,output=float32"
    apply_fn, params = functionalize(model, policy, trainable=["0", "2"])  # embedding (and head), LayerNorm
    assert sorted(params) == ["0.weight", "2.bias", "2.weight"] and sorted(apply_fn.frozen) == ["1.bias", "1.weight"]
    report = memory_report(params, apply_fn=apply_fn)
    # stored: float32 masters (embedding 40, LayerNorm 8), the frozen Linear in bf16 (20)
    assert report.stored == {F32: (40 + 8) * 4, BF16: 20 * 2}
    # copies a call makes: the tied weight in bf16 for the head's use only (the embedding looks up in
    # float32 from its float32 master); LayerNorm computes in float32
    assert report.compute == {BF16: 40 * 2}
    assert report.stored_bytes == memory_footprint(params, apply_fn=apply_fn) == memory_footprint(params) + 40
    assert apply_fn.aliases == {"3.weight": "0.weight"}


def test_report_with_apply_fn_under_half_params_counts_the_float32_lookup_copy():
    # params=float16 (model.half()'s footprint): the table stays float16, cast to float32 for its lookup
    # at each call (the cast the "embedding" op rule made before); the tied head uses it as stored.
    model = _tied_lm()
    apply_fn, params = functionalize(model, "params=float16,compute=float16,output=float32")
    assert params["0.weight"].dtype == F16 and params["2.weight"].dtype == F32
    report = memory_report(params, apply_fn=apply_fn)
    assert report.stored == {F16: (40 + 20) * 2, F32: 8 * 4}  # table, Linear; LayerNorm in float32
    assert report.compute == {F32: 40 * 4}  # the table's float32 copy; nothing else is cast
    model[1].requires_grad_(False)
    model[0].requires_grad_(False)  # frozen: stored in float16 all the same, the same copy per call
    apply_fn, params = functionalize(model, "params=float16,compute=float16,output=float32")
    assert apply_fn.frozen["0.weight"].dtype == F16
    assert memory_report(params, apply_fn=apply_fn).compute == {F32: 40 * 4}


def test_report_counts_int8_weights_and_their_scales():
    from funcamp.quant import Int8WeightOnlyConfig, quantize_int8

    model = _tied_lm().requires_grad_(False)
    apply_fn, params = functionalize(
        model, "params=float32,compute=bfloat16,output=float32", quantize=Int8WeightOnlyConfig()
    )
    assert params == {} and list(apply_fn.frozen) == ["0.weight", "1.weight", "1.bias", "2.weight", "2.bias"]
    report = memory_report(params, apply_fn=apply_fn)
    # int8: the Linear's 16 values and 4 float32 scales; float32: the scales, the LayerNorm and the
    # embedding (tied head left alone: frozen, stored in float32, the dtype of its lookup); bf16: the bias
    assert report.stored == {torch.int8: 16, F32: 4 * 4 + 8 * 4 + 40 * 4, BF16: 4 * 2}
    assert report.compute == {BF16: 16 * 2 + 40 * 2}  # the dequantized Linear weight; the head's use of wte
    assert memory_footprint(params, apply_fn=apply_fn) == report.stored_bytes
    # A flat dict holding an Int8Weight, under a policy: stored as it is, dequantized into compute.
    tree = {"w": quantize_int8(torch.randn(8, 3)), "b": torch.zeros(8)}
    report = memory_report(tree, "params=float32,compute=bfloat16")
    assert report.stored == {torch.int8: 24, F32: 8 * 4 + 8 * 4} and report.compute == {BF16: (24 + 8) * 2}


def test_report_with_apply_fn_errors():
    apply_fn, params = functionalize(nn.Linear(2, 2), "float32")
    with pytest.raises(TypeError, match="either a policy or apply_fn"):
        memory_report(params, "float32", apply_fn=apply_fn)
    with pytest.raises(TypeError, match="apply_fn must be the function funcamp.nn.functionalize returned"):
        memory_report(params, apply_fn=lambda p: p)
    with pytest.raises(TypeError, match="apply_fn must be"):
        memory_footprint(params, apply_fn=params)
    with pytest.raises(ValueError, match=r"\['x'\] are not parameters or buffers"):
        memory_report({**params, "x": torch.ones(1)}, apply_fn=apply_fn)
    with pytest.raises(TypeError, match="flat dict of params"):
        memory_report([params], apply_fn=apply_fn)


def test_report_with_apply_fn_takes_buffers_too():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    apply_fn, params, buffers = functionalize(
        model, "params=float32,compute=bfloat16,output=float32", with_buffers=True
    )
    report = memory_report({**params, **buffers}, apply_fn=apply_fn)
    assert report.stored == {F32: (20 + 8 + 8) * 4, torch.int64: 8}  # masters, running stats, counter
    assert report.compute == {BF16: 20 * 2}  # the Linear in bf16; BatchNorm keeps float32


# --- fp8 layers: their fp8 copies, from the shapes, and what the forward really keeps -----------------------

FP8_SIZES = [(64, 64), (64, 128), (128, 32), (32, 48)]  # (in, out) = (K, N) of four fp8 layers
B, T = 2, 20  # tokens M = 40


def _fp8_model(recipe: str) -> nn.Module:
    from funcamp import fp8

    torch.manual_seed(0)
    layers = [nn.Linear(k, n) for k, n in FP8_SIZES]
    return fp8.convert(nn.Sequential(*layers), recipe, filter="*")


def _saved_fp8_bytes(apply_fn, params, buffers, x) -> tuple[int, int]:
    """(bytes of fp8 tensors the forward saves for the backward, bytes of every fp8 tensor it makes)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    fp8_dtypes = (torch.float8_e4m3fn, torch.float8_e5m2)
    saved, made = {}, []

    class Made(TorchDispatchMode):  # an fp8 output whose storage is none of the inputs' (not a view)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {
                t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
            }
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dtype in fp8_dtypes:
                    if t.untyped_storage().data_ptr() not in inputs:
                        made.append(t.untyped_storage().nbytes())
            return out

    def pack(t):
        if t.dtype in fp8_dtypes:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {k: v.requires_grad_() for k, v in params.items()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Made():
        apply_fn(params, *([buffers] if buffers else []), x)
    return sum(saved.values()), sum(made)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_report_counts_fp8_copies_from_the_shapes(recipe):
    """Per fp8 layer: the e4m3 weight (N*K bytes) and, with tokens=M, the e4m3 input (M*K), with float32
    inverse scales (1 each per tensor; N and M rowwise). tensorwise and delayed keep them until the
    backward (every layer counts, and the forward saves exactly those bytes); rowwise frees them when
    the layer returns (the largest layer counts, and nothing fp8 is saved)."""
    from funcamp import fp8

    model = _fp8_model(recipe)
    policy = "params=float32,compute=bfloat16,output=float32"
    m = B * T
    per_layer = [(n * k + m * k, 4 * ((n + m) if recipe == "rowwise" else 2)) for k, n in FP8_SIZES]
    if recipe == "rowwise":
        e4m3, f32 = max(per_layer)
    else:
        e4m3, f32 = sum(p[0] for p in per_layer), sum(p[1] for p in per_layer)
    params_bytes = sum((n * k + n) * 4 for k, n in FP8_SIZES)
    state = 4 * 2 * (16 + 1) * 4 if recipe == "delayed" else 0  # 4 layers, input and weight: history 16, scale

    pols = param_policies(model, policy, module_policies=fp8.MODULE_POLICIES)
    report = memory_report(model, pols, tokens=m)
    # fp8 layers enter in float32 under MODULE_POLICIES: no bfloat16 copies, only the fp8 ones
    assert report.compute == {torch.float8_e4m3fn: e4m3, F32: f32}
    assert report.stored == {F32: params_bytes + state}
    weights_only = memory_report(model, pols).compute
    assert weights_only[torch.float8_e4m3fn] == (
        max(n * k for k, n in FP8_SIZES) if recipe == "rowwise" else sum(n * k for k, n in FP8_SIZES)
    )

    out = functionalize(model, policy, module_policies=fp8.MODULE_POLICIES, with_buffers=recipe == "delayed")
    apply_fn, params, buffers = out if recipe == "delayed" else (*out, {})
    assert memory_report({**params, **buffers}, apply_fn=apply_fn, model=model, tokens=m) == dataclasses.replace(
        report, policy="as functionalize's apply_fn holds and casts them"
    )
    saved, made = _saved_fp8_bytes(apply_fn, params, buffers, torch.randn(B, T, 64))
    assert made == sum(p[0] for p in per_layer)  # every fp8 tensor the forward makes, one cast each
    assert saved == (0 if recipe == "rowwise" else e4m3)


def test_report_fp8_errors():
    from funcamp import fp8

    model = _fp8_model("delayed")
    apply_fn, params, buffers = functionalize(model, "f32", module_policies=fp8.MODULE_POLICIES, with_buffers=True)
    with pytest.raises(TypeError, match=r"fp8 recipe state \(fp8_amax_history_input, .*pass model="):
        memory_report({**params, **buffers}, apply_fn=apply_fn)
    with pytest.raises(ValueError, match="tokens must be None or an int >= 1"):
        memory_report(model, "f32", tokens=0)
    with pytest.raises(TypeError, match="model= is for a pytree"):
        memory_report(model, "f32", model=nn.Linear(2, 2))
    with pytest.raises(ValueError, match="tokens must be None or an int >= 1"):
        model[0].fp8_copy_bytes(tokens=2.5)
