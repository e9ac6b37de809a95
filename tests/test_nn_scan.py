"""functionalize(..., scan=...): a run of identical blocks compiled as one scan over stacked layers.

The compiled step (aot_eager) with ``scan="blocks"`` against the eager step without it: parameters after two
SGD steps bitwise equal, the compiled graph holds a scan (and none without ``scan=``), names per layer; every
refusal names the run.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import funcamp as fa
from funcamp import optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

POLICY = "params=float32,compute=bfloat16,output=float32"
CFG = GPTConfig(block_size=16, n_layer=3, n_head=2, n_embd=16)


def _recording(seen):
    def backend(gm, example_inputs):
        seen.append(any("scan" in str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    return backend


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)


def _train(model, scan, compile, seen=None, steps=2, op_policies=None):
    apply_fn, params = fa.nn.functionalize(model, POLICY, scan=scan, op_policies=op_policies)

    def loss_fn(p, batch):
        x, y = batch
        return nn.functional.cross_entropy(apply_fn(p, x).flatten(0, 1), y.flatten())

    opt = optim.sgd(0.5)
    state = fa.TrainState.create(params, opt)
    backend = _recording(seen) if compile else None
    step = fa.make_train_step(loss_fn, opt, compile=compile, backend=backend)
    for _ in range(steps):
        state, metrics = step(state, _batch())
    return state, metrics


@pytest.fixture(scope="module")
def runs():
    torch.manual_seed(0)
    model = GPT(CFG)
    seen_scan = []
    return {"eager": _train(model, None, False), "scan": _train(model, "blocks", True, seen_scan), "seen": seen_scan}


def test_scanned_step_bitwise_equal_to_eager_unrolled(runs):
    (eager, m_eager), (scanned, m_scan) = runs["eager"], runs["scan"]
    assert list(scanned.params) == list(eager.params)  # names per layer, in the same order
    assert "blocks.2.attn.qkv.weight" in scanned.params
    for name, p in eager.params.items():
        assert torch.equal(scanned.params[name], p), name
    assert torch.equal(m_scan["loss"], m_eager["loss"])


class _Softmaxing(nn.Module):
    """A block whose softmax falls under funcamp's default float32 rule (``funcamp.ops.FLOAT32_ACCUMULATION``)."""

    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.softmax(self.lin(x), dim=-1)


class _Head(nn.Module):
    def __init__(self, n=3, d=16):
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.blocks = nn.ModuleList(_Softmaxing(d) for _ in range(n))
        self.out = nn.Linear(d, 256)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


@pytest.mark.parametrize(
    ("make", "op_policies"),
    [
        (lambda: GPT(CFG), {"scaled_dot_product_attention": torch.float32}),  # a rule of the user's
        (_Head, None),  # the default rules: softmax in float32
    ],
    ids=["user-rule", "default-rule"],
)
def test_op_rules_hold_inside_the_scanned_body(make, op_policies):
    """The forward's per-op precision applies inside the scan as in the layers unrolled: the compiled scanned step
    equals the eager unrolled one bit for bit, and the rules change the result (so that the comparison can fail).
    Before, Dynamo traced the scan's body without the mode entered around the forward: the compiled scanned step
    computed attention (and the default rules' softmax) in bfloat16, silently. (Planted: the body without the
    mode: fails.)"""
    torch.manual_seed(0)
    model = make()
    eager, m_eager = _train(model, None, False, op_policies=op_policies)
    scanned, m_scan = _train(model, "blocks", True, [], op_policies=op_policies)
    for name, p in eager.params.items():
        assert torch.equal(scanned.params[name], p), name
    assert torch.equal(m_scan["loss"], m_eager["loss"])
    # without the rule (the user's left out; the default softmax rule removed): other numbers
    other, _ = _train(model, None, False, op_policies=None if op_policies is not None else {"softmax": None})
    assert any(not torch.equal(other.params[n], p) for n, p in eager.params.items())


class _CheckpointedHead(_Head):
    """``_Head`` whose blocks the model's own code checkpoints (``torch.utils.checkpoint``, as Hugging Face's
    ``gradient_checkpointing_enable()`` does)."""

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False)
        return self.out(h)


