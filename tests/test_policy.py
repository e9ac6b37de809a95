"""Policies: parsing (against jmp 0.0.4 golden data), casting invariants, round trips."""

import copy
import io
import itertools
import json
import pickle
from pathlib import Path

import pytest
import torch

import funcamp as fa
from funcamp import _tree
from funcamp.policy import Policy

GOLDEN = json.loads((Path(__file__).parent / "golden" / "jmp_policy.json").read_text())
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _names(policy):
    return tuple(str(d).removeprefix("torch.") for d in (policy.param_dtype, policy.compute_dtype, policy.output_dtype))


def _has_duplicate_key(text):
    aliases = {"p": "p", "params": "p", "c": "c", "compute": "c", "o": "o", "output": "o"}
    keys = [aliases.get(part.split("=")[0].strip().lower()) for part in text.split(",")]
    return len(keys) != len(set(keys))


JMP_ACCEPTED = [c for c in GOLDEN["cases"] if "error" not in c]
JMP_REJECTED = [c for c in GOLDEN["cases"] if "error" in c]


@pytest.mark.parametrize("case", JMP_ACCEPTED, ids=lambda c: repr(c["input"]))
def test_every_string_jmp_accepts_gives_jmps_dtypes(case):
    # Golden data: tests/golden/jmp_policy.json, made by tools/make_jmp_golden.py with jmp 0.0.4 on CPU.
    if _has_duplicate_key(case["input"]):
        # Deliberate difference: jmp lets the last duplicate win; funcamp refuses the ambiguity.
        with pytest.raises(ValueError, match="given twice"):
            fa.get_policy(case["input"])
        return
    assert _names(fa.get_policy(case["input"])) == (case["param"], case["compute"], case["output"])


def test_golden_covers_every_key_and_dtype_name():
    inputs = " ".join(c["input"] for c in JMP_ACCEPTED)
    for name in ["p=", "params=", "c=", "compute=", "o=", "output=", "half", "full", "bf16", "bfloat16", "f64"]:
        assert name in inputs
    assert len(JMP_ACCEPTED) > 300


@pytest.mark.parametrize(
    "text, expected",
    [
        ("  params = float32 , compute = bfloat16 , output = float32 ", ("float32", "bfloat16", "float32")),
        ("C=F16", ("float32", "float16", "float16")),
        ("p=fp32,c=fp16", ("float32", "float16", "float16")),
        ("p=torch.float32,c=torch.bfloat16,o=torch.float32", ("float32", "bfloat16", "float32")),
        ("c=torch.half", ("float32", "float16", "float16")),
        ("double", ("float64", "float64", "float64")),
        ("mixed_float16", ("float32", "float16", "float32")),
        ("MIXED_BFLOAT16", ("float32", "bfloat16", "float32")),
        ("p=bf16", ("bfloat16", "bfloat16", "bfloat16")),
    ],
)
def test_extensions_beyond_jmp(text, expected):
    assert _names(fa.get_policy(text)) == expected


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("c=f16,", "empty part"),
        ("p=f32,x=f16", "unknown key 'x'"),
        ("c=float8", "unknown dtype 'float8'"),
        ("", "empty policy string"),
        ("   ", "empty policy string"),
        ("c=f16=f32", "part 'c=f16=f32'"),
        ("c=f16;o=f32", "part 'c=f16;o=f32'"),
        ("f", "unknown dtype 'f'"),
        ("c=int8", "unknown dtype 'int8'"),
        ("c=", "unknown dtype ''"),
    ],
)
def test_bad_strings_name_the_bad_part_and_the_choices(text, fragment):
    with pytest.raises(ValueError) as info:
        fa.get_policy(text)
    message = str(info.value)
    assert fragment in message
    # The message lists what is accepted (keys or dtype names or an example).
    assert any(word in message for word in ("accepted", "expected", "must be"))


def test_every_input_jmp_rejects_is_rejected_or_an_extension():
    extensions = {"fp16", "fp32", "float", "double"}
    for case in JMP_REJECTED:
        text = case["input"]
        normalised = text.strip().lower().replace(" ", "")
        try:
            policy = fa.get_policy(text)
        except ValueError:
            continue
        # Accepted only where funcamp's documented extensions apply: whitespace, case, torch names.
        base = fa.get_policy(normalised)
        assert policy == base, text
        assert normalised != text or normalised in extensions or normalised.split("=")[-1] in extensions, text


@pytest.mark.parametrize("bad", [None, 16, torch.float16, b"c=f16", ["c=f16"]])
def test_non_strings_raise_type_error(bad):
    with pytest.raises(TypeError, match="policy string or a Policy"):
        fa.get_policy(bad)


def test_get_policy_returns_a_policy_unchanged():
    policy = Policy(torch.float32, torch.float16, torch.float32)
    assert fa.get_policy(policy) is policy


