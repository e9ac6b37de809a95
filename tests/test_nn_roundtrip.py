"""The way back into the module: ``funcamp.nn.state_dict`` and ``funcamp.nn.load_into``.

Each round trip functionalizes a module, changes the parameters (a train step or a stand-in for one),
loads them into a module of the same architecture with other weights, and checks that
``load_state_dict(strict=True)`` accepted them, that every module tensor is the trained value cast to its
dtype, and (float32 policy) that the module's outputs equal ``apply_fn(params)`` bitwise.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

import funcamp as fa
from funcamp import fp8, optim, quant
from funcamp.nn import _load, functionalize, load_into, state_dict

F32, BF16 = torch.float32, torch.bfloat16
MIXED = "params=float32,compute=bfloat16,output=float32"


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))


def bumped(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stands for training: every value changes (0.25 is exact in float32 and bfloat16 steps here)."""
    return {k: v + 0.25 for k, v in params.items()}


def assert_module_holds(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    sd = model.state_dict()
    assert sd.keys() == expected.keys()
    for k, v in expected.items():
        assert sd[k].dtype == v.dtype, k
        torch.testing.assert_close(sd[k], v, rtol=0, atol=0, msg=k)


# --- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["float32", MIXED])
def test_sequential_round_trip(policy):
    apply_fn, params = functionalize(mlp(0), policy)
    trained = bumped(params)
    target = mlp(1)
    assert load_into(target, trained) is target
    assert_module_holds(target, trained)  # float32 module, float32 masters: the values themselves
    _, again = functionalize(target, policy)
    torch.testing.assert_close(again, trained, rtol=0, atol=0)  # functionalize(load_into(...)) round trips
    x = torch.randn(5, 4)
    with torch.no_grad():
        out = target(x)
    if policy == "float32":
        torch.testing.assert_close(out, apply_fn(trained, x), rtol=0, atol=0)


def test_values_take_the_module_dtype_and_share_memory_when_they_can():
    model = mlp(0).to(BF16)
    _, params = functionalize(model, MIXED)  # float32 masters of a bfloat16 module
    assert all(p.dtype == F32 for p in params.values())
    trained = {k: v + 1e-3 for k, v in params.items()}  # not representable in bfloat16
    sd = state_dict(model, trained)
    assert all(v.dtype == BF16 for v in sd.values())
    for k, v in sd.items():
        torch.testing.assert_close(v, trained[k].to(BF16), rtol=0, atol=0)  # rounded to nearest even, once
    sd32 = state_dict(mlp(0), trained)
    assert all(sd32[k].data_ptr() == trained[k].data_ptr() for k in trained)  # no copy where dtype, device match
    grad_tracking = {k: v.requires_grad_() for k, v in trained.items()}
    assert not any(v.requires_grad for v in state_dict(mlp(0), grad_tracking).values())  # detached


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_values_go_to_the_module_device():
    _, params = functionalize(mlp(0), "float32")
    on_gpu = load_into(mlp(1).cuda(), bumped(params))  # CPU params into a CUDA module
    assert all(t.is_cuda for t in on_gpu.state_dict().values())
    assert_module_holds(on_gpu.cpu(), bumped(params))
    sd = state_dict(mlp(1), {k: v.cuda() for k, v in params.items()})  # CUDA params for a CPU module
    assert all(t.device.type == "cpu" for t in sd.values())


def test_batchnorm_buffers_round_trip_through_a_train_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    apply_fn, params, buffers = functionalize(model, "float32", with_buffers=True)

    def loss_fn(p, b, x):
        out, new_b = apply_fn(p, b, x)
        return out.square().mean(), new_b

    opt = optim.sgd(0.1)
    step = fa.make_train_step(loss_fn, opt, compile=False)
    state = fa.TrainState.create(params, opt, buffers=buffers)
    for _ in range(2):
        state, _ = step(state, torch.randn(16, 4))
    assert int(state.buffers["1.num_batches_tracked"]) == 2
    target = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    load_into(target, state.params, state.buffers)
    assert_module_holds(target, {**state.params, **state.buffers})
    eval_fn, p2, b2 = functionalize(target, "float32", training=False, with_buffers=True)
    x = torch.randn(6, 4)
    with torch.no_grad():
        out = target.eval()(x)
    torch.testing.assert_close(out, eval_fn(state.params, state.buffers, x)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"missing \['1.running_mean', .*pass buffers \(state.buffers"):
        state_dict(target, state.params)


def test_frozen_split_round_trip():
    model = mlp(0)
    apply_fn, params = functionalize(model, MIXED, trainable="3")
    assert sorted(params) == ["3.bias", "3.weight"]
    assert apply_fn.frozen["0.weight"].dtype == BF16  # stored in the compute dtype
    trained = bumped(params)
    with pytest.raises(ValueError, match=r"missing \['0.weight', '0.bias', '1.weight'.*frozen=apply_fn.frozen"):
        state_dict(mlp(1), trained)
    own = {k: v.clone() for k, v in model.state_dict().items() if k in apply_fn.frozen}
    # Into the module apply_fn was made from, and into another instance holding the same weights: the
    # frozen weights stay bitwise as the module holds them (float32), not the bf16 copies widened.
    for target in (model, mlp(0)):
        load_into(target, trained, frozen=apply_fn.frozen)
        assert_module_holds(target, {**trained, **own})
    # Into a module with other weights the bf16 copies cannot be made the float32 weights: refused, saying what
    # to pass; either given explicitly is written.
    with pytest.raises(
        ValueError,
        match=r"frozen \['0.weight', '0.bias'\] hold bfloat16 .*"
        r"not made from the weights this module holds.*base.state_dict\(\)",
    ):
        load_into(mlp(1), trained, frozen=apply_fn.frozen)
    assert_module_holds(load_into(mlp(1), trained, frozen=own), {**trained, **own})
    used = {k: v.float() for k, v in apply_fn.frozen.items()}
    assert_module_holds(load_into(mlp(1), trained, frozen=used), {**trained, **used})


@pytest.mark.parametrize(
    ("policy", "frozen_dtype"),
    [(MIXED, BF16), ("params=float16,compute=float16,output=float32", torch.float16), ("bfloat16", BF16)],
)
def test_frozen_weights_come_back_bitwise(policy, frozen_dtype, tmp_path):
    """The sweep of the way back for frozen weights stored narrower than the module holds them: a compute
    dtype copy (bf16, float16; bf16 masters), int8 (below), after a checkpoint round trip of the state. Each
    frozen weight is checked bitwise against the module's own value before the call. Planted: the old
    ``_value`` (write the copy, cast) fails every case here, 0.weight off by up to 2e-3 relative."""
    model = mlp(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_fn, params = functionalize(model, policy, trainable="3")
    assert apply_fn.frozen["0.weight"].dtype == frozen_dtype  # the LayerNorm's stay float32
    assert any(not torch.equal(v.to(F32), before[k]) for k, v in apply_fn.frozen.items())  # the copies round
    state = fa.TrainState.create(bumped(params), optim.sgd(0.1))
    path = tmp_path / "state.pt"
    fa.checkpoint.save(path, state)
    state = fa.checkpoint.load(path)
    load_into(model, state.params, frozen=apply_fn.frozen)
    sd = model.state_dict()
    for k in apply_fn.frozen:
        assert sd[k].dtype == F32 and torch.equal(sd[k], before[k]), k
    for k, v in state.params.items():
        assert torch.equal(sd[k], v.to(F32)), k
    with pytest.raises(ValueError, match="not made from the weights this module holds"):
        state_dict(mlp(1), state.params, frozen=apply_fn.frozen)


def test_frozen_as_wide_as_the_module_is_written():
    """A float32 frozen copy of a float32 module holds the weight exactly: written into any module."""
    apply_fn, params = functionalize(mlp(0), "float32", trainable="3")
    target = load_into(mlp(1), params, frozen=apply_fn.frozen)
    assert_module_holds(target, {**params, **dict(apply_fn.frozen)})


def test_frozen_split_float32_outputs_equal_apply_fn():
    apply_fn, params = functionalize(mlp(0), "float32", trainable=["0", "3.bias"])
    trained = bumped(params)
    target = load_into(mlp(1), trained, frozen=apply_fn.frozen)
    x = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(target(x), apply_fn(trained, x), rtol=0, atol=0)


@pytest.mark.parametrize("module_dtype", [F32, BF16])
def test_int8_weights_come_back_bitwise_or_dequantized_when_asked(module_dtype):
    model = mlp(0).to(module_dtype)
    model.requires_grad_(False)
    model[1].requires_grad_(True)  # train the LayerNorm only
    before = {k: v.clone() for k, v in model.state_dict().items()}
    policy = "float32" if module_dtype == F32 else MIXED
    apply_fn, params = functionalize(model, policy, quantize=quant.Int8WeightOnlyConfig())
    assert isinstance(apply_fn.frozen["0.weight"], quant.Int8Weight)
    trained = bumped(params)
    # The module the int8 weights were made from keeps its own weights, bitwise (planted: the old code wrote
    # the dequantized ones, up to half a step off).
    load_into(model, trained, frozen=apply_fn.frozen)
    for name in ("0.weight", "3.weight"):
        assert torch.equal(model.state_dict()[name], before[name]), name
    # Another module: refused; the dequantized weights, given in the module's dtype, are written.
    with pytest.raises(ValueError, match=r"frozen \['0.weight', '3.weight'\] hold int8 copies.*dequantize_int8"):
        load_into(mlp(1).to(module_dtype), trained, frozen=apply_fn.frozen)
    used = {
        k: quant.dequantize_int8(v, module_dtype) if isinstance(v, quant.Int8Weight) else v
        for k, v in apply_fn.frozen.items()
    }
    target = load_into(mlp(1).to(module_dtype), trained, frozen=used)
    sd = target.state_dict()
    for name in ("0.weight", "3.weight"):
        w = apply_fn.frozen[name]
        assert sd[name].dtype == module_dtype
        torch.testing.assert_close(sd[name], quant.dequantize_int8(w, module_dtype), rtol=0, atol=0)
        err = (sd[name].float() - before[name].float()).abs()
        rounding = 0 if module_dtype == F32 else before[name].float().abs() * 2**-8
        assert (err <= w.absmax / 254 * (1 + 1e-6) + rounding).all()  # quantize_int8: half a step (+ bf16 rounding)
    if module_dtype == F32:
        x = torch.randn(5, 4)
        with torch.no_grad():
            torch.testing.assert_close(target(x), apply_fn(trained, x), rtol=0, atol=0)


# --- fp8-converted layers -----------------------------------------------------------------------------


def fp8_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))


