"""``functionalize(..., autocast=True)`` is ``torch.autocast`` on the module, bitwise (issue 26 item 8).

The oracle is the reference library itself: the same module, the same inputs, run under
``torch.autocast("cpu", dtype)`` and differentiated with autograd. Before the fix funcamp's own
defaults ran under autocast too: the embedding default (``float32_lookup``) handed its rows on in the
compute dtype, so GPT-2's residual stream was added in float16 where torch.autocast adds it in
float32 (float16 logits 5.5e-4 off, bfloat16 3.9e-3, equal to the casting mode's); the norm default
ran LayerNorm and BatchNorm on a float32 copy of their inputs (a Sequential's LayerNorm gradients
3.8e-4 of their largest element off in float16); ``FLOAT32_ACCUMULATION`` ran softmax, cumsum, gathers
and the other families in float32 on half inputs. The rules stay in the casting mode and can be
asked for under autocast.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import funcamp as fa
from funcamp import optim
from funcamp.nn import functionalize

transformers = pytest.importorskip("transformers")

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
NAMES = {F16: "float16", BF16: "bfloat16"}


def _policy(dtype: torch.dtype) -> str:
    return f"params=float32,compute={NAMES[dtype]},output=float32"


def gpt2(attn: str = "sdpa") -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    config._attn_implementation = attn
    model = transformers.GPT2LMHeadModel(config).eval()
    assert model.config._attn_implementation == attn
    return model


class LSTMHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (the name nn.Sequential uses)
        return self.head(self.lstm(input)[0])


class SoftmaxMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.softmax(self.a(x), dim=-1))


def _families():
    """``name -> (make module, make inputs, output -> tensor)``: a tiny model of each family."""
    ids = lambda: {"input_ids": torch.randint(0, 256, (2, 16))}  # noqa: E731
    logits = lambda out: out.logits  # noqa: E731
    same = lambda out: out  # noqa: E731
    return {
        "mlp-layernorm": (
            lambda: nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4)),
            lambda: {"input": torch.randn(5, 8)},
            same,
        ),
        "gpt2-sdpa": (gpt2, ids, logits),
        "gpt2-eager-attention": (lambda: gpt2("eager"), ids, logits),
        "convnet-batchnorm-train": (
            lambda: nn.Sequential(
                nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)
            ).train(),
            lambda: {"input": torch.randn(4, 3, 8, 8)},
            same,
        ),
        "lstm": (LSTMHead, lambda: {"input": torch.randn(2, 5, 8)}, same),
    }


FAMILIES = _families()


def _torch_autocast(model: nn.Module, kwargs: dict, pick, dtype: torch.dtype):
    """The oracle: torch.autocast on (a copy of) the module, autograd into ``.grad``."""
    model = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=dtype):
        out = pick(model(**kwargs))
    out.float().square().mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return out, grads, dict(model.named_buffers())


def _funcamp(model: nn.Module, kwargs: dict, pick, dtype: torch.dtype, how: str):
    """``apply_fn`` under ``autocast=True``, differentiated with autograd or ``torch.func.grad``."""
    result = functionalize(model, _policy(dtype), autocast=True, with_buffers=True)
    apply_fn, params, buffers = result
    new_buffers = {}

    def loss(p):
        out, new = apply_fn(p, buffers, **kwargs)
        new_buffers.update(new)
        return pick(out).square().mean(), pick(out)

    if how == "autograd":
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        value, out = loss(leaves)
        value.backward()
        grads = {k: v.grad for k, v in leaves.items()}
    else:
        grads, (value, out) = torch.func.grad_and_value(loss, has_aux=True)(params)
    return out.detach(), grads, new_buffers


def _cases():
    for name in FAMILIES:
        for dtype in (F16, BF16):
            yield pytest.param(name, dtype, "autograd", id=f"{name}-{NAMES[dtype]}-autograd")
            if name != "lstm":  # torch itself: torch.func.grad of a CPU LSTM differs from autograd (4.9e-4 in bf16)
                yield pytest.param(name, dtype, "torch.func", id=f"{name}-{NAMES[dtype]}-torch.func")


@pytest.mark.parametrize(("family", "dtype", "how"), list(_cases()))
def test_sweep_outputs_gradients_and_buffers_equal_torch_autocast(family, dtype, how):
    """Sweep: 5 families x float16/bfloat16 x autograd/torch.func: outputs, every gradient and the new
    buffers (BatchNorm statistics) bitwise those of torch.autocast on the module. Where torch.autocast
    itself cannot run (no oneDNN float16 LSTM primitive on CPUs without it) funcamp raises the same
    error. Old code: 16 of 18 cases failed, all but LSTM's (no norm, no embedding): GPT-2's logits 5.5e-4
    (float16) and 3.9e-3 (bfloat16) off, its gradients up to 5.3e-3 and 1.0e-2 of their largest element;
    the Sequential's LayerNorm gradients 3.8e-4 and 4.2e-3; the BatchNorm weight's 8.5e-8 and 4.2e-8.
    Now all 0."""
    make, inputs, pick = FAMILIES[family]
    torch.manual_seed(0)
    model = make()
    kwargs = inputs()
    try:
        ref_out, ref_grads, ref_buffers = _torch_autocast(model, kwargs, pick, dtype)
    except RuntimeError as e:  # e.g. "could not create a primitive descriptor for the LSTM forward ..."
        with pytest.raises(RuntimeError, match=re.escape(str(e)[:40])):
            _funcamp(model, kwargs, pick, dtype, how)
        return
    out, grads, buffers = _funcamp(model, kwargs, pick, dtype, how)
    assert out.dtype == F32 and ref_out.dtype == dtype  # the policy's output dtype: an exact upcast
    assert torch.equal(out, ref_out.float()), (out - ref_out.float()).abs().max()
    assert grads.keys() == {k for k, g in ref_grads.items() if g is not None}
    for k, g in grads.items():
        assert g.dtype == ref_grads[k].dtype and torch.equal(g, ref_grads[k]), (k, (g - ref_grads[k]).abs().max())
    for k, b in buffers.items():
        assert torch.equal(b, ref_buffers[k]), k


def test_gpt2_float16_logits_fault():
    """The fault as filed: GPT-2 in float16 under autocast=True gave the casting mode's logits, 5.5e-4
    (max abs) off torch.autocast's. Now bitwise torch.autocast's; the casting mode still differs (it keeps
    the residual stream in float16, jmp's rule), so this comparison can tell the two apart."""
    torch.manual_seed(0)
    model = gpt2()
    ids = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=F16):
        ref = model(input_ids=ids).logits.float()
    auto_fn, params = functionalize(model, _policy(F16), autocast=True)
    cast_fn, cast_params = functionalize(model, _policy(F16))
    assert torch.equal(auto_fn(params, input_ids=ids).logits, ref)
    assert (cast_fn(cast_params, input_ids=ids).logits - ref).abs().max() > 1e-4