def test_op_rules_hold_inside_a_checkpoint_the_model_calls():
    """The same kind as the scan's fault: under torch.compile a ``torch.utils.checkpoint`` call in the model is
    Dynamo's checkpoint operator, whose body Dynamo traces without the forward's per-op mode; the compiled step
    computed the block's softmax in bfloat16 where the eager step computes it in float32. Now the submodules of a
    module whose forward names a checkpoint enter the mode where they find none: compiled equals eager, bitwise,
    and the default rule changes the numbers (so that the comparison can fail). (Planted: no such wrapper, the
    code before: fails, as its strict xfail recorded.)"""
    torch.manual_seed(0)
    model = _CheckpointedHead()
    eager, _ = _train(model, None, False)
    compiled, _ = _train(model, None, True, [])
    for name, p in eager.params.items():
        assert torch.equal(compiled.params[name], p), name
    other, _ = _train(model, None, False, op_policies={"softmax": None})
    assert any(not torch.equal(other.params[n], p) for n, p in eager.params.items())


def test_the_checkpoint_wrapper_spares_modules_that_say_they_do_not_checkpoint():
    """Hugging Face's models name ``gradient_checkpointing`` in their forward whether it is on or not; a module whose
    ``gradient_checkpointing`` is False gets no wrapper on its submodules (their forwards stay as they were: 3.6% of
    the traced bytecode on transformers' GPT-2), one whose flag is True or absent does."""
    from funcamp import ops
    from funcamp.nn import _wrappers

    mode = functools.partial(ops.OpPolicies, ops.checked_rules(ops.FLOAT32_ACCUMULATION))
    for flag, wrapped in ((False, False), (True, True), (None, True)):
        model = _CheckpointedHead()
        if flag is not None:
            model.gradient_checkpointing = flag
        before = {name: m.forward for name, m in model.named_modules() if name}
        _wrappers._modes_in_checkpoints(model, mode)
        after = {name: m.forward for name, m in model.named_modules() if name}
        assert all((after[n] != before[n]) == wrapped for n in before), (flag, wrapped)


def test_graph_holds_a_scan_only_when_asked(runs):
    assert runs["seen"] and all(runs["seen"])
    net = _Net([_Res(), _Res()])
    for scan, expected in ((None, False), ("blocks", True)):
        apply_fn, params = fa.nn.functionalize(net, POLICY, scan=scan)
        seen = []
        torch.compile(apply_fn, fullgraph=True, backend=_recording(seen))(params, torch.randn(2, 8))
        assert seen == [expected]


def test_eager_apply_fn_runs_the_layers_as_written():
    torch.manual_seed(0)
    model = GPT(CFG)
    x = _batch()[0]
    plain, params = fa.nn.functionalize(model, POLICY)
    scanned, _ = fa.nn.functionalize(model, POLICY, scan="blocks")
    assert torch.equal(scanned(params, x), plain(params, x))


class _Res(nn.Module):
    def __init__(self, d=8, out=None):
        super().__init__()
        self.lin = nn.Linear(d, out or d)
        self.norm = nn.LayerNorm(out or d)

    def forward(self, x):
        return x + torch.tanh(self.norm(self.lin(x)))


def test_sequential_compiled_gradients_bitwise():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(*[_Res() for _ in range(4)]))
    x = torch.randn(3, 8)
    apply_fn, params = fa.nn.functionalize(model, POLICY, scan="1")

    def grads(p, x):
        ps = {k: v.detach().requires_grad_() for k, v in p.items()}
        with torch.enable_grad():
            loss = apply_fn(ps, x).float().square().sum()
        return torch.autograd.grad(loss, list(ps.values()))

    seen = []
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = torch.compile(grads, fullgraph=True, backend=_recording(seen))(params, x)
    eager = grads(params, x)
    assert all(seen)
    for c, e in zip(compiled, eager, strict=True):
        assert torch.equal(c, e)