def test_fp8_state_names_match_the_fp8_layer():
    layer = fp8.Float8Linear(16, 16, recipe="delayed")
    assert {n for n, _ in layer.named_buffers()} == set(_load._FP8_STATE)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_trained_params_load_into_the_plain_and_the_converted_model(recipe):
    policy = f"params=float32,compute=float32,output=float32,fp8={recipe}"
    apply_fn, params, buffers = functionalize(fp8_mlp(0), policy, with_buffers=True)
    _, buffers = apply_fn(params, buffers, torch.randn(4, 16))  # the delayed state advances
    assert sorted(buffers) == ([f"2.{n}" for n in sorted(_load._FP8_STATE)] if recipe == "delayed" else [])
    trained = bumped(params)
    plain = load_into(fp8_mlp(1), trained, buffers)  # the fp8 state has no place in a plain Linear: left out
    assert_module_holds(plain, trained)
    converted = fp8.convert(fp8_mlp(1), recipe)
    assert isinstance(converted[2], fp8.Float8Linear)
    load_into(converted, trained, buffers)
    assert_module_holds(converted, {**trained, **buffers})


def test_fp8_state_of_a_layer_that_is_not_a_linear_is_refused():
    converted = fp8.convert(fp8_mlp(0), "delayed")
    _, params, buffers = functionalize(converted, "float32", module_policies=fp8.MODULE_POLICIES, with_buffers=True)
    bad = {k.replace("2.", "1.", 1): v for k, v in buffers.items()}  # "1" is a ReLU
    with pytest.raises(ValueError, match=r"unexpected \['1.fp8_amax_history_input'"):
        state_dict(fp8_mlp(0), params, bad)