@pytest.mark.parametrize("dtypes", list(itertools.product(DTYPES, repeat=4)))
def test_str_parses_back_to_an_equal_policy(dtypes):
    policy = Policy(*dtypes)
    assert fa.get_policy(str(policy)) == policy
    assert hash(fa.get_policy(str(policy))) == hash(policy)


def test_reduce_dtype_defaults_to_param_dtype_and_is_parsed():
    assert fa.get_policy("p=f32,c=bf16").reduce_dtype == torch.float32
    assert fa.get_policy("p=f32,c=bf16,r=bf16,o=f32").reduce_dtype == torch.bfloat16
    assert fa.get_policy("reduce=f16").reduce_dtype == torch.float16
    assert "reduce" not in str(fa.get_policy("c=bf16"))


@pytest.mark.parametrize("bad", ["float16", torch.int32, torch.complex64, None])
def test_policy_fields_are_checked(bad):
    with pytest.raises((TypeError, ValueError), match="compute_dtype"):
        Policy(torch.float32, bad, torch.float32)


def test_policy_is_frozen_and_hashable():
    policy = fa.get_policy("c=bf16")
    with pytest.raises(AttributeError):
        policy.compute_dtype = torch.float16
    assert len({policy, fa.get_policy("compute=bfloat16")}) == 1
    assert policy.with_output_dtype(torch.float32).output_dtype == torch.float32
    assert policy.with_compute_dtype(torch.float16).compute_dtype == torch.float16
    assert policy.output_dtype == torch.bfloat16


def test_casting_changes_only_floating_tensors():
    tree = {
        "ids": torch.tensor([[1, 2, 3]]),
        "mask": torch.tensor([True, False]),
        "x": torch.tensor([1.5]),
        "c": torch.tensor([1 + 2j]),
        "n": 3,
        "f": 2.5,
        "name": "a",
        "z": None,
    }
    out = fa.get_policy("c=f16").cast_to_compute(tree)
    assert out["x"].dtype == torch.float16 and out["x"].item() == 1.5
    for key in ("ids", "mask", "c", "n", "f", "name", "z"):
        assert out[key] is tree[key], key
    assert out.keys() == tree.keys()


def test_casting_positional_and_keyword_structures():
    args = (torch.ones(2), 3, torch.arange(2))
    kwargs = {"scale": torch.ones(()), "flag": True}
    policy = fa.get_policy("c=bf16")
    out_args, out_kwargs = policy.cast_to_compute((args, kwargs))
    assert out_args[0].dtype == torch.bfloat16 and out_args[1] == 3 and out_args[2] is args[2]
    assert out_kwargs["scale"].dtype == torch.bfloat16 and out_kwargs["flag"] is True


@pytest.mark.parametrize("dtype", DTYPES)
def test_noop_cast_returns_the_same_tensor(dtype):
    x = torch.ones(3, dtype=dtype)
    policy = Policy(dtype, dtype, dtype)
    assert policy.cast_to_param(x) is x
    assert policy.cast_to_compute({"x": x})["x"] is x
    assert policy.cast_to_output([x])[0] is x


def test_cast_helpers():
    tree = {"a": torch.ones(1, dtype=torch.float16), "b": torch.ones(1, dtype=torch.int64)}
    assert fa.cast_to_full(tree)["a"].dtype == torch.float32
    assert fa.cast_to_full(tree)["b"] is tree["b"]
    # cast_to_half follows the hardware probe (tests/test_hardware.py checks the probe itself).
    assert fa.cast_to_half({"a": torch.ones(1)}, "cpu")["a"].dtype == fa.half_dtype("cpu")
    assert fa.cast_to_half(tree, "cpu")["b"] is tree["b"]


def test_casting_is_differentiable():
    w = torch.ones(2, requires_grad=True)
    y = fa.get_policy("c=bf16").cast_to_compute(w).sum()
    y.backward()
    assert w.grad.dtype == torch.float32 and torch.equal(w.grad, torch.ones(2))


def test_policy_round_trips():
    policy = fa.get_policy("p=f32,c=bf16,o=f16,r=bf16")
    assert copy.deepcopy(policy) == policy
    assert pickle.loads(pickle.dumps(policy)) == policy
    leaves, spec = _tree.tree_flatten({"policy": policy})
    assert _tree.tree_unflatten(spec, leaves)["policy"] == policy
    buffer = io.BytesIO()
    torch.save(policy.state_dict(), buffer)
    buffer.seek(0)
    assert Policy.from_state_dict(torch.load(buffer, weights_only=True)) == policy
    with pytest.raises(ValueError, match="unknown dtype"):
        Policy.from_state_dict({**policy.state_dict(), "compute_dtype": "float8"})