def test_gpt2_float16_scale_trajectory_equals_grad_scaler():
    """100 float16 steps of GPT-2 from a loss scale of 2**24, growth every 20 finite steps: funcamp's
    step (autocast=True, DynamicLossScale with GradScaler's options, SGD) against torch.autocast +
    torch.amp.GradScaler(init_scale=2**24, growth_interval=20) + torch.optim.SGD on the same batches.
    The scale and the overflow flag agree at every step, and so do the parameters, bitwise (a learning
    rate of 2**-3 makes ``lr * g`` exact, so torch's fused ``p.add_(g, alpha=-lr)`` and funcamp's
    ``p + (-lr * g)`` round alike). Old code: the parameters differed from the first applied update
    (step 7, 7.9e-5)."""
    torch.manual_seed(0)
    model = gpt2()
    ref = copy.deepcopy(model)
    lr = 2.0**-3
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (2, 17), generator=gen) for _ in range(100)]

    apply_fn, params = functionalize(model, _policy(F16), autocast=True)

    def loss_fn(p, ids):
        logits = apply_fn(p, input_ids=ids[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    opt = optim.sgd(lr)
    scale = fa.DynamicLossScale(2.0**24, period=20, growth_factor=2.0, backoff_factor=0.5, min_loss_scale=2.0**-126)
    state = fa.TrainState.create(params, opt, loss_scale=scale)
    step = fa.make_train_step(loss_fn, opt, compile=False)
    torch_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=20)
    ours, theirs = [], []
    for i, ids in enumerate(batches):
        state, metrics = step(state, ids)
        ours.append((float(metrics["loss_scale"]), bool(metrics["grads_finite"])))
        with torch.autocast("cpu", dtype=F16):
            logits = ref(input_ids=ids[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        torch_opt.zero_grad()
        before = float(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.step(torch_opt)
        scaler.update()
        theirs.append((before, float(scaler.get_scale()) >= before))  # backs off exactly on overflow
        assert ours[-1] == theirs[-1], (i, ours[-1], theirs[-1])
        for name, p in ref.named_parameters():
            if name in state.params:
                assert torch.equal(state.params[name], p.detach()), (i, name)
    overflows = [i for i, (_, finite) in enumerate(ours) if not finite]
    scales = sorted({int(math.log2(s)) for s, _ in ours})
    assert len(overflows) >= 8 and len(scales) >= 5  # it backed off from 2**24 and grew again


class SoftmaxDtypes(TorchDispatchMode):
    """The input dtypes of the aten softmax ops that run (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "softmax" in func.__name__:
            self.seen.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_default_accumulation_rules_can_be_asked_for_under_autocast():
    """What funcamp no longer adds under autocast can be asked for: with
    ``op_policies=FLOAT32_ACCUMULATION`` a softmax between two Linears runs in float32, forward and
    backward (and the gradients change); without it in float16, as under torch.autocast on CPU, where
    softmax is on neither list."""
    torch.manual_seed(0)
    model = SoftmaxMLP()
    x = torch.randn(5, 8)
    plain, params = functionalize(model, _policy(F16), autocast=True)
    ruled, _ = functionalize(model, _policy(F16), autocast=True, op_policies=fa.ops.FLOAT32_ACCUMULATION)
    grads = []
    for fn, dtype in ((plain, F16), (ruled, F32)):
        with SoftmaxDtypes() as rec:
            grads.append(torch.func.grad(lambda p, fn=fn: fn(p, x).square().sum())(params))
        assert rec.seen == {dtype}
    assert not torch.equal(grads[0]["a.weight"], grads[1]["a.weight"])  # the softmax backward's rounding


@pytest.mark.parametrize("family", ["mlp-layernorm", "convnet-batchnorm-train"])
def test_compiled_gradients_equal_torch_autocast(family):
    """The compiled path (fullgraph, aot_eager): the same bitwise equality, for a norm of each kind."""
    make, inputs, pick = FAMILIES[family]
    torch.manual_seed(0)
    model = make()
    kwargs = inputs()
    ref_out, ref_grads, ref_buffers = _torch_autocast(model, kwargs, pick, F16)
    apply_fn, params, buffers = functionalize(model, _policy(F16), autocast=True, with_buffers=True)

    def loss(p, b):
        out, new = apply_fn(p, b, **kwargs)
        return out.square().mean(), (out, new)

    torch._dynamo.reset()
    compiled = torch.compile(torch.func.grad_and_value(loss, has_aux=True), fullgraph=True, backend="aot_eager")
    grads, (_, (out, new)) = compiled(params, buffers)
    assert torch.equal(out, ref_out.float())
    for k, g in grads.items():
        assert torch.equal(g, ref_grads[k]), k
    for k, b in new.items():
        assert torch.equal(b, ref_buffers[k]), k


# --- Hugging Face Llama (issue 33 item 9) --------------------------------------------------------------


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config)


LLAMA_IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def _llama_loss(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), LLAMA_IDS[:, 1:].flatten())


def test_llama_equals_torch_autocast_per_route():
    """A tiny LlamaForCausalLM (RMSNorm's float32 upcast, rotary embeddings, SDPA with grouped KV heads, SiLU,
    the loss) under bfloat16: loss and every gradient bitwise those of torch.autocast on the module, when both
    are differentiated the same way (autograd, or torch.func.grad). The two routes differ from each other, in
    torch itself, on SiLU alone: torch.func differentiates it as ``x * sigmoid(x)`` in bfloat16 steps, autograd
    with the ``silu_backward`` kernel (float32 inside); docs/module.md gives the sizes
    (benchmarks/autocast_llama.py: 2.6e-3 in loss after 20 AdamW steps at lr 3e-3, 0 between funcamp and
    torch.autocast on each route). Planted: the norm default (``keep_in_float32``) applied under autocast too:
    the gradients differ (RMSNorm then hands its output on in float32)."""
    model = _llama()
    apply_fn, params = functionalize(model, _policy(BF16), autocast=True)

    def reference(p):
        with torch.autocast("cpu", dtype=BF16):
            return _llama_loss(torch.func.functional_call(model, p, (), {"input_ids": LLAMA_IDS}).logits)

    def funcamp(p):
        return _llama_loss(apply_fn(p, input_ids=LLAMA_IDS).logits)

    def autograd(loss_fn):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        loss = loss_fn(leaves)
        loss.backward()
        return {k: v.grad for k, v in leaves.items()}, loss.detach()

    routes = {
        "autograd": (autograd(funcamp), autograd(reference)),
        "torch.func": (torch.func.grad_and_value(funcamp)(params), torch.func.grad_and_value(reference)(params)),
    }
    for route, ((grads, loss), (ref_grads, ref_loss)) in routes.items():
        assert torch.equal(loss, ref_loss), (route, loss, ref_loss)
        for k in ref_grads:
            assert torch.equal(grads[k], ref_grads[k]), (route, k, (grads[k] - ref_grads[k]).abs().max())
    by_autograd, by_func = routes["autograd"][1][0], routes["torch.func"][1][0]
    differ = sorted(k for k in by_autograd if not torch.equal(by_autograd[k], by_func[k]))
    assert "model.layers.0.mlp.gate_proj.weight" in differ  # torch's own: the routes differ at SiLU's backward
    for k in ("lm_head.weight", "model.norm.weight", "model.layers.0.mlp.down_proj.weight"):
        assert k not in differ  # what the backward reaches before SiLU is bitwise on both routes


def test_silu_backward_routes_differ_in_torch():
    """The one op behind the routes' difference on Llama: SiLU's gradient in bfloat16, autograd's
    ``silu_backward`` kernel against torch.func's bfloat16 steps (measured 7.4e-3 of the largest element)."""
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)).to(BF16)
    g = torch.randn(256, 256, generator=torch.Generator().manual_seed(1)).to(BF16)
    leaf = x.clone().requires_grad_()
    F.silu(leaf).backward(g)
    by_func = torch.func.grad(lambda t: (F.silu(t) * g).sum())(x)
    sig = torch.sigmoid(x)
    assert torch.equal(leaf.grad, torch.ops.aten.silu_backward(g, x))
    assert torch.equal(by_func, g * sig * (1 + x * (1 - sig)))  # bfloat16 steps
    rel = ((by_func.float() - leaf.grad.float()).abs().max() / leaf.grad.float().abs().max()).item()
    assert 0 < rel < 2e-2