class _Net(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize(
    "make, kwargs, message",
    [
        (lambda: _Net([_Res(), _Res(8, 4)]), {}, "differs from blocks.0"),
        (lambda: _Net([_Res(), nn.Linear(8, 8)]), {}, "differs from blocks.0"),
        (lambda: _Net([_Res(), _Res()]), {"module_policies": {"blocks.1": "float32"}}, "differs from blocks.0"),
        (lambda: _Net([_Res(), _Res()]), {"remat": "blocks.1"}, "remat="),
        (lambda: _Net([_Res(), _Res()]), {"trainable": "blocks.1.*"}, "frozen"),
        (lambda: _Net([_Res()]), {}, "two or more"),
        (lambda: _Net([_Res(), _Res()]), {"autocast": True}, "autocast"),
    ],
    ids=["shape", "class", "policy", "remat", "frozen", "one-layer", "autocast"],
)
def test_refusals_name_the_run(make, kwargs, message):
    with pytest.raises(ValueError, match=rf"scan='blocks'.*{message}"):
        fa.nn.functionalize(make(), POLICY, scan="blocks", **kwargs)


def test_refuses_differing_attributes_and_hooks():
    net = _Net([_Res(), _Res()])
    net.blocks[1].scale = 2.0
    net.blocks[0].scale = 1.0
    differs = r"differs from blocks.0 in module \(the layer itself\)'s attribute scale: 2.0 vs 1.0"
    with pytest.raises(ValueError, match=differs):
        fa.nn.functionalize(net, POLICY, scan="blocks")
    net = _Net([_Res(), _Res()])
    net.blocks[1].lin.register_forward_hook(lambda m, i, o: o)
    with pytest.raises(ValueError, match=r"blocks.1.lin has hooks"):
        fa.nn.functionalize(net, POLICY, scan="blocks")


def test_refuses_fp8_and_int8():
    net = _Net([nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)) for _ in range(2)])
    with pytest.raises(ValueError, match="fp8 layer"):
        fa.nn.functionalize(net, POLICY + ",fp8=tensorwise", scan="blocks")
    with pytest.raises(ValueError, match=r"int8"):
        fa.nn.functionalize(net, POLICY, scan="blocks", trainable="*.2.*", quantize=fa.quant.Int8WeightOnlyConfig())


def test_bad_scan_arguments():
    with pytest.raises(ValueError, match="matches no submodule"):
        fa.nn.functionalize(_Net([_Res(), _Res()]), POLICY, scan="layers")
    with pytest.raises(TypeError, match="ModuleList or Sequential"):
        fa.nn.functionalize(_Net([_Res(), _Res()]), POLICY, scan="blocks.0")
    with pytest.raises(TypeError, match="scan must be None"):
        fa.nn.functionalize(_Net([_Res(), _Res()]), POLICY, scan=3)


class _Drop(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(64))

    def forward(self, x):
        return x + nn.functional.dropout(self.w.expand_as(x), 0.5, self.training)


def test_dropout_masks_differ_per_layer_and_backward_uses_the_forwards():
    """out[b, j] = sum over layers of 2 * mask_l[b, j], and d sum(out) / d w_l[j] = sum over b of 2 * mask_l[b, j]:
    the batch sum of the output equals the sum of the layers' gradients only if each layer's backward uses the
    mask its forward drew; equal masks in every layer would make every output a multiple of 2 * 4."""
    apply_fn, params = fa.nn.functionalize(_Net([_Drop() for _ in range(4)]), "float32", scan="blocks", training=True)

    def grads(p, x):
        ps = {k: v.detach().requires_grad_() for k, v in p.items()}
        with torch.enable_grad():
            out = apply_fn(ps, x)
        return out.detach(), torch.autograd.grad(out.sum(), list(ps.values()))

    seen = []
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        out, g = torch.compile(grads, fullgraph=True, backend=_recording(seen))(params, torch.zeros(16, 64))
    assert all(seen)
    assert torch.equal(out.sum(0), sum(g))
    assert {2.0, 4.0, 6.0} & set(out.flatten().tolist())


def test_way_back_per_layer(runs):
    scanned, _ = runs["scan"]
    model = GPT(CFG)
    fa.nn.load_into(model, scanned.params)
    assert torch.equal(model.blocks[2].mlp.fc.weight, scanned.params["blocks.2.mlp.fc.weight"])