# --- Hugging Face GPT-2 ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_config():
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=96, n_positions=16, bos_token_id=0, eos_token_id=0
    )


def gpt2(config, seed: int) -> nn.Module:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


def test_gpt2_tied_head_round_trip(gpt2_config):
    apply_fn, params = functionalize(gpt2(gpt2_config, 0), "float32")
    assert "lm_head.weight" not in params
    trained = bumped(params)
    target = gpt2(gpt2_config, 1)
    load_into(target, trained)  # strict=True: lm_head.weight comes under its own name too
    assert target.lm_head.weight is target.transformer.wte.weight  # still tied
    torch.testing.assert_close(target.lm_head.weight, trained["transformer.wte.weight"], rtol=0, atol=0)
    ids = torch.randint(0, 96, (2, 8))
    with torch.no_grad():
        out = target(input_ids=ids).logits
    torch.testing.assert_close(out, apply_fn(trained, input_ids=ids).logits, rtol=0, atol=0)
    sd = state_dict(target, trained)
    assert sd.keys() == target.state_dict().keys() and sd["lm_head.weight"] is sd["transformer.wte.weight"]
    with pytest.raises(ValueError, match=r"'lm_head.weight' \(tied to 'transformer.wte.weight'\)"):
        state_dict(target, {**trained, "lm_head.weight": trained["transformer.wte.weight"]})