class _Sliced(nn.Module):
    """Runs over slices of one list, as Hugging Face's Llama loop (``self.layers[: config.num_hidden_layers]``)."""

    SLICES = (slice(1, None), slice(None, None, 2), slice(3, None))

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Res() for _ in range(3))

    def forward(self, x):
        for part in self.SLICES:
            for b in self.blocks[part]:
                x = b(x)
        return x


def test_a_slice_scans_exactly_the_sliced_layers():
    """Sweep: a run over each slice of :class:`_Sliced` (from the second layer on, every other one, an empty one)
    compiled with the scan: one scan per non-empty slice, each over its own layers (gradients bitwise the eager
    unrolled loop's, so a slice that ran the whole run, or the first layers of the run, shows). Two scans: each
    costs a compile of its own. The old code raised an AttributeError (the slice, a new list, had no scan)."""
    model = _Sliced()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    apply_fn, params = fa.nn.functionalize(model, POLICY, scan="blocks")

    def grads(p, x):
        ps = {k: v.detach().requires_grad_() for k, v in p.items()}
        with torch.enable_grad():
            loss = apply_fn(ps, x).float().square().sum()
        return torch.autograd.grad(loss, list(ps.values()))

    scans = []

    def backend(gm, example_inputs):
        scans.append(sum("scan" in str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = torch.compile(grads, fullgraph=True, backend=backend)(params, x)
    assert scans == [2]
    for name, c, e in zip(params, compiled, grads(params, x), strict=True):
        assert torch.equal(c, e), name


class _WithTable(nn.Module):
    """A block whose non-persistent buffer (a per-layer constant) scales its residual branch."""

    def __init__(self, table):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("table", table, persistent=False)

    def forward(self, x):
        return x + torch.tanh(self.lin(x)) * self.table


TABLES = {
    "a layer index": lambda i: torch.tensor(float(i)),
    "a rotary table per layer": lambda i: torch.cos(torch.arange(8.0) / 10.0 ** (i + 1)),
    "one value in the last element": lambda i: torch.cat([torch.ones(7), torch.tensor([1.0 + (i == 2)])]),
}


@pytest.mark.parametrize("name", list(TABLES))
def test_refuses_non_persistent_buffers_that_differ_in_value(name):
    """Sweep: blocks whose non-persistent buffers have one shape and dtype but other values (a layer index, a
    per-layer rotary table, one element of the last layer's) are refused, naming the buffer: the scan would run
    the first layer's buffer for every layer. Equal values in tensors of their own are accepted."""
    with pytest.raises(ValueError, match=r"scan='blocks'.*the buffer blocks\.\d\.table differs from blocks\.0\.table"):
        fa.nn.functionalize(_Net([_WithTable(TABLES[name](i)) for i in range(3)]), POLICY, scan="blocks")
    fa.nn.functionalize(_Net([_WithTable(TABLES[name](0).clone()) for _ in range(3)]), POLICY, scan="blocks")


class _Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Res(), _Res()])
        self.blocks_out = nn.Linear(8, 8)  # a sibling whose name starts with the run's

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.blocks_out(x)


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _Body()
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.mark.parametrize(
    "remat, refused",
    [("body", True), ("body.blocks.1", True), ("body.blocks.*", True), ("body.blocks_out", False), ("head", False)],
)
def test_remat_on_or_around_the_run_is_refused_and_beside_it_accepted(remat, refused):
    """Sweep: ``scan="body.blocks"`` with ``remat=`` on the module around the run, a layer inside it, every layer;
    refused, naming the run. A sibling whose name starts with the run's (``body.blocks_out``) and a module outside
    are accepted (the rule matches whole name components)."""
    if refused:
        with pytest.raises(ValueError, match=r"scan='body\.blocks'.*remat= checkpoints .*on or around the run"):
            fa.nn.functionalize(_Outer(), POLICY, scan="body.blocks", remat=remat)
    else:
        apply_fn, _ = fa.nn.functionalize(_Outer(), POLICY, scan="body.blocks", remat=remat)
        assert apply_fn.remat == (remat,)