def test_gpt2_bfloat16_module_gets_rounded_masters(gpt2_config):
    model = gpt2(gpt2_config, 0).to(BF16)
    _, params = functionalize(model, MIXED)
    trained = {k: v + 1e-3 for k, v in params.items()}
    load_into(model, trained)
    for k, v in trained.items():
        torch.testing.assert_close(model.get_parameter(k), v.to(BF16), rtol=0, atol=0, msg=k)


def test_gpt2_save_pretrained_round_trip(gpt2_config, tmp_path):
    from transformers import GPT2LMHeadModel

    apply_fn, params = functionalize(gpt2(gpt2_config, 0), MIXED)
    trained = bumped(params)
    model = load_into(gpt2(gpt2_config, 1), trained)
    model.save_pretrained(tmp_path / "loaded")
    # Or straight from the state dict, the module untouched:
    untouched = gpt2(gpt2_config, 2)
    untouched.save_pretrained(tmp_path / "direct", state_dict=state_dict(untouched, trained))
    ids = torch.randint(0, 96, (2, 8))
    for folder in ("loaded", "direct"):
        back = GPT2LMHeadModel.from_pretrained(tmp_path / folder).eval()
        assert back.lm_head.weight is back.transformer.wte.weight
        assert_module_holds(back, model.state_dict())
        _, again = functionalize(back, MIXED)
        torch.testing.assert_close(again, trained, rtol=0, atol=0)
        with torch.no_grad():
            torch.testing.assert_close(back(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


# --- bad input -----------------------------------------------------------------------------------


def other_model() -> nn.Module:
    return nn.Sequential(OrderedDict(conv=nn.Conv1d(2, 2, 3)))


BN = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
_, BN_PARAMS, BN_BUFFERS = functionalize(BN, "float32", with_buffers=True)
_, MLP_PARAMS = functionalize(mlp(0), "float32")


@pytest.mark.parametrize(
    ("call", "error", "pattern"),
    [
        pytest.param(
            lambda: state_dict(other_model(), MLP_PARAMS),
            ValueError,
            r"missing \['conv.weight', 'conv.bias'\], unexpected \['0.bias', '0.weight', '1.bias', '1.weight', "
            r"'3.bias', '3.weight'\].*params of another model",
            id="another-model",
        ),
        pytest.param(
            lambda: state_dict(mlp(0), {k: v for k, v in MLP_PARAMS.items() if k != "1.bias"}),
            ValueError,
            r"missing \['1.bias'\], unexpected \[\]",
            id="missing",
        ),
        pytest.param(
            lambda: state_dict(mlp(0), {**MLP_PARAMS, "4.weight": torch.ones(1)}),
            ValueError,
            r"missing \[\], unexpected \['4.weight'\]",
            id="extra",
        ),
        pytest.param(
            lambda: state_dict(mlp(0), {**MLP_PARAMS, "3.weight": torch.ones(3, 9)}),
            ValueError,
            r"params\['3.weight'\] has shape \(3, 9\), the module's tensor \(3, 8\)",
            id="shape",
        ),
        pytest.param(
            lambda: state_dict(mlp(0), {**MLP_PARAMS, "3.bias": [0.0, 0.0, 0.0]}),
            TypeError,
            r"params\['3.bias'\] must be a tensor, got list",
            id="not-a-tensor",
        ),
        pytest.param(
            lambda: state_dict(mlp(0), list(MLP_PARAMS.values())),
            TypeError,
            r"params must be a dict of tensors by name",
            id="params-not-a-dict",
        ),
        pytest.param(
            lambda: state_dict(mlp(0), MLP_PARAMS, frozen={"3.bias": MLP_PARAMS["3.bias"]}),
            ValueError,
            r"'3.bias' is in both params and frozen",
            id="in-two",
        ),
        pytest.param(
            lambda: state_dict(BN, BN_PARAMS, {**BN_BUFFERS, "1.num_batches_tracked": torch.tensor(1.0)}),
            TypeError,
            r"buffers\['1.num_batches_tracked'\] is torch.float32, the module's tensor torch.int64",
            id="float-for-int",
        ),
        pytest.param(
            lambda: state_dict(BN, BN_PARAMS, {**BN_BUFFERS, "1.running_var": torch.ones(3, dtype=torch.int64)}),
            TypeError,
            r"buffers\['1.running_var'\] is torch.int64, the module's tensor torch.float32",
            id="int-for-float",
        ),
        pytest.param(
            lambda: state_dict(mlp(0), {**MLP_PARAMS, "0.weight": quant.quantize_int8(torch.ones(8, 4))}),
            TypeError,
            r"params\['0.weight'\] must be a tensor, got Int8Weight",
            id="int8-in-params",
        ),
        pytest.param(
            lambda: state_dict(MLP_PARAMS, MLP_PARAMS),
            TypeError,
            r"expected a torch.nn.Module, got dict",
            id="not-a-module",
        ),
        pytest.param(
            lambda: load_into(mlp(0).to("meta"), MLP_PARAMS),
            ValueError,
            r"\['0.weight', .*\] of the module are on the meta device",
            id="meta-load_into",
        ),
    ],
)
def test_bad_input(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_refused_load_leaves_the_module_unchanged():
    model = mlp(0)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="shape"):
        load_into(model, {**bumped(MLP_PARAMS), "3.weight": torch.ones(3, 9)})
    assert_module_holds(model, before)


def test_meta_module_state_dict_keeps_the_values_for_assign():
    model = mlp(0).to("meta")
    sd = state_dict(model, MLP_PARAMS)
    assert all(v.device.type == "cpu" for v in sd.values())
    model.load_state_dict(sd, strict=True, assign=True)
    assert_module_holds(model, MLP_PARAMS)


def test_hf_gpt2_example_saves_the_trained_model(tmp_path, capsys):
    """examples/hf_gpt2.py --save DIR: trained tensors in, the frozen ones exactly the base model's."""
    pytest.importorskip("transformers")
    import importlib.util
    import pathlib

    from transformers import GPT2LMHeadModel

    path = pathlib.Path(__file__).parents[1] / "examples" / "hf_gpt2.py"
    spec = importlib.util.spec_from_file_location("hf_gpt2_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = ["--tiny", "--steps", "1", "--seq-len", "16", "--trainable", "lm_head", "--save", str(tmp_path)]
    example.main(args)
    assert f"saved to {tmp_path}" in capsys.readouterr().out
    torch.manual_seed(0)
    base = example.build_gpt2(True, "sdpa").state_dict()
    saved = GPT2LMHeadModel.from_pretrained(tmp_path).state_dict()
    assert saved.keys() == base.keys()
    for k, v in saved.items():
        trained = k in ("transformer.wte.weight", "lm_head.weight")  # trainable="lm_head": the tied table
        assert v.dtype == base[k].dtype and torch.equal(v, base[k]) != trained, k
